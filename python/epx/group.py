"""epx.Group: EPX's native API for PyTorch, one thin wrapper per C call.

Each call checks its tensors (_checks.py, usable without a GPU), fills the ctypes args, calls
libepx on torch.cuda.current_stream() (or stream=) and maps a failed status to an EpxError.
Outputs of dispatch and ll_dispatch are views of EPX's workspace and handles (no copies):
valid until the next dispatch on the group (low-latency: the dispatch after next).

Lifetime: call destroy() on every rank (or use `with epx.Group(...) as g:`). destroy() is
collective. A group that is garbage-collected is destroyed then too (also collective, so every
rank must drop it alike), but never at interpreter exit: a process that exits without destroy()
leaves the cleanup to the driver (_resources.py). torch is imported lazily.

The package's other modules hold the rest of what this module exports (every name stays
importable from here): _config.py (make_config, config_dict, workspace_size), _checks.py (Dims,
check_*), _results.py (Layout, DispatchResult, LLDispatchResult, Hook), _resources.py (Handle
and the native lifetime).
"""
import ctypes
import functools
import os

from . import _capi, _nccl, _tensors, errors
from ._capi import lib
from ._checks import (Dims, _scale_strides, check_cached_args, check_combine_args,  # noqa: F401
                      check_combine_expand_args,
                      check_dispatch_args, check_layout_args, check_ll_combine_args,
                      check_ll_dispatch_args, check_scales)
from ._config import (DTYPE_NAMES, LL_ROUTE_NAMES, MODE_NAMES, config_dict,  # noqa: F401
                      make_config, workspace_size)
from ._resources import Handle, _GroupResources, borrowed_comm_gone
from ._results import DispatchResult, ExpandResult, Hook, Layout, LLDispatchResult
from ._tensors import _torch, data_ptr, invalid_argument
from ._tensors import stream_ptr as _stream_ptr


def _process_group_alive(dist, pg):
    """Whether pg is still one of torch.distributed's process groups (destroy_process_group
    removes it, and destroys its communicator with it). torch shuts the group down before it
    removes it from the map, so a garbage collection inside destroy_process_group itself could
    still see it alive; calls made by the application after it returns cannot."""
    if not dist.is_initialized():
        return False
    pg_map = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    return True if pg_map is None else pg in pg_map  # a torch without the map: not known


def _borrowed_comm(dist, torch, group):
    """The ncclComm_t of a ProcessGroupNCCL (torch's private _comm_ptr), and a callable that
    says whether that process group (so the communicator) still exists."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        backend = pg._get_backend(torch.device("cuda"))
    except Exception as e:  # noqa: BLE001 (torch raises RuntimeError or AttributeError)
        raise errors.EpxInvalidArgument(
            errors.EPX_ERR_INVALID_ARGUMENT,
            "Group(borrow_nccl_comm=True): the process group has no CUDA (NCCL) backend (%s); "
            "use borrow_nccl_comm=False, EPX then creates its own communicator" % e) from e
    if not hasattr(backend, "_comm_ptr"):
        raise errors.EpxUnsupported(
            errors.EPX_ERR_UNSUPPORTED,
            "Group(borrow_nccl_comm=True): %s has no _comm_ptr() in this torch; use "
            "borrow_nccl_comm=False" % type(backend).__name__)
    # ProcessGroupNCCL creates its communicator at its first collective: make sure there was one.
    dist.all_reduce(torch.zeros(1, device="cuda"), group=group)
    torch.cuda.synchronize()
    comm = backend._comm_ptr()
    if not comm:
        raise errors.EpxNcclError(errors.EPX_ERR_NCCL,
                                  "Group(borrow_nccl_comm=True): _comm_ptr() returned NULL")
    return comm, functools.partial(_process_group_alive, dist, pg)


class Group:
    """An EPX group over a torch.distributed process group (see the module doc and
    docs/python.md). Collective: every rank constructs it with the same arguments."""

    def __init__(self, max_tokens_per_rank, hidden, num_experts, top_k, *, group=None,
                 borrow_nccl_comm=False, modes=("normal",), ll_max_tokens_per_rank=0, num_sms=0,
                 ll_num_sms=0, ll_route=0, timeout_ms=0, dtypes=0, expand_max_rows=0,
                 expand_fan_out=0):
        torch = _torch()
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise errors.EpxInvalidUsage(
                errors.EPX_ERR_INVALID_USAGE,
                "Group: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group first (any backend; gloo works)")
        cfg = make_config(max_tokens_per_rank, hidden, num_experts, top_k, modes=modes,
                          ll_max_tokens_per_rank=ll_max_tokens_per_rank, num_sms=num_sms,
                          ll_num_sms=ll_num_sms, ll_route=ll_route, timeout_ms=timeout_ms,
                          dtypes=dtypes, expand_max_rows=expand_max_rows,
                          expand_fan_out=expand_fan_out)
        rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        comm_alive = None
        if borrow_nccl_comm:
            comm, comm_alive = _borrowed_comm(dist, torch, group)
        else:
            unique_id = [_nccl.get_unique_id() if rank == 0 else None]
            src = 0 if group is None else dist.get_global_rank(group, 0)
            dist.broadcast_object_list(unique_id, src=src, group=group)
            comm = _nccl.comm_init_rank(num_ranks, unique_id[0], rank)
        gptr = ctypes.c_void_p()
        status = lib.epx_group_create(comm, ctypes.byref(cfg), ctypes.byref(gptr))
        if status != errors.EPX_OK:
            err = errors.error_for(status, _capi.last_error())
            if not borrow_nccl_comm:
                _nccl.comm_abort(comm)  # every rank failed alike (EPX agrees first)
            raise err
        self._res = _GroupResources(gptr.value, comm, not borrow_nccl_comm, comm_alive)
        self._views = {}
        self._moe_workspace = None  # moe_decode's scratch, grown on demand
        out = ctypes.c_int()
        _capi.check(lib.epx_group_rank(gptr, ctypes.byref(out)))
        self.rank = out.value
        _capi.check(lib.epx_group_size(gptr, ctypes.byref(out)))
        self.num_ranks = out.value
        resolved = _capi.epx_group_config_t()
        _capi.check(lib.epx_group_get_config(gptr, ctypes.byref(resolved)))
        self.config = config_dict(resolved)
        nbytes = ctypes.c_size_t()
        _capi.check(lib.epx_group_workspace_bytes(gptr, ctypes.byref(nbytes)))
        self.workspace_bytes = nbytes.value
        self.num_local_experts = self.config["num_experts"] // self.num_ranks
        self._dims = Dims(self.config["hidden"], self.config["top_k"], self.config["num_experts"],
                          self.num_ranks, self.device.index, self.config["max_tokens_per_rank"],
                          self.config["ll_max_tokens_per_rank"])

    # -- lifetime --------------------------------------------------------------------------
    def _ptr(self, fn="Group"):
        gptr = self._res.state["group"]
        if gptr is None:
            raise errors.EpxInvalidUsage(errors.EPX_ERR_INVALID_USAGE,
                                         "%s: the group was destroyed" % fn)
        gone = borrowed_comm_gone(self._res.state, fn)
        if gone is not None:
            raise gone
        return gptr

    @property
    def destroyed(self):
        return self._res.state["group"] is None

    def destroy(self):
        """Destroy the group's handles, the group (COLLECTIVE) and the communicator EPX created.
        Idempotent. Views of the workspace must not be used afterwards."""
        self._views.clear()
        err = self._res.release()
        if err is not None:
            raise err

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    def __repr__(self):
        return "Group(rank=%d, num_ranks=%d, hidden=%d, num_experts=%d, top_k=%d%s)" % (
            self.rank, self.num_ranks, self.config["hidden"], self.config["num_experts"],
            self.config["top_k"], ", destroyed" if self.destroyed else "")

    def _view(self, ptr, dtype, shape, region_bytes=0, owner=None):
        owner = owner or self
        return _tensors.device_view(owner._views, owner._res, ptr, dtype, shape, self.device,
                                    region_bytes)

    def _call(self, status):
        _capi.check(status)

    # -- layout and normal mode -------------------------------------------------------------
    def layout(self, topk_idx, *, stream=None):
        """Where this rank's tokens go (fresh tensors): epx.Layout."""
        torch = _torch()
        T = check_layout_args(self._dims, topk_idx)
        R, E = self.num_ranks, self.config["num_experts"]
        result = Layout(torch.empty(R, dtype=torch.int32, device=self.device),
                        torch.empty(E, dtype=torch.int32, device=self.device),
                        torch.empty((T, R), dtype=torch.bool, device=self.device),
                        torch.empty((T, R), dtype=torch.int32, device=self.device))
        a = _capi.EPX_LAYOUT_ARGS_INIT()
        a.topk_idx = topk_idx.data_ptr()
        a.topk_idx_dtype = _tensors.epx_dtype(topk_idx.dtype)
        a.num_tokens = T
        a.num_tokens_per_rank = result.num_tokens_per_rank.data_ptr()
        a.num_tokens_per_expert = result.num_tokens_per_expert.data_ptr()
        a.is_token_in_rank = result.is_token_in_rank.data_ptr()
        a.token_pos_in_rank = result.token_pos_in_rank.data_ptr()
        self._call(lib.epx_layout(self._ptr("Group.layout"), ctypes.byref(a), _stream_ptr(stream)))
        return result

    def handle(self):
        """A new epx.Handle (create once, reuse for every dispatch)."""
        return Handle(self)

    def _check_handle(self, h, fn):
        self._ptr(fn)  # a destroyed group first: its handles went with it
        if not isinstance(h, Handle) or h._group is not self:
            raise invalid_argument("%s: handle: expected an epx.Handle of this group, got %r" %
                                   (fn, h))
        return h._ptr(fn)

    def dispatch(self, h, x, topk_idx=None, topk_weights=None, *, x_scales=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, expert_alignment=1,
                 sync_counts=True, num_worst_tokens=0, recv_topk_idx_dtype=None, stream=None):
        """Send this rank's tokens to their experts' ranks (COLLECTIVE). x: [T, H] bf16, or
        float8_e4m3fn with x_scales ([T, H/128] float32, any strides, or [T, ceil(H/512)] int32
        packed UE8M0). recv_topk_idx_dtype: torch.int32 (default) or torch.int64.
        Returns epx.DispatchResult: views valid until the next dispatch on the group."""
        torch = _torch()
        fn = "Group.dispatch"
        hptr = self._check_handle(h, fn)
        T, x_dtype, scales_dtype = check_dispatch_args(
            self._dims, x, topk_idx, topk_weights, x_scales, is_token_in_rank,
            num_tokens_per_expert)
        idx_dtype = recv_topk_idx_dtype or torch.int32
        if idx_dtype not in (torch.int32, torch.int64):
            raise invalid_argument("%s: recv_topk_idx_dtype: expected torch.int32 or torch.int64, "
                                   "got %s" % (fn, idx_dtype))
        a = _capi.EPX_DISPATCH_ARGS_INIT()
        a.x, a.x_dtype, a.num_tokens = x.data_ptr(), x_dtype, T
        if scales_dtype:
            a.x_scales, a.x_scales_dtype = x_scales.data_ptr(), scales_dtype
            a.x_scales_stride_token, a.x_scales_stride_group = _scale_strides(x_scales)
        if topk_idx is not None:
            a.topk_idx, a.topk_idx_dtype = topk_idx.data_ptr(), _tensors.epx_dtype(topk_idx.dtype)
        a.topk_weights = data_ptr(topk_weights)
        a.is_token_in_rank = data_ptr(is_token_in_rank)
        a.num_tokens_per_expert = data_ptr(num_tokens_per_expert)
        a.expert_alignment = expert_alignment
        a.sync_counts = 1 if sync_counts else 0
        per_expert = (ctypes.c_int * self.num_local_experts)() if sync_counts else None
        if per_expert is not None:
            a.num_recv_per_expert = ctypes.addressof(per_expert)
        a.num_worst_tokens = num_worst_tokens
        a.recv_topk_idx_dtype = _tensors.epx_dtype(idx_dtype)
        r = _capi.epx_dispatch_result_t()
        status = lib.epx_dispatch(self._ptr(fn), hptr, ctypes.byref(a), ctypes.byref(r),
                                  _stream_ptr(stream))
        if r.capacity > 0:
            # C filled the result (also before a count timeout): the handle is this call's.
            held = self._tokens_held(T)
            h.num_tokens, h.num_recv = held, r.num_recv
            h.num_worst_tokens = num_worst_tokens if held == T else 0  # (C's, after a refusal)
            # Valid device memory for combine's empty inputs (a rank that received no rows
            # passes empty tensors, whose data_ptr() is 0, and C refuses NULL).
            h._recv_x_ptr, h._recv_weights_ptr = r.recv_x, r.recv_topk_weights
        elif status != errors.EPX_OK:
            # C may have begun to fill the handle (its token count) before failing: the
            # previous routing is gone, and a combine sized by it would write past `out`.
            h.num_tokens = None
        self._call(status)
        return self._dispatch_result(h, r, x.dtype, r.num_recv,
                                     list(per_expert) if per_expert is not None else None)

    def dispatch_cached(self, h, x, x_scales=None, *, stream=None):
        """Dispatch new payload with the routing in h (COLLECTIVE; no host sync). num_recv is
        the count of the dispatch that filled h when that one knew it."""
        fn = "Group.dispatch_cached"
        hptr = self._check_handle(h, fn)
        if h.num_tokens is None:
            raise errors.EpxInvalidUsage(errors.EPX_ERR_INVALID_USAGE,
                                         "%s: the handle holds no routing yet; call "
                                         "Group.dispatch first" % fn)
        T, x_dtype, scales_dtype = check_cached_args(self._dims, h.num_tokens, x, x_scales)
        a = _capi.EPX_DISPATCH_ARGS_INIT()
        a.x, a.x_dtype, a.num_tokens = x.data_ptr(), x_dtype, T
        if scales_dtype:
            a.x_scales, a.x_scales_dtype = x_scales.data_ptr(), scales_dtype
            a.x_scales_stride_token, a.x_scales_stride_group = _scale_strides(x_scales)
        r = _capi.epx_dispatch_result_t()
        self._call(lib.epx_dispatch_cached_args(self._ptr(fn), hptr, ctypes.byref(a),
                                                ctypes.byref(r), _stream_ptr(stream)))
        num_recv = r.num_recv if r.num_recv >= 0 else h.num_recv  # same routing, same count
        return self._dispatch_result(h, r, x.dtype, num_recv, None)

    def _dispatch_result(self, h, r, x_dtype, num_recv, per_expert):
        torch = _torch()
        H, K, R, L = self._dims.hidden, self._dims.top_k, self.num_ranks, self.num_local_experts
        cap = r.capacity
        n = num_recv if num_recv >= 0 else cap
        i32, f32 = torch.int32, torch.float32
        scales = None
        if r.recv_x_scales:
            scales = self._view(r.recv_x_scales, f32, (n, H // 128), cap * (H // 128) * 4)
        elif r.recv_x_scales_packed:
            words = (H // 128 + 3) // 4
            scales = self._view(r.recv_x_scales_packed, i32, (n, words), cap * words * 4)
        if r.recv_topk_idx_int64:
            idx = self._view(r.recv_topk_idx_int64, torch.int64, (n, K), cap * K * 8)
        else:
            idx = self._view(r.recv_topk_idx, i32, (n, K), cap * K * 4)
        return DispatchResult(
            num_recv=num_recv,
            recv_x=self._view(r.recv_x, x_dtype, (n, H), cap * H * x_dtype.itemsize),
            recv_x_scales=scales,
            recv_topk_idx=idx,
            recv_topk_weights=self._view(r.recv_topk_weights, f32, (n, K), cap * K * 4),
            recv_src_token=self._view(r.recv_src_token, i32, (n,), cap * 4),
            recv_rank_prefix=self._view(r.recv_rank_prefix, i32, (R + 1,), owner=h),
            num_recv_device=self._view(r.num_recv_device, i32, (1,), owner=h),
            num_recv_per_expert=per_expert,
            num_recv_per_expert_device=self._view(r.num_recv_per_expert_device, i32, (L,),
                                                  owner=h),
            rank_prefix_matrix=self._view(r.rank_prefix_matrix_device, i32, (R, R), owner=h),
            capacity=cap)

    def combine(self, h, x, *, out=None, topk_idx=None, topk_weights=None,
                recv_topk_weights=None, bias=None, stream=None):
        """Return the expert outputs x [num_recv, H] bf16 to their tokens, summed (COLLECTIVE).
        Returns (out [T, H] bf16, out_topk_weights [T, K] f32 or None)."""
        torch = _torch()
        fn = "Group.combine"
        hptr = self._check_handle(h, fn)
        if h.num_tokens is None:
            raise errors.EpxInvalidUsage(errors.EPX_ERR_INVALID_USAGE,
                                         "%s: the handle holds no routing yet; call "
                                         "Group.dispatch first" % fn)
        T = h.num_tokens
        bias = check_combine_args(self._dims, T, h.num_recv, x, out, topk_idx, topk_weights,
                                  recv_topk_weights, bias)
        if out is None:
            out = torch.empty((T, self._dims.hidden), dtype=torch.bfloat16, device=self.device)
        out_w = None
        if recv_topk_weights is not None:
            out_w = torch.empty((T, self._dims.top_k), dtype=torch.float32, device=self.device)
        a = _capi.EPX_COMBINE_ARGS_INIT()
        a.x, a.out = x.data_ptr() or h._recv_x_ptr, out.data_ptr()
        if topk_idx is not None:
            a.topk_idx, a.topk_idx_dtype = topk_idx.data_ptr(), _tensors.epx_dtype(topk_idx.dtype)
        a.topk_weights = data_ptr(topk_weights)
        if recv_topk_weights is not None:
            a.recv_topk_weights = recv_topk_weights.data_ptr() or h._recv_weights_ptr
        if out_w is not None:
            # Both or neither, on every rank: a rank with no tokens gets an empty out_w, whose
            # data_ptr() is 0; C never writes it then, but NULL would refuse the call on that rank
            # alone and leave its peers waiting in the collective.
            a.out_topk_weights = out_w.data_ptr() or h._recv_weights_ptr
        a.bias[0], a.bias[1] = data_ptr(bias[0]), data_ptr(bias[1])
        self._call(lib.epx_combine(self._ptr(fn), hptr, ctypes.byref(a), _stream_ptr(stream)))
        return out, out_w

    # -- expert-major normal mode -----------------------------------------------------------
    def _tokens_held(self, T):
        """The token count C's handle holds after a dispatch of T tokens that C queued: T, or
        0 when T is over max_tokens_per_rank (C refused it but still ran the failed, empty
        exchange on every rank, so a combine may follow, over no tokens)."""
        return T if T <= self._dims.max_tokens_per_rank else 0

    def dispatch_expand(self, h, x, topk_idx, topk_weights=None, *, x_scales=None,
                        expert_alignment=1, sync_counts=True, stream=None):
        """Send this rank's tokens to their experts' ranks in the expert-major layout
        (COLLECTIVE; needs a Group made with expand_max_rows > 0): one row per (token, local
        expert), each expert's rows contiguous and padded to expert_alignment. x as dispatch.
        Returns epx.ExpandResult: views valid until the next dispatch on the group."""
        torch = _torch()
        fn = "Group.dispatch_expand"
        hptr = self._check_handle(h, fn)
        if topk_idx is None:
            raise invalid_argument("%s: topk_idx is required (the expert-major layout places "
                                   "rows by expert id)" % fn)
        T, x_dtype, scales_dtype = check_dispatch_args(self._dims, x, topk_idx, topk_weights,
                                                       x_scales, None, None)
        a = _capi.EPX_DISPATCH_ARGS_INIT()
        a.x, a.x_dtype, a.num_tokens = x.data_ptr(), x_dtype, T
        if scales_dtype:
            a.x_scales, a.x_scales_dtype = x_scales.data_ptr(), scales_dtype
            a.x_scales_stride_token, a.x_scales_stride_group = _scale_strides(x_scales)
        a.topk_idx, a.topk_idx_dtype = topk_idx.data_ptr(), _tensors.epx_dtype(topk_idx.dtype)
        a.topk_weights = data_ptr(topk_weights)
        a.expert_alignment = expert_alignment
        a.sync_counts = 1 if sync_counts else 0
        L = self.num_local_experts
        per_expert = (ctypes.c_int * L)() if sync_counts else None
        if per_expert is not None:
            a.num_recv_per_expert = ctypes.addressof(per_expert)
        r = _capi.epx_dispatch_expand_result_t()
        status = lib.epx_dispatch_expand(self._ptr(fn), hptr, ctypes.byref(a), ctypes.byref(r),
                                         _stream_ptr(stream))
        if r.capacity > 0:
            # C filled the result, so the call was queued (even if it then reported an error:
            # rows past the capacity, a count timeout) and a combine_expand must follow on
            # every rank: the handle describes this dispatch either way.
            # Rows past the capacity (a call that overflowed it) were not written, and the
            # combine_expand every rank must still make reads at most the capacity's.
            h.num_tokens, h.num_recv, h.num_worst_tokens = self._tokens_held(T), r.num_recv, 0
            h.num_rows, h._recv_x_ptr = min(r.num_rows, r.capacity), r.recv_x
            h._recv_weights_ptr = r.recv_weights  # (combine's empty recv_topk_weights, below)
        elif status != errors.EPX_OK:
            h.num_tokens = None  # as in dispatch: C may have begun to fill the handle
        self._call(status)
        H, K, R, cap = self._dims.hidden, self._dims.top_k, self.num_ranks, r.capacity
        n = r.num_rows if r.num_rows >= 0 else cap
        i32 = torch.int32
        scales = None
        if r.recv_x_scales:
            scales = self._view(r.recv_x_scales, torch.float32, (n, H // 128), cap * (H // 128) * 4)
        elif r.recv_x_scales_packed:
            words = (H // 128 + 3) // 4
            scales = self._view(r.recv_x_scales_packed, i32, (n, words), cap * words * 4)
        lists = r.num_recv if r.num_recv >= 0 else R * self._dims.max_tokens_per_rank
        return ExpandResult(
            num_rows=r.num_rows, num_recv=r.num_recv,
            recv_x=self._view(r.recv_x, x.dtype, (n, H), cap * H * x.dtype.itemsize),
            recv_x_scales=scales,
            recv_src_info=self._view(r.recv_src_info, i32, (n, 4), cap * 16),
            recv_weights=self._view(r.recv_weights, torch.float32, (n,), cap * 4),
            expert_begin=self._view(r.expert_begin_device, i32, (L + 1,), owner=h),
            expert_count=self._view(r.expert_count_device, i32, (L,), owner=h),
            num_rows_device=self._view(r.num_rows_device, i32, (1,), owner=h),
            token_rows=self._view(r.token_rows, i32, (lists, K),
                                  R * self._dims.max_tokens_per_rank * K * 4),
            recv_rank_prefix=self._view(r.recv_rank_prefix, i32, (R + 1,), owner=h),
            num_recv_device=self._view(r.num_recv_device, i32, (1,), owner=h),
            num_recv_per_expert=list(per_expert) if per_expert is not None else None,
            capacity=cap,
            expert_ready=self._view(r.expert_ready, i32, (L,), L * 4),
            counts_event=r.counts_event or 0)

    def combine_expand(self, h, x, *, weighted=True, out=None, stream=None):
        """Return expert outputs in the expert-major layout (x [num_rows, H] bf16, row for row as
        dispatch_expand delivered them) to their tokens (COLLECTIVE): each token's rows weighed
        (weighted: by recv_weights) and summed on the expert side, one row per (token, rank)
        sent home and summed there. Returns out [T, H] bf16."""
        torch = _torch()
        fn = "Group.combine_expand"
        hptr = self._check_handle(h, fn)
        if h.num_tokens is None:
            raise errors.EpxInvalidUsage(errors.EPX_ERR_INVALID_USAGE,
                                         "%s: the handle holds no routing yet; call "
                                         "Group.dispatch_expand first" % fn)
        T = h.num_tokens
        check_combine_expand_args(self._dims, T, h.num_rows, x, out)
        if out is None:
            out = torch.empty((T, self._dims.hidden), dtype=torch.bfloat16, device=self.device)
        a = _capi.EPX_COMBINE_EXPAND_ARGS_INIT()
        a.x = x.data_ptr() or h._recv_x_ptr
        a.weighted = 1 if weighted else 0
        a.out = out.data_ptr() or h._recv_x_ptr
        self._call(lib.epx_combine_expand(self._ptr(fn), hptr, ctypes.byref(a),
                                          _stream_ptr(stream)))
        return out

    # -- low-latency mode -------------------------------------------------------------------
    def ll_dispatch(self, x, topk_idx, topk_weights=None, *, fp8=False, ue8m0=False,
                    ue8m0_packed=False, packed=False, split=False, layout_range=False,
                    stream=None):
        """Low-latency dispatch (COLLECTIVE, no host sync). x: [T, H] bf16; returns
        epx.LLDispatchResult (views valid until the dispatch after next). split=True: call
        result.hook() before using the outputs."""
        torch = _torch()
        fn = "Group.ll_dispatch"
        T = check_ll_dispatch_args(self._dims, x, topk_idx, topk_weights)
        L, R = self.num_local_experts, self.num_ranks
        range_out = torch.empty((L, R), dtype=torch.int64, device=self.device) \
            if layout_range else None
        a = _capi.EPX_LL_DISPATCH_ARGS_INIT()
        a.x, a.topk_idx, a.topk_weights = x.data_ptr(), topk_idx.data_ptr(), data_ptr(topk_weights)
        a.topk_idx_dtype = _tensors.epx_dtype(topk_idx.dtype)
        a.num_tokens = T
        a.recv_dtype = _capi.EPX_DTYPE_FP8_E4M3 if fp8 else _capi.EPX_DTYPE_BF16
        a.ue8m0, a.ue8m0_packed = int(bool(ue8m0)), int(bool(ue8m0_packed))
        a.packed, a.split = int(bool(packed)), int(bool(split))
        a.layout_range = data_ptr(range_out)
        c = _capi.epx_ll_dispatch_result_t()
        self._call(lib.epx_ll_dispatch(self._ptr(fn), ctypes.byref(a), ctypes.byref(c),
                                       _stream_ptr(stream)))
        H, RM = self._dims.hidden, c.rows_per_expert
        rows = L * RM
        recv_dtype = torch.float8_e4m3fn if c.recv_dtype == _capi.EPX_DTYPE_FP8_E4M3 \
            else torch.bfloat16
        i32 = torch.int32
        # Regions at the largest dtype each array can have, so both dtypes share a cache entry.
        scales = packed_scales = None
        if c.recv_x_scales:
            scales = self._view(c.recv_x_scales, torch.float32, (L, RM, H // 128))
        if c.recv_x_scales_packed:
            packed_scales = self._view(c.recv_x_scales_packed, i32, (L, RM, (H // 128 + 3) // 4),
                                       rows * (H // 128) * 4)
        keep = (x, topk_idx, topk_weights, range_out)
        result = LLDispatchResult(
            self, c, keep,
            recv_x=self._view(c.recv_x, recv_dtype, (L, RM, H)),
            recv_x_scales=scales,
            recv_x_scales_packed=packed_scales,
            recv_src_info=self._view(c.recv_src_info, i32, (L, RM, 4)),
            recv_count=self._view(c.recv_count, i32, (L,)),
            recv_begin=self._view(c.recv_begin, i32, (L, R)),
            recv_num=self._view(c.recv_num, i32, (L, R)),
            combine_input=self._view(c.combine_input, torch.bfloat16, (L, RM, H)),
            layout_range=range_out,
            num_tokens=c.num_tokens,
            buffer=c.buffer,
            packed=bool(c.packed),
            hook=Hook(self, c.hook, keep=(c,) + keep) if split else None)
        return result

    def ll_combine(self, d, x=None, *, out=None, topk_weights=None, split=False, stream=None):
        """Return the rows of low-latency dispatch d to their tokens (COLLECTIVE). x: [L, R*M, H]
        bf16, or None to read d.combine_input (zero copy). Returns out [T, H] bf16, or
        (out, hook) with split=True (out is written when hook() runs)."""
        torch = _torch()
        fn = "Group.ll_combine"
        if not isinstance(d, LLDispatchResult) or d._group is not self:
            raise invalid_argument("%s: d: expected an epx.LLDispatchResult of this group, got %r"
                                   % (fn, d))
        T = d.num_tokens
        check_ll_combine_args(self._dims, T, d._c.rows_per_expert, x, out, topk_weights)
        if out is None:
            out = torch.empty((T, self._dims.hidden), dtype=torch.bfloat16, device=self.device)
        a = _capi.EPX_LL_COMBINE_ARGS_INIT()
        a.x, a.out = data_ptr(x), out.data_ptr()
        if topk_weights is not None:
            # Given weights stay given on a rank with no tokens (empty tensor, data_ptr() 0): with
            # route BY_RANK they choose the combine every rank must run alike; C reads none for
            # T = 0, so any valid device address stands in for NULL.
            a.topk_weights = topk_weights.data_ptr() or d._c.combine_input
        a.dispatch = ctypes.pointer(d._c)
        hook = None
        if split:
            hook = Hook(self, _capi.epx_ll_hook_t(), keep=(out, topk_weights, x, d))
            a.split, a.hook = 1, ctypes.pointer(hook._c)
        self._call(lib.epx_ll_combine(self._ptr(fn), ctypes.byref(a), _stream_ptr(stream)))
        return (out, hook) if split else out

    def moe_decode(self, experts, x, topk_idx, topk_weights=None, *, fp8=False, out=None,
                   stream=None):
        """One MoE layer at decode (epx_moe_decode, COLLECTIVE, no host sync, capturable):
        low-latency dispatch (packed), experts' SwiGLU FFN of this rank's epx.Experts, combine;
        with the default route the down projection sends each row to its token's rank as it
        finishes it (docs/moe.md). x: [T, H] bf16; topk_idx [T, K] int64/int32;
        topk_weights [T, K] float32 or None (1); fp8=True sends FP8 rows (FP8 experts only).
        Returns out [T, H] bf16 (a new tensor unless given). The scratch is one tensor per
        Group, reused by every call: two calls of one group on two streams at once race."""
        from .experts import Experts
        torch = _torch()
        fn = "Group.moe_decode"
        if not isinstance(experts, Experts):
            raise invalid_argument("%s: experts: expected an epx.Experts, got %r" % (fn, experts))
        T = check_ll_dispatch_args(self._dims, x, topk_idx, topk_weights)
        if out is None:
            out = torch.empty((T, self._dims.hidden), dtype=torch.bfloat16, device=self.device)
        else:
            _tensors.check_tensor(fn, "out", out, torch.bfloat16, shape=(T, self._dims.hidden),
                                  align=16, device_index=self.device.index)
        dtype = _capi.EPX_DTYPE_FP8_E4M3 if fp8 else _capi.EPX_DTYPE_BF16
        need = ctypes.c_size_t()
        self._call(lib.epx_moe_workspace_size(self._ptr(fn), ctypes.byref(experts._c), dtype,
                                              ctypes.byref(need)))
        if self._moe_workspace is None or self._moe_workspace.numel() < need.value:
            self._moe_workspace = torch.empty(max(need.value, 256), dtype=torch.uint8,
                                              device=self.device)
        a = _capi.EPX_MOE_ARGS_INIT()
        a.x, a.topk_idx, a.topk_weights = x.data_ptr(), topk_idx.data_ptr(), data_ptr(topk_weights)
        a.topk_idx_dtype = _tensors.epx_dtype(topk_idx.dtype)
        a.num_tokens, a.dispatch_dtype = T, dtype
        a.out = out.data_ptr()
        a.workspace, a.workspace_bytes = (self._moe_workspace.data_ptr(),
                                          self._moe_workspace.numel())
        self._call(lib.epx_moe_decode(self._ptr(fn), ctypes.byref(experts._c), ctypes.byref(a),
                                      _stream_ptr(stream)))
        return out

    def ll_recv(self, hook, *, stream=None):
        """The receive half of a split ll_dispatch / ll_combine (epx_ll_recv)."""
        if not isinstance(hook, Hook) or hook._group is not self:
            raise invalid_argument("Group.ll_recv: hook: expected an epx.Hook of this group, got "
                                   "%r" % (hook,))
        self._call(lib.epx_ll_recv(self._ptr("Group.ll_recv"), ctypes.byref(hook._c),
                                   _stream_ptr(stream)))

    # -- barrier, peers, errors, tracing ----------------------------------------------------
    def barrier(self, *, stream=None, skip_masked=False):
        """Device-side barrier of every rank, on the stream (COLLECTIVE). skip_masked: only this
        rank and the peers it has not masked (peer_mask); a masked peer is neither told nor
        waited for (epx_group_barrier_unmasked)."""
        fn = lib.epx_group_barrier_unmasked if skip_masked else lib.epx_group_barrier
        self._call(fn(self._ptr("Group.barrier"), _stream_ptr(stream)))

    def mask_peer(self, peer, *, stream=None):
        """Mask `peer` in this rank's low-latency calls from now on (stream-ordered)."""
        self._call(lib.epx_group_mask_peer(self._ptr("Group.mask_peer"), peer,
                                           _stream_ptr(stream)))

    @property
    def peer_mask(self):
        """Masked peers, bit p = rank p (reads the device word without waiting)."""
        mask = ctypes.c_uint()
        self._call(lib.epx_group_get_peer_mask(self._ptr("Group.peer_mask"), ctypes.byref(mask)))
        return mask.value

    def clear_peer_mask(self):
        """Unmask every peer (COLLECTIVE, synchronizes the device)."""
        self._call(lib.epx_group_clear_peer_mask(self._ptr("Group.clear_peer_mask")))

    def async_error(self):
        """The first asynchronous error recorded (epx.AsyncError), or None. Does not wait for
        any stream: synchronize first to see the errors of queued work."""
        e = _capi.epx_async_error_t()
        self._call(lib.epx_group_get_async_error(self._ptr("Group.async_error"), ctypes.byref(e)))
        if e.status == errors.EPX_OK:
            return None
        return errors.AsyncError(e.status, e.stage, e.peer, e.position, e.value,
                                 e.message.decode("utf-8", errors="replace"))

    def check_async_error(self, synchronize=True):
        """Raise the recorded asynchronous error as an EpxError (its .async_error attached);
        synchronizes the group's device first unless synchronize=False."""
        if synchronize:
            _torch().cuda.synchronize(self.device)
        e = self.async_error()
        if e is not None:
            err = e.error()
            err.async_error = e
            raise err

    def clear_async_error(self):
        """Forget the recorded asynchronous error (synchronizes the device)."""
        self._call(lib.epx_group_clear_async_error(self._ptr("Group.clear_async_error")))

    def trace_start(self, capacity=0, *, stream=None):
        """Start in-kernel tracing on every rank (COLLECTIVE; docs/profiling.md)."""
        self._call(lib.epx_trace_start(self._ptr("Group.trace_start"), capacity,
                                       _stream_ptr(stream)))

    def trace_dump(self, path, *, stream=None):
        """Stop tracing; rank 0 writes the Chrome trace JSON to path (None: discard).
        COLLECTIVE. Returns the summary as a dict."""
        s = _capi.epx_trace_summary_t()
        c_path = None if path is None else os.fsencode(path)
        self._call(lib.epx_trace_dump(self._ptr("Group.trace_dump"), c_path, ctypes.byref(s),
                                      _stream_ptr(stream)))
        return {name: getattr(s, name) for name, _ in s._fields_}

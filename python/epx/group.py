"""epx.Group: EPX's native API for PyTorch, one thin wrapper per C call.

Each call checks its tensors (check_* functions below, usable without a GPU), fills the ctypes
args, calls libepx on torch.cuda.current_stream() (or stream=) and maps a failed status to an
EpxError. Outputs of dispatch and ll_dispatch are views of EPX's workspace and handles (no
copies): valid until the next dispatch on the group (low-latency: the dispatch after next).

Lifetime: call destroy() on every rank (or use `with epx.Group(...) as g:`). destroy() is
collective. A group that is garbage-collected is destroyed then too (also collective, so every
rank must drop it alike), but never at interpreter exit: a process that exits without destroy()
leaves the cleanup to the driver. torch is imported lazily (workspace_size needs none).
"""
import ctypes
import os
import typing
import weakref

from . import _capi, _nccl, _tensors, errors
from ._capi import lib
from ._tensors import check_optional, check_tensor, data_ptr, invalid_argument

MODE_NAMES = {"normal": _capi.EPX_MODE_NORMAL, "low_latency": _capi.EPX_MODE_LOW_LATENCY}
LL_ROUTE_NAMES = {"auto": _capi.EPX_LL_ROUTE_AUTO, "direct": _capi.EPX_LL_ROUTE_DIRECT,
                  "by_rank": _capi.EPX_LL_ROUTE_BY_RANK,
                  "dispatch_by_rank": _capi.EPX_LL_ROUTE_DISPATCH_BY_RANK}
DTYPE_NAMES = {"bf16": _capi.EPX_DTYPE_BF16, "bfloat16": _capi.EPX_DTYPE_BF16,
               "fp8": _capi.EPX_DTYPE_FP8_E4M3, "fp8_e4m3": _capi.EPX_DTYPE_FP8_E4M3}


def _torch():
    import torch
    return torch


# ---------------------------------------------------------------------------------------------
# Config: keyword arguments -> epx_group_config_t, and the workspace size (no GPU needed).
# ---------------------------------------------------------------------------------------------
def _bits(value, names, what):
    """An int as is, a name, or an iterable of names/ints OR-ed together."""
    if isinstance(value, int):
        return value
    items = [value] if isinstance(value, str) else list(value)
    bits = 0
    for item in items:
        if isinstance(item, int):
            bits |= item
        elif item in names:
            bits |= names[item]
        else:
            raise invalid_argument("%s: unknown name %r; expected one of %s" %
                                   (what, item, ", ".join(sorted(names))))
    return bits


def _route(value):
    if isinstance(value, int):
        return value
    if value in LL_ROUTE_NAMES:
        return LL_ROUTE_NAMES[value]
    raise invalid_argument("ll_route: unknown name %r; expected one of %s" %
                           (value, ", ".join(LL_ROUTE_NAMES)))


def make_config(max_tokens_per_rank, hidden, num_experts, top_k, *, modes=("normal",),
                ll_max_tokens_per_rank=0, num_sms=0, ll_num_sms=0, ll_route=0, timeout_ms=0,
                dtypes=0):
    """An epx_group_config_t (EPX_GROUP_CONFIG_INIT, then these fields; 0 = auto)."""
    c = _capi.EPX_GROUP_CONFIG_INIT()
    c.max_tokens_per_rank = max_tokens_per_rank
    c.hidden = hidden
    c.num_experts = num_experts
    c.top_k = top_k
    c.modes = _bits(modes, MODE_NAMES, "modes")
    c.dtypes = _bits(dtypes, DTYPE_NAMES, "dtypes")
    c.num_sms = num_sms
    c.timeout_ms = timeout_ms
    c.ll_num_sms = ll_num_sms
    c.ll_route = _route(ll_route)
    c.ll_max_tokens_per_rank = ll_max_tokens_per_rank
    return c


def config_dict(c):
    """The fields of an epx_group_config_t as a dict (without `size`)."""
    return {name: getattr(c, name) for name, _ in c._fields_ if name != "size"}


def workspace_size(num_ranks, max_tokens_per_rank, hidden, num_experts, top_k, **config):
    """Workspace bytes per GPU of a group with this config, split by mode:
    dict(total, common, normal, low_latency). Takes Group's config keywords; touches no GPU."""
    c = make_config(max_tokens_per_rank, hidden, num_experts, top_k, **config)
    sizes = _capi.EPX_WORKSPACE_SIZES_INIT()
    _capi.check(lib.epx_workspace_size_by_mode(ctypes.byref(c), num_ranks, ctypes.byref(sizes)))
    return {"total": sizes.total_bytes, "common": sizes.common_bytes,
            "normal": sizes.normal_bytes, "low_latency": sizes.low_latency_bytes}


# ---------------------------------------------------------------------------------------------
# Results.
# ---------------------------------------------------------------------------------------------
class Layout(typing.NamedTuple):
    num_tokens_per_rank: typing.Any  # [R] int32
    num_tokens_per_expert: typing.Any  # [E] int32
    is_token_in_rank: typing.Any  # [T, R] bool
    token_pos_in_rank: typing.Any  # [T, R] int32


class DispatchResult(typing.NamedTuple):
    """Views of the workspace and the handle, valid until the next dispatch on the group."""
    num_recv: int  # rows received; -1 when unknown on the host
    recv_x: typing.Any  # [n, H] bf16 or float8_e4m3fn
    recv_x_scales: typing.Any  # [n, H/128] f32, [n, ceil(H/512)] i32 (packed UE8M0), or None
    recv_topk_idx: typing.Any  # [n, K] int32 or int64, local expert ids, -1 elsewhere
    recv_topk_weights: typing.Any  # [n, K] f32
    recv_src_token: typing.Any  # [n] i32
    recv_rank_prefix: typing.Any  # [R + 1] i32
    num_recv_device: typing.Any  # [1] i32
    num_recv_per_expert: typing.Optional[list]  # host counts (sync_counts) or None
    num_recv_per_expert_device: typing.Any  # [E/R] i32
    rank_prefix_matrix: typing.Any  # [R, R] i32
    capacity: int  # rows the receive arrays hold (n when the count is unknown)


class LLDispatchResult:
    """A low-latency dispatch: views valid until the dispatch after next. Keeps the C result
    (._c) for ll_combine, and its group alive."""

    _FIELDS = ("recv_x", "recv_x_scales", "recv_x_scales_packed", "recv_src_info", "recv_count",
               "recv_begin", "recv_num", "combine_input", "layout_range", "num_tokens", "buffer",
               "packed", "hook")

    def __init__(self, group, c_result, keep, **fields):
        self._group = group
        self._c = c_result
        self._keep = keep  # tensors C reads or writes later (layout_range, inputs)
        for name in self._FIELDS:
            setattr(self, name, fields[name])

    def __repr__(self):
        return "LLDispatchResult(num_tokens=%d, buffer=%d, packed=%s, recv_x=%s, split=%s)" % (
            self.num_tokens, self.buffer, self.packed, tuple(self.recv_x.shape),
            self.hook is not None)


class Hook:
    """The receive half of a split low-latency call: hook() (or Group.ll_recv(hook)) queues it
    on the current stream. Calling it twice raises EpxInvalidUsage (nothing is pending)."""

    def __init__(self, group, c_hook, keep=()):
        self._group = group
        self._c = c_hook  # epx_ll_hook_t (inside an LL dispatch result, or its own)
        self._keep = keep  # what C reads or writes when the receive runs (out, weights)

    @property
    def pending(self):
        return self._c.id != 0

    def __call__(self, stream=None):
        self._group.ll_recv(self, stream=stream)

    def __repr__(self):
        return "Hook(id=%d, pending=%s)" % (self._c.id, self.pending)


# ---------------------------------------------------------------------------------------------
# Native resources: what views keep alive, and what destroy() (or the GC) releases.
# ---------------------------------------------------------------------------------------------
class _HandleState:
    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr


def _release_handle(state, group_state):
    if state.ptr is None:
        return None
    ptr, state.ptr = state.ptr, None
    group_state["handles"].discard(state)
    if group_state["group"] is None:
        return None  # the group's destroy released it first
    status = lib.epx_handle_destroy(ptr)
    return None if status == errors.EPX_OK else errors.error_for(status, _capi.last_error())


def _release_group(state):
    """Handles, then the group (collective), then the communicator EPX created. Returns the
    first error instead of raising (a GC callback has nobody to raise to)."""
    first = None
    for h in list(state["handles"]):
        first = first or _release_handle(h, state)
    gptr, state["group"] = state["group"], None
    status = lib.epx_group_destroy(gptr)
    if status != errors.EPX_OK:
        first = first or errors.error_for(status, _capi.last_error())
    if state["owns_comm"] and state["comm"]:
        try:  # a failed group destroy may leave peers out of step: abort, which never waits
            (_nccl.comm_destroy if status == errors.EPX_OK else _nccl.comm_abort)(state["comm"])
        except errors.EpxError as e:
            first = first or e
    state["comm"] = None
    return first


class _GroupResources:
    """Owns the epx_group_t and (unless borrowed) the ncclComm_t. Views of the workspace keep
    this alive, not the Group, so a dropped Group with no views left is collected."""

    def __init__(self, gptr, comm, owns_comm):
        self.state = {"group": gptr, "comm": comm, "owns_comm": owns_comm, "handles": set()}
        self.release = weakref.finalize(self, _release_group, self.state)
        self.release.atexit = False  # never a collective while the interpreter shuts down


class _HandleResources:
    def __init__(self, group_res, hptr):
        self.group_res = group_res  # the group outlives its handles
        self.state = _HandleState(hptr)
        group_res.state["handles"].add(self.state)
        self.release = weakref.finalize(self, _release_handle, self.state, group_res.state)
        self.release.atexit = False


class Handle:
    """The routing of one normal dispatch (epx_handle_create), reused by combine and
    dispatch_cached. Released by destroy(), by garbage collection, or with its group."""

    def __init__(self, group):
        hptr = ctypes.c_void_p()
        _capi.check(lib.epx_handle_create(group._ptr(), ctypes.byref(hptr)))
        self._group = group  # a handle keeps its group alive
        self._res = _HandleResources(group._res, hptr.value)
        self._views = {}
        self.num_tokens = None  # of the dispatch that filled it (None: no dispatch yet)
        self.num_recv = -1  # its receive count when known on the host
        self.num_worst_tokens = 0
        self._recv_x_ptr = self._recv_weights_ptr = None

    def _ptr(self, fn):
        ptr = self._res.state.ptr
        if ptr is None:
            raise errors.EpxInvalidUsage(errors.EPX_ERR_INVALID_USAGE,
                                         "%s: the handle was destroyed" % fn)
        return ptr

    def destroy(self):
        """Release the handle (idempotent; synchronizes the device)."""
        self._views.clear()
        err = self._res.release()
        if err is not None:
            raise err

    def __repr__(self):
        return "Handle(num_tokens=%s, destroyed=%s)" % (self.num_tokens,
                                                        self._res.state.ptr is None)


# ---------------------------------------------------------------------------------------------
# Tensor checks of each call, standalone (a Dims and tensors in; no GPU, no Group needed).
# ---------------------------------------------------------------------------------------------
class Dims(typing.NamedTuple):
    """What the checks need to know of a group."""
    hidden: int
    top_k: int
    num_experts: int
    num_ranks: int
    device_index: typing.Optional[int]
    max_tokens_per_rank: int = 65536
    ll_max_tokens_per_rank: int = 65536
    device_type: str = "cuda"  # "cpu" in tests, to exercise the other checks without a GPU

    @property
    def num_local_experts(self):
        return self.num_experts // self.num_ranks


def _where(dims):
    """check_tensor's device arguments for a group of these dims."""
    return {"device_index": dims.device_index, "device_type": dims.device_type}


def _index_dtypes():
    torch = _torch()
    return (torch.int64, torch.int32)


def check_layout_args(dims, topk_idx):
    check_tensor("Group.layout", "topk_idx", topk_idx, _index_dtypes(), ("T", dims.top_k),
                 **_where(dims))
    return topk_idx.shape[0]


def check_scales(fn, dims, x, x_scales):
    """x_scales against an already checked x: float32 [T, H/128] (any strides) or int32
    [T, ceil(H/512)] (packed UE8M0) with float8 x, None with bfloat16 x.
    Returns (T, x_dtype, scales_dtype) as epx_dtype_t values (scales_dtype 0: none)."""
    torch = _torch()
    T, H = x.shape[0], dims.hidden
    if x.dtype != torch.float8_e4m3fn:
        if x_scales is not None:
            raise invalid_argument("%s: x_scales: expected None with bfloat16 x, got a tensor"
                                   % fn)
        return T, _capi.EPX_DTYPE_BF16, 0
    groups, words = H // 128, (H // 128 + 3) // 4
    if x_scales is None:
        raise invalid_argument("%s: x_scales: expected a [%d, %d] float32 or [%d, %d] int32 "
                               "tensor with float8 x, got None" % (fn, T, groups, T, words))
    packed = getattr(x_scales, "dtype", None) == torch.int32
    check_tensor(fn, "x_scales", x_scales, (torch.float32, torch.int32),
                 (T, words if packed else groups), contiguous=False,
                 **_where(dims))  # any strides: C takes them as element strides
    return T, _capi.EPX_DTYPE_FP8_E4M3, _capi.EPX_DTYPE_INT32 if packed else _capi.EPX_DTYPE_FLOAT32


def check_dispatch_args(dims, x, topk_idx=None, topk_weights=None, x_scales=None,
                        is_token_in_rank=None, num_tokens_per_expert=None,
                        fn="Group.dispatch"):
    """Checks dispatch's tensors; returns (T, x_dtype, scales_dtype) as epx_dtype_t values."""
    torch = _torch()
    dev, H, K = _where(dims), dims.hidden, dims.top_k
    check_tensor(fn, "x", x, (torch.bfloat16, torch.float8_e4m3fn), ("T", H), **dev, align=16)
    T = x.shape[0]
    _, x_dtype, scales_dtype = check_scales(fn, dims, x, x_scales)
    if is_token_in_rank is not None or num_tokens_per_expert is not None:
        check_tensor(fn, "is_token_in_rank", is_token_in_rank, (torch.bool, torch.uint8),
                     (T, dims.num_ranks), **dev)
        check_tensor(fn, "num_tokens_per_expert", num_tokens_per_expert, torch.int32,
                     (dims.num_experts,), **dev)
        if topk_idx is not None or topk_weights is not None:
            raise invalid_argument("%s: topk_idx, topk_weights: expected None when routing by "
                                   "is_token_in_rank, got a tensor" % fn)
    else:
        check_tensor(fn, "topk_idx", topk_idx, _index_dtypes(), (T, K), **dev)
        check_optional(fn, "topk_weights", topk_weights, torch.float32, (T, K), **dev)
    return T, x_dtype, scales_dtype


def check_cached_args(dims, num_tokens, x, x_scales=None):
    """Checks dispatch_cached's tensors (T is the handle's); returns (T, x_dtype, scales_dtype)."""
    torch = _torch()
    fn, H, dev = "Group.dispatch_cached", dims.hidden, _where(dims)
    check_tensor(fn, "x", x, (torch.bfloat16, torch.float8_e4m3fn), (num_tokens, H), **dev,
                 align=16)
    return check_scales(fn, dims, x, x_scales)


def _scale_strides(x_scales):
    """(stride_token, stride_group) for C: both 0 for contiguous rows."""
    if x_scales is None or x_scales.is_contiguous():
        return 0, 0
    st, sg = x_scales.stride()
    if st < 1 or sg < 1:
        raise invalid_argument("Group.dispatch: x_scales: expected strides >= 1, got %s" %
                               (tuple(x_scales.stride()),))
    return st, sg


def check_combine_args(dims, num_tokens, num_recv, x, out=None, topk_idx=None,
                       topk_weights=None, recv_topk_weights=None, bias=None):
    """Checks combine's tensors; returns bias as a pair (each a tensor or None)."""
    torch = _torch()
    fn, dev, H, K, T = "Group.combine", _where(dims), dims.hidden, dims.top_k, num_tokens
    check_tensor(fn, "x", x, torch.bfloat16, ("num_recv", H), **dev, align=16)
    if num_recv >= 0 and x.shape[0] < num_recv:
        raise invalid_argument("%s: x: expected at least %d rows (the dispatch's num_recv), got "
                               "%d" % (fn, num_recv, x.shape[0]))
    check_optional(fn, "out", out, torch.bfloat16, (T, H), **dev, align=16)
    check_optional(fn, "topk_idx", topk_idx, _index_dtypes(), (T, K), **dev)
    check_optional(fn, "topk_weights", topk_weights, torch.float32, (T, K), **dev)
    check_optional(fn, "recv_topk_weights", recv_topk_weights, torch.float32,
                   (x.shape[0], K), **dev)
    if bias is None or isinstance(bias, torch.Tensor):
        bias = (bias, None)
    else:
        bias = tuple(bias)
        if len(bias) > 2:
            raise invalid_argument("%s: bias: expected a tensor or a pair, got %d tensors" %
                                   (fn, len(bias)))
        bias = bias + (None,) * (2 - len(bias))
    for i, b in enumerate(bias):
        check_optional(fn, "bias[%d]" % i, b, torch.bfloat16, (T, H), **dev, align=16)
    return bias


def check_ll_dispatch_args(dims, x, topk_idx, topk_weights=None):
    torch = _torch()
    fn, dev = "Group.ll_dispatch", _where(dims)
    check_tensor(fn, "x", x, torch.bfloat16, ("T", dims.hidden), **dev, align=16)
    T = x.shape[0]
    check_tensor(fn, "topk_idx", topk_idx, _index_dtypes(), (T, dims.top_k), **dev)
    check_optional(fn, "topk_weights", topk_weights, torch.float32, (T, dims.top_k), **dev)
    return T


def check_ll_combine_args(dims, num_tokens, rows_per_expert, x=None, out=None, topk_weights=None):
    torch = _torch()
    fn, dev, H = "Group.ll_combine", _where(dims), dims.hidden
    check_optional(fn, "x", x, torch.bfloat16, (dims.num_local_experts, rows_per_expert, H),
                   **dev, align=16)
    check_optional(fn, "out", out, torch.bfloat16, (num_tokens, H), **dev, align=16)
    check_optional(fn, "topk_weights", topk_weights, torch.float32, (num_tokens, dims.top_k),
                   **dev)


# ---------------------------------------------------------------------------------------------
# The group.
# ---------------------------------------------------------------------------------------------
def _stream_ptr(stream):
    """cudaStream_t of a torch.cuda.Stream (or a raw int); None: the current stream."""
    if stream is None:
        return _torch().cuda.current_stream().cuda_stream
    return stream if isinstance(stream, int) else stream.cuda_stream


def _borrowed_comm(dist, torch, group):
    """The ncclComm_t of a ProcessGroupNCCL (torch's private _comm_ptr)."""
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
    return comm


class Group:
    """An EPX group over a torch.distributed process group (see the module doc and
    docs/python.md). Collective: every rank constructs it with the same arguments."""

    def __init__(self, max_tokens_per_rank, hidden, num_experts, top_k, *, group=None,
                 borrow_nccl_comm=False, modes=("normal",), ll_max_tokens_per_rank=0, num_sms=0,
                 ll_num_sms=0, ll_route=0, timeout_ms=0, dtypes=0):
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
                          dtypes=dtypes)
        rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        if borrow_nccl_comm:
            comm = _borrowed_comm(dist, torch, group)
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
        self._res = _GroupResources(gptr.value, comm, not borrow_nccl_comm)
        self._views = {}
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
        self._call(lib.epx_dispatch(self._ptr(fn), hptr, ctypes.byref(a), ctypes.byref(r),
                                    _stream_ptr(stream)))
        h.num_tokens, h.num_recv, h.num_worst_tokens = T, r.num_recv, num_worst_tokens
        # Valid device memory for combine's empty inputs (a rank that received no rows passes
        # empty tensors, whose data_ptr() is 0, and C refuses NULL).
        h._recv_x_ptr, h._recv_weights_ptr = r.recv_x, r.recv_topk_weights
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
        a.out_topk_weights = data_ptr(out_w)
        a.bias[0], a.bias[1] = data_ptr(bias[0]), data_ptr(bias[1])
        self._call(lib.epx_combine(self._ptr(fn), hptr, ctypes.byref(a), _stream_ptr(stream)))
        return out, out_w

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
        a.x, a.out, a.topk_weights = data_ptr(x), out.data_ptr(), data_ptr(topk_weights)
        a.dispatch = ctypes.pointer(d._c)
        hook = None
        if split:
            hook = Hook(self, _capi.epx_ll_hook_t(), keep=(out, topk_weights, x, d))
            a.split, a.hook = 1, ctypes.pointer(hook._c)
        self._call(lib.epx_ll_combine(self._ptr(fn), ctypes.byref(a), _stream_ptr(stream)))
        return (out, hook) if split else out

    def ll_recv(self, hook, *, stream=None):
        """The receive half of a split ll_dispatch / ll_combine (epx_ll_recv)."""
        if not isinstance(hook, Hook) or hook._group is not self:
            raise invalid_argument("Group.ll_recv: hook: expected an epx.Hook of this group, got "
                                   "%r" % (hook,))
        self._call(lib.epx_ll_recv(self._ptr("Group.ll_recv"), ctypes.byref(hook._c),
                                   _stream_ptr(stream)))

    # -- barrier, peers, errors, tracing ----------------------------------------------------
    def barrier(self, *, stream=None):
        """Device-side barrier of every rank, on the stream (COLLECTIVE)."""
        self._call(lib.epx_group_barrier(self._ptr("Group.barrier"), _stream_ptr(stream)))

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

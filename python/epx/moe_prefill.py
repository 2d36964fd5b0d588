"""epx.MoePrefill: the MoE layer at prefill (epx_moe_prefill, docs/moe.md "MoE layer at
prefill") over one or two epx.Group objects made with expand_max_rows: expert-major dispatch,
the experts' SwiGLU FFN through cuBLAS (or EPX's own FFN), weighted combine, one after another
by default; with two groups and overlap=True the tokens are cut into chunks whose communication
overlaps the other chunks' GEMMs.

The plan holds its groups and experts (Python references keep them alive); destroy it before
its groups. torch is imported lazily.
"""
import ctypes
import weakref

from . import _capi, _tensors, errors
from ._tensors import _torch, data_ptr, invalid_argument
from ._tensors import stream_ptr as _stream_ptr

FFN_BACKENDS = {"auto": 0, "cublas": 1, "epx": 2, "cublas_grouped": 3, "epx_grouped": 4}


def _release_plan(ptr, _groups):
    """The release of a plan nobody destroyed (garbage collection, interpreter exit): the
    finalizer holds its groups (_groups), which keeps them alive until then, so the plan goes
    first. Errors are dropped (a GC callback has nobody to raise to)."""
    _capi.lib.epx_moe_prefill_destroy(ptr)


class MoePrefill:
    """A prefill-layer plan (epx_moe_prefill_create; not collective). groups: one epx.Group or
    a list of one or two with identical configs (normal mode, BF16, expand_max_rows >= R x
    max_tokens_per_rank x min(K, E/R) + 3 E/R); experts: this rank's epx.Experts; num_chunks:
    chunks of an overlapped call (0: 2); ffn_backend: "auto" ("cublas_grouped" for BF16
    weights; for FP8 "epx_grouped" where an expert's GEMM in a chunk is small, as at
    Qwen3-30B-A3B's shape with 4096 tokens a rank, else "cublas", else "epx"; include/epx.h
    says the rule), "cublas" (one GEMM per expert), "cublas_grouped" (BF16 weights:
    one cuBLAS batched GEMM per projection for all experts), "epx_grouped" (FP8 weights: EPX's
    grouped FP8 GEMM, one launch per projection for all experts; Hopper) or "epx"; gemm_sms: SMs
    the overlapped GEMMs are tuned for (0: the GPU's minus the group's num_sms, every SM with
    "epx_grouped"; the batched down projection always uses every SM); gemm_lanes: streams the
    per-expert GEMMs run on at once (0: 4; cuBLAS backends); dispatch_dtype: what crosses NVLink,
    "auto" (FP8 with FP8 weights on cuBLAS or epx_grouped and groups with dtypes including "fp8"), "bf16" or
    "fp8"."""

    def __init__(self, groups, experts, *, num_chunks=0, ffn_backend="auto", gemm_sms=0,
                 gemm_lanes=0, dispatch_dtype="auto"):
        from .experts import Experts
        from .group import Group
        fn = "MoePrefill"
        groups = [groups] if isinstance(groups, Group) else list(groups)
        if not 1 <= len(groups) <= 2 or not all(isinstance(g, Group) for g in groups):
            raise invalid_argument("%s: groups: expected an epx.Group or a list of one or two, "
                                   "got %r" % (fn, groups))
        if not isinstance(experts, Experts):
            raise invalid_argument("%s: experts: expected an epx.Experts, got %r" % (fn, experts))
        if ffn_backend not in FFN_BACKENDS:
            raise invalid_argument("%s: ffn_backend: expected one of %s, got %r" % (
                fn, sorted(FFN_BACKENDS), ffn_backend))
        cfg = _capi.EPX_MOE_PREFILL_CONFIG_INIT()
        cfg.num_chunks, cfg.ffn_backend = num_chunks, FFN_BACKENDS[ffn_backend]
        cfg.gemm_sms, cfg.gemm_lanes = gemm_sms, gemm_lanes
        wires = {"auto": 0, "bf16": _capi.EPX_DTYPE_BF16, "fp8": _capi.EPX_DTYPE_FP8_E4M3}
        if dispatch_dtype not in wires:
            raise invalid_argument("%s: dispatch_dtype: expected one of %s, got %r" % (
                fn, sorted(wires), dispatch_dtype))
        cfg.dispatch_dtype = wires[dispatch_dtype]
        ptrs = (_capi._group * len(groups))(*[g._ptr(fn) for g in groups])
        plan = ctypes.c_void_p()
        _capi.check(_capi.lib.epx_moe_prefill_create(ptrs, len(groups), ctypes.byref(experts._c),
                                                     ctypes.byref(cfg), ctypes.byref(plan)))
        self._plan = plan.value
        self._release = weakref.finalize(self, _release_plan, self._plan, groups)
        self._groups, self._experts = groups, experts
        try:
            self._describe(groups)
        except BaseException:  # a failed query or workspace allocation: no half-made plan left
            try:
                self.destroy()
            except errors.EpxError:
                pass  # the first failure is the one raised
            raise

    def _describe(self, groups):
        info = _capi.EPX_MOE_PREFILL_INFO_INIT()
        _capi.check(_capi.lib.epx_moe_prefill_get_info(self._plan, ctypes.byref(info)))
        self.num_chunks, self.gemm_sms = info.num_chunks, info.gemm_sms
        self.gemm_lanes = info.gemm_lanes
        self.dispatch_dtype = "fp8" if info.dispatch_dtype == _capi.EPX_DTYPE_FP8_E4M3 else "bf16"
        names = {v: k for k, v in FFN_BACKENDS.items()}
        self.ffn_backend = names.get(info.ffn_backend, str(info.ffn_backend))
        self.workspace_bytes = info.workspace_bytes
        g = groups[0]
        self.device, self._dims = g.device, g._dims
        self._workspace = _torch().empty(max(self.workspace_bytes, 256), dtype=_torch().uint8,
                                         device=self.device)

    def _ptr(self, fn):
        if self._plan is None:
            raise errors.EpxInvalidUsage(errors.EPX_ERR_INVALID_USAGE,
                                         "%s: the plan was destroyed" % fn)
        for g in self._groups:  # runs on their workspaces: each must still be usable (not
            g._ptr(fn)  # destroyed, its borrowed communicator still there)
        return self._plan

    def __call__(self, x, topk_idx, topk_weights=None, *, overlap=False, out=None, stream=None):
        """One layer (COLLECTIVE over the plan's groups; the host waits for each chunk's count
        exchange, so not capturable). x [T, H] bf16; topk_idx [T, K] int64/int32; topk_weights
        [T, K] float32 or None (1). overlap: False (the default), the chain on the first group
        (neither overlap has been measured faster than it beyond the noise: docs/moe.md); True,
        chunks over both groups (needs two); "phases", the down projection by source rank with
        each phase's rows sent back while the next computes (EPX's grouped FP8 GEMM only;
        docs/moe.md, "Phases by source"). Returns out [T, H] bf16 (a new tensor unless given)."""
        torch = _torch()
        fn = "MoePrefill"
        if isinstance(overlap, str) and overlap != "phases":
            raise errors.EpxInvalidArgument(errors.EPX_ERR_INVALID_ARGUMENT,
                                            "%s: overlap = %r: True, False or \"phases\""
                                            % (fn, overlap))
        mode = 2 if overlap == "phases" else 1 if overlap else 0
        plan = self._ptr(fn)
        H, K, dev = self._dims.hidden, self._dims.top_k, self.device.index
        _tensors.check_tensor(fn, "x", x, torch.bfloat16, ("T", H), device_index=dev, align=16)
        T = x.shape[0]
        _tensors.check_tensor(fn, "topk_idx", topk_idx, (torch.int64, torch.int32), (T, K),
                              device_index=dev)
        if topk_weights is not None:
            _tensors.check_tensor(fn, "topk_weights", topk_weights, torch.float32, (T, K),
                                  device_index=dev)
        if out is None:
            out = torch.empty((T, self._dims.hidden), dtype=torch.bfloat16, device=self.device)
        else:
            _tensors.check_tensor(fn, "out", out, torch.bfloat16, shape=(T, self._dims.hidden),
                                  align=16, device_index=self.device.index)
        a = _capi.EPX_MOE_PREFILL_ARGS_INIT()
        a.x, a.topk_idx, a.topk_weights = x.data_ptr(), topk_idx.data_ptr(), data_ptr(topk_weights)
        a.topk_idx_dtype = _tensors.epx_dtype(topk_idx.dtype)
        a.num_tokens, a.overlap, a.out = T, mode, out.data_ptr()
        a.workspace, a.workspace_bytes = self._workspace.data_ptr(), self._workspace.numel()
        _capi.check(_capi.lib.epx_moe_prefill(plan, ctypes.byref(a), _stream_ptr(stream)))
        return out

    def destroy(self):
        """Release the plan (idempotent): before its groups are destroyed."""
        if self._plan is not None:
            plan, self._plan = self._plan, None
            self._release.detach()
            self._workspace = None
            _capi.check(_capi.lib.epx_moe_prefill_destroy(plan))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

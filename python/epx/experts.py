"""epx.Experts: the experts' SwiGLU FFN of one GPU (epx_experts_ffn, docs/moe.md) on torch
tensors. Needs no group: out[r] = down_e(silu(gate_e(x[r])) * up_e(x[r])) for the rows of each
expert e, the row counts read on the device (no host synchronization; capturable in a graph).

Lifetimes: the weights are referenced, not copied (keep them unchanged while calls are in
flight). The scratch memory is one tensor per Experts object, reused by every call: calls on
one stream are ordered, calls of one object on two streams at once race (use two objects).
`out` is a fresh tensor unless given; only the experts' rows of it are written.
"""
import ctypes

from . import _capi
from ._tensors import (_torch, check_optional, check_tensor, data_ptr, epx_dtype, invalid_argument,
                       stream_ptr)


class Experts:
    """E experts' weights, row-major with K contiguous (nn.Linear's [out, in]):
    gate_up [E, 2I, H] (expert e's gate rows, then its up rows) and down [E, H, I], both
    torch.bfloat16, or both torch.float8_e4m3fn with float32 block scales gate_up_scales
    [E, 2I/128, H/128] and down_scales [E, H/128, I/128] (DeepSeek-V3's weight_scale_inv)."""

    def __init__(self, gate_up, down, gate_up_scales=None, down_scales=None):
        torch = _torch()
        fn = "epx.Experts"
        check_tensor(fn, "gate_up", gate_up, (torch.bfloat16, torch.float8_e4m3fn),
                     shape=("E", "2I", "H"), align=16)
        if gate_up.shape[1] % 2:
            raise invalid_argument("%s: gate_up: expected an even second dimension (2I), got %d" %
                                   (fn, gate_up.shape[1]))
        E, I, H = gate_up.shape[0], gate_up.shape[1] // 2, gate_up.shape[2]
        check_tensor(fn, "down", down, gate_up.dtype, shape=(E, H, I), align=16,
                     device_index=gate_up.device.index)
        fp8 = gate_up.dtype == torch.float8_e4m3fn
        if fp8:
            check_tensor(fn, "gate_up_scales", gate_up_scales, torch.float32,
                         shape=(E, 2 * I // 128, H // 128), device_index=gate_up.device.index)
            check_tensor(fn, "down_scales", down_scales, torch.float32,
                         shape=(E, H // 128, I // 128), device_index=gate_up.device.index)
        elif gate_up_scales is not None or down_scales is not None:
            raise invalid_argument("%s: scales are for FP8 weights; these are BF16" % fn)
        self.num_experts, self.hidden, self.intermediate = E, H, I
        self.device = gate_up.device
        self._tensors = (gate_up, down, gate_up_scales, down_scales)  # kept alive
        c = _capi.EPX_EXPERTS_INIT()
        c.num_experts, c.hidden, c.intermediate = E, H, I
        c.weight_dtype = epx_dtype(gate_up.dtype)
        c.gate_up, c.down = gate_up.data_ptr(), down.data_ptr()
        c.gate_up_scales, c.down_scales = data_ptr(gate_up_scales), data_ptr(down_scales)
        self._c = c
        self._workspace = None
        # Shapes the library refuses (H or I not a multiple of 128, ...) fail here, by name.
        self.workspace_size(0)

    def workspace_size(self, num_rows, x_dtype=None):
        """Scratch bytes a call over num_rows rows needs (x_dtype: torch.bfloat16 default)."""
        torch = _torch()
        code = epx_dtype(x_dtype or torch.bfloat16)
        out = ctypes.c_size_t()
        _capi.check(_capi.lib.epx_experts_ffn_workspace_size(ctypes.byref(self._c), num_rows, code,
                                                             ctypes.byref(out)))
        return out.value

    def __call__(self, x, expert_count, *, expert_begin=None, x_scales=None, out=None,
                 stream=None):
        """The FFN of every expert's rows; returns out.

        x: [num_rows, H], or [E, rows_per_expert, H] for the masked layout (expert e's rows
        [e * rows_per_expert, + count[e]), as epx_ll_dispatch delivers them); torch.bfloat16,
        or torch.float8_e4m3fn with x_scales [..., H/128] float32 (FP8 weights only).
        expert_count: int32 [E] on the device. expert_begin: int32 [E] (contiguous layout,
        2-D x only). out: like x but torch.bfloat16 (default: a new tensor)."""
        torch = _torch()
        fn = "epx.Experts"
        dev = self.device.index
        check_tensor(fn, "x", x, (torch.bfloat16, torch.float8_e4m3fn), align=16,
                     device_index=dev)
        if x.dim() == 3:
            if expert_begin is not None:
                raise invalid_argument("%s: expert_begin is for a 2-D x (contiguous layout); "
                                       "a 3-D x is the masked layout" % fn)
            check_tensor(fn, "x", x, x.dtype, shape=(self.num_experts, "rows", self.hidden))
            rows_per_expert, num_rows = x.shape[1], x.shape[0] * x.shape[1]
        else:
            check_tensor(fn, "x", x, x.dtype, shape=("rows", self.hidden))
            if expert_begin is None:
                raise invalid_argument("%s: a 2-D x needs expert_begin (or pass x as "
                                       "[E, rows_per_expert, H])" % fn)
            rows_per_expert, num_rows = 0, x.shape[0]
        check_tensor(fn, "expert_count", expert_count, torch.int32, shape=(self.num_experts,),
                     device_index=dev)
        check_optional(fn, "expert_begin", expert_begin, torch.int32,
                       shape=(self.num_experts,), device_index=dev)
        if x.dtype == torch.float8_e4m3fn:
            check_tensor(fn, "x_scales", x_scales, torch.float32,
                         shape=tuple(x.shape[:-1]) + (self.hidden // 128,), device_index=dev)
        if out is None:
            out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
        else:
            check_tensor(fn, "out", out, torch.bfloat16, shape=tuple(x.shape), align=16,
                         device_index=dev)
        need = self.workspace_size(num_rows, x.dtype)
        if self._workspace is None or self._workspace.numel() < need:
            self._workspace = torch.empty(max(need, 256), dtype=torch.uint8, device=x.device)
        a = _capi.EPX_EXPERTS_FFN_ARGS_INIT()
        a.x, a.x_dtype, a.x_scales = x.data_ptr(), epx_dtype(x.dtype), data_ptr(x_scales)
        a.num_rows, a.rows_per_expert = num_rows, rows_per_expert
        a.expert_count, a.expert_begin = expert_count.data_ptr(), data_ptr(expert_begin)
        a.out, a.workspace = out.data_ptr(), self._workspace.data_ptr()
        a.workspace_bytes = self._workspace.numel()
        _capi.check(_capi.lib.epx_experts_ffn(ctypes.byref(self._c), ctypes.byref(a),
                                              stream_ptr(stream)))
        return out

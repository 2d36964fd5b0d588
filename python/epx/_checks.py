"""The tensor checks of each Group call, standalone: a Dims (what the checks need to know of a
group) and the call's tensors in, EpxInvalidArgument ("Group.dispatch: x: expected ..., got
...") out. No GPU and no Group needed (Dims.device_type "cpu" lets tests run them on the host).
torch is imported lazily.
"""
import typing

from . import _capi
from ._tensors import _torch, check_optional, check_tensor, invalid_argument


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


def _check_rows_known(fn, x, count, name):
    """An empty x stands for "no rows" only when the dispatch's count is known on the host: with
    it unknown (sync_counts=False), C would read the rows the dispatch delivered in its place
    (the Group passes valid memory for an empty tensor) and combine them as the expert outputs."""
    if x.numel() == 0 and (count is None or count < 0):
        raise invalid_argument("%s: x is empty, but this rank's %s is unknown on the host (a "
                               "dispatch with sync_counts=False): pass x with the rows the "
                               "dispatch delivered (its recv_x's row count)" % (fn, name))


def check_combine_expand_args(dims, num_tokens, num_rows, x, out=None):
    """Checks combine_expand's tensors: x [>= num_rows, H] bf16 (num_rows -1: unknown on the
    host), out [T, H] bf16 or None."""
    torch = _torch()
    fn, dev, H = "Group.combine_expand", _where(dims), dims.hidden
    check_tensor(fn, "x", x, torch.bfloat16, ("num_rows", H), **dev, align=16)
    if num_rows is not None and num_rows >= 0 and x.shape[0] < num_rows:
        raise invalid_argument("%s: x: expected at least %d rows (the dispatch's num_rows), got "
                               "%d" % (fn, num_rows, x.shape[0]))
    _check_rows_known(fn, x, num_rows, "num_rows")
    check_optional(fn, "out", out, torch.bfloat16, (num_tokens, H), **dev, align=16)


def check_combine_args(dims, num_tokens, num_recv, x, out=None, topk_idx=None,
                       topk_weights=None, recv_topk_weights=None, bias=None):
    """Checks combine's tensors; returns bias as a pair (each a tensor or None)."""
    torch = _torch()
    fn, dev, H, K, T = "Group.combine", _where(dims), dims.hidden, dims.top_k, num_tokens
    check_tensor(fn, "x", x, torch.bfloat16, ("num_recv", H), **dev, align=16)
    if num_recv >= 0 and x.shape[0] < num_recv:
        raise invalid_argument("%s: x: expected at least %d rows (the dispatch's num_recv), got "
                               "%d" % (fn, num_recv, x.shape[0]))
    _check_rows_known(fn, x, num_recv, "num_recv")
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


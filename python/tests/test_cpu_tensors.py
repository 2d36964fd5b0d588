"""Tensor plumbing without a GPU: the __cuda_array_interface__ object, dtype maps, and the
argument checks of every Group call (CPU tensors stand in for CUDA ones: every check but the
device one runs before it, and the device one must refuse them clearly)."""
import pytest

torch = pytest.importorskip("torch")

import epx  # noqa: E402
from epx import _capi, _tensors  # noqa: E402
from epx import group as G  # noqa: E402

DIMS = G.Dims(hidden=256, top_k=2, num_experts=8, num_ranks=2, device_index=0)
# The same group shape with CPU tensors accepted, to reach the checks after the device one.
CPU = DIMS._replace(device_type="cpu", device_index=None)
T = 5


def bf16(*shape):
    return torch.zeros(shape, dtype=torch.bfloat16)


def idx(t=T, k=DIMS.top_k, dtype=torch.int64):
    return torch.zeros((t, k), dtype=dtype)


def test_cuda_array_interface_of_a_device_buffer():
    keep = object()
    buf = _tensors.DeviceBuffer(0x7f0000001000, 4096, keep)
    assert buf.__cuda_array_interface__ == {
        "version": 3, "typestr": "|u1", "shape": (4096,), "data": (0x7f0000001000, False),
        "strides": None, "stream": None}
    assert buf.keepalive is keep


def test_dtype_maps_round_trip():
    for t, code in [(torch.bfloat16, _capi.EPX_DTYPE_BF16),
                    (torch.float8_e4m3fn, _capi.EPX_DTYPE_FP8_E4M3),
                    (torch.int32, _capi.EPX_DTYPE_INT32), (torch.int64, _capi.EPX_DTYPE_INT64),
                    (torch.float32, _capi.EPX_DTYPE_FLOAT32)]:
        assert _tensors.epx_dtype(t) == code and _tensors.torch_dtype(code) is t
    with pytest.raises(epx.EpxInvalidArgument, match="torch.float16 has no EPX equivalent"):
        _tensors.epx_dtype(torch.float16)


def test_zero_size_view_needs_no_pointer():
    v = _tensors.device_view({}, None, 0, torch.bfloat16, (0, 256), "cpu")
    assert v.shape == (0, 256) and v.dtype == torch.bfloat16


def test_cpu_tensors_are_refused_clearly():
    with pytest.raises(epx.EpxInvalidArgument) as info:
        G.check_dispatch_args(DIMS, bf16(T, 256), idx())
    assert str(info.value) == ("Group.dispatch: x: expected a CUDA tensor, got a tensor on cpu "
                               "(EPX_ERR_INVALID_ARGUMENT)")
    with pytest.raises(epx.EpxInvalidArgument, match="Group.layout: topk_idx: expected a CUDA"):
        G.check_layout_args(DIMS, idx())
    with pytest.raises(epx.EpxInvalidArgument, match="Group.ll_dispatch: x: expected a CUDA"):
        G.check_ll_dispatch_args(DIMS, bf16(T, 256), idx())


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("call, needle", [
    (lambda: G.check_dispatch_args(CPU, bf16(T, 255), idx()),
     "Group.dispatch: x: expected shape [T, 256], got [5, 255]"),
    (lambda: G.check_dispatch_args(CPU, torch.zeros(T, 256), idx()),
     "Group.dispatch: x: expected dtype torch.bfloat16 or torch.float8_e4m3fn, got torch.float32"),
    (lambda: G.check_dispatch_args(CPU, bf16(T, 512)[:, ::2], idx()),
     "Group.dispatch: x: expected a contiguous tensor, got strides (512, 2)"),
    (lambda: G.check_dispatch_args(CPU, [[0.0]], idx()),
     "Group.dispatch: x: expected a torch.Tensor, got list"),
    (lambda: G.check_dispatch_args(CPU, bf16(T, 256), torch.zeros(T, 2)),
     "Group.dispatch: topk_idx: expected dtype torch.int64 or torch.int32, got torch.float32"),
    (lambda: G.check_dispatch_args(CPU, bf16(T, 256), idx(t=4)),
     "Group.dispatch: topk_idx: expected shape [5, 2], got [4, 2]"),
    (lambda: G.check_dispatch_args(CPU, bf16(T, 256), None),
     "Group.dispatch: topk_idx: expected a torch.Tensor, got NoneType"),
    (lambda: G.check_dispatch_args(CPU, bf16(T, 256), idx(), torch.zeros(T, 3)),
     "Group.dispatch: topk_weights: expected shape [5, 2], got [5, 3]"),
    (lambda: G.check_dispatch_args(CPU, bf16(T, 256).to(FP8), idx()),
     "Group.dispatch: x_scales: expected a [5, 2] float32 or [5, 1] int32 tensor with float8 "
     "x, got None"),
    (lambda: G.check_dispatch_args(CPU, bf16(T, 256), idx(), x_scales=torch.zeros(T, 2)),
     "Group.dispatch: x_scales: expected None with bfloat16 x"),
    (lambda: G.check_dispatch_args(CPU, bf16(T, 256).to(FP8), idx(), x_scales=torch.zeros(T, 3)),
     "Group.dispatch: x_scales: expected shape [5, 2], got [5, 3]"),
    (lambda: G.check_dispatch_args(CPU, bf16(T, 256).to(FP8), idx(),
                                   x_scales=torch.zeros((T, 2), dtype=torch.int32)),
     "Group.dispatch: x_scales: expected shape [5, 1], got [5, 2]"),
    (lambda: G.check_dispatch_args(CPU, bf16(T, 256), None,
                                   is_token_in_rank=torch.zeros((T, 3), dtype=torch.bool),
                                   num_tokens_per_expert=torch.zeros(8, dtype=torch.int32)),
     "Group.dispatch: is_token_in_rank: expected shape [5, 2], got [5, 3]"),
    (lambda: G.check_dispatch_args(CPU, bf16(T, 256), idx(),
                                   is_token_in_rank=torch.zeros((T, 2), dtype=torch.bool),
                                   num_tokens_per_expert=torch.zeros(8, dtype=torch.int32)),
     "Group.dispatch: topk_idx, topk_weights: expected None when routing by is_token_in_rank"),
    (lambda: G.check_dispatch_args(CPU, bf16(T, 256), None,
                                   is_token_in_rank=torch.zeros((T, 2), dtype=torch.bool)),
     "Group.dispatch: num_tokens_per_expert: expected a torch.Tensor, got NoneType"),
    (lambda: G.check_layout_args(CPU, idx(dtype=torch.int16)),
     "Group.layout: topk_idx: expected dtype torch.int64 or torch.int32, got torch.int16"),
    (lambda: G.check_layout_args(CPU, idx(k=3)),
     "Group.layout: topk_idx: expected shape [T, 2], got [5, 3]"),
    (lambda: G.check_cached_args(CPU, 4, bf16(T, 256)),
     "Group.dispatch_cached: x: expected shape [4, 256], got [5, 256]"),
    (lambda: G.check_cached_args(CPU, T, bf16(T, 256).to(FP8)),
     "Group.dispatch_cached: x_scales: expected a [5, 2] float32"),
    (lambda: G.check_combine_args(CPU, T, 7, bf16(6, 256)),
     "Group.combine: x: expected at least 7 rows (the dispatch's num_recv), got 6"),
    (lambda: G.check_combine_args(CPU, T, -1, bf16(6, 128)),
     "Group.combine: x: expected shape [num_recv, 256], got [6, 128]"),
    (lambda: G.check_combine_args(CPU, T, -1, bf16(6, 256), out=bf16(T, 256).float()),
     "Group.combine: out: expected dtype torch.bfloat16, got torch.float32"),
    (lambda: G.check_combine_args(CPU, T, -1, bf16(6, 256), recv_topk_weights=torch.zeros(5, 2)),
     "Group.combine: recv_topk_weights: expected shape [6, 2], got [5, 2]"),
    (lambda: G.check_combine_args(CPU, T, -1, bf16(6, 256), bias=(bf16(T, 256),) * 3),
     "Group.combine: bias: expected a tensor or a pair, got 3 tensors"),
    (lambda: G.check_combine_args(CPU, T, -1, bf16(6, 256), bias=(bf16(T, 256), bf16(4, 256))),
     "Group.combine: bias[1]: expected shape [5, 256], got [4, 256]"),
    (lambda: G.check_combine_expand_args(CPU, T, 9, bf16(8, 256)),
     "Group.combine_expand: x: expected at least 9 rows (the dispatch's num_rows), got 8"),
    (lambda: G.check_combine_expand_args(CPU, T, -1, bf16(8, 128)),
     "Group.combine_expand: x: expected shape [num_rows, 256], got [8, 128]"),
    (lambda: G.check_combine_expand_args(CPU, T, 8, bf16(8, 256), out=bf16(T + 1, 256)),
     "Group.combine_expand: out: expected shape [5, 256], got [6, 256]"),
    (lambda: G.check_ll_dispatch_args(CPU, bf16(T, 256).to(FP8), idx()),
     "Group.ll_dispatch: x: expected dtype torch.bfloat16, got torch.float8_e4m3fn"),
    (lambda: G.check_ll_dispatch_args(CPU, bf16(T, 256), idx(t=4)),
     "Group.ll_dispatch: topk_idx: expected shape [5, 2], got [4, 2]"),
    (lambda: G.check_ll_combine_args(CPU, T, 16, x=bf16(3, 16, 256)),
     "Group.ll_combine: x: expected shape [4, 16, 256], got [3, 16, 256]"),
    (lambda: G.check_ll_combine_args(CPU, T, 16, out=bf16(T + 1, 256)),
     "Group.ll_combine: out: expected shape [5, 256], got [6, 256]"),
    (lambda: G.check_ll_combine_args(DIMS, T, 16, x=bf16(4, 16, 256)),
     "Group.ll_combine: x: expected a CUDA tensor, got a tensor on cpu"),
])
def test_argument_messages(call, needle):
    with pytest.raises(epx.EpxInvalidArgument) as info:
        call()
    assert needle in str(info.value)
    assert isinstance(info.value, ValueError)


def test_well_formed_arguments_pass_every_other_check():
    x, i, w = bf16(T, 256), idx(), torch.zeros(T, 2)
    assert G.check_dispatch_args(CPU, x, i, w) == (T, _capi.EPX_DTYPE_BF16, 0)
    scales = torch.zeros(2, T).t()  # DeepEP's column-major scales: any strides are fine
    assert G.check_dispatch_args(CPU, x.to(torch.float8_e4m3fn), i, x_scales=scales) == \
        (T, _capi.EPX_DTYPE_FP8_E4M3, _capi.EPX_DTYPE_FLOAT32)
    assert G._scale_strides(scales) == (1, T)
    packed = torch.zeros((T, 1), dtype=torch.int32)
    assert G.check_cached_args(CPU, T, x.to(torch.float8_e4m3fn), packed)[2] == \
        _capi.EPX_DTYPE_INT32
    assert G.check_combine_args(CPU, T, 6, bf16(6, 256), bias=bf16(T, 256))[1] is None
    G.check_combine_expand_args(CPU, T, 6, bf16(6, 256), bf16(T, 256))
    G.check_combine_expand_args(CPU, T, -1, bf16(6, 256))  # count unknown on the host: x's rows are taken
    with pytest.raises(epx.EpxInvalidArgument, match="num_rows is unknown"):  # ... but not an empty x
        G.check_combine_expand_args(CPU, T, -1, bf16(0, 256))
    assert G.check_ll_dispatch_args(CPU, x, i.int(), w) == T
    G.check_ll_combine_args(CPU, T, 16, bf16(4, 16, 256), bf16(T, 256), w)


def test_alignment_is_checked_after_the_device():
    x = bf16(T * 256 + 1)[1:].view(T, 256)  # 2 bytes past a 16-byte boundary
    with pytest.raises(epx.EpxInvalidArgument, match="x: expected a 16-byte aligned data "
                                                     "pointer, got 0x"):
        G.check_ll_dispatch_args(CPU, x, idx())


def test_group_needs_torch_distributed():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(epx.EpxInvalidUsage, match="init_process_group"):
        epx.Group(128, 1024, 16, 4)


def test_device_views_are_cached_fresh_objects_and_bounded(monkeypatch):
    """device_view over host memory (torch.as_tensor of a CUDA array interface needs CUDA: the
    stand-in reads the same pointer on the host). Typed views are cached per (pointer, region,
    dtype, shape) but every call gets its own tensor object; the cache stays bounded and keeps
    working after it is emptied."""
    import ctypes
    host = (ctypes.c_char * 4096)()
    made = []

    def as_tensor(buf, device=None):
        made.append(buf.ptr)
        raw = (ctypes.c_char * buf.nbytes).from_address(buf.ptr)
        return torch.frombuffer(raw, dtype=torch.uint8)

    class Shim:
        def __getattr__(self, name):
            return as_tensor if name == "as_tensor" else getattr(torch, name)

    monkeypatch.setattr(_tensors, "_torch", lambda: Shim())
    ptr, cache, keep = ctypes.addressof(host), {}, object()
    a = _tensors.device_view(cache, keep, ptr, torch.int32, (4, 8), "cpu", region_bytes=4096)
    a.fill_(7)
    b = _tensors.device_view(cache, keep, ptr, torch.int32, (4, 8), "cpu", region_bytes=4096)
    assert a is not b and torch.equal(a, b) and a.data_ptr() == b.data_ptr() == ptr
    b.unsqueeze_(0)  # a caller's metadata change does not reach the next call
    c = _tensors.device_view(cache, keep, ptr, torch.int32, (4, 8), "cpu", region_bytes=4096)
    assert c.shape == (4, 8) and len(made) == 1
    for rows in range(1, 600):  # varying row counts, as normal-mode receive arrays have
        v = _tensors.device_view(cache, keep, ptr, torch.uint8, (rows % 4000 + 1,), "cpu",
                                 region_bytes=4096)
        assert v.shape == (rows % 4000 + 1,) and v.data_ptr() == ptr
    assert len(cache) <= _tensors._MAX_CACHED_VIEWS and len(made) == 1  # the base survived
    d = _tensors.device_view(cache, keep, ptr, torch.int32, (4, 8), "cpu", region_bytes=4096)
    assert int(d[3, 7]) == 7

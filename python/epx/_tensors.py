"""Torch tensors over EPX's device memory, without copies, and the checks of tensor arguments.

A device pointer becomes a tensor through __cuda_array_interface__ on a uint8 buffer, then
.view(dtype).view(shape): the interface has no typestr for bfloat16 or float8, bytes have one.
The uint8 base tensors are cached per (pointer, bytes) by their owner (a Group or a Handle), so
repeated calls cost two views. Each base tensor keeps its owner's native resources alive (the
buffer object below holds them, and torch holds the buffer object for as long as the memory is
viewed), so a view never outlives the memory it shows. torch is imported lazily: importing this
module needs no torch.
"""
import math

from . import _capi, errors


def _torch():
    import torch
    return torch


# torch dtype <-> epx_dtype_t (built on first use, torch being optional at import).
_EPX_OF_TORCH = None


def _dtype_maps():
    global _EPX_OF_TORCH
    if _EPX_OF_TORCH is None:
        torch = _torch()
        _EPX_OF_TORCH = {
            torch.bfloat16: _capi.EPX_DTYPE_BF16,
            torch.float8_e4m3fn: _capi.EPX_DTYPE_FP8_E4M3,
            torch.int32: _capi.EPX_DTYPE_INT32,
            torch.int64: _capi.EPX_DTYPE_INT64,
            torch.float32: _capi.EPX_DTYPE_FLOAT32,
        }
    return _EPX_OF_TORCH


def epx_dtype(torch_dtype):
    """The epx_dtype_t of a torch dtype; EpxInvalidArgument if EPX has none."""
    code = _dtype_maps().get(torch_dtype)
    if code is None:
        raise invalid_argument("epx_dtype: torch dtype %s has no EPX equivalent" % torch_dtype)
    return code


def torch_dtype(epx_code):
    """The torch dtype of an epx_dtype_t value."""
    for t, code in _dtype_maps().items():
        if code == epx_code:
            return t
    raise invalid_argument("torch_dtype: %r is not an epx_dtype_t value" % (epx_code,))


def invalid_argument(message):
    return errors.EpxInvalidArgument(errors.EPX_ERR_INVALID_ARGUMENT, message)


class DeviceBuffer:
    """`nbytes` bytes of device memory at `ptr`, as torch.as_tensor reads it (CAI version 3);
    holds `keepalive` (the native owner of the memory) for as long as torch holds this."""

    __slots__ = ("ptr", "nbytes", "keepalive")

    def __init__(self, ptr, nbytes, keepalive):
        self.ptr = int(ptr)
        self.nbytes = int(nbytes)
        self.keepalive = keepalive

    @property
    def __cuda_array_interface__(self):
        # stream None: no synchronization; EPX's memory is ordered by the caller's streams.
        return {"version": 3, "typestr": "|u1", "shape": (self.nbytes,),
                "data": (self.ptr, False), "strides": None, "stream": None}


def device_view(cache, keepalive, ptr, dtype, shape, device, region_bytes=0):
    """A `dtype` tensor of `shape` over device memory at `ptr`, no copy.

    cache: the owner's dict of uint8 base tensors; keepalive: what every view keeps alive;
    region_bytes: the array's full extent (e.g. its capacity), so that views of varying row
    counts share one cached base tensor."""
    shape = tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    region = max(int(region_bytes), nbytes)
    if region == 0 or (nbytes == 0 and not ptr):
        return _torch().empty(shape, dtype=dtype, device=device)
    if not ptr:
        raise errors.EpxInternalError(errors.EPX_ERR_INTERNAL,
                                      "device_view: EPX returned NULL for a %s array of shape %s"
                                      % (dtype, list(shape)))
    # The typed view of the same (pointer, region, dtype, shape) is cached too, and handed out
    # as a fresh detach() of it: one cheap op (1.6 us on a CPU where slice + view + view took
    # 10 us) instead of three, per array and call; a low-latency dispatch returns 7 arrays at two
    # fixed addresses, so Python time per call drops below the kernels'. detach() gives every
    # caller its own tensor object (metadata changes on it do not reach the cache).
    key = (ptr, region, dtype, shape)
    typed = cache.get(key)
    if typed is None:
        # An empty view still points into the region: C refuses NULL even for 0 rows.
        base = cache.get((ptr, region))
        if base is None:
            base = _torch().as_tensor(DeviceBuffer(ptr, region, keepalive), device=device)
            cache[(ptr, region)] = base
        typed = (base[:nbytes] if region != nbytes else base).view(dtype).view(shape)
        if len(cache) >= _MAX_CACHED_VIEWS:  # row counts vary in normal mode: stay bounded
            cache.clear()
            cache[(ptr, region)] = base
        cache[key] = typed
    return typed.detach()


# Typed views cached per owner before the cache is emptied (normal-mode row counts vary).
_MAX_CACHED_VIEWS = 256


# ---------------------------------------------------------------------------------------------
# Argument checks: "Group.dispatch: x: expected ..., got ..." (EpxInvalidArgument).
# ---------------------------------------------------------------------------------------------
def _shape_text(shape):
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_tensor(fn, name, t, dtypes, shape=None, device_index=None, contiguous=True, align=None,
                 device_type="cuda"):
    """Check one tensor argument and return it.

    dtypes: a torch dtype or a tuple of them; shape: a tuple of ints (must match) and strings
    (any size; the string names the dimension in the message); device_index: the CUDA device it
    must be on (None: any CUDA device); align: bytes the data pointer must be a multiple of
    (default: the element size); device_type: "cuda" (tests of the other checks pass "cpu").
    Checked in this order: type, dtype, shape, contiguity, device, alignment."""
    torch = _torch()
    where = "%s: %s" % (fn, name)
    if not isinstance(t, torch.Tensor):
        raise invalid_argument("%s: expected a torch.Tensor, got %s" % (where, type(t).__name__))
    if not isinstance(dtypes, tuple):
        dtypes = (dtypes,)
    if t.dtype not in dtypes:
        raise invalid_argument("%s: expected dtype %s, got %s" %
                               (where, " or ".join(str(d) for d in dtypes), t.dtype))
    if shape is not None:
        ok = t.dim() == len(shape) and all(
            isinstance(want, str) or want == got for want, got in zip(shape, t.shape))
        if not ok:
            raise invalid_argument("%s: expected shape %s, got %s" %
                                   (where, _shape_text(shape), _shape_text(t.shape)))
    if contiguous and not t.is_contiguous():
        raise invalid_argument("%s: expected a contiguous tensor, got strides %s" %
                               (where, tuple(t.stride())))
    if t.device.type != device_type:
        raise invalid_argument("%s: expected a %s tensor, got a tensor on %s" %
                               (where, "CUDA" if device_type == "cuda" else device_type, t.device))
    if device_type == "cuda" and device_index is not None and t.device.index != device_index:
        raise invalid_argument("%s: expected a tensor on cuda:%d (the group's device), got %s" %
                               (where, device_index, t.device))
    align = align or t.element_size()
    if t.numel() > 0 and t.data_ptr() % align != 0:
        raise invalid_argument("%s: expected a %d-byte aligned data pointer, got 0x%x" %
                               (where, align, t.data_ptr()))
    return t


def check_optional(fn, name, t, *args, **kwargs):
    """check_tensor, with None allowed (and returned)."""
    return None if t is None else check_tensor(fn, name, t, *args, **kwargs)


def stream_ptr(stream):
    """cudaStream_t of a torch.cuda.Stream (or a raw int); None: the current stream."""
    if stream is None:
        return _torch().cuda.current_stream().cuda_stream
    return stream if isinstance(stream, int) else stream.cuda_stream


def data_ptr(t):
    """The device address of a tensor, None (NULL) for None."""
    return None if t is None else t.data_ptr()

"""ctypes binding of libepx: loads the library, mirrors every struct of include/epx.h, declares
every exported function's prototype, and maps a failed status to an exception (check).

The mirrors must match the C layout exactly: the library checks each struct's `size` field
against its own sizeof, and python/tests/test_cpu_structs.py compiles a C program that prints
the C offsets and compares them with these. Needs no torch.
"""
import ctypes
import os
import pathlib

from . import errors

# ---------------------------------------------------------------------------------------------
# Constants of epx.h (the header these mirrors were written against).
# ---------------------------------------------------------------------------------------------
EPX_VERSION_MAJOR, EPX_VERSION_MINOR, EPX_VERSION_PATCH = 0, 1, 1
EPX_VERSION_CODE = EPX_VERSION_MAJOR * 10000 + EPX_VERSION_MINOR * 100 + EPX_VERSION_PATCH

EPX_DTYPE_BF16 = 1 << 0
EPX_DTYPE_FP8_E4M3 = 1 << 1
EPX_DTYPE_INT32 = 1 << 2
EPX_DTYPE_INT64 = 1 << 3
EPX_DTYPE_FLOAT32 = 1 << 4

EPX_MODE_NORMAL = 1 << 0
EPX_MODE_LOW_LATENCY = 1 << 1

EPX_LL_ROUTE_AUTO = 0
EPX_LL_ROUTE_DIRECT = 1
EPX_LL_ROUTE_BY_RANK = 2
EPX_LL_ROUTE_DISPATCH_BY_RANK = 3

EPX_EXPAND_FAN_OUT_AUTO = 0
EPX_EXPAND_FAN_OUT_AFTER = 1
EPX_EXPAND_FAN_OUT_DURING = 2

EPX_STAGE_NONE, EPX_STAGE_LAYOUT, EPX_STAGE_BARRIER, EPX_STAGE_NOTIFY = 0, 1, 2, 3
EPX_STAGE_DISPATCH, EPX_STAGE_COMBINE, EPX_STAGE_LL_DISPATCH, EPX_STAGE_LL_COMBINE = 4, 5, 6, 7

EPX_MAX_RANKS = 8
EPX_MAX_TOP_K = 16
EPX_MAX_EXPERTS = 1024
EPX_MAX_HIDDEN = 32768
EPX_MAX_TOKENS_PER_RANK = 65536
EPX_AUTO = 0

# C enums are int-sized on every ABI EPX supports.
c_enum = ctypes.c_int
_ptr = ctypes.c_void_p  # every pointer field: Python fills them with integer addresses


# ---------------------------------------------------------------------------------------------
# Struct mirrors, field for field in epx.h order.
# ---------------------------------------------------------------------------------------------
class epx_group_config_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("version", ctypes.c_int),
        ("max_tokens_per_rank", ctypes.c_int),
        ("hidden", ctypes.c_int),
        ("num_experts", ctypes.c_int),
        ("top_k", ctypes.c_int),
        ("dtypes", ctypes.c_uint),
        ("modes", ctypes.c_uint),
        ("num_sms", ctypes.c_int),
        ("timeout_ms", ctypes.c_int),
        ("ll_num_sms", ctypes.c_int),
        ("ll_route", ctypes.c_int),
        ("ll_max_tokens_per_rank", ctypes.c_int),
        ("expand_max_rows", ctypes.c_int),
        ("expand_fan_out", ctypes.c_int),
    ]


class epx_workspace_sizes_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("total_bytes", ctypes.c_size_t),
        ("common_bytes", ctypes.c_size_t),
        ("normal_bytes", ctypes.c_size_t),
        ("low_latency_bytes", ctypes.c_size_t),
    ]


class epx_async_error_t(ctypes.Structure):
    _fields_ = [
        ("status", c_enum),
        ("stage", c_enum),
        ("peer", ctypes.c_int),
        ("position", ctypes.c_longlong),
        ("value", ctypes.c_longlong),
        ("message", ctypes.c_char * 256),
    ]


class epx_layout_args_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("topk_idx", _ptr),
        ("topk_idx_dtype", c_enum),
        ("num_tokens", ctypes.c_int),
        ("num_tokens_per_rank", _ptr),
        ("num_tokens_per_expert", _ptr),
        ("is_token_in_rank", _ptr),
        ("token_pos_in_rank", _ptr),
    ]


class epx_dispatch_args_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("x", _ptr),
        ("x_dtype", c_enum),
        ("x_scales", _ptr),
        ("topk_idx", _ptr),
        ("topk_idx_dtype", c_enum),
        ("topk_weights", _ptr),
        ("num_tokens", ctypes.c_int),
        ("expert_alignment", ctypes.c_int),
        ("sync_counts", ctypes.c_int),
        ("num_recv_per_expert", _ptr),
        ("is_token_in_rank", _ptr),
        ("num_tokens_per_expert", _ptr),
        ("num_worst_tokens", ctypes.c_int),
        ("recv_topk_idx_dtype", c_enum),
        ("x_scales_dtype", c_enum),
        ("x_scales_stride_token", ctypes.c_int),
        ("x_scales_stride_group", ctypes.c_int),
    ]


class epx_dispatch_result_t(ctypes.Structure):
    _fields_ = [
        ("num_recv", ctypes.c_int),
        ("capacity", ctypes.c_int),
        ("recv_x", _ptr),
        ("recv_x_scales", _ptr),
        ("recv_topk_idx", _ptr),
        ("recv_topk_weights", _ptr),
        ("recv_src_token", _ptr),
        ("recv_rank_prefix", _ptr),
        ("num_recv_device", _ptr),
        ("num_recv_per_expert_device", _ptr),
        ("rank_prefix_matrix_device", _ptr),
        ("recv_topk_idx_int64", _ptr),
        ("recv_x_scales_packed", _ptr),
    ]


class epx_combine_args_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("x", _ptr),
        ("topk_idx", _ptr),
        ("topk_idx_dtype", c_enum),
        ("topk_weights", _ptr),
        ("out", _ptr),
        ("recv_topk_weights", _ptr),
        ("out_topk_weights", _ptr),
        ("bias", _ptr * 2),
    ]


class epx_dispatch_expand_result_t(ctypes.Structure):
    _fields_ = [
        ("num_rows", ctypes.c_int),
        ("num_recv", ctypes.c_int),
        ("capacity", ctypes.c_int),
        ("num_local_experts", ctypes.c_int),
        ("recv_x", _ptr),
        ("recv_x_scales", _ptr),
        ("recv_x_scales_packed", _ptr),
        ("recv_src_info", _ptr),
        ("recv_weights", _ptr),
        ("expert_begin_device", _ptr),
        ("expert_count_device", _ptr),
        ("num_rows_device", _ptr),
        ("token_rows", _ptr),
        ("recv_rank_prefix", _ptr),
        ("num_recv_device", _ptr),
        ("expert_ready", _ptr),
        ("counts_event", _ptr),
    ]


class epx_combine_expand_args_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("x", _ptr),
        ("weighted", ctypes.c_int),
        ("out", _ptr),
    ]


class epx_ll_hook_t(ctypes.Structure):
    _fields_ = [("id", ctypes.c_ulonglong)]


class epx_ll_dispatch_args_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("x", _ptr),
        ("topk_idx", _ptr),
        ("topk_idx_dtype", c_enum),
        ("topk_weights", _ptr),
        ("num_tokens", ctypes.c_int),
        ("recv_dtype", c_enum),
        ("ue8m0", ctypes.c_int),
        ("split", ctypes.c_int),
        ("packed", ctypes.c_int),
        ("ue8m0_packed", ctypes.c_int),
        ("layout_range", _ptr),
    ]


class epx_ll_dispatch_result_t(ctypes.Structure):
    _fields_ = [
        ("num_tokens", ctypes.c_int),
        ("num_local_experts", ctypes.c_int),
        ("rows_per_expert", ctypes.c_int),
        ("max_tokens_per_rank", ctypes.c_int),
        ("recv_dtype", c_enum),
        ("recv_x", _ptr),
        ("recv_x_scales", _ptr),
        ("recv_src_info", _ptr),
        ("recv_count", _ptr),
        ("recv_begin", _ptr),
        ("recv_num", _ptr),
        ("combine_input", _ptr),
        ("buffer", ctypes.c_int),
        ("call_id", ctypes.c_ulonglong),
        ("hook", epx_ll_hook_t),
        ("packed", ctypes.c_int),
        ("recv_x_scales_packed", _ptr),
    ]


class epx_ll_combine_args_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("x", _ptr),
        ("dispatch", ctypes.POINTER(epx_ll_dispatch_result_t)),
        ("out", _ptr),
        ("split", ctypes.c_int),
        ("hook", ctypes.POINTER(epx_ll_hook_t)),
        ("topk_weights", _ptr),
    ]


class epx_trace_summary_t(ctypes.Structure):
    _fields_ = [
        ("num_events", ctypes.c_longlong),
        ("num_dropped", ctypes.c_longlong),
        ("clock_spread_ns", ctypes.c_longlong),
        ("clock_drift_ns", ctypes.c_longlong),
        ("timer_tick_ns", ctypes.c_longlong),
    ]


class epx_experts_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("num_experts", ctypes.c_int),
        ("hidden", ctypes.c_int),
        ("intermediate", ctypes.c_int),
        ("weight_dtype", c_enum),
        ("gate_up", _ptr),
        ("gate_up_scales", _ptr),
        ("down", _ptr),
        ("down_scales", _ptr),
    ]


class epx_experts_ffn_args_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("x", _ptr),
        ("x_dtype", c_enum),
        ("x_scales", _ptr),
        ("num_rows", ctypes.c_int),
        ("expert_count", _ptr),
        ("expert_begin", _ptr),
        ("rows_per_expert", ctypes.c_int),
        ("out", _ptr),
        ("workspace", _ptr),
        ("workspace_bytes", ctypes.c_size_t),
    ]


class epx_moe_args_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("x", _ptr),
        ("topk_idx", _ptr),
        ("topk_idx_dtype", c_enum),
        ("topk_weights", _ptr),
        ("num_tokens", ctypes.c_int),
        ("dispatch_dtype", c_enum),
        ("out", _ptr),
        ("workspace", _ptr),
        ("workspace_bytes", ctypes.c_size_t),
    ]


class epx_moe_prefill_config_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("num_chunks", ctypes.c_int),
        ("ffn_backend", ctypes.c_int),
        ("gemm_sms", ctypes.c_int),
        ("gemm_lanes", ctypes.c_int),
        ("dispatch_dtype", ctypes.c_int),
    ]


class epx_moe_prefill_info_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("num_chunks", ctypes.c_int),
        ("num_groups", ctypes.c_int),
        ("ffn_backend", ctypes.c_int),
        ("gemm_sms", ctypes.c_int),
        ("gate_up_out_fp32", ctypes.c_int),
        ("expert_alignment", ctypes.c_int),
        ("workspace_bytes", ctypes.c_size_t),
        ("gemm_lanes", ctypes.c_int),
        ("dispatch_dtype", ctypes.c_int),
    ]


class epx_moe_prefill_args_t(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("x", _ptr),
        ("topk_idx", _ptr),
        ("topk_idx_dtype", c_enum),
        ("topk_weights", _ptr),
        ("num_tokens", ctypes.c_int),
        ("overlap", ctypes.c_int),
        ("out", _ptr),
        ("workspace", _ptr),
        ("workspace_bytes", ctypes.c_size_t),
    ]


# Every struct of epx.h, by its C name (the layout test walks this).
STRUCTS = {
    cls.__name__: cls
    for cls in (epx_group_config_t, epx_workspace_sizes_t, epx_async_error_t, epx_layout_args_t,
                epx_dispatch_args_t, epx_dispatch_result_t, epx_combine_args_t,
                epx_dispatch_expand_result_t, epx_combine_expand_args_t, epx_ll_hook_t,
                epx_ll_dispatch_args_t, epx_ll_dispatch_result_t, epx_ll_combine_args_t,
                epx_trace_summary_t, epx_experts_t, epx_experts_ffn_args_t, epx_moe_args_t,
                epx_moe_prefill_config_t, epx_moe_prefill_info_t, epx_moe_prefill_args_t)
}


# The *_INIT macros: the same field values (ctypes zero-fills the rest).
def EPX_GROUP_CONFIG_INIT():
    return epx_group_config_t(size=ctypes.sizeof(epx_group_config_t), version=EPX_VERSION_CODE)


def EPX_WORKSPACE_SIZES_INIT():
    return epx_workspace_sizes_t(size=ctypes.sizeof(epx_workspace_sizes_t))


def EPX_LAYOUT_ARGS_INIT():
    return epx_layout_args_t(size=ctypes.sizeof(epx_layout_args_t), topk_idx_dtype=EPX_DTYPE_INT64)


def EPX_DISPATCH_ARGS_INIT():
    return epx_dispatch_args_t(size=ctypes.sizeof(epx_dispatch_args_t), x_dtype=EPX_DTYPE_BF16,
                               topk_idx_dtype=EPX_DTYPE_INT64, sync_counts=1,
                               recv_topk_idx_dtype=EPX_DTYPE_INT32,
                               x_scales_dtype=EPX_DTYPE_FLOAT32)


def EPX_COMBINE_ARGS_INIT():
    return epx_combine_args_t(size=ctypes.sizeof(epx_combine_args_t),
                              topk_idx_dtype=EPX_DTYPE_INT64)


def EPX_COMBINE_EXPAND_ARGS_INIT():
    return epx_combine_expand_args_t(size=ctypes.sizeof(epx_combine_expand_args_t), weighted=1)


def EPX_LL_DISPATCH_ARGS_INIT():
    return epx_ll_dispatch_args_t(size=ctypes.sizeof(epx_ll_dispatch_args_t),
                                  topk_idx_dtype=EPX_DTYPE_INT64, recv_dtype=EPX_DTYPE_BF16)


def EPX_LL_COMBINE_ARGS_INIT():
    return epx_ll_combine_args_t(size=ctypes.sizeof(epx_ll_combine_args_t))


def EPX_EXPERTS_INIT():
    return epx_experts_t(size=ctypes.sizeof(epx_experts_t), weight_dtype=EPX_DTYPE_BF16)


def EPX_EXPERTS_FFN_ARGS_INIT():
    return epx_experts_ffn_args_t(size=ctypes.sizeof(epx_experts_ffn_args_t),
                                  x_dtype=EPX_DTYPE_BF16)


def EPX_MOE_ARGS_INIT():
    return epx_moe_args_t(size=ctypes.sizeof(epx_moe_args_t), topk_idx_dtype=EPX_DTYPE_INT64,
                          dispatch_dtype=EPX_DTYPE_BF16)


def EPX_MOE_PREFILL_CONFIG_INIT():
    return epx_moe_prefill_config_t(size=ctypes.sizeof(epx_moe_prefill_config_t))


def EPX_MOE_PREFILL_INFO_INIT():
    return epx_moe_prefill_info_t(size=ctypes.sizeof(epx_moe_prefill_info_t))


def EPX_MOE_PREFILL_ARGS_INIT():
    return epx_moe_prefill_args_t(size=ctypes.sizeof(epx_moe_prefill_args_t),
                                  topk_idx_dtype=EPX_DTYPE_INT64, overlap=0)


INITS = {
    "EPX_GROUP_CONFIG_INIT": (epx_group_config_t, EPX_GROUP_CONFIG_INIT),
    "EPX_WORKSPACE_SIZES_INIT": (epx_workspace_sizes_t, EPX_WORKSPACE_SIZES_INIT),
    "EPX_LAYOUT_ARGS_INIT": (epx_layout_args_t, EPX_LAYOUT_ARGS_INIT),
    "EPX_DISPATCH_ARGS_INIT": (epx_dispatch_args_t, EPX_DISPATCH_ARGS_INIT),
    "EPX_COMBINE_ARGS_INIT": (epx_combine_args_t, EPX_COMBINE_ARGS_INIT),
    "EPX_COMBINE_EXPAND_ARGS_INIT": (epx_combine_expand_args_t, EPX_COMBINE_EXPAND_ARGS_INIT),
    "EPX_LL_DISPATCH_ARGS_INIT": (epx_ll_dispatch_args_t, EPX_LL_DISPATCH_ARGS_INIT),
    "EPX_LL_COMBINE_ARGS_INIT": (epx_ll_combine_args_t, EPX_LL_COMBINE_ARGS_INIT),
    "EPX_EXPERTS_INIT": (epx_experts_t, EPX_EXPERTS_INIT),
    "EPX_EXPERTS_FFN_ARGS_INIT": (epx_experts_ffn_args_t, EPX_EXPERTS_FFN_ARGS_INIT),
    "EPX_MOE_ARGS_INIT": (epx_moe_args_t, EPX_MOE_ARGS_INIT),
    "EPX_MOE_PREFILL_CONFIG_INIT": (epx_moe_prefill_config_t, EPX_MOE_PREFILL_CONFIG_INIT),
    "EPX_MOE_PREFILL_INFO_INIT": (epx_moe_prefill_info_t, EPX_MOE_PREFILL_INFO_INIT),
    "EPX_MOE_PREFILL_ARGS_INIT": (epx_moe_prefill_args_t, EPX_MOE_PREFILL_ARGS_INIT),
}

# ---------------------------------------------------------------------------------------------
# Loading the library.
# ---------------------------------------------------------------------------------------------
_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
# python/epx/_capi.py -> the repository root, when running from a source tree.
_REPO_DIR = _PACKAGE_DIR.parent.parent


def library_candidates():
    """Where libepx.so is looked for, in order: $EPX_LIBRARY, the package's copy (pip install),
    the source tree's build (make lib)."""
    env = os.environ.get("EPX_LIBRARY")
    if env:
        return [pathlib.Path(env)]  # an explicit choice: no silent fallback
    return [_PACKAGE_DIR / "_lib" / "libepx.so", _REPO_DIR / "build" / "lib" / "libepx.so"]


def _load():
    tried = library_candidates()
    for path in tried:
        if not path.is_file():
            continue
        try:
            return ctypes.CDLL(str(path)), path
        except OSError as e:
            raise ImportError(
                "epx: cannot load %s: %s. libepx needs libcudart and libnccl.so.2: import torch "
                "before epx, or add their directories to LD_LIBRARY_PATH" % (path, e)) from e
    raise ImportError(
        "epx: libepx.so not found; tried: %s. Install the package with `pip install "
        "--no-build-isolation <epx source tree>`, or run `make lib` in the source tree, or set "
        "EPX_LIBRARY=/path/to/libepx.so" % ", ".join(str(p) for p in tried))


lib, library_path = _load()

_c_int_p = ctypes.POINTER(ctypes.c_int)
_c_uint_p = ctypes.POINTER(ctypes.c_uint)
_c_size_t_p = ctypes.POINTER(ctypes.c_size_t)
_handle_p = ctypes.POINTER(ctypes.c_void_p)  # epx_group_t* / epx_handle_t*
_stream = ctypes.c_void_p  # cudaStream_t
_group = ctypes.c_void_p  # epx_group_t
_handle = ctypes.c_void_p  # epx_handle_t
P = ctypes.POINTER

# name: (restype, argtypes), one entry per function of epx.h.
PROTOTYPES = {
    "epx_get_version": (c_enum, [_c_int_p]),
    "epx_get_nccl_version": (c_enum, [_c_int_p, _c_int_p]),
    "epx_status_string": (ctypes.c_char_p, [c_enum]),
    "epx_last_error": (ctypes.c_char_p, []),
    "epx_workspace_size": (c_enum, [P(epx_group_config_t), ctypes.c_int, _c_size_t_p]),
    "epx_workspace_size_by_mode": (c_enum, [P(epx_group_config_t), ctypes.c_int,
                                            P(epx_workspace_sizes_t)]),
    "epx_config_validate": (c_enum, [P(epx_group_config_t), ctypes.c_int]),
    "epx_group_create": (c_enum, [ctypes.c_void_p, P(epx_group_config_t), _handle_p]),
    "epx_group_destroy": (c_enum, [_group]),
    "epx_group_rank": (c_enum, [_group, _c_int_p]),
    "epx_group_size": (c_enum, [_group, _c_int_p]),
    "epx_group_get_config": (c_enum, [_group, P(epx_group_config_t)]),
    "epx_group_workspace_bytes": (c_enum, [_group, _c_size_t_p]),
    "epx_group_barrier": (c_enum, [_group, _stream]),
    "epx_group_barrier_unmasked": (c_enum, [_group, _stream]),
    "epx_group_get_async_error": (c_enum, [_group, P(epx_async_error_t)]),
    "epx_group_clear_async_error": (c_enum, [_group]),
    "epx_layout": (c_enum, [_group, P(epx_layout_args_t), _stream]),
    "epx_handle_create": (c_enum, [_group, _handle_p]),
    "epx_handle_destroy": (c_enum, [_handle]),
    "epx_dispatch": (c_enum, [_group, _handle, P(epx_dispatch_args_t),
                              P(epx_dispatch_result_t), _stream]),
    "epx_dispatch_cached": (c_enum, [_group, _handle, ctypes.c_void_p, c_enum, ctypes.c_void_p,
                                     P(epx_dispatch_result_t), _stream]),
    "epx_dispatch_cached_args": (c_enum, [_group, _handle, P(epx_dispatch_args_t),
                                          P(epx_dispatch_result_t), _stream]),
    "epx_combine": (c_enum, [_group, _handle, P(epx_combine_args_t), _stream]),
    "epx_dispatch_expand": (c_enum, [_group, _handle, P(epx_dispatch_args_t),
                                     P(epx_dispatch_expand_result_t), _stream]),
    "epx_combine_expand": (c_enum, [_group, _handle, P(epx_combine_expand_args_t), _stream]),
    "epx_ll_dispatch": (c_enum, [_group, P(epx_ll_dispatch_args_t),
                                 P(epx_ll_dispatch_result_t), _stream]),
    "epx_ll_combine": (c_enum, [_group, P(epx_ll_combine_args_t), _stream]),
    "epx_ll_recv": (c_enum, [_group, P(epx_ll_hook_t), _stream]),
    "epx_group_get_peer_mask": (c_enum, [_group, _c_uint_p]),
    "epx_group_mask_peer": (c_enum, [_group, ctypes.c_int, _stream]),
    "epx_group_clear_peer_mask": (c_enum, [_group]),
    "epx_trace_start": (c_enum, [_group, ctypes.c_int, _stream]),
    "epx_trace_dump": (c_enum, [_group, ctypes.c_char_p, P(epx_trace_summary_t), _stream]),
    "epx_experts_ffn_workspace_size": (c_enum, [P(epx_experts_t), ctypes.c_int, c_enum,
                                                _c_size_t_p]),
    "epx_experts_ffn": (c_enum, [P(epx_experts_t), P(epx_experts_ffn_args_t), _stream]),
    "epx_moe_workspace_size": (c_enum, [_group, P(epx_experts_t), c_enum, _c_size_t_p]),
    "epx_moe_decode": (c_enum, [_group, P(epx_experts_t), P(epx_moe_args_t), _stream]),
    "epx_moe_prefill_create": (c_enum, [ctypes.POINTER(_group), ctypes.c_int, P(epx_experts_t),
                                        P(epx_moe_prefill_config_t),
                                        ctypes.POINTER(ctypes.c_void_p)]),
    "epx_moe_prefill_destroy": (c_enum, [ctypes.c_void_p]),
    "epx_moe_prefill_get_info": (c_enum, [ctypes.c_void_p, P(epx_moe_prefill_info_t)]),
    "epx_moe_prefill_workspace_size": (c_enum, [ctypes.c_void_p, _c_size_t_p]),
    "epx_moe_prefill": (c_enum, [ctypes.c_void_p, P(epx_moe_prefill_args_t), _stream]),
}

for _name, (_restype, _argtypes) in PROTOTYPES.items():
    _fn = getattr(lib, _name)  # AttributeError here: the library predates this binding
    _fn.restype = _restype
    _fn.argtypes = _argtypes


# ---------------------------------------------------------------------------------------------
# Status handling.
# ---------------------------------------------------------------------------------------------
def last_error():
    """epx_last_error() of this thread, as text."""
    return lib.epx_last_error().decode("utf-8", errors="replace")


def status_string(status):
    return lib.epx_status_string(status).decode("utf-8", errors="replace")


def check(status):
    """Raise the EpxError subclass of a failed status, with EPX's message; EPX_OK passes."""
    if status != errors.EPX_OK:
        raise errors.error_for(status, last_error() or status_string(status))


def version_string(code):
    """EPX_VERSION_CODE -> "major.minor.patch"."""
    return "%d.%d.%d" % (code // 10000, code // 100 % 100, code % 100)


def library_version():
    v = ctypes.c_int()
    check(lib.epx_get_version(ctypes.byref(v)))
    return v.value


def nccl_versions():
    """(built, loaded): NCCL_VERSION_CODE of EPX's headers and of the process's libnccl."""
    built, loaded = ctypes.c_int(), ctypes.c_int()
    check(lib.epx_get_nccl_version(ctypes.byref(built), ctypes.byref(loaded)))
    return built.value, loaded.value


def built_nccl_version():
    built = ctypes.c_int()
    check(lib.epx_get_nccl_version(ctypes.byref(built), None))
    return built.value

"""Group configuration without a GPU: keyword arguments -> epx_group_config_t (make_config),
the config back as a dict of C field names (config_dict), the workspace size of a config
(workspace_size), and the names the keywords accept (MODE_NAMES, LL_ROUTE_NAMES, DTYPE_NAMES).

Needs neither torch nor a GPU, only libepx. Calls go through _capi.lib at call time.
"""
import ctypes

from . import _capi
from ._tensors import invalid_argument

MODE_NAMES = {"normal": _capi.EPX_MODE_NORMAL, "low_latency": _capi.EPX_MODE_LOW_LATENCY}
LL_ROUTE_NAMES = {"auto": _capi.EPX_LL_ROUTE_AUTO, "direct": _capi.EPX_LL_ROUTE_DIRECT,
                  "by_rank": _capi.EPX_LL_ROUTE_BY_RANK,
                  "dispatch_by_rank": _capi.EPX_LL_ROUTE_DISPATCH_BY_RANK}
FAN_OUT_NAMES = {"auto": _capi.EPX_EXPAND_FAN_OUT_AUTO, "after": _capi.EPX_EXPAND_FAN_OUT_AFTER,
                 "during": _capi.EPX_EXPAND_FAN_OUT_DURING}
DTYPE_NAMES = {"bf16": _capi.EPX_DTYPE_BF16, "bfloat16": _capi.EPX_DTYPE_BF16,
               "fp8": _capi.EPX_DTYPE_FP8_E4M3, "fp8_e4m3": _capi.EPX_DTYPE_FP8_E4M3}


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


def _fan_out(value):
    if isinstance(value, int):
        return value
    if value in FAN_OUT_NAMES:
        return FAN_OUT_NAMES[value]
    raise invalid_argument("expand_fan_out: unknown name %r; expected one of %s" %
                           (value, ", ".join(FAN_OUT_NAMES)))


def make_config(max_tokens_per_rank, hidden, num_experts, top_k, *, modes=("normal",),
                ll_max_tokens_per_rank=0, num_sms=0, ll_num_sms=0, ll_route=0, timeout_ms=0,
                dtypes=0, expand_max_rows=0, expand_fan_out=0):
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
    c.expand_max_rows = expand_max_rows
    c.expand_fan_out = _fan_out(expand_fan_out)
    return c


def config_dict(c):
    """The fields of an epx_group_config_t as a dict (without `size`)."""
    return {name: getattr(c, name) for name, _ in c._fields_ if name != "size"}


def workspace_size(num_ranks, max_tokens_per_rank, hidden, num_experts, top_k, **config):
    """Workspace bytes per GPU of a group with this config, split by mode:
    dict(total, common, normal, low_latency). Takes Group's config keywords; touches no GPU."""
    c = make_config(max_tokens_per_rank, hidden, num_experts, top_k, **config)
    sizes = _capi.EPX_WORKSPACE_SIZES_INIT()
    _capi.check(_capi.lib.epx_workspace_size_by_mode(ctypes.byref(c), num_ranks,
                                                     ctypes.byref(sizes)))
    return {"total": sizes.total_bytes, "common": sizes.common_bytes,
            "normal": sizes.normal_bytes, "low_latency": sizes.low_latency_bytes}


"""epx.workspace_size: EPX's sizing through Python, no GPU."""
import ctypes

import pytest

import epx
from epx import _capi
from epx.group import config_dict, make_config

SHAPE = dict(max_tokens_per_rank=128, hidden=1024, num_experts=16, top_k=4)


def sizes(num_ranks=2, **kw):
    args = dict(SHAPE, **kw)
    return epx.workspace_size(num_ranks, args.pop("max_tokens_per_rank"), args.pop("hidden"),
                              args.pop("num_experts"), args.pop("top_k"), **args)


def test_parts_are_positive_and_sum_to_total():
    s = sizes()
    assert set(s) == {"total", "common", "normal", "low_latency"}
    assert s["total"] > 0 and s["common"] > 0 and s["normal"] > 0
    assert s["low_latency"] == 0  # not asked for
    assert s["common"] + s["normal"] + s["low_latency"] == s["total"]


def test_total_equals_epx_workspace_size():
    c = make_config(256, 2048, 32, 8, modes=("normal", "low_latency"))
    n = ctypes.c_size_t()
    _capi.check(_capi.lib.epx_workspace_size(ctypes.byref(c), 4, ctypes.byref(n)))
    assert sizes(4, max_tokens_per_rank=256, hidden=2048, num_experts=32, top_k=8,
                 modes=("normal", "low_latency"))["total"] == n.value


def test_grows_with_max_tokens_per_rank():
    small, large = sizes(max_tokens_per_rank=128), sizes(max_tokens_per_rank=1024)
    assert large["normal"] > small["normal"] and large["total"] > small["total"]


def test_low_latency_part_follows_ll_max_tokens_per_rank():
    a = sizes(modes=("normal", "low_latency"), ll_max_tokens_per_rank=32)
    b = sizes(modes=("normal", "low_latency"), ll_max_tokens_per_rank=128)
    assert 0 < a["low_latency"] < b["low_latency"] and a["normal"] == b["normal"]
    for s in (a, b):
        assert s["common"] + s["normal"] + s["low_latency"] == s["total"]


@pytest.mark.parametrize("modes", [("normal",), "low_latency", ("normal", "low_latency"),
                                   _capi.EPX_MODE_NORMAL | _capi.EPX_MODE_LOW_LATENCY])
def test_modes_by_name_or_bits(modes):
    s = sizes(modes=modes)
    assert (s["low_latency"] > 0) == ("low_latency" in modes if not isinstance(modes, int)
                                      else True)


def test_config_kwargs_fill_the_struct():
    c = make_config(64, 512, 8, 2, modes="low_latency", ll_route="by_rank", dtypes=("bf16",),
                    num_sms=12, timeout_ms=1000, ll_num_sms=4, ll_max_tokens_per_rank=16,
                    expand_fan_out="during")
    d = config_dict(c)
    assert d == dict(version=101, max_tokens_per_rank=64, hidden=512, num_experts=8, top_k=2,
                     dtypes=_capi.EPX_DTYPE_BF16, modes=_capi.EPX_MODE_LOW_LATENCY, num_sms=12,
                     timeout_ms=1000, ll_num_sms=4, ll_route=_capi.EPX_LL_ROUTE_BY_RANK,
                     ll_max_tokens_per_rank=16, expand_max_rows=0,
                     expand_fan_out=_capi.EPX_EXPAND_FAN_OUT_DURING)
    assert c.size == ctypes.sizeof(c)

"""Status -> exception mapping, and EPX's own messages through failing C calls."""
import ctypes
import pickle

import pytest

import epx
from epx import _capi, errors
from epx.group import make_config

EXPECTED = {
    1: epx.EpxCudaError, 2: epx.EpxNcclError, 3: epx.EpxSystemError, 4: epx.EpxInternalError,
    5: epx.EpxInvalidArgument, 6: epx.EpxInvalidUsage, 7: epx.EpxTimeout, 8: epx.EpxPeerFailed,
    9: epx.EpxUnsupported, 10: epx.EpxPeerData,
}


@pytest.mark.parametrize("status", sorted(EXPECTED))
def test_error_for_every_status(status):
    e = epx.error_for(status, "what went wrong")
    assert type(e) is EXPECTED[status]
    assert isinstance(e, epx.EpxError) and isinstance(e, RuntimeError)
    assert e.status == status and e.message == "what went wrong"
    assert e.status_name == errors.STATUS_NAMES[status]
    assert str(e) == "what went wrong (%s)" % e.status_name
    assert pickle.loads(pickle.dumps(e)).status == status


def test_error_for_unknown_and_ok():
    assert type(epx.error_for(42, "x")) is epx.EpxError
    assert epx.error_for(42, "x").status_name == "EPX_STATUS_42"
    assert type(epx.error_for(0, "x")) is epx.EpxError


def test_builtin_bases():
    assert issubclass(epx.EpxInvalidArgument, ValueError)
    assert issubclass(epx.EpxTimeout, TimeoutError)
    assert issubclass(epx.EpxUnsupported, NotImplementedError)


def test_status_names_match_the_header():
    for status, name in errors.STATUS_NAMES.items():
        assert getattr(errors, name) == status


def test_async_error_record():
    a = epx.AsyncError(7, 2, 1, -1, 5, "rank 0 waited for rank 1")
    assert a.stage == "EPX_STAGE_BARRIER" and a.status_name == "EPX_ERR_TIMEOUT"
    assert isinstance(a.error(), epx.EpxTimeout) and "rank 1" in str(a.error())
    assert "EPX_ERR_TIMEOUT" in repr(a)


def _validate(num_ranks=2, **fields):
    base = dict(max_tokens_per_rank=128, hidden=1024, num_experts=16, top_k=4)
    base.update(fields)
    c = make_config(base.pop("max_tokens_per_rank"), base.pop("hidden"), base.pop("num_experts"),
                    base.pop("top_k"), **base)
    _capi.check(_capi.lib.epx_config_validate(ctypes.byref(c), num_ranks))


def test_valid_config_passes():
    _validate()


@pytest.mark.parametrize("fields, needle", [
    (dict(hidden=1001), "config.hidden = 1001"),
    (dict(num_experts=15), "config.num_experts = 15"),
    (dict(top_k=0), "config.top_k = 0"),
    (dict(max_tokens_per_rank=-1), "config.max_tokens_per_rank = -1"),
    (dict(modes=0x10), "config.modes"),
    (dict(ll_route=7), "config.ll_route = 7"),
])
def test_invalid_config_raises_invalid_argument_with_epx_message(fields, needle):
    with pytest.raises(epx.EpxInvalidArgument) as info:
        _validate(**fields)
    assert needle in info.value.message
    assert info.value.status == errors.EPX_ERR_INVALID_ARGUMENT


@pytest.mark.parametrize("num_ranks, fields, needle", [
    (16, {}, "num_ranks = 16"),
    (2, dict(top_k=17, num_experts=32), "config.top_k = 17"),
    (2, dict(hidden=65536), "config.hidden = 65536"),
])
def test_beyond_limits_raises_unsupported(num_ranks, fields, needle):
    with pytest.raises(epx.EpxUnsupported, match=needle):
        _validate(num_ranks, **fields)


def test_workspace_size_bad_config():
    with pytest.raises(epx.EpxInvalidArgument, match="config.num_experts = 15"):
        epx.workspace_size(2, 128, 1024, 15, 4)
    with pytest.raises(epx.EpxUnsupported, match="num_ranks = 0"):
        epx.workspace_size(0, 128, 1024, 16, 4)
    assert epx.workspace_size(1, 128, 1024, 16, 4)["total"] > 0  # a one-rank group is a group


def test_wrong_struct_size_is_refused_naming_the_init_macro():
    c = make_config(128, 1024, 16, 4)
    sizes = _capi.EPX_WORKSPACE_SIZES_INIT()
    sizes.size -= 8
    with pytest.raises(epx.EpxInvalidArgument, match="EPX_WORKSPACE_SIZES_INIT"):
        _capi.check(_capi.lib.epx_workspace_size_by_mode(ctypes.byref(c), 2, ctypes.byref(sizes)))


def test_unknown_config_names_are_refused_in_python():
    with pytest.raises(epx.EpxInvalidArgument, match="modes: unknown name 'fast'"):
        make_config(128, 1024, 16, 4, modes=("fast",))
    with pytest.raises(epx.EpxInvalidArgument, match="ll_route: unknown name"):
        make_config(128, 1024, 16, 4, ll_route="sideways")

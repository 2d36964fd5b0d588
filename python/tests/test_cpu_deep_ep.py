"""CPU tests of epx.deep_ep (DeepEP V1's surface on EPX): no GPU needed.

* Config, events, argument refusals, handle shapes, the group sizing search: pure Python.
* Size hints: need the EPX core package and libepx (epx.workspace_size touches no GPU); skipped
  where the core package is not importable.
* The Buffer's plumbing (group creation and reuse, the handle pool, copies, events, low-latency
  handles and hooks) against a stand-in for epx.Group that runs on CPU tensors: what the Buffer
  asks of EPX and what it returns, not EPX's results (the GPU tests and DeepEP's own tests check
  those).
"""

import contextlib
import gc
import importlib.util
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

if importlib.util.find_spec("epx") is None:  # running from the source tree, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    from epx import deep_ep
    from epx.deep_ep import buffer as buffer_mod
    from epx.deep_ep import utils as utils_mod
except Exception as e:  # noqa: BLE001 -- no EPX package, no libepx, or an NCCL mismatch at import
    pytest.skip(f"epx.deep_ep is not importable here: {e}", allow_module_level=True)


def _core_or_skip():
    epx = pytest.importorskip("epx")
    if not hasattr(epx, "workspace_size"):
        pytest.skip("the EPX core package (epx.workspace_size) is not in this tree yet")
    return epx


# ------------------------------------------------------------------------------------------------
# Module surface, Config, events
# ------------------------------------------------------------------------------------------------
def test_exports():
    for name in ("Buffer", "Config", "EventOverlap", "EventHandle", "topk_idx_t"):
        assert hasattr(deep_ep, name), name
    assert deep_ep.topk_idx_t is torch.int64
    assert deep_ep.Buffer.is_sm90_compiled() is True
    assert deep_ep.EventHandle is utils_mod.EventHandle


def test_config_fields_and_checks():
    c = deep_ep.Config(24, 8, 256)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens) == (24, 8, 256)
    assert (c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (6, 256)
    d = deep_ep.Config()
    assert d.num_sms == 20 and "Config(" in repr(d)
    with pytest.raises(ValueError):
        deep_ep.Config(24, 256, 256)  # send must be below recv
    with pytest.raises(ValueError):
        deep_ep.Config(-2, 6, 256)
    with pytest.raises(ValueError):
        deep_ep.Config(24, 0, 256)
    with pytest.raises(TypeError):
        deep_ep.Config(24.0, 6, 256)


def test_dispatch_and_combine_configs():
    for n in (2, 4, 8, 16):
        for cfg in (deep_ep.Buffer.get_dispatch_config(n), deep_ep.Buffer.get_combine_config(n)):
            assert isinstance(cfg, deep_ep.Config)
            assert cfg.num_sms == deep_ep.Buffer.num_sms
    with pytest.raises(ValueError):
        deep_ep.Buffer.get_dispatch_config(0)


def test_rdma_hint_is_zero_on_one_host():
    cfg = deep_ep.Config()
    for n in (2, 4, 8):
        assert cfg.get_rdma_buffer_size_hint(7168 * 2, n) == 0
    with pytest.raises(NotImplementedError, match="internode"):
        cfg.get_rdma_buffer_size_hint(7168 * 2, 16)
    with pytest.raises(NotImplementedError):
        cfg.get_nvl_buffer_size_hint(7168 * 2, 16)


def test_event_overlap_without_event():
    ov = deep_ep.EventOverlap()
    assert ov.event is None and ov.extra_tensors is None
    with ov as inner:  # no event: nothing to wait for
        assert inner is ov
    with pytest.raises(RuntimeError, match="async_finish"):
        ov.current_stream_wait()
    t = torch.zeros(2)
    assert deep_ep.EventOverlap(None, (t,)).extra_tensors[0] is t
    assert utils_mod.as_cuda_event(None) is None
    assert utils_mod.as_cuda_event(ov) is None
    with pytest.raises(TypeError):
        utils_mod.as_cuda_event(object())


def test_set_num_sms():
    saved = deep_ep.Buffer.num_sms
    try:
        assert saved == 24
        deep_ep.Buffer.set_num_sms(32)
        assert deep_ep.Buffer.num_sms == 32
        assert deep_ep.Buffer.get_dispatch_config(4).num_sms == 32
        for bad in (3, 0, -2):
            with pytest.raises(ValueError):
                deep_ep.Buffer.set_num_sms(bad)
        with pytest.raises(TypeError):
            deep_ep.Buffer.set_num_sms(24.0)
        assert deep_ep.Buffer.num_sms == 32
    finally:
        deep_ep.Buffer.num_sms = saved


# ------------------------------------------------------------------------------------------------
# Refusals that come before any torch.distributed or GPU use
# ------------------------------------------------------------------------------------------------
class _NoGroup:
    """A group that must not be touched."""

    def rank(self):
        raise AssertionError("the group was used before the argument checks")

    size = rank


def test_constructor_refusals_before_distributed():
    import torch.distributed as dist

    with pytest.raises(NotImplementedError, match="MNNVL"):
        deep_ep.Buffer(_NoGroup(), int(1e9), allow_mnnvl=True)
    with pytest.raises(NotImplementedError, match="fabric"):
        deep_ep.Buffer(_NoGroup(), int(1e9), use_fabric=True)
    with pytest.raises(ValueError, match="group"):
        deep_ep.Buffer(None)
    with pytest.raises(NotImplementedError, match="mpi4py"):
        deep_ep.Buffer(None, comm=object())
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        deep_ep.Buffer(_NoGroup(), -1)
    with pytest.raises(ValueError, match="num_rdma_bytes"):
        deep_ep.Buffer(_NoGroup(), 0, 1.5)
    assert not (dist.is_available() and dist.is_initialized())


def test_feature_refusals_before_any_state():
    b = deep_ep.Buffer.__new__(deep_ep.Buffer)  # no group, no GPU: the refusals come first
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    idx = torch.zeros(1, 1, dtype=torch.int64)
    with pytest.raises(NotImplementedError, match="LogFMT"):
        b.low_latency_combine(x, idx, idx.float(), None, use_logfmt=True)
    with pytest.raises(NotImplementedError, match="NVFP4"):
        b.low_latency_dispatch(x, idx, 1, 2, use_nvfp4=True)
    with pytest.raises(ValueError, match="round_scale"):
        b.low_latency_dispatch(x, idx, 1, 2, use_ue8m0=True)
    with pytest.raises(ValueError):
        b.low_latency_dispatch(x, idx, 1, 2, async_finish=True, return_recv_hook=True)
    with pytest.raises(NotImplementedError, match="internode"):
        b.internode_dispatch(x)
    with pytest.raises(NotImplementedError, match="internode"):
        b.internode_combine(x, None)
    with pytest.raises(NotImplementedError):
        b.get_local_buffer_tensor(torch.bfloat16)
    with pytest.raises(RuntimeError, match="destroyed"):  # never set up: treated as unusable
        b.dispatch(x)


# ------------------------------------------------------------------------------------------------
# Handles, the pool, the sizing search
# ------------------------------------------------------------------------------------------------
def test_dispatch_handle_shape():
    rpm, src, mask = torch.zeros(2, 2, dtype=torch.int32), torch.arange(5, dtype=torch.int32), torch.ones(3, 2).bool()
    h = buffer_mod.DispatchHandle(rpm, src, mask, num_recv=5, num_tokens=3)
    assert isinstance(h, tuple) and len(h) == 6 == len(buffer_mod.DispatchHandle.FIELDS)
    rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head = h
    assert rank_prefix_matrix is rpm and recv_src_idx is src and is_token_in_rank is mask
    assert channel_prefix_matrix is None and recv_channel_prefix_matrix is None and send_head is None
    assert h.num_recv == 5 and h.num_tokens == 3 and h.epx_handle is None


def test_low_latency_handle_shape():
    info = torch.zeros(2, 8, 4, dtype=torch.int32)[..., 1]
    rng = torch.zeros(2, 2, dtype=torch.int64)
    h = buffer_mod.LowLatencyHandle(info, rng, 4, 128, 4, result="r", state=None)
    assert isinstance(h, tuple) and len(h) == 5
    src_info, layout_range, m, hidden, experts = h
    assert src_info is info and layout_range is rng and (m, hidden, experts) == (4, 128, 4)
    assert h.epx_result == "r"


class _FakeHandle:
    def __init__(self, log):
        self.log = log
        self.destroyed = False

    def destroy(self):
        self.destroyed = True
        self.log.append("handle")


def test_handle_pool_and_leases():
    log, made = [], []

    def make_handle():
        made.append(_FakeHandle(log))
        return made[-1]

    def destroy_group():  # as epx.Group.destroy: its handles first, then the group
        for h in made:
            h.destroy()
        log.append("group")

    group = types.SimpleNamespace(handle=make_handle, destroy=destroy_group)
    st = buffer_mod._GroupState(group, 1, "normal", 128, 8, 2, 64)
    h1 = st.take_handle()
    lease = buffer_mod._Lease(st, h1)
    assert st.take_handle() is not h1  # h1 is lent: a new one is made
    del lease
    gc.collect()
    assert st.take_handle() is h1  # given back when its lease died
    st.destroy()
    assert log == ["handle", "handle", "group"] and st.alive is False
    st.give_back(h1)  # after destruction: ignored
    st.destroy()  # idempotent
    assert log == ["handle", "handle", "group"]


def test_group_state_serves():
    st = buffer_mod._GroupState(None, 1, "normal", 7168, 256, 8, 4096)
    assert st.serves(256, 7168, 8) and st.serves(256, None, 8) and st.serves(256, 7168, None)
    assert not st.serves(128, 7168, 8) and not st.serves(256, 4096, 8) and not st.serves(256, 7168, 6)
    layout_only = buffer_mod._GroupState(None, 1, "normal", 8, 256, 8, 65536, provisional=True)
    assert layout_only.serves(256, None, 8) and not layout_only.serves(256, 8, 8)


def test_fit_max_tokens():
    def size(m):
        return 1000 + 10 * m

    assert buffer_mod.fit_max_tokens(size, 1000 + 10 * 4096, 100) == 4096
    assert buffer_mod.fit_max_tokens(size, 1000 + 10 * 4096 + 9, 4096) == 4096
    assert buffer_mod.fit_max_tokens(size, 10 ** 12, 1) == 65536  # capped at EPX's limit
    assert buffer_mod.fit_max_tokens(size, 1000 + 10 * 99, 100) is None  # even the need does not fit
    assert buffer_mod.fit_max_tokens(size, 10 ** 12, 70000) is None  # beyond EPX's limit
    assert buffer_mod.fit_max_tokens(size, 1010, 0) == 1


# ------------------------------------------------------------------------------------------------
# Size hints (need libepx, not a GPU)
# ------------------------------------------------------------------------------------------------
def test_low_latency_rdma_size_hint():
    epx = _core_or_skip()
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 4, 288)
    sizes = epx.workspace_size(4, 128, 7168, 288, 16, modes=("low_latency",), ll_max_tokens_per_rank=128)
    assert hint == sizes["total"] > 0
    assert sizes["normal"] == 0 and sizes["low_latency"] > 0
    need8 = epx.workspace_size(4, 128, 7168, 288, 8, modes=("low_latency",), ll_max_tokens_per_rank=128)["total"]
    assert need8 <= hint  # the hint covers any top-k
    assert deep_ep.Buffer.get_low_latency_rdma_size_hint(256, 7168, 4, 288) > hint
    with pytest.raises(NotImplementedError):
        deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 16, 288)


def test_nvl_buffer_size_hint():
    epx = _core_or_skip()
    cfg = deep_ep.Config()
    hint = cfg.get_nvl_buffer_size_hint(7168 * 2, 8)
    tokens = deep_ep.config.NVL_HINT_TOKENS_PER_RANK
    assert hint == epx.workspace_size(8, tokens, 7168, 1024, 16, modes=("normal",))["total"]
    # What a Buffer would then size its group to: at least the hint's token count, any top-k.
    for top_k in (1, 8, 16):
        def size(m, k=top_k):
            return epx.workspace_size(8, m, 7168, 256, k, modes=("normal",))["total"]

        assert buffer_mod.fit_max_tokens(size, hint, 1) >= tokens
    assert cfg.get_nvl_buffer_size_hint(4096 * 2, 8) < hint
    assert cfg.get_nvl_buffer_size_hint(7168 * 2, 2) < hint


# ------------------------------------------------------------------------------------------------
# Plumbing against a CPU stand-in for epx.Group
# ------------------------------------------------------------------------------------------------
class _FakeStream:
    def __init__(self, name):
        self.name = name
        self.waits = []

    def wait_event(self, event):
        self.waits.append(("event", event))

    def wait_stream(self, stream):
        self.waits.append(("stream", stream.name))

    def synchronize(self):
        pass


class _FakeEventHandle(utils_mod.EventHandle):
    def __init__(self, stream=None):
        self.event = ("event-on", getattr(stream, "name", "current"))

    def current_stream_wait(self):
        pass


class _FakeWorld:
    """Two ranks seen from rank 0: every token 'comes back' from this rank only."""

    def __init__(self):
        self.groups = []
        self.log = []


class _FakeEpxGroup:
    """The epx.Group surface the Buffer uses, on CPU tensors, for one rank of 2."""

    R = 2

    def __init__(self, world, max_tokens, hidden, num_experts, top_k, *, group=None, modes=("normal",),
                 ll_max_tokens_per_rank=0, num_sms=0, **kwargs):
        self.world, self.max_tokens, self.hidden, self.E, self.K = world, max_tokens, hidden, num_experts, top_k
        self.modes, self.num_sms, self.M = modes, num_sms, ll_max_tokens_per_rank
        self.alive, self.mask, self.parity = True, 0, 0
        self.handles = []
        cap = self.R * max_tokens
        self.ws_x = torch.zeros(cap, hidden)
        self.ws_scales = torch.zeros(cap, max(1, hidden // 128))
        self.ws_idx = torch.full((cap, top_k), -1, dtype=torch.int64)
        self.ws_w = torch.zeros(cap, top_k)
        self.ws_src = torch.zeros(cap, dtype=torch.int32)
        world.groups.append(self)
        world.log.append(("create", modes, hidden, num_experts, top_k, max_tokens))

    def _check(self):
        assert self.alive, "call on a destroyed group"

    def layout(self, topk_idx, stream=None):
        self._check()
        assert topk_idx.size(1) == self.K
        t = topk_idx.size(0)
        return types.SimpleNamespace(num_tokens_per_rank=torch.full((self.R,), t, dtype=torch.int32),
                                     num_tokens_per_expert=torch.zeros(self.E, dtype=torch.int32),
                                     is_token_in_rank=torch.ones(t, self.R, dtype=torch.bool),
                                     token_pos_in_rank=torch.zeros(t, self.R, dtype=torch.int32))

    def handle(self):
        self._check()
        h = _FakeHandle(self.world.log)
        h.rows = None
        self.handles.append(h)
        return h

    def _result(self, rows, x_dtype, fp8, packed_scales=False):
        return types.SimpleNamespace(
            num_recv=rows, recv_x=self.ws_x if x_dtype == torch.float32 else self.ws_x.to(x_dtype), recv_x_scales=None if (not fp8 or packed_scales) else self.ws_scales,
            recv_x_scales_packed=self.ws_scales.int() if packed_scales else None, recv_topk_idx=self.ws_idx,
            recv_topk_weights=self.ws_w, recv_src_token=self.ws_src,
            rank_prefix_matrix=torch.tensor([[rows, 0], [rows, 0]], dtype=torch.int32),
            num_recv_per_expert=[rows] + [0] * (self.E // self.R - 1))

    def dispatch(self, h, x, topk_idx=None, topk_weights=None, *, x_scales=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, expert_alignment=1, sync_counts=True, num_worst_tokens=0,
                 recv_topk_idx_dtype=torch.int32, stream=None):
        self._check()
        assert not h.destroyed and recv_topk_idx_dtype is torch.int64 and x.size(1) == self.hidden
        assert (topk_idx is None) == (is_token_in_rank is not None)
        assert sync_counts == (num_worst_tokens == 0)
        t = x.size(0)
        if t > self.max_tokens:  # as C: refused here, after telling the peers in the count exchange
            self.world.log.append(("refused", t))
            from epx import errors
            raise errors.EpxInvalidArgument(errors.EPX_ERR_INVALID_ARGUMENT,
                                            f"epx_dispatch: args->num_tokens = {t}: more than {self.max_tokens}")
        h.rows = t
        self.ws_x[:t] = x.float()
        self.ws_src[:t] = torch.arange(t, dtype=torch.int32)
        if topk_idx is not None:
            self.ws_idx[:t] = topk_idx
            self.ws_w[:t] = topk_weights if topk_weights is not None else 0
        if x_scales is not None:
            self.ws_scales[:t] = x_scales.float()
        self.world.log.append(("dispatch", "ids" if topk_idx is not None else "mask", t, num_worst_tokens))
        rows = num_worst_tokens if num_worst_tokens else t
        packed = x_scales is not None and x_scales.dtype == torch.int32
        return self._result(rows, x.dtype, x_scales is not None, packed)

    def dispatch_cached(self, h, x, x_scales=None, stream=None):
        self._check()
        assert h.rows == x.size(0)
        self.ws_x[:h.rows] = x.float()
        self.world.log.append(("cached", h.rows))
        return self._result(-1, x.dtype, x_scales is not None)

    def combine(self, h, x, *, out=None, topk_idx=None, topk_weights=None, recv_topk_weights=None, bias=None,
                stream=None):
        self._check()
        self.world.log.append(("combine", bias is not None))
        out = torch.zeros(h.rows, self.hidden)
        return out, (torch.zeros(h.rows, self.K) if recv_topk_weights is not None else None)

    def ll_dispatch(self, x, topk_idx, topk_weights=None, *, fp8=False, ue8m0=False, ue8m0_packed=False, packed=False,
                    split=False, layout_range=False):
        self._check()
        assert packed and layout_range and "low_latency" in self.modes and x.size(0) <= self.M
        L, rows, H = self.E // self.R, self.R * self.M, self.hidden
        hook = types.SimpleNamespace(id=1 if split else 0)
        self.world.log.append(("ll_dispatch", fp8, ue8m0, ue8m0_packed, split))
        self.parity ^= 1
        return types.SimpleNamespace(
            recv_x=torch.zeros(L, rows, H), recv_x_scales=None if (not fp8 or ue8m0_packed) else torch.ones(L, rows, H // 128),
            recv_x_scales_packed=torch.zeros(L, rows, (H + 511) // 512, dtype=torch.int32) if ue8m0_packed else None,
            recv_src_info=torch.arange(L * rows * 4, dtype=torch.int32).view(L, rows, 4),
            recv_count=torch.full((L,), 3, dtype=torch.int32), combine_input=torch.zeros(L, rows, H),
            layout_range=torch.zeros(L, self.R, dtype=torch.int64), hook=hook if split else None, buffer=self.parity)

    def ll_combine(self, d, x=None, *, out=None, topk_weights=None, split=False):
        self._check()
        self.world.log.append(("ll_combine", x is None, split))
        out = torch.zeros(4, self.hidden) if out is None else out
        return (out, types.SimpleNamespace(id=2)) if split else out

    def ll_recv(self, hook):
        assert hook.id != 0
        hook.id = 0
        self.world.log.append(("ll_recv",))

    def barrier(self, skip_masked=False):
        self.world.log.append(("barrier", skip_masked))

    def mask_peer(self, peer):
        self.mask |= 1 << peer

    @property
    def peer_mask(self):
        return self.mask

    def clear_peer_mask(self):
        self.mask = 0

    def destroy(self):  # as epx.Group.destroy: releases the handles it made, then the group
        for h in self.handles:
            h.destroy()
        self.alive = False
        self.world.log.append(("destroy", self.modes))


@pytest.fixture
def fake(monkeypatch):
    world = _FakeWorld()
    streams = {"current": _FakeStream("current")}

    def workspace_size(num_ranks, m, hidden, num_experts, top_k, modes=("normal",), ll_max_tokens_per_rank=0, **kw):
        per = 2 * hidden * num_ranks  # bytes per token of max_tokens (made up)
        normal = 1000 + per * m if "normal" in modes else 0
        ll = 5000 + ll_max_tokens_per_rank * hidden * top_k if "low_latency" in modes else 0
        return {"total": 64 + normal + ll, "common": 64, "normal": normal, "low_latency": ll}

    core = types.SimpleNamespace(Group=lambda *a, **k: _FakeEpxGroup(world, *a, **k), workspace_size=workspace_size)
    monkeypatch.setattr(buffer_mod, "core", lambda: core)
    monkeypatch.setattr(buffer_mod, "current_stream", lambda: streams["current"])
    monkeypatch.setattr(buffer_mod, "new_stream", lambda: _FakeStream("comm"))
    monkeypatch.setattr(buffer_mod, "stream_ctx", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(buffer_mod, "record_stream", lambda t, s: world.log.append(("record", s.name)))
    monkeypatch.setattr(buffer_mod, "EventHandle", _FakeEventHandle)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)

    def all_gather_object(out, obj, group=None):
        for i in range(len(out)):
            out[i] = obj

    monkeypatch.setattr(buffer_mod.dist, "all_gather_object", all_gather_object)
    world.streams = streams
    world.core = core
    return world


class _Group2:
    def rank(self):
        return 0

    def size(self):
        return 2


def _per_token_budget(hidden, tokens):  # the fake workspace_size's normal group at `tokens`
    return 64 + 1000 + 2 * hidden * 2 * tokens


def test_buffer_normal_plumbing(fake):
    H, E, K, T = 256, 8, 2, 6
    buf = deep_ep.Buffer(_Group2(), _per_token_budget(H, 100), explicitly_destroy=True)
    assert (buf.rank, buf.group_size) == (0, 2) and buf.get_comm_stream().name == "comm"
    topk_idx = torch.tensor([[0, 5], [1, -1], [2, 3], [4, 7], [6, 0], [1, 2]], dtype=torch.int64)
    topk_w = torch.rand(T, K)

    # Layout first: a layout-only group (hidden unknown), on the current stream.
    ntpr, rdma, ntpe, in_rank, ev = buf.get_dispatch_layout(topk_idx, E)
    assert rdma is None and ev.event is None and ntpr.shape == (2,) and in_rank.dtype == torch.bool
    assert fake.log[-1][:5] == ("create", ("normal",), buffer_mod.LAYOUT_ONLY_HIDDEN, E, K)
    assert fake.streams["current"].waits == []

    # First dispatch: the layout-only group is replaced by the real one (sized to the budget).
    x = torch.randn(T, H).to(torch.bfloat16)
    recv_x, r_idx, r_w, counts, handle, ev = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                           num_tokens_per_expert=ntpe, topk_idx=topk_idx,
                                                           topk_weights=topk_w)
    creates = [e for e in fake.log if e[0] == "create"]
    assert creates[-1] == ("create", ("normal",), H, E, K, 100) and ("destroy", ("normal",)) in fake.log
    assert fake.groups[-1].num_sms == deep_ep.Buffer.num_sms
    assert recv_x.shape == (T, H) and r_idx.dtype == torch.int64 and r_w.shape == (T, K)
    assert counts == [T, 0, 0, 0] and ev.event is None
    assert torch.equal(recv_x.float(), x.float()) and torch.equal(r_idx, topk_idx)
    assert isinstance(handle, buffer_mod.DispatchHandle) and handle.num_recv == T and handle[4] is in_rank
    assert torch.equal(handle[3], torch.arange(T, dtype=torch.int32)) and handle[0].shape == (2, 2)
    assert ("stream", "current") in buf.get_comm_stream().waits  # comm waited for the current stream
    assert ("stream", "comm") in fake.streams["current"].waits  # and the current one for comm
    # Fresh tensors: the next dispatch's workspace writes leave them alone.
    kept = recv_x.clone()
    group = fake.groups[-1]
    h1 = handle.epx_handle

    # Rank-mask route, async: no ids back; tensors recorded on the comm stream; an event.
    recv2, r_idx2, r_w2, counts2, handle2, ev2 = buf.dispatch(x * 2, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
                                                              num_tokens_per_rank=ntpr, async_finish=True)
    assert r_idx2 is None and r_w2 is None and ev2.event.event == ("event-on", "comm")
    assert torch.equal(recv_x, kept) and handle2.epx_handle is not h1
    assert fake.log[-1] == ("record", "comm")
    assert fake.groups[-1] is group  # same group serves the rank-mask route

    # Worst-case rows: no counts, num_worst rows.
    w = buf.dispatch(x, num_tokens_per_expert=ntpe, topk_idx=topk_idx, topk_weights=topk_w, num_worst_tokens=2 * T)
    assert w[0].shape == (2 * T, H) and w[1].shape == (2 * T, K) and w[3] == [] and w[4].num_recv == 2 * T
    assert ("dispatch", "ids", T, 2 * T) in fake.log

    # FP8 tuple with column-major scales; cached dispatch with the first handle keeps its rows.
    x8 = torch.randn(T, H).to(torch.float8_e4m3fn)
    sc = torch.rand(H // 128, T).T  # column-major [T, H/128]
    fp8_res = buf.dispatch((x8, sc), num_tokens_per_expert=ntpe, topk_idx=topk_idx, topk_weights=topk_w)
    r8, rs = fp8_res[0]
    assert r8.dtype == torch.float8_e4m3fn and rs.shape == (T, H // 128) and rs.is_contiguous()
    cached = buf.dispatch(x, handle=handle)
    assert cached[1:5] == (None, None, None, None) and cached[0].shape == (T, H)
    assert fake.log[-1] == ("cached", T)
    with pytest.raises(ValueError, match="cached"):
        buf.dispatch(x, handle=handle, topk_idx=topk_idx)

    # Combine: weights come back; bias pairs pass through.
    out, out_w, ev = buf.combine(recv_x, handle, topk_weights=r_w, bias=(x, None))
    assert out.shape == (T, H) and out_w.shape == (T, K) and fake.log[-1] == ("combine", True)
    out, out_w, _ = buf.combine(recv_x, handle)
    assert out_w is None
    with pytest.raises(TypeError):
        buf.combine(recv_x, tuple(handle))
    with pytest.raises(ValueError, match="allocate_on_comm_stream"):
        buf.combine(recv_x, handle, allocate_on_comm_stream=True)
    prev = deep_ep.Buffer.capture()
    out, _, ev = buf.combine(recv_x, handle, previous_event=prev, async_finish=True, allocate_on_comm_stream=True)
    assert ("event", ("event-on", "current")) in buf.get_comm_stream().waits

    # Handles go back to the pool when the Python handle dies; new dispatches reuse them.
    assert len(buf._normal._handles) == 4 and buf._normal._pool == []  # four dispatches, four held
    freed = {id(h1), id(handle2.epx_handle), id(w[4].epx_handle), id(fp8_res[4].epx_handle)}
    del handle, handle2, w, cached, recv2, fp8_res
    gc.collect()
    assert {id(h) for h in buf._normal._pool} == freed
    _, _, _, _, handle3, _ = buf.dispatch(x, num_tokens_per_expert=ntpe, topk_idx=topk_idx, topk_weights=topk_w)
    assert id(handle3.epx_handle) in freed and len(buf._normal._handles) == 4

    # Too many tokens for the group: the layout is computed in torch (EPX's holds max_tokens),
    # bit for bit the definition (tests/ref: once per listed expert and rank, ids outside [0, E)
    # empty); the dispatch reaches EPX (which fails it on every rank at once), and the Buffer's
    # error names the budget.
    n_big = group.max_tokens + 1
    big_idx = torch.randint(-1, E + 2, (n_big, K), dtype=torch.int64)
    big_idx[0] = torch.tensor([3, 3])  # an expert listed twice counts once
    calls_before = len(fake.log)
    b_ntpr, b_rdma, b_ntpe, b_in_rank, b_ev = buf.get_dispatch_layout(big_idx, E)
    assert len(fake.log) == calls_before and b_rdma is None and b_ev.event is None
    want_in_rank = torch.zeros(n_big, 2, dtype=torch.bool)
    want_ntpe = torch.zeros(E, dtype=torch.int32)
    for t in range(n_big):
        for e in {int(v) for v in big_idx[t] if 0 <= int(v) < E}:
            want_ntpe[e] += 1
            want_in_rank[t, e // (E // 2)] = True
    assert torch.equal(b_in_rank, want_in_rank) and torch.equal(b_ntpe, want_ntpe)
    assert torch.equal(b_ntpr, want_in_rank.sum(0, dtype=torch.int32)) and b_ntpr.dtype == torch.int32
    big = torch.zeros(n_big, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        buf.dispatch(big, num_tokens_per_expert=ntpe, topk_idx=torch.zeros(big.size(0), K, dtype=torch.int64))
    assert fake.log[-1] == ("refused", n_big)

    # Another hidden size: the group is replaced and old handles are refused by name.
    x2 = torch.zeros(T, 2 * H, dtype=torch.bfloat16)
    buf.dispatch(x2, num_tokens_per_expert=ntpe, topk_idx=topk_idx, topk_weights=topk_w)
    assert not group.alive and all(h.destroyed for h in [handle3.epx_handle])
    with pytest.raises(RuntimeError, match="gone"):
        buf.combine(recv_x, handle3)

    buf.destroy()
    assert not fake.groups[-1].alive
    with pytest.raises(RuntimeError, match="destroyed"):
        buf.get_dispatch_layout(topk_idx, E)
    with pytest.raises(RuntimeError, match="destroyed"):
        buf.destroy()


def test_async_layout_records_every_output(fake):
    """An async layout runs on the comm stream and writes four tensors, token_pos_in_rank too (not
    returned, so dropped when the call returns): each must be recorded there, with topk_idx."""
    buf = deep_ep.Buffer(_Group2(), _per_token_budget(256, 100), explicitly_destroy=True)
    topk_idx = torch.tensor([[0, 5], [1, -1]], dtype=torch.int64)
    ntpr, _, ntpe, in_rank, ev = buf.get_dispatch_layout(topk_idx, 8, async_finish=True)
    assert ev.event.event == ("event-on", "comm")
    assert [e for e in fake.log if e[0] == "record"] == [("record", "comm")] * 5


def test_buffer_budget_too_small(fake):
    buf = deep_ep.Buffer(_Group2(), 2000)
    topk_idx = torch.zeros(4, 2, dtype=torch.int64)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="num_nvl_bytes = 2000"):
        buf.dispatch(x, num_tokens_per_expert=torch.zeros(8, dtype=torch.int32), topk_idx=topk_idx)
    with pytest.raises(RuntimeError, match="explicitly_destroy"):
        buf.destroy()
    with pytest.raises(ValueError, match="num_nvl_bytes = 0"):
        deep_ep.Buffer(_Group2(), 0, 10 ** 9, low_latency_mode=True).get_dispatch_layout(topk_idx, 8)


def test_buffer_refuses_multi_host(fake, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(NotImplementedError, match="more than one host"):
        deep_ep.Buffer(_Group2(), 10 ** 9)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    names = iter([("a", 8), ("b", 8)])  # (host, visible GPUs) of each rank

    def gather(out, obj, group=None):
        for i in range(len(out)):
            out[i] = next(names)

    monkeypatch.setattr(buffer_mod.dist, "all_gather_object", gather)
    with pytest.raises(NotImplementedError, match="internode RDMA"):
        deep_ep.Buffer(_Group2(), 10 ** 9, 10 ** 9)


def test_buffer_low_latency_plumbing(fake):
    H, E, K, M, T = 512, 8, 2, 4, 3
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(M, H, 2, E)
    assert hint == fake.core.workspace_size(2, M, H, E, min(16, E), modes=("low_latency",),
                                            ll_max_tokens_per_rank=M)["total"]
    buf = deep_ep.Buffer(_Group2(), 0, hint, low_latency_mode=True, num_qps_per_rank=4, explicitly_destroy=True,
                         enable_shrink=True)
    buf.clean_low_latency_buffer(M, H, E)  # no group yet: nothing to do
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    idx = torch.zeros(T, K, dtype=torch.int64)
    w = torch.rand(T, K)
    stats = torch.zeros(E // 2, dtype=torch.int32)

    (rx, rs), count, handle, ev, hook = buf.low_latency_dispatch(x, idx, M, E, cumulative_local_expert_recv_stats=stats,
                                                                 async_finish=True)
    assert fake.log[-1] == ("ll_dispatch", True, False, False, False)
    assert rx.shape == (E // 2, 2 * M, H) and rs.shape == (E // 2, 2 * M, H // 128) and hook is None
    assert torch.equal(stats, count) and ev.event.event == ("event-on", "current") and len(ev.extra_tensors) == 8
    src_info, layout_range, m, hidden, experts = handle
    assert src_info.shape == (E // 2, 2 * M) and int(src_info[0, 1]) == 5 and (m, hidden, experts) == (M, H, E)
    assert layout_range.dtype == torch.int64

    (rx, rs), count, handle, ev, hook = buf.low_latency_dispatch(x, idx, M, E, use_fp8=True, round_scale=True,
                                                                 use_ue8m0=True, return_recv_hook=True,
                                                                 cumulative_local_expert_recv_stats=stats)
    assert rs.dtype == torch.int32 and rs.shape == (E // 2, 2 * M, H // 512) and ev.event is None
    assert torch.equal(stats, count)  # not yet: the hook adds
    hook()
    assert fake.log[-1] == ("ll_recv",) and torch.equal(stats, 2 * count)

    buf.get_next_low_latency_combine_buffer(handle)[:] = 1
    out = torch.empty(T, H, dtype=torch.bfloat16)
    combined, ev, hook = buf.low_latency_combine(rx, idx, w, handle, zero_copy=True, out=out)
    assert combined is out and hook is None and fake.log[-1] == ("ll_combine", True, False)
    combined, ev, hook = buf.low_latency_combine(rx, idx, w, handle, return_recv_hook=True)
    assert fake.log[-1] == ("ll_combine", False, True)
    hook()
    assert fake.log[-1] == ("ll_recv",)

    rx, *_ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    assert isinstance(rx, torch.Tensor)
    buf.clean_low_latency_buffer(M, H, E)
    assert fake.log[-1] == ("barrier", True)  # shrink mode: the masked ranks are not waited for

    mask = torch.zeros(2, dtype=torch.int32)
    buf.low_latency_update_mask_buffer(1, True)
    buf.low_latency_query_mask_buffer(mask)
    assert mask.tolist() == [0, 1]
    with pytest.raises(NotImplementedError, match="clean_mask"):
        buf.low_latency_update_mask_buffer(1, False)
    buf.low_latency_clean_mask_buffer()
    buf.low_latency_query_mask_buffer(mask)
    assert mask.tolist() == [0, 0]
    buf.low_latency_update_mask_buffer(1, False)  # not masked: nothing to do

    # Another num_max_dispatch_tokens_per_rank: a new group (if it fits), old handles refused.
    with pytest.raises(ValueError, match="num_rdma_bytes"):
        buf.low_latency_dispatch(x, idx, 8 * M, E)
    with pytest.raises(RuntimeError, match="gone"):
        buf.low_latency_combine(rx, idx, w, handle)
    buf.low_latency_dispatch(x, idx, M // 2 + 1, E)
    buf.destroy()
    assert all(not g.alive for g in fake.groups)


def test_buffer_low_latency_needs_mode(fake):
    buf = deep_ep.Buffer(_Group2(), 10 ** 9)
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="low_latency_mode"):
        buf.low_latency_dispatch(x, torch.zeros(1, 1, dtype=torch.int64), 1, 2)
    with pytest.raises(RuntimeError, match="shrink"):
        buf.low_latency_query_mask_buffer(torch.zeros(2, dtype=torch.int32))

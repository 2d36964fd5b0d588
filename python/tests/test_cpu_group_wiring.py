"""epx.Group's plumbing without a GPU: libepx is replaced by a fake that records the ctypes args
and answers with host memory, torch.distributed runs gloo with one rank, tensors are CPU ones.
Checks that each call fills the C args as epx.h says, shapes its views right, keeps handles and
hooks straight, and releases handles, group and communicator in order."""
import ctypes
import functools
import gc
import math

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import epx  # noqa: E402
from epx import _capi, _nccl, _tensors  # noqa: E402
from epx import group as G  # noqa: E402
from epx.moe_prefill import MoePrefill  # noqa: E402

H, E, K, R, M = 256, 8, 2, 2, 16  # hidden, experts, top-k, ranks, max tokens per rank
L, CAP = E // R, R * M  # local experts, normal-mode receive capacity


class FakeLib:
    """The epx_* entry points the Group calls, on host memory."""

    def __init__(self):
        self.calls, self.buffers, self.error = [], [], b""
        self.next_handle = 0x5000
        self.seq = 0
        # what epx_dispatch answers, and whether it fills the result first (as C does before
        # a count timeout, not before a refusal); handles whose destroy fails
        self.dispatch_status, self.dispatch_fills = 0, True
        self.failing_handles = set()

    def _buffer(self, nbytes):
        b = (ctypes.c_char * max(nbytes, 16))()
        self.buffers.append(b)
        return ctypes.addressof(b)

    def epx_last_error(self):
        return self.error

    def epx_status_string(self, status):
        return b"fake status"

    def epx_group_create(self, comm, cfg, out):
        self.calls.append(("create", comm, G.config_dict(cfg._obj)))
        self.config = _capi.epx_group_config_t.from_buffer_copy(cfg._obj)
        out._obj.value = 0x1000
        return 0

    def epx_group_rank(self, g, out):
        out._obj.value = 1
        return 0

    def epx_group_size(self, g, out):
        out._obj.value = R
        return 0

    def epx_group_get_config(self, g, out):
        ctypes.memmove(ctypes.addressof(out._obj), ctypes.addressof(self.config),
                       ctypes.sizeof(self.config))
        out._obj.num_sms = 24  # an auto field, resolved
        return 0

    def epx_group_workspace_bytes(self, g, out):
        out._obj.value = 123456
        return 0

    def epx_group_destroy(self, g):
        self.calls.append(("group_destroy", g))
        return 0

    def epx_handle_create(self, g, out):
        self.next_handle += 0x10
        out._obj.value = self.next_handle
        return 0

    def epx_handle_destroy(self, h):
        self.calls.append(("handle_destroy", h))
        return epx.errors.EPX_ERR_CUDA if h in self.failing_handles else 0

    def epx_layout(self, g, a, stream):
        self.calls.append(("layout", _copy(a._obj), stream))
        return 0

    def _fill_dispatch(self, a, r, num_recv):
        fp8 = a.x_dtype == _capi.EPX_DTYPE_FP8_E4M3
        packed = a.x_scales_dtype == _capi.EPX_DTYPE_INT32
        r.num_recv, r.capacity = num_recv, CAP
        r.recv_x = self._buffer(CAP * H * 2)
        if fp8 and packed:
            r.recv_x_scales_packed = self._buffer(CAP * H // 128 * 4)
        elif fp8:
            r.recv_x_scales = self._buffer(CAP * H // 128 * 4)
        if a.recv_topk_idx_dtype == _capi.EPX_DTYPE_INT64:
            r.recv_topk_idx_int64 = self._buffer(CAP * K * 8)
        else:
            r.recv_topk_idx = self._buffer(CAP * K * 4)
        r.recv_topk_weights = self._buffer(CAP * K * 4)
        r.recv_src_token = self._buffer(CAP * 4)
        r.recv_rank_prefix = self._buffer((R + 1) * 4)
        r.num_recv_device = self._buffer(4)
        r.num_recv_per_expert_device = self._buffer(L * 4)
        r.rank_prefix_matrix_device = self._buffer(R * R * 4)

    def epx_dispatch(self, g, h, a, r, stream):
        a = a._obj
        self.calls.append(("dispatch", h, _copy(a), stream))
        if a.num_recv_per_expert:
            counts = (ctypes.c_int * L).from_address(a.num_recv_per_expert)
            counts[:] = list(range(1, L + 1))
        num_recv = 7 if a.sync_counts else (a.num_worst_tokens or -1)
        if self.dispatch_status in (epx.errors.EPX_ERR_TIMEOUT,
                                    epx.errors.EPX_ERR_INVALID_ARGUMENT):
            num_recv = -1  # a failed count exchange (a refusal that still fills: too many tokens)
        if self.dispatch_fills:
            self._fill_dispatch(a, r._obj, num_recv)
        return self.dispatch_status

    def epx_dispatch_cached_args(self, g, h, a, r, stream):
        self.calls.append(("dispatch_cached", h, _copy(a._obj), stream))
        self._fill_dispatch(a._obj, r._obj, -1)
        return 0

    def epx_combine(self, g, h, a, stream):
        self.calls.append(("combine", h, _copy(a._obj), stream))
        return 0

    def epx_ll_dispatch(self, g, a, r, stream):
        a, r = a._obj, r._obj
        self.calls.append(("ll_dispatch", _copy(a), stream))
        self.seq += 1
        r.num_tokens, r.num_local_experts, r.rows_per_expert = a.num_tokens, L, R * M
        r.max_tokens_per_rank, r.recv_dtype = M, a.recv_dtype
        rows = L * R * M
        r.recv_x = self._buffer(rows * H * 2)
        if a.recv_dtype == _capi.EPX_DTYPE_FP8_E4M3:
            if a.ue8m0_packed:
                r.recv_x_scales_packed = self._buffer(rows * H // 128 * 4)
            else:
                r.recv_x_scales = self._buffer(rows * H // 128 * 4)
        r.recv_src_info = self._buffer(rows * 16)
        r.recv_count = self._buffer(L * 4)
        r.recv_begin, r.recv_num = self._buffer(L * R * 4), self._buffer(L * R * 4)
        r.combine_input = self._buffer(rows * H * 2)
        r.buffer, r.call_id, r.packed = self.seq % 2, self.seq, a.packed
        r.hook.id = (self.seq << 2) if a.split else 0
        return 0

    def epx_ll_combine(self, g, a, stream):
        a = a._obj
        self.calls.append(("ll_combine", _copy(a), a.dispatch.contents.call_id, stream))
        if a.split:
            self.seq += 1
            a.hook.contents.id = (self.seq << 2) | 2
        return 0

    def epx_ll_recv(self, g, hook, stream):
        hook = hook._obj
        if hook.id == 0:
            self.error = b"epx_ll_recv: hook 0 is not pending on this group"
            return epx.errors.EPX_ERR_INVALID_USAGE
        self.calls.append(("ll_recv", hook.id, stream))
        hook.id = 0
        return 0

    def epx_group_get_async_error(self, g, e):
        e = e._obj
        e.status, e.stage, e.peer, e.position, e.value = 7, 2, 0, -1, 3
        e.message = b"barrier: rank 1 waited for rank 0"
        return 0

    def epx_group_get_peer_mask(self, g, mask):
        mask._obj.value = 0b01
        return 0

    def epx_group_barrier(self, g, stream):
        self.calls.append(("barrier", stream))
        return 0

    def epx_group_barrier_unmasked(self, g, stream):
        self.calls.append(("barrier_unmasked", stream))
        return 0

    def epx_trace_dump(self, g, path, summary, stream):
        self.calls.append(("trace_dump", path))
        summary._obj.num_events = 42
        return 0


def _copy(struct):
    return type(struct).from_buffer_copy(struct)


def fake_view(cache, keepalive, ptr, dtype, shape, device, region_bytes=0):
    """device_view over host memory (torch cannot read a CUDA array interface without CUDA)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = (ctypes.c_char * nbytes).from_address(ptr)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    lib = FakeLib()
    monkeypatch.setattr(_capi, "lib", lib)
    monkeypatch.setattr(G, "lib", lib)
    monkeypatch.setattr(_tensors, "device_view", fake_view)
    monkeypatch.setattr(G, "_stream_ptr", lambda stream: 0xABC if stream is None else stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_nccl, "comm_init_rank", lambda n, uid, rank: 0xC0)
    monkeypatch.setattr(_nccl, "comm_destroy", lambda c: lib.calls.append(("comm_destroy", c)))
    monkeypatch.setattr(_nccl, "comm_abort", lambda c: lib.calls.append(("comm_abort", c)))
    dist.init_process_group("gloo", init_method="file://%s" % (tmp_path / "store"), rank=0,
                            world_size=1)
    yield lib
    dist.destroy_process_group()


def make_group(**kw):
    g = epx.Group(M, H, E, K, modes=("normal", "low_latency"), **kw)
    g.device = torch.device("cpu")  # fresh outputs on the host, and CPU tensors accepted
    g._dims = g._dims._replace(device_type="cpu", device_index=None)
    return g


def test_create_fills_the_config_and_reads_the_group_back(fake):
    g = make_group(ll_route="by_rank", timeout_ms=1000)
    _, comm, cfg = fake.calls[0]
    assert comm == 0xC0
    assert cfg["modes"] == 3 and cfg["ll_route"] == 2 and cfg["timeout_ms"] == 1000
    assert (g.rank, g.num_ranks, g.num_local_experts, g.workspace_bytes) == (1, R, L, 123456)
    assert g.config["num_sms"] == 24 and g.config["hidden"] == H
    g.destroy()


def test_normal_round_trip(fake):
    g = make_group()
    h = g.handle()
    x = torch.zeros((5, H), dtype=torch.bfloat16)
    idx = torch.zeros((5, K), dtype=torch.int32)
    w = torch.zeros((5, K))
    r = g.dispatch(h, x, idx, w)
    _, hptr, a, stream = fake.calls[-1]
    assert hptr == h._res.state.ptr and stream == 0xABC
    assert (a.x, a.x_dtype, a.num_tokens, a.topk_idx) == (x.data_ptr(), 1, 5, idx.data_ptr())
    assert a.topk_idx_dtype == _capi.EPX_DTYPE_INT32 and a.topk_weights == w.data_ptr()
    assert a.sync_counts == 1 and a.expert_alignment == 1 and a.x_scales is None
    assert r.num_recv == 7 and r.num_recv_per_expert == [1, 2, 3, 4]
    assert r.recv_x.shape == (7, H) and r.recv_x.dtype == torch.bfloat16
    assert r.recv_topk_idx.shape == (7, K) and r.recv_topk_idx.dtype == torch.int32
    assert r.recv_src_token.shape == (7,) and r.rank_prefix_matrix.shape == (R, R)
    assert r.recv_rank_prefix.shape == (R + 1,) and r.num_recv_per_expert_device.shape == (L,)
    assert r.recv_x_scales is None and r.capacity == CAP

    out, out_w = g.combine(h, r.recv_x, recv_topk_weights=r.recv_topk_weights, bias=(x, x))
    _, _, c, _ = fake.calls[-1]
    assert out.shape == (5, H) and out_w.shape == (5, K)
    assert (c.x, c.out, c.out_topk_weights) == (r.recv_x.data_ptr(), out.data_ptr(),
                                               out_w.data_ptr())
    assert list(c.bias) == [x.data_ptr(), x.data_ptr()]

    # A rank that received nothing passes empty tensors: C still gets valid memory.
    empty = torch.empty((0, H), dtype=torch.bfloat16)
    h.num_recv = 0
    g.combine(h, empty, recv_topk_weights=torch.empty((0, K)))
    _, _, c, _ = fake.calls[-1]
    assert c.x == h._recv_x_ptr and c.recv_topk_weights == h._recv_weights_ptr

    cached = g.dispatch_cached(h, x)
    assert cached.num_recv == 0  # the filling dispatch's count (h.num_recv above)
    g.destroy()
    names = [c[0] for c in fake.calls[-3:]]
    assert names == ["handle_destroy", "group_destroy", "comm_destroy"]
    with pytest.raises(epx.EpxInvalidUsage, match="Group.dispatch: the group was destroyed"):
        g.dispatch(h, x, idx)
    g.destroy()  # idempotent
    h.destroy()


def test_a_rank_without_tokens_keeps_its_weight_choices(fake):
    """T = 0: empty tensors have data_ptr() 0, but weights the caller gave must not turn into
    NULL (normal combine: out_topk_weights pairs with recv_topk_weights; low-latency combine:
    given weights choose route BY_RANK's combine on every rank alike)."""
    g = make_group()
    h = g.handle()
    x = torch.empty((0, H), dtype=torch.bfloat16)
    r = g.dispatch(h, x, torch.empty((0, K), dtype=torch.int32))
    out, out_w = g.combine(h, r.recv_x, recv_topk_weights=r.recv_topk_weights)
    _, _, c, _ = fake.calls[-1]
    assert out.shape == (0, H) and out_w.shape == (0, K)
    assert c.recv_topk_weights and c.out_topk_weights == h._recv_weights_ptr

    d = g.ll_dispatch(x, torch.empty((0, K), dtype=torch.int64))
    g.ll_combine(d, topk_weights=torch.empty((0, K)))
    _, c, _, _ = fake.calls[-1]
    assert c.topk_weights == d._c.combine_input and c.topk_weights
    g.ll_combine(d)
    _, c, _, _ = fake.calls[-1]
    assert c.topk_weights is None
    g.destroy()


def test_fp8_dispatch_with_strided_scales_and_int64_ids(fake):
    g = make_group()
    h = g.handle()
    x = torch.zeros((5, H), dtype=torch.float8_e4m3fn)
    scales = torch.zeros((H // 128, 5)).t()  # column-major, as DeepEP passes them
    idx = torch.zeros((5, K), dtype=torch.int64)
    r = g.dispatch(h, x, idx, x_scales=scales, sync_counts=False, num_worst_tokens=9,
                   recv_topk_idx_dtype=torch.int64)
    _, _, a, _ = fake.calls[-1]
    assert (a.x_dtype, a.x_scales_dtype) == (_capi.EPX_DTYPE_FP8_E4M3, _capi.EPX_DTYPE_FLOAT32)
    assert (a.x_scales_stride_token, a.x_scales_stride_group) == (1, 5)
    assert a.sync_counts == 0 and a.num_recv_per_expert is None and a.num_worst_tokens == 9
    assert a.recv_topk_idx_dtype == _capi.EPX_DTYPE_INT64
    assert r.num_recv == 9 and r.recv_x.shape == (9, H) and r.recv_x.dtype == x.dtype
    assert r.recv_x_scales.shape == (9, H // 128) and r.recv_topk_idx.dtype == torch.int64
    assert r.num_recv_per_expert is None

    packed = torch.zeros((5, 1), dtype=torch.int32)
    r = g.dispatch_cached(h, x, packed)
    _, _, a, _ = fake.calls[-1]
    assert a.x_scales_dtype == _capi.EPX_DTYPE_INT32 and a.num_tokens == 5
    assert a.topk_idx is None and r.recv_x_scales.dtype == torch.int32
    g.destroy()


def test_layout_outputs(fake):
    g = make_group()
    idx = torch.zeros((3, K), dtype=torch.int64)
    lay = g.layout(idx)
    _, a, _ = fake.calls[-1]
    assert lay.is_token_in_rank.shape == (3, R) and lay.is_token_in_rank.dtype == torch.bool
    assert lay.num_tokens_per_expert.shape == (E,) and lay.num_tokens_per_rank.shape == (R,)
    assert (a.num_tokens, a.topk_idx_dtype) == (3, _capi.EPX_DTYPE_INT64)
    assert a.token_pos_in_rank == lay.token_pos_in_rank.data_ptr()
    g.destroy()


def test_low_latency_split_round_trip(fake):
    g = make_group()
    x = torch.zeros((4, H), dtype=torch.bfloat16)
    idx = torch.zeros((4, K), dtype=torch.int64)
    d = g.ll_dispatch(x, idx, fp8=True, split=True)
    _, a, _ = fake.calls[-1]
    assert (a.recv_dtype, a.split, a.num_tokens) == (_capi.EPX_DTYPE_FP8_E4M3, 1, 4)
    assert d.recv_x.shape == (L, R * M, H) and d.recv_x.dtype == torch.float8_e4m3fn
    assert d.recv_x_scales.shape == (L, R * M, H // 128) and d.recv_x_scales_packed is None
    assert d.recv_src_info.shape == (L, R * M, 4) and d.recv_begin.shape == (L, R)
    assert d.combine_input.dtype == torch.bfloat16 and d.layout_range is None
    assert d.hook is not None and d.hook.pending
    d.hook()
    assert not d.hook.pending and d._c.hook.id == 0  # the result's own hook was completed
    with pytest.raises(epx.EpxInvalidUsage, match="not pending"):
        d.hook()

    out, hook = g.ll_combine(d, split=True)
    _, c, call_id, _ = fake.calls[-1]
    assert call_id == d._c.call_id and c.x is None and c.out == out.data_ptr()
    assert out.shape == (4, H) and hook.pending
    g.ll_recv(hook)
    assert not hook.pending

    d2 = g.ll_dispatch(x, idx, fp8=True, ue8m0=True, ue8m0_packed=True, packed=True,
                       layout_range=True)
    _, a, _ = fake.calls[-1]
    assert a.layout_range == d2.layout_range.data_ptr() and d2.layout_range.shape == (L, R)
    assert d2.recv_x_scales is None and d2.recv_x_scales_packed.shape == (L, R * M, 1)
    assert d2.hook is None and d2.packed
    out = g.ll_combine(d2, d2.combine_input, topk_weights=torch.zeros((4, K)))
    assert out.shape == (4, H)
    g.destroy()


def test_errors_peers_and_tracing(fake):
    g = make_group()
    e = g.async_error()
    assert e.stage == "EPX_STAGE_BARRIER" and e.message.startswith("barrier")
    with pytest.raises(epx.EpxTimeout) as info:
        g.check_async_error(synchronize=False)
    assert info.value.async_error.peer == 0
    assert g.peer_mask == 1
    g.barrier()
    assert fake.calls[-1] == ("barrier", 0xABC)
    g.barrier(skip_masked=True, stream=7)  # shrink mode's barrier: not the masked peers
    assert fake.calls[-1] == ("barrier_unmasked", 7)
    assert g.trace_dump("/tmp/t.json")["num_events"] == 42
    assert fake.calls[-1] == ("trace_dump", b"/tmp/t.json")
    g.destroy()


def test_garbage_collection_releases_but_never_at_exit(fake):
    g = make_group()
    h = g.handle()
    release = g._res.release
    assert release.atexit is False and h._res.release.atexit is False
    del g, h
    gc.collect()
    names = [c[0] for c in fake.calls[-3:]]
    assert names == ["handle_destroy", "group_destroy", "comm_destroy"]
    assert not release.alive


def test_context_manager_destroys(fake):
    with make_group() as g:
        pass
    assert g.destroyed and fake.calls[-2][0] == "group_destroy"


def test_foreign_handles_hooks_and_results_are_refused(fake):
    g, other = make_group(), make_group()
    x = torch.zeros((2, H), dtype=torch.bfloat16)
    with pytest.raises(epx.EpxInvalidArgument, match="expected an epx.Handle of this group"):
        g.dispatch(other.handle(), x, torch.zeros((2, K), dtype=torch.int64))
    with pytest.raises(epx.EpxInvalidArgument, match="expected an epx.Hook of this group"):
        g.ll_recv(object())
    with pytest.raises(epx.EpxInvalidArgument, match="expected an epx.LLDispatchResult"):
        g.ll_combine(object())
    with pytest.raises(epx.EpxInvalidUsage, match="holds no routing yet"):
        g.combine(g.handle(), x)
    h = g.handle()
    h.destroy()
    with pytest.raises(epx.EpxInvalidUsage, match="the handle was destroyed"):
        g.dispatch(h, x, torch.zeros((2, K), dtype=torch.int64))
    g.destroy()
    other.destroy()


def test_a_failed_dispatch_leaves_no_stale_routing(fake):
    """C sets the handle's token count before a dispatch can fail: a combine sized by the
    previous dispatch's count would write past its output."""
    g = make_group()
    h = g.handle()
    x5, idx5 = torch.zeros((5, H), dtype=torch.bfloat16), torch.zeros((5, K), dtype=torch.int32)
    x9, idx9 = torch.zeros((9, H), dtype=torch.bfloat16), torch.zeros((9, K), dtype=torch.int32)
    g.dispatch(h, x5, idx5)
    assert h.num_tokens == 5
    fake.dispatch_status, fake.dispatch_fills = epx.errors.EPX_ERR_CUDA, False
    with pytest.raises(epx.EpxError):
        g.dispatch(h, x9, idx9)
    assert h.num_tokens is None
    with pytest.raises(epx.EpxInvalidUsage, match="holds no routing yet"):
        g.combine(h, torch.zeros((7, H), dtype=torch.bfloat16))
    # a count timeout: C filled the result, the handle is that call's (9 tokens, count unknown)
    fake.dispatch_status, fake.dispatch_fills = epx.errors.EPX_ERR_TIMEOUT, True
    with pytest.raises(epx.EpxTimeout):
        g.dispatch(h, x9, idx9)
    assert (h.num_tokens, h.num_recv) == (9, -1)
    out, _ = g.combine(h, torch.zeros((CAP, H), dtype=torch.bfloat16))
    assert out.shape == (9, H)
    # over max_tokens_per_rank: C refuses but runs the failed, empty exchange (every rank's call
    # fails at once), and its handle holds 0 tokens, so a combine after it returns no rows
    # instead of M + 1 rows of uninitialized memory
    xb, idxb = torch.zeros((M + 1, H), dtype=torch.bfloat16), torch.zeros((M + 1, K),
                                                                          dtype=torch.int32)
    fake.dispatch_status = epx.errors.EPX_ERR_INVALID_ARGUMENT
    with pytest.raises(epx.EpxError):
        g.dispatch(h, xb, idxb, num_worst_tokens=CAP)
    assert (h.num_tokens, h.num_recv, h.num_worst_tokens) == (0, -1, 0)
    out, _ = g.combine(h, torch.zeros((CAP, H), dtype=torch.bfloat16))
    assert out.shape == (0, H)
    g.destroy()


def test_releasing_a_group_releases_every_handle_after_a_failure(fake):
    g = make_group()
    handles = [g.handle() for _ in range(3)]
    ptrs = {h._res.state.ptr for h in handles}
    fake.failing_handles = set(ptrs)  # every one fails: none may be skipped
    with pytest.raises(epx.EpxError):
        g.destroy()
    assert {c[1] for c in fake.calls if c[0] == "handle_destroy"} == ptrs
    assert [c[0] for c in fake.calls[-2:]] == ["group_destroy", "comm_destroy"]



def test_an_empty_x_with_an_unknown_count_is_refused(fake):
    """With sync_counts=False the host does not know this rank's rows: an empty x cannot mean
    "no rows" then (C would combine the delivered rows in its place)."""
    g = make_group()
    h = g.handle()
    x, idx = torch.zeros((5, H), dtype=torch.bfloat16), torch.zeros((5, K), dtype=torch.int32)
    g.dispatch(h, x, idx, sync_counts=False)
    assert h.num_recv == -1
    with pytest.raises(epx.EpxInvalidArgument, match="x is empty, but this rank's num_recv"):
        g.combine(h, torch.empty((0, H), dtype=torch.bfloat16))
    g.combine(h, torch.zeros((CAP, H), dtype=torch.bfloat16))  # the delivered rows: accepted
    g.destroy()


def test_a_borrowed_communicator_destroyed_first_is_refused(fake, monkeypatch):
    """With borrow_nccl_comm=True the process group must outlive the EPX group: once
    destroy_process_group took the communicator (and what EPX registered on it), every call is
    refused by name, and destroy leaves the group's memory instead of releasing it through NCCL
    state that no longer exists."""
    sub = dist.new_group([0])
    alive = functools.partial(G._process_group_alive, dist, sub)
    monkeypatch.setattr(G, "_borrowed_comm", lambda d, t, group: (0xB0, alive))
    g = make_group(group=sub, borrow_nccl_comm=True)
    h = g.handle()
    x, idx = torch.zeros((5, H), dtype=torch.bfloat16), torch.zeros((5, K), dtype=torch.int32)
    g.dispatch(h, x, idx)  # alive: calls go through
    assert alive() and G._process_group_alive(dist, dist.distributed_c10d._get_default_group())
    dist.destroy_process_group(sub)
    assert not alive()
    with pytest.raises(epx.EpxInvalidUsage, match="borrowed .*destroyed before the group"):
        g.dispatch(h, x, idx)
    # a prefill plan over the group runs on its workspace: refused too (its _ptr alone here)
    plan = MoePrefill.__new__(MoePrefill)
    plan._plan, plan._groups = 0x5, [g]
    with pytest.raises(epx.EpxInvalidUsage, match="MoePrefill: .*destroyed before the group"):
        plan._ptr("MoePrefill")
    with pytest.raises(epx.EpxInvalidUsage, match="Group.destroy: .*left allocated"):
        g.destroy()
    assert not [c for c in fake.calls if c[0] in ("group_destroy", "handle_destroy",
                                                  "comm_destroy", "comm_abort")]
    g.destroy()  # idempotent: nothing left to release
    h.destroy()


def test_cpu_prefill_overlap_mode_names():
    """MoePrefill's overlap takes True, False or "phases"; another string is refused by name
    before the plan is touched (a bare object here: no plan, no GPU)."""
    plan = MoePrefill.__new__(MoePrefill)
    with pytest.raises(epx.EpxInvalidArgument, match="overlap = 'chunks'.*phases"):
        plan(None, None, overlap="chunks")

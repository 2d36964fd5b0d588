"""test_gpu_native.py - epx.Group on 1, 2 and 4 GPUs against plain-torch references.

Each test spawns one process per GPU (gpu_spawn.run_ranks: NCCL process group, NCCL_NVLS_ENABLE=0,
a timeout so that a hang fails instead of blocking) and runs one worker below, which goes through
many sections on one EPX group; spawning costs ~10 s, so checks are grouped per spawn:

  worker_normal (normal-mode group):
    group        rank, size, local experts, config, workspace_bytes == epx.workspace_size,
                 version, nccl_version
    layout       Group.layout: per-rank and per-expert counts, is_token_in_rank, positions
                 (int64 and int32 ids, uniform and holes routings)
    dispatch     BF16 rows in source-rank then source-token order, local ids / -1, weights / 0,
                 source tokens, rank prefix, per-expert counts (host and device), prefix matrix;
                 int32 ids in and int64 ids out, expert_alignment; combine: plain sum over ranks,
                 weighted by topk_idx/topk_weights, recv_topk_weights -> combined weights
                 (exact) with a bias pair, one bias with out=
    fp8          FP8 rows bit-exact, scales exact, contiguous and column-major scales
    cached       dispatch_cached: new BF16 and FP8 payload along the recorded routing; combine
    no host sync sync_counts=False (num_recv -1, capacity rows, device counts) and
                 num_worst_tokens (N rows, ids -1 and weights 0 in the tail), each then combined
    rank mask    is_token_in_rank + num_tokens_per_expert routing, no ids; combine
    adversarial  all tokens to one expert, -1 slots, duplicated experts, a rank with 0 tokens
    moe prefill  epx.MoePrefill (two groups with expand_max_rows, BF16 experts): chain and
                 overlapped layer against a plain-torch layer, four routings; the same
                 experts in FP8 on EPX's grouped GEMM: phases equal to the chain
    expand       dispatch_expand / combine_expand (a second group with expand_max_rows): rows,
                 padding, begins, counts, sources, weights, token_rows, expert_ready exact;
                 combine within BF16 rounding; alignments 1 and 8; the routings above; refusal without the buffer
    cuda graph   dispatch(sync_counts=False) + expert + combine captured once, replayed twice on
                 new inputs; dispatch(sync_counts=True) under capture raises EpxInvalidUsage
    errors       bad arguments -> EpxInvalidArgument (Python's and EPX's messages, status,
                 ValueError), mask_peer without low-latency mode -> EpxInvalidUsage, async
                 errors (bad expert id in layout; worst-token overflow), then the group works
    communicators an epx.Group over a gloo group, and one borrowing the NCCL communicator
  worker_low_latency (group with both modes, ll_max_tokens_per_rank < max_tokens_per_rank):
    fixed        fixed slots: counts, segments, rows, source info; zero-copy combine with
                 dispatch-time weights
    two in flight two dispatches then two combines: combine-time weights with an explicit x,
                 int32 ids, no weights at all (1)
    fp8          on-the-fly FP8 (scales, dequantized rows), UE8M0 scales, UE8M0 words
    packed       packed layout: begins, rows from 0, layout_range; combine
    split        split dispatch (Group.ll_recv) and split combine (hook())
    adversarial  the routings above, combine-time weights
    ll errors    too many tokens, ue8m0 without fp8 -> EpxInvalidArgument
    peer mask    mask_peer / peer_mask / calls without the masked peer / clear_peer_mask;
                 masking this rank -> EpxInvalidArgument
    cuda graph   ll_dispatch + expert + ll_combine captured once, replayed twice
    normal too   a normal dispatch/combine of more tokens than the low-latency maximum
    moe layer    Group.moe_decode with BF16 epx.Experts (every rank draws every rank's experts
                 from the seed) against a float64 per-token reference, bound 0.03 x sum |w y|
                 + 0.02 x rms(y) x sum |w|; holes in the routing; out= given; a bad experts
                 argument -> EpxInvalidArgument

A failed check is recorded, not raised, so every rank keeps making the same collective calls;
after each section the ranks agree (over gloo) whether it raised, and stop if only some did.
Every failure names its seed; rerun with EPX_TEST_SEED=N.
"""
import os
import random
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import pytest  # noqa: E402

import gpu_spawn  # noqa: E402

_SKIP = gpu_spawn.skip_reason(1)
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")

SEED = int(os.environ.get("EPX_TEST_SEED") or random.SystemRandom().randrange(1, 2**31))
TIMEOUT_S = float(os.environ.get("EPX_TEST_TIMEOUT", "300"))


def _need(world_size):
    n = gpu_spawn.gpu_count()
    if n < world_size:
        pytest.skip(f"needs {world_size} GPUs, {n} visible")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_normal_mode(world_size):
    _need(world_size)
    print(f"seed {SEED} (EPX_TEST_SEED={SEED} reruns it)")
    gpu_spawn.run_ranks(world_size, "test_gpu_native:worker_normal", (SEED,), TIMEOUT_S)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_low_latency(world_size):
    _need(world_size)
    print(f"seed {SEED} (EPX_TEST_SEED={SEED} reruns it)")
    gpu_spawn.run_ranks(world_size, "test_gpu_native:worker_low_latency", (SEED,), TIMEOUT_S)


# =============================================================================================
# Everything below runs in the spawned rank processes.
# =============================================================================================
class Ctx:
    """One rank's state: modules, checks, the gloo groups for host barriers and agreement."""

    def __init__(self, rank, num_ranks, seed):
        import torch
        import torch.distributed as dist

        import epx
        import gpu_reference
        self.torch, self.dist, self.epx, self.ref = torch, dist, epx, gpu_reference
        self.rank, self.R, self.seed = rank, num_ranks, seed
        self.device = torch.device("cuda", rank)
        self.checks = gpu_spawn.Checks(rank, seed)
        self.host_pg = dist.new_group(backend="gloo")    # barriers inside sections
        self.agree_pg = dist.new_group(backend="gloo")   # "did this section raise?" only
        self.scale = [2.0**d for d in range(num_ranks)]  # rank d's expert: x * 2^d (exact)

    def cuda(self, t):
        return t.to(self.device)

    def barrier(self):
        """All ranks done with their GPU work and host reads: outputs of the previous dispatch
        may now be overwritten by a peer's next one."""
        self.torch.cuda.synchronize()
        self.dist.barrier(group=self.host_pg)


def run_sections(ctx, sections):
    torch, dist = ctx.torch, ctx.dist
    for name, fn in sections:
        ctx.checks.where(name)
        raised = 0
        try:
            fn(ctx)
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - recorded with its traceback
            ctx.checks.fail("exception:\n" + traceback.format_exc())
            raised = 1
        flag = torch.tensor([raised], dtype=torch.int64)
        dist.all_reduce(flag, group=ctx.agree_pg)
        n = int(flag.item())
        if 0 < n < ctx.R:
            ctx.checks.fail(f"{n} of {ctx.R} ranks raised: stopping here (their collective calls "
                            "no longer match)")
            return False
    return True


def check_dispatch(ctx, r, want, what, ids_dtype=None, fp8=False, num_recv=True):
    """A normal dispatch result against gpu_reference.dispatch (rows [0, n) of every array)."""
    torch, c = ctx.torch, ctx.checks
    ids_dtype = ids_dtype or torch.int32
    n = want["x"].shape[0]
    if num_recv:
        c.check(r.num_recv == n, f"{what}: num_recv {r.num_recv}, expected {n}")
        per_expert = r.num_recv_per_expert
        c.check(per_expert is not None and list(per_expert) == want["per_expert"].tolist(),
                lambda: f"{what}: num_recv_per_expert {r.num_recv_per_expert}, expected "
                        f"{want['per_expert'].tolist()}")
    c.check(r.recv_x.shape[0] >= n and r.recv_x.shape[1:] == want["x"].shape[1:],
            f"{what}: recv_x shape {tuple(r.recv_x.shape)}, expected >= {tuple(want['x'].shape)}")
    if fp8:
        c.check(r.recv_x.dtype == torch.float8_e4m3fn, f"{what}: recv_x dtype {r.recv_x.dtype}")
        c.equal(r.recv_x[:n].view(torch.uint8), want["x_fp8"].view(torch.uint8), f"{what}: recv_x")
        c.equal(r.recv_x_scales[:n], want["x_scales"], f"{what}: recv_x_scales")
    else:
        c.check(r.recv_x.dtype == torch.bfloat16, f"{what}: recv_x dtype {r.recv_x.dtype}")
        c.check(r.recv_x_scales is None, f"{what}: recv_x_scales not None for BF16")
        c.equal(r.recv_x[:n], want["x"], f"{what}: recv_x")
    c.check(r.recv_topk_idx.dtype == ids_dtype,
            f"{what}: recv_topk_idx dtype {r.recv_topk_idx.dtype}, expected {ids_dtype}")
    c.equal(r.recv_topk_idx[:n].long(), want["topk_idx"].long(), f"{what}: recv_topk_idx")
    c.equal(r.recv_topk_weights[:n], want["topk_weights"], f"{what}: recv_topk_weights")
    c.equal(r.recv_src_token[:n], want["src_token"], f"{what}: recv_src_token")
    c.equal(r.recv_rank_prefix, want["rank_prefix"], f"{what}: recv_rank_prefix")
    c.equal(r.num_recv_device.reshape(-1), torch.tensor([n], dtype=torch.int32),
            f"{what}: num_recv_device")
    c.equal(r.num_recv_per_expert_device, want["per_expert"], f"{what}: num_recv_per_expert_device")
    c.equal(r.rank_prefix_matrix, want["rank_prefix_matrix"], f"{what}: rank_prefix_matrix")


def inputs(ctx, world):
    """This rank's x, ids, weights on the GPU."""
    s = ctx.rank
    return ctx.cuda(world.x[s]), ctx.cuda(world.idx[s]), ctx.cuda(world.w[s])


def dispatch_and_combine(ctx, g, h, world, what, weighted=False):
    """A plain dispatch, checked, then a combine of x * 2^rank, checked."""
    x, idx, w = inputs(ctx, world)
    r = g.dispatch(h, x, idx, w)
    want = ctx.ref.dispatch(world, ctx.rank)
    check_dispatch(ctx, r, want, what)
    y = r.recv_x[:want["x"].shape[0]] * ctx.scale[ctx.rank]
    kw = dict(topk_idx=idx, topk_weights=w) if weighted else {}
    out, out_w = g.combine(h, y, **kw)
    ctx.checks.check(out_w is None, f"{what}: combine returned weights without recv_topk_weights")
    exp, bound = ctx.ref.combine(world, ctx.rank, ctx.scale, weighted=weighted)
    ctx.checks.check(out.dtype == ctx.torch.bfloat16, f"{what}: combine out dtype {out.dtype}")
    ctx.checks.close(out, exp, bound, f"{what}: combine{' weighted' if weighted else ''}")


# ---------------------------------------------------------------------------------------------
# Normal mode
# ---------------------------------------------------------------------------------------------
N_M, N_H, N_K = 64, 512, 6  # max tokens per rank, hidden, top-k; experts = 8 per rank


def worker_normal(rank, num_ranks, seed):
    ctx = Ctx(rank, num_ranks, seed)
    epx = ctx.epx
    ctx.E = 8 * num_ranks
    ctx.world = lambda k, routing="uniform", **kw: ctx.ref.World(
        seed + k, num_ranks, N_M, N_H, ctx.E, N_K, routing, **kw)
    ctx.g = epx.Group(N_M, N_H, ctx.E, N_K)  # the default (NCCL) process group
    ctx.h = ctx.g.handle()
    finished = run_sections(ctx, [
        ("group", _n_group), ("layout", _n_layout), ("dispatch + combine", _n_dispatch_combine),
        ("fp8", _n_fp8), ("cached", _n_cached), ("no host sync", _n_no_host_sync),
        ("rank mask", _n_rank_mask), ("adversarial", _n_adversarial), ("expand", _n_expand),
        ("moe prefill", _n_moe_prefill),
        ("cuda graph", _n_graph),
        ("errors", _n_errors), ("communicators", _n_communicators),
    ])
    if finished:  # else the ranks are out of step: a collective destroy could hang
        ctx.checks.where("destroy")
        ctx.h.destroy()
        ctx.g.destroy()
        ctx.g.destroy()  # idempotent
    return ctx.checks.failures


def _n_group(ctx):
    c, g, R = ctx.checks, ctx.g, ctx.R
    c.check(g.rank == ctx.rank and g.num_ranks == R, f"rank/size {g.rank}/{g.num_ranks}")
    c.check(g.num_local_experts == ctx.E // R, f"num_local_experts {g.num_local_experts}")
    ws = ctx.epx.workspace_size(R, N_M, N_H, ctx.E, N_K)
    c.check(ws["total"] == g.workspace_bytes, f"workspace_size {ws} vs {g.workspace_bytes}")
    c.check(ws["total"] == ws["common"] + ws["normal"] + ws["low_latency"]
            and ws["low_latency"] == 0, f"workspace_size parts {ws}")
    cfg = g.config
    for key, want in (("max_tokens_per_rank", N_M), ("hidden", N_H), ("num_experts", ctx.E),
                      ("top_k", N_K)):
        c.check(cfg.get(key) == want, f"config[{key!r}] = {cfg.get(key)!r}, expected {want}")
    c.check(cfg.get("num_sms", 0) > 0, f"config num_sms not resolved: {cfg}")
    c.check(isinstance(ctx.epx.version(), str), f"version() {ctx.epx.version()!r}")
    built, loaded = ctx.epx.nccl_version()
    c.check(built == loaded, f"nccl_version() built {built} != loaded {loaded}")


def _n_layout(ctx):
    torch, c = ctx.torch, ctx.checks
    for k, routing in ((1, "uniform"), (2, "holes")):
        world = ctx.world(k, routing)
        idx = ctx.cuda(world.idx[ctx.rank])
        want = ctx.ref.layout(world, ctx.rank)
        for ids in (idx, idx.int()):
            lay = ctx.g.layout(ids)
            what = f"layout {routing} {ids.dtype}"
            c.check(lay.is_token_in_rank.dtype == torch.bool,
                    f"{what}: is_token_in_rank dtype {lay.is_token_in_rank.dtype}")
            for name in ("num_tokens_per_rank", "num_tokens_per_expert", "token_pos_in_rank"):
                got = getattr(lay, name)
                c.check(got.dtype == torch.int32, f"{what}: {name} dtype {got.dtype}")
                c.equal(got, want[name], f"{what}: {name}")
            c.equal(lay.is_token_in_rank, want["is_token_in_rank"], f"{what}: is_token_in_rank")


def _n_dispatch_combine(ctx):
    torch, c, g, h, me = ctx.torch, ctx.checks, ctx.g, ctx.h, ctx.rank
    world = ctx.world(3)
    x, idx, w = inputs(ctx, world)
    T = x.shape[0]
    want = ctx.ref.dispatch(world, me)
    n = want["x"].shape[0]

    r = g.dispatch(h, x, idx, w)
    check_dispatch(ctx, r, want, "bf16")
    y = r.recv_x[:n] * ctx.scale[me]
    out, out_w = g.combine(h, y)
    c.check(out_w is None, "plain combine returned weights")
    c.check(tuple(out.shape) == (T, N_H), f"combine out shape {tuple(out.shape)}")
    exp, bound = ctx.ref.combine(world, me, ctx.scale)
    c.close(out, exp, bound, "combine")

    out, _ = g.combine(h, y, topk_idx=idx, topk_weights=w)
    exp, bound = ctx.ref.combine(world, me, ctx.scale, weighted=True)
    c.close(out, exp, bound, "combine weighted")

    gen = torch.Generator().manual_seed(ctx.seed + 1000 + me)
    b0 = (torch.rand(T, N_H, generator=gen) * 2 - 1).to(torch.bfloat16)
    b1 = (torch.rand(T, N_H, generator=gen) * 2 - 1).to(torch.bfloat16)
    out, out_w = g.combine(h, y, recv_topk_weights=r.recv_topk_weights[:n],
                           bias=(ctx.cuda(b0), ctx.cuda(b1)))
    exp, bound = ctx.ref.combine(world, me, ctx.scale, bias=(b0, b1))
    c.close(out, exp, bound, "combine + bias pair")
    # Each slot lives on exactly one rank: the summed weights are the token's own, exactly.
    if c.check(out_w is not None, "combine with recv_topk_weights returned no weights"):
        c.equal(out_w, torch.where(world.idx[me] >= 0, world.w[me], torch.zeros(())),
                "combined topk weights")

    given = torch.empty(T, N_H, dtype=torch.bfloat16, device=ctx.device)
    out, _ = g.combine(h, y, out=given, bias=ctx.cuda(b0))
    c.check(out.data_ptr() == given.data_ptr(), "combine(out=) did not return out")
    exp, bound = ctx.ref.combine(world, me, ctx.scale, bias=(b0,))
    c.close(given, exp, bound, "combine + one bias, out=")
    ctx.barrier()

    # int32 ids in, int64 received ids out, per-expert counts aligned to 4.
    r = g.dispatch(h, x, idx.int(), w, recv_topk_idx_dtype=torch.int64, expert_alignment=4)
    check_dispatch(ctx, r, ctx.ref.dispatch(world, me, expert_alignment=4),
                   "int32 ids, int64 out, align 4", ids_dtype=torch.int64)
    out, _ = g.combine(h, r.recv_x[:n] * ctx.scale[me])
    c.close(out, *ctx.ref.combine(world, me, ctx.scale), "combine after int64 dispatch")


def _n_fp8(ctx):
    me = ctx.rank
    world = ctx.world(4)
    _, idx, w = inputs(ctx, world)
    xf, sc = ctx.cuda(world.x_fp8[me]), ctx.cuda(world.x_scales[me])
    want = ctx.ref.dispatch(world, me)
    r = ctx.g.dispatch(ctx.h, xf, idx, w, x_scales=sc)
    check_dispatch(ctx, r, want, "fp8", fp8=True)
    ctx.barrier()
    column_major = sc.t().contiguous().t()  # [T, H/128] with strides (1, T), as DeepEP's tests
    r = ctx.g.dispatch(ctx.h, xf, idx, w, x_scales=column_major)
    check_dispatch(ctx, r, want, "fp8 column-major scales", fp8=True)
    ctx.barrier()


def _n_cached(ctx):
    import copy
    torch, c, g, h, me = ctx.torch, ctx.checks, ctx.g, ctx.h, ctx.rank
    world = ctx.world(5)
    other = ctx.world(6, num_tokens=world.num_tokens)  # new payload, same token counts
    x, idx, w = inputs(ctx, world)
    want = ctx.ref.dispatch(world, me)
    n = want["x"].shape[0]
    r = g.dispatch(h, x, idx, w)
    check_dispatch(ctx, r, want, "before cached")
    ctx.barrier()

    r = g.dispatch_cached(h, ctx.cuda(other.x[me]))
    rows = [other.x[s][t] for s, t in want["src"]]
    c.equal(r.recv_x[:n], torch.stack(rows) if rows else want["x"], "cached bf16: recv_x")
    c.equal(r.recv_topk_idx[:n], want["topk_idx"], "cached: recv_topk_idx kept")
    c.equal(r.recv_topk_weights[:n], want["topk_weights"], "cached: recv_topk_weights kept")
    c.equal(r.recv_src_token[:n], want["src_token"], "cached: recv_src_token kept")
    out, _ = g.combine(h, r.recv_x[:n] * ctx.scale[me])
    mixed = copy.copy(world)
    mixed.x = other.x  # the routing of `world`, the payload of `other`
    c.close(out, *ctx.ref.combine(mixed, me, ctx.scale), "combine after cached")

    r = g.dispatch_cached(h, ctx.cuda(other.x_fp8[me]), x_scales=ctx.cuda(other.x_scales[me]))
    if rows:
        c.equal(r.recv_x[:n].view(torch.uint8),
                torch.stack([other.x_fp8[s].view(torch.uint8)[t] for s, t in want["src"]]),
                "cached fp8: recv_x")
        c.equal(r.recv_x_scales[:n], torch.stack([other.x_scales[s][t] for s, t in want["src"]]),
                "cached fp8: recv_x_scales")
    ctx.barrier()


def _n_no_host_sync(ctx):
    torch, c, g, h, me, R = ctx.torch, ctx.checks, ctx.g, ctx.h, ctx.rank, ctx.R
    world = ctx.world(7)
    x, idx, w = inputs(ctx, world)
    want = ctx.ref.dispatch(world, me)
    real = want["x"].shape[0]
    reals = [ctx.ref.dispatch(world, d)["x"].shape[0] for d in range(R)]
    N = min(max(reals) + 3, R * N_M)

    r = g.dispatch(h, x, idx, w, sync_counts=False, num_worst_tokens=N)
    c.check(r.num_recv == N, f"worst: num_recv {r.num_recv}, expected {N}")
    c.check(r.recv_x.shape[0] == N and r.recv_topk_idx.shape[0] == N,
            f"worst: rows {r.recv_x.shape[0]} / {r.recv_topk_idx.shape[0]}, expected {N}")
    check_dispatch(ctx, r, want, "worst", num_recv=False)
    c.equal(r.recv_topk_idx[real:N], torch.full((N - real, N_K), -1, dtype=torch.int32),
            "worst: tail recv_topk_idx")
    c.equal(r.recv_topk_weights[real:N], torch.zeros(N - real, N_K), "worst: tail weights")
    out, _ = g.combine(h, r.recv_x * ctx.scale[me])  # all N rows, as a grouped GEMM would
    c.close(out, *ctx.ref.combine(world, me, ctx.scale), "combine after worst")

    r = g.dispatch(h, x, idx, w, sync_counts=False)
    c.check(r.num_recv == -1, f"sync_counts=False: num_recv {r.num_recv}, expected -1")
    c.check(r.num_recv_per_expert is None, "sync_counts=False: host per-expert counts")
    c.check(r.recv_x.shape[0] == R * N_M, f"sync_counts=False: {r.recv_x.shape[0]} rows, "
                                          f"expected the capacity {R * N_M}")
    check_dispatch(ctx, r, want, "sync_counts=False", num_recv=False)
    out, _ = g.combine(h, r.recv_x * ctx.scale[me])
    c.close(out, *ctx.ref.combine(world, me, ctx.scale), "combine after sync_counts=False")


def _n_rank_mask(ctx):
    torch, c, g, h, me, R = ctx.torch, ctx.checks, ctx.g, ctx.h, ctx.rank, ctx.R
    world = ctx.world(8)
    gen = torch.Generator().manual_seed(ctx.seed + 8)
    masks = [torch.rand(T, R, generator=gen) < 0.5 for T in world.num_tokens]
    counts = [torch.randint(0, 5, (ctx.E,), generator=gen, dtype=torch.int32) for _ in range(R)]
    x = ctx.cuda(world.x[me])
    r = g.dispatch(h, x, is_token_in_rank=ctx.cuda(masks[me]),
                   num_tokens_per_expert=ctx.cuda(counts[me]))
    want = ctx.ref.dispatch(world, me, masks=masks, expert_counts=counts)
    check_dispatch(ctx, r, want, "rank mask")
    out, _ = g.combine(h, r.recv_x[:want["x"].shape[0]] * ctx.scale[me])
    c.close(out, *ctx.ref.combine(world, me, ctx.scale, holders=masks[me]), "rank-mask combine")


def _n_adversarial(ctx):
    for k, routing in enumerate(("one_expert", "holes", "duplicates", "empty_rank")):
        world = ctx.world(10 + k, routing)
        dispatch_and_combine(ctx, ctx.g, ctx.h, world, routing)
        dispatch_and_combine(ctx, ctx.g, ctx.h, world, routing, weighted=True)


def _n_expand(ctx):
    """Group.dispatch_expand / combine_expand on a group with an expert-major buffer, against
    gpu_reference.expand / combine_expand: uniform and adversarial routings, alignments 1 and
    8, weighted and plain sums, both fan-out modes."""
    c, epx, me = ctx.checks, ctx.epx, ctx.rank
    L = ctx.E // ctx.R
    for fan_out in ("after", "during"):  # config.expand_fan_out: both copy paths
        g = epx.Group(N_M, N_H, ctx.E, N_K, expand_max_rows=ctx.R * N_M * min(N_K, L) + L * 8,
                      expand_fan_out=fan_out)
        h = g.handle()
        try:
            for k, routing in enumerate(("uniform", "one_expert", "holes", "duplicates",
                                         "empty_rank")):
                world = ctx.world(20 + k, routing)
                x, idx, w = inputs(ctx, world)
                for align, weighted in ((1, True), (8, False)):
                    what = f"expand {routing} align {align} fan-out {fan_out}"
                    want = ctx.ref.expand(world, me, align)
                    r = g.dispatch_expand(h, x, idx, w, expert_alignment=align)
                    n, real = want["x"].shape[0], ~want["padding"]
                    c.check(r.num_rows == n, f"{what}: num_rows {r.num_rows}, expected {n}")
                    n_recv = want["token_rows"].shape[0]
                    c.check(r.num_recv == n_recv,
                            f"{what}: num_recv {r.num_recv}, expected {n_recv}")
                    c.check(r.num_recv_per_expert == want["count"].tolist(),
                            lambda: f"{what}: per-expert {r.num_recv_per_expert}, expected "
                                    f"{want['count'].tolist()}")
                    c.equal(r.expert_begin, want["begin"], f"{what}: expert_begin")
                    c.equal(r.expert_count, want["count"], f"{what}: expert_count")
                    c.equal(r.recv_x[:n][real.to(ctx.device)], want["x"][real], f"{what}: recv_x")
                    c.equal(r.recv_src_info[:n], want["src_info"], f"{what}: recv_src_info")
                    c.equal(r.recv_weights[:n], want["weights"], f"{what}: recv_weights")
                    c.equal(r.token_rows, want["token_rows"], f"{what}: token_rows")
                    # the call's arrival signals, read after it: every local expert complete
                    c.equal(r.expert_ready, ctx.torch.ones(L, dtype=ctx.torch.int32,
                                                           device=ctx.device),
                            f"{what}: expert_ready")
                    y = r.recv_x[:n] * ctx.scale[me]
                    out = g.combine_expand(h, y, weighted=weighted)
                    exp, bound = ctx.ref.combine_expand(world, me, ctx.scale, weighted=weighted)
                    c.close(out, exp, bound, f"{what}: combine_expand weighted={weighted}")
                    ctx.barrier()
        finally:
            h.destroy()
            g.destroy()
    try:  # the suite's group has no expert-major buffer: refused by name, nothing sent
        ctx.g.dispatch_expand(ctx.h, x, idx, w)
        c.fail("dispatch_expand without expand_max_rows did not raise")
    except epx.EpxInvalidUsage as e:
        c.check("expand_max_rows" in str(e), f"refusal does not name expand_max_rows: {e}")


def _prefill_experts(ctx, d, I):
    """Rank d's BF16 experts [L] for the prefill section, drawn from (seed, d): every rank can
    rebuild every rank's weights for the reference."""
    torch = ctx.torch
    gen = torch.Generator().manual_seed(ctx.seed * 131 + d)
    L = ctx.E // ctx.R
    gate_up = ((torch.rand(L, 2 * I, N_H, generator=gen) - 0.5) * 0.1).to(torch.bfloat16)
    down = ((torch.rand(L, N_H, I, generator=gen) - 0.5) * 0.1).to(torch.bfloat16)
    return ctx.cuda(gate_up), ctx.cuda(down)


def _prefill_reference(ctx, world, weights, I):
    """out[t] = sum over t's valid slots k of w[t][k] * FFN_{e_k}(x[t]) (float32, h rounded to
    BF16), and the per-value bound 0.03 x sum |w| |FFN| + 0.02 x rms(FFN) x sum |w|."""
    torch = ctx.torch
    L, s = ctx.E // ctx.R, ctx.rank
    x = ctx.cuda(world.x[s]).float()
    idx, w = ctx.cuda(world.idx[s]), ctx.cuda(world.w[s])
    out = torch.zeros_like(x)
    mag = torch.zeros_like(x)
    wsum = torch.zeros(x.shape[0], device=ctx.device)
    y_sq, y_count = 0.0, 0  # rms(FFN) is over the FFN rows, not over out (already weighted)
    for k in range(idx.shape[1]):
        for e in idx[:, k].unique().tolist():
            if e < 0:
                continue
            rows = (idx[:, k] == e).nonzero().flatten()
            gate_up, down = weights[e // L]
            gu = x[rows] @ gate_up[e % L].float().t()
            h = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]).to(torch.bfloat16).float()
            y = h @ down[e % L].float().t()
            out[rows] += w[rows, k:k + 1] * y
            mag[rows] += w[rows, k:k + 1].abs() * y.abs()
            wsum[rows] += w[rows, k].abs()
            y_sq, y_count = y_sq + y.pow(2).sum().item(), y_count + y.numel()
    rms = (y_sq / y_count) ** 0.5 if y_count else 0.0
    # 0.1 x rms per value: BF16 gate/up rounding has heavy tails (tests/gpu/test_moe_prefill.c)
    return out, 0.03 * mag + 0.1 * (rms + 1e-3) * wsum[:, None]


def _fp8_blocks(torch, w):
    """w [E, N, K] quantized to FP8 E4M3 with one float32 scale per 128 x 128 block
    (DeepSeek-V3's weight_scale_inv): (codes [E, N, K], scales [E, N/128, K/128])."""
    E, N, K = w.shape
    b = w.float().reshape(E, N // 128, 128, K // 128, 128)
    scales = b.abs().amax(dim=(2, 4)).clamp(min=1e-12) / 448.0
    codes = (b / scales[:, :, None, :, None]).to(torch.float8_e4m3fn).reshape(E, N, K)
    return codes, scales.contiguous()


def _n_moe_prefill(ctx):
    """epx.MoePrefill on two groups with expert-major buffers: the chain and the overlapped
    layer against a plain-torch layer, uniform and adversarial routings, BF16 weights, on the
    batched cuBLAS GEMM (auto for BF16 weights) and on the per-expert cuBLAS GEMMs; phases
    (overlap="phases") refused by name with these weights; with the same weights in FP8 on EPX's
    grouped GEMM, phases bit for bit equal to the chain, both near the BF16 layer."""
    c, epx = ctx.checks, ctx.epx
    L, I = ctx.E // ctx.R, 256
    rows = ctx.R * N_M * min(N_K, L) + 3 * L
    groups = [epx.Group(N_M, N_H, ctx.E, N_K, expand_max_rows=rows) for _ in range(2)]
    weights = [_prefill_experts(ctx, d, I) for d in range(ctx.R)]
    layer = None
    try:
        c.raises(epx.errors.EpxInvalidArgument,
                 lambda: epx.MoePrefill(groups, epx.Experts(*weights[ctx.rank]),
                                        ffn_backend="epx_grouped"),
                 "MoePrefill(ffn_backend='epx_grouped') with BF16 weights",
                 contains=("EPX_MOE_FFN_EPX_GROUPED needs FP8 weights",))
        for backend, chosen in (("auto", "cublas_grouped"), ("cublas", "cublas")):
            layer = epx.MoePrefill(groups, epx.Experts(*weights[ctx.rank]), ffn_backend=backend)
            c.check(layer.ffn_backend == chosen, f"MoePrefill({backend}) chose {layer.ffn_backend}")
            if backend == "auto":  # phases need EPX's grouped FP8 GEMM: refused on every rank
                x, idx, w = inputs(ctx, ctx.world(40, "uniform"))
                c.raises(epx.errors.EpxUnsupported, lambda: layer(x, idx, w, overlap="phases"),
                         "MoePrefill(overlap='phases') with BF16 weights",
                         contains=("EPX_MOE_OVERLAP_PHASES",))
            for k, routing in enumerate(("uniform", "one_expert", "holes", "empty_rank")):
                world = ctx.world(40 + k, routing)
                x, idx, w = inputs(ctx, world)
                want, bound = _prefill_reference(ctx, world, weights, I)
                for overlap in (False, True):
                    out = layer(x, idx, w, overlap=overlap)
                    c.close(out, want, bound, f"moe prefill {backend} {routing} overlap={overlap}")
                ctx.barrier()
            layer.destroy()
            layer = None
        # FP8 weights on EPX's grouped GEMM: phases (the rows back by the copy engines) against
        # the chain, bit for bit (the same arithmetic per row), and both near the BF16 layer
        # (FP8 weights and rows: a few percent of the output's rms; a wrong row is ~100%)
        gu8, gus = _fp8_blocks(ctx.torch, weights[ctx.rank][0])
        dn8, dns = _fp8_blocks(ctx.torch, weights[ctx.rank][1])
        layer = epx.MoePrefill(groups, epx.Experts(gu8, dn8, gus, dns), ffn_backend="epx_grouped")
        for k, routing in enumerate(("uniform", "holes", "empty_rank")):
            world = ctx.world(50 + k, routing)
            x, idx, w = inputs(ctx, world)
            want, _ = _prefill_reference(ctx, world, weights, I)
            chain = layer(x, idx, w, overlap=False)
            phases = layer(x, idx, w, overlap="phases")
            c.equal(phases, chain, f"moe prefill fp8 {routing}: phases against the chain")
            n = max(want.numel(), 1)  # (a rank with no tokens: both sums 0)
            err = ((chain.float() - want.float()).pow(2).sum().item() / n) ** 0.5
            rms = (want.float().pow(2).sum().item() / n) ** 0.5
            c.check(err <= 0.1 * rms + 1e-3,
                    f"moe prefill fp8 {routing}: rms error {err:.4g} against the BF16 layer's "
                    f"rms {rms:.4g}")
            ctx.barrier()
        layer.destroy()
        layer = None
    finally:
        if layer is not None:
            layer.destroy()
        for g in groups:
            g.destroy()


def _n_graph(ctx):
    torch, c, g, h, me, epx = ctx.torch, ctx.checks, ctx.g, ctx.h, ctx.rank, ctx.epx
    first = ctx.world(20)
    worlds = [ctx.world(k, num_tokens=first.num_tokens) for k in (21, 22)]
    x, idx, w = (t.clone() for t in inputs(ctx, first))
    out = torch.empty(x.shape[0], N_H, dtype=torch.bfloat16, device=ctx.device)

    def layer():
        r = g.dispatch(h, x, idx, w, sync_counts=False)
        g.combine(h, r.recv_x * ctx.scale[me], out=out)

    layer()  # eager once (warm-up), checked
    torch.cuda.synchronize()
    c.close(out, *ctx.ref.combine(first, me, ctx.scale), "graph warm-up (eager)")
    ctx.barrier()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        c.raises(epx.errors.EpxInvalidUsage, lambda: g.dispatch(h, x, idx, w),
                 "dispatch(sync_counts=True) under capture")
        layer()
    for k, world in enumerate(worlds):
        x.copy_(ctx.cuda(world.x[me]))
        idx.copy_(ctx.cuda(world.idx[me]))
        w.copy_(ctx.cuda(world.w[me]))
        graph.replay()
        torch.cuda.synchronize()
        c.close(out, *ctx.ref.combine(world, me, ctx.scale), f"graph replay {k + 1}")
        ctx.barrier()
    del graph


def _n_errors(ctx):
    torch, c, g, h, me, errors = ctx.torch, ctx.checks, ctx.g, ctx.h, ctx.rank, ctx.epx.errors
    world = ctx.world(30)
    x, idx, w = inputs(ctx, world)
    T = x.shape[0]

    # Found by Python (dtype, shape), then by EPX (an option it refuses): same exception type.
    c.raises(errors.EpxInvalidArgument, lambda: g.dispatch(h, x.float(), idx, w), "float32 x",
             contains=("x",))
    c.raises(errors.EpxInvalidArgument, lambda: g.dispatch(h, x, idx[:, :N_K - 1], w),
             "topk_idx of K-1 columns", contains=("topk_idx",))
    e = c.raises(errors.EpxInvalidArgument, lambda: g.dispatch(h, x, idx, w, num_worst_tokens=1),
                 "num_worst_tokens with sync_counts=True", contains=("num_worst_tokens",))
    if e is not None:
        c.check(isinstance(e, ValueError) and isinstance(e, errors.EpxError),
                f"EpxInvalidArgument bases: {type(e).__mro__}")
        c.check(e.status == 5 and e.status_name == "EPX_ERR_INVALID_ARGUMENT",
                f"status {e.status!r} {e.status_name!r}")
        c.check(bool(e.message) and e.message in str(e) and "EPX_ERR_INVALID_ARGUMENT" in str(e),
                f"message {e.message!r}, str {str(e)!r}")
    if ctx.R > 1:  # a one-rank group has no peer to name
        c.raises(errors.EpxInvalidUsage, lambda: g.mask_peer((me + 1) % ctx.R),
                 "mask_peer on a group without low-latency mode")

    # Asynchronous: a bad expert id found by the layout kernel (not collective).
    bad = idx.clone()
    bad[T - 1, N_K - 1] = ctx.E + 3
    g.layout(bad)
    torch.cuda.synchronize()
    ae = g.async_error()
    if c.check(ae is not None, "bad expert id: no async error recorded"):
        c.check(ae.status == 5 and ae.value == ctx.E + 3 and ae.position == T * N_K - 1,
                f"async error status {ae.status}, value {ae.value}, position {ae.position}; "
                f"expected 5, {ctx.E + 3}, {T * N_K - 1} ({ae.message})")
        c.check("LAYOUT" in str(ae.stage).upper(), f"async error stage {ae.stage!r}")
        c.raises(errors.EpxInvalidArgument, lambda: g.check_async_error(), "check_async_error")
    g.clear_async_error()
    c.check(g.async_error() is None, "async error still recorded after clear_async_error")

    # Asynchronous: more rows than num_worst_tokens (collective dispatch; every row still written).
    real = ctx.ref.dispatch(world, me)["x"].shape[0]
    N = real - 1 if real >= 2 else real + 1
    g.dispatch(h, x, idx, w, sync_counts=False, num_worst_tokens=N)
    torch.cuda.synchronize()
    ae = g.async_error()
    if real >= 2:
        if c.check(ae is not None, f"worst overflow ({real} rows > {N}): no async error"):
            c.check(ae.status == 5 and ae.value == real and "DISPATCH" in str(ae.stage).upper(),
                    f"worst overflow: status {ae.status}, stage {ae.stage}, value {ae.value} "
                    f"({ae.message})")
    else:
        c.check(ae is None, f"worst within bounds: unexpected async error {ae}")
    g.clear_async_error()
    ctx.barrier()

    # The group still works.
    dispatch_and_combine(ctx, g, h, world, "after errors")
    torch.cuda.synchronize()
    c.check(g.async_error() is None, "async error after a clean dispatch/combine")


def _n_communicators(ctx):
    dist, epx, torch = ctx.dist, ctx.epx, ctx.torch
    world = ctx.world(40)
    gloo = dist.new_group(backend="gloo")
    with epx.Group(N_M, N_H, ctx.E, N_K, group=gloo) as g2:
        h2 = g2.handle()
        dispatch_and_combine(ctx, g2, h2, world, "gloo group")
        h2.destroy()
    with epx.Group(N_M, N_H, ctx.E, N_K, borrow_nccl_comm=True) as g3:
        h3 = g3.handle()
        dispatch_and_combine(ctx, g3, h3, world, "borrowed NCCL communicator")
        h3.destroy()

    # The borrowed communicator's process group destroyed before the EPX group (against the
    # documented order): every call, and destroy, is refused by name, and nothing touches the
    # destroyed communicator (the group's memory is left allocated).
    c = ctx.checks
    nccl_sub = dist.new_group(backend="nccl")
    g4 = epx.Group(N_M, N_H, ctx.E, N_K, group=nccl_sub, borrow_nccl_comm=True)
    h4 = g4.handle()
    dispatch_and_combine(ctx, g4, h4, world, "borrowed from a subgroup")
    torch.cuda.synchronize()
    dist.destroy_process_group(nccl_sub)
    x, idx, _ = inputs(ctx, world)
    c.raises(epx.EpxInvalidUsage, lambda: g4.dispatch(h4, x, idx),
             "dispatch after the borrowed communicator's group was destroyed",
             contains=("destroyed before the group",))
    c.raises(epx.EpxInvalidUsage, g4.destroy, "destroy after it", contains=("left allocated",))
    g4.destroy()  # idempotent
    ctx.barrier()


# ---------------------------------------------------------------------------------------------
# Low-latency mode
# ---------------------------------------------------------------------------------------------
L_M, L_ML, L_H, L_K = 64, 32, 640, 6  # normal maximum, low-latency maximum, hidden, top-k


def worker_low_latency(rank, num_ranks, seed):
    ctx = Ctx(rank, num_ranks, seed)
    ctx.E = 8 * num_ranks
    ctx.L = ctx.E // num_ranks
    ctx.world = lambda k, routing="uniform", **kw: ctx.ref.World(
        seed + k, num_ranks, L_ML, L_H, ctx.E, L_K, routing, **kw)
    ctx.kwargs = dict(modes=("normal", "low_latency"), ll_max_tokens_per_rank=L_ML,
                      ll_route="dispatch_by_rank")  # packed needs a by-rank dispatch
    ctx.g = ctx.epx.Group(L_M, L_H, ctx.E, L_K, **ctx.kwargs)
    finished = run_sections(ctx, [
        ("fixed", _l_fixed), ("two in flight", _l_two_in_flight), ("fp8", _l_fp8),
        ("packed", _l_packed), ("split", _l_split), ("adversarial", _l_adversarial),
        ("ll errors", _l_errors), ("peer mask", _l_peer_mask), ("cuda graph", _l_graph),
        ("normal too", _l_normal_too), ("moe layer", _l_moe),
    ])
    if finished:
        ctx.checks.where("destroy")
        ctx.g.destroy()
    return ctx.checks.failures


def check_ll(ctx, d, world, want, what, fp8=None):
    """A low-latency dispatch against gpu_reference.ll_dispatch, segment by segment.
    fp8: None (BF16 rows, exact), "plain" or "ue8m0" (scales and dequantized rows)."""
    torch, c, me, ref = ctx.torch, ctx.checks, ctx.rank, ctx.ref
    R, L = ctx.R, ctx.L
    c.check(d.num_tokens == world.num_tokens[me], f"{what}: num_tokens {d.num_tokens}")
    c.check(tuple(d.recv_x.shape) == (L, R * L_ML, L_H), f"{what}: recv_x {tuple(d.recv_x.shape)}")
    ok = c.equal(d.recv_count, want["count"], f"{what}: recv_count")
    ok &= c.equal(d.recv_num, want["num"], f"{what}: recv_num")
    ok &= c.equal(d.recv_begin, want["begin"], f"{what}: recv_begin")
    if not ok:
        return
    rx = d.recv_x.cpu()
    info = d.recv_src_info.cpu()
    scales = d.recv_x_scales.cpu() if fp8 and d.recv_x_scales is not None else None
    if fp8:
        c.check(rx.dtype == torch.float8_e4m3fn, f"{what}: recv_x dtype {rx.dtype}")
    for (j, s), (tokens, first) in want["segments"].items():
        n = tokens.numel()
        if n == 0:
            continue
        b = int(want["begin"][j, s])
        rows = slice(b, b + n)
        where = f"{what}: expert {j}, source {s}"
        c.equal(info[j, rows], torch.stack([torch.full((n,), s), tokens, first,
                                            torch.zeros(n, dtype=torch.int64)], dim=1).int(),
                f"{where}: recv_src_info")
        x = world.x[s][tokens]
        if fp8 is None:
            c.equal(rx[j, rows], x, f"{where}: recv_x")
            continue
        want_sc = ref.fp8_scales(x, ue8m0=(fp8 == "ue8m0"))
        if scales is None:
            continue
        got_sc = scales[j, rows]
        c.close(got_sc, want_sc, want_sc * 1e-6, f"{where}: recv_x_scales ({fp8})")
        full = got_sc.repeat_interleave(128, dim=1)
        deq = rx[j, rows].float() * full
        # e4m3: half a step is 2^-4 of the value (normal range), 2^-10 of the scale (subnormal).
        c.close(deq, x.float(), x.float().abs() * 2.0**-4 * 1.01 + full * 2.0**-9,
                f"{where}: dequantized rows ({fp8})")


def fill_experts(ctx, d, dst=None):
    """The test experts: row * 2^(e % 3) for global expert e, written for every row of every
    local expert (stale rows included: combine reads only the segments) into dst, default the
    dispatch's own combine_input (zero copy)."""
    dst = d.combine_input if dst is None else dst
    for j in range(ctx.L):
        dst[j].copy_(d.recv_x[j] * ctx.ref.expert_scale(ctx.rank * ctx.L + j))
    return dst


def _ll_round(ctx, world, what, dispatch_weights=True, combine_weights=None, masked=(), **kw):
    """ll_dispatch (checked), the test experts into combine_input, ll_combine (checked)."""
    x, idx, w = inputs(ctx, world)
    d = ctx.g.ll_dispatch(x, idx, w if dispatch_weights else None, **kw)
    want = ctx.ref.ll_dispatch(world, ctx.rank, L_ML, packed=kw.get("packed", False), masked=masked)
    check_ll(ctx, d, world, want, what)
    fill_experts(ctx, d)
    cw = None if combine_weights is None else ctx.cuda(combine_weights)
    out = ctx.g.ll_combine(d, topk_weights=cw)
    if combine_weights is not None:
        weights = combine_weights
    else:
        weights = world.w[ctx.rank] if dispatch_weights else None
    ctx.checks.close(out, *ctx.ref.ll_combine(world, ctx.rank, weights, masked=masked),
                     f"{what}: ll_combine")
    return d


def _fresh_weights(ctx, world, k):
    gen = ctx.torch.Generator().manual_seed(ctx.seed + 5000 + 10 * k + ctx.rank)
    return ctx.torch.rand(world.num_tokens[ctx.rank], L_K, generator=gen) * 0.99 + 0.01


def _l_fixed(ctx):
    d = _ll_round(ctx, ctx.world(100), "fixed")
    c = ctx.checks
    c.check(d.hook is None and d.layout_range is None and not d.packed,
            f"fixed: hook {d.hook}, layout_range {d.layout_range}, packed {d.packed}")
    c.check(d.recv_x_scales is None and d.recv_x_scales_packed is None, "bf16: scales present")


def _l_two_in_flight(ctx):
    torch, c, g, me = ctx.torch, ctx.checks, ctx.g, ctx.rank
    wa, wb = ctx.world(101), ctx.world(102)
    xa, ia, _ = inputs(ctx, wa)
    xb, ib, _ = inputs(ctx, wb)
    da = g.ll_dispatch(xa, ia)             # weights given to its combine instead
    db = g.ll_dispatch(xb, ib.int())       # int32 ids; no weights anywhere: 1
    check_ll(ctx, da, wa, ctx.ref.ll_dispatch(wa, me, L_ML), "first in flight")
    check_ll(ctx, db, wb, ctx.ref.ll_dispatch(wb, me, L_ML), "second in flight")
    ya = fill_experts(ctx, da, torch.empty_like(da.combine_input))  # explicit x, not zero copy
    fill_experts(ctx, db)
    cw = _fresh_weights(ctx, wa, 1)
    out_a = g.ll_combine(da, ya, topk_weights=ctx.cuda(cw))
    out_b = g.ll_combine(db)
    c.close(out_a, *ctx.ref.ll_combine(wa, me, cw), "first: combine-time weights, explicit x")
    c.close(out_b, *ctx.ref.ll_combine(wb, me, None), "second: no weights (1)")


def _l_fp8(ctx):
    torch, c, g, me, ref = ctx.torch, ctx.checks, ctx.g, ctx.rank, ctx.ref
    world = ctx.world(103)
    x, idx, w = inputs(ctx, world)
    want = ref.ll_dispatch(world, me, L_ML)
    d = g.ll_dispatch(x, idx, w, fp8=True)
    c.check(d.recv_x_scales is not None and d.recv_x_scales_packed is None, "fp8: scales")
    check_ll(ctx, d, world, want, "fp8", fp8="plain")
    ctx.barrier()
    d = g.ll_dispatch(x, idx, w, fp8=True, ue8m0=True)
    check_ll(ctx, d, world, want, "fp8 ue8m0", fp8="ue8m0")
    ue8m0_scales = d.recv_x_scales.cpu()
    ue8m0_rows = d.recv_x.cpu().view(torch.uint8)
    ctx.barrier()
    d = g.ll_dispatch(x, idx, w, fp8=True, ue8m0=True, ue8m0_packed=True)
    c.check(d.recv_x_scales is None, "ue8m0_packed: float scales present")
    words = d.recv_x_scales_packed.cpu()
    num_words = (L_H + 511) // 512
    c.check(tuple(words.shape) == (ctx.L, ctx.R * L_ML, num_words) and words.dtype == torch.int32,
            f"ue8m0_packed: {tuple(words.shape)} {words.dtype}")
    rows = d.recv_x.cpu().view(torch.uint8)
    groups = L_H // 128
    for (j, s), (tokens, _) in want["segments"].items():
        n = tokens.numel()
        if n == 0:
            continue
        b = int(want["begin"][j, s])
        got = words[j, b:b + n].contiguous().view(torch.uint8).reshape(n, 4 * num_words)
        exp = torch.zeros(n, 4 * num_words, dtype=torch.uint8)
        exp[:, :groups] = ref.exponent_bytes(ue8m0_scales[j, b:b + n])
        c.equal(got, exp, f"ue8m0 words: expert {j}, source {s} (word w byte i = group 4w+i)")
        c.equal(rows[j, b:b + n], ue8m0_rows[j, b:b + n],
                f"ue8m0 words: rows, expert {j}, source {s}")
    ctx.barrier()


def _l_packed(ctx):
    c = ctx.checks
    world = ctx.world(104)
    d = _ll_round(ctx, world, "packed", packed=True, layout_range=True)
    c.check(bool(d.packed), f"packed: result says packed={d.packed}")
    want = ctx.ref.ll_dispatch(world, ctx.rank, L_ML, packed=True)
    if c.check(d.layout_range is not None, "packed: no layout_range"):
        c.equal(d.layout_range, (want["begin"].long() << 32) | want["num"].long(),
                "packed: layout_range")


def _l_split(ctx):
    c, g, me = ctx.checks, ctx.g, ctx.rank
    world = ctx.world(105)
    x, idx, w = inputs(ctx, world)
    d = g.ll_dispatch(x, idx, split=True)
    if not c.check(d.hook is not None, "split dispatch returned no hook"):
        return
    g.ll_recv(d.hook)
    check_ll(ctx, d, world, ctx.ref.ll_dispatch(world, me, L_ML), "split dispatch")
    fill_experts(ctx, d)
    out, hook = g.ll_combine(d, topk_weights=w, split=True)
    hook()
    c.close(out, *ctx.ref.ll_combine(world, me, world.w[me]), "split combine")


def _l_adversarial(ctx):
    for k, routing in enumerate(("one_expert", "holes", "duplicates", "empty_rank")):
        world = ctx.world(110 + k, routing)
        _ll_round(ctx, world, routing, dispatch_weights=False,
                  combine_weights=_fresh_weights(ctx, world, 110 + k))


def _l_errors(ctx):
    torch, c, g, errors = ctx.torch, ctx.checks, ctx.g, ctx.epx.errors
    world = ctx.world(120)
    x, idx, w = inputs(ctx, world)
    big_x = torch.zeros(L_ML + 1, L_H, dtype=torch.bfloat16, device=ctx.device)
    big_idx = torch.zeros(L_ML + 1, L_K, dtype=torch.int64, device=ctx.device)
    c.raises(errors.EpxInvalidArgument, lambda: g.ll_dispatch(big_x, big_idx),
             "ll_dispatch of ll_max_tokens_per_rank + 1 tokens")
    c.raises(errors.EpxInvalidArgument, lambda: g.ll_dispatch(x, idx, w, ue8m0=True),
             "ue8m0 without fp8", contains=("ue8m0",))
    _ll_round(ctx, world, "after ll errors")


def _l_peer_mask(ctx):
    torch, c, g, me, R, errors = ctx.torch, ctx.checks, ctx.g, ctx.rank, ctx.R, ctx.epx.errors
    if R == 1:  # nothing to mask in a one-rank group: only the refusals apply
        c.raises(errors.EpxInvalidArgument, lambda: g.mask_peer(me), "mask_peer(this rank)",
                 contains=("peer",))
        return
    victim = R - 1
    masked = (victim,) if me != victim else tuple(p for p in range(R) if p != victim)
    for p in masked:  # both sides mask: nobody waits for anybody across the cut
        g.mask_peer(p)
    torch.cuda.synchronize()
    want = sum(1 << p for p in masked)
    c.check(g.peer_mask == want, f"peer_mask {g.peer_mask:#x}, expected {want:#x}")
    c.check(g.async_error() is None, f"mask_peer recorded an async error: {g.async_error()}")
    _ll_round(ctx, ctx.world(130), "masked", masked=masked)
    c.raises(errors.EpxInvalidArgument, lambda: g.mask_peer(me), "mask_peer(this rank)",
             contains=("peer",))
    c.raises(errors.EpxInvalidArgument, lambda: g.mask_peer(R), "mask_peer(num_ranks)",
             contains=("peer",))
    g.clear_peer_mask()  # collective
    c.check(g.peer_mask == 0, f"peer_mask {g.peer_mask:#x} after clear_peer_mask")
    _ll_round(ctx, ctx.world(131), "after clear_peer_mask")
    c.check(g.async_error() is None, f"async error after the masked rounds: {g.async_error()}")


def _l_graph(ctx):
    torch, c, g, me = ctx.torch, ctx.checks, ctx.g, ctx.rank
    first = ctx.world(140)
    worlds = [ctx.world(k, num_tokens=first.num_tokens) for k in (141, 142)]
    x, idx, w = (t.clone() for t in inputs(ctx, first))
    out = torch.empty(x.shape[0], L_H, dtype=torch.bfloat16, device=ctx.device)

    def layer():
        d = g.ll_dispatch(x, idx, w)
        fill_experts(ctx, d)
        g.ll_combine(d, out=out)

    layer()
    torch.cuda.synchronize()
    c.close(out, *ctx.ref.ll_combine(first, me, first.w[me]), "ll graph warm-up (eager)")
    ctx.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        layer()
    for k, world in enumerate(worlds):
        x.copy_(ctx.cuda(world.x[me]))
        idx.copy_(ctx.cuda(world.idx[me]))
        w.copy_(ctx.cuda(world.w[me]))
        graph.replay()
        torch.cuda.synchronize()
        c.close(out, *ctx.ref.ll_combine(world, me, world.w[me]), f"ll graph replay {k + 1}")
        ctx.barrier()
    del graph


def _l_normal_too(ctx):
    c, g = ctx.checks, ctx.g
    ws = ctx.epx.workspace_size(ctx.R, L_M, L_H, ctx.E, L_K, **ctx.kwargs)
    c.check(ws["total"] == g.workspace_bytes and ws["low_latency"] > 0 and ws["normal"] > 0,
            f"workspace_size {ws} vs {g.workspace_bytes}")
    world = ctx.ref.World(ctx.seed + 150, ctx.R, L_M, L_H, ctx.E, L_K,
                          num_tokens=[L_M] * ctx.R)  # more than the low-latency maximum
    h = g.handle()
    dispatch_and_combine(ctx, g, h, world, "normal dispatch on a two-mode group")
    h.destroy()


MOE_I = 128  # intermediate size of the moe-layer section's experts


def _moe_experts(ctx):
    """Every rank's BF16 experts [L, 2I, H] / [L, H, I], drawn alike on every rank (CPU)."""
    torch = ctx.torch
    gen = torch.Generator().manual_seed(ctx.seed + 7000)
    E, H, I = ctx.E, L_H, MOE_I
    gate_up = ((torch.rand(E, 2 * I, H, generator=gen) * 2 - 1) / H ** 0.5).to(torch.bfloat16)
    down = ((torch.rand(E, H, I, generator=gen) * 2 - 1) / I ** 0.5).to(torch.bfloat16)
    return gate_up, down


def _moe_reference(ctx, world, gate_up, down):
    """out[t] = sum over valid slots of w * bf16(FFN_e(x[t])) in float64, its magnitude
    sum |w| |y|, and sum |w| per token."""
    torch, me = ctx.torch, ctx.rank
    x, idx, w = world.x[me].double(), world.idx[me], world.w[me].double()
    T, H, I = x.shape[0], L_H, MOE_I
    out = torch.zeros(T, H, dtype=torch.float64)
    mag = torch.zeros(T, H, dtype=torch.float64)
    wsum = torch.zeros(T, 1, dtype=torch.float64)
    ys = []
    for t in range(T):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e < 0:
                continue
            g = x[t] @ gate_up[e].double().T
            h = (torch.nn.functional.silu(g[:I]) * g[I:]).to(torch.bfloat16).double()
            y = (h @ down[e].double().T).to(torch.bfloat16).double()
            ys.append(y)
            out[t] += w[t, k] * y
            mag[t] += w[t, k].abs() * y.abs()
            wsum[t] += w[t, k].abs()
    rms = torch.stack(ys).pow(2).mean().sqrt().item() if ys else 0.0
    return out, mag, wsum, rms


def _l_moe(ctx):
    torch, c, g, me, epx = ctx.torch, ctx.checks, ctx.g, ctx.rank, ctx.epx
    gate_up, down = _moe_experts(ctx)
    L = ctx.L
    mine = epx.Experts(ctx.cuda(gate_up[me * L:(me + 1) * L].contiguous()),
                       ctx.cuda(down[me * L:(me + 1) * L].contiguous()))
    for k, routing in ((140, "uniform"), (141, "holes")):
        world = ctx.world(k, routing)
        x, idx, w = inputs(ctx, world)
        given = torch.full((x.shape[0], L_H), float("nan"), dtype=torch.bfloat16,
                           device=x.device) if k == 141 else None
        out = g.moe_decode(mine, x, idx, w, out=given)
        torch.cuda.synchronize()
        if given is not None:
            c.check(out.data_ptr() == given.data_ptr(), "moe_decode(out=...) returned another tensor")
        want, mag, wsum, rms = _moe_reference(ctx, world, gate_up, down)
        c.close(out, want, 0.03 * mag + 0.02 * rms * wsum + 1e-6, f"moe_decode ({routing})")
        # The CPU oracle takes seconds, longer on a rank with more tokens: meet before the next
        # layer call, or an early rank's low-latency wait runs out on a late one (peer masked).
        ctx.barrier()
    c.raises(epx.errors.EpxInvalidArgument, lambda: g.moe_decode(None, x, idx, w),
             "moe_decode(experts=None)", contains=("experts",))
    c.check(g.async_error() is None, f"async error after moe_decode: {g.async_error()}")

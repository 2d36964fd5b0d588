"""gpu_reference.py - plain-torch references for the multi-GPU tests (CPU only, no epx).

A World is every rank's input (tokens, expert ids, weights, FP8 payload), drawn on the CPU from
one seed, so that each rank can rebuild its peers' inputs and compute what EPX must deliver to
it or give back to it. The functions below are the semantics of include/epx.h written as
directly as possible in torch (loops over ranks and experts, no cleverness): they are the
oracle, and small enough to read next to docs/normal-mode.md and docs/low-latency.md.

Numeric contract of the checks (docs/testing.md): payload rows, ids, weights, counts and sources
are exact; a combine, summed in float32 and rounded once to BF16, is within 2^-8 of the sum of
the absolute values of its terms (`bf16_bound`).
"""
import torch

ROUTINGS = ("uniform", "holes", "one_expert", "duplicates", "empty_rank")


class World:
    """Inputs of every rank. Rank s has num_tokens[s] tokens:
    x[s] [T, H] bf16, idx[s] [T, K] int64 (-1 = empty slot), w[s] [T, K] float32 in [0.01, 1),
    x_fp8[s] [T, H] float8_e4m3fn (random bytes) with x_scales[s] [T, H/128] float32 (FP8
    worlds only: hidden % 128 == 0)."""

    def __init__(self, seed, num_ranks, max_tokens, hidden, num_experts, top_k,
                 routing="uniform", num_tokens=None):
        assert routing in ROUTINGS, routing
        assert num_experts % num_ranks == 0 and top_k <= num_experts
        self.seed, self.routing = seed, routing
        self.R, self.M, self.H, self.E, self.K = num_ranks, max_tokens, hidden, num_experts, top_k
        self.L = num_experts // num_ranks
        gen = torch.Generator().manual_seed(seed)
        if num_tokens is None:
            num_tokens = [int(torch.randint(max_tokens // 2, max_tokens + 1, (1,), generator=gen))
                          for _ in range(num_ranks)]
            if routing == "empty_rank":
                num_tokens[int(torch.randint(0, num_ranks, (1,), generator=gen))] = 0
        self.num_tokens = list(num_tokens)
        hot = int(torch.randint(0, num_experts, (1,), generator=gen))  # one_expert's expert
        self.x, self.idx, self.w, self.x_fp8, self.x_scales = [], [], [], [], []
        for T in self.num_tokens:
            K, E = top_k, num_experts
            self.x.append((torch.rand(T, hidden, generator=gen) * 4 - 2).to(torch.bfloat16))
            # K distinct experts per token, uniformly.
            idx = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K].contiguous()
            if routing == "holes":      # ~30% empty slots, and token 0 (if any) chooses none
                idx[torch.rand(T, K, generator=gen) < 0.3] = -1
                idx[:1] = -1
            elif routing == "one_expert":  # every token: one expert, the same, in its last slot
                idx[:] = -1
                idx[:, K - 1] = hot
            elif routing == "duplicates" and K > 1:  # half the tokens list an expert twice
                half = torch.rand(T, generator=gen) < 0.5
                idx[half, 1] = idx[half, 0]
            self.idx.append(idx)
            self.w.append(torch.rand(T, K, generator=gen) * 0.99 + 0.01)
            if hidden % 128 == 0:
                self.x_fp8.append(torch.randint(0, 256, (T, hidden), dtype=torch.uint8,
                                                generator=gen).view(torch.float8_e4m3fn))
                self.x_scales.append(torch.rand(T, hidden // 128, generator=gen) * 1.5 + 0.5)

    def describe(self):
        return (f"seed {self.seed}, {self.R} ranks, tokens {self.num_tokens}, hidden {self.H}, "
                f"{self.E} experts, top-{self.K}, routing {self.routing}")

    def rank_of(self, idx):
        """Expert ids -> owning rank, -1 for empty slots."""
        return torch.where(idx >= 0, idx // self.L, torch.full_like(idx, -1))


def bf16_bound(abs_sum):
    """Tolerance of a float32 sum rounded once to BF16: 2^-8 of the sum of |terms|, plus a
    floor for sums that are exactly 0."""
    return abs_sum * 2.0**-8 + 1e-30


# ---------------------------------------------------------------------------------------------
# Layout and normal-mode dispatch
# ---------------------------------------------------------------------------------------------
def layout(world, s, idx=None):
    """epx_layout of rank s's tokens: dict of num_tokens_per_rank [R] int32,
    num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, token_pos_in_rank [T, R]
    int32 (-1 where not sent)."""
    idx = world.idx[s] if idx is None else idx
    R, E = world.R, world.E
    dest = world.rank_of(idx)
    in_rank = torch.stack([(dest == d).any(dim=1) for d in range(R)], dim=1).reshape(-1, R)
    per_expert = torch.stack([(idx == e).any(dim=1).sum() for e in range(E)]).to(torch.int32)
    pos = torch.where(in_rank, in_rank.to(torch.int32).cumsum(dim=0) - 1,
                      torch.full(in_rank.shape, -1, dtype=torch.int64))
    return {
        "num_tokens_per_rank": in_rank.sum(dim=0).to(torch.int32),
        "num_tokens_per_expert": per_expert,
        "is_token_in_rank": in_rank,
        "token_pos_in_rank": pos.to(torch.int32),
    }


def dispatch(world, r, masks=None, expert_counts=None, expert_alignment=1):
    """What a normal dispatch delivers to rank r, rows in source-rank then source-token order.
    masks / expert_counts: rank-mask routing (per source: [T, R] bool and [E] int32); rows then
    carry no ids (-1) and weights 0, and the per-expert counts are the sums of the sources'.
    Returns a dict: src (list of (s, t)), x [n, H] bf16, x_fp8 / x_scales (FP8 worlds),
    topk_idx [n, K] int32 local ids, topk_weights [n, K] float32, src_token [n] int32,
    rank_prefix [R+1] int32, per_expert [L] (aligned), rank_prefix_matrix [R, R] int32."""
    R, L, K = world.R, world.L, world.K
    lo = r * L
    src, xs, xf, sc, ids, ws, prefix = [], [], [], [], [], [], [0]
    per_expert = torch.zeros(L, dtype=torch.int64)
    sent = torch.zeros(R, R, dtype=torch.int64)  # sent[s][d]: tokens s sends to d
    for s in range(R):
        idx = world.idx[s]
        if masks is not None:
            rows = masks[s][:, r].nonzero().flatten()
            per_expert += expert_counts[s][lo:lo + L].to(torch.int64)
            sent[s] = masks[s].sum(dim=0)
            local = torch.full((rows.numel(), K), -1, dtype=torch.int64)
            weights = torch.zeros(rows.numel(), K)
        else:
            mine = (idx >= lo) & (idx < lo + L)
            rows = mine.any(dim=1).nonzero().flatten()
            for j in range(L):
                per_expert[j] += int((idx == lo + j).any(dim=1).sum())
            dest = world.rank_of(idx)
            sent[s] = torch.stack([(dest == d).any(dim=1).sum() for d in range(R)])
            local = torch.where(mine[rows], idx[rows] - lo, torch.full_like(idx[rows], -1))
            weights = torch.where(mine[rows], world.w[s][rows], torch.zeros(()))
        src += [(s, int(t)) for t in rows]
        xs.append(world.x[s][rows])
        if world.x_fp8:
            xf.append(world.x_fp8[s].view(torch.uint8)[rows])
            sc.append(world.x_scales[s][rows])
        ids.append(local)
        ws.append(weights)
        prefix.append(prefix[-1] + rows.numel())
    a = max(expert_alignment, 1)
    per_expert = (per_expert + a - 1) // a * a
    out = {
        "src": src,
        "x": torch.cat(xs),
        "topk_idx": torch.cat(ids).to(torch.int32),
        "topk_weights": torch.cat(ws).float(),
        "src_token": torch.tensor([t for _, t in src], dtype=torch.int32),
        "rank_prefix": torch.tensor(prefix, dtype=torch.int32),
        "per_expert": per_expert.to(torch.int32),
        "rank_prefix_matrix": sent.cumsum(dim=0).to(torch.int32),
    }
    if world.x_fp8:
        out["x_fp8"] = torch.cat(xf).view(torch.float8_e4m3fn)
        out["x_scales"] = torch.cat(sc)
    return out


def combine(world, s, rank_scale, weighted=False, holders=None, bias=()):
    """Normal combine of rank s's tokens when rank d's expert output for a row is its received x
    times rank_scale[d] (exact in BF16: powers of two). out[t] = sum over the ranks d holding t
    of scale_d * x[t], times the sum of the token's weights on d in weighted mode, plus the bias
    tensors. holders: [T, R] bool (default: from the ids). Returns (out float32, bound)."""
    x = world.x[s].float()
    idx = world.idx[s]
    if holders is None:
        holders = layout(world, s)["is_token_in_rank"]
    dest = world.rank_of(idx)
    factor = torch.zeros(x.shape[0])
    for d in range(world.R):
        f = torch.full((x.shape[0],), float(rank_scale[d]))
        if weighted:
            f = f * torch.where(dest == d, world.w[s], torch.zeros(())).sum(dim=1)
        factor += torch.where(holders[:, d], f, torch.zeros(()))
    out = x * factor[:, None]
    abs_sum = x.abs() * factor.abs()[:, None]
    for b in bias:
        out = out + b.float()
        abs_sum = abs_sum + b.float().abs()
    return out, bf16_bound(abs_sum)


def expand(world, d, expert_alignment=1):
    """What an expert-major dispatch (epx_dispatch_expand) delivers to rank d: one row per
    distinct (token, local expert), local expert j's rows contiguous in source-rank then token
    order, each segment padded to expert_alignment. Returns a dict: begin [L+1] int32, count [L]
    int32, x [rows, H] bf16 (padding rows zero, not compared), src_info [rows, 4] int32
    (rank, token, first slot, 0; padding -1, -1, -1, 0), weights [rows] float32 (the sum of the
    token's weights over the slots listing the expert, in slot order, from 0; padding 0),
    padding [rows] bool, and token_rows [n, K] int32: per received token (dispatch's order)
    its rows in ascending local expert, then -1."""
    R, L, K, H = world.R, world.L, world.K, world.H
    lo, a = d * L, max(expert_alignment, 1)
    rows_of = {}  # (s, t) -> rows, ascending expert
    begin, count, xs, info, ws, pad = [0], [], [], [], [], []
    for j in range(L):
        n = 0
        for s in range(R):
            idx, w = world.idx[s], world.w[s]
            for t in range(idx.shape[0]):
                slots = [k for k in range(K) if int(idx[t, k]) == lo + j]
                if not slots:
                    continue
                acc = torch.zeros((), dtype=torch.float32)
                for k in slots:
                    acc = acc + w[t, k]
                rows_of.setdefault((s, t), []).append(begin[-1] + n)
                xs.append(world.x[s][t])
                info.append([s, t, slots[0], 0])
                ws.append(float(acc))
                pad.append(False)
                n += 1
        count.append(n)
        padded = (n + a - 1) // a * a
        for _ in range(padded - n):
            xs.append(torch.zeros(H, dtype=torch.bfloat16))
            info.append([-1, -1, -1, 0])
            ws.append(0.0)
            pad.append(True)
        begin.append(begin[-1] + padded)
    order = dispatch(world, d)["src"]
    token_rows = torch.full((len(order), K), -1, dtype=torch.int32)
    for i, key in enumerate(order):
        r = rows_of.get(key, [])
        token_rows[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
    return {
        "begin": torch.tensor(begin, dtype=torch.int32),
        "count": torch.tensor(count, dtype=torch.int32),
        "x": torch.stack(xs) if xs else torch.zeros(0, H, dtype=torch.bfloat16),
        "src_info": torch.tensor(info, dtype=torch.int32).reshape(-1, 4),
        "weights": torch.tensor(ws, dtype=torch.float32),
        "padding": torch.tensor(pad, dtype=torch.bool),
        "token_rows": token_rows,
    }


def combine_expand(world, s, rank_scale, weighted=True):
    """epx_combine_expand of rank s's tokens when every row's expert output is its x times
    rank_scale[d] on rank d: out[t] = x[t] * sum over ranks d of scale_d * (weighted: the sum of
    t's weights over its slots on d; else the count of t's distinct experts on d). Returns
    (out float32, bound): two roundings to BF16 (the expert side's partial row, then home), each
    within half a BF16 step (at most 2^-8) of its sum, so twice bf16_bound of the sum of |terms|
    (2.02: the second rounds a sum that already carries the first error, and float32 sums; the
    C test checks the exact bits against tests/ref's model of both roundings)."""
    x = world.x[s].float()
    idx = world.idx[s]
    dest = world.rank_of(idx)
    factor = torch.zeros(x.shape[0])
    for d in range(world.R):
        if weighted:
            f = torch.where(dest == d, world.w[s], torch.zeros(())).sum(dim=1)
        else:
            lo = d * world.L
            f = torch.stack([((idx == lo + j).any(dim=1)).float() for j in range(world.L)],
                            dim=1).sum(dim=1) if idx.shape[0] else torch.zeros(0)
        factor += float(rank_scale[d]) * f
    return x * factor[:, None], 2.02 * bf16_bound(x.abs() * factor.abs()[:, None])


# ---------------------------------------------------------------------------------------------
# Low-latency mode
# ---------------------------------------------------------------------------------------------
def ll_dispatch(world, d, M, packed=False, masked=()):
    """What a low-latency dispatch delivers to rank d (ll_max_tokens_per_rank M): one row per
    distinct (token, expert). Sources in `masked` deliver nothing. Returns a dict:
    num [L, R], begin [L, R] (fixed: s*M; packed: rows of the sources before s), count [L],
    segments {(j, s): (tokens [n] int64, first_slots [n] int64)}."""
    R, L = world.R, world.L
    num = torch.zeros(L, R, dtype=torch.int32)
    segments = {}
    for j in range(L):
        e = d * L + j
        for s in range(R):
            hit = world.idx[s] == e
            tokens = hit.any(dim=1).nonzero().flatten()
            if s in masked:
                tokens = tokens[:0]
            first = hit[tokens].to(torch.int64).argmax(dim=1)  # the first slot naming e
            segments[(j, s)] = (tokens, first)
            num[j, s] = tokens.numel()
    if packed:
        begin = torch.cat([torch.zeros(L, 1, dtype=torch.int32), num.cumsum(dim=1)[:, :-1]],
                          dim=1).to(torch.int32)
    else:
        begin = (torch.arange(R, dtype=torch.int32) * M).expand(L, R).contiguous()
    return {"num": num, "begin": begin, "count": num.sum(dim=1).to(torch.int32),
            "segments": segments}


def expert_scale(e):
    """The test experts' output: row * 2^(e % 3), exact in BF16."""
    return float(2 ** (e % 3))


def ll_combine(world, s, weights=None, masked=()):
    """Low-latency combine of rank s's tokens when expert e returns x * expert_scale(e):
    out[t] = sum over valid slots k (expert not on a masked rank) of w[t][k] * scale * x[t]
    (w = 1 when weights is None). Returns (out float32, bound)."""
    x = world.x[s].float()
    idx = world.idx[s]
    w = torch.ones(idx.shape) if weights is None else weights
    scale = torch.tensor([[expert_scale(int(e)) for e in row] for row in idx.tolist()]
                         ).reshape(idx.shape)
    valid = idx >= 0
    for p in masked:
        valid &= world.rank_of(idx) != p
    factor = torch.where(valid, w * scale, torch.zeros(())).sum(dim=1)
    abs_factor = torch.where(valid, (w * scale).abs(), torch.zeros(())).sum(dim=1)
    return x * factor[:, None], bf16_bound(x.abs() * abs_factor[:, None])


def fp8_scales(x, ue8m0=False):
    """Low-latency on-the-fly FP8 scales of x [n, H] bf16: per 128 channels
    max(amax, 1e-4) / 448, rounded up to a power of two with ue8m0. [n, H/128] float32."""
    n, H = x.shape
    amax = x.float().abs().reshape(n, H // 128, 128).amax(dim=2)
    scale = amax.clamp(min=1e-4) / 448.0
    if ue8m0:  # round up to a power of two, on the bits: exponent + 1 unless the mantissa is 0
        bits = scale.view(torch.int32)
        exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scale = (exponent << 23).view(torch.float32)
    return scale


def exponent_bytes(scales):
    """UE8M0: the biased exponent byte (bits 23..30) of float32 powers of two, as uint8."""
    return ((scales.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)

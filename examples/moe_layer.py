"""moe_layer.py - a small Mixture-of-Experts layer on EPX, checked against a one-GPU reference.

Run it with one process per GPU of one host (EPX needs 2 to 8):

    torchrun --nproc-per-node=4 examples/moe_layer.py                      # normal mode
    torchrun --nproc-per-node=4 examples/moe_layer.py --mode low_latency   # decode mode

The layer: a router (linear, softmax, top-k, weights renormalized to sum 1), E experts spread
evenly over the ranks (rank r holds experts [r*L, (r+1)*L), L = E/R), each a SwiGLU feed-forward
block in BF16, and the weighted sum of a token's experts:

    y[t] = sum over the token's k of  w[t][k] * expert_{e[t][k]}(x[t])

Every rank builds the same weights from the seed and its own tokens, runs the layer through
EPX (dispatch -> local experts -> combine), then computes the same layer for its own tokens in
float32 without any communication (all experts local: the one-GPU reference) and compares.
One line per rank: "rank r: max abs err ..., rel ..., OK/FAIL"; the exit code is 1 on a failure.

Two ways through EPX:
- normal mode (prefill, training): Group.dispatch delivers each token once to every rank that
  holds one of its experts, as rows of recv_x [n, H] with recv_topk_idx [n, K] (the local expert
  of each top-k slot, -1 when that expert lives elsewhere) and recv_topk_weights. A row can go
  to several local experts; this rank computes sum over its slots of w * expert(x) for it, so
  that Group.combine, which sums a token's rows from all ranks without weights, gives y.
- low-latency mode (decode): Group.ll_dispatch writes one row per (token, expert) into
  per-expert slots, recv_x [L, R*M, H]; expert j's rows from source rank s are the segment
  [recv_begin[j][s], + recv_num[j][s]). The experts write their unweighted outputs into the
  same rows of combine_input (the group's own memory: no copy), and Group.ll_combine applies the
  router weights as it sums (combine-time weights, as DeepEP's low_latency_combine takes them).
"""
import argparse
import os
import sys

# NVLink multicast (NVLS) stays off in every process that creates an NCCL communicator.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import epx  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("normal", "low_latency"), default="normal")
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=1024, help="model width (a multiple of 128)")
    p.add_argument("--ffn", type=int, default=512, help="expert intermediate width")
    p.add_argument("--experts-per-rank", type=int, default=4, help="E = this x ranks")
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                   help="torch.distributed backend (EPX creates its own NCCL communicator "
                        "either way)")
    p.add_argument("--tolerance", type=float, default=3e-2,
                   help="largest accepted max|err| / max|reference| (BF16 experts and exchange)")
    return p.parse_args()


# ---------------------------------------------------------------------------------------------
# The layer's parameters: the same on every rank (built on the CPU from the seed).
# ---------------------------------------------------------------------------------------------
class MoEWeights:
    def __init__(self, hidden, ffn, num_experts, seed, device):
        gen = torch.Generator().manual_seed(seed)
        self.router = torch.randn(hidden, num_experts, generator=gen) / hidden**0.5
        # Expert e: [gate | up] = x @ gate_up[e] ([H, 2F]), out = (silu(gate) * up) @ down[e].
        gate_up = torch.randn(num_experts, hidden, 2 * ffn, generator=gen) / hidden**0.5
        down = torch.randn(num_experts, ffn, hidden, generator=gen) / ffn**0.5
        self.router = self.router.to(device)                       # float32: routing is exact
        self.gate_up = gate_up.to(device, torch.bfloat16)           # experts run in BF16
        self.down = down.to(device, torch.bfloat16)


def expert_ffn(x, gate_up, down):
    """One SwiGLU expert, in the dtype of its arguments (BF16 on EPX, float32 in the reference)."""
    gate, up = (x @ gate_up).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down


def route(x, weights, top_k):
    """Router: softmax over all experts, top-k, weights renormalized over the chosen k.
    Computed in float32 by both paths, so both pick the same experts."""
    probs = torch.softmax(x.float() @ weights.router, dim=-1)
    topk_w, topk_idx = probs.topk(top_k, dim=-1)
    topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
    return topk_idx, topk_w  # [T, K] int64 expert ids, [T, K] float32 weights


# ---------------------------------------------------------------------------------------------
# The layer on EPX.
# ---------------------------------------------------------------------------------------------
def moe_normal(group, handle, x, topk_idx, topk_w, weights):
    """Normal mode: dispatch, local experts, combine. Returns [T, H] BF16."""
    r = group.dispatch(handle, x, topk_idx, topk_w)
    # r.recv_x etc. are views of the group's workspace, valid until the next dispatch: they are
    # consumed before combine. r.num_recv_per_expert: the rows of each local expert (host ints).
    y = torch.zeros(r.num_recv, x.shape[1], dtype=torch.float32, device=x.device)
    first = group.rank * group.num_local_experts
    for j, count in enumerate(r.num_recv_per_expert):
        if count == 0:
            continue
        # Rows that chose local expert j, and in which top-k slot (a token lists an expert once).
        rows, slots = (r.recv_topk_idx == j).nonzero(as_tuple=True)
        assert rows.numel() == count, f"expert {j}: {rows.numel()} rows, EPX counted {count}"
        out = expert_ffn(r.recv_x[rows], weights.gate_up[first + j], weights.down[first + j])
        # Weigh here: combine adds the rows of one token from all ranks as they are.
        y.index_add_(0, rows, out.float() * r.recv_topk_weights[rows, slots].unsqueeze(1))
    out, _ = group.combine(handle, y.to(torch.bfloat16))
    return out


def moe_low_latency(group, x, topk_idx, topk_w, weights):
    """Low-latency mode: fixed-slot dispatch, local experts, zero-copy combine. [T, H] BF16."""
    d = group.ll_dispatch(x, topk_idx)        # BF16 rows; weights are given to the combine
    # Segments of (local expert j, source s): read on the host here for clarity; a grouped GEMM
    # would take d.recv_begin / d.recv_num (or all rows of an expert, masked) on the device.
    begin, num = d.recv_begin.tolist(), d.recv_num.tolist()
    first = group.rank * group.num_local_experts
    for j in range(group.num_local_experts):
        for s in range(group.num_ranks):
            if num[j][s] == 0:
                continue
            rows = slice(begin[j][s], begin[j][s] + num[j][s])
            # Unweighted expert output, written row for row into the group's combine input.
            d.combine_input[j, rows] = expert_ffn(d.recv_x[j, rows], weights.gate_up[first + j],
                                                  weights.down[first + j])
    # x=None: combine reads d.combine_input (zero copy); it weighs each (token, expert) row by
    # topk_w in float32 as it sums them.
    return group.ll_combine(d, topk_weights=topk_w)


# ---------------------------------------------------------------------------------------------
# The one-GPU reference: float32, every expert local, no communication.
# ---------------------------------------------------------------------------------------------
def moe_reference(x, topk_idx, topk_w, weights):
    x = x.float()
    y = torch.zeros_like(x)
    for e in range(weights.gate_up.shape[0]):
        tokens, slots = (topk_idx == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        out = expert_ffn(x[tokens], weights.gate_up[e].float(), weights.down[e].float())
        y.index_add_(0, tokens, out * topk_w[tokens, slots].unsqueeze(1))
    return y


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    if args.backend == "nccl":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    num_experts = args.experts_per_rank * world
    T, H = args.tokens, args.hidden

    weights = MoEWeights(H, args.ffn, num_experts, args.seed, device)
    gen = torch.Generator().manual_seed(args.seed * 1000 + 1 + rank)   # this rank's own tokens
    x = torch.randn(T, H, generator=gen).to(device, torch.bfloat16)
    topk_idx, topk_w = route(x, weights, args.top_k)

    # One EPX group per process group, collective. group= takes any torch.distributed group
    # (nccl or gloo): EPX builds its own NCCL communicator, exchanging its id over that group.
    modes = ("low_latency",) if args.mode == "low_latency" else ("normal",)
    with epx.Group(T, H, num_experts, args.top_k, group=dist.group.WORLD, modes=modes) as g:
        if args.mode == "normal":
            handle = g.handle()          # routing buffers, reused by every dispatch
            out = moe_normal(g, handle, x, topk_idx, topk_w, weights)
        else:
            out = moe_low_latency(g, x, topk_idx, topk_w, weights)
        torch.cuda.synchronize()
        g.check_async_error()            # raises if a kernel recorded an error
    # (leaving the with block destroyed the group: collective, so every rank gets here)

    ref = moe_reference(x, topk_idx, topk_w, weights)
    err = (out.float() - ref).abs().max().item()
    rel = err / max(ref.abs().max().item(), 1e-30)
    ok = rel <= args.tolerance and bool(torch.isfinite(out).all())
    print(f"rank {rank}: {args.mode}, {world} ranks, {T} tokens, {num_experts} experts, "
          f"top-{args.top_k}: max abs err {err:.3e}, rel {rel:.3e} (tolerance {args.tolerance:g}), "
          f"{'OK' if ok else 'FAIL'}", flush=True)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

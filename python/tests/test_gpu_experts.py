"""test_gpu_experts.py - epx.Experts (epx_experts_ffn) on one GPU against a float64 torch
reference that rounds where the library rounds (BF16 intermediate; FP8 x and intermediate
quantized per 128 channels, amax / 448). Skipped without a GPU.

Checks: every expert row within 0.02 * rms + 0.02 |ref| (the library sums in another order;
a wrong row or scale is off by ~rms; FP8 weights: check() says what), rows past each count
untouched (sentinel), masked and contiguous layouts, BF16 and FP8 weights, FP8 x, a CUDA graph
replayed after the counts changed, and argument errors by name."""
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

import epx  # noqa: E402

E, H, I, ROOM = 4, 256, 384, 40


def quantize(x):
    """Per-128-channel FP8 of the last dimension: (codes as float64, scales float32)."""
    g = x.float().reshape(*x.shape[:-1], -1, 128)
    amax = g.abs().amax(-1).clamp_min(1e-4)
    scale = amax / 448.0
    q = (g * (1.0 / scale)[..., None]).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), scale


def reference(x, first, rows, w, fp8, x_scales=None):
    out = {}
    gu, dn = w["gate_up"], w["down"]
    for e in range(E):
        xr = x[first[e]:first[e] + rows[e]]
        if rows[e] == 0:
            continue
        if not fp8:
            g = xr.double() @ gu[e].double().T
            h = (torch.nn.functional.silu(g[:, :I]) * g[:, I:]).to(torch.bfloat16).double()
            y = h @ dn[e].double().T
        else:
            if xr.dtype == torch.float8_e4m3fn:
                q, s = xr, x_scales[first[e]:first[e] + rows[e]]
            else:
                q, s = quantize(xr)

            def mm(q, s, wq, ws):
                k = q.shape[1]
                acc = 0
                for b in range(k // 128):
                    part = q[:, b * 128:(b + 1) * 128].double() @ \
                        wq[:, b * 128:(b + 1) * 128].double().T
                    wsb = ws[:, b].double().repeat_interleave(128)[:wq.shape[0]]
                    acc = acc + part * s[:, b].double()[:, None] * wsb[None, :]
                return acc
            g = mm(q, s, gu[e], w["gate_up_scales"][e])
            h = (torch.nn.functional.silu(g[:, :I]) * g[:, I:]).float()
            hq, hs = quantize(h)
            y = mm(hq, hs, dn[e], w["down_scales"][e])
        out[e] = y.to(torch.bfloat16)
    return out


def make_weights(fp8, gen):
    dev = "cuda"
    if not fp8:
        return {"gate_up": ((torch.rand(E, 2 * I, H, generator=gen) * 2 - 1) / H ** 0.5)
                .to(torch.bfloat16).to(dev),
                "down": ((torch.rand(E, H, I, generator=gen) * 2 - 1) / I ** 0.5)
                .to(torch.bfloat16).to(dev)}
    return {"gate_up": ((torch.rand(E, 2 * I, H, generator=gen) * 2 - 1) * 448)
            .to(torch.float8_e4m3fn).to(dev),
            "down": ((torch.rand(E, H, I, generator=gen) * 2 - 1) * 448)
            .to(torch.float8_e4m3fn).to(dev),
            "gate_up_scales": ((torch.rand(E, 2 * I // 128, H // 128, generator=gen) + 0.5)
                               / (448 * H ** 0.5)).to(dev),
            "down_scales": ((torch.rand(E, H // 128, I // 128, generator=gen) + 0.5)
                            / (448 * I ** 0.5)).to(dev)}


def check(out, ref, first, rows, sentinel, fp8=False):
    """Every expert's rows against the reference. FP8 weights: an h value next to an FP8
    rounding boundary can round the other way (the GPU's gate/up sums, on the tensor cores,
    keep fewer bits than float32: docs/moe.md, "FP8 on wgmma"), moving its row by w_down x one
    FP8 step, up to ~0.2 x rms; so a loose bound per value, a tight one that the values of at
    most max(2, rows / 32) rows, or 0.1 % of the values, may pass (a flip moves one row), and a
    tight one on the rms of the errors."""
    flat = out.reshape(-1, H).float().cpu()
    covered = torch.zeros(flat.shape[0], dtype=torch.bool)
    vals = torch.cat([r.float().cpu().reshape(-1) for r in ref.values()])
    rms = vals.pow(2).mean().sqrt().item()
    err_sq, n, rows_past_tight, rows_covered, values_past_tight = 0.0, 0, 0, 0, 0
    per_val, tight = (0.03, 0.06) if fp8 else (0.02, 0.02)
    loose = 0.3 if fp8 else tight
    for e, r in ref.items():
        got = flat[first[e]:first[e] + rows[e]]
        want = r.float().cpu()
        err = (got - want).abs()
        assert (err <= loose * rms + per_val * want.abs()).all(), \
            "expert %d: max err %g (rms %g)" % (e, err.max().item(), rms)
        past = ~(err <= tight * rms + per_val * want.abs())
        rows_past_tight += int(past.any(dim=1).sum().item())
        values_past_tight += int(past.sum().item())
        rows_covered += want.shape[0]
        err_sq += err.pow(2).sum().item()
        n += want.numel()
        covered[first[e]:first[e] + rows[e]] = True
    rows_allowed = max(2, rows_covered // 32)
    assert rows_past_tight <= rows_allowed or values_past_tight <= n // 1000, \
        "%d values in %d of %d rows past %g x rms + %g |ref|" % (
            values_past_tight, rows_past_tight, rows_covered, tight, per_val)
    assert n == 0 or (err_sq / n) ** 0.5 <= 0.01 * rms, "rms of the errors %g > 0.01 x %g" % (
        (err_sq / n) ** 0.5, rms)
    assert (flat[~covered] == sentinel).all(), "a row outside the experts' rows was written"


@pytest.mark.parametrize("fp8,x_fp8", [(False, False), (True, False), (True, True)])
def test_masked_layout_matches_reference(fp8, x_fp8):
    gen = torch.Generator().manual_seed(7 + fp8 + 2 * x_fp8)
    w = make_weights(fp8, gen)
    experts = epx.Experts(**w)
    count = torch.tensor([0, 1, 33, 50], dtype=torch.int32)  # 50 is cut to the room, 40
    x16 = ((torch.rand(E, ROOM, H, generator=gen) * 4 - 2).to(torch.bfloat16)).cuda()
    x, xs = (quantize(x16) if x_fp8 else (x16, None))
    out = torch.full((E, ROOM, H), 7.0, dtype=torch.bfloat16, device="cuda")
    experts(x, count.cuda(), x_scales=xs, out=out)
    torch.cuda.synchronize()
    first = [e * ROOM for e in range(E)]
    rows = [min(int(c), ROOM) for c in count]
    ref = reference(x.reshape(-1, H), first, rows, w, fp8,
                    xs.reshape(-1, H // 128) if xs is not None else None)
    check(out, ref, first, rows, 7.0, fp8)


def test_contiguous_layout_and_graph_replay():
    gen = torch.Generator().manual_seed(11)
    w = make_weights(True, gen)
    experts = epx.Experts(**w)
    n = 120
    x = ((torch.rand(n, H, generator=gen) * 4 - 2).to(torch.bfloat16)).cuda()
    begin = torch.tensor([70, 0, 30, 120], dtype=torch.int32, device="cuda")
    count = torch.tensor([40, 9, 25, 3], dtype=torch.int32, device="cuda")  # 70 + 40 <= 120
    out = torch.full((n, H), 7.0, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    experts(x, count, expert_begin=begin, out=out, stream=stream)  # workspace allocated eagerly
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        experts(x, count, expert_begin=begin, out=out)
    for counts in ([40, 9, 25, 3], [2, 30, 0, 0]):
        count.copy_(torch.tensor(counts, dtype=torch.int32))
        out.fill_(7.0)
        graph.replay()
        torch.cuda.synchronize()
        first = begin.tolist()
        rows = [max(0, min(c, n - b)) for c, b in zip(counts, first)]
        check(out, reference(x, first, rows, w, True), first, rows, 7.0, True)


def test_bad_arguments_are_named():
    gen = torch.Generator().manual_seed(3)
    w = make_weights(False, gen)
    experts = epx.Experts(**w)
    x = torch.zeros(E, 8, H, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(epx.EpxInvalidArgument, match="expert_count"):
        experts(x, torch.zeros(E, dtype=torch.int64, device="cuda"))
    with pytest.raises(epx.EpxInvalidArgument, match="expert_begin"):
        experts(x.reshape(-1, H), torch.zeros(E, dtype=torch.int32, device="cuda"))
    with pytest.raises(epx.EpxUnsupported):
        experts(x.to(torch.float8_e4m3fn), torch.zeros(E, dtype=torch.int32, device="cuda"),
                x_scales=torch.ones(E, 8, H // 128, device="cuda"))
    with pytest.raises(epx.EpxInvalidArgument, match="hidden"):
        epx.Experts(torch.zeros(E, 2 * I, 200, dtype=torch.bfloat16, device="cuda"),
                    torch.zeros(E, 200, I, dtype=torch.bfloat16, device="cuda"))

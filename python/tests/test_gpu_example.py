"""test_gpu_example.py - examples/moe_layer.py under torchrun, normal and low-latency modes.

Runs `python -m torch.distributed.run --standalone --nproc-per-node=N examples/moe_layer.py
--mode M` at N = 1, 2 and 4 GPUs (when visible), plus once over a gloo process group at 2, and
asserts exit code 0 and one "OK" line per rank (the example compares its EPX output with a
one-GPU float32 reference). Skips without a GPU,
torch, CUDA or an importable epx. Each run has a timeout, so a hang fails the test.
"""
import os
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import pytest  # noqa: E402

import gpu_spawn  # noqa: E402

_SKIP = gpu_spawn.skip_reason(1)
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")

REPO = os.path.dirname(os.path.dirname(HERE))
EXAMPLE = os.path.join(REPO, "examples", "moe_layer.py")
TIMEOUT_S = float(os.environ.get("EPX_TEST_TIMEOUT", "300"))


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_moe_layer_example(nproc, mode):
    _run_example(nproc, "--mode", mode)


def test_moe_layer_example_gloo():
    """The same layer with a gloo process group: EPX exchanges its NCCL id over it."""
    _run_example(2, "--mode", "normal", "--backend", "gloo")


def _run_example(nproc, *args):
    n = gpu_spawn.gpu_count()
    if n < nproc:
        pytest.skip(f"needs {nproc} GPUs, {n} visible")
    import epx
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    # The example imports epx as this process does (installed, or from the source tree).
    epx_root = os.path.dirname(os.path.dirname(os.path.abspath(epx.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(part for part in (epx_root, env.get("PYTHONPATH")) if part)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", EXAMPLE, *args]
    # Own session, so that a timeout kills torchrun and its workers together.
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"{' '.join(cmd)}: no exit within {TIMEOUT_S:.0f} s\n{out[-6000:]}")
    print(out)
    assert p.returncode == 0, f"{' '.join(cmd)}: exit code {p.returncode}\n{out[-6000:]}"
    ok = [line for line in out.splitlines() if line.startswith("rank ") and line.endswith("OK")]
    assert len(ok) == nproc, f"expected {nproc} 'rank r: ... OK' lines\n{out[-6000:]}"

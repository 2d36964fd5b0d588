"""gpu_spawn.py - run a function in one process per GPU, for the multi-GPU pytest files.

`run_ranks(world_size, "module:function", args, timeout_s)` spawns world_size processes (the
"spawn" start method: no CUDA state crosses a fork), each with its own GPU, a torch.distributed
process group over NCCL (a free TCP port on 127.0.0.1) and NCCL_NVLS_ENABLE=0, and calls
`module.function(rank, world_size, *args)` there. The function returns a list of failure
messages (empty = passed); an exception counts as a failure too. The parent waits at most
timeout_s; once a rank has failed, the others get GRACE_S more to finish (a failed rank may
leave its peers waiting in a collective), then every process still alive is killed. So a hang
fails the test, it never blocks the suite.

`skip_reason(min_gpus)` says why a multi-GPU test cannot run here (None when it can): no torch,
no CUDA, fewer than min_gpus GPUs, or epx not importable.
"""
import importlib
import os
import queue as queue_mod
import socket
import sys
import time
import traceback

GRACE_S = 20.0
HERE = os.path.dirname(os.path.abspath(__file__))


def gpu_count():
    """Visible GPUs, 0 without torch or CUDA. Creates no CUDA context in this process."""
    try:
        import torch
    except ImportError:
        return 0
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def skip_reason(min_gpus=2):
    try:
        import torch
    except ImportError as e:
        return f"torch is not installed ({e})"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    n = torch.cuda.device_count()
    if n < min_gpus:
        return f"needs {min_gpus} GPUs, {n} visible"
    try:
        import epx  # noqa: F401 - importable (the NCCL check passes) is what counts
    except Exception as e:  # ImportError, or the import-time NCCL check
        return f"epx is not importable: {type(e).__name__}: {e}"
    return None


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world_size, port, paths, target, args, results):
    """Entry point of one rank (runs in the spawned process)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    failures = None
    try:
        import datetime

        import torch
        import torch.distributed as dist
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device,
                                timeout=datetime.timedelta(seconds=120))
        module_name, fn_name = target.split(":")
        fn = getattr(importlib.import_module(module_name), fn_name)
        failures = list(fn(rank, world_size, *args) or [])
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        results.close()
        results.join_thread()
        os._exit(1)  # skip interpreter teardown: peers may be gone, NCCL may hang in it
    results.put((rank, "done", failures))
    results.close()
    results.join_thread()
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def run_ranks(world_size, target, args=(), timeout_s=300.0):
    """Run `target` ("module:function", importable from this folder) on world_size GPUs.
    Raises AssertionError listing every rank's failures, errors, exit codes and timeouts."""
    import torch.multiprocessing as mp

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    paths = [HERE]
    procs = [ctx.Process(target=_child, args=(r, world_size, port, paths, target, args, results),
                         name=f"epx-rank{r}", daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()

    reports = {}
    deadline = time.monotonic() + timeout_s
    first_failure = None
    while len(reports) < world_size:
        now = time.monotonic()
        limit = deadline if first_failure is None else min(deadline, first_failure + GRACE_S)
        if now >= limit:
            break
        try:
            rank, kind, payload = results.get(timeout=min(1.0, limit - now))
        except queue_mod.Empty:
            # A rank that died without reporting (a crash) counts as failed from now.
            if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
                first_failure = time.monotonic()
            continue
        reports[rank] = (kind, payload)
        if first_failure is None and (kind == "error" or payload):
            first_failure = time.monotonic()

    # Every rank reported: give them a moment to exit cleanly. Otherwise: kill at once.
    for p in procs:
        p.join(timeout=10.0 if len(reports) == world_size else 0.5)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)

    problems = []
    for r in range(world_size):
        if r not in reports:
            code = procs[r].exitcode
            why = "killed" if code is not None and code < 0 else f"exit code {code}"
            problems.append(f"rank {r}: no report ({why}; limit {timeout_s:.0f} s, "
                            f"{GRACE_S:.0f} s after the first failure)")
            continue
        kind, payload = reports[r]
        if kind == "error":
            problems.append(f"rank {r}: exception\n{payload}")
        elif payload:
            problems.append(f"rank {r}: {len(payload)} failed check(s)\n  " + "\n  ".join(payload))
    if problems:
        raise AssertionError(f"{target} on {world_size} ranks (args {args!r}):\n"
                             + "\n".join(problems))


class Checks:
    """Failure collector for a rank: a failed check is recorded, never raised, so that a rank
    keeps making the same collective calls as its peers and the test ends instead of hanging."""

    def __init__(self, rank, seed, limit=40):
        self.rank, self.seed, self.limit = rank, seed, limit
        self.failures = []
        self.section = ""

    def where(self, section):
        self.section = section

    def fail(self, msg):
        if len(self.failures) < self.limit:
            self.failures.append(f"[{self.section}] {msg} (seed {self.seed})")
        elif len(self.failures) == self.limit:
            self.failures.append("... more failures not shown")

    def check(self, cond, msg):
        if not cond:
            self.fail(msg() if callable(msg) else msg)
        return bool(cond)

    def equal(self, got, want, what):
        """Exact equality of two tensors (moved to the CPU), naming the first mismatch."""
        got, want = got.detach().cpu(), want.detach().cpu()
        if got.shape != want.shape:
            self.fail(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
            return False
        if got.dtype != want.dtype:
            want = want.to(got.dtype)
        bad = got != want
        if got.is_floating_point():
            bad &= ~(got.isnan() & want.isnan())
        if bad.any():
            i = tuple(bad.nonzero()[0].tolist())
            self.fail(f"{what}: {int(bad.sum())} of {got.numel()} differ; first at {i}: "
                      f"{got[i].item()!r}, expected {want[i].item()!r}")
            return False
        return True

    def close(self, got, want, bound, what):
        """|got - want| <= bound elementwise (float32 on the CPU)."""
        got, want = got.detach().cpu().float(), want.detach().cpu().float()
        bound = bound.detach().cpu().float() if hasattr(bound, "detach") else bound
        if got.shape != want.shape:
            self.fail(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
            return False
        err = (got - want).abs()
        bad = ~(err <= bound)  # NaN counts as bad
        if bad.any():
            i = tuple(bad.nonzero()[0].tolist())
            b = bound[i].item() if hasattr(bound, "shape") and bound.dim() else float(bound)
            self.fail(f"{what}: {int(bad.sum())} of {got.numel()} beyond tolerance; first at {i}: "
                      f"{got[i].item()!r}, expected {want[i].item()!r} (bound {b:.3g}); "
                      f"max err {err.max().item():.3g}")
            return False
        return True

    def raises(self, exc_type, fn, what, contains=()):
        """fn() must raise exc_type whose str() contains every string of `contains`."""
        try:
            fn()
        except exc_type as e:
            text = str(e)
            for c in contains:
                self.check(c in text, f"{what}: message {text!r} does not name {c!r}")
            return e
        except BaseException as e:  # noqa: BLE001 - reported, not swallowed silently
            self.fail(f"{what}: raised {type(e).__module__}.{type(e).__name__}: {e}, "
                      f"expected {exc_type.__name__}")
            return None
        self.fail(f"{what}: no exception, expected {exc_type.__name__}")
        return None

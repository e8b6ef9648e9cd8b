#!/usr/bin/env python3
"""bench/peers: the higher-order workloads of bench/workloads.md in torch eager,
torch.compile (fullgraph, trace_autograd_ops) and JAX jit, on one thread.

    python bench/peers/run.py [--workload NAME[,NAME...]|all] [--dtype float|double|both]
                              [--framework torch|compile|jax|all] [--rounds R] [--warmup W]
                              [--small]

Prints one row per workload / framework / dtype: the first call's seconds (trace and
compile included), the median ms per step over R rounds after W warm-up rounds (rounds
interleave the frameworks), the speed-up over torch eager at the same dtype, and the max
relative difference of the loss and gradients from torch eager in double. torch eager is
the baseline and always runs when torch is importable. See README.md.
"""

import os

# One thread, before torch or jax is imported.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
_xla = os.environ.get("XLA_FLAGS", "")
for _flag in ("--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1"):
    if _flag not in _xla:
        _xla = (_xla + " " + _flag).strip()
os.environ["XLA_FLAGS"] = _xla
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The flags above do not keep XLA on one thread: jax 0.10.2's CPU runtime still ran a
# 2000x512x512 product on both cores of a 2-core VM (10.5 ms of CPU time per 5.4 ms of
# wall time, 2026-12-07), which made JAX's product-bound rows (critic512) look 2x faster
# than one core allows. So the process is pinned to one CPU (the first it may run on)
# before torch or jax starts a thread; --all-cpus keeps the inherited affinity.
_PINNED_CPU = None
if "--all-cpus" not in __import__("sys").argv and hasattr(os, "sched_setaffinity"):
    _PINNED_CPU = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {_PINNED_CPU})
# A cold first call: inductor's on-disk caches (FX graph, AOT autograd, compiled C++)
# would make a rerun's "first call" a cache load. A fresh cache folder per process
# (removed at exit) unless --warm-cache.
_FRESH_CACHE = "--warm-cache" not in __import__("sys").argv
if _FRESH_CACHE:
    import atexit
    import shutil
    import tempfile
    _cache = tempfile.mkdtemp(prefix="peers-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _cache
    os.environ["TRITON_CACHE_DIR"] = os.path.join(_cache, "triton")
    # inductor's precompiled headers go to tempfile.gettempdir()/torchinductor_<user>
    # whatever TORCHINDUCTOR_CACHE_DIR says: the process's temp folder is the fresh one too
    tempfile.tempdir = _cache
    atexit.register(shutil.rmtree, _cache, True)

import argparse
import importlib.util
import statistics
import sys
import time
import traceback

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    import workloads as W  # noqa: E402  (needs numpy)
except ImportError as _e:
    print("bench/peers: %s; nothing to run (pip install numpy torch jax, see bench/peers/README.md)" % _e)
    sys.exit(0)

FRAMEWORKS = ["torch", "compile", "jax"]
LABEL = {"torch": "torch eager", "compile": "torch.compile", "jax": "JAX jit"}


def importable(mod):
    """None when `mod` imports, else the reason."""
    try:
        if importlib.util.find_spec(mod) is None:
            return "not installed"
        importlib.import_module(mod)
        return None
    except Exception as e:  # a broken install counts as missing
        return one_line(e)


# ---------------------------------------------------------------------------- runners

class TorchRunner:
    """torch eager, or torch.compile(fullgraph=True) of the whole step (the loss, its
    inner create_graph grads and the final grad in the weights)."""

    def __init__(self, spec, compiled):
        import torch
        self.torch = torch
        self.w, self.d = W.torch_inputs(spec)
        step = W.torch_step_fn(spec)
        if compiled:
            import torch._dynamo
            torch._dynamo.reset()  # a fresh cache per workload and dtype
            step = torch.compile(step, fullgraph=True)
        self.step = step

    def __call__(self):
        return self.step(self.w, self.d)

    def result(self, out):
        loss, grads = out
        return float(loss.double().item()), [g.detach().double().numpy() for g in grads]


class JaxRunner:
    def __init__(self, spec):
        import jax
        self.jax = jax
        self.w, self.d = W.jax_inputs(spec)
        self.step = W.jax_step_fn(spec)

    def __call__(self):
        out = self.step(self.w, self.d)
        self.jax.block_until_ready(out)
        return out

    def result(self, out):
        import numpy as np
        loss, grads = out
        return (None if loss is None else float(np.asarray(loss, dtype=np.float64)),
                [np.asarray(g, dtype=np.float64) for g in grads])


def finish_result(spec, loss, grads):
    """hvp reports the sum of the HVP's entries as its loss."""
    if spec.name == "hvp":
        return float(sum(g.sum() for g in grads)), grads
    return loss, grads


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def one_line(e):
    text = "%s: %s" % (type(e).__name__, str(e).strip())
    first = text.splitlines()[0] if text else type(e).__name__
    return first if len(first) <= 160 else first[:157] + "..."


# ---------------------------------------------------------------------------- bench

def run_case(name, dtype, frameworks, args, reference, errors):
    """Rows for one workload at one dtype."""
    spec = W.make_spec(name, dtype, args.small)
    rows = []
    live = []  # (fw, runner, times)
    for fw in frameworks:
        try:
            runner = JaxRunner(spec) if fw == "jax" else TorchRunner(spec, fw == "compile")
            t0 = time.perf_counter()
            out = runner()
            first = time.perf_counter() - t0
            loss, grads = finish_result(spec, *runner.result(out))
        except Exception as e:  # a peer that cannot run this workload: n/a (reason)
            errors.append((name, fw, dtype, traceback.format_exc()))
            rows.append(dict(fw=fw, error=one_line(e)))
            continue
        diff = None
        if reference is not None:
            diff = W.max_rel_diff(loss, grads, reference[0], reference[1])
        row = dict(fw=fw, first=first, loss=loss, diff=diff, times=[])
        rows.append(row)
        live.append((fw, runner, row))
    # warm-up, then timed rounds; each round runs every framework once, the order
    # rotating by one per round
    for r in range(args.warmup + args.rounds):
        for i in range(len(live)):
            fw, runner, row = live[(i + r) % len(live)]
            t0 = time.perf_counter()
            runner()
            dt = time.perf_counter() - t0
            if r >= args.warmup:
                row["times"].append(dt)
    for row in rows:
        if "times" in row and row["times"]:
            row["ms"] = 1e3 * statistics.median(row["times"])
    base = next((row.get("ms") for row in rows if row["fw"] == "torch"), None)
    for row in rows:
        if base is not None and row.get("ms"):
            row["ratio"] = base / row["ms"]
    return spec, rows


def reference_double(name, small):
    """torch eager in double: (loss, grads) in float64."""
    spec = W.make_spec(name, "double", small)
    runner = TorchRunner(spec, False)
    return finish_result(spec, *runner.result(runner()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="all",
                   help="a name, a comma-separated list, or all (%s)" % ", ".join(W.NAMES))
    p.add_argument("--dtype", choices=["float", "double", "both"], default="both")
    p.add_argument("--framework", choices=FRAMEWORKS + ["all"], default="all")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--small", action="store_true", help="the tests' small sizes")
    p.add_argument("--warm-cache", action="store_true",
                   help="keep inductor's on-disk caches (first calls of reruns load, not compile)")
    p.add_argument("--all-cpus", action="store_true",
                   help="do not pin the process to one CPU (XLA then uses every core it may run on)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the comparison with torch eager in double")
    args = p.parse_args(argv)

    names = W.NAMES if args.workload == "all" else [n.strip() for n in args.workload.split(",") if n.strip()]
    for n in names:
        if n not in W.NAMES:
            p.error("unknown workload '%s' (one of %s)" % (n, ", ".join(W.NAMES)))
    dtypes = ["float", "double"] if args.dtype == "both" else [args.dtype]
    wanted = FRAMEWORKS if args.framework == "all" else [args.framework]

    why_torch = importable("torch")
    why_jax = importable("jax") if ("jax" in wanted) else "not requested"
    have_torch, have_jax = why_torch is None, why_jax is None
    frameworks = []
    for fw in wanted:
        if fw == "jax" and not have_jax:
            print("bench/peers: jax is not importable (%s); skipping JAX (pip install jax)" % why_jax)
        elif fw != "jax" and not have_torch:
            print("bench/peers: torch is not importable (%s); skipping %s (pip install torch)"
                  % (why_torch, LABEL[fw]))
        elif fw not in frameworks:
            frameworks.append(fw)
    if not frameworks:
        print("bench/peers: no requested framework is importable; nothing to run")
        return 0
    if have_torch and "torch" not in frameworks:
        frameworks.insert(0, "torch")  # the baseline of the ratios

    versions = []
    if have_torch:
        import torch
        torch.set_num_threads(1)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
        if "compile" in frameworks:
            import torch._dynamo
            import torch._inductor.config
            torch._dynamo.config.trace_autograd_ops = True
            torch._inductor.config.compile_threads = 1
            if _FRESH_CACHE:
                torch._inductor.config.fx_graph_cache = False
                try:
                    import torch._functorch.config
                    torch._functorch.config.enable_autograd_cache = False
                except (ImportError, AttributeError):
                    pass
        versions.append("torch %s (%d thread)" % (torch.__version__, torch.get_num_threads()))
    if "jax" in frameworks:
        import jax
        jax.config.update("jax_enable_x64", True)  # float64 arrays stay float64
        versions.append("jax %s (%s)" % (jax.__version__, jax.default_backend()))
    print("bench/peers: %s UTC, %s, %s cores, Python %s" % (
        time.strftime("%Y-%m-%d %H:%M", time.gmtime()), cpu_model(), os.cpu_count(),
        sys.version.split()[0]))
    print("bench/peers: %s; XLA_FLAGS=%s; %s; %s sizes; %d warm-up + %d rounds (median)" % (
        ", ".join(versions), os.environ["XLA_FLAGS"],
        "pinned to CPU %d" % _PINNED_CPU if _PINNED_CPU is not None else "not pinned (--all-cpus)",
        "small" if args.small else "default", args.warmup, args.rounds))
    print("ratio = torch eager ms / this ms (same dtype); rel diff = max |x - ref| / max |ref| "
          "over loss and gradients, ref = torch eager in double")
    print()
    header = "%-17s %-14s %-7s %12s %12s %8s %10s %18s  %s" % (
        "workload", "framework", "dtype", "first call s", "ms/step", "ratio", "rel diff", "loss", "network")
    print(header)
    print("-" * len(header))

    errors = []
    check = have_torch and not args.no_check
    for name in names:
        reference = reference_double(name, args.small) if check else None
        for dtype in dtypes:
            spec, rows = run_case(name, dtype, frameworks, args, reference, errors)
            for row in rows:
                if "error" in row:
                    print("%-17s %-14s %-7s %s" % (name, LABEL[row["fw"]], dtype,
                                                 "n/a (%s)" % row["error"]))
                    continue
                ms = row.get("ms")
                print("%-17s %-14s %-7s %12.2f %12s %8s %10s %18.10e  %s" % (
                    name, LABEL[row["fw"]], dtype, row["first"],
                    "%.3f" % ms if ms is not None else "-",
                    "%.2fx" % row["ratio"] if row.get("ratio") else "-",
                    "%.1e" % row["diff"] if row.get("diff") is not None else "-",
                    row["loss"], spec.describe()), flush=True)
    if errors:
        print("\nerrors:")
        for name, fw, dtype, tb in errors:
            print("--- %s, %s, %s" % (name, LABEL[fw], dtype))
            lines = tb.rstrip().splitlines()
            print("\n".join(lines[-25:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""fxmem against the tools users would pick instead: measured memory and time, side by side.

    python benchmarks/run.py [--device cpu|cuda] [--models gpt,vit,...] [--quick] [--steps N]

For each model, from one process and one set of weights: eager; eager with every block
checkpointed (torch.utils.checkpoint, or HF's gradient_checkpointing_enable); eager with
activations offloaded to host memory (torch.autograd.graph.save_on_cpu(pin_memory=True),
CUDA only); torch.compile (inductor); torch.compile with activation_memory_budget swept;
fxmem swept over absolute budgets from its floor to unconstrained, with its default passes,
and fxmem with passes=() (rematerialisation alone). Peaks come from `fxmem.measure`; see
benchmarks/_harness.py for how steps are run, alternated, timed and checked.

Writes, under --out-dir (default benchmarks/results/<device>, or .../<device>-quick):
RESULTS.md (tables, goal checks, notes), results.json, and pareto-<model>.png per model.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import sys
import tempfile
import time

# A cold, private inductor cache, so that "first call" includes real compilation (and is not a
# hit from an earlier run). Configurations of one run share it, as one user's runs would.
if "--warm-cache" not in sys.argv and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _CACHE_DIR = tempfile.mkdtemp(prefix="fxmem-bench-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _CACHE_DIR
    atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
# The repository root, for `benchmarks`; after the installed packages, so that an installed
# fxmem (with fxmem.passes, which only the install maps) is the one imported.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._harness import allow_many_compiles, bench_model  # noqa: E402
from benchmarks._models import DEFAULT_MODELS, MODELS  # noqa: E402
from benchmarks._records import Options, machine_line  # noqa: E402
from benchmarks._report import plot_pareto, render_model, summary_table, to_json  # noqa: E402

__all__ = ["main"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--models", default=None, help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="small sizes, one activation_memory_budget, fxmem at its floor and unconstrained; default model gpt",
    )
    ap.add_argument("--steps", type=int, default=5, help="measured rounds per configuration (>= 5 for the report)")
    ap.add_argument("--out-dir", default=None, help="where RESULTS.md, results.json and the plots go")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads on CPU (default 1: on the 2-vCPU VM two threads were slower and far "
        "noisier; 0 keeps torch's default)",
    )
    ap.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds: past it no further configuration or model starts, and a model's timed rounds end "
        "after at least two (what was started is measured and written, the report says what was cut); "
        "the report is rewritten after every model either way",
    )
    ap.add_argument("--warm-cache", action="store_true", help="use the usual inductor cache instead of a cold one")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.time_limit is not None and not args.time_limit > 0:
        ap.error("--time-limit must be > 0")
    size_key = "quick" if args.quick else args.device
    names = args.models.split(",") if args.models else (["gpt"] if args.quick else DEFAULT_MODELS[args.device])
    for n in names:
        if n not in MODELS:
            ap.error(f"unknown model {n!r}; known: {', '.join(MODELS)}")
        if size_key not in MODELS[n].sizes and not (args.quick and args.device in MODELS[n].sizes):
            ap.error(f"model {n!r} has no {size_key} size (it has: {', '.join(MODELS[n].sizes)})")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    args.names = names
    args.size_key = size_key
    if args.out_dir is None:
        here = os.path.dirname(os.path.abspath(__file__))
        args.out_dir = os.path.join(here, "results", args.device + ("-quick" if args.quick else ""))
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.device == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    allow_many_compiles()
    opts = Options(device=args.device, steps=args.steps)
    if args.quick:
        opts.amb_values, opts.fxmem_points, opts.remat_only, opts.sliced = (0.5,), 1, False, False

    def log(msg: str) -> None:
        print(msg, flush=True)

    machine = machine_line(args.device)
    command = "python benchmarks/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    log(machine)
    t0 = time.perf_counter()
    if args.time_limit is not None:
        opts.deadline = t0 + args.time_limit
    os.makedirs(args.out_dir, exist_ok=True)
    results, sections = [], []
    # A run stopped from outside (timeout sends SIGTERM) still writes the models it finished.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    done = False
    try:
        for k, name in enumerate(args.names):
            # The first model always starts (its configurations each ask the clock): what a
            # run past its limit reports does not hang on the milliseconds before it.
            if k and opts.out_of_time():
                log(f"time limit: not run: {', '.join(args.names[k:])}")
                sections.append(
                    f"## Not run\n\nPast the time limit ({args.time_limit:.0f} s): {', '.join(args.names[k:])}.\n"
                )
                break
            spec = MODELS[name]
            size_key = args.size_key if args.size_key in spec.sizes else args.device
            result = bench_model(spec, size_key, opts, log)
            results.append(result)
            png = f"pareto-{name}.png"
            try:
                plot_pareto(result, os.path.join(args.out_dir, png), f" ({args.device}, torch {torch.__version__})")
            except Exception as e:  # noqa: BLE001 - a missing plot loses no measurement
                log(f"[{name}] no plot: {type(e).__name__}: {e}")
                png = None
            sections.append(render_model(result, png))
            log(f"[{name}] done in {result.wall_s:.0f} s")
            if k + 1 < len(args.names):
                _write(args, machine, command, opts, results, sections, time.perf_counter() - t0, done=False)
        done = True
    finally:
        report = _write(args, machine, command, opts, results, sections, time.perf_counter() - t0, done=done)
    print()
    print(report)
    log(f"wrote {args.out_dir}/RESULTS.md, results.json and {len(results)} plot(s) in {time.perf_counter() - t0:.0f} s")
    return 0


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _write(
    args: argparse.Namespace,
    machine: str,
    command: str,
    opts: Options,
    results: list,
    sections: list[str],
    wall_s: float,
    done: bool,
) -> str:
    """RESULTS.md and results.json for the models measured so far; returns the report."""
    header = [
        f"# fxmem benchmarks, {args.device}{' (--quick)' if args.quick else ''}",
        "",
        f"Machine: {machine}.",
        "",
        f"Command: `{command.strip()}` — wall time {wall_s / 60:.1f} min "
        f"{'for the whole run' if done else 'so far (the run had not finished)'}"
        f"{' (cold inductor cache)' if not args.warm_cache else ''}.",
        "",
        "Each step is forward + backward of a training step, fp32, no optimizer, keeping only the loss (what "
        "else the model returns is let go before the backward; fxmem plans for that: `keep_outputs=False`). "
        f"{opts.steps} timed rounds; in "
        "each, every configuration runs one plain timed step (median step time), configurations alternating in "
        "rotating order after one warm-up step each; in the first and last rounds each also runs one step inside "
        "`fxmem.measure` (peak: the largest of those and the warm-up's). 'first call' is the warm-up step: compilation, fxmem's planning and one step. Anchors are every "
        "configuration that is not fxmem. Gradients are compared once per configuration (relative L2 error, worst "
        "parameter). MiB = 2**20 bytes.",
        "",
        "## Summary",
        "",
        summary_table(results),
    ]
    report = "\n".join(header) + "\n" + "\n".join(sections)
    with open(os.path.join(args.out_dir, "RESULTS.md"), "w") as f:
        f.write(report)
    meta = {"machine": machine, "command": command.strip(), "wall_s": wall_s, "torch": torch.__version__}
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        f.write(to_json(results, meta))
    return report


if __name__ == "__main__":
    sys.exit(main())

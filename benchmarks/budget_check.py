"""The budget contract on one GPT: fxmem at fractions of eager's measured peak and at its floor.

    python benchmarks/budget_check.py [--device cpu|cuda] [--size cpu|cuda|quick]
        [--points remat:0.8,remat:0.6,remat:0.5,default:floor] [--steps 3] [--time-limit S]
        [--out-dir DIR]

The benchmark GPT (hand-written attention; on CUDA the GPT-2-small shape at batch 8 x 1024,
which fills several GB) trains from one set of weights: eager first, then
`fxmem.optimize(model, budget)` at each point, with the default compiler (inductor). A point is
PASSES:BUDGET: PASSES `remat` (passes=(): the planner's rematerialisation alone) or `default`
(the default rewrite passes); BUDGET a fraction of eager's measured peak, or `floor`, the
smallest budget fxmem accepts for that pass set (read from the BudgetError of an impossible
one). The default points hold the planner to 80%, 60% and 50% of eager's peak, then the
default passes to their floor. Per point: measured peak (`fxmem.measure`: on CUDA
`torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`) against the budget, the
plan's prediction against the measured peak, the gradients' largest relative error against
eager's (norm of the difference over the norm, per parameter), the median step time and the
first call (planning and compilation). Steps, peaks and gradients are taken as in
benchmarks/run.py (benchmarks/_harness.py).

Writes budget_check.md and budget_check.json under --out-dir (default
benchmarks/results/budget-<device>) after every point, so a run cut short keeps what it
measured (a point that was running when the run was stopped reads "started, did not finish";
the report says whether the run finished); past --time-limit seconds no further point is
started. Exit status 0 when every point was measured within its budget with gradients within
1e-4 of eager's; 1 when a budget was exceeded, gradients differ, or a point failed; 3 when
nothing failed but the time limit left points unmeasured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# The repository root, for `benchmarks`; after the installed packages, so that an installed
# fxmem (with fxmem.passes, which only the install maps) is the one imported.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._harness import (  # noqa: E402
    Runner,
    allow_many_compiles,
    call_model,
    floor_of,
    free_memory,
    fxmem_config,
    warm_up_at_floor,
    zero_grads,
)
from benchmarks._models import MODELS  # noqa: E402
from benchmarks._records import Config, MiB, machine_line  # noqa: E402

__all__ = ["main"]

GRAD_TOL = 1e-4
PASS_SETS: dict[str, tuple[str, ...] | None] = {"remat": (), "default": None}  # fxmem.optimize's passes=


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--size", choices=("cpu", "cuda", "quick"), default=None, help="default: the device's")
    ap.add_argument(
        "--points",
        default="remat:0.8,remat:0.6,remat:0.5,default:floor",
        help="PASSES:BUDGET, comma-separated; PASSES remat or default, BUDGET a fraction of eager's peak or floor",
    )
    ap.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    ap.add_argument("--time-limit", type=float, default=None, help="start no budget after this many seconds")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    points = []
    for item in args.points.split(","):
        passes, _, budget = (part.strip() for part in item.partition(":"))
        try:
            fraction = None if budget == "floor" else float(budget)
        except ValueError:
            fraction = -1.0
        if passes not in PASS_SETS or (fraction is not None and not 0.0 < fraction <= 1.0):
            ap.error(
                f"--points: {item!r} is not PASSES:BUDGET with PASSES in {sorted(PASS_SETS)}, BUDGET in (0, 1] or floor"
            )
        points.append((passes, fraction))
    args.points = points
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.time_limit is not None and not args.time_limit > 0:
        ap.error("--time-limit must be > 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    args.size = args.size or args.device
    if args.out_dir is None:
        here = os.path.dirname(os.path.abspath(__file__))
        args.out_dir = os.path.join(here, "results", f"budget-{args.device}")
    return args


def _row(c: Config) -> dict:
    peak = c.peak_bytes
    return {
        "config": c.name,
        "budget_mib": c.budget_bytes / MiB if c.budget_bytes else None,
        "measured_peak_mib": peak / MiB if peak is not None else None,
        "predicted_peak_mib": c.predicted_peak_bytes / MiB if c.predicted_peak_bytes else None,
        "within_budget": None if c.budget_bytes is None or peak is None else peak <= c.budget_bytes,
        "grad_rel_err": c.grad_err,
        "step_s": c.step_s,
        "first_call_s": c.first_s,
        "planning_s": c.planning_s,
        "error": c.error,
        "notes": list(c.notes),
    }


def _f(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def _markdown(rows: list[dict], header: list[str], status: str) -> str:
    f = _f
    lines = [
        *header,
        "",
        f"Status: {status}.",
        "",
        "| configuration | budget MiB | measured MiB | predicted MiB | pred/meas | within | grad rel err "
        "| step s | first call s |",
        "|---|---:|---:|---:|---:|:-:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = (
            r["predicted_peak_mib"] / r["measured_peak_mib"]
            if r["predicted_peak_mib"] and r["measured_peak_mib"]
            else None
        )
        within = {None: "", True: "yes", False: "**NO**"}[r["within_budget"]]
        lines.append(
            f"| {r['config']} | {f(r['budget_mib'], '.1f')} | {f(r['measured_peak_mib'], '.1f')} "
            f"| {f(r['predicted_peak_mib'], '.1f')} | {f(ratio, '.3f')} | {within} | {f(r['grad_rel_err'], '.1e')} "
            f"| {f(r['step_s'], '.4f')} | {f(r['first_call_s'], '.1f')} |"
        )
        for text in ([r["error"]] if r["error"] else []) + r["notes"]:
            lines.append(f"|  ↳ {text} | | | | | | | | |")
    return "\n".join(lines) + "\n"


NOT_RUN = "not run: time limit"
UNFINISHED = "started, did not finish"


def _failed(r: dict) -> bool:
    """The point broke the contract, or could not be measured for a reason other than time."""
    if r["error"] in (NOT_RUN, UNFINISHED):
        return False
    if r["error"] or r["measured_peak_mib"] is None:
        return True
    return r["within_budget"] is not True or not (r["grad_rel_err"] is not None and r["grad_rel_err"] < GRAD_TOL)


def exit_status(points: list[dict]) -> int:
    """0: every point measured and within the contract; 1: a point broke it (or failed);
    3: none broke it, but the time limit left some unmeasured."""
    if any(_failed(r) for r in points):
        return 1
    return 3 if any(r["error"] in (NOT_RUN, UNFINISHED) for r in points) else 0


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(msg, flush=True)

    os.makedirs(args.out_dir, exist_ok=True)
    size = MODELS["gpt"].sizes[args.size]
    machine = machine_line(args.device)
    header = [
        f"# Budget check, {args.device}",
        "",
        f"Machine: {machine}.",
        f"Model: GPT, {size.label}. Command: python benchmarks/budget_check.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "",
        "MiB = 2**20 bytes; peaks measured by fxmem.measure (one step inside it, after one step that "
        "compiles); step s: median of the timed steps; first call: planning, compilation (inductor's cache "
        "as found, not cleared: see benchmarks/run.py for cold-cache compile times) and one step.",
    ]
    log(header[2])
    log(header[3])

    allow_many_compiles()
    torch.manual_seed(0)
    model, batch = size.build()
    model.to(args.device).train()
    batch = tuple(v.to(args.device) for v in batch)
    runner = Runner(model, batch, args.device, log)

    rows: list[dict] = []

    def write(finished: bool = False) -> str:
        status = "finished" if finished else "running (a report left like this is from a run that was stopped)"
        meta = {"machine": machine, "torch": torch.__version__, "model": size.label, "finished": finished}
        with open(os.path.join(args.out_dir, "budget_check.json"), "w") as fh:
            json.dump({**meta, "rows": rows}, fh, indent=1)
        report = _markdown(rows, header, status)
        with open(os.path.join(args.out_dir, "budget_check.md"), "w") as fh:
            fh.write(report)
        return report

    eager = Config("eager", "eager", call=lambda b: call_model(model, b))
    runner.warm_up(eager)
    grad_ref = runner.measure(eager, keep_grads=True) if eager.error is None else None
    for _ in range(args.steps):
        if eager.error is None:
            runner.time_step(eager)
    rows.append(_row(eager))
    write()
    if grad_ref is None:
        log(f"eager failed: {eager.error}")
        write(finished=True)
        return 1

    for passes, fraction in args.points:
        what = "at its floor" if fraction is None else f"{fraction:.0%} of eager's peak"
        name = f"fxmem{' remat only (passes=())' if passes == 'remat' else ''}, {what}"
        if args.time_limit is not None and time.perf_counter() - t0 > args.time_limit:
            log(f"time limit: {name} not started")
            rows.append(_row(Config(name, "fxmem", error=NOT_RUN)))
            write()
            continue
        rows.append(_row(Config(name, "fxmem", error=UNFINISHED)))  # replaced when the point ends
        write()
        if fraction is None:
            budget, why = floor_of(model, batch, PASS_SETS[passes])
            if budget is None:
                rows[-1] = _row(Config(name, "fxmem", error=f"no floor: {why}"))
                write()
                continue
        else:
            budget = int(eager.peak_bytes * fraction)
        if fraction is None:
            c = warm_up_at_floor(runner, model, budget, PASS_SETS[passes])
        else:
            c = fxmem_config(model, budget, PASS_SETS[passes], what)
            runner.warm_up(c)
        c.name = name
        if c.error is None and c.predicted_peak_bytes is None:
            c.error = "no fxmem plan was made (did Dynamo fall back to eager?)"
        if c.error is None:
            try:
                runner.measure(c, grad_ref=grad_ref)
                for _ in range(args.steps):
                    runner.time_step(c)
            except Exception as e:  # noqa: BLE001 - a failing point is a row, not a crash
                c.error = f"{type(e).__name__}: {e}"[:300]
                zero_grads(model)
        c.call = c.fxmem_module = None
        rows[-1] = r = _row(c)
        write()
        log(
            f"  {name}: measured {_f(r['measured_peak_mib'], '.1f')} MiB of {_f(r['budget_mib'], '.1f')}, "
            f"predicted {_f(r['predicted_peak_mib'], '.1f')}, gradients' relative error {_f(r['grad_rel_err'], '.1e')}"
            + (f"; {r['error']}" if r["error"] else "")
        )
        free_memory(args.device)

    print(write(finished=True), flush=True)
    log(f"written to {args.out_dir}; {time.perf_counter() - t0:.0f} s")
    return exit_status(rows[1:])


if __name__ == "__main__":
    sys.exit(main())

"""Side-by-side memory/time benchmark of a GPT training step on CPU.

    python benchmarks/gpt.py [--quick] [--steps N] [--out benchmarks/RESULTS-gpt.md]

Configurations, all in one process and all from one set of weights:

* eager
* eager + torch.utils.checkpoint around every block (use_reentrant=False)
* torch.compile (inductor)
* torch.compile with torch._functorch.config.activation_memory_budget 0.5, 0.2, 0.05
* fxmem (inductor), unconstrained and at 80%, 60%, 50%, 40% of eager's measured peak

Each configuration gets one warm-up step (compilation included, timed as "first call"),
then N measured steps, each one forward + backward inside `fxmem.measure`, with the
gradients set to None between steps outside the measured call. The table reports the
largest measured peak and the median step time (which, on CPU, includes the profiler's
per-op overhead that `fxmem.measure` needs). Gradients are checked once per
configuration against eager's.

The reference weights and eager's gradients are kept as numpy copies, so that no extra
torch tensor is alive (and counted by `fxmem.measure`) while another configuration runs.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import types
import warnings
from dataclasses import dataclass, field

# A cold, private inductor cache, so that "first call" includes real compilation (and is not a
# hit from an earlier run of this script). --warm-cache keeps the usual cache.
if "--warm-cache" not in sys.argv and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _CACHE_DIR = tempfile.mkdtemp(prefix="fxmem-bench-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _CACHE_DIR
    atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)

import numpy as np
import torch
import torch.utils.checkpoint

import fxmem
from fxmem.testing import GPT, Block, GPTConfig, gpt_batch

MiB = 2**20
GiB = 2**30
HUGE_BUDGET_GB = 1024.0  # "unconstrained"
FRACTIONS = (0.8, 0.6, 0.5, 0.4)
AMB_VALUES = (0.5, 0.2, 0.05)


# -- setup ---------------------------------------------------------------------------------
@dataclass
class Setup:
    cfg: GPTConfig
    batch: int
    seq: int
    steps: int


FULL = Setup(GPTConfig(), batch=4, seq=512, steps=5)
QUICK = Setup(GPTConfig(vocab_size=2048, block_size=256, n_layer=2, n_head=4, n_embd=128), batch=2, seq=256, steps=5)


@dataclass
class Row:
    name: str
    budget_bytes: int | None = None
    peak_bytes: int | None = None
    entry_bytes: int | None = None
    step_s: float | None = None
    first_s: float | None = None
    planning_s: float | None = None
    grad_err: float | None = None
    kind: str = "other"  # eager | ckpt | compile | amb | fxmem
    amb: float | None = None
    floor_bytes: int | None = None  # BudgetError: no row, only this
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def over_budget(self) -> bool:
        return self.budget_bytes is not None and self.peak_bytes is not None and self.peak_bytes > self.budget_bytes

    @property
    def ok(self) -> bool:
        return self.peak_bytes is not None and self.error is None


def machine_line() -> str:
    cpu = platform.processor()
    if not cpu:
        try:
            with open("/proc/cpuinfo") as f:
                cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
        except OSError:
            cpu = ""
    cpu = cpu or platform.machine()
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return (
        f"Machine: {cpu} / nproc {os.cpu_count()} (torch threads {torch.get_num_threads()}), "
        f"{platform.system()} {platform.release()}; torch {torch.__version__}; "
        f"python {platform.python_version()}; {now}"
    )


# -- helpers -------------------------------------------------------------------------------
def to_numpy_state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def fresh_model(setup: Setup, weights: dict[str, np.ndarray]) -> GPT:
    model = GPT(setup.cfg)
    with torch.no_grad():
        sd = model.state_dict()
        for k, v in weights.items():
            sd[k].copy_(torch.from_numpy(v))
    model.train()
    return model


def grads_numpy(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


def max_rel_err(model: torch.nn.Module, ref: dict[str, np.ndarray]) -> float:
    got = dict(model.named_parameters())
    missing = sorted(k for k in ref if got.get(k) is None or got[k].grad is None)
    if missing:
        raise RuntimeError(f"no gradient for {missing[:5]}{'...' if len(missing) > 5 else ''}")
    errs = []
    for k, r in ref.items():
        g = got[k].grad.detach().double().numpy()
        r64 = r.astype(np.float64)
        errs.append(float(np.linalg.norm(g - r64) / max(np.linalg.norm(r64), 1e-12)))
    return max(errs)


def zero_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def free_all() -> None:
    torch._dynamo.reset()
    gc.collect()


def checkpointed_forward(self: Block, x: torch.Tensor) -> torch.Tensor:
    return torch.utils.checkpoint.checkpoint(Block.forward, self, x, use_reentrant=False)


def add_checkpointing(model: GPT) -> GPT:
    """Checkpoint every block: same modules, same parameter names, same weights."""
    for block in model.h:
        block.forward = types.MethodType(checkpointed_forward, block)
    return model


def run_config(
    row: Row,
    model: torch.nn.Module,
    runner,
    batch: tuple[torch.Tensor, torch.Tensor],
    steps: int,
    ref_grads: dict[str, np.ndarray] | None,
    fxmem_module=None,
) -> dict[str, np.ndarray] | None:
    """Warm up (timed), then `steps` measured steps. Returns eager-style grads if ref_grads is None."""
    idx, targets = batch

    def step_fn():
        loss = runner(idx, targets)
        loss.backward()
        return loss.detach()

    zero_grads(model)
    t0 = time.perf_counter()
    step_fn()  # compile (if any) + first step
    row.first_s = time.perf_counter() - t0
    if fxmem_module is not None and fxmem_module.plan is not None:
        plan = fxmem_module.plan
        row.planning_s = plan.planning_s
        row.notes.append(
            f"plan: predicted peak {plan.predicted_peak_bytes / MiB:.1f} MiB, floor {plan.floor_bytes / MiB:.1f} MiB, "
            f"unconstrained {plan.unconstrained_peak_bytes / MiB:.1f} MiB, recomputed {len(plan.recomputed)} "
            f"({sum(d.nbytes for d in plan.recomputed) / MiB:.1f} MiB, +{plan.added_time_s * 1e3:.0f} ms est.), "
            f"planning {plan.planning_s:.2f} s, {len(fxmem_module.plans)} plan(s)"
        )
    zero_grads(model)

    peaks, times, entries = [], [], []
    out_grads = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps):
            m = fxmem.measure(step_fn)
            peaks.append(m.peak_bytes)
            entries.append(m.entry_bytes)
            times.append(m.seconds)
            if i == 0:
                if ref_grads is None:
                    out_grads = grads_numpy(model)
                    row.grad_err = 0.0
                else:
                    row.grad_err = max_rel_err(model, ref_grads)
            del m
            zero_grads(model)
    for w in caught:
        msg = str(w.message)
        if "fxmem.measure" in msg:
            row.notes.append("measure warning: " + msg.split(";")[0])
    if fxmem_module is not None and len(fxmem_module.plans) > 1:
        row.notes.append(f"WARNING: {len(fxmem_module.plans)} plans were made (re-planning during measured steps)")
    row.peak_bytes = max(peaks)
    row.entry_bytes = max(entries)
    row.step_s = statistics.median(times)
    row.notes.append(
        "step s: " + ", ".join(f"{t:.3f}" for t in times) + "; peak MiB: " + ", ".join(f"{p / MiB:.1f}" for p in peaks)
    )
    if min(entries) != max(entries):
        row.notes.append(f"entry bytes varied across steps: {min(entries)}..{max(entries)}")
    return out_grads


# -- the configurations -----------------------------------------------------------------------
def bench(setup: Setup, log) -> tuple[list[Row], Row]:
    torch.manual_seed(0)
    weights = to_numpy_state(GPT(setup.cfg))
    gc.collect()
    batch = gpt_batch(setup.cfg, setup.batch, setup.seq)
    rows: list[Row] = []

    def done(row: Row) -> None:
        rows.append(row)
        if row.floor_bytes is not None:
            log(f"  -> BudgetError: floor {row.floor_bytes / MiB:.1f} MiB (budget {row.budget_bytes / MiB:.1f} MiB)")
        elif row.error:
            log(f"  -> ERROR {row.error}")
        else:
            extra = f", plan {row.planning_s:.2f}s" if row.planning_s is not None else ""
            log(
                f"  -> peak {row.peak_bytes / MiB:.1f} MiB (entry {row.entry_bytes / MiB:.1f}), "
                f"step {row.step_s:.3f}s, first {row.first_s:.1f}s{extra}, grad err {row.grad_err:.2e}"
                + ("  OVER BUDGET" if row.over_budget else "")
            )
        for n in row.notes:
            log(f"     {n}")

    # eager: the reference for gradients, peaks and budgets
    log("[eager]")
    free_all()
    row = Row("eager", kind="eager")
    model = fresh_model(setup, weights)
    ref_grads = run_config(row, model, model, batch, setup.steps, None)
    del model
    free_all()
    done(row)
    eager = row

    # eager + checkpoint per block
    log("[eager + checkpoint]")
    row = Row("eager + checkpoint(every block)", kind="ckpt")
    try:
        model = add_checkpointing(fresh_model(setup, weights))
        run_config(row, model, model, batch, setup.steps, ref_grads)
    except Exception as e:  # noqa: BLE001
        row.error = f"{type(e).__name__}: {e}"
    model = None
    free_all()
    done(row)

    # torch.compile, default and with activation_memory_budget
    for amb in (None, *AMB_VALUES):
        name = "torch.compile" if amb is None else f"torch.compile, activation_memory_budget={amb}"
        log(f"[{name}]")
        row = Row(name, kind="compile" if amb is None else "amb", amb=amb)
        model = compiled = None
        try:
            model = fresh_model(setup, weights)
            patch = torch._functorch.config.patch(activation_memory_budget=1.0 if amb is None else amb)
            # Held over the measured steps too, so that a recompile (there should be none) would
            # see the same setting.
            with patch:
                compiled = torch.compile(model)
                run_config(row, model, compiled, batch, setup.steps, ref_grads)
        except Exception as e:  # noqa: BLE001
            row.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        del model, compiled
        free_all()
        done(row)

    # fxmem
    budgets: list[tuple[str, float, int | None]] = [("fxmem unconstrained", HUGE_BUDGET_GB, None)]
    for frac in FRACTIONS:
        b = int(frac * eager.peak_bytes)
        budgets.append((f"fxmem {int(frac * 100)}% of eager", b / GiB, b))
    for name, budget_gb, budget_bytes in budgets:
        log(f"[{name}]")
        row = Row(name, budget_bytes=budget_bytes, kind="fxmem")
        model = m = None
        try:
            model = fresh_model(setup, weights)
            m = fxmem.optimize(model, budget_gb, compiler="inductor")
            run_config(row, model, m, batch, setup.steps, ref_grads, fxmem_module=m)
        except fxmem.BudgetError as e:
            row.floor_bytes = e.floor_bytes
        except Exception as e:  # noqa: BLE001
            row.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        del model, m
        free_all()
        done(row)

    return rows, eager


# -- report -------------------------------------------------------------------------------------
def fmt_mib(n: int | None) -> str:
    return "—" if n is None else f"{n / MiB:.1f}"


def render(setup: Setup, rows: list[Row], eager: Row, wall_s: float) -> str:
    cfg = setup.cfg
    lines = [
        f"# fxmem GPT benchmark{' (--quick)' if setup is QUICK else ''}",
        "",
        machine_line(),
        "",
        f"GPT: {cfg.n_layer} layers, {cfg.n_head} heads, d{cfg.n_embd}, vocab {cfg.vocab_size}, "
        f"block {cfg.block_size}, dropout {cfg.dropout}; batch {setup.batch} x {setup.seq} tokens, fp32, CPU. "
        f"{setup.steps} measured steps per config (forward + backward in `fxmem.measure`, grads set to None "
        f"between steps); peak = max over steps, step = median (includes profiler overhead). "
        f"First call = compile + first step"
        f"{' (cold inductor cache)' if 'TORCHINDUCTOR_CACHE_DIR' in os.environ and '--warm-cache' not in sys.argv else ''}"
        f"; plan = fxmem's plan.planning_s. MiB = 2**20 bytes.",
        "",
        "| config | budget MiB | measured peak MiB | median step s | step vs eager | first call s | max grad rel err |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for r in rows:
        if r.floor_bytes is not None:
            notes.append(
                f"- {r.name}: budget {fmt_mib(r.budget_bytes)} MiB -> BudgetError, "
                f"floor {r.floor_bytes / MiB:.1f} MiB (no row)"
            )
            continue
        if r.error:
            notes.append(f"- {r.name}: ERROR {r.error} (no row)")
            continue
        peak = fmt_mib(r.peak_bytes) + (" **OVER BUDGET**" if r.over_budget else "")
        first = f"{r.first_s:.2f}"
        if r.planning_s is not None:
            first += f" (plan {r.planning_s:.2f})"
        budget = "∞" if (r.kind == "fxmem" and r.budget_bytes is None) else fmt_mib(r.budget_bytes)
        if r.kind != "fxmem":
            budget = "—"
        lines.append(
            f"| {r.name} | {budget} | {peak} | {r.step_s:.3f} | {r.step_s / eager.step_s:.2f}x | {first} | "
            f"{r.grad_err:.1e} |"
        )
        for n in r.notes:
            notes.append(f"- {r.name}: {n}")
    lines.append("")
    lines.append(f"Entry (params + buffers + batch) measured at {fmt_mib(eager.entry_bytes)} MiB for eager.")
    if notes:
        lines += ["", "Notes:", *notes]

    # goal checks
    lines += ["", "Goal checks:"]
    by = {r.name: r for r in rows}
    f60, free = by.get("fxmem 60% of eager"), by.get("fxmem unconstrained")
    if f60 and free and f60.ok and free.ok:
        ratio = f60.step_s / free.step_s
        lines.append(
            f"- (a) fxmem 60% step / fxmem unconstrained step = {f60.step_s:.3f} / {free.step_s:.3f} = "
            f"{ratio:.3f} (goal <= 1.10: {'PASS' if ratio <= 1.10 else 'FAIL'})"
        )
    else:
        why = "no 60% row" if not (f60 and f60.ok) else "no unconstrained row"
        lines.append(f"- (a) not evaluable: {why}")
    fx_rows = [r for r in rows if r.kind == "fxmem" and r.ok]
    for a in (r for r in rows if r.kind == "amb"):
        if not a.ok:
            lines.append(f"- (b) {a.name}: no measurement ({a.error})")
            continue
        fits = [r for r in fx_rows if r.peak_bytes <= a.peak_bytes]
        if not fits:
            lines.append(
                f"- (b) {a.name} (peak {fmt_mib(a.peak_bytes)} MiB, step {a.step_s:.3f} s): "
                f"no fxmem row with measured peak <= it -> fxmem NOT faster (no fxmem plan reached that peak)"
            )
            continue
        best = min(fits, key=lambda r: r.step_s)
        faster = best.step_s < a.step_s
        lines.append(
            f"- (b) {a.name} (peak {fmt_mib(a.peak_bytes)} MiB, step {a.step_s:.3f} s): fastest fxmem row with "
            f"peak <= it is '{best.name}' (peak {fmt_mib(best.peak_bytes)} MiB, step {best.step_s:.3f} s) -> "
            f"fxmem {'FASTER' if faster else 'NOT faster'} ({best.step_s / a.step_s:.2f}x)"
        )
    lines += ["", f"Total benchmark wall time: {wall_s:.0f} s."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small GPT for a fast smoke run")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per configuration (>= 5)")
    ap.add_argument("--out", default=None, help="also write the markdown report to this file")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on this 2-vCPU VM two threads were both slower and "
        "far noisier, with 10-40x step-time outliers; 0 keeps torch's default)",
    )
    ap.add_argument("--warm-cache", action="store_true", help="use the usual inductor cache instead of a cold one")
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    setup = QUICK if args.quick else FULL
    if args.steps is not None:
        if args.steps < 1:
            ap.error("--steps must be >= 1")
        setup.steps = args.steps

    def log(msg: str) -> None:
        print(msg, flush=True)

    log(machine_line())
    t0 = time.perf_counter()
    rows, eager = bench(setup, log)
    report = render(setup, rows, eager, time.perf_counter() - t0)
    print()
    print(report, end="", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(report)
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Turn measured configurations into the markdown report, the goal checks, JSON and Pareto plots."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from benchmarks._records import Config, MiB, Result

__all__ = ["GoalCheck", "goal_checks", "plot_pareto", "render_model", "summary_table", "to_json"]


def _mib(n: int | None) -> str:
    return "—" if n is None else f"{n / MiB:.1f}"


# -- goal checks -----------------------------------------------------------------------------------
@dataclass
class GoalCheck:
    """At one fxmem budget: the fastest anchor whose measured peak fits, and who is faster."""

    config: Config
    anchor: Config | None  # None: no anchor's measured peak is within this budget

    @property
    def ratio(self) -> float | None:
        return None if self.anchor is None else self.config.step_s / self.anchor.step_s

    @property
    def met(self) -> bool:
        return self.anchor is None or self.ratio <= 1.0


def goal_checks(result: Result) -> tuple[list[GoalCheck], tuple[int, int, Config, Config] | None]:
    """Per fxmem point (default passes) the speed check; and (fxmem's lowest measured peak within
    its budget, in any of its configurations; the lowest anchor peak; that anchor; that fxmem
    configuration)."""
    anchors = result.anchors()
    checks = []
    for c in result.fxmem():
        limit = math.inf if c.budget_bytes is None else c.budget_bytes
        fits = [a for a in anchors if a.peak_bytes <= limit]
        checks.append(GoalCheck(c, min(fits, key=lambda a: a.step_s) if fits else None))
    floor = None
    floor_points = [c for c in result.fxmem() + result.fxmem("fxmem-sliced") if "at its floor" in c.name]
    if result.cut_short and not floor_points:
        return checks, None  # what was measured is not fxmem's floor
    if anchors and result.fxmem():
        lowest = min(anchors, key=lambda a: a.peak_bytes)
        fits = [c for c in result.fxmem() + result.fxmem("fxmem-sliced") if not c.over_budget]
        best = min(fits or result.fxmem(), key=lambda c: c.peak_bytes)
        floor = (best.peak_bytes, lowest.peak_bytes, lowest, best)
    return checks, floor


# -- markdown --------------------------------------------------------------------------------------
def _sliced_mark(c: Config) -> str:
    return ', compiler="eager" + microbatch_blocks' if c.kind == "fxmem-sliced" else ""


def _row(c: Config, base: Config | None) -> str:
    if c.na:
        return f"| {c.name} | — | n/a | n/a | | | | |"
    if not c.ok:
        return f"| {c.name} | {_mib(c.budget_bytes)} | error (see notes) | | | | | |"
    if c.kind.startswith("fxmem"):
        budget = "∞" if c.budget_bytes is None else _mib(c.budget_bytes)
    else:
        budget = "—"
    peak = _mib(c.peak_bytes) + (" **OVER BUDGET**" if c.over_budget else "")
    rel = f"{c.step_s / base.step_s:.2f}x" if base is not None and base.ok else ""
    plan = "" if c.planning_s is None else f"{c.planning_s:.2f}"
    if c.grad_err is None:
        err = c.grad_ref or ""
    else:
        err = f"{c.grad_err:.1e}" + ("" if c.grad_ref == "eager" else f" ({c.grad_ref})")
    return f"| {c.name} | {budget} | {peak} | {c.step_s:.3f} | {rel} | {c.first_s:.1f} | {plan} | {err} |"


def render_model(result: Result, png_name: str | None) -> str:
    configs = result.configs
    base = next((c for c in configs if c.kind == "compile"), None)
    lines = [
        f"## {result.spec.name}",
        "",
        f"{result.spec.description}. {result.size_label}. Measured in {result.wall_s:.0f} s.",
        "",
        "| configuration | budget MiB | measured peak MiB | median step s | vs torch.compile | first call s | "
        "planning s | grad rel err |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_row(c, base) for c in configs]
    if result.cut_short:
        lines += ["", f"**Cut short by the time limit.** Not run: {', '.join(result.cut_short)}."]
    if result.rounds < result.rounds_wanted:
        lines += [
            "",
            f"**Timed rounds ended by the time limit:** {result.rounds} of {result.rounds_wanted}; "
            f"each median is of {result.rounds} steps.",
        ]
    entry = next((c.entries[0] for c in configs if c.entries), None)
    lines += ["", f"Alive at entry (parameters, buffers, batch): {_mib(entry)} MiB."]
    if result.fxmem_floor_bytes is not None:
        lines[-1] += f" fxmem's planned floor: {_mib(result.fxmem_floor_bytes)} MiB."
    rewrites = {k: v for c in result.fxmem() for k, v in c.rewrites.items()}
    lines[-1] += f" Passes that fired: {', '.join(f'{k} x{v}' for k, v in rewrites.items()) or 'none'}."

    checks, floor = goal_checks(result)
    lines += ["", "Goal checks:"]
    for g in checks:
        c = g.config
        budget = "no budget" if c.budget_bytes is None else f"budget {_mib(c.budget_bytes)} MiB"
        if g.anchor is None:
            lines.append(f"- {c.name} ({budget}): no anchor's measured peak fits — fxmem alone reaches it")
        else:
            verdict = "ahead" if g.ratio <= 1.0 else "**behind**"
            lines.append(
                f"- {c.name} ({budget}): fastest anchor that fits is {g.anchor.name} "
                f"({_mib(g.anchor.peak_bytes)} MiB, {g.anchor.step_s:.3f} s); fxmem {c.step_s:.3f} s = "
                f"{g.ratio:.2f}x, {verdict}"
            )
    if floor is None and result.cut_short:
        lines.append("- floor: not measured (the time limit cut the run short)")
    elif floor is not None:
        fx_floor, low, who, best = floor
        verdict = "met" if fx_floor <= low / 2 else "**not met**"
        lines.append(
            f"- floor: fxmem's lowest measured peak within its budget {_mib(fx_floor)} MiB ({best.name}) vs half "
            f"the lowest anchor peak ({who.name}, {_mib(low)} MiB → {_mib(low // 2)} MiB): {fx_floor / low:.2f}x "
            f"that anchor's peak (goal ≤ 0.50x), {verdict}"
        )
    free = next((c for c in result.fxmem() if c.budget_bytes is None), None)
    for c in result.fxmem():
        if "of eager's peak" in c.name and free is not None:
            ratio = c.step_s / free.step_s
            verdict = "met" if ratio <= 1.10 else "**not met**"
            lines.append(f"- {c.name}: step {ratio:.2f}x fxmem's unconstrained step (goal ≤ 1.10x), {verdict}")
    if free is not None:
        lines += [f"- {free.name}: {n}, so that budget runs this same plan" for n in free.notes if "of eager's" in n]
    over = [c for c in configs if c.over_budget]
    lines.append(
        "- budgets: "
        + ("every fxmem point's measured peak is within its budget" if not over else "**OVER BUDGET**: ")
        + ", ".join(c.name for c in over)
    )

    notes = []
    for c in configs:
        if c.na:
            notes.append(f"- {c.name}: n/a — {c.na}")
        if c.error:
            notes.append(f"- {c.name}: {c.error}")
        if c.times:
            spread = f"{min(c.times):.3f}–{max(c.times):.3f}"
            prof = f"; under the profiler {sorted(c.profiled_times)[len(c.profiled_times) // 2]:.3f} s"
            pred = f"; predicted peak {_mib(c.predicted_peak_bytes)} MiB" if c.predicted_peak_bytes else ""
            notes.append(f"- {c.name}: steps {spread} s{prof}{pred}")
        notes += [f"- {c.name}: {n}" for n in c.notes]
    if notes:
        lines += ["", "<details><summary>per-configuration notes</summary>", "", *notes, "", "</details>"]
    if png_name:
        lines += ["", f"![{result.spec.name} memory–time Pareto]({png_name})"]
    return "\n".join(lines) + "\n"


def summary_table(results: list[Result]) -> str:
    lines = [
        "| model | fastest anchor (peak MiB, step s) | lowest anchor peak MiB | fxmem floor, measured MiB | "
        "fxmem ≤ fastest fitting anchor | fxmem unconstrained vs torch.compile | gradients (rel err > 1e-4) |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        anchors = r.anchors()
        checks, floor = goal_checks(r)
        comp = next((c for c in r.configs if c.kind == "compile" and c.ok), None)
        free = next((c for c in r.fxmem() if c.budget_bytes is None), None)
        if not anchors or (floor is None and not r.cut_short):
            lines.append(f"| {r.spec.name} | no measurement | | | | | |")
            continue
        fast = min(anchors, key=lambda a: a.step_s)
        met = sum(g.met for g in checks)
        vs = f"{free.step_s / comp.step_s:.2f}x" if free and comp else "—"
        bad = [f"{c.name} {c.grad_err:.1e}" for c in r.configs if c.grad_err is not None and c.grad_err > 1e-4]
        grads = "; ".join(bad) if bad else "all match their reference"
        if floor is None:
            lowest = min(anchors, key=lambda a: a.peak_bytes)
            low, fx_floor = f"{_mib(lowest.peak_bytes)} ({lowest.name})", "not measured (time limit)"
        else:
            low = f"{_mib(floor[1])} ({floor[2].name})"
            fx_floor = f"{_mib(floor[0])} ({floor[0] / floor[1]:.2f}x{_sliced_mark(floor[3])})"
        cut = " (cut short)" if r.cut_short or r.rounds < r.rounds_wanted else ""
        lines.append(
            f"| {r.spec.name}{cut} | {fast.name} ({_mib(fast.peak_bytes)}, {fast.step_s:.3f}) | {low} | {fx_floor} | "
            f"{met} of {len(checks)} budgets | {vs} | {grads} |"
        )
    return "\n".join(lines) + "\n"


def to_json(results: list[Result], meta: dict) -> str:
    out = {"meta": meta, "models": []}
    for r in results:
        out["models"].append(
            {
                "model": r.spec.name,
                "size": r.size_label,
                "wall_s": r.wall_s,
                "fxmem_floor_bytes": r.fxmem_floor_bytes,
                "cut_short": r.cut_short,
                "timed_rounds": r.rounds,
                "configs": [
                    {
                        "name": c.name,
                        "kind": c.kind,
                        "budget_bytes": c.budget_bytes,
                        "amb": c.amb,
                        "peak_bytes": c.peak_bytes,
                        "entry_bytes": c.entries[0] if c.entries else None,
                        "median_step_s": c.step_s,
                        "step_s": c.times,
                        "profiled_step_s": c.profiled_times,
                        "first_call_s": c.first_s,
                        "planning_s": c.planning_s,
                        "plan_floor_bytes": c.plan_floor_bytes,
                        "predicted_peak_bytes": c.predicted_peak_bytes,
                        "grad_rel_err": c.grad_err,
                        "grad_ref": c.grad_ref,
                        "rewrites": c.rewrites,
                        "error": c.error,
                        "na": c.na,
                        "notes": c.notes,
                    }
                    for c in r.configs
                ],
            }
        )
    return json.dumps(out, indent=1) + "\n"


# -- the plot --------------------------------------------------------------------------------------
_STYLE = {  # kind -> (label, marker, colour)
    "eager": ("eager", "o", "tab:gray"),
    "ckpt": ("eager + checkpoint every block", "s", "tab:brown"),
    "offload": ("eager + save_on_cpu", "D", "tab:purple"),
    "compile": ("torch.compile", "^", "tab:blue"),
    "amb": ("torch.compile + activation_memory_budget", "v", "tab:cyan"),
    "fxmem": ("fxmem (budget sweep)", "*", "tab:red"),
    "fxmem-remat": ("fxmem remat only (passes=())", "P", "tab:orange"),
    "fxmem-sliced": ('fxmem compiler="eager" + microbatch_blocks', "X", "tab:green"),
}


def plot_pareto(result: Result, path: str, title_suffix: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.2), dpi=110)
    for kind, (label, marker, colour) in _STYLE.items():
        pts = sorted((c for c in result.configs if c.kind == kind and c.ok), key=lambda c: c.peak_bytes)
        if not pts:
            continue
        xs = [c.peak_bytes / MiB for c in pts]
        ys = [c.step_s for c in pts]
        line = "-" if kind.startswith("fxmem") else "none"
        size = 14 if marker == "*" else 8
        ax.plot(xs, ys, linestyle=line, marker=marker, color=colour, label=label, markersize=size, linewidth=1.5)
        for c, x, y in zip(pts, xs, ys, strict=True):
            if kind == "amb":
                ax.annotate(f"{c.amb}", (x, y), textcoords="offset points", xytext=(5, -10), fontsize=7, color=colour)
            if kind.startswith("fxmem") and c.budget_bytes is not None:
                b = c.budget_bytes / MiB
                # the budget: a hollow marker at (budget, step), joined to the measured point
                ax.plot([x, b], [y, y], ":", color=colour, linewidth=1)
                ax.plot([b], [y], "|", color=colour, markersize=12, markeredgewidth=2)
    anchors = result.anchors()
    if anchors:
        half = min(a.peak_bytes for a in anchors) / 2 / MiB
        ax.axvline(half, color="black", linestyle="--", linewidth=0.8)
        ax.annotate(
            "half the lowest anchor peak",
            (half, 1),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
        )
    ax.plot([], [], "|", color="tab:red", markersize=12, markeredgewidth=2, label="fxmem budget (joined to its point)")
    ax.set_xlabel("measured peak memory, MiB (fxmem.measure)")
    ax.set_ylabel("median step time, s (forward + backward)")
    ax.set_title(f"{result.spec.name}: memory vs time{title_suffix}", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.text(0.01, 0.01, result.size_label, fontsize=6, color="dimgray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)
    plt.close(fig)

"""The files `Plan.save` writes beside `plan.json`, each drawn from the plan alone.

* `timeline.png`: predicted memory over the step, stacked by category, with the budget and,
  when a measured run was attached (`measure_plan`), the measured curve.
* `graph.dot` (and `graph.svg` when Graphviz's `dot` is on PATH): the joint graph, coloured
  by decision.
* `memory_snapshot.pickle`: the predicted step as allocator events in the layout of
  `torch.cuda.memory._dump_snapshot`, built the way torch's profiler-to-snapshot helper
  (`torch.cuda._memory_viz._profile_to_snapshot`) builds synthetic ones, so
  https://pytorch.org/memory_viz opens it ("Active Memory Timeline"). This pickle holds only
  dicts, lists, strings and ints; fxmem itself never reads pickles.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pickle
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

from fxmem.plan import Plan, format_bytes
from fxmem.plan_record import category_curves, total_curve

__all__ = ["measure_plan", "snapshot", "write_graph_dot", "write_plan_files", "write_snapshot", "write_timeline_png"]

log = logging.getLogger("fxmem")

TIMELINE_PX = (1400, 700)
_DPI = 100
_CURVE_POINTS = 2000
_SVG_MAX_NODES = 3000  # Graphviz takes minutes beyond this; the .dot is always written

# One colour family per kind of memory: static in greys/blues, gradients purple, activations
# green, recomputation orange, temporaries yellow.
_COLOURS = {
    "parameters": "#5b7fa6",
    "inputs and buffers": "#9db7d5",
    "existing gradients": "#8e7cc3",
    "other live tensors": "#c7c7c7",
    "CUDA allocations outside tensors": "#a7a7a7",
    "earlier regions' activations": "#93c47d",
    "optimizer state": "#3d5a80",
    "gradients": "#b4a7d6",
    "saved activations": "#6aa84f",
    "outputs": "#76a5af",
    "recomputed": "#f6a04d",
    "temporaries": "#f1d26b",
}


def write_plan_files(plan: Plan, directory: str | os.PathLike) -> list[str]:
    """Write every picture and viewer file of `plan` into `directory`; returns their paths."""
    directory = os.fspath(directory)
    written = []
    if plan.timeline:
        if importlib.util.find_spec("matplotlib") is None:
            log.warning("fxmem: matplotlib is not installed, so timeline.png is not drawn")
        else:
            written.append(write_timeline_png(plan, os.path.join(directory, "timeline.png")))
        written.append(write_snapshot(plan, os.path.join(directory, "memory_snapshot.pickle")))
    if plan.graph:
        written += write_graph_dot(plan, os.path.join(directory, "graph.dot"))
    return written


# -- timeline.png -------------------------------------------------------------------------------
def _unit(max_bytes: float) -> tuple[str, float]:
    return ("GiB", 2**30) if max_bytes >= 2**30 else ("MiB", 2**20) if max_bytes >= 2**20 else ("KiB", 2**10)


def write_timeline_png(plan: Plan, path: str) -> str:
    # A Figure of its own on the Agg canvas: no pyplot state, no window, whatever backend the
    # user's session has.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tl = plan.timeline
    steps = tl["steps"]
    n = len(steps)
    layers = [(k, [v] * n) for k, v in tl["static"].items() if v > 0]
    total = total_curve(tl)
    curves = category_curves(tl)
    for k in [k for k in curves if k != "temporaries" and max(curves[k]) < 0.002 * max(total, default=1)]:
        # Too thin to see (the loss, say): counted with the temporaries rather than listed.
        tiny = curves.pop(k)
        curves["temporaries"] = [a + b for a, b in zip(curves.get("temporaries", [0] * n), tiny, strict=True)]
    layers += list(curves.items())
    peak_t = max(range(n), key=total.__getitem__) if n else 0
    top = max([*total, plan.measured.get("peak_bytes", 0), 1])
    name, scale = _unit(max(top, plan.budget_bytes or 0) if _budget_on_chart(plan, top) else top)

    fig = Figure(figsize=(TIMELINE_PX[0] / _DPI, TIMELINE_PX[1] / _DPI), dpi=_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = list(range(n))
    ax.stackplot(
        xs,
        *[[b / scale for b in ys] for _, ys in layers],
        labels=[f"{k}  ({format_bytes(ys[peak_t])} at peak)" for k, ys in layers],
        colors=[_COLOURS.get(k, "#bbbbbb") for k, _ in layers],
        step="post",
        alpha=0.95,
        linewidth=0,
    )
    ax.plot(xs, [b / scale for b in total], color="#333333", linewidth=0.8, drawstyle="steps-post")
    ax.annotate(
        f"predicted peak {format_bytes(total[peak_t])}\nat {steps[peak_t][0]} ({steps[peak_t][1]})",
        xy=(peak_t, total[peak_t] / scale),
        xytext=(0.5, 0.91),
        textcoords="axes fraction",
        ha="center",
        va="top",
        fontsize=10,
        arrowprops={"arrowstyle": "->", "color": "#333333"},
    )
    if plan.measured:
        _draw_measured(ax, plan.measured, n, scale)
    if plan.budget_bytes is not None:
        if _budget_on_chart(plan, top):
            ax.axhline(plan.budget_bytes / scale, color="#cc0000", linestyle="--", linewidth=1.5)
            ax.text(
                0.005, plan.budget_bytes / scale, f" budget {format_bytes(plan.budget_bytes)}",
                color="#cc0000", va="bottom", ha="left", transform=ax.get_yaxis_transform(), fontsize=10,
            )  # fmt: skip
        else:
            ax.text(
                0.995, 0.99, f"budget {format_bytes(plan.budget_bytes)} (far above this chart)",
                color="#cc0000", ha="right", va="top", transform=ax.transAxes, fontsize=10,
            )  # fmt: skip
    _draw_phases(ax, steps)
    ax.set_xlim(0, max(n, 1))
    shown = max(top, plan.budget_bytes) if _budget_on_chart(plan, top) else top
    ax.set_ylim(0, shown / scale * 1.18)  # room above for the phase names and the peak's note
    ax.set_xlabel("training step, one graph node at a time (run order)")
    ax.set_ylabel(f"device memory in use ({name})")
    budget = format_bytes(plan.budget_bytes) if plan.budget_bytes is not None else "none"
    ax.set_title(
        f"fxmem plan: predicted memory over one training step — budget {budget}, "
        f"peak {format_bytes(plan.predicted_peak_bytes)}, floor {format_bytes(plan.floor_bytes)}, "
        f"{len(plan.recomputed)} tensors recomputed",
        fontsize=11,
    )
    handles, labels = ax.get_legend_handles_labels()
    # Legend in stacking order, top layer first, outside the plot so it hides nothing.
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    fig.subplots_adjust(left=0.07, right=0.72, top=0.93, bottom=0.09)
    fig.savefig(path, dpi=_DPI)
    return path


def _budget_on_chart(plan: Plan, top: int) -> bool:
    return plan.budget_bytes is not None and plan.budget_bytes <= 2.5 * top


def _draw_phases(ax: Any, steps: list[list[str]]) -> None:
    """Shade the backward, and name each phase at the top of the plot."""
    spans: list[tuple[str, int, int]] = []
    for t, (_, phase) in enumerate(steps):
        label = {"fwd": "forward", "optimizer": "optimizer step"}.get(phase, "backward")
        if spans and spans[-1][0] == label:
            spans[-1] = (label, spans[-1][1], t + 1)
        else:
            spans.append((label, t, t + 1))
    for label, a, b in spans:
        if label != "forward":
            ax.axvspan(a, b, color="#000000", alpha=0.04, linewidth=0)
        ax.axvline(a, color="#777777", linewidth=0.6, linestyle=":")
        ax.text(
            (a + b) / 2, 0.985, label, transform=ax.get_xaxis_transform(),
            ha="center", va="top", fontsize=10, color="#555555", fontweight="bold",
        )  # fmt: skip
    recompute = [t for t, (_, phase) in enumerate(steps) if phase == "recompute"]
    if recompute:
        ax.plot(recompute, [0] * len(recompute), "|", color="#e06c00", markersize=8, label="recomputation runs here")


def _draw_measured(ax: Any, measured: dict, n: int, scale: float) -> None:
    curve = measured.get("curve") or []
    if len(curve) > 1:
        xs = [i * (n - 1) / (len(curve) - 1) for i in range(len(curve))]
        ax.plot(
            xs,
            [b / scale for b in curve],
            color="#000000",
            linewidth=1.2,
            label="measured (time stretched to the step)",
        )
    peak = measured.get("peak_bytes")
    if peak:
        ax.axhline(
            peak / scale, color="#000000", linestyle=":", linewidth=1.2, label=f"measured peak {format_bytes(peak)}"
        )


# -- measured curve -------------------------------------------------------------------------------
def measure_plan(plan: Plan, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run `fn(*args, **kwargs)` once, measured as `fxmem.measure` does, and attach the result to
    `plan.measured` (the peak; on CPU also the memory curve over the call), so `timeline.png`
    overlays it. Returns the `fxmem.Measurement`."""
    m = importlib.import_module("fxmem.measure")  # the module; `fxmem.measure` is its function

    if m._pick_device(fn, args, kwargs).type != "cpu":
        result = m.measure(fn, *args, **kwargs)
        plan.measured = {"peak_bytes": int(result.peak_bytes), "curve": []}
        return result
    call = m._profiled_cpu_call(fn, args, kwargs, stacklevel=3)
    curve = [call.entry_bytes + max(running, 0) for running in call.totals]
    stride = max(1, len(curve) // _CURVE_POINTS)
    curve = [max(curve[i : i + stride]) for i in range(0, len(curve), stride)]
    plan.measured = {"peak_bytes": call.peak_bytes, "curve": curve}
    return m.Measurement(call.peak_bytes, call.entry_bytes, call.seconds, m._CPU, call.result)


# -- memory_snapshot.pickle ---------------------------------------------------------------------
_BASE_ADDR = 0x7F0000000000
_ALIGN = 512


def snapshot(plan: Plan) -> dict:
    """The predicted step as a `torch.cuda.memory._snapshot()`-shaped dict (device 0).

    Static memory (parameters, optimizer state, ...) is allocated first, one block per
    category; then every allocation of the timeline, in run order, with frames naming the
    node, its op, module, source line and category. `time_us` holds the step index.
    Allocations alive at the end are the segment's active blocks, as in a real snapshot.
    """
    tl = plan.timeline
    nodes = {row[0]: row for row in plan.graph.get("nodes", [])}
    trace: list[dict] = []
    live: dict[int, dict] = {}
    next_addr = _BASE_ADDR

    def alloc(key: int, nbytes: int, frames: list[dict], step: int) -> None:
        nonlocal next_addr
        event = {"action": "alloc", "addr": next_addr, "size": nbytes, "stream": 0, "frames": frames, "time_us": step}
        trace.append(event)
        live[key] = event
        next_addr += -(-max(nbytes, 1) // _ALIGN) * _ALIGN

    for k, (category, nbytes) in enumerate(tl["static"].items()):
        if nbytes > 0:
            alloc(-1 - k, nbytes, [{"filename": "fxmem", "line": 0, "name": f"alive all step: {category}"}], 0)
    for step, a, nbytes in tl["events"]:
        if nbytes > 0:
            node, category = tl["allocations"][a]
            phase = tl["steps"][step][1]
            alloc(a, nbytes, _frames(nodes.get(node), node, category, phase, step), step)
        else:
            event = live.pop(a)
            for action in ("free_requested", "free_completed"):
                trace.append({**event, "action": action, "time_us": step})
    blocks, addr = [], _BASE_ADDR
    for event in sorted(live.values(), key=lambda e: e["addr"]):
        if event["addr"] > addr:
            blocks.append({"size": event["addr"] - addr, "state": "inactive", "requested_size": 0, "frames": []})
        size = -(-max(event["size"], 1) // _ALIGN) * _ALIGN
        blocks.append(
            {"size": size, "state": "active_allocated", "requested_size": event["size"], "frames": event["frames"]}
        )
        addr = event["addr"] + size
    if next_addr > addr:
        blocks.append({"size": next_addr - addr, "state": "inactive", "requested_size": 0, "frames": []})
    segment = {
        "device": 0,
        "address": _BASE_ADDR,
        "total_size": next_addr - _BASE_ADDR,
        "allocated_size": sum(b["requested_size"] for b in blocks if b["state"] == "active_allocated"),
        "active_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
        "requested_size": sum(b["requested_size"] for b in blocks),
        "stream": 0,
        "segment_type": "large",
        "blocks": blocks,
    }
    return {"segments": [segment], "device_traces": [trace]}


def _frames(row: list | None, node: str, category: str, phase: str, step: int) -> list[dict]:
    op, module, source = (row[1], row[5], row[6]) if row else ("", "", "")
    filename, _, line = source.rpartition(":") if source else ("<graph>", "", "0")
    frames = [{"filename": filename or source, "line": int(line) if line.isdigit() else 0, "name": module or node}]
    frames.append({"filename": "fxmem", "line": step, "name": f"{category}: {node} = {op} ({phase} step {step})"})
    return frames


def write_snapshot(plan: Plan, path: str) -> str:
    with open(path, "wb") as f:
        pickle.dump(snapshot(plan), f)
    return path


# -- graph.dot ----------------------------------------------------------------------------------
_NODE_STYLE = {
    "save": ("#b6d7a8", "saved for backward"),
    "recompute": ("#f9cb9c", "recomputed in backward"),
    "input": ("#cfe2f3", "input / parameter"),
    "tangent": ("#d9d2e9", "incoming gradient"),
    "fwd": ("#ffffff", "forward, not kept"),
    "bwd": ("#eeeeee", "backward"),
}


def _quote(text: str) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_graph_dot(plan: Plan, path: str) -> list[str]:
    """The joint graph as DOT, forward and backward in two clusters, nodes coloured by decision."""
    rows = plan.graph["nodes"]
    action = {d.name: d.action for d in plan.decisions}
    saved = set(plan.saved_nodes)
    lines = [
        "digraph fxmem_plan {",
        "  rankdir=TB; node [shape=box, style=filled, fontname=Helvetica, fontsize=9];",
        f"  label={_quote(_graph_title(plan))}; labelloc=t;",
    ]
    # Nodes carry their attributes at the top level (where every DOT reader finds them); the
    # clusters only group names, forward and backward.
    clusters: dict[str, list[str]] = {"forward": [], "backward": []}
    for name, op, phase, typ, _, module, _source in rows:
        style = action.get(name) or ("save" if name in saved and phase == "fwd" else phase)
        colour, meaning = _NODE_STYLE.get(style, _NODE_STYLE["fwd"])
        label = f"{name}\\n{op.replace('aten.', '')}\\n{typ}" + (f"\\n{module}" if module else "")
        lines.append(
            f"  {_quote(name)} [label={_quote(label)}, fillcolor={_quote(colour)}, tooltip={_quote(meaning)}];"
        )
        clusters["backward" if phase in ("bwd", "tangent") else "forward"].append(_quote(name))
    for k, (title, names) in enumerate(clusters.items()):
        lines.append(f"  subgraph cluster_{k} {{ label={_quote(title)}; {'; '.join(names)}; }}")
    for name, _, _, _, inputs, _, _ in rows:
        for j in inputs:
            lines.append(f"  {_quote(rows[j][0])} -> {_quote(name)};")
    lines += ["  subgraph cluster_legend {", '    label="colours"; rank=sink;']
    for k, (colour, meaning) in enumerate(_NODE_STYLE.values()):
        lines.append(f"    legend_{k} [label={_quote(meaning)}, fillcolor={_quote(colour)}];")
    lines += ["  }", "}"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    written = [path]
    dot = shutil.which("dot")
    if dot and len(rows) <= _SVG_MAX_NODES:
        svg = os.path.splitext(path)[0] + ".svg"
        try:
            subprocess.run([dot, "-Tsvg", path, "-o", svg], check=True, timeout=120, capture_output=True)
            written.append(svg)
        except (subprocess.SubprocessError, OSError):
            pass  # the .dot stays; Graphviz failing is not the plan's problem
    return written


def _graph_title(plan: Plan) -> str:
    return (
        f"fxmem plan: {len(plan.saved)} saved (green), {len(plan.recomputed)} recomputed (orange); "
        f"peak {format_bytes(plan.predicted_peak_bytes)}"
    )

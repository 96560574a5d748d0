"""What is alive at a CUDA step's measured peak, beside what the plan predicted alive at its own.

    python benchmarks/cuda_peak.py [--passes default|none] [--budget floor|unconstrained] [--model NAME]

The small GPT of tests/test_cuda.py (4 layers, d64, vocab 512, batch 4 x 256, fp32; or NAME,
a model of benchmarks/run.py at its CUDA size) under `fxmem.optimize` at its floor (default)
runs one step, keeping only the loss as the benchmark does (planned with `keep_outputs=False`),
with the CUDA allocator's history recorded (`torch.cuda.memory._record_memory_history`, Python stacks). The history is replayed
to the moment of its highest requested bytes (which `memory_stats()["requested_bytes.all.peak"]`
reads; `torch.cuda.max_memory_allocated()` counts the allocator's rounded blocks, both are
printed); the blocks the step allocated that are alive then are listed by the line that allocated them (in inductor's
generated code, that line names the buffer and the kernel or library call). Beside them: the
plan's predicted peak, its allocations alive there (from `plan.timeline`), and the workspaces
fxmem measured for library kernels. A difference between the two lists is what the plan
misses: the two lists are paired by size, and what is left unpaired on either side is listed
last. Prints a text report; needs CUDA.
"""

from __future__ import annotations

import argparse
import bisect
import linecache
import os
import sys
from collections import defaultdict
from typing import Any

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from fxmem.plan_record import alive_at_peak  # noqa: E402

__all__ = ["alive_at_measured_peak", "main", "unmatched"]

MiB = 2**20
_TOP = 25


def alive_at_measured_peak(trace: list[dict], entry: dict[int, int]) -> tuple[int, list[dict]]:
    """Replay one device's allocator trace (`torch.cuda.memory._snapshot()["device_traces"][i]`)
    as `fxmem.measure` counts allocations: the highest rise over where the trace began, and
    the trace's allocations alive at that moment. `entry`: the blocks alive before the trace
    (address -> bytes), whose frees in it lower the total. Sizes are as requested: the
    allocator's blocks, which `max_memory_allocated()` counts, are rounded up (to 512 bytes; a
    large block is not split for less than 1 MiB), so compare with
    `memory_stats()["requested_bytes.all.peak"]`."""
    from fxmem.measure import _running_totals

    allocs = [e for e in trace if e.get("action") in ("alloc", "free_requested")]
    events = [(0, e["addr"], e["size"] if e["action"] == "alloc" else -e["size"]) for e in allocs]
    made: dict[int, dict] = {}  # address -> the trace entry that allocated what lives there
    peak, at_peak = 0, []
    for e, (running, live) in zip(allocs, _running_totals(events, entry, set()), strict=True):
        if e["action"] == "alloc":
            made[e["addr"]] = e
        if running > peak:
            peak, at_peak = running, [made[a] for a in live]
    return peak, at_peak


def _alive_blocks(snapshot: dict, device: int) -> dict[int, int]:
    """Blocks allocated on `device` in an allocator snapshot: address -> requested bytes."""
    return {
        b["address"]: b.get("requested_size", b["size"])
        for seg in snapshot["segments"]
        if seg.get("device", device) == device
        for b in seg["blocks"]
        if b["state"] == "active_allocated"
    }


def _site(frames: list[dict]) -> str:
    """The line that asked for a block: the first frame in inductor's generated code, else the
    first outside torch."""
    for want in (lambda f: "torchinductor" in f, lambda f: "/torch/" not in f):
        for fr in frames:
            name = fr.get("filename", "")
            if name and want(name):
                text = linecache.getline(name, fr.get("line", 0)).strip()
                return f"{os.path.basename(name)}:{fr.get('line')} {text[:110]}"
    return "(C++ only)"


def unmatched(
    measured: list[tuple[int, str]], predicted: list[tuple[int, str]], slack: int = 512
) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """Pair each predicted allocation (bytes, label) with a measured block (requested bytes,
    label) of its size, up to `slack` bytes larger, largest first; return the measured blocks
    left unpaired (what the plan misses) and the predicted allocations left unpaired (what it
    counts that is not there)."""
    free = sorted(measured)
    extra: list[tuple[int, str]] = []
    for nbytes, label in sorted(predicted, reverse=True):
        k = bisect.bisect_left(free, (nbytes, ""))
        if k < len(free) and free[k][0] <= nbytes + slack:
            del free[k]
        else:
            extra.append((nbytes, label))
    return sorted(free, reverse=True), extra


def _report_measured(trace: list[dict], entry: dict[int, int]) -> tuple[int, list[tuple[int, str]]]:
    peak, blocks = alive_at_measured_peak(trace, entry)
    sites: dict[str, list[int]] = defaultdict(list)
    labelled = [(b["size"], _site(b.get("frames", []))) for b in blocks]
    for size, site in labelled:
        sites[site].append(size)
    print(f"measured: {peak / MiB:.3f} MiB allocated by the step at its peak, {len(blocks)} blocks")
    for site, sizes in sorted(sites.items(), key=lambda kv: -sum(kv[1]))[:_TOP]:
        print(f"  {sum(sizes) / MiB:9.3f} MiB  x{len(sizes):<3d} {site}")
    return peak, labelled


def _report_predicted(plan) -> tuple[int, list[tuple[int, str]]]:
    _, peak, rows = alive_at_peak(plan.timeline)
    print(f"predicted: {peak / MiB:.3f} MiB of dynamic bytes at the plan's peak, {len(rows)} allocations")
    for name, category, nbytes in rows[:_TOP]:
        print(f"  {nbytes / MiB:9.3f} MiB  {category:<18s} {name}")
    return peak, [(nbytes, f"{category} {name}") for name, category, nbytes in rows]


def _report_unmatched(measured: list[tuple[int, str]], predicted: list[tuple[int, str]]) -> None:
    missed, extra = unmatched(measured, predicted)
    for title, rows in (
        ("alive at the measured peak, not in the plan's", missed),
        ("in the plan's, not measured", extra),
    ):
        print(f"{title}: {sum(n for n, _ in rows) / MiB:.3f} MiB in {len(rows)}")
        for nbytes, label in rows[:_TOP]:
            print(f"  {nbytes / MiB:9.3f} MiB  {label}")


_TEST_GPT = "test-gpt"


def _build(name: str, ap: argparse.ArgumentParser) -> tuple[torch.nn.Module, Any]:
    """The model and batch on the GPU: the small GPT of tests/test_cuda.py, or a benchmark model at
    its CUDA size."""
    from benchmarks._harness import to_device
    from benchmarks._models import MODELS

    if name == _TEST_GPT:
        from fxmem.testing import GPT, GPTConfig, gpt_batch

        cfg = GPTConfig(vocab_size=512, block_size=256, n_layer=4, n_head=4, n_embd=64)
        model, batch = GPT(cfg), gpt_batch(cfg, 4, 256)
    elif name in MODELS and "cuda" in MODELS[name].sizes:
        model, batch = MODELS[name].sizes["cuda"].build()
    else:
        cuda = [n for n, spec in MODELS.items() if "cuda" in spec.sizes]
        ap.error(f"--model {name!r}: not {_TEST_GPT} or one of {', '.join(cuda)}")
    return model, to_device(model, batch, "cuda")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", choices=("default", "none"), default="default")
    ap.add_argument("--budget", choices=("floor", "unconstrained"), default="floor")
    ap.add_argument("--model", default=_TEST_GPT, help=f"{_TEST_GPT} or a model of benchmarks/run.py")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")

    import fxmem
    from benchmarks._harness import KEEP_OUTPUTS, floor_of, train_step, zero_grads
    from fxmem import probe

    passes = None if args.passes == "default" else ()
    torch.manual_seed(0)
    model, batch = _build(args.model, ap)

    def step(module):
        train_step(module, batch)

    step(model)  # cuBLAS's workspaces exist from here on
    zero_grads(model)
    budget_gb = 1024.0  # unconstrained
    if args.budget == "floor":
        floor, why = floor_of(model, batch, passes)
        if floor is None:
            raise SystemExit(f"no floor to run at: {why}")
        budget_gb = (floor + 0.5) / 2**30
    try:
        m = fxmem.optimize(model, budget_gb, example_inputs=batch, passes=passes, keep_outputs=KEEP_OUTPUTS)
    except fxmem.BudgetError as e:  # what the floor search left cached counts now: its floor
        if args.budget != "floor" or e.floor_bytes is None:
            raise
        print(f"the floor found first ({budget_gb * 1024:.1f} MiB) was refused; at {e.floor_bytes / MiB:.1f}")
        m = fxmem.optimize(
            model, (e.floor_bytes + 0.5) / 2**30, example_inputs=batch, passes=passes, keep_outputs=KEEP_OUTPUTS
        )
    step(m)  # compiles
    zero_grads(model)
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    entry = torch.cuda.memory_allocated()
    requested_entry = torch.cuda.memory_stats().get("requested_bytes.all.current", 0)
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    try:
        before = _alive_blocks(torch.cuda.memory._snapshot(), device)
        step(m)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated()
    requested_peak = torch.cuda.memory_stats().get("requested_bytes.all.peak", 0)
    plan = m.plan
    print(
        f"{args.model}, passes={args.passes} budget={args.budget}: {torch.cuda.get_device_name()} torch {torch.__version__}"
    )
    print(
        f"entry {entry / MiB:.3f} MiB, measured peak {peak / MiB:.3f} MiB (the step added "
        f"{(peak - entry) / MiB:.3f}), predicted {plan.predicted_peak_bytes / MiB:.3f} MiB, budget "
        + (f"{plan.budget_bytes / MiB:.3f} MiB" if plan.budget_bytes else "none")
    )
    print(
        f"requested bytes (what the replay below counts): the step added "
        f"{(requested_peak - requested_entry) / MiB:.3f} MiB at its peak"
    )
    print(f"plan breakdown at its peak (MiB): { {k: round(v / MiB, 3) for k, v in plan.breakdown.items()} }")
    _, measured = _report_measured(snap["device_traces"][device], before)
    _, predicted = _report_predicted(plan)
    _report_unmatched(measured, predicted)
    print("library-kernel workspaces fxmem measured (op, argument shapes -> bytes):")
    for key, nbytes in probe._cache.items():
        print(f"  {nbytes / MiB:9.3f} MiB  {key[0]} {str(key[1])[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

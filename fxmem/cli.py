"""The `fxmem` command: plan a model against a budget, explain a saved plan, estimate a fit.

    fxmem plan MODULE:FACTORY --budget 8GB [--out DIR]
    fxmem explain plan.json
    fxmem estimate MODULE:FACTORY --device-memory 24GB [--optimizer adamw]

FACTORY is a callable taking no arguments that returns `(model, example_inputs)`, with
example_inputs a tuple of positional arguments or a dict of keyword arguments; MODULE is an
importable module (`my_pkg.models`) or a path to a `.py` file. Sizes take binary units: KB,
MB, GB, TB mean KiB, MiB, GiB, TiB (as `budget_gb` does); a bare number is GiB.

Exit status: 0 done (and, for `estimate`, it fits); 1 the budget or device memory is too
small; 2 a bad argument, path, factory or file, or a model fxmem cannot plan; 141 the reader
of the output closed it first (`fxmem plan ... | head`), as for a command SIGPIPE ends.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["load_factory", "main", "parse_size"]

_UNITS = {"": 2**30, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


class CliError(Exception):
    """A bad argument: printed as one line, exit status 2."""


def parse_size(text: str) -> int:
    """'8GB' / '8GiB' / '512MB' / '0.5' (GiB) -> bytes. Units are binary."""
    m = _SIZE.match(text)
    if not m:
        raise CliError(f"{text!r} is not a size: write it like 8GB, 512MiB or 0.5 (GiB)")
    number, prefix, suffix = m.groups()
    unit = "b" if (suffix and not prefix) else prefix.lower()
    nbytes = float(number) * _UNITS[unit]
    if not math.isfinite(nbytes):
        raise CliError(f"{text!r}: a size must be a finite number")
    if nbytes < 1:
        raise CliError(f"{text!r}: a size must be at least 1 byte")
    return int(nbytes)


def load_factory(spec: str) -> Callable[[], Any]:
    """'pkg.module:fn' or 'path/to/file.py:fn' -> the callable."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise CliError(f"{spec!r}: expected MODULE:FACTORY, e.g. my_models:build or models.py:build")
    if module_part.endswith(".py") or os.sep in module_part:
        path = os.path.abspath(module_part)
        if not os.path.isfile(path):
            raise CliError(f"{module_part!r}: no such file")
        name = "_fxmem_factory_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, os.path.dirname(path))  # the file's own imports of its neighbours
        try:
            module_spec.loader.exec_module(module)
        finally:
            sys.path.remove(os.path.dirname(path))
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as e:
            raise CliError(f"cannot import {module_part!r}: {e}") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise CliError(f"{module_part!r} has no attribute {attr!r}")
    if not callable(factory):
        raise CliError(f"{spec!r} is a {type(factory).__name__}, not a callable returning (model, example_inputs)")
    return factory


def _build(factory: Callable[[], Any], spec: str) -> tuple[Any, Any]:
    try:
        built = factory()
    except Exception as e:  # the user's code: say whose error it is, in one line
        raise CliError(f"{spec}() raised {type(e).__name__}: {e}") from None
    return _checked(built, spec)


def _checked(built: Any, spec: str) -> tuple[Any, Any]:
    import torch.nn as nn

    if not (isinstance(built, (tuple, list)) and len(built) == 2 and isinstance(built[0], nn.Module)):
        raise CliError(f"{spec} must return (model, example_inputs); it returned {type(built).__name__}")
    if not isinstance(built[1], (tuple, list, dict)):
        raise CliError(f"{spec}: example_inputs must be a tuple of arguments or a dict of keyword arguments")
    return built[0], built[1]


class _Progress:
    """Stage lines on stderr, and a heartbeat while a stage runs long."""

    def __init__(self, quiet: bool = False, every_s: float = 10.0):
        self.quiet, self.every_s, self.t0 = quiet, every_s, time.perf_counter()
        self._stop: threading.Event | None = None

    def stage(self, text: str) -> None:
        self.done()
        self.say(text)
        if self.quiet:
            return
        stop = self._stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.every_s):
                self.say(f"  ... still {text.rstrip('.').lower()}")

        threading.Thread(target=beat, daemon=True).start()

    def say(self, text: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self.t0:6.1f}s] {text}", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._stop = None


def _loss_of(out: Any) -> Any:
    if hasattr(out, "loss") and out.loss is not None:
        return out.loss
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def _model_error(e: Exception) -> CliError:
    """A model fxmem cannot plan, as a one-line `CliError`."""
    return CliError(" ".join(str(e).split()))


def _cmd_plan(args: argparse.Namespace, progress: _Progress) -> int:
    import fxmem
    from fxmem.estimate import split_inputs

    budget = parse_size(args.budget)
    factory = load_factory(args.factory)
    progress.stage("Building the model")
    model, example = _build(factory, args.factory)
    optimizer = _make_optimizer(model, args.optimizer)
    progress.stage("Capturing and planning")
    try:
        wrapped = fxmem.optimize(model, budget / 2**30, optimizer=optimizer, compiler=args.compiler)
        plan = wrapped.plan_for(example, compile=args.measure)  # compiled only to run a step
    except fxmem.BudgetError as e:
        progress.done()
        print(f"fxmem: {e}", file=sys.stderr)
        if e.plan is not None:
            path = e.plan.save(args.out)
            print(f"the smallest plan fxmem found is in {os.path.dirname(path)}", file=sys.stderr)
        return 1
    except (fxmem.GraphBreakError, fxmem.DataDependentShapeError) as e:
        raise _model_error(e) from None
    if plan is None:
        raise CliError(
            f"{args.factory}: the step has no backward to plan, as nothing its output depends on requires "
            "grad: set requires_grad=True on the parameters it trains"
        )
    if args.measure:
        from fxmem.plan_files import measure_plan

        progress.stage("Measuring one step")
        call_args, call_kwargs = split_inputs(example)
        wrapped(*call_args, **call_kwargs)  # compiled already; a warm step, so the measured one is exact
        measured = measure_plan(plan, lambda: _loss_of(wrapped(*call_args, **call_kwargs)).backward())
        print(f"measured: {measured}")
    progress.stage("Writing files")
    path = plan.save(args.out)
    progress.done()
    print(plan.summary(top=args.top))
    print(f"\nwrote {', '.join(sorted(os.listdir(os.path.dirname(path))))} to {os.path.dirname(path)}")
    return 0


def _make_optimizer(model: Any, name: str) -> Any:
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if name == "none" or not params:
        return None
    if name in ("adamw", "adam"):
        return (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(params, lr=1e-4)
    if name in ("sgd", "sgd-momentum"):
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9 if name == "sgd-momentum" else 0.0)
    raise CliError(f"`fxmem plan` accounts for optimizers adamw, adam, sgd, sgd-momentum or none, not {name!r}")


def explain_text(plan: Any, top: int = 20) -> str:
    """A readable table of a plan: totals, rules fired, the largest tensors and their decisions."""
    from fxmem.plan import format_bytes

    lines = [plan.summary(top=0)]
    if plan.measured:
        lines.append(f"  measured peak    {format_bytes(plan.measured['peak_bytes'])}")
    rules = ", ".join(f"{k} x{v}" for k, v in plan.rewrites.items() if v) or "none fired"
    lines.append(f"  rules            {rules}")
    lines += _peak_lines(plan, top)
    biggest = sorted(plan.decisions, key=lambda d: -d.nbytes)[:top]
    if biggest:
        lines.append("")
        lines.append(f"top {len(biggest)} of {len(plan.decisions)} candidate tensors by size:")
        header = f"  {'decision':<10}{'bytes':>11}  {'+time':>8}  {'op':<30} {'module':<24} {'source':<28} reason"
        lines.append(header)
        lines.append("  " + "-" * (len(header) + 10))
        for d in biggest:
            cost = f"{d.cost_s * 1e3:.2f}ms" if d.action == "recompute" else ""
            source = d.source if len(d.source) <= 28 else "..." + d.source[-25:]
            lines.append(
                f"  {d.action:<10}{format_bytes(d.nbytes):>11}  {cost:>8}  {d.op[:30]:<30} "
                f"{d.module[:24]:<24} {source:<28} {d.reason}"
            )
    return "\n".join(lines)


_PHASES = {"fwd": "forward", "bwd": "backward", "recompute": "backward, recomputing", "optimizer": "optimizer step"}


def _peak_lines(plan: Any, top: int) -> list[str]:
    """The `top` largest allocations alive at the plan's predicted peak, with the op, module and
    source line that made each: what to change for a lower peak."""
    from fxmem.plan import format_bytes
    from fxmem.plan_record import alive_at_peak

    at, peak, alive = alive_at_peak(plan.timeline)
    if at < 0 or top <= 0:
        return []
    steps, static = plan.timeline["steps"], sum(plan.timeline["static"].values())
    node, phase = steps[at]
    made_by = {row[0]: row for row in plan.graph.get("nodes", ())}
    lines = [
        "",
        f"alive at the predicted peak, step {at + 1} of {len(steps)} ({node}, {_PHASES.get(phase, phase)}): "
        f"{format_bytes(peak)} in {len(alive)} tensors, besides {format_bytes(static)} alive through the "
        "whole step",
    ]
    header = f"  {'category':<18}{'bytes':>11}  {'tensor':<20} {'op':<30} {'module':<32} source"
    lines += [header, "  " + "-" * (len(header) + 16)]
    for name, category, nbytes in alive[:top]:
        _, op, _, _, _, module, source = made_by.get(name, [name, "", "", "", [], "", ""])
        lines.append(
            f"  {category:<18}{format_bytes(nbytes):>11}  {name[:20]:<20} {op[:30]:<30} {module[:32]:<32} "
            f"{os.path.basename(source)}"
        )
    return lines


def _cmd_explain(args: argparse.Namespace, progress: _Progress) -> int:
    from fxmem.plan import Plan

    path = args.plan
    if os.path.isdir(path):
        path = os.path.join(path, "plan.json")
    if not os.path.isfile(path):
        raise CliError(f"{args.plan!r}: no such plan file")
    try:
        plan = Plan.load(path)
    except (ValueError, TypeError, KeyError) as e:
        raise CliError(f"{path}: not a readable fxmem plan ({e})") from None
    print(explain_text(plan, args.top))
    return 0


def _cmd_estimate(args: argparse.Namespace, progress: _Progress) -> int:
    from fxmem.errors import GraphBreakError
    from fxmem.estimate import estimate

    device_memory = parse_size(args.device_memory) if args.device_memory else None
    factory = load_factory(args.factory)
    progress.stage("Tracing on meta tensors and planning")
    try:
        est = estimate(lambda: _build(factory, args.factory), args.optimizer, compiler=args.compiler)
    except (ValueError, GraphBreakError) as e:
        raise _model_error(e) from None
    progress.done()
    print(est.table(device_memory))
    if args.out:
        est.plan.save(args.out)
        print(f"unconstrained plan written to {args.out}")
    return 0 if device_memory is None or est.floor_bytes <= device_memory or est.peak_bytes <= device_memory else 1


def _parser() -> argparse.ArgumentParser:
    from fxmem.estimate import OPTIMIZERS

    ap = argparse.ArgumentParser(prog="fxmem", description=__doc__.split("\n\n")[0])
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    sub = ap.add_subparsers(dest="command", required=True)
    factory_help = "MODULE:FACTORY, FACTORY() returning (model, example_inputs); MODULE a module or a .py path"

    p = sub.add_parser("plan", help="plan a training step against a budget and write the plan's files")
    p.add_argument("factory", help=factory_help)
    p.add_argument("--budget", required=True, help="e.g. 8GB (GiB), 512MB (MiB)")
    p.add_argument("--out", default="fxmem-plan", help="folder for plan.json and pictures (default fxmem-plan)")
    p.add_argument("--optimizer", default="none", help="count this optimizer's state: adamw, adam, sgd, sgd-momentum")
    p.add_argument("--compiler", default="inductor", choices=("inductor", "eager"))
    p.add_argument(
        "--measure",
        action="store_true",
        help="also compile and run one step and overlay its measured memory (without it nothing is compiled)",
    )
    p.add_argument("--top", type=int, default=10, help="largest tensors to list")
    p.set_defaults(run=_cmd_plan)

    e = sub.add_parser("explain", help="print a saved plan as a readable table")
    e.add_argument("plan", help="plan.json, or the folder holding it")
    e.add_argument("--top", type=int, default=20, help="largest tensors to list")
    e.set_defaults(run=_cmd_explain)

    s = sub.add_parser("estimate", help="will a training step fit? (meta tensors: nothing is allocated)")
    s.add_argument("factory", help=factory_help)
    s.add_argument("--device-memory", help="e.g. 24GB: say whether the step fits in it")
    s.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    s.add_argument("--compiler", default="inductor", choices=("inductor", "eager"))
    s.add_argument("--out", help="also save the unconstrained plan and its files here")
    s.set_defaults(run=_cmd_estimate)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    progress = _Progress(quiet=args.quiet)
    try:
        status = args.run(args, progress)
        sys.stdout.flush()  # a closed pipe raises here, not at exit
        return status
    except CliError as e:
        print(f"fxmem {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`| head`): nothing more to say, and nothing for Python to
        # flush into the closed pipe at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    finally:
        progress.done()


if __name__ == "__main__":
    sys.exit(main())

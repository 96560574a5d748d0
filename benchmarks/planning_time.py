"""Planning time of a 12-layer GPT (d256, vocab 8192, batch 4 x 512) at a tight budget, or of
the benchmark models at one of their sizes.

    python benchmarks/planning_time.py [--layers 12]
    python benchmarks/planning_time.py --models gpt-dropout,hf-gpt2 [--size cuda]
    python benchmarks/planning_time.py --zoo t5,beit [--compiler inductor]
    python benchmarks/planning_time.py --models vit --size cpu --budgets 10 [--compiler inductor]

Prints the joint graph size and the seconds the planner took (plan.planning_s: building the
graph arrays, the save/recompute trajectory with its simulations, and choosing and polishing).
With --models, each benchmark model (benchmarks/_models.py) is built at --size on this machine's
CPU and planned for its floor with the default passes and with rematerialisation alone (the
plan an impossible budget's BudgetError carries; nothing is compiled or run): the GPU sizes
planned here are the graphs a GPU run plans, but for the passes that fire on the CPU only.
With --zoo, each HF architecture of benchmarks/hf_zoo.py is planned for its floor under
--compiler (default eager), as `hf_zoo.py --budget floor` does before it measures: the floor
(the budget a plan at it asks for) and the seconds it took.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator

import torch

import fxmem
from fxmem.partition import budget_for
from fxmem.testing import GPT, GPTConfig, gpt_batch


def _gpt(layers: int) -> None:
    cfg = GPTConfig(n_layer=layers)
    torch.manual_seed(0)
    model = GPT(cfg)
    batch = gpt_batch(cfg, 4, 512)
    for budget_gb in (4.0, 0.5):
        torch._dynamo.reset()
        try:
            plan = fxmem.optimize(model, budget_gb, example_inputs=batch, compiler="eager").plan
        except fxmem.BudgetError as e:
            plan = e.plan
        print(
            f"{layers} layers, budget {budget_gb} GiB: {plan.graph_nodes} joint nodes, "
            f"planned in {plan.planning_s:.2f} s; predicted {plan.predicted_peak_bytes / 2**20:.0f} MiB, "
            f"floor {plan.floor_bytes / 2**20:.0f} MiB"
        )


def _repository_root_on_path() -> None:
    # The repository root, for `benchmarks`, after the installed packages (see budget_check.py).
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _floor_error(model: torch.nn.Module, batch: object, **options: object) -> fxmem.BudgetError:
    """The error a budget no plan reaches raises: it carries the floor and the plan at it."""
    torch._dynamo.reset()
    try:
        fxmem.optimize(model, 1e-6, example_inputs=batch, **options)
    except fxmem.BudgetError as e:
        return e
    raise RuntimeError("a 1e-6 GiB budget was accepted")


def _built(names: list[str], size: str) -> Iterator[tuple[str, torch.nn.Module, object]]:
    """(name, model, batch) of each of the benchmark models `names` at `size`, seeded; a model
    without that size is said and skipped."""
    _repository_root_on_path()
    from benchmarks._models import MODELS

    for name in _known(names, MODELS, "--models"):
        if size not in MODELS[name].sizes:
            print(f"[{name}] has no {size!r} size")
            continue
        torch.manual_seed(0)
        yield (name, *MODELS[name].sizes[size].build())


def _benchmark_models(names: list[str], size: str) -> None:
    for name, model, batch in _built(names, size):
        for label, passes in (("default passes", None), ("remat only", ())):
            plan = _floor_error(model, batch, passes=passes).plan
            fired = ", ".join(f"{k} x{v}" for k, v in plan.rewrites.items() if v) or "none"
            print(
                f"[{name}] {size} size, {label}: {plan.graph_nodes} joint nodes, planned in "
                f"{plan.planning_s:.1f} s; floor {plan.floor_bytes / 2**20:.1f} MiB, unconstrained "
                f"{plan.unconstrained_peak_bytes / 2**20:.1f} MiB; passes fired: {fired}",
                flush=True,
            )


def _budgets(names: list[str], size: str, steps: int, compiler: str) -> None:
    """Each model planned at `steps - 1` budgets evenly between its floor and its unconstrained
    peak (default passes): the peak each plan predicts and the time it adds, as it estimates."""
    for name, model, batch in _built(names, size):
        floor = _floor_error(model, batch, compiler=compiler).floor_bytes
        torch._dynamo.reset()
        unconstrained = fxmem.optimize(model, 64.0, example_inputs=batch, compiler=compiler).plan
        top = budget_for(unconstrained.predicted_peak_bytes)  # the budget that plan asks for
        for k in range(1, steps):
            budget = floor + (top - floor) * k / steps
            torch._dynamo.reset()
            plan = fxmem.optimize(model, (budget + 0.5) / 2**30, example_inputs=batch, compiler=compiler).plan
            print(
                f"[{name}] {size} size, {compiler}, budget {budget / 2**20:.2f} MiB: predicted "
                f"{plan.predicted_peak_bytes / 2**20:.2f} MiB, estimated added time "
                f"{plan.added_time_s * 1e3:.2f} ms, planned in {plan.planning_s:.2f} s",
                flush=True,
            )


def _known(names: list[str], known: dict, flag: str) -> list[str]:
    """`names`, once each is one of `known`; else exit naming the ones there are."""
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"{flag}: no {', '.join(unknown)} (have: {', '.join(known)})")
    return names


def _zoo(names: list[str], compiler: str) -> None:
    _repository_root_on_path()
    from benchmarks.hf_zoo import _models

    zoo = _models()
    for name in _known(names, zoo, "--zoo"):
        torch.manual_seed(0)
        model, batch = zoo[name]()
        model.train()
        e = _floor_error(model, batch, compiler=compiler)
        print(
            f"[{name}] {compiler}: {e.plan.graph_nodes} joint nodes, planned in {e.plan.planning_s:.2f} s; "
            f"floor {e.floor_bytes / 2**20:.2f} MiB",
            flush=True,
        )
        # The error's traceback holds this model: a later plan would count its tensors as
        # other live tensors, and its floor would be that much higher.
        del model, batch, e


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--models", default=None, help="comma-separated benchmark models (benchmarks/_models.py)")
    ap.add_argument("--size", default="cuda", help="with --models: cpu, quick or cuda (default)")
    ap.add_argument("--zoo", default=None, help="comma-separated HF architectures (benchmarks/hf_zoo.py)")
    ap.add_argument("--compiler", default="eager", choices=("eager", "inductor"), help="with --zoo or --budgets")
    ap.add_argument(
        "--budgets",
        type=int,
        default=None,
        metavar="N",
        help="with --models: plan at N-1 budgets evenly between floor and unconstrained (default passes)",
    )
    args = ap.parse_args()
    if args.budgets is not None and (not args.models or args.budgets < 2):
        ap.error("--budgets N needs --models and N >= 2")
    if args.budgets is not None:
        _budgets(args.models.split(","), args.size, args.budgets, args.compiler)
    elif args.zoo:
        _zoo(args.zoo.split(","), args.compiler)
    elif args.models:
        _benchmark_models(args.models.split(","), args.size)
    else:
        _gpt(args.layers)


if __name__ == "__main__":
    main()

"""Planning time of a 12-layer GPT (d256, vocab 8192, batch 4 x 512) at a tight budget.

    python benchmarks/planning_time.py [--layers 12]

Prints the joint graph size and the seconds the planner took (plan.planning_s: building the
graph arrays, the save/recompute trajectory with its simulations, and choosing and polishing).
"""

from __future__ import annotations

import argparse

import torch

import fxmem
from fxmem.testing import GPT, GPTConfig, gpt_batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    args = ap.parse_args()
    cfg = GPTConfig(n_layer=args.layers)
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
            f"{args.layers} layers, budget {budget_gb} GiB: {plan.graph_nodes} joint nodes, "
            f"planned in {plan.planning_s:.2f} s; predicted {plan.predicted_peak_bytes / 2**20:.0f} MiB, "
            f"floor {plan.floor_bytes / 2**20:.0f} MiB"
        )


if __name__ == "__main__":
    main()

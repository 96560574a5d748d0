"""What the rewrite passes buy: fxmem's measured floor and unconstrained step, passes off vs on.

For the GPT with hand-written attention (fxmem.testing.GPT) at T=1024, one run measures, for
each pass set (none; the exact default ones; those plus the opt-in bf16_regions): the floor
(the smallest budget any plan reaches, from BudgetError.floor_bytes) and the measured peak and
median step time of a plan at that floor, and of the unconstrained plan. One model is alive at
a time (fxmem.measure counts every live tensor), so configurations run one after another.

    python benchmarks/passes.py [--batch 2] [--seq 1024] [--steps 5] [--compiler inductor]
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys

import torch

import fxmem
from fxmem.testing import GPT, GPTConfig, gpt_batch

MiB = 2**20
GiB = 2**30


def _floor_bytes(cfg: GPTConfig, batch, passes, compiler: str, precision: str) -> int:
    torch.manual_seed(0)
    try:
        fxmem.optimize(
            GPT(cfg), budget_gb=1 / 1024, compiler=compiler, passes=passes, precision=precision, example_inputs=batch
        )
    except fxmem.BudgetError as err:
        return err.floor_bytes
    raise RuntimeError("a 1 MiB budget was accepted")


def _step(model, batch) -> float:
    loss = model(*batch)
    loss.backward()
    for p in model.parameters():
        p.grad = None
    return loss.item()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--compiler", default="inductor")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = GPTConfig(block_size=args.seq)
    batch = gpt_batch(cfg, args.batch, args.seq)
    # label -> (passes, precision); the last one adds the opt-in bf16_regions to the exact passes.
    pass_sets = {
        "remat only (passes=())": ((), "fp32"),
        "default passes": (None, "fp32"),
        "default + bf16_regions": (None, "bf16"),
    }

    configs = {}
    for label, (passes, precision) in pass_sets.items():
        floor = _floor_bytes(cfg, batch, passes, args.compiler, precision)
        for point, budget_gb in (("floor", floor / GiB), ("unconstrained", 1024.0)):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = fxmem.optimize(
                GPT(cfg),
                budget_gb=budget_gb,
                compiler=args.compiler,
                passes=passes,
                precision=precision,
                example_inputs=batch,
            )
            _step(model, batch)  # warm-up: compile
            runs = [fxmem.measure(_step, model, batch) for _ in range(args.steps)]
            configs[(label, point)] = {
                "floor": floor,
                "rewrites": model.plan.rewrites,
                "peaks": [m.peak_bytes for m in runs],
                "times": [m.seconds for m in runs],
                "losses": [m.result for m in runs],
            }
            del model, runs
            gc.collect()

    print(
        f"GPT d{cfg.n_embd} {cfg.n_layer}L vocab {cfg.vocab_size}, batch {args.batch} x {args.seq}, fp32, "
        f"{args.compiler}; torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads; medians of {args.steps} steps"
    )
    print(f"{'passes':<24} {'point':<14} {'floor MiB':>10} {'peak MiB':>9} {'step s':>8}  rewrites")
    for (label, point), c in configs.items():
        print(
            f"{label:<24} {point:<14} {c['floor'] / MiB:>10.1f} {max(c['peaks']) / MiB:>9.1f} "
            f"{statistics.median(c['times']):>8.3f}  {c['rewrites']}"
        )
    base = configs[("remat only (passes=())", "floor")]
    new = configs[("default passes", "floor")]
    drop = 1 - max(new["peaks"]) / max(base["peaks"])
    t_base = statistics.median(configs[("remat only (passes=())", "unconstrained")]["times"])
    t_new = statistics.median(configs[("default passes", "unconstrained")]["times"])
    print(f"exact passes: measured floor lowered by {drop:.1%} (goal >= 40%); unconstrained step {t_new / t_base:.2f}x")
    bf16 = configs[("default + bf16_regions", "floor")]
    t_bf16 = statistics.median(configs[("default + bf16_regions", "unconstrained")]["times"])
    print(
        f"with bf16_regions: measured floor lowered by {1 - max(bf16['peaks']) / max(base['peaks']):.1%}; "
        f"unconstrained step {t_bf16 / t_base:.2f}x"
    )
    exact = [c for (label, _), c in configs.items() if pass_sets[label][1] == "fp32"]
    same = all(abs(a - b) < 1e-4 for c in exact for a, b in zip(c["losses"], base["losses"], strict=True))
    print(f"losses agree across the fp32 configurations: {'yes' if same else 'NO'}")
    diff = max(abs(a - b) for a, b in zip(bf16["losses"], base["losses"], strict=True))
    print(f"bf16 regions: largest loss difference from fp32 at initialisation {diff:.2e}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

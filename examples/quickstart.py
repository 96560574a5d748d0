"""Train a nanoGPT-style model (hand-written attention) in half the memory eager PyTorch needs.

    python examples/quickstart.py [--steps 8] [--fraction 0.5] [--compiler inductor] [--plan-dir fxmem-plan]

It trains the same model from the same weights twice, with the same AdamW: once in eager
PyTorch, once under `fxmem.optimize` with a budget of `fraction` x eager's measured peak.
Every peak printed is measured by `fxmem.measure` (forward, backward and optimizer step), not
predicted. The plan is written to `--plan-dir`.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys

import torch

import fxmem
from fxmem.plan import format_bytes
from fxmem.testing import GPT, GPTConfig, gpt_batch


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches, *, label: str):
    """One measured training step per batch; returns (losses, peaks, seconds)."""

    def step(idx, targets):
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        return loss.item()

    losses, peaks, secs = [], [], []
    for i, (idx, targets) in enumerate(batches):
        m = fxmem.measure(step, idx, targets)
        opt.zero_grad(set_to_none=True)
        losses.append(m.result)
        peaks.append(m.peak_bytes)
        secs.append(m.seconds)
        print(f"  {label} step {i}: loss {m.result:.4f}  peak {format_bytes(m.peak_bytes)}  {m.seconds:.3f} s")
    return losses, peaks, secs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fraction", type=float, default=0.5, help="budget as a fraction of eager's measured peak")
    ap.add_argument("--compiler", default="inductor", choices=["inductor", "eager"])
    ap.add_argument("--plan-dir", default="fxmem-plan")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=1024, block_size=256, n_layer=4, n_head=4, n_embd=128)
    model = GPT(cfg)
    initial = copy.deepcopy(model.state_dict())
    batches = [gpt_batch(cfg, 8, 256, seed=s) for s in range(args.steps)]
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"GPT: {cfg.n_layer} layers, d{cfg.n_embd}, vocab {cfg.vocab_size}, {n_params / 1e6:.2f} M parameters; batch 8 x 256"
    )

    print("eager PyTorch:")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    eager_losses, eager_peaks, eager_secs = train(model, opt, batches, label="eager")
    eager_peak = max(eager_peaks)
    del opt

    budget_gb = args.fraction * eager_peak / 2**30
    print(f"fxmem, budget {format_bytes(budget_gb * 2**30)} ({args.fraction:.0%} of eager's measured peak):")
    model.load_state_dict(initial)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    try:
        # Planned now, outside fxmem.measure: planning probes library kernels' workspaces
        # with the profiler that measure runs on CPU.
        fast = fxmem.optimize(model, budget_gb, optimizer=opt, compiler=args.compiler, example_inputs=batches[0])
        fx_losses, fx_peaks, fx_secs = train(fast, opt, batches, label="fxmem")
    except fxmem.BudgetError as e:
        print(f"no plan fits: {e}")
        return 1
    plan_path = fast.plan.save(args.plan_dir)

    print()
    print(fast.plan.summary(top=6))
    print()
    print("step | eager loss | fxmem loss")
    for i, (a, b) in enumerate(zip(eager_losses, fx_losses, strict=True)):
        print(f"{i:4d} | {a:10.4f} | {b:10.4f}")
    print()
    # Step 0 can include first-call work (eager's allocator warming up); medians are over the later steps.
    eager_t = statistics.median(eager_secs[1:])
    fx_t = statistics.median(fx_secs[1:])
    fx_peak = max(fx_peaks)
    print(f"budget          {format_bytes(budget_gb * 2**30)}")
    print(f"eager peak      {format_bytes(eager_peak)} (measured), median step {eager_t:.3f} s")
    print(f"fxmem peak      {format_bytes(fx_peak)} (measured), median step {fx_t:.3f} s  [{args.compiler}]")
    print(
        f"fxmem predicted {format_bytes(fast.plan.predicted_peak_bytes)}, floor {format_bytes(fast.plan.floor_bytes)}"
    )
    print(f"within budget:  {'yes' if fx_peak <= budget_gb * 2**30 else 'NO'}")
    print(f"plan written to {plan_path}")
    return 0 if fx_peak <= budget_gb * 2**30 else 2


if __name__ == "__main__":
    sys.exit(main())

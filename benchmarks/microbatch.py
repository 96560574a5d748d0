"""`microbatch_blocks` on Hugging Face decoders: how far the floor drops, and does the budget hold?

    python benchmarks/microbatch.py [--models hf-gpt2,hf-llama] [--compiler eager] [--layers 2] [--batch 8] [--seq 128]

Per model, built from a small config (d64, 4 heads, vocab 512; GPT-2 without dropout, whose
blocks would otherwise stay whole; Llama with 2 key/value heads and rotary positions), on CPU:
the floor of the default passes (from the `BudgetError` of an impossible budget), the floor
with `microbatch_blocks` named, and a step planned at the budget halfway between them: the slices
it runs over, the peak `fxmem.measure` reads against the plan's prediction and the budget, and
the gradients' largest relative error against eager's (per parameter). Prints a Markdown table;
exit status 1 when a budget did not hold or a gradient is off by more than 1e-5.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import torch

import fxmem
from fxmem.pipeline import default_passes

MiB = 2**20
SLICING = [*default_passes(), "microbatch_blocks"]


def _model(name: str, layers: int, seq: int) -> torch.nn.Module:
    import transformers

    common = {"vocab_size": 512, "bos_token_id": 0, "eos_token_id": 0}
    if name == "hf-gpt2":
        cfg = transformers.GPT2Config(
            n_positions=seq, n_embd=64, n_layer=layers, n_head=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, **common
        )
        model = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")
        model.loss_type = "ForCausalLM"  # the loss its class name maps to no type for
        return model
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        pad_token_id=None,
        **common,
    )
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager")


def _step(model, batch) -> None:
    out = model(**batch)  # held through the backward, as the plan assumes (keep_outputs=True)
    out.loss.backward()


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return grads


def _floor(model, batch, compiler: str, passes) -> int:
    try:
        fxmem.optimize(model, 1e-6, example_inputs=batch, compiler=compiler, passes=passes)
    except fxmem.BudgetError as e:
        return e.floor_bytes
    raise RuntimeError("a budget of 1 KiB was accepted")


def run(name: str, compiler: str, layers: int, batch_size: int, seq: int) -> tuple[str, bool]:
    torch.manual_seed(0)
    model = _model(name, layers, seq)
    ids = torch.randint(0, 512, (batch_size, seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    _step(model, batch)
    ref = _grads(model)
    whole = _floor(model, batch, compiler, None)
    t = time.perf_counter()
    sliced = _floor(model, batch, compiler, SLICING)
    search_s = time.perf_counter() - t
    budget = (whole + sliced) // 2
    m = fxmem.optimize(model, budget / 2**30, example_inputs=batch, compiler=compiler, passes=SLICING)
    _step(m, batch)
    err = max(((g - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)).item() for k, g in _grads(m).items())
    measured = fxmem.measure(_step, m, batch).peak_bytes
    held = measured <= m.plan.budget_bytes
    row = (
        f"| {name} | {whole / MiB:.2f} | {sliced / MiB:.2f} ({sliced / whole:.2f}x) | {search_s:.1f} | "
        f"{budget / MiB:.2f} | {m.plan.batch_slices} | {measured / MiB:.2f} | "
        f"{m.plan.predicted_peak_bytes / MiB:.2f} | {'yes' if held else '**no**'} | {err:.1e} |"
    )
    return row, held and err <= 1e-5


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="hf-gpt2,hf-llama")
    ap.add_argument("--compiler", default="eager", choices=["eager", "inductor"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args(argv)
    print(
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, compiler={args.compiler}, "
        f"{args.layers} layers, batch {args.batch} x {args.seq} tokens, fp32\n"
    )
    print(
        "| model | floor (MiB) | floor, microbatch_blocks (MiB) | floor search (s) | budget (MiB) | slices | "
        "measured (MiB) | predicted (MiB) | held | grad error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for name in args.models.split(","):
        row, good = run(name, args.compiler, args.layers, args.batch, args.seq)
        print(row, flush=True)
        ok &= good
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

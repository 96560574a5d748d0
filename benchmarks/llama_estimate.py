"""`fxmem estimate` on a config-built ~1B Llama, and the check of its activation estimate.

Factories for the CLI (nothing is downloaded; the config is Llama-3.2-1B's shape):

    fxmem estimate benchmarks/llama_estimate.py:llama_1b --device-memory 24GB --optimizer adamw

`python benchmarks/llama_estimate.py [--measure]` times the estimate and, with --measure,
checks the activation estimate against real eager forwards on this CPU: the forward's memory
above what is alive at entry (the activations autograd saves, and temporaries) is affine in the
batch size, F(b) = F(1) + A*(b - 1), so two small measured runs (batch 1 and 2) give A, and
F(1) + A*(B - 1) is the measured activation memory scaled up to the estimate's batch B. (The
whole step's peak is no use for this: it comes at the end of the backward, where gradients,
not activations, fill memory, and it does not change with the batch.)
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch

SEQ = int(os.environ.get("FXMEM_LLAMA_SEQ", "256"))
BATCH = int(os.environ.get("FXMEM_LLAMA_BATCH", "8"))
# The rule passes change the graph being estimated; none by default, so the check compares
# like with like (eager PyTorch runs the model as written).
PASSES = [p for p in os.environ.get("FXMEM_PASSES", "").split(",") if p]


def llama_config(**overrides):
    from transformers import LlamaConfig

    cfg = dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
        rope_theta=500000.0, tie_word_embeddings=True, attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    cfg.update(overrides)
    return LlamaConfig(**cfg)


def _llama(batch: int, seq: int = SEQ, **overrides):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config(**overrides))
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    return model, {"input_ids": ids, "labels": ids}


def llama_1b():
    """Llama-3.2-1B-shaped, batch FXMEM_LLAMA_BATCH (8) x FXMEM_LLAMA_SEQ (256) tokens."""
    return _llama(BATCH)


def _measured_forward_rise(batch: int) -> int:
    """Measured peak of the forward minus what is alive at entry, real model, eager."""
    import fxmem

    torch.manual_seed(0)
    model, inputs = _llama(batch)
    m = fxmem.measure(lambda: model(**inputs).loss)  # the loss keeps the saved activations alive
    return m.peak_bytes - m.entry_bytes


def forward_activation_bytes(est) -> int:
    """The estimate's largest memory during the forward, above parameters and inputs."""
    from fxmem.plan_record import category_curves

    curves = category_curves(est.plan.timeline)
    steps = est.plan.timeline["steps"]
    return max(sum(c[t] for c in curves.values()) for t in range(len(steps)) if steps[t][1] == "fwd")


def main() -> None:
    from fxmem.estimate import estimate
    from fxmem.plan import format_bytes

    ap = argparse.ArgumentParser()
    ap.add_argument("--measure", action="store_true", help="also run forwards at batch 1 and 2 for real (~7 GB RAM)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    est = estimate(llama_1b, "adamw", compiler="eager", passes=PASSES)
    print(est.table(24 * 2**30))
    print(f"estimate took {time.perf_counter() - t0:.1f} s ({est.plan.graph_nodes} joint nodes)")
    if not args.measure:
        return
    # Activations are compared where nothing else moves: the forward (the backward's peak is
    # dominated by gradients, which do not grow with the batch).
    f1 = _measured_forward_rise(1)
    gc.collect()  # the batch-1 model is gone before the batch-2 one is built
    f2 = _measured_forward_rise(2)
    scaled = f1 + (f2 - f1) * (BATCH - 1)
    estimated = forward_activation_bytes(est)
    print(f"measured forward activations: batch 1 {format_bytes(f1)}, batch 2 {format_bytes(f2)}")
    print(f"  scaled to batch {BATCH} (f1 + (f2 - f1) * {BATCH - 1}): {format_bytes(scaled)}")
    print(f"estimated forward activations at batch {BATCH}: {format_bytes(estimated)} ({estimated / scaled - 1:+.1%})")


if __name__ == "__main__":
    main()

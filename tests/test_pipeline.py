"""All the default rule passes together, planned against a budget: the budget still holds as measured."""

from __future__ import annotations

import pytest
import torch
from _graphs import grad_err
from conftest import grads_of, small_gpt, step, zero_grads

import fxmem
from fxmem.testing import GPT, GPTConfig, gpt_batch

MiB = 2**20


@pytest.mark.parametrize("fraction", [0.8, 0.6, 0.45])  # with the passes the floor is ~0.38 of eager
def test_budget_held_with_all_passes_small_gpt(fraction):
    model, batch = small_gpt()
    step(model, *batch)  # warm-up: lazy allocations, profiler bookkeeping
    zero_grads(model)
    eager = fxmem.measure(step, model, *batch)
    ref = grads_of(model)
    zero_grads(model)
    budget = fraction * eager.peak_bytes
    m = fxmem.optimize(model, budget / 2**30, compiler="eager")  # passes=None: every exact pass
    step(m, *batch)  # plans and compiles
    zero_grads(model)
    got = fxmem.measure(step, m, *batch)
    plan = m.plan
    assert plan.rewrites == {
        "index_as_slice": 0,
        "swap_sdpa": 4,
        "fuse_projections": 0,
        "chunked_attention": 0,
        "chunked_lm_loss": 1,
        "detach_caches": 0,
    }
    assert got.peak_bytes <= budget, (
        f"measured {got.peak_bytes / MiB:.1f} MiB > budget {budget / MiB:.1f} MiB "
        f"(predicted {plan.predicted_peak_bytes / MiB:.1f} MiB)"
    )
    assert torch.allclose(got.result, eager.result, rtol=1e-5)
    assert grad_err(grads_of(model), ref) < 1e-5


@pytest.mark.slow
def test_budget_held_with_bf16_regions_and_inductor():
    """precision="bf16" adds bf16_regions to the exact passes. From the floor up, the measured
    peak holds with inductor: the chunked loss casts its head to bf16 once, not once per chunk
    (inductor makes those copies in one kernel, all alive at once)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=4096, block_size=128, n_layer=2, n_head=4, n_embd=64)
    model, batch = GPT(cfg), gpt_batch(cfg, 4, 128)
    try:
        fxmem.optimize(model, 1e-6, precision="bf16", example_inputs=batch)
    except fxmem.BudgetError as err:
        floor = err.floor_bytes
    for budget in (floor, 4 * floor):  # the second: nothing recomputed
        m = fxmem.optimize(model, budget / 2**30, precision="bf16", example_inputs=batch)
        step(m, *batch)  # compiles
        zero_grads(model)
        got = fxmem.measure(step, m, *batch)
        zero_grads(model)
        assert m.plan.rewrites["bf16_regions"] > 0 and m.plan.rewrites["chunked_lm_loss"] == 1
        assert got.peak_bytes <= budget, (
            f"measured {got.peak_bytes / MiB:.1f} MiB > budget {budget / MiB:.1f} MiB "
            f"(predicted {m.plan.predicted_peak_bytes / MiB:.1f} MiB)"
        )
        assert torch.isfinite(got.result)

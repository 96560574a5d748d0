"""The budget on a CUDA device, as `torch.cuda.max_memory_allocated` reads it (skipped without one).

Small budgets are where CUDA differs from the CPU: cuBLAS's workspaces (one per thread and
stream that ran a matmul, 32 MiB each on Hopper) are allocated outside any tensor and counted
by every measured peak, so a plan that left them out would break a budget of tens of MiB.
"""

from __future__ import annotations

import pytest
import torch
from conftest import grads_of, max_rel_err, small_gpt, step, zero_grads

import fxmem
from fxmem.backend import OUTSIDE_TENSORS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _on_cuda():
    model, batch = small_gpt()
    return model.cuda(), tuple(t.cuda() for t in batch)


def _eager(model, batch):
    zero_grads(model)
    peak = fxmem.measure(step, model, *batch).peak_bytes
    ref = grads_of(model)
    zero_grads(model)
    return peak, ref


def _floor(model, batch, **kw) -> int:
    with pytest.raises(fxmem.BudgetError) as e:
        fxmem.optimize(model, 1e-6, example_inputs=batch, **kw)
    return e.value.floor_bytes


@pytest.mark.parametrize("passes", [(), None], ids=["remat-only", "default-passes"])
@pytest.mark.parametrize("where", ["floor", "half of eager"])
def test_budget_holds_on_cuda(passes, where):
    model, batch = _on_cuda()
    eager_peak, ref = _eager(model, batch)
    budget = _floor(model, batch, passes=passes) if where == "floor" else eager_peak // 2
    try:
        m = fxmem.optimize(model, (budget + 0.5) / 2**30, example_inputs=batch, passes=passes)
    except fxmem.BudgetError as e:
        assert where != "floor", e  # half of eager's peak may be below this pass set's floor
        pytest.skip(f"half of eager's peak is below the floor ({e.floor_bytes} bytes)")
    step(m, *batch)  # compiles
    zero_grads(model)
    measured = fxmem.measure(step, m, *batch).peak_bytes
    assert measured <= m.plan.budget_bytes, (measured, m.plan.budget_bytes, m.plan.breakdown)
    assert abs(m.plan.predicted_peak_bytes - measured) <= 0.15 * measured, (m.plan.predicted_peak_bytes, measured)
    assert max_rel_err(grads_of(model), ref) < 1e-4


def test_the_plan_counts_cublas_workspaces():
    model, batch = _on_cuda()
    _eager(model, batch)  # cuBLAS has run in both directions
    m = fxmem.optimize(model, 1024.0, example_inputs=batch)
    assert m.plan.breakdown.get(OUTSIDE_TENSORS, 0) > 0, m.plan.breakdown

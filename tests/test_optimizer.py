"""The optimizer's share of a step: state and step temporaries as measured, and plans that count them."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import grads_of, max_rel_err, small_gpt

import fxmem
from fxmem.measure import live_tensor_bytes
from fxmem.optimizer import optimizer_bytes, step_implementation
from fxmem.testing import GPT, GPTConfig, gpt_batch

MiB = 2**20
# the largest parameter follows a small one: Adam's single-tensor loop still holds the small
# one's denominator while it makes the large one's
_SHAPES = [(256, 128), (128,), (512, 256), (64, 64), (1024, 128), (16,)]
_EXACT = [
    (torch.optim.AdamW, {}),
    (torch.optim.Adam, {"weight_decay": 0.1}),
    (torch.optim.Adam, {"maximize": True, "amsgrad": True}),
    (torch.optim.SGD, {}),
    (torch.optim.SGD, {"momentum": 0.9}),
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.1, "nesterov": True}),
    (torch.optim.SGD, {"maximize": True}),
]
_IMPLEMENTATIONS = {"default": {}, "single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape, generator=gen)) for shape in _SHAPES]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


def _measured_step(opt: torch.optim.Optimizer) -> tuple[int, int, int, int]:
    """(state bytes predicted before the first step, allocated by it, temporaries predicted,
    measured in the second step)."""
    state_predicted, _ = optimizer_bytes(opt)
    before = live_tensor_bytes(torch.device("cpu"))
    opt.step()
    state = live_tensor_bytes(torch.device("cpu")) - before
    _, step_predicted = optimizer_bytes(opt)
    base = live_tensor_bytes(torch.device("cpu"))
    step = fxmem.measure(opt.step).peak_bytes - base
    return state_predicted, state, step_predicted, step


@pytest.mark.parametrize("impl", list(_IMPLEMENTATIONS))
@pytest.mark.parametrize("cls, kwargs", _EXACT, ids=lambda x: getattr(x, "__name__", None) or str(x))
def test_step_temporaries_and_state_as_measured(cls, kwargs, impl):
    opt = cls(_params(), lr=1e-3, **_IMPLEMENTATIONS[impl], **kwargs)
    state_predicted, state, step_predicted, step = _measured_step(opt)
    # the step counters and bias corrections are a few scalars
    assert abs(state_predicted - state) <= 4096
    assert abs(step_predicted - step) <= 4096, f"predicted {step_predicted / MiB:.3f} MiB, measured {step / MiB:.3f}"
    largest = 1024 * 128 * 4
    if impl != "fused" and cls is not torch.optim.SGD:
        assert step >= 2 * largest  # the case is one where the step's temporaries matter


@pytest.mark.parametrize("cls", [torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.NAdam])
@pytest.mark.parametrize("impl", ["single", "foreach"])
def test_other_optimizers_never_under_predicted(cls, impl):
    opt = cls(_params(), lr=1e-3, **_IMPLEMENTATIONS[impl])
    state_predicted, state, step_predicted, step = _measured_step(opt)
    assert state_predicted >= state - 4096
    assert step_predicted >= step - 4096


def test_implementation_follows_torch_defaults():
    params = _params()
    default = {"foreach": None, "fused": None}
    assert step_implementation(default, params) == "single"  # CPU tensors
    assert step_implementation(default, params, device_type="cuda") == "foreach"
    assert step_implementation({**default, "differentiable": True}, params, "cuda", "Adam") == "single"
    assert step_implementation({**default, "differentiable": True}, params, "cuda", "SGD") == "foreach"
    lr = torch.tensor(1e-3)
    assert step_implementation({**default, "lr": lr}, params, "cuda", "Adam") == "single"
    assert step_implementation({**default, "lr": lr, "capturable": True}, params, "cuda", "Adam") == "foreach"
    assert step_implementation({"foreach": None, "fused": False}, params, device_type="cuda") == "single"
    assert step_implementation({"fused": True, "foreach": None}, params) == "fused"
    assert step_implementation({"foreach": True}, params) == "foreach"


def test_mixed_dtypes_in_foreach_adam_not_under_predicted():
    """Adam's foreach path keeps one (device, dtype) group's square root while it makes the next's."""
    params = _params()
    params[2].data, params[2].grad = params[2].data.double(), params[2].grad.double()  # 1 MiB
    opt = torch.optim.Adam(params, lr=1e-3, foreach=True)
    _, _, step_predicted, step = _measured_step(opt)
    assert step >= 1.5 * 2**20  # both groups' square roots at once (0.66 MiB of float32)
    assert step_predicted >= step - 4096, (step_predicted, step)


def test_a_subclass_counts_as_the_optimizer_it_extends():
    class MyAdamW(torch.optim.AdamW):
        pass

    ours, theirs = (cls(_params(), lr=1e-3) for cls in (MyAdamW, torch.optim.AdamW))
    assert optimizer_bytes(ours) == optimizer_bytes(theirs)
    assert optimizer_bytes(ours)[0] > 0


def _train(model, opt, batch):
    loss = model(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _first_step_gradients(model, opt, batch) -> dict[str, torch.Tensor]:
    """One training step; the gradients it applied. (Compared after one step only: Adam's
    update divides by the gradients' size, so where they are near zero it turns rounding
    differences into steps of `lr`.)"""
    model(*batch).backward()
    grads = grads_of(model)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return grads


def test_plan_whose_peak_is_the_optimizer_step():
    """A model whose parameters outweigh its activations: the step's peak is the optimizer's,
    and the plan predicts it."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=8192, block_size=64, n_layer=2, n_head=4, n_embd=128)
    model, batch = GPT(cfg), gpt_batch(cfg, 2, 64)
    reference = copy.deepcopy(model)
    ref = _first_step_gradients(reference, torch.optim.AdamW(reference.parameters(), lr=1e-3), batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    m = fxmem.optimize(model, 1.0, optimizer=opt, compiler="eager")
    # plans, and allocates the optimizer's state
    assert max_rel_err(_first_step_gradients(m, opt, batch), ref) < 1e-4
    peaks = [fxmem.measure(_train, m, opt, batch).peak_bytes for _ in range(2)]
    plan = m.plan
    assert plan.breakdown["optimizer step temporaries"] > 0
    assert sum(plan.breakdown.values()) == plan.predicted_peak_bytes
    assert max(peaks) <= plan.predicted_peak_bytes <= 1.10 * max(peaks), (plan.predicted_peak_bytes, peaks)


def test_budget_held_through_the_optimizer_step():
    model, batch = small_gpt()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    eager = fxmem.measure(_first_step_gradients, reference, ref_opt, batch)  # the step that allocates the state
    budget = 0.6 * eager.peak_bytes
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    m = fxmem.optimize(model, budget / 2**30, optimizer=opt, compiler="eager")
    first = fxmem.measure(_first_step_gradients, m, opt, batch)
    peaks = [first.peak_bytes] + [fxmem.measure(_train, m, opt, batch).peak_bytes for _ in range(2)]
    assert max(peaks) <= budget, f"measured {max(peaks) / MiB:.1f} MiB > budget {budget / MiB:.1f} MiB"
    assert m.plan.breakdown["optimizer"] == 2 * sum(p.numel() * 4 for p in model.parameters())
    assert m.plan.recomputed
    assert max_rel_err(first.result, eager.result) < 1e-4

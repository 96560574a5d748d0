"""fxmem.outputs: values a pass returns beside the graph's outputs reach its hook, never the
caller; a plan for a caller that keeps only the loss (`keep_outputs=False`), and its check."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from conftest import floor_plan, grads_of, max_rel_err, zero_grads

import fxmem
from fxmem._torch_private import TANGENTS_HELD_THROUGH_BACKWARD
from fxmem.backend import Options
from fxmem.outputs import return_outside, with_output_hooks

MiB = 2**20


def _graph() -> fx.GraphModule:
    def f(x, y):
        return (x + y, x * y)

    return fx.symbolic_trace(f)


def test_without_hooks_the_step_is_returned_as_it_is():
    gm = _graph()
    step = gm.forward
    assert with_output_hooks(step, gm) is step


def test_hooks_see_the_extra_outputs_and_the_caller_does_not():
    gm = _graph()
    nodes = {n.name: n for n in gm.graph.nodes}
    seen = []

    def hook(outputs, positions):
        seen.append([outputs[p] for p in positions])
        outputs[0] = outputs[0] + outputs[positions[1]]  # the hook may replace an output

    return_outside(gm, [nodes["x"], nodes["y"]], hook)
    x, y = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])
    assert len(gm(x, y)) == 4  # the graph itself returns the extra values
    step = with_output_hooks(gm.forward, gm)
    out = step(x, y)
    assert len(out) == 2
    assert torch.equal(out[0], x + y + y) and torch.equal(out[1], x * y)
    ((got_x, got_y),) = seen
    assert got_x is x and got_y is y


class _LM(nn.Module):
    """An LM head returning its logits beside the loss, as HF's *ForCausalLM do. With d=256 the
    chunked loss runs 8 chunks (vocab / d): inductor compiles a kernel of its own for each."""

    def __init__(self, vocab: int = 2048, d: int = 256, loss_first: bool = True):
        super().__init__()
        self.loss_first = loss_first
        self.emb = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.body(self.emb(idx)))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return (loss, logits) if self.loss_first else (logits, loss)


def _lm(loss_first: bool = True):
    torch.manual_seed(0)
    model = _LM(loss_first=loss_first)
    idx = torch.randint(0, 2048, (4, 256))
    return model, (idx, torch.roll(idx, -1, dims=1))


def _loss(out):
    return min(out, key=torch.Tensor.numel)


def _keeping_the_loss(model, *batch):
    _loss(model(*batch)).backward()


def _holding_the_output(model, *batch):
    out = model(*batch)
    _loss(out).backward()
    return out


def _warned(category, fn, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fxmem.measure(fn, *args)
    return got, [w for w in caught if issubclass(w.category, category)]


def _held_warnings(fn, *args):
    return _warned(fxmem.OutputsHeldWarning, fn, *args)


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_keep_outputs_false_plans_for_a_step_that_keeps_the_loss(compiler):
    """Logits counted until the forward ends: the loss-only step measures what the plan
    predicts, at a budget the default plan cannot reach; gradients as eager's; holding the
    logits through the backward warns."""
    model, batch = _lm()
    _keeping_the_loss(model, *batch)
    ref = grads_of(model)
    zero_grads(model)
    logits_bytes = 4 * 256 * 2048 * 4
    plans = {keep: floor_plan(model, batch, compiler=compiler, keep_outputs=keep)[1] for keep in (True, False)}
    assert plans[True].keep_outputs and not plans[False].keep_outputs
    assert plans[False].floor_bytes <= plans[True].floor_bytes - logits_bytes // 4, plans
    assert "keep_outputs=False" in plans[False].summary() and "keep_outputs" not in plans[True].summary()

    with pytest.raises(fxmem.BudgetError):  # between the floors: the default plan cannot reach it
        fxmem.optimize(
            model, (plans[False].floor_bytes + plans[True].floor_bytes) / 2**31, example_inputs=batch, compiler=compiler
        )
    budget = int(plans[False].floor_bytes * 1.005)
    m = fxmem.optimize(model, budget / 2**30, example_inputs=batch, compiler=compiler, keep_outputs=False)
    _keeping_the_loss(m, *batch)  # the first call's lazy allocations
    zero_grads(model)
    got, warned = _held_warnings(_keeping_the_loss, m, *batch)
    assert not warned
    assert got.peak_bytes <= budget, (got.peak_bytes / MiB, budget / MiB)
    assert abs(got.peak_bytes - m.plan.predicted_peak_bytes) <= 0.02 * got.peak_bytes, (
        got.peak_bytes / MiB,
        m.plan.predicted_peak_bytes / MiB,
    )
    assert max_rel_err(grads_of(model), ref) < 1e-4
    zero_grads(model)
    held, warned = _held_warnings(_holding_the_output, m, *batch)
    assert held.peak_bytes > budget and len(warned) == 1, (held.peak_bytes / MiB, budget / MiB)
    assert "keep_outputs=True" in str(warned[0].message)
    assert max_rel_err(grads_of(model), ref) < 1e-4


def test_keep_outputs_must_be_a_bool():
    model, batch = _lm()
    with pytest.raises(TypeError, match="keep_outputs"):
        fxmem.optimize(model, 1.0, keep_outputs="no")
    with pytest.raises(TypeError, match="keep_outputs"):
        Options.from_dict({"budget_gb": 1.0, "keep_outputs": 0})


def test_a_held_output_is_caught_wherever_the_step_returns_it():
    """The logits returned before the loss: their hook runs first, and they still count."""
    model, batch = _lm(loss_first=False)
    floor = fxmem.optimize(model, 1024.0, example_inputs=batch, compiler="eager", keep_outputs=False).plan.floor_bytes
    budget = int(floor * 1.005)
    m = fxmem.optimize(model, budget / 2**30, example_inputs=batch, compiler="eager", keep_outputs=False)
    assert [pos for pos, _, _ in m.plan.released_outputs] == [0, 1]  # the logits, then the loss
    zero_grads(model)
    _, warned = _held_warnings(_keeping_the_loss, m, *batch)
    assert not warned
    zero_grads(model)
    _, warned = _held_warnings(_holding_the_output, m, *batch)
    assert len(warned) == 1


def test_a_saved_plan_applies_only_with_the_keep_outputs_it_was_made_with(tmp_path):
    model, batch = _lm()
    plan = fxmem.optimize(model, 1024.0, example_inputs=batch, compiler="eager", keep_outputs=False).plan
    plan.save(tmp_path, files=False)
    with pytest.raises(fxmem.PlanMismatchError, match="keep_outputs=False"):
        fxmem.optimize(model, 1024.0, example_inputs=batch, compiler="eager", plan=tmp_path)
    m = fxmem.optimize(model, 1024.0, example_inputs=batch, compiler="eager", plan=tmp_path, keep_outputs=False)
    assert m.plan.keep_outputs is False and m.plan.released_outputs == plan.released_outputs


def test_the_check_keeps_no_module_alive():
    """The step outlives the module in Dynamo's cache (until reset); with the check on, that
    must not keep the module and its parameters alive."""
    model, batch = _lm()
    m = fxmem.optimize(model, 1.0, example_inputs=batch, compiler="eager", keep_outputs=False)
    _keeping_the_loss(m, *batch)
    module, weight = weakref.ref(m), weakref.ref(model.head.weight)
    del m, model
    gc.collect()
    assert module() is None and weight() is None


def test_a_loss_computed_outside_the_step_on_a_large_output_warns():
    """`F.cross_entropy(model(x), y)`: the loss's own tensors (the log-softmax of the logits and
    its gradient) are the caller's code, outside the plan; at a budget that leaves less free than
    the logits take, the step measured over it with no word said."""
    model, (idx, targets) = _lm()
    logits_only = nn.Sequential(model.emb, model.body, model.head)

    def outside(m, idx, targets):
        F.cross_entropy(m(idx).flatten(0, 1), targets.flatten()).backward()

    floor = fxmem.optimize(logits_only, 1.0, example_inputs=(idx,), compiler="eager").plan.floor_bytes
    budget = int(floor * 1.005)
    m = fxmem.optimize(logits_only, budget / 2**30, compiler="eager")
    outside(m, idx, targets)
    zero_grads(model)
    got, warned = _warned(fxmem.LossOutsideWarning, outside, m, idx, targets)
    assert len(warned) == 1
    assert got.peak_bytes > m.plan.predicted_peak_bytes + MiB, (got.peak_bytes / MiB, m.plan.predicted_peak_bytes / MiB)
    if not TANGENTS_HELD_THROUGH_BACKWARD:
        # Where the logits' gradient is held through the backward (torch < 2.13), the plan's
        # peak is there, and the loss's tensors outside fit the head-room beside it.
        assert got.peak_bytes > budget, (got.peak_bytes / MiB, budget / MiB)
    assert "inside the model's forward" in str(warned[0].message)
    zero_grads(model)
    # The loss inside the step, at its own floor: nothing outside, nothing to warn of.
    inside = fxmem.optimize(model, 1.0, example_inputs=(idx, targets), compiler="eager").plan.floor_bytes
    m = fxmem.optimize(model, 1.005 * inside / 2**30, compiler="eager")
    _keeping_the_loss(m, idx, targets)
    zero_grads(model)
    got, warned = _warned(fxmem.LossOutsideWarning, _keeping_the_loss, m, idx, targets)
    assert got.peak_bytes <= 1.005 * inside and not warned

    # A large output returned beside a loss computed inside, which no gradient reaches (its
    # hook is called with None), and a large output summed (its gradient an expanded scalar):
    # nothing allocated outside, nothing to warn of.
    class LossAndHidden(nn.Module):
        def forward(self, idx, targets):
            hidden = torch.tanh(model.body(model.emb(idx)))
            return F.cross_entropy(model.head(hidden).flatten(0, 1), targets.flatten()), hidden * 2

    zero_grads(model)
    own = fxmem.optimize(LossAndHidden(), 1.0, example_inputs=(idx, targets), compiler="eager").plan.floor_bytes
    m = fxmem.optimize(LossAndHidden(), 1.005 * own / 2**30, compiler="eager")
    for call in (lambda: m(idx, targets)[0].backward(), lambda: m(idx, targets)[1].sum().backward()):
        call()
        zero_grads(model)
        _, warned = _warned(fxmem.LossOutsideWarning, call)
        assert not warned
        zero_grads(model)
    # Outside again, with room for it below the budget: no warning.
    zero_grads(model)
    m = fxmem.optimize(logits_only, 4 * budget / 2**30, compiler="eager")
    outside(m, idx, targets)
    zero_grads(model)
    got, warned = _warned(fxmem.LossOutsideWarning, outside, m, idx, targets)
    assert got.peak_bytes <= 4 * budget and not warned


class _ReturnsItsFeatures(nn.Module):
    """A head over normalised features that it returns beside the loss (a model handing its
    hidden states to the caller): the head's weight gradient reads them in the backward."""

    def __init__(self, vocab: int = 512, d: int = 64, layers: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block(x)
        features = self.norm(x)
        loss = F.cross_entropy(self.head(features).flatten(0, 1), targets.flatten())
        return loss, features


def test_a_kept_output_the_backward_reads_is_saved_not_recomputed():
    """The features the step returns stay alive through the backward whatever the plan saves:
    saving them for the head's gradient costs nothing, and recomputing them would make a second
    copy. At the floor the plan reads the kept ones, and the step measures what it predicts."""
    torch.manual_seed(0)
    model = _ReturnsItsFeatures()
    idx = torch.randint(0, 512, (8, 256))
    batch = (idx, torch.roll(idx, -1, dims=1))
    _keeping_the_loss(model, *batch)
    ref = grads_of(model)
    zero_grads(model)
    with pytest.raises(fxmem.BudgetError) as e:
        fxmem.optimize(model, 1e-6, example_inputs=batch, compiler="eager")
    budget = e.value.floor_bytes
    del e
    m = fxmem.optimize(model, budget / 2**30, example_inputs=batch, compiler="eager")
    _holding_the_output(m, *batch)
    zero_grads(model)
    assert not [d.name for d in m.plan.recomputed if d.module == "norm"], m.plan.summary()
    returned = [d.nbytes for d in m.plan.saved if d.reason.startswith("returned by the step")]
    assert returned == [8 * 256 * 64 * 4], m.plan.summary()  # the features, read by the head's gradient
    got = fxmem.measure(_holding_the_output, m, *batch)
    assert got.peak_bytes <= budget, (got.peak_bytes / MiB, budget / MiB)
    assert abs(got.peak_bytes - m.plan.predicted_peak_bytes) <= 0.005 * got.peak_bytes, (
        got.peak_bytes / MiB,
        m.plan.predicted_peak_bytes / MiB,
    )
    assert max_rel_err(grads_of(model), ref) < 1e-5

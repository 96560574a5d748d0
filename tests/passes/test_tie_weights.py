"""tie_weights: detection in every plan, tying only on request, safetensors round trips."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from conftest import grads_of, max_rel_err, small_gpt, step
from fxmem.passes import tie_weights as tw

import fxmem

safetensors_torch = pytest.importorskip("safetensors.torch")


def _untied_checkpoint():
    """A GPT whose LM head holds the embedding's values in a tensor of its own."""
    model, batch = small_gpt()
    with torch.no_grad():
        model.lm_head.weight.copy_(model.wte.weight)
    return model, batch


def test_detects_candidates_and_ties_nothing_unasked():
    model, batch = _untied_checkpoint()
    m = fxmem.optimize(model, budget_gb=1.0, compiler="eager", example_inputs=batch)
    assert m.plan.tie_candidates == [["wte.weight", "lm_head.weight"]]
    assert m.plan.tied_weights == []
    assert "tie_weights" not in m.plan.rewrites
    assert model.lm_head.weight is not model.wte.weight


def test_constant_tensors_are_not_candidates():
    # Every LayerNorm weight is all ones at init: equal values, not one weight.
    model, _ = small_gpt()
    report = tw.detect(model)
    assert report.candidates == []
    assert report.shared == []


def test_detects_candidates_past_float32_integer_range():
    """Sampled positions stay inside a tensor of more than 2**24 elements (a GPT-2 embedding
    has 38.6M), where a float32 position would round past its last element."""
    n = 2**24 + 4  # float32(n - 1) == n
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.arange(n, dtype=torch.bfloat16))
    model.b = torch.nn.Parameter(model.a.detach().clone())
    model.c = torch.nn.Parameter(model.a.detach().flip(0))
    assert tw.detect(model).candidates == [["a", "b"]]


def test_tie_true_ties_counts_once_and_trains_like_a_tied_model():
    model, batch = _untied_checkpoint()
    reference, _ = _untied_checkpoint()
    reference.lm_head.weight = reference.wte.weight  # tied by hand, in eager
    m = fxmem.optimize(model, budget_gb=1.0, compiler="eager", tie_weights=True, example_inputs=batch)
    assert model.lm_head.weight is model.wte.weight
    assert m.plan.rewrites["tie_weights"] == 1
    assert m.plan.tied_weights == [["wte.weight", "lm_head.weight"]]
    assert m.plan.tie_candidates == []
    untied = fxmem.optimize(_untied_checkpoint()[0], budget_gb=1.0, compiler="eager", example_inputs=batch)
    head = model.lm_head.weight
    assert untied.plan.breakdown["parameters"] - m.plan.breakdown["parameters"] == head.numel() * head.element_size()
    loss = step(m, *batch)
    loss_ref = step(reference, *batch)
    assert torch.allclose(loss, loss_ref, rtol=1e-5)
    assert max_rel_err(grads_of(model), grads_of(reference)) < 1e-4


def test_a_copy_of_a_tied_module_stays_tied_and_says_so(tmp_path):
    model, batch = _untied_checkpoint()
    m = fxmem.optimize(model, budget_gb=1.0, compiler="eager", tie_weights=True)
    torch.save(m, tmp_path / "m.pt")
    for c in (copy.deepcopy(m), torch.load(tmp_path / "m.pt", weights_only=False)):
        assert c.module.lm_head.weight is c.module.wte.weight
        step(c, *batch)
        assert c.plan.rewrites["tie_weights"] == 1
        assert c.plan.tied_weights == [["wte.weight", "lm_head.weight"]]


def test_named_pairs_and_refusals():
    model, batch = small_gpt()  # values differ: a named pair is still tied, to the first name
    wte = model.wte.weight
    fxmem.optimize(model, budget_gb=1.0, compiler="eager", tie_weights=[("wte.weight", "lm_head.weight")])
    assert model.lm_head.weight is wte
    with pytest.raises(ValueError, match="differ"):
        fxmem.optimize(small_gpt()[0], budget_gb=1.0, tie_weights=[("wte.weight", "wpe.weight")])
    with pytest.raises(ValueError, match="not a parameter"):
        fxmem.optimize(small_gpt()[0], budget_gb=1.0, tie_weights=[("wte.weight", "nope.weight")])
    with pytest.raises(ValueError, match="pairs"):
        fxmem.optimize(small_gpt()[0], budget_gb=1.0, tie_weights=["wte.weight"])
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="fxmem.optimize"):
        torch.compile(small_gpt()[0], backend="fxmem", options={"budget_gb": 1.0, "tie_weights": True})(*batch)


def test_failed_optimize_unties():
    model, batch = _untied_checkpoint()
    head = model.lm_head.weight
    with pytest.raises(fxmem.BudgetError):
        fxmem.optimize(model, budget_gb=1e-6, compiler="eager", tie_weights=True, example_inputs=batch)
    assert model.lm_head.weight is head
    assert model.lm_head.weight is not model.wte.weight


def test_safetensors_round_trip_of_a_tied_model(tmp_path):
    model, batch = _untied_checkpoint()
    m = fxmem.optimize(model, budget_gb=1.0, compiler="eager", tie_weights=True)
    step(m, *batch)
    path = os.fspath(tmp_path / "model.safetensors")
    with pytest.raises(RuntimeError):  # save_file refuses shared tensors; save_model handles them
        safetensors_torch.save_file(m.state_dict(), path)
    safetensors_torch.save_model(m, path)
    fresh, _ = small_gpt(seed=1)
    fresh.lm_head.weight = fresh.wte.weight
    safetensors_torch.load_model(fresh, path)
    assert fresh.lm_head.weight is fresh.wte.weight
    for (k, a), (_, b) in zip(fresh.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_tie_true_leaves_repeated_blocks_built_as_copies_untied():
    """nn.TransformerEncoder deep-copies one layer: every layer's weights are equal at init, and
    tie_weights=True made the four layers one (34209 parameters -> 9345)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
    count = sum(p.numel() for p in model.parameters())
    assert tw.detect(model).candidates  # equal, so listed
    with pytest.warns(UserWarning, match="block indices"):
        m = fxmem.optimize(model, 1.0, compiler="eager", tie_weights=True)
    assert sum(p.numel() for p in m.parameters()) == count
    assert model.layers[0].linear1.weight is not model.layers[3].linear1.weight
    # named, they are tied
    fxmem.optimize(model, 1.0, compiler="eager", tie_weights=[("layers.0.linear1.weight", "layers.1.linear1.weight")])
    assert model.layers[0].linear1.weight is model.layers[1].linear1.weight

"""chunked_mlp: a transformer MLP runs over chunks of rows, exactly, and lowers the floor."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _graphs import apply_pass, calls, capture, compare_with_eager, run_graph
from conftest import grads_of, max_rel_err, step, zero_grads
from fxmem.passes.chunked_mlp import chunked_mlp

import fxmem
from fxmem.pipeline import run_passes
from fxmem.testing import ViT, ViTConfig, vit_batch

TOL = 1e-5


class MLP(nn.Module):
    def __init__(self, width=32, ratio=4, act=F.gelu, gated=False):
        super().__init__()
        self.fc1 = nn.Linear(width, ratio * width, bias=not gated)  # gated: Llama's, no biases
        self.up = nn.Linear(width, ratio * width, bias=False) if gated else None
        self.fc2 = nn.Linear(ratio * width, width)
        self.act = act

    def forward(self, x):
        h = self.act(self.fc1(x))
        if self.up is not None:
            h = h * self.up(x)
        return self.fc2(h)


def _rows(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).requires_grad_()


def _split(fn, *args):
    return apply_pass(chunked_mlp, fn, *args)


def _assert_exact(module, x, gm, ex):
    leaves = [x, *module.parameters()]
    loss_err, grad_err = compare_with_eager(lambda: module(x), lambda: run_graph(gm, ex), leaves)
    assert loss_err < TOL and grad_err < TOL, (loss_err, grad_err)


@pytest.mark.parametrize(
    "act",
    [F.gelu, F.relu, F.silu, lambda h: F.gelu(h, approximate="tanh")],
    ids=["gelu", "relu", "silu", "gelu-tanh"],
)
def test_mlp_runs_in_chunks_of_rows_and_is_exact(act):
    torch.manual_seed(0)
    mlp, x = MLP(act=act), _rows(8, 40, 32)  # 320 rows, hidden 4x: 4 chunks of 2 sequences
    gm, ex, fired = _split(mlp, x)
    assert fired == 1, chunked_mlp.refusals
    fc1 = [n for n in calls(gm, F.linear) if n.meta["example_value"].shape[-1] == 128]
    assert [tuple(n.meta["example_value"].shape) for n in fc1] == [(2, 40, 128)] * 4
    _assert_exact(mlp, x, gm, ex)


def test_gated_mlp_chunks_and_its_projections_fuse_per_chunk():
    torch.manual_seed(0)
    mlp, x = MLP(act=F.silu, gated=True), _rows(2, 160, 32)  # two sequences: chunks of positions
    gm, ex = capture(mlp, x)
    gm, fired = run_passes(gm, ex, ["chunked_mlp", "fuse_projections"])
    assert fired == {"chunked_mlp": 1, "fuse_projections": 4}
    chunks = [n for n in calls(gm, F.linear) if n.meta["example_value"].shape[-1] == 256]  # gate+up
    assert [tuple(n.meta["example_value"].shape) for n in chunks] == [(2, 40, 256)] * 4
    _assert_exact(mlp, x, gm, ex)


def test_llama_mlp_from_transformers_chunks_exactly():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=172, num_hidden_layers=1, num_attention_heads=4, vocab_size=64
    )
    torch.manual_seed(0)
    mlp = transformers.LlamaForCausalLM(cfg).model.layers[0].mlp
    x = _rows(4, 64, 64)
    gm, ex, fired = _split(mlp, x)
    assert fired == 1, chunked_mlp.refusals
    assert len(calls(gm, F.silu)) == 3  # ceil(172 / 64) chunks
    _assert_exact(mlp, x, gm, ex)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: (MLP(ratio=1), _rows(8, 40, 32)), "under 2x"),
        (lambda: (MLP(), _rows(2, 40, 32)), "too few"),
        (lambda: (MLP().requires_grad_(False), torch.randn(8, 40, 32)), "needs a gradient"),
    ],
    ids=["narrow-hidden", "few-rows", "no-gradient"],
)
def test_left_alone_where_chunks_would_not_help(make, reason):
    torch.manual_seed(0)
    mlp, x = make()
    gm, _, fired = _split(mlp, x)
    assert fired == 0 and len(calls(gm, F.linear)) == 2
    assert any(reason in r for _, _, r in chunked_mlp.refusals), chunked_mlp.refusals


def test_hidden_values_used_elsewhere_are_not_split():
    class Returns(MLP):
        def forward(self, x):
            h = F.gelu(self.fc1(x))
            return self.fc2(h), h

    torch.manual_seed(0)
    _, _, fired = _split(Returns(), _rows(8, 40, 32))
    assert fired == 0
    assert any("outside" in r for _, _, r in chunked_mlp.refusals), chunked_mlp.refusals


@pytest.mark.slow
def test_vit_reaches_a_lower_floor_and_keeps_eagers_gradients():
    cfg = ViTConfig(image_size=32, patch_size=4, n_layer=2, n_head=2, n_embd=64, classes=10)
    torch.manual_seed(0)
    model = ViT(cfg)
    batch = vit_batch(cfg, 16)
    step(model, *batch)
    eager = grads_of(model)
    zero_grads(model)
    floors = {}
    for name, passes in (("without", ()), ("with", ["chunked_mlp"])):
        torch._dynamo.reset()
        with pytest.raises(fxmem.BudgetError) as e:
            fxmem.optimize(model, 1e-6, example_inputs=batch, passes=passes, compiler="eager")
        floors[name] = e.value.floor_bytes
    assert floors["with"] < 0.92 * floors["without"], floors

    budget = 1.02 * floors["with"]  # the floors' own errors and plans are alive now too
    torch._dynamo.reset()
    m = fxmem.optimize(model, budget / 2**30, compiler="eager", passes=["chunked_mlp"])
    step(m, *batch)  # plans and compiles
    zero_grads(model)
    peak = fxmem.measure(step, m, *batch).peak_bytes
    assert m.plan.rewrites == {"chunked_mlp": cfg.n_layer}
    assert m.plan.recomputed
    assert peak <= budget < floors["without"], (peak, budget, floors)
    assert max_rel_err(grads_of(model), eager) < 1e-4

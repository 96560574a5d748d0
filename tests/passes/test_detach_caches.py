"""detach_caches: returned key/value caches leave the step without a gradient, exactly.

A toy layer that returns its keys and values as HF's DynamicCache makes them on its first
update (`torch.cat` onto an empty tensor), and HF GPT-2 and Llama built from configs with
`use_cache` at its default (Mistral's sliding-window cache too): the loss and every parameter's gradient equal eager's, the caches'
values equal eager's and require grad exactly where eager's do, a backward of the loss alone
measures the zeros' bytes below the step without the pass, and a gradient sent into a cache
raises. Left alone: a cache update onto a non-empty past, a prefix of the states' own rank, a
cache that a graph break hands to a later graph, and a graph whose only differentiable outputs
are the caches.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _graphs import compare_with_eager, compile_with_pass
from conftest import grads_of, max_rel_err, zero_grads
from fxmem.passes.detach_caches import detach_caches

import fxmem
from fxmem.pipeline import default_passes

TOL = 1e-5
B, T, D, HEADS = 2, 64, 32, 4


class Layer(nn.Module):
    """Attention over projected q/k/v; returns the loss and the (keys, values) cache."""

    def __init__(self, past: str = "empty", loss: bool = True, window: int | None = None, graph_break=False):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.past, self.loss, self.window, self.graph_break = past, loss, window, graph_break

    def forward(self, x):
        q, k, v = (t.view(B, T, HEADS, D // HEADS).transpose(1, 2) for t in self.qkv(x).split(D, dim=-1))
        past = {
            "empty": lambda: torch.tensor([]),  # as HF's cache layers start
            "tokens": lambda: torch.ones(B, HEADS, 1, D // HEADS),
            "own-empty": lambda: k.new_zeros(B, HEADS, 0, D // HEADS),  # a prefix of the states' rank
        }[self.past]()
        keys, values = torch.cat([past, k], dim=-2), torch.cat([past, v], dim=-2)
        if self.graph_break:  # the attention runs in a second graph
            torch._dynamo.graph_break()
        y = F.scaled_dot_product_attention(q, keys, values)
        if self.window:  # a sliding-window layer keeps the last tokens
            keys, values = keys[:, :, -self.window :, :], values[:, :, -self.window :, :]
        return (y.square().mean(), keys, values) if self.loss else (keys, values)


def _x():
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(0), requires_grad=False)


@pytest.mark.parametrize("window", [None, 15], ids=["whole", "sliding-window"])
def test_caches_detached_and_the_loss_exact(window):
    torch.manual_seed(0)
    model, x = Layer(window=window), _x()
    compiled, seen = compile_with_pass(detach_caches, model)
    loss_err, worst = compare_with_eager(
        lambda: model(x), lambda: compiled(x), list(model.parameters()), lambda o: o[0]
    )
    assert loss_err < TOL and worst < TOL, (loss_err, worst)
    ((gm, fired),) = seen
    assert fired == 2
    assert sum(n.op == "call_method" and n.target == "detach" for n in gm.graph.nodes) == 2
    out, ref = compiled(x), model(x)
    for got, want in zip(out[1:], ref[1:], strict=True):
        assert torch.equal(got, want) and got.requires_grad
    with torch.no_grad():
        assert not any(t.requires_grad for t in compiled(x))


def test_a_gradient_into_a_cache_raises():
    torch.manual_seed(0)
    model, x = Layer(), _x()
    compiled, _ = compile_with_pass(detach_caches, model)
    loss, keys, _ = compiled(x)
    with pytest.raises(RuntimeError, match="gradient reached a key/value cache"):
        (loss + keys.sum()).backward()
    loss, keys, _ = compiled(x)
    (loss + keys.detach().sum()).backward()  # a detached cache is the caller's own
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs",
    [{"past": "tokens"}, {"past": "own-empty"}, {"loss": False}],
    ids=["onto-a-past", "own-empty-prefix", "nothing-to-hang-from"],
)
def test_left_alone(kwargs):
    # A loss on the returned values: each trains through them as eager does.
    torch.manual_seed(0)
    model, x = Layer(**kwargs), _x()
    compiled, seen = compile_with_pass(detach_caches, model)
    loss = lambda o: sum(t.sum() for t in o[int(model.loss) :]) + (o[0] if model.loss else 0)  # noqa: E731
    loss_err, worst = compare_with_eager(lambda: model(x), lambda: compiled(x), list(model.parameters()), loss)
    assert loss_err < TOL and worst < TOL, (loss_err, worst)
    ((_, fired),) = seen
    assert fired == 0


def test_a_cache_handed_to_a_later_graph_is_left_alone():
    # Across a graph break the first graph returns the cache to the second, whose backward sends
    # it a gradient: only values the graph also reads are detached.
    torch.manual_seed(0)
    model, x = Layer(graph_break=True), _x()
    model(x)[0].backward()
    ref = grads_of(model)
    zero_grads(model)
    plans = []
    compiled = torch.compile(model, backend="fxmem", options={"compiler": "eager", "on_plan": plans.append})
    compiled(x)[0].backward()
    assert len(plans) == 2 and all(p.rewrites["detach_caches"] == 0 for p in plans)
    assert max_rel_err(grads_of(model), ref) < TOL


# --- HF models with their caches --------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def backward_bytes(model, **kwargs):
    """The bytes a step's backward allocates above what is alive when it starts: there the
    compiled step's backward would get the caches' zeros. (The forward is measured too, so
    that the backward's frees of its tensors are counted exactly.)"""
    loss = fxmem.measure(lambda: model(**kwargs).loss).result
    measured = fxmem.measure(loss.backward)
    return measured.peak_bytes - measured.entry_bytes


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral"])
def test_hf_caches_cost_no_zeros(name):
    from test_hf_models import _build

    n_layer = 2
    model, kwargs = _build(name, n_layer=n_layer)
    assert model.config.use_cache
    eager = copy.deepcopy(model)
    ref_out = eager(**kwargs)
    ref_out.loss.backward()
    peaks = {}
    for with_pass in (True, False):
        torch._dynamo.reset()
        zero_grads(model)
        passes = default_passes() if with_pass else [p for p in default_passes() if p != "detach_caches"]
        m = fxmem.optimize(model, 1.0, compiler="eager", passes=passes)
        out = m(**kwargs)
        assert m.plan.rewrites.get("detach_caches", 0) == (2 * n_layer if with_pass else 0)
        ref_layers, layers = ref_out.past_key_values.layers, out.past_key_values.layers
        pairs = [(a.keys, b.keys) for a, b in zip(layers, ref_layers, strict=True)]
        pairs += [(a.values, b.values) for a, b in zip(layers, ref_layers, strict=True)]
        for got, want in pairs:
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6) and got.requires_grad
        out.loss.backward()
        assert max_rel_err(grads_of(model), grads_of(eager)) < 1e-4
        del out
        zero_grads(model)
        peaks[with_pass] = backward_bytes(m, **kwargs)
    keys = ref_out.past_key_values.layers[0].keys
    if name == "mistral":
        assert keys.shape[-2] == 63  # the window's last tokens, of 256
    zeros = 2 * n_layer * keys.numel() * keys.element_size()
    assert peaks[False] - peaks[True] >= 0.9 * zeros, (peaks, zeros)

"""fuse_projections: linears of one input become one linear on concatenated weights and a split.

Checked on captured Dynamo graphs (one linear node left, lints, forward and backward equal to
eager to 1e-5 relative) and end to end through `fxmem.optimize` (state_dict unchanged, gradients
on the original parameters). Refusals: weights of different dtype, a frozen weight beside trained
ones, biases on some only, an input computed after the first projection, a lone linear.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from _graphs import calls, capture, compare_with_eager, compile_with_pass, grad_err
from conftest import grads_of, step, zero_grads
from fxmem.passes.fuse_projections import fuse_projections

import fxmem

TOL = 1e-5
C = 32


class QKV(nn.Module):
    """Separate q/k/v projections of one input (HF Llama/BERT attention), sizes as GQA makes them."""

    def __init__(self, bias=True, sizes=(C, C, C)):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(C, n, bias=bias) for n in sizes)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        return (q[..., : k.shape[-1]] * k).sum(-1, keepdim=True) * v[..., :1] + q.mean()


class SwiGLU(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden=88):
        super().__init__()
        self.gate = nn.Linear(C, hidden, bias=False)
        self.up = nn.Linear(C, hidden, bias=False)
        self.down = nn.Linear(hidden, C, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _TwoGroups(nn.Module):
    """q/k/v feeding a SwiGLU: two groups in one graph."""

    def __init__(self):
        super().__init__()
        self.attn, self.mlp = QKV(False), SwiGLU()

    def forward(self, x):
        return self.mlp(self.attn(x).expand(-1, -1, C) + x)


class _Loss(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).square().mean()


def _x(seed=0):
    return torch.randn(2, 8, C, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def _fuse(model, x):
    gm, ex = capture(model, x)
    gm, fired = fuse_projections(gm, ex)
    gm.graph.lint()
    return gm, ex, fired


def _assert_exact(model, x):
    """Through a backend that runs only fuse_projections: output, and grads of x and every parameter."""
    compiled, seen = compile_with_pass(fuse_projections, model)
    leaves = [x, *model.parameters()]
    loss = lambda y: (y * torch.linspace(-1, 1, y.shape[-1])).sum()  # noqa: E731
    loss_err, worst = compare_with_eager(lambda: model(x), lambda: compiled(x), leaves, loss)
    assert loss_err < TOL and worst < TOL, (loss_err, worst)
    return seen[0]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("sizes", [(C, C, C), (C, C // 2, C // 2)], ids=["same", "gqa"])
def test_qkv_fused_exact(bias, sizes):
    torch.manual_seed(0)
    model = QKV(bias, sizes)
    gm, fired = _assert_exact(model, _x())
    assert fired == 1
    (linear,) = calls(gm, F.linear)
    assert linear.meta["example_value"].shape[-1] == sum(sizes)
    assert len(calls(gm, torch.cat)) == (2 if bias else 1)
    (split,) = calls(gm, "split")
    assert list(split.args[1]) == list(sizes)


def test_swiglu_gate_up_fused_exact():
    torch.manual_seed(0)
    gm, fired = _assert_exact(SwiGLU(), _x())
    assert fired == 1
    assert len(calls(gm, F.linear)) == 2  # gate+up fused, down alone


def test_two_groups_in_one_graph():
    torch.manual_seed(0)
    gm, fired = _assert_exact(_TwoGroups(), _x())
    assert fired == 2
    assert len(calls(gm, F.linear)) == 3


class _ParallelBlock(nn.Module):
    """Cohere's layer: the attention and the feed-forward both read one normed input, the
    feed-forward after the attention (its output projection a matmul between them)."""

    def __init__(self):
        super().__init__()
        self.attn, self.o, self.mlp = QKV(False), nn.Linear(C, C, bias=False), SwiGLU()

    def forward(self, x):
        h = F.layer_norm(x, (C,))
        return x + self.o(self.attn(h).expand(-1, -1, C)) + self.mlp(h)


def test_projections_with_a_matmul_between_them_are_fused_apart():
    """q/k/v, then the attention's output projection, then gate/up: two fused groups, made
    where the unfused projections were (fused as one, gate/up would be made before the
    attention and q/k/v held through the feed-forward)."""
    torch.manual_seed(0)
    gm, fired = _assert_exact(_ParallelBlock(), _x())
    assert fired == 2
    fused = [n for n in calls(gm, F.linear) if n.meta["example_value"].shape[-1] > C]
    assert sorted(n.meta["example_value"].shape[-1] for n in fused) == [3 * C, 2 * 88]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    out_proj, _down = [n for n in calls(gm, F.linear) if n not in fused]  # graph order
    qkv, gate_up = sorted(fused, key=order.__getitem__)
    assert order[qkv] < order[out_proj] < order[gate_up]


def test_end_to_end_state_dict_and_gradients_land_on_original_parameters():
    torch.manual_seed(0)
    model = _Loss(QKV(True, (C, C // 2, C // 2)))
    keys = {k: v.shape for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    x = _x()
    ref = step(model, x)
    ref_grads = grads_of(model)
    zero_grads(model)
    m = fxmem.optimize(model, 4.0, compiler="eager")
    got = step(m, x)
    assert m.plan.rewrites["fuse_projections"] == 1
    assert {k: v.shape for k, v in m.state_dict().items()} == keys
    assert all(p is params[n] for n, p in m.named_parameters())
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    assert torch.allclose(got, ref, rtol=TOL)
    assert grad_err(grads_of(model), ref_grads) < TOL


def test_llama_projections_fused_exact():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager")
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    ref = step(model, input_ids=ids, labels=ids)
    ref_grads = grads_of(model)
    zero_grads(model)
    m = fxmem.optimize(model, 4.0, compiler="eager", passes=("fuse_projections",))
    got = step(m, input_ids=ids, labels=ids)
    assert m.plan.rewrites == {"fuse_projections": 4}  # q/k/v and gate/up in each of 2 layers
    assert torch.allclose(got, ref, rtol=TOL)
    assert grad_err(grads_of(model), ref_grads) < TOL


def test_fused_with_inductor():
    torch.manual_seed(0)
    model = _Loss(_TwoGroups())
    x = _x()
    ref = step(model, x)
    ref_grads = grads_of(model)
    zero_grads(model)
    m = fxmem.optimize(model, 4.0, passes=("fuse_projections",))  # inductor
    got = step(m, x)
    assert m.plan.rewrites == {"fuse_projections": 2}
    assert torch.allclose(got, ref, rtol=TOL)
    assert grad_err(grads_of(model), ref_grads) < 1e-4  # inductor's kernels reorder sums


# --- refusals --------------------------------------------------------------------------------------


def test_single_linear_untouched():
    torch.manual_seed(0)
    model = nn.Linear(C, C)
    gm, _, fired = _fuse(model, _x())
    assert fired == 0 and len(calls(gm, F.linear)) == 1 and not calls(gm, torch.cat)


def test_frozen_weight_beside_trained_ones_is_refused():
    torch.manual_seed(0)
    model = QKV(False)
    model.k.weight.requires_grad_(False)
    gm, _, fired = _fuse(model, _x())
    assert fired == 0 and len(calls(gm, F.linear)) == 3
    # end to end: the frozen weight gets no gradient, the others eager's
    x = _x()
    model(x).sum().backward()
    ref = grads_of(model)
    zero_grads(model)
    torch._dynamo.reset()
    m = fxmem.optimize(model, 4.0, compiler="eager")
    m(x).sum().backward()
    assert m.plan.rewrites["fuse_projections"] == 0
    assert model.k.weight.grad is None
    assert grad_err(grads_of(model), ref) < TOL


def test_all_frozen_still_fused():
    torch.manual_seed(0)
    model = QKV(True)
    model.requires_grad_(False)
    _, _, fired = _fuse(model, _x())
    assert fired == 1


def test_bias_on_some_only_is_refused():
    torch.manual_seed(0)
    model = QKV(True)
    model.k = nn.Linear(C, C, bias=False)
    _, _, fired = _fuse(model, _x())
    assert fired == 0


def test_a_projection_written_in_place_is_refused():
    """fairseq's `q = self.q(x); q *= self.scaling`: fused, q is a view of one output, which
    autograd does not let be written in place (the first call failed)."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = nn.Linear(C, C), nn.Linear(C, C)

        def forward(self, x):
            q = self.q(x)
            q *= 0.25
            return q @ self.k(x).transpose(-1, -2)

    torch.manual_seed(0)
    model = Scaled()
    gm, _, fired = _fuse(model, _x())
    assert fired == 0 and len(calls(gm, F.linear)) == 2
    _assert_exact(model, _x())


def test_input_computed_after_the_first_projection_is_refused():
    # k's weight depends on q: one matmul cannot produce both.
    class Dependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(C, C)
            self.w = nn.Parameter(torch.randn(C, C))

        def forward(self, x):
            q = self.q(x)
            k = F.linear(x, self.w * q.mean())
            return (q * k).sum()

    torch.manual_seed(0)
    model = Dependent()
    gm, _, fired = _fuse(model, _x())
    assert fired == 0 and len(calls(gm, F.linear)) == 2


def _graph_of_two_linears(w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> fx.GraphModule:
    """A two-linear graph built by hand, with the example values a Dynamo graph carries."""

    def f(x, w1, w2):
        return F.linear(x, w1), F.linear(x, w2)

    gm = fx.symbolic_trace(f)
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), (x, w1, w2), strict=True):
        node.meta["example_value"] = value
    return gm


def test_weights_of_different_dtype_are_refused():
    x = torch.randn(4, C)
    gm = _graph_of_two_linears(torch.randn(C, C), torch.randn(C, C, dtype=torch.float64), x)
    gm, fired = fuse_projections(gm)
    assert fired == 0
    gm = _graph_of_two_linears(torch.randn(C, C), torch.randn(C // 2, C), x)  # and the control
    gm, fired = fuse_projections(gm)
    gm.graph.lint()
    assert fired == 1
    w1, w2 = torch.randn(C, C), torch.randn(C // 2, C)
    a, b = gm(x, w1, w2)
    assert torch.allclose(a, F.linear(x, w1), rtol=TOL, atol=1e-6)
    assert torch.allclose(b, F.linear(x, w2), rtol=TOL, atol=1e-6)


def test_linears_of_different_inputs_untouched():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(C, C), nn.Linear(C, C)

        def forward(self, x):
            return self.a(x) + self.b(x * 2)

    torch.manual_seed(0)
    _, _, fired = _fuse(TwoInputs(), _x())
    assert fired == 0

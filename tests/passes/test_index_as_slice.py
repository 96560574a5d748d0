"""index_as_slice: `x[..., [c], :]` and other constant consecutive list indices become slices.

On captured Dynamo graphs: the forms that fire (negative, positive, several consecutive
positions, before and after an Ellipsis, a bare list), forward and gradients equal to eager's;
through inductor, the multi-query attention split where inductor's gradients of the list index
are wrong (Falcon's), now eager's; and HF Falcon end to end through `fxmem.optimize`.
Refusals: positions not consecutive, several list indices, the source written in place, the
indexed value returned.
"""

from __future__ import annotations

import operator

import pytest
import torch
from _graphs import capture, compare_with_eager, compile_with_pass, grad_err
from conftest import grads_of, step, zero_grads
from fxmem.passes.index_as_slice import as_slice, index_as_slice

import fxmem

TOL = 1e-5
B, T, H, D = 2, 16, 4, 32


def _list_indices(gm):
    return [
        n
        for n in gm.graph.nodes
        if n.target is operator.getitem and any(isinstance(e, list) for e in _entries(n.args[1]))
    ]


def _entries(index):
    return index if isinstance(index, tuple) else (index,)


FORMS = {
    "last-but-one": lambda x: x[..., [-2], :],
    "positive": lambda x: x[:, :, [5]],
    "range": lambda x: x[:, [1, 2, 3]],
    "negative-range": lambda x: x[..., [-3, -2, -1], :],
    "bare-list": lambda x: x[[1]],
    "after-slices": lambda x: x[:, 2:, [4, 5], ::2],
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_forms_become_slices_with_eagers_values(form):
    pick = FORMS[form]
    x = torch.randn(B, T, H + 2, D, requires_grad=True)
    w = torch.randn_like(pick(x))

    def f(x):
        return pick(x * 2) * w  # of an activation: the caller's own tensors are refused

    gm, ex = capture(f, x)
    gm, fired = index_as_slice(gm, ex)
    gm.graph.lint()
    assert fired == 1 and not _list_indices(gm), gm.code
    compiled, seen = compile_with_pass(index_as_slice, f)
    loss_err, worst = compare_with_eager(lambda: f(x), lambda: compiled(x), [x], lambda out: out.square().sum())
    assert loss_err < TOL and worst < TOL
    assert seen[0][1] == 1


def _multi_query(x, q):
    """Falcon's split of a fused q/k/v with one key/value head, then attention scores."""
    x = x * 2  # the fused projection's output
    k = x[..., [-2], :].transpose(1, 2)  # (B, 1, T, D), broadcast over q's heads
    v = x[..., [-1], :].transpose(1, 2)
    return (torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v).square().sum()


def test_multi_query_split_gradients_right_through_inductor():
    from torch._inductor.compile_fx import compile_fx

    torch.manual_seed(0)
    x = torch.randn(B, T, H + 2, D, requires_grad=True)
    q = torch.randn(B, H, T, D, requires_grad=True)
    _multi_query(x, q).backward()
    ref = {"x": x.grad.clone(), "q": q.grad.clone()}
    x.grad = q.grad = None
    fired = []

    def pass_then_inductor(gm, ex):
        gm, n = index_as_slice(gm, ex)
        fired.append(n)
        return compile_fx(gm, ex)

    torch.compile(_multi_query, backend=pass_then_inductor)(x, q).backward()
    assert fired == [2]
    assert grad_err({"x": x.grad, "q": q.grad}, ref) < TOL


def test_falcon_end_to_end():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.FalconConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    assert cfg.multi_query
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM._from_config(cfg, attn_implementation="eager").train()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    ref_loss = step(model, input_ids=ids, labels=ids)
    ref = grads_of(model)
    zero_grads(model)
    m = fxmem.optimize(model, 4.0)  # inductor
    loss = step(m, input_ids=ids, labels=ids)
    # the key's and the value's; Falcon from transformers 5.25 splits its heads without list
    # indices (`split`), and nothing is rewritten
    split_by_lists = hasattr(transformers.models.falcon.modeling_falcon.FalconAttention, "_split_heads")
    assert m.plan.rewrites["index_as_slice"] == (2 if split_by_lists else 0)
    assert torch.allclose(loss, ref_loss, rtol=TOL)
    assert grad_err(grads_of(model), ref) < 1e-4


def test_the_caller_may_write_its_input_between_forward_and_backward():
    """Eager saves the list index's copy; a slice of the input saved instead would see the write."""

    class Pick(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(D, D, generator=torch.Generator().manual_seed(0)))

        def forward(self, x):
            return (x[:, [1, 2, 3]] @ self.w).square().sum()

    model, x0 = Pick(), torch.randn(B, T, D)

    def step_then_write(m):
        x = x0.clone()
        loss = m(x)
        x.add_(1)
        loss.backward()
        return model.w.grad

    ref = step_then_write(model).clone()
    model.w.grad = None
    got = step_then_write(fxmem.optimize(model, 1.0))  # inductor
    assert torch.allclose(got, ref, rtol=TOL, atol=TOL)


# --- refusals ---------------------------------------------------------------------------------------


def _returns_view(x):
    return x[..., [-2], :]


def _written_after(x):
    y = x * 2
    k = y[..., [1], :]
    y.add_(1)  # k is a copy: it does not see this
    return (k * y[..., :1, :]).sum()


def _written_index(x):
    k = (x * 2)[..., [1], :]
    k.mul_(3)
    return k.sum()


REFUSED = {
    "not-consecutive": (lambda x: (x[..., [0, 2], :] * 2).sum(), "not consecutive"),
    "two-lists": (lambda x: (x[[0], :, [1]] * 2).sum(), "no single list"),
    "source-written": (_written_after, "written in place"),
    "index-written": (_written_index, "written in place"),
    "returned": (_returns_view, "returned"),
    "callers-input": (lambda x: (x[..., [1], :] * 2).sum(), "the caller's"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_and_untouched(name):
    f, reason = REFUSED[name]
    x = torch.randn(B, T, H + 2, D, requires_grad=True)
    gm, ex = capture(f, x)
    reasons = [str(as_slice(n)) for n in _list_indices(gm)]
    assert reasons and any(reason in r for r in reasons), reasons
    gm, fired = index_as_slice(gm, ex)
    assert fired == 0
    assert _list_indices(gm)
    compiled, _ = compile_with_pass(index_as_slice, f)
    loss_err, worst = compare_with_eager(lambda: f(x), lambda: compiled(x), [x], lambda out: out.square().sum())
    assert loss_err < TOL and worst < TOL

"""chunked_attention: SDPA that runs its math form is split into groups of heads (and sequences).

The math form is what CPU SDPA runs with dropout, with a value head size other than the query's,
or with a mask that needs a gradient; the exactness tests use the last two (no random draws), so
outputs and gradients compare with eager to 1e-5. Dropout is checked by what it must do, and a
GPT with dropout end to end: a lower floor, held, with the gradients of fxmem's own
unconstrained step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _graphs import assert_dropped_attention_weights, calls, capture, compare_with_eager, run_graph
from conftest import grads_of, max_rel_err, step, zero_grads
from fxmem.passes.chunked_attention import chunked_attention

import fxmem
from fxmem.pipeline import default_passes
from fxmem.testing import GPT, GPTConfig, gpt_batch

B, H, T, D = 2, 4, 32, 4  # 32 keys of width 4: the weights are 8x q, so 8 groups are wanted
TOL = 1e-5


def _tensors(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


def _split(fn, *args):
    gm, ex = capture(fn, *args)
    chunked_attention.refusals.clear()
    gm, fired = chunked_attention(gm, ex)
    gm.graph.lint()
    return gm, ex, fired


def _assert_exact(fn, args, gm, ex):
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    weight = torch.randn(run_graph(gm, ex).shape, generator=torch.Generator().manual_seed(1))
    loss_err, grad_err = compare_with_eager(
        lambda: fn(*args), lambda: run_graph(gm, ex), leaves, lambda out: (out * weight).sum()
    )
    assert loss_err < TOL and grad_err < TOL, (loss_err, grad_err)


def wide_values(q, k, v):  # a value head size other than q's: no fused CPU kernel
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_math_attention_splits_by_heads_then_sequences_and_is_exact():
    args = _tensors((B, H, T, D), (B, H, T, D), (B, H, T, 2 * D))
    gm, ex, fired = _split(wide_values, *args)
    assert fired == 1, chunked_attention.refusals
    sdpa = calls(gm, F.scaled_dot_product_attention)
    assert len(sdpa) == H * B  # 4 heads are not 8 groups: each sequence on its own too
    assert all(tuple(n.meta["example_value"].shape) == (1, 1, T, 2 * D) for n in sdpa)
    assert all(n.kwargs["is_causal"] for n in sdpa)
    _assert_exact(wide_values, args, gm, ex)


def test_groups_are_as_few_as_keep_one_group_no_larger_than_q():
    args = _tensors((B, H, 8, D), (B, H, 8, D), (B, H, 8, 2 * D))  # weights 2x q: 2 groups
    gm, ex, fired = _split(wide_values, *args)
    assert fired == 1
    sdpa = calls(gm, F.scaled_dot_product_attention)
    assert [tuple(n.meta["example_value"].shape) for n in sdpa] == [(B, H // 2, 8, 2 * D)] * 2
    _assert_exact(wide_values, args, gm, ex)


@pytest.mark.parametrize("shape", [(B, H, T, T), (B, 1, T, T), (T, T), (1, H, T, T)])
def test_a_mask_with_a_gradient_goes_with_its_group(shape):
    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    args = _tensors((B, H, T, D), (B, H, T, D), (B, H, T, D), shape)  # mask.requires_grad: math
    gm, ex, fired = _split(fn, *args)
    assert fired == 1, chunked_attention.refusals
    assert len(calls(gm, F.scaled_dot_product_attention)) == H * B
    _assert_exact(fn, args, gm, ex)  # the mask's gradient too


def test_gqa_groups_keep_whole_key_value_heads():
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    args = _tensors((B, H, T, D), (B, 2, T, D), (B, 2, T, 2 * D))
    gm, ex, fired = _split(fn, *args)
    assert fired == 1, chunked_attention.refusals
    sdpa = calls(gm, F.scaled_dot_product_attention)
    # two key/value heads: two groups of two query heads each, then each sequence
    assert len(sdpa) == 2 * B
    assert all(n.args[0].meta["example_value"].shape[1] == 2 for n in sdpa)
    assert all(n.args[1].meta["example_value"].shape[1] == 1 for n in sdpa)
    _assert_exact(fn, args, gm, ex)


def test_dropout_still_drops_weights_at_rate_p():
    # With v = I the output is the dropped-out weights: every entry is 0 or weight / (1 - p),
    # and about p of them are 0. The groups draw their own masks: the distribution is the same.
    p, t = 0.5, 32
    q, k = _tensors((8, H, t, D), (8, H, t, D))
    v = torch.eye(t).expand(8, H, t, t).contiguous()

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p)

    gm, ex, fired = _split(fn, q, k, v)
    assert fired == 1, chunked_attention.refusals
    torch.manual_seed(0)
    # 8*4*32*32 = 32768 draws: 5 sigma is +-0.014
    assert_dropped_attention_weights(run_graph(gm, ex), q, k, p, band=0.03, scale=D**-0.5)


def test_fused_kernel_and_short_sequences_are_left_alone():
    same = _tensors((B, H, T, D), (B, H, T, D), (B, H, T, D))
    gm, _, fired = _split(wide_values, *same)  # CPU flash attention runs this
    assert fired == 0 and len(calls(gm, F.scaled_dot_product_attention)) == 1
    assert any("fused kernel" in r for _, _, r in chunked_attention.refusals)
    short = _tensors((B, H, 4, D), (B, H, 4, D), (B, H, 4, 2 * D))  # weights no larger than q
    _, _, fired = _split(wide_values, *short)
    assert fired == 0
    assert any("no larger than q" in r for _, _, r in chunked_attention.refusals)
    flat = _tensors((B * H, T, D), (B * H, T, D), (B * H, T, 2 * D))  # 3-D: no heads to group
    gm, ex, fired = _split(wide_values, *flat)
    assert fired == 0 and any("not 4-D" in r for _, _, r in chunked_attention.refusals)
    _assert_exact(wide_values, flat, gm, ex)


def test_attention_under_autocast_splits_and_is_exact():
    # Under autocast SDPA casts q, k and v to bf16 itself: the groups' values are made under
    # the same autocast, or the fp32 keys and bf16 queries would not meet.
    def fn(q, k, v, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return wide_values(q @ w, k, v)  # bf16 queries, fp32 keys and values

    q, k, v, w = _tensors((B, H, T, D), (B, H, T, D), (B, H, T, 2 * D), (D, D))
    gm, ex, fired = _split(fn, q, k, v, w)
    assert fired == 1, chunked_attention.refusals
    assert all(n.meta["example_value"].dtype == torch.bfloat16 for n in calls(gm, F.scaled_dot_product_attention))
    assert run_graph(gm, ex).dtype == torch.bfloat16
    _assert_exact(fn, [q, k, v, w], gm, ex)


@pytest.mark.slow
def test_gpt_with_dropout_reaches_a_lower_floor_and_keeps_its_gradients():
    cfg = GPTConfig(vocab_size=512, block_size=128, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    torch.manual_seed(0)
    model = GPT(cfg)
    batch = gpt_batch(cfg, 4, 128)
    without = [p for p in default_passes() if p != "chunked_attention"]
    floors = {}
    for name, passes in (("without", without), ("with", None)):
        torch._dynamo.reset()
        with pytest.raises(fxmem.BudgetError) as e:
            fxmem.optimize(model, 1e-6, example_inputs=batch, passes=passes, compiler="eager")
        floors[name] = e.value.floor_bytes
    assert floors["with"] < 0.9 * floors["without"], floors

    results = []
    tight_budget = 1.1 * floors["with"]  # the floors' own errors and plans are alive now too
    for budget_gb in (tight_budget / 2**30, 4.0):
        torch._dynamo.reset()
        m = fxmem.optimize(model, budget_gb, compiler="eager")  # inductor: tests/test_simulate.py
        torch.manual_seed(7)
        step(m, *batch)  # compiles; its dropout draws are not compared
        zero_grads(model)
        torch.manual_seed(7)
        peak = fxmem.measure(step, m, *batch).peak_bytes
        results.append((grads_of(model), m.plan, peak))
        zero_grads(model)
    (tight, tight_plan, tight_peak), (free, _, _) = results
    assert tight_plan.rewrites["chunked_attention"] == cfg.n_layer
    assert tight_plan.recomputed, "the tight plan must recompute something"
    assert tight_peak <= tight_budget < floors["without"], (tight_peak, floors)
    assert max_rel_err(tight, free) < 1e-5


CAP = 2.0  # scores of 32 keys of width 4 reach it: the cap bends them


def softcapped(q, k, v, mask, p=0.0):  # Gemma 2's eager attention
    att = torch.matmul(q, k.transpose(2, 3)) * D**-0.5
    att = torch.tanh(att / CAP) * CAP + mask
    att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(F.dropout(att, p=p, training=True), v)


@pytest.mark.parametrize("shape", [(B, 1, T, T), (B, H, T, T), (T, T)])
def test_softcapped_attention_splits_into_groups_and_is_exact(shape):
    q, k, v, mask = _tensors((B, H, T, D), (B, H, T, D), (B, H, T, D), shape)
    mask.requires_grad_(len(shape) == 4 and shape[1] == H)  # a gradient for the full mask only
    gm, ex, fired = _split(softcapped, q, k, v, mask)
    assert fired == 1, chunked_attention.refusals
    caps = calls(gm, torch.tanh)
    assert len(caps) == H * B  # 8 groups wanted: every head of every sequence
    assert all(tuple(n.meta["example_value"].shape) == (1, 1, T, T) for n in caps)
    _assert_exact(softcapped, [q, k, v, mask], gm, ex)


def test_softcapped_attention_with_dropout_drops_weights_at_rate_p():
    p, t = 0.5, 32
    q, k = _tensors((8, H, t, D), (8, H, t, D))
    v = torch.eye(t).expand(8, H, t, t).contiguous()
    zeros = torch.zeros(t, t)

    def fn(q, k, v):
        return softcapped(q, k, v, zeros, p)

    gm, ex, fired = _split(fn, q, k, v)
    assert fired == 1, chunked_attention.refusals
    assert len(calls(gm, torch.tanh)) == 8  # 8 groups: every head of two sequences at a time
    torch.manual_seed(0)
    assert_dropped_attention_weights(run_graph(gm, ex), q, k, p, band=0.03, scale=D**-0.5, cap=CAP)


@pytest.mark.parametrize("shape", [(1, H, T, D), (B, 1, T, D)], ids=["one-sequence", "one-head"])
def test_softcapped_attention_with_values_broadcast_over_the_keys_is_left_alone(shape):
    q, k, v, mask = _tensors((B, H, T, D), (B, H, T, D), shape, (T, T))
    gm, ex, fired = _split(softcapped, q, k, v, mask)
    assert fired == 0 and len(calls(gm, torch.tanh)) == 1
    assert any("values with other" in r for _, _, r in chunked_attention.refusals), chunked_attention.refusals
    _assert_exact(softcapped, [q, k, v, mask], gm, ex)


def test_softcapped_attention_with_a_cap_held_in_a_tensor_is_left_alone():
    def fn(q, k, v, cap):
        att = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * D**-0.5 / cap) * cap + torch.zeros(T, T)
        return torch.matmul(F.softmax(att, dim=-1), v)

    q, k, v = _tensors((B, H, T, D), (B, H, T, D), (B, H, T, D))
    gm, _, fired = _split(fn, q, k, v, torch.tensor(CAP))
    assert fired == 0 and len(calls(gm, torch.tanh)) == 1
    assert any("not constants" in r for _, _, r in chunked_attention.refusals), chunked_attention.refusals


def alibi_attention(q, k, v, bias, mask):  # BLOOM's: heads flattened into the batch, a bias per head
    b, h, t, d = q.shape
    q, k, v = (x.reshape(b * h, t, d) for x in (q, k, v))
    scores = bias.baddbmm(q, k.transpose(-1, -2), beta=1.0, alpha=d**-0.5)
    att = F.softmax(scores.view(b, h, t, -1) + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(att.view(b * h, t, -1), v)


@pytest.mark.parametrize("shape", [(B, 1, T, T), (T, T)])
def test_alibi_attention_splits_into_groups_and_is_exact(shape):
    q, k, v, mask = _tensors((B, H, T, D), (B, H, T, D), (B, H, T, D), shape)
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(H)])
    bias = (slopes[:, None, None] * torch.arange(T)).repeat(B, 1, 1).requires_grad_()  # (B * H, 1, T)
    gm, ex, fired = _split(alibi_attention, q, k, v, bias, mask)
    assert fired == 1, chunked_attention.refusals
    groups = calls(gm, "baddbmm")
    assert len(groups) == H * B
    assert all(tuple(n.meta["example_value"].shape) == (1, T, T) for n in groups)
    _assert_exact(alibi_attention, [q, k, v, bias, mask], gm, ex)  # the bias's gradient too


def alibi_attention_sized_by_minus_one(q, k, v, bias, mask):  # the query length left to view
    b, h, t, d = q.shape
    q, k, v = (x.reshape(b * h, t, d) for x in (q, k, v))
    scores = bias.baddbmm(q, k.transpose(-1, -2), beta=1.0, alpha=d**-0.5)
    att = F.softmax(scores.view(b, h, -1, t) + mask, dim=-1)
    return torch.bmm(att.view(-1, t, t), v)


def test_alibi_attention_with_sizes_left_to_view_splits_and_is_exact():
    q, k, v, mask = _tensors((B, H, T, D), (B, H, T, D), (B, H, T, D), (T, T))
    bias = _tensors((B * H, 1, T))[0]
    gm, ex, fired = _split(alibi_attention_sized_by_minus_one, q, k, v, bias, mask)
    assert fired == 1, chunked_attention.refusals
    assert len(calls(gm, "baddbmm")) == H * B
    _assert_exact(alibi_attention_sized_by_minus_one, [q, k, v, bias, mask], gm, ex)

"""Joint-graph cleanups before planning (fxmem/cleanup.py)."""

from __future__ import annotations

import functools
import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxmem.cleanup import (
    LAID_STRIDE,
    copy_conv_inputs_channels_last,
    copy_expanded_attention_inputs,
    copy_views_of_channels_last,
    merge_repeated_values,
    realize_running_sums,
    save_as_traced,
)
from fxmem.kernels import LAYOUT_COPY

aten = torch.ops.aten


def _conv_step(x, w, gy):
    y = aten.convolution.default(x, w, None, [2, 2], [0, 0], [1, 1], False, [0, 0], 1)
    gx, gw, _ = aten.convolution_backward.default(
        gy, x, w, [0], [2, 2], [0, 0], [1, 1], False, [0, 0], 1, [True, True, False]
    )
    return y, gx, gw, x.sum()


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(2, 3, 8, 8, generator=g),
        torch.randn(4, 3, 2, 2, generator=g),
        torch.randn(2, 4, 4, 4, generator=g),
    )


def test_a_graph_input_read_by_convolutions_gets_one_channels_last_copy():
    args = _inputs()
    gm = make_fx(_conv_step, tracing_mode="fake")(*args)
    assert copy_conv_inputs_channels_last(gm) == 1
    clones = [n for n in gm.graph.nodes if n.target is aten.clone.default]
    assert len(clones) == 1
    (copy,) = clones
    assert copy.kwargs["memory_format"] is torch.channels_last
    assert copy.meta["val"].is_contiguous(memory_format=torch.channels_last)
    readers = {u.target for u in copy.users}
    assert readers == {aten.convolution.default, aten.convolution_backward.default}
    x = copy.args[0]
    assert [u.target for u in x.users if u is not copy] == [aten.sum.default]  # other readers keep x
    for got, want in zip(gm(*args), _conv_step(*args), strict=True):
        torch.testing.assert_close(got, want)


def test_inputs_already_channels_last_are_left_alone():
    x, w, gy = _inputs()
    x = x.contiguous(memory_format=torch.channels_last)
    gm = make_fx(_conv_step, tracing_mode="fake")(x, w, gy)
    assert copy_conv_inputs_channels_last(gm) == 0
    assert not [n for n in gm.graph.nodes if n.target is aten.clone.default]


def _views_of_conv_output(x, w):
    y = aten.relu.default(aten.convolution.default(x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1))
    n, c, h, wd = y.shape
    rows = aten.view.default(y, [n * c, h * wd])  # (N*C, H*W): merges N with C
    planes = aten.view.default(y, [n, c, h * wd])  # merges H with W: either layout takes it
    return rows.sum(1), planes.sum(2)


def test_a_view_channels_last_values_cannot_take_reads_a_contiguous_copy():
    """Inductor runs the convolution channels-last: viewing its output as (N*C, H*W) needs a
    contiguous copy, which becomes a node of the graph; viewing it as (N, C, H*W) does not."""
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 3, 8, 8, generator=g), torch.randn(4, 3, 1, 1, generator=g))
    gm = make_fx(_views_of_conv_output, tracing_mode="fake")(*args)
    assert copy_views_of_channels_last(gm) == 1
    (copy,) = [n for n in gm.graph.nodes if n.meta.get(LAYOUT_COPY)]
    assert copy.target is aten.clone.default and copy.args[0].target is aten.relu.default
    (view,) = copy.users
    assert view.target is aten.view.default and view.args[1] == [8, 64]
    # the view's fake value now aliases the copy, not the convolution's output
    assert view.meta["val"].untyped_storage()._cdata == copy.meta["val"].untyped_storage()._cdata
    assert view.meta["val"].untyped_storage()._cdata != copy.args[0].meta["val"].untyped_storage()._cdata
    for got, want in zip(gm(*args), _views_of_conv_output(*args), strict=True):
        torch.testing.assert_close(got, want)


def test_views_without_convolutions_are_left_alone():
    def step(x):
        return aten.view.default(aten.relu.default(x), [8, 64]).sum(1)

    gm = make_fx(step, tracing_mode="fake")(torch.randn(2, 4, 8, 8))
    assert copy_views_of_channels_last(gm) == 0
    assert not [n for n in gm.graph.nodes if n.target is aten.clone.default]


def _nhwc_block(x, w, m, w2):
    """A convolution, a matmul over its (N, H, W, C) output, and a second convolution; besides,
    a value after the last convolution and a stand-in for a backward op reading each."""
    y = aten.convolution.default(x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    n, c, hh, ww = y.shape
    rows = aten.reshape.default(aten.permute.default(y, [0, 2, 3, 1]), [n * hh * ww, c])
    h = aten.view.default(aten.mm.default(rows, m), [n, hh, ww, m.shape[1]])  # saved: (N, H, W, K)
    g = aten.gelu.default(h)
    z = aten.convolution.default(
        aten.permute.default(g, [0, 3, 1, 2]), w2, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1
    )
    r = aten.relu.default(z)
    return r.sum(), aten.mul.Tensor(h, 3.0), aten.mul.Tensor(y, 3.0), aten.mul.Tensor(r, 3.0)


_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _repeated(x, heads: int):
    """One head repeated over `heads` by a view, as HF's `repeat_kv` does (stride 0)."""
    b, _, t, d = x.shape
    return x[:, :, None].expand(b, 1, heads, t, d).reshape(b, heads, t, d)


def _attention_step(q, k, v, mask, gy, repeat=(False, False), expand_mask=None, key_as_value=False):
    """CPU flash attention and its backward; `repeat`: whether the key and the value (one
    head) are repeated over the query heads by a view, else broadcast by the call;
    `expand_mask`: the mask is one batch row's expanded over the batch ("batch"), or one
    value per query expanded over the batch and the keys ("batch and keys");
    `key_as_value`: the key is passed as the value too."""
    heads = q.shape[1]
    k, v = (_repeated(x, heads) if r else x for x, r in zip((k, v), repeat, strict=True))
    v = k if key_as_value else v
    if expand_mask == "batch":
        mask = mask[0].expand(mask.shape)
    elif expand_mask == "batch and keys":
        mask = mask[:1, :, :, :1].expand(mask.shape)
    y, lse = _FLASH(q, k, v, attn_mask=mask)[:2]
    grads = _FLASH_BACKWARD(gy, q, k, v, y, lse, 0.0, False, attn_mask=mask)
    return y, *grads, k.sum()


def _attention_inputs(transposed: bool = False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 4, 16, generator=g).transpose(1, 2) if transposed else torch.randn(2, 4, 8, 16, generator=g)
    k = torch.randn(2, 1, 8, 16, generator=g)
    v = torch.randn(2, 1, 8, 16, generator=g)
    mask = torch.randn(2, 1, 8, 8, generator=g)
    return q, k, v, mask, torch.randn(2, 4, 8, 16, generator=g)


def _traced_and_copied(args, **how):
    """The step traced and its views copied: the copies of the inputs (that of the forward's
    log-sum-exp, which every such step makes, checked and left out). The step runs as before."""
    step = functools.partial(_attention_step, **how)
    gm = make_fx(step, tracing_mode="fake")(*args)
    made = copy_expanded_attention_inputs(gm)
    copies = [n for n in gm.graph.nodes if n.target is aten.clone.default]
    assert made == len(copies)
    assert all(c.meta[LAYOUT_COPY] and c.meta["val"].is_contiguous() for c in copies)
    for got, want in zip(gm(*args), step(*args), strict=True):
        torch.testing.assert_close(got, want)
    (lse,) = [c for c in copies if c.args[0].target is operator.getitem]
    assert [u.target for u in lse.users] == [_FLASH_BACKWARD]
    return [c for c in copies if c is not lse]


def test_the_forwards_log_sum_exp_is_copied_for_the_backward():
    """The forward's log-sum-exp, (batch, heads, tokens) with the heads innermost: inductor
    hands the backward a contiguous copy (checked in `_traced_and_copied`)."""
    step = functools.partial(_attention_step)
    gm = make_fx(step, tracing_mode="fake")(*_attention_inputs())
    lse = next(n for n in gm.graph.nodes if n.target is operator.getitem and n.args[1] == 1)
    assert lse.meta["val"].stride() == (32, 1, 4)
    assert _traced_and_copied(_attention_inputs()) == []


def test_a_repeated_key_head_gets_one_dense_copy_read_by_the_attention_and_its_backward():
    copies = _traced_and_copied(_attention_inputs(), repeat=(True, True))
    assert len(copies) == 2  # the key's and the value's
    for copy in copies:
        assert copy.args[0].meta["val"].stride(1) == 0  # it copies the view
        assert {u.target for u in copy.users} == {_FLASH, _FLASH_BACKWARD}
    (key, _) = copies
    assert [u.target for u in key.args[0].users if u is not key] == [aten.sum.default]  # the sum reads the view


def test_a_view_passed_as_both_key_and_value_gets_a_copy_per_argument():
    """Inductor lays out each argument of the call apart: a view passed twice is copied twice."""
    copies = _traced_and_copied(_attention_inputs(), repeat=(True, False), key_as_value=True)
    assert len(copies) == 2 and copies[0].args[0] is copies[1].args[0]
    for copy in copies:
        assert {u.target for u in copy.users} == {_FLASH, _FLASH_BACKWARD}


def test_a_mask_expanded_over_the_batch_is_copied():
    copies = _traced_and_copied(_attention_inputs(), expand_mask="batch")
    assert [tuple(c.meta["val"].shape) for c in copies] == [(2, 1, 8, 8)]


def test_a_mask_expanded_over_the_batch_and_the_keys_is_left_alone():
    """Strides (0, 8, 1, 0): the last dimension ties for the smallest stride, and inductor
    counts ties for the inner dimension, so the mask keeps its own order and is passed as it
    is (checked in inductor's code)."""
    assert _traced_and_copied(_attention_inputs(), expand_mask="batch and keys") == []


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "heads-transposed"])
def test_attention_inputs_in_a_layout_inductor_takes_are_left_alone(transposed):
    """Queries contiguous or viewed with their heads transposed (the last dimension still the
    innermost: inductor keeps their own order), one key and value head broadcast by the call."""
    assert _traced_and_copied(_attention_inputs(transposed)) == []


def test_saved_nhwc_values_inductor_would_lay_out_are_saved_through_a_view():
    """A saved (N, H, W, K) value that feeds a convolution is saved as its (N, H*W, K) view,
    which the backward reads back as 4-d; a convolution's output (channels-last already) and a
    value after the last convolution are saved as they are. Values are unchanged."""
    g = torch.Generator().manual_seed(0)
    args = (
        torch.randn(2, 3, 6, 6, generator=g),
        torch.randn(4, 3, 1, 1, generator=g),
        torch.randn(4, 8, generator=g),
        torch.randn(5, 8, 1, 1, generator=g),
    )
    gm = make_fx(_nhwc_block, tracing_mode="fake")(*args)
    copy_views_of_channels_last(gm)
    nodes = list(gm.graph.nodes)
    backward = [n for n in nodes if n.target is aten.mul.Tensor]
    h, y, r = (b.args[0] for b in backward)
    assert LAID_STRIDE in y.meta and LAID_STRIDE not in h.meta
    forward = [n for n in nodes if n.op == "call_function" and n not in backward]
    saved = save_as_traced(gm, [h, y, r], forward, lambda n: n in backward)
    assert saved[1] is y and saved[2] is r
    flat = saved[0]
    assert flat.target is aten.view.default and flat.args == (h, [2, 36, 8])
    (back,) = flat.users
    assert backward[0].args[0] is back and tuple(back.meta["val"].shape) == (2, 6, 6, 8)
    assert [u for u in h.users if u is not flat] == [n for n in nodes if n.target is aten.gelu.default]
    gm.graph.lint()
    gm.recompile()
    for got, want in zip(gm(*args), _nhwc_block(*args), strict=True):
        torch.testing.assert_close(got, want)


def _two_layers(x, m, gy):
    """A joint graph's shape: the forward output first, then what the backward makes of `gy`."""
    opened = [torch.where(m.all(-1, keepdim=True), 0.0, x) for _ in range(2)]  # both read later
    y = opened[0] * 2 + opened[1]
    y = y * x.sin() + x.sin()  # the forward alone reads these
    drawn = [torch.rand_like(x) for _ in range(2)]
    y = y + drawn[0] + drawn[1]
    return y, gy * opened[0] + gy * opened[1] + gy * drawn[0] * drawn[1]


def test_a_value_computed_twice_and_read_by_the_backward_is_computed_once():
    g = torch.Generator().manual_seed(0)
    x, gy = torch.randn(2, 4, 4, generator=g), torch.randn(2, 4, 4, generator=g)
    m = torch.rand(2, 4, 4, generator=g) > 0.3
    gm = make_fx(_two_layers)(x, m, gy)

    ops = (aten.where.self, aten.all.dim, aten.sin.default, aten.rand_like.default)

    def counts():
        return [sum(n.target is op for n in gm.graph.nodes) for op in ops]

    assert counts() == [2, 2, 2, 2]
    merge_repeated_values(gm, num_fwd_outputs=1)
    gm.graph.lint()
    # the opened mask and its row test once; the forward's own repeats and the random draws apart
    assert counts() == [1, 1, 2, 2]
    torch.manual_seed(1)
    got = gm(x, m, gy)
    torch.manual_seed(1)
    for a, b in zip(got, _two_layers(x, m, gy), strict=True):
        torch.testing.assert_close(a, b)


def _sums(x, t1, t2, t3, w, between: bool, terms: int = 4):
    """A forward output and, beyond it, a running sum of `terms` terms; `between`: a matmul
    runs between its first add and its last."""
    fwd = (x + x + x + x).sum()  # a chain of adds in the forward
    if not between:
        t3 = t3 @ w
    s = t1 + t2
    if between:
        t3 = t3 @ w
    for term in (t3, t1, t2)[: terms - 2]:
        s = s + term
    return fwd, s


@pytest.mark.parametrize(("between", "terms", "made"), [(True, 4, 3), (True, 5, 4), (False, 4, 0), (True, 3, 0)])
def test_a_running_sum_of_four_terms_spanning_a_library_call_is_written_as_it_goes(between, terms, made):
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(512, 512, generator=g) for _ in range(5)]
    fn = functools.partial(_sums, between=between, terms=terms)
    gm = make_fx(fn, tracing_mode="fake")(*args)
    opaque = lambda: gm.graph.find_nodes(op="call_function", target=torch.ops.fxmem.add.default)  # noqa: E731
    assert realize_running_sums(gm, num_fwd_outputs=1) == len(opaque()) == made
    assert all(a.target is aten.add.Tensor for n in gm.graph.nodes if n.target is aten.sum.default for a in n.args)
    for got, want in zip(gm(*args), fn(*args), strict=True):
        torch.testing.assert_close(got, want)

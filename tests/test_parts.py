"""Element-wise values read only in chunks, made chunk by chunk (fxmem/parts.py)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxmem.parts import split_element_wise_by_chunk

aten = torch.ops.aten


def _grouped_mask_attention(allowed, scores):
    """A float mask made from a broadcast boolean one (transformers' eager mask), split into
    two groups of sequences, each group's part added to its scores."""
    mask = torch.where(allowed.expand(4, 1, 8, 8), torch.zeros(()), torch.finfo(torch.float32).min)
    parts = torch.chunk(mask, 2, dim=0)
    groups = torch.chunk(scores, 2, dim=0)
    return torch.cat([torch.softmax(s + m, -1) for s, m in zip(groups, parts, strict=True)])


def test_a_float_mask_read_only_in_chunks_is_made_chunk_by_chunk():
    allowed = torch.rand(4, 1, 8, 8) > 0.3
    scores = torch.randn(4, 2, 8, 8)
    gm = make_fx(_grouped_mask_attention, tracing_mode="fake")(allowed, scores)
    assert split_element_wise_by_chunk(gm) == 1
    wheres = [n for n in gm.graph.nodes if n.target is aten.where.self]
    assert [tuple(n.meta["val"].shape) for n in wheres] == [(2, 1, 8, 8)] * 2  # no whole mask
    for n in wheres:  # each part read from the boolean mask's matching rows
        assert n.args[0].target is aten.slice.Tensor and n.args[0].args[1:] in ((0, 0, 2), (0, 2, 4))
    torch.testing.assert_close(gm(allowed, scores), _grouped_mask_attention(allowed, scores), rtol=0, atol=0)


def test_a_value_read_whole_or_as_large_as_its_inputs_is_left_whole():
    x, y = torch.randn(4, 8), torch.randn(4, 8)

    def read_whole_too(a, b):
        s = a + b
        return torch.chunk(s, 2)[0] * 2, s.sum()

    def inputs_as_large(a, b):  # chunking would keep a and b alive instead of s: no gain
        return [c * 2 for c in torch.chunk(a + b, 2)]

    for fn in (read_whole_too, inputs_as_large):
        gm = make_fx(fn, tracing_mode="fake")(x, y)
        assert split_element_wise_by_chunk(gm) == 0, fn.__name__


def test_a_value_whose_parts_are_split_again_is_left_whole():
    """Split parts of a part would keep the whole value's storage in their fake values."""
    allowed = torch.rand(4, 1, 8, 8) > 0.3

    def split_twice(a):
        mask = torch.where(a.expand(4, 2, 8, 8), torch.zeros(()), -1e9)
        return [q.sum() for p in torch.chunk(mask, 2, dim=0) for q in torch.chunk(p, 2, dim=1)]

    gm = make_fx(split_twice, tracing_mode="fake")(allowed)
    assert split_element_wise_by_chunk(gm) == 0

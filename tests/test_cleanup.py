"""Joint-graph cleanups before planning (fxmem/cleanup.py)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxmem.cleanup import copy_conv_inputs_channels_last

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

"""emit: the graphs handed to inductor, as the plan counts them."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxmem._torch_private import force_stride_order
from fxmem.emit import _conv_backward_channels_last, _loads, _view_per_reader

aten = torch.ops.aten


def _feed_forward(x, w1, w2, g):
    """T5's feed-forward as the backward computes it again: the ReLU's output is read through one
    view by the next matmul and by its weight gradient, and by the ReLU's gradient itself."""
    h = torch.mm(x, w1).view(4, 8, 16)  # (B, T, d_ff)
    r = torch.relu(h)
    v = r.view(32, 16)
    return torch.mm(v, w2), torch.mm(g.t(), v), r <= 0


def _inputs():
    torch.manual_seed(0)
    return torch.randn(32, 8), torch.randn(8, 16), torch.randn(16, 8), torch.randn(32, 8)


def _mm_views(gm):
    return [a for n in gm.graph.nodes if n.target is aten.mm.default for a in n.args if a.target is aten.view.default]


def test_each_matmul_reads_a_view_of_its_own():
    args = _inputs()
    gm = make_fx(_feed_forward)(*args)
    before = gm(*args)
    views = _mm_views(gm)
    assert len(views) == 2 and len(set(views)) == 1, "one view of the ReLU, read by two matmuls"
    _view_per_reader(gm, layout_opt=False)
    gm.recompile()
    views = _mm_views(gm)
    assert len(set(views)) == 2 and all(len(v.users) == 1 for v in views)
    assert all(v.args[0].target is aten.relu.default for v in views)
    for got, want in zip(gm(*args), before, strict=True):
        assert torch.equal(got, want)


def test_a_value_loading_two_buffers_keeps_one_view():
    """Inductor stores such a value where it meets the view (`realize_hint`): nothing to split."""

    def f(x, w1, w2, g):
        h = torch.mm(x, w1).view(4, 8, 16)
        r = torch.relu(h + g.view(4, 8, 8).repeat(1, 1, 2))
        v = r.view(32, 16)
        return torch.mm(v, w2), torch.mm(g.t(), v), r <= 0

    gm = make_fx(f)(*_inputs())
    nodes = len(gm.graph.nodes)
    _view_per_reader(gm, layout_opt=False)
    assert len(gm.graph.nodes) == nodes


def test_loads_counts_each_buffer_once_through_shared_values():
    """A value built from one input by forty doublings reads one buffer; counted path by path,
    the walk would take 2**40 steps."""

    def f(x):
        for _ in range(40):
            x = x + x * 2
        return x

    gm = make_fx(f)(torch.randn(8))
    (out,) = next(iter(gm.graph.find_nodes(op="output"))).all_input_nodes
    assert _loads(out) == 1


def test_an_in_place_op_is_never_taken_again():
    """In-place ops return an alias of their input too; taken twice they would write twice."""

    def f(x, w):
        r = torch.relu(x)
        return r, w

    gm = make_fx(f)(torch.randn(32, 16), torch.randn(16, 8))
    graph = gm.graph
    r = next(n for n in graph.nodes if n.target is aten.relu.default)
    w = next(n for n in graph.nodes if n.name == "w_1")
    with graph.inserting_after(r):
        inplace = graph.call_function(aten.mul_.Tensor, (r, 2.0))
        inplace.meta["val"] = r.meta["val"]
    with graph.inserting_after(inplace):
        a = graph.call_function(aten.mm.default, (inplace, w))
        b = graph.call_function(aten.neg.default, (inplace,))
    out = next(iter(graph.find_nodes(op="output")))
    out.args = ((a, b),)
    nodes = len(graph.nodes)
    _view_per_reader(gm, layout_opt=False)
    assert len(graph.nodes) == nodes


def test_convolution_backward_reads_channels_last_values():
    """A convolution's backward whose gradient was traced contiguous, beside a channels-last
    input and weight: the gradient alone is pinned channels-last (the op asks for those strides
    and takes the value as it is), and the graph computes what it did."""

    def backward(g, x, w):
        grad = g * torch.sigmoid(g)  # element-wise code written where the call reads it
        dx, dw, _ = aten.convolution_backward.default(
            grad, x, w, [0], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False]
        )
        return dx, dw

    torch.manual_seed(0)
    g = torch.randn(2, 4, 6, 6)
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    w = torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last)
    gm = make_fx(backward, tracing_mode="fake")(g, x, w)
    before = gm(g, x, w)
    _conv_backward_channels_last(gm)
    gm.recompile()
    (conv,) = gm.graph.find_nodes(op="call_function", target=aten.convolution_backward.default)
    pinned, read = conv.args[0], conv.args[1]
    assert pinned.target is force_stride_order() and pinned.args[0].target is aten.mul.Tensor
    assert pinned.meta["val"].is_contiguous(memory_format=torch.channels_last)
    assert read.op == "placeholder", "already channels-last: left as it is"
    for got, want in zip(gm(g, x, w), before, strict=True):
        assert torch.equal(got, want)

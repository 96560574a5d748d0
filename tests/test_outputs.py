"""fxmem.outputs: values a pass returns beside the graph's outputs reach its hook, never the caller."""

from __future__ import annotations

import torch
import torch.fx as fx

from fxmem.outputs import return_outside, with_output_hooks


def _graph() -> fx.GraphModule:
    def f(x, y):
        return (x + y, x * y)

    return fx.symbolic_trace(f)


def test_without_hooks_the_step_is_returned_as_it_is():
    gm = _graph()
    step = gm.forward
    assert with_output_hooks(step, gm) is step


def test_hooks_see_the_extra_outputs_and_the_caller_does_not():
    gm = _graph()
    nodes = {n.name: n for n in gm.graph.nodes}
    seen = []

    def hook(outputs, positions):
        seen.append([outputs[p] for p in positions])
        outputs[0] = outputs[0] + outputs[positions[1]]  # the hook may replace an output

    return_outside(gm, [nodes["x"], nodes["y"]], hook)
    x, y = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])
    assert len(gm(x, y)) == 4  # the graph itself returns the extra values
    step = with_output_hooks(gm.forward, gm)
    out = step(x, y)
    assert len(out) == 2
    assert torch.equal(out[0], x + y + y) and torch.equal(out[1], x * y)
    ((got_x, got_y),) = seen
    assert got_x is x and got_y is y

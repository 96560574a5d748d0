"""detach_caches: the key/value caches a model returns leave the step without a gradient.

Before (an HF decoder layer with `use_cache=True`, the default, on a step without a past)::

    keys = torch.cat([torch.tensor([]), key_states], dim=-2)    # DynamicCache's first update
    ...                                                         # attention reads keys
    return loss, logits, keys, values, ...                      # past_key_values

After::

    return loss, logits, keys.detach(), values.detach(), ...

and an output hook (`fxmem.outputs`) makes each returned cache a tensor that requires grad
again, through a function whose backward raises if a gradient ever reaches it.

A compiled step is one autograd node: for every output the backward sends no gradient into,
autograd hands the compiled backward a tensor of zeros of that output's size. Training code
backpropagates the loss, never the caches, so each backward would get two zero tensors per
layer as large as that layer's keys (HF GPT-2 small at 8 x 1024 tokens: 24 MiB each, 576 MiB
over twelve layers), all alive at once as the backward starts. Eager makes none.

Exact for every backward that does not reach the caches; one that does (a loss on the
returned keys, or a next step that attends to this step's cache without detaching it) raises,
naming the way out, where eager would have trained through them. Fires on returned values
made as HF's cache makes them on its first update — a `torch.cat` onto empty 1-D tensors,
or a slice of one (a sliding-window layer's) — that the graph also reads (the attention);
returned only, the value may be a graph break's hand-over to a later graph, whose backward
sends it a gradient. Only when another returned value (the loss, the logits) carries a
gradient, which the returned caches then hang from, so that they require grad exactly when
eager's would. Returned, the caches are views made by that function: edited in place while
grad is on, they raise autograd's error for such views.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from fxmem.ops import example_value
from fxmem.outputs import output_values, return_outside
from fxmem.rules import propagate_meta

__all__ = ["detach_caches"]

log = logging.getLogger(__name__)


def _is_cache(node: Any) -> bool:
    """`node` is a first cache update — with a gradient, read in the graph besides being
    returned — or a slice of one (a sliding-window layer keeps the last tokens of it)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target is operator.getitem and _is_slicing(node.args[1]):
        return _is_cache(node.args[0]) and _carries_gradient(node)
    # Read only by the output, the value goes to a later graph (a graph break), whose backward
    # may send it a gradient: not one to detach.
    read_here = any(u.op != "output" for u in node.users)
    return _is_first_update(node) and _carries_gradient(node) and read_here


def _is_first_update(node: fx.Node) -> bool:
    """`torch.cat([torch.tensor([]), states], dim)`: HF's cache layers start from an empty
    1-D tensor, which `cat` lets stand beside tensors of any rank (a user's own empty prefix,
    `x.new_zeros(B, 0, D)`, has the states' rank and is not taken for one)."""
    if node.target is not torch.cat:
        return False
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    if not isinstance(parts, (list, tuple)) or len(parts) < 2:
        return False
    value = example_value(node)
    if not isinstance(value, torch.Tensor) or value.ndim < 2:
        return False
    earlier = [example_value(p) for p in parts[:-1]]
    return all(isinstance(t, torch.Tensor) and t.ndim == 1 and t.numel() == 0 for t in earlier)


def _is_slicing(index: Any) -> bool:
    entries = index if isinstance(index, tuple) else (index,)
    return all(e is Ellipsis or isinstance(e, slice) for e in entries)


def _carries_gradient(node: Any) -> bool:
    value = example_value(node) if isinstance(node, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.requires_grad


class _NoGradientIntoTheStep(torch.autograd.Function):
    """A returned cache, requiring grad as it did in the model. Its gradient cannot reach the
    step (the step returned it detached), so one that comes raises; none comes when the
    backward starts from the loss."""

    @staticmethod
    def forward(ctx, cache, anchor):
        ctx.set_materialize_grads(False)
        return cache

    @staticmethod
    def backward(ctx, grad):
        if grad is not None:
            raise RuntimeError(
                "fxmem: a gradient reached a key/value cache the model returned (past_key_values); "
                "fxmem returns caches without one. Detach the cache before using it, call the model "
                "with use_cache=False, or leave the detach_caches pass out (passes=...)."
            )
        return None, None


def _caches_hook(caches: list[int], anchors: list[int]):
    def hook(outputs: list, positions: Sequence[int]) -> None:
        anchor = next((outputs[i] for i in anchors if outputs[i].requires_grad), None)
        if anchor is None:  # the step ran without grad: neither would eager's caches have one
            return
        with torch.enable_grad():
            for i in caches:
                outputs[i] = _NoGradientIntoTheStep.apply(outputs[i], anchor)

    return hook


def detach_caches(gm: fx.GraphModule, example_inputs: Sequence[Any] = ()) -> tuple[fx.GraphModule, int]:
    """Return the graph's first cache updates detached; a hook gives them their requires_grad."""
    values = output_values(gm)
    caches = [i for i, v in enumerate(values) if _is_cache(v)]
    anchors = [i for i, v in enumerate(values) if i not in caches and _carries_gradient(v)]
    if not caches:
        return gm, 0
    if not anchors:
        log.debug("detach_caches refused: no other returned value carries a gradient")
        return gm, 0
    output = gm.graph.output_node()
    detached = {}
    for i in caches:
        if values[i] not in detached:
            with gm.graph.inserting_before(output):
                node = gm.graph.call_method("detach", (values[i],))
            propagate_meta(node, like=values[i])
            detached[values[i]] = node
        values[i] = detached[values[i]]
    output.args = (tuple(values),)
    return_outside(gm, [], _caches_hook(caches, anchors))
    gm.graph.lint()
    return gm, len(detached)

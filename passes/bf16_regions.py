"""bf16_regions: the step runs under autocast's bf16 policy; the outputs keep their dtypes.

Opt-in (`precision="bf16"`): it changes numerics. Before::

    def forward(idx, targets):          # every op in fp32
        ...
        return loss, logits

After::

    def forward(idx, targets):
        with torch.autocast(device_type, dtype=torch.bfloat16):
            ...                          # matmul / linear / conv / attention in bf16,
                                         # softmax / norms / losses / reductions in fp32
        return loss, logits.to(torch.float32)

The parameters stay fp32 (master weights: the optimizer updates fp32 values, the graph casts
them on use) and autocast's op lists decide the precision of every op, so the region keeps
fp32 exactly where torch's own mixed precision does. AOTAutograd traces the region and the
backward mirrors it; the planner then counts the bf16 activations the backward keeps at half
size. Outputs that came out in a lower precision are cast back to the dtype the model
returned, so callers see the same types. Runs last: it wraps the graph the other passes leave.

Tolerance: a bf16 step is not fp32's. tests/passes/test_bf16_regions.py trains the small GPT
for a few steps both ways and bounds the loss difference (see there for the measured value).
Refuses graphs that already enter autocast (the model chose its own precision), graphs
without a matmul-like op (nothing to gain) and graphs whose matmul-like ops run on more than
one device type. The autocast entered is that of the device the matmul-like ops run on (an
index tensor on the CPU beside a model on CUDA does not decide it).

Numbers Dynamo took from an fp32 tensor's dtype are written into the graph as fp32's: a mask
fill of `torch.finfo(scores.dtype).min` stays fp32's smallest number while the scores become
bf16, where it rounds to -inf (a row the mask drops whole gives NaN) or does not fit
(`masked_fill` raises). In the region fp32's largest and smallest finite numbers become bf16's,
which autocast itself would have traced. A tensor made in the traced dtype
(`torch.zeros(..., dtype=h.dtype)`) into which an op writes a source the region made bf16
(`index_add_`, `scatter_add`, `index_put`) gets its source cast to its own dtype, where aten
would raise; it stays fp32, where autocast's trace would have made it bf16.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from fxmem.ops import example_value, op_key
from fxmem.rules import Refusal

__all__ = ["bf16_regions"]

log = logging.getLogger("fxmem.passes")

# Ops autocast runs in the lower precision, by the canonical names of fxmem.ops.
_LOWERED = {
    "linear",
    "matmul",
    "bmm",
    "addmm",
    "baddbmm",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose2d",
    "scaled_dot_product_attention",
    "einsum",
}


def _device_types(gm: fx.GraphModule) -> set[str]:
    """The device types the graph's matmul-like ops run on: the autocast to enter."""
    return {
        v.device.type
        for n in gm.graph.nodes
        if op_key(n) in _LOWERED
        for a in n.all_input_nodes
        if isinstance(v := example_value(a), torch.Tensor)
    }


def _device_type(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    (found,) = _device_types(gm) or {
        next((t.device.type for t in example_inputs if isinstance(t, torch.Tensor)), "cpu")
    }
    return found


_FP32, _BF16 = torch.finfo(torch.float32), torch.finfo(torch.bfloat16)


def _bf16_extreme(value: Any) -> Any:
    """fp32's largest and smallest finite numbers as bf16's: Dynamo wrote the numbers a model
    took from its fp32 tensors' dtype into the graph (`torch.finfo(scores.dtype).min`, HF's
    mask fill), and in the region those tensors are bf16, in which fp32's extremes round to
    infinity (a padded row's fill turns its softmax into NaN; `masked_fill` raises)."""
    if isinstance(value, float) and value in (_FP32.min, _FP32.max):
        return _BF16.min if value < 0 else _BF16.max
    return value


# Ops that take their source in the dtype of the tensor they write into (aten raises
# otherwise): the source's position (self first) and name.
_SAME_DTYPE = {
    "index_add": (3, "source"),
    "index_copy": (3, "source"),
    "scatter": (3, "src"),
    "scatter_add": (3, "src"),
    "scatter_reduce": (3, "src"),
    "index_put": (2, "values"),
    "masked_scatter": (2, "source"),
}


def _source_as_destination(node: fx.Node) -> None:
    """Give an op that writes a source into a tensor of another dtype the source in that dtype
    (`type_as`, nothing where they agree): a tensor made in the model's traced dtype
    (`torch.zeros(..., dtype=h.dtype)`) meets a source the region made bf16."""
    at = _SAME_DTYPE.get(op_key(node).removesuffix("_"))
    if at is None or not node.args:
        return
    position, name = at
    in_args = len(node.args) > position
    source = node.args[position] if in_args else node.kwargs.get(name)
    if not isinstance(source, fx.Node) or not isinstance(example_value(source), torch.Tensor):
        return
    with node.graph.inserting_before(node):
        cast = node.graph.call_method("type_as", (source, node.args[0]))
    cast.meta["example_value"] = example_value(source)
    if in_args:
        node.args = (*node.args[:position], cast, *node.args[position + 1 :])
    else:
        node.kwargs = {**node.kwargs, name: cast}


def guard(gm: fx.GraphModule) -> Refusal | None:
    if any(getattr(n.target, "__name__", "") == "_enter_autocast" for n in gm.graph.nodes):
        return Refusal("the model already enters autocast")
    if not any(op_key(n) in _LOWERED for n in gm.graph.nodes):
        return Refusal("no matmul, convolution or attention to run in bf16")
    if len(_device_types(gm)) > 1:
        return Refusal("matmuls on more than one device type")
    return None


def bf16_regions(gm: fx.GraphModule, example_inputs: Sequence[Any] = ()) -> tuple[fx.GraphModule, int]:
    refusal = guard(gm)
    if refusal is not None:
        log.debug("bf16_regions refused: %s", refusal.reason)
        return gm, 0
    graph = gm.graph
    nodes = list(graph.nodes)
    first_op = next(n for n in nodes if n.op not in ("placeholder", "get_attr"))
    output = nodes[-1]
    with graph.inserting_before(first_op):
        enter = graph.call_function(
            torch.amp.autocast_mode._enter_autocast, (_device_type(gm, example_inputs), torch.bfloat16, True, None)
        )
    with graph.inserting_before(output):
        graph.call_function(torch.amp.autocast_mode._exit_autocast, (enter,))

        def restore(value: Any) -> Any:
            # Inside the region a floating output may come out in bf16: give it back its dtype.
            v = example_value(value)
            if isinstance(value, fx.Node) and isinstance(v, torch.Tensor) and v.is_floating_point():
                cast = graph.call_method("to", (value, v.dtype))
                cast.meta["example_value"] = v
                return cast
            return value

        output.args = (fx.node.map_aggregate(output.args[0], restore),)
    for node in nodes:
        if node.op in ("call_function", "call_method"):
            node.args, node.kwargs = fx.node.map_aggregate((node.args, node.kwargs), _bf16_extreme)
            _source_as_destination(node)
    lowered = sum(op_key(n) in _LOWERED for n in nodes)
    graph.lint()
    gm.recompile()
    return gm, lowered

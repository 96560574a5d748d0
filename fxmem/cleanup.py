"""Joint-graph cleanups that run before planning.

Functionalization leaves `clone` nodes where an op returned its input (dropout with p=0, say):
the values are equal and the graph is functional, so the copy only costs memory, and a plan
would save both. A clone is dropped when it keeps the layout, is not a graph output and does
not copy a graph input (AOTAutograd's output-aliasing bookkeeping depends on those).

The other way round, a copy inductor would make unseen is made a node of the graph: with a
convolution on CPU, inductor runs convolutions channels-last, so a graph input read by one (a
batch of images) is copied to channels-last, and that copy is what the backward keeps. As a
node the copy is counted, kept from the forward (inductor keeps one for the backward whatever
the plan says).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxmem import _torch_private as tp

__all__ = ["copy_conv_inputs_channels_last", "remove_redundant_clones"]

_CLONE = torch.ops.aten.clone.default
_CONVS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)


def remove_redundant_clones(gm: fx.GraphModule) -> dict[int, int]:
    """Replace layout-preserving clones by their input.

    Returns, for each removed clone, its fake storage key -> its input's: views of the clone
    still carry the clone's storage in their metadata and now alias the input's.
    """
    output = next(iter(gm.graph.find_nodes(op="output")))
    outputs = set(output.all_input_nodes)
    remap: dict[int, int] = {}
    for node in list(gm.graph.find_nodes(op="call_function", target=_CLONE)):
        src = node.args[0]
        val, src_val = node.meta.get("val"), getattr(src, "meta", {}).get("val")
        if node in outputs or not isinstance(src, fx.Node) or src.op == "placeholder":
            continue
        if not isinstance(val, torch.Tensor) or not isinstance(src_val, torch.Tensor):
            continue
        if val.stride() != src_val.stride() or val.storage_offset() != src_val.storage_offset():
            continue
        if src_val.untyped_storage().nbytes() != val.untyped_storage().nbytes():
            continue  # the clone compacts a view of a larger storage: keep it
        remap[val.untyped_storage()._cdata] = src_val.untyped_storage()._cdata
        node.replace_all_uses_with(src)
        gm.graph.erase_node(node)
    if remap:
        gm.recompile()
    return remap


def copy_conv_inputs_channels_last(gm: fx.GraphModule) -> int:
    """Where inductor will run convolutions channels-last (its layout optimisation), give each
    graph input that a convolution reads as its input, and that is not channels-last already,
    an explicit channels-last copy read by the convolutions and their backward. Returns how
    many inputs were copied."""
    if not tp.inductor_layout_optimization(gm):
        return 0
    copies = 0
    for src in list(gm.graph.find_nodes(op="placeholder")):
        val = src.meta.get("val")
        readers = [u for u in src.users if u.target in _CONVS and _conv_input(u) is src]
        if not readers or not isinstance(val, torch.Tensor) or val.ndim != 4:
            continue
        if val.is_contiguous(memory_format=torch.channels_last):
            continue
        first = min(readers, key=lambda u: list(gm.graph.nodes).index(u))
        with gm.graph.inserting_before(first):
            copy = gm.graph.call_function(_CLONE, (src,), {"memory_format": torch.channels_last})
        copy.meta["val"] = val.clone(memory_format=torch.channels_last)
        # Kept, never made again: inductor keeps a channels-last copy for the backward either way
        # (made again in the backward, the forward still returns a copy of its own).
        copy.meta["partitioner_tag"] = "must_be_in_forward"
        for u in readers:
            u.replace_input_with(src, copy)
        copies += 1
    if copies:
        gm.graph.lint()
        gm.recompile()
    return copies


def _conv_input(node: fx.Node) -> fx.Node | None:
    """The input (not the weight) a convolution or its backward reads."""
    return node.args[0] if node.target is _CONVS[0] else node.args[1]

"""Joint-graph cleanups that run before planning.

Functionalization leaves `clone` nodes where an op returned its input (dropout with p=0, say):
the values are equal and the graph is functional, so the copy only costs memory, and a plan
would save both. A clone is dropped when it keeps the layout, is not a graph output and does
not copy a graph input (AOTAutograd's output-aliasing bookkeeping depends on those).
"""

from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["remove_redundant_clones"]

_CLONE = torch.ops.aten.clone.default


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

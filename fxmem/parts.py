"""Element-wise values read only in chunks, made chunk by chunk (graphs run without a fusing
compiler).

Without a fusing compiler every value is made whole in memory. transformers' eager attention
adds a float mask made from a boolean one, `torch.where(mask, 0, min)`, (B, 1, T, S) in fp32,
and `chunked_attention` hands each group of heads its part through a split: the whole mask
was made and held across the forward and, recomputed, from the last layer's attention
backward to the first's. `split_element_wise_by_chunk` makes each part from its inputs' parts
where those inputs take under half the value's bytes (the boolean mask), so no reader keeps
the whole value alive. The same op on the same elements: values are unchanged. A fusing
compiler computes such a value inside the kernels that read its parts.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxmem import _torch_private as tp
from fxmem.nodes import aliased_input, must_run_once, retrace_views
from fxmem.ops import storage_of

__all__ = ["split_element_wise_by_chunk"]

_SPLITS = (torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default)
_SLICE = torch.ops.aten.slice.Tensor
# Views a part made on its own storage cannot stand under: a split's parts would keep the whole
# value's storage in their fake values, `as_strided` reads at an offset into it.
_REFUSED_VIEWS = (*_SPLITS, torch.ops.aten.unbind.int, torch.ops.aten.as_strided.default)


def split_element_wise_by_chunk(gm: fx.GraphModule) -> int:
    """Compute each chunk of an element-wise value that is only ever read in chunks from the
    matching chunks of its inputs, where those inputs take less memory than the value.

    A float attention mask made from a broadcast boolean one (`torch.where(mask, 0, min)`, as
    transformers' eager attention makes it) and split by `chunked_attention` into each group's
    part is then made group by group, so the whole (B, 1, T, S) float mask never exists: a
    group holds its part, and the backward, recomputing the mask, holds a part at a time rather
    than the whole from the last layer's attention to the first's. The same op on the same
    elements: values are unchanged. For graphs run without a fusing compiler (a fusing one
    computes such a value inside the kernels that read its chunks). Returns how many values
    were so split."""
    done = 0
    for x in list(gm.graph.nodes):
        splits = list(x.users)
        if not splits or not all(u.target in _SPLITS and u.args[0] is x for u in splits):
            continue
        if not _chunkable(x, splits):
            continue
        for split in splits:
            _chunk_by_chunk(gm, x, split)
        gm.graph.erase_node(x)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _split_dim(split: fx.Node, ndim: int) -> int:
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    return dim % ndim


def _chunkable(x: fx.Node, splits: list[fx.Node]) -> bool:
    """Whether `x` is a deterministic element-wise op whose inputs, chunked as its splits
    chunk it, hold fewer bytes than it, and whose splits are read only through their chunks."""
    val = x.meta.get("val")
    if x.op != "call_function" or torch.Tag.pointwise not in getattr(x.target, "tags", ()):
        return False
    if must_run_once(x) or not isinstance(val, torch.Tensor) or val.ndim == 0:
        return False
    items = [u for s in splits for u in s.users]
    if not all(u.target is operator.getitem for u in items) or any(0 in t.shape for t in _parts(splits)):
        return False
    if any(u.target in _REFUSED_VIEWS for v in items + _views_of(items) for u in v.users):
        return False  # a part split again, or viewed at a storage offset: not its own storage
    inputs = x.all_input_nodes
    if not all(isinstance(a.meta.get("val"), torch.Tensor) for a in inputs):
        return False
    held = sum({storage_of(a): a.meta["val"].untyped_storage().nbytes() for a in inputs}.values())
    return held < val.untyped_storage().nbytes() // 2


def _parts(splits: list[fx.Node]) -> list[torch.Tensor]:
    return [t for s in splits for t in s.meta["val"]]


def _views_of(nodes: list[fx.Node]) -> list[fx.Node]:
    """The views of `nodes`, and of those views, ..."""
    out, todo = [], list(nodes)
    while todo:
        node = todo.pop()
        views = [u for u in node.users if aliased_input(u) is node]
        out += views
        todo += views
    return out


def _chunk_by_chunk(gm: fx.GraphModule, x: fx.Node, split: fx.Node) -> None:
    """Each chunk `split` takes of `x`, made by `x`'s op from its inputs' chunks."""
    val = x.meta["val"]
    dim = _split_dim(split, val.ndim)
    sizes = [t.shape[dim] for t in split.meta["val"]]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for item in list(split.users):
        i = item.args[1]
        if not item.users:
            gm.graph.erase_node(item)
            continue
        with gm.graph.inserting_before(item):
            args, kwargs = torch.fx.node.map_aggregate(
                (x.args, x.kwargs), lambda a, i=i: _rows(gm, a, dim - val.ndim, starts[i], starts[i] + sizes[i])
            )
            part = gm.graph.call_function(x.target, args, kwargs)
            part.meta = tp.meta_for(part, x)
        views = [u for u in item.users if aliased_input(u) is item]
        item.replace_all_uses_with(part)
        gm.graph.erase_node(item)
        retrace_views(views)
    gm.graph.erase_node(split)


def _rows(gm: fx.GraphModule, a: object, dim: int, start: int, end: int) -> object:
    """`a[start:end]` along `dim` (negative: counted from the last, as broadcasting aligns
    dimensions), as a view node; `a` itself where it is not a node or is broadcast along `dim`
    (every chunk reads all of it)."""
    if not isinstance(a, fx.Node):
        return a
    shape = a.meta["val"].shape
    if -dim > len(shape) or shape[dim] == 1:
        return a
    part = gm.graph.call_function(_SLICE, (a, len(shape) + dim, start, end))
    part.meta = tp.meta_for(part, a)
    return part

"""index_as_slice: a constant list index that picks consecutive positions reads as a slice.

Before (Falcon's split of its fused q/k/v with one key/value head)::

    key = fused_qkv[..., [-2], :]          # advanced indexing: a gathered copy

After::

    key = fused_qkv[..., 4:5, :]           # a view of the same values (here 6 heads)

The same values in the same shape (a single list index keeps its dimension where it stands),
so the same gradients; one copy fewer in the forward, and in the backward a slice's gradient
is a pad where an index's is a scatter into zeros. It also keeps a graph out of a compiler
defect: inductor (torch 2.13, CPU) computes wrong gradients for a list-indexed tensor that a
broadcasting matmul reads — Falcon's attention with one key/value head, 5e-2 relative error
in the fused projection's weight gradient — and right ones for the slice.

Refused where a view would change what the program computes: the source or the indexed
value (or a view of either) is written in place anywhere in the graph, the indexed value
is returned (the caller would get a view of the source where it had a fresh tensor), or the
source is the caller's (an input, a parameter or a buffer: autograd would save a view of it,
and the caller writing it before `backward()` would then raise, or change the gradients,
where the copy saved before did not see the write).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from fxmem.ops import example_value, static_int, storage_of, storages_written
from fxmem.rules import Refusal, propagate_meta

__all__ = ["as_slice", "index_as_slice"]

log = logging.getLogger(__name__)


def _slice_for(index: Any, shape: Sequence[Any]) -> tuple[tuple[Any, ...] | None, str]:
    """`index` with its one list of consecutive constant positions as a slice, or why not."""
    entries = list(index) if isinstance(index, tuple) else [index]
    lists = [i for i, e in enumerate(entries) if isinstance(e, list)]
    if len(lists) != 1:
        return None, "no single list index"
    (at,) = lists
    for e in entries:
        if e is Ellipsis or e is entries[at]:
            continue
        if not isinstance(e, slice) or not all(v is None or type(v) is int for v in (e.start, e.stop, e.step)):
            return None, "other entries are not constant slices"
    if entries.count(Ellipsis) > 1:
        return None, "more than one Ellipsis"
    explicit = len(entries) - entries.count(Ellipsis)
    if explicit > len(shape):
        return None, "more entries than dimensions"
    dim = at
    if Ellipsis in entries and entries.index(Ellipsis) < at:
        dim = at - 1 + len(shape) - explicit  # the Ellipsis stands for the dimensions not named
    size, picks = static_int(shape[dim]), entries[at]
    if size is None:
        return None, "the indexed dimension's size is not a constant"
    if not picks or any(type(p) is not int for p in picks):
        return None, "the list holds other than integers"
    if any(not -size <= p < size for p in picks):
        return None, "a position is out of range"
    first = picks[0] % size
    if [p % size for p in picks] != list(range(first, first + len(picks))):
        return None, "the positions are not consecutive"
    entries[at] = slice(first, first + len(picks))
    return tuple(entries), ""


_Storages = tuple[set[int | None], set[int | None], set[int | None]]


def _storages(graph: fx.Graph) -> _Storages:
    """The storages the graph writes in place, those it returns, and the caller's it reads."""
    written = storages_written(graph)
    output = next(iter(graph.find_nodes(op="output")))
    callers = {storage_of(n) for n in graph.nodes if n.op in ("placeholder", "get_attr")} - {None}
    return written, {storage_of(n) for n in output.all_input_nodes}, callers


def as_slice(node: fx.Node, storages: _Storages | None = None) -> tuple[Any, ...] | Refusal:
    """The slice index that `node` (a getitem with a list index) can read as, or why not.
    `storages`: its graph's, from `_storages` (found when not given)."""
    source = node.args[0]
    val = example_value(source)
    if not isinstance(val, torch.Tensor) or not isinstance(example_value(node), torch.Tensor):
        return Refusal("not a tensor")
    index, why = _slice_for(node.args[1], val.shape)
    if index is None:
        return Refusal(why)
    written, returned, callers = storages or _storages(node.graph)
    if {storage_of(source), storage_of(node)} & written:
        return Refusal("the source or the indexed value is written in place")
    if storage_of(node) in returned:
        return Refusal("the indexed value is returned")
    if storage_of(source) in callers:
        return Refusal("the source is the caller's")
    return index


def index_as_slice(gm: fx.GraphModule, example_inputs: Sequence[Any] = ()) -> tuple[fx.GraphModule, int]:
    """Rewrite every constant consecutive list index of the graph as a slice."""
    fired = 0
    # once: a rewrite turns only its own node into a view, and no written or returned one is rewritten
    storages = _storages(gm.graph)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
            continue
        if not isinstance(node.args[0], fx.Node) or not isinstance(node.args[1], (tuple, list)):
            continue
        index = as_slice(node, storages)
        if isinstance(index, Refusal):
            log.debug("index_as_slice refused at %s: %s", node.name, index.reason)
            continue
        node.args = (node.args[0], index)
        propagate_meta(node)
        fired += 1
    if fired:
        gm.graph.lint()
        gm.recompile()
    return gm, fired

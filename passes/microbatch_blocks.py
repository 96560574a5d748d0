"""microbatch_blocks: under memory pressure, repeated blocks run over slices of the batch.

Before (a ViT's or a GPT's `nn.ModuleList` of blocks)::

    for block in self.blocks:
        x = block(x)                                  # (B, N, C); inside: (B, N, 4C) MLP values, q/k/v

After, with n slices::

    for block in self.blocks:
        x = torch.cat([block(s) for s in torch.tensor_split(x, n)])   # inside: (B/n, ...) values

Each slice's values are values of their own to the planner, and the backward of a block works
one slice at a time: what the block makes inside (its MLP's hidden values and their gradient,
attention's q/k/v, their gradients and the copies their backward makes) is alive for one slice
of the batch, not the whole of it. The blocks' inputs and outputs stay whole.

Opt-in: `fxmem.optimize(model, budget_gb, passes=[*default_passes(), "microbatch_blocks"])`
(`default_passes` from `fxmem.pipeline`).
Named, it runs only when the budget is below the floor of the plan without it: the backend then
plans again with 2 slices and, when that does not fit, finds the floor over the most slices (8,
at most one sample a slice) without compiling; the two floors, fitted as a + b/n, name the
fewest slices the budget needs, planned next (one more while a plan does not fit), since smaller
slices make smaller matmuls. Finding the floor plans three times (a ViT on CPU: 7.7 s, against
10.4 s when it planned with 2, 4 and 8 slices in turn). It is not on by default: that floor
search makes every refused budget slower, inductor compiles a graph of 8 slices far more slowly
(that ViT: a first call of 98 s at its floor, 8-10 s unsliced), and under inductor it plans
2.4% below the measured peak there (31.9 MiB predicted, 32.65 measured; within the budget);
with `compiler="eager"` predictions match (28.84 / 28.83 MiB) and the floor is lower.

A block is sliced when every op in it treats each sample on its own, followed through views
and permutes: pointwise ops, linear, addmm and matmul, LayerNorm and RMSNorm-style reductions
over features, softmax, SDPA without dropout, views that keep each sample's values together
(the batch whole, or merged with the dimensions after it: GPT-2's `x.view(-1, C)`), tables the
same for every sample (Llama's rotary `cos`/`sin`, one for the batch), masks gathered sample
by sample (HF's padding masks: `mask[arange(batch)[:, None, None, None], kv]`). HF's GPT-2 and
Llama-style decoder layers are sliced, with a padding mask or without. Anything else leaves the block as it is: BatchNorm or
another reduction over the batch, random ops (each slice would draw differently from the
unsliced step), in-place ops, views that interleave the samples, ops not listed here. A budget
refused with no block sliced says which op kept the first block whole.

Exact: each sample meets the same ops with the same weights; a weight's gradient is summed
over the slices, as gradient accumulation sums it (equal to float rounding).
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch
import torch.fx as fx

from fxmem.batch_dims import UNKNOWN, BatchDims, batch_size
from fxmem.nodes import path_in_model
from fxmem.ops import example_value, writes_in_place
from fxmem.rules import Refusal

__all__ = ["microbatch_blocks", "slice_candidates", "why_none_sliced"]

MAX_SLICES = 8


def _block_of(node: fx.Node) -> str | None:
    """The outermost list item (`blocks.3`, `h.11`) among the modules the node ran in: a
    block, not one of its own layers held in a list."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in stack.values():
        if path.rsplit(".", 1)[-1].isdigit():
            return path
    return None


def _blocks(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Calls grouped by block, in graph order: each block's longest run of consecutive calls.
    Calls of a block found elsewhere (a pass's `detach` of a returned cache, placed by the
    output) stay outside it, reading its outputs."""
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    blocks: dict[str, list[fx.Node]] = {}
    for key, group in itertools.groupby(calls, key=_block_of):
        run = list(group)
        if key is not None and len(run) > len(blocks.get(key, ())):
            blocks[key] = run
    return blocks


def _refusal(nodes: list[fx.Node], labels: BatchDims) -> Refusal | None:
    inside = set(nodes)
    for n in nodes:
        if labels.of[n] is UNKNOWN:
            name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
            what = "writes in place" if writes_in_place(name) else "not known to treat samples on their own"
            return Refusal(f"{n.format_node()}: {what}")
        for a in n.all_input_nodes:
            if a not in inside and labels.of.get(a, UNKNOWN) is UNKNOWN:
                return Refusal(f"{a.name}, read by {n.name}: not followed from the batch")
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    if not outputs or any(not isinstance(labels.of[n], int) for n in outputs):
        return Refusal("a value leaving the block has no batch dimension")
    for n in outputs:
        # Rebuilt whole by torch.cat, which is contiguous: a strided view (a transpose) would
        # leave the block in another layout, where a later `.view` can fail.
        v = example_value(n)
        if not isinstance(v, torch.Tensor) or not v.is_contiguous():
            return Refusal(f"{n.name}, leaving the block, is not contiguous")
    if not any(isinstance(labels.of.get(a), int) for n in nodes for a in n.all_input_nodes if a not in inside):
        return Refusal("nothing from the batch enters the block")
    return None


def slice_candidates(gm: fx.GraphModule) -> tuple[int | None, dict[str, list[fx.Node]], dict[str, Refusal]]:
    """The batch size, the blocks that can run over slices of it, and why the others cannot."""
    batch, _, ok, refused = _candidates(gm)
    return batch, ok, refused


def why_none_sliced(gm: fx.GraphModule) -> str:
    """Why no block of `gm` can run over slices of the batch, in a line."""
    batch, ok, refused = slice_candidates(gm)
    if batch is None or batch < 2:
        return "microbatch_blocks: the step's inputs share no batch of 2 or more samples to slice"
    if not refused:
        return "microbatch_blocks: no repeated blocks (the items of an nn.ModuleList) to run over slices of the batch"
    path, why = next(iter(refused.items()))
    return f"microbatch_blocks left every block whole ({len(refused)}), {path_in_model(path)} because of {why.reason}"


def _candidates(
    gm: fx.GraphModule,
) -> tuple[int | None, BatchDims | None, dict[str, list[fx.Node]], dict[str, Refusal]]:
    batch = batch_size(gm)
    if batch is None or batch < 2:
        return batch, None, {}, {}
    labels = BatchDims(gm, batch)
    ok, refused = {}, {}
    for key, nodes in _blocks(gm).items():
        why = _refusal(nodes, labels)
        if why is None:
            ok[key] = nodes
        else:
            refused[key] = why
    return batch, labels, ok, refused


def microbatch_blocks(gm: fx.GraphModule, slices: int) -> tuple[fx.GraphModule, int]:
    """A new graph in which every block that can runs over `slices` slices of the batch (at most
    one sample a slice: more slices than samples slice nothing); the number of blocks sliced.
    `gm` itself is left as it was."""
    batch, labels, blocks, _ = _candidates(gm)
    if not blocks or labels is None or not 2 <= slices <= batch:
        return gm, 0
    bounds = [batch * k // slices for k in range(slices + 1)]
    sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    first = {nodes[0]: key for key, nodes in blocks.items()}
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    skip: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node in skip:
            continue
        if node in first:
            nodes = blocks[first[node]]
            _emit_sliced(graph, env, nodes, labels, sizes, batch)
            skip.update(nodes)
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    new = fx.GraphModule(gm, graph)
    new.meta.update(gm.meta)
    return new, len(blocks)


def _emit_sliced(
    graph: fx.Graph, env: dict[fx.Node, Any], nodes: list[fx.Node], labels: BatchDims, sizes: list[int], batch: int
) -> None:
    inside = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    pieces: dict[fx.Node, list[Any]] = {}
    for a in inputs:
        dim = labels.of.get(a)
        if isinstance(dim, int):
            per_sample = example_value(a).shape[dim] // batch  # indices along it per sample
            split = graph.call_function(torch.split, (env[a], [s * per_sample for s in sizes]), {"dim": dim})
            pieces[a] = [graph.call_function(operator.getitem, (split, k)) for k in range(len(sizes))]
    per_slice: list[dict[fx.Node, Any]] = []
    for k, size in enumerate(sizes):
        local: dict[fx.Node, Any] = {}

        def value(n: fx.Node, k: int = k, local: dict = local) -> Any:
            if n in local:
                return local[n]
            return pieces[n][k] if n in pieces else env[n]

        for n in nodes:
            copy = graph.node_copy(n, value)
            if n in labels.size_args:
                copy.args = _resized(copy.args, labels.size_args[n], batch, size)
            copy.meta.pop("example_value", None)
            copy.meta.pop("val", None)
            local[n] = copy
        per_slice.append(local)
    for n in outputs:
        parts = [local[n] for local in per_slice]
        env[n] = graph.call_function(torch.cat, (parts,), {"dim": labels.of[n]})
        env[n].meta["nn_module_stack"] = dict(n.meta.get("nn_module_stack") or {})


def _resized(args: tuple, positions: list[Any], batch: int, size: int) -> tuple:
    """Shape arguments for a slice of `size` samples: each size given for the batch's dimension
    (`batch` samples, each with as many indices along it as a slice's) scaled to the slice."""
    out = list(args)
    for pos in positions:
        if isinstance(pos, tuple):  # a shape given as one list argument
            i, k = pos
            shape = list(out[i])
            assert shape[k] % batch == 0, (shape, k, batch)
            shape[k] = shape[k] // batch * size
            out[i] = type(args[i])(shape)
        else:
            assert out[pos] % batch == 0, (out, pos, batch)
            out[pos] = out[pos] // batch * size
    return tuple(out)

"""fuse_projections: Linear layers that read the same input become one matmul and a split.

Before (HF Llama attention; SwiGLU MLPs have the same shape with gate/up)::

    q = F.linear(x, wq)            # (B, T, nh * hs)
    k = F.linear(x, wk)            # (B, T, nkv * hs)
    v = F.linear(x, wv)

After::

    q, k, v = F.linear(x, torch.cat([wq, wk, wv])).split([nh * hs, nkv * hs, nkv * hs], dim=-1)

One larger matmul runs faster than several small ones reading the same input, and the
backward forms one input gradient instead of summing three. The parameters stay as the user
wrote them — the concatenation happens in the graph, so `state_dict()` is unchanged and the
gradients flow back to each original weight; the planner decides whether the concatenated
weight is kept for the backward or concatenated again. Runs after swap_sdpa (which reads
q/k/v as separate values) and before bf16_regions (which casts whole regions).

Only projections the model computes one after another are fused: a group is split where
another matmul runs between two of its projections. Cohere's attention and feed-forward both
read the layer's normed input, the feed-forward after the attention; fused as one, the
feed-forward's projections were made before the attention and the attention's held through
the feed-forward, the split keeping all alive until the last part was read (one layer at 8 x
512 tokens under inductor, nothing recomputed: 23.6 MiB measured, 18.5 unfused). Fused as two,
q/k/v and gate/up, each part lives as its unfused projection would.

Fusing trades memory for speed: the fused output lives until its last part is read, and the
backward concatenates the parts' gradients before one matmul. Under inductor that put a
2-layer Llama's floor (8 x 512 tokens, the loss alone kept) at 19.41 MiB against 16.28 with
the projections apart. So with the default passes, a budget below the floor with them fused
is planned again with them apart (`backend.FUSE`); passes named explicitly run as named.

Exact: each output column is the same dot product, to float rounding. Biases may be present
on all or none of the group; output sizes may differ.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxmem.kernels import any_between
from fxmem.ops import example_value, op_key, storage_of, storages_written
from fxmem.rules import Refusal, insert_call

__all__ = ["fuse_projections"]

log = logging.getLogger("fxmem.passes")


# 1: several `F.linear(x, w_i, b_i)` of one `x` (q/k/v in HF Llama/BERT, gate/up in SwiGLU
# MLPs). A group of any size is one match, so it is found by grouping a node's linear users
# rather than by tracing a pattern function.
def replacement_1(x, weights, biases, sizes):
    weight = torch.cat(weights, dim=0)
    bias = torch.cat(biases, dim=0) if biases is not None else None
    return F.linear(x, weight, bias).split(sizes, dim=-1)


def guard(x: fx.Node, linears: list[fx.Node], order: dict[fx.Node, int], written: set[int | None]) -> Refusal | None:
    """Refuse a group that cannot share one matmul. `written`: the storages the graph writes
    in place (fusing adds no writes, so one set serves the whole pass)."""
    weights = [example_value(n.args[1]) for n in linears]
    biases = [_bias(n) for n in linears]
    if any(not isinstance(w, torch.Tensor) or w.ndim != 2 for w in weights):
        return Refusal("a weight is not a 2-D tensor")
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
        return Refusal("weights differ in dtype, device or input size")
    if len({b is None for b in biases}) != 1:
        return Refusal("some projections have a bias and some do not")
    if any(isinstance(w, torch.Tensor) and w.requires_grad is False for w in weights) and any(
        w.requires_grad for w in weights
    ):
        return Refusal("some weights are frozen and some are trained")
    if any(storage_of(n) in written for n in linears):
        # Fused, each projection is a view of one output, which autograd does not let be
        # written in place (`q *= scaling` after `q = self.q(x)`).
        return Refusal("a projection's output is written in place")
    first = min(order[n] for n in linears)
    late = [a for n in linears for a in n.all_input_nodes if order[a] > first]
    if late:
        return Refusal(f"{late[0].name} is computed after the first projection")
    return None


def _bias(node: fx.Node) -> Any:
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")


# Ops that multiply matrices: one between two projections of a group splits it.
_MATMULS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "scaled_dot_product_attention"})


def _groups(graph: fx.Graph, order: dict[fx.Node, int]) -> list[tuple[fx.Node, list[fx.Node]]]:
    """Per input, its linear users in runs that no other matmul interrupts (graph order)."""
    matmuls = [order[n] for n in graph.nodes if op_key(n) in _MATMULS]
    groups = []
    for x in graph.nodes:
        linears = sorted((u for u in x.users if op_key(u) == "linear" and u.args[0] is x), key=order.__getitem__)
        run: list[fx.Node] = []
        for node in linears:
            if run and any_between(matmuls, order[run[-1]], order[node]):
                groups.append((x, run))
                run = []
            run.append(node)
        groups.append((x, run))
    return [(x, run) for x, run in groups if len(run) >= 2]


def fuse_projections(gm: fx.GraphModule, example_inputs: Sequence[Any] = ()) -> tuple[fx.GraphModule, int]:
    fired = 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    written = storages_written(gm.graph)
    for x, linears in _groups(gm.graph, order):
        refusal = guard(x, linears, order, written)
        if refusal is not None:
            log.debug("fuse_projections refused at %s: %s", x.name, refusal.reason)
            continue
        biases = [_bias(n) for n in linears]
        sizes = [example_value(n.args[1]).shape[0] for n in linears]
        kwargs = {
            "x": x,
            "weights": [n.args[1] for n in linears],
            "biases": None if biases[0] is None else biases,
            "sizes": sizes,
        }
        first = linears[0]
        parts = insert_call(replacement_1, kwargs, before=first, like=first)
        with gm.graph.inserting_before(first):
            for i, old in enumerate(linears):
                part = gm.graph.call_function(operator.getitem, (parts, i))
                part.meta.update(old.meta)
                old.replace_all_uses_with(part)
        for old in linears:  # after the block: `first` is where it inserts
            gm.graph.erase_node(old)
        fired += 1
    if fired:
        gm.graph.lint()
        gm.recompile()
    return gm, fired

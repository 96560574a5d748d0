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
plans again with 2, 4 and 8 slices (at most one sample a slice) and keeps the fewest that fit,
since smaller slices make smaller matmuls. It is not on by default yet: finding the floor plans
up to four times, and its predictions under inductor were low until inductor's channels-last
copy of a convolution's input was counted (a ViT on CPU, 4 blocks, batch 48, 8 slices, near its
floor: 29.8 MiB predicted for 32.8 measured before, 32.1 for 32.8 after); with
`compiler="eager"` they match (28.84 / 28.83 MiB). A block is sliced when every op in it treats each sample
on its own, followed through views and permutes: pointwise ops, linear and matmul, LayerNorm
and RMSNorm-style reductions over features, softmax, SDPA without dropout, views that keep the
batch dimension whole. Anything else leaves the block as it is: BatchNorm or another reduction
over the batch, random ops (each slice would draw differently from the unsliced step), in-place
ops, tensors made from sizes, ops not listed here.

Exact: each sample meets the same ops with the same weights; a weight's gradient is summed
over the slices, as gradient accumulation sums it (equal to float rounding).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxmem.rules import Refusal, example_value

__all__ = ["microbatch_blocks", "slice_candidates"]

MAX_SLICES = 8


class _Unknown:
    def __repr__(self) -> str:
        return "unknown"


# What a value's label says about the batch: an int is the dimension that runs over the samples;
# None: the value is the same for every sample (a weight, a constant); UNKNOWN: not followed.
# A tuple output (unbind, split) has a tuple of labels.
UNKNOWN: Any = _Unknown()
Label = Any

_POINTWISE = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.exp, torch.tanh,
    torch.sigmoid, torch.rsqrt, torch.sqrt, torch.erf, torch.where, torch.masked_fill,
    F.gelu, F.relu, F.silu, F.tanh, F.sigmoid, torch.relu, torch.square, torch.abs,
    operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.invert,
    torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge, torch.logical_not,
    "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "square", "abs",
    "add", "sub", "mul", "div", "neg", "pow", "exp", "tanh", "sigmoid", "rsqrt", "sqrt", "erf",
    "relu", "masked_fill", "float", "half", "bfloat16", "to", "type_as", "contiguous", "clone",
}  # fmt: skip
_REDUCTIONS = {torch.mean, torch.sum, torch.amax, "mean", "sum", "amax"}
_SOFTMAX = {F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, "softmax", "log_softmax"}
_VIEWS = {"view", "reshape", torch.reshape}
_PERMUTES = {"permute", torch.permute}
_TRANSPOSES = {"transpose", torch.transpose}
_MATMULS = {operator.matmul, torch.matmul, torch.bmm, "matmul", "bmm"}
_SPLITS = {"unbind", torch.unbind, "split", "chunk", torch.split, torch.chunk}
_CONVS = {F.conv1d, F.conv2d, F.conv3d}
# Tensors made from sizes alone (no random draws): the same for every sample.
_FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.full, torch.eye, torch.tensor}
_KNOWN = (
    _POINTWISE | _CONVS | {F.embedding} | _REDUCTIONS | _SOFTMAX | _VIEWS | _PERMUTES | _TRANSPOSES | _MATMULS | _SPLITS
    | {F.linear, F.layer_norm, torch.layer_norm, F.scaled_dot_product_attention, "unsqueeze", torch.unsqueeze,
       "flatten", torch.flatten, torch.cat, torch.stack, "expand"}
)  # fmt: skip


def _shape(node: Any) -> tuple[int, ...] | None:
    if not isinstance(node, fx.Node):
        return None
    v = example_value(node)
    if isinstance(v, torch.Tensor) and all(isinstance(n, int) for n in v.shape):
        return tuple(v.shape)
    return None


class _Labels:
    """Labels of the graph's values, followed from the batch inputs (the non-parameter tensor
    placeholders whose first dimension is the batch)."""

    def __init__(self, gm: fx.GraphModule, batch: int):
        self.batch = batch
        self.of: dict[fx.Node, Label] = {}
        # Shape arguments to rewrite per slice: node -> positions of its args that hold the batch.
        self.size_args: dict[fx.Node, list[int]] = {}
        for node in gm.graph.nodes:
            self.of[node] = self._label(node)

    def get(self, a: Any) -> Label:
        if isinstance(a, fx.Node):
            return self.of.get(a, UNKNOWN)
        if isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a):
            return UNKNOWN
        return None  # a constant

    def _label(self, node: fx.Node) -> Label:
        if node.op == "placeholder":
            return _placeholder_label(node, self.batch)
        if node.op == "get_attr":
            return None
        if node.op == "output":
            return None
        if node.op not in ("call_function", "call_method"):
            return UNKNOWN
        try:
            return self._call_label(node)
        except (IndexError, TypeError, ValueError):
            return UNKNOWN

    def _call_label(self, node: fx.Node) -> Label:
        t, args, kw = node.target, node.args, node.kwargs
        out = _shape(node)
        if t is operator.getitem:
            return self._getitem(node)
        if isinstance(t, str) and t.endswith("_") and not t.startswith("_"):
            return UNKNOWN  # in place
        if t in (F.dropout, "dropout"):
            p = kw.get("p", args[1] if len(args) > 1 else 0.5)
            training = kw.get("training", args[2] if len(args) > 2 else True)
            return self.get(args[0]) if (p == 0 or not training) else UNKNOWN
        if t in _FACTORIES:  # the same tensor for every sample
            return None if out is not None else UNKNOWN
        if t not in _KNOWN or not node.all_input_nodes:
            return UNKNOWN  # an op not listed here
        if t == "expand":
            return self._expand(node, out)
        if all(self.of.get(a, UNKNOWN) is None for a in node.all_input_nodes):
            return None
        if out is None and t not in _SPLITS:
            return UNKNOWN
        if t in _POINTWISE:
            return self._broadcast(node, [*args, *kw.values()], out)
        if t is F.linear:
            x = self.get(args[0])
            ok = isinstance(x, int) and x < len(_shape(args[0])) - 1
            others = [a for a in (*args[1:], *kw.values())]
            return x if ok and all(self.get(a) is None for a in others) else UNKNOWN
        if t in (F.layer_norm, torch.layer_norm):
            x, shape = self.get(args[0]), args[1]
            ok = isinstance(x, int) and x < len(_shape(args[0])) - len(shape)
            return x if ok and all(self.get(a) is None for a in (*args[2:], *kw.values())) else UNKNOWN
        if t in _SOFTMAX:
            x, dim = self.get(args[0]), kw.get("dim", args[1] if len(args) > 1 else None)
            return x if isinstance(x, int) and isinstance(dim, int) and dim % len(out) != x else UNKNOWN
        if t in _REDUCTIONS:
            return self._reduction(node)
        if t in _MATMULS:
            return self._matmul(node, out)
        if t is F.scaled_dot_product_attention:
            return self._sdpa(node, out)
        if t in _VIEWS:
            return self._view(node, out)
        if t in _PERMUTES:
            dims = _int_args(args[1:], kw.get("dims"))
            x = self.get(args[0])
            return [d % len(out) for d in dims].index(x) if isinstance(x, int) else UNKNOWN
        if t in _TRANSPOSES:
            x, a, b = self.get(args[0]), args[1] % len(out), args[2] % len(out)
            return UNKNOWN if not isinstance(x, int) else b if x == a else a if x == b else x
        if t in ("unsqueeze", torch.unsqueeze):
            x, d = self.get(args[0]), args[1] % len(out)
            return UNKNOWN if not isinstance(x, int) else x + 1 if d <= x else x
        if t in ("flatten", torch.flatten):
            return self._flatten(node)
        if t in _SPLITS:
            return self._split(node)
        if t in (torch.cat, torch.stack):
            return self._cat(node, out)
        if t in _CONVS or t is F.embedding:  # conv: (N, C, ...) input; embedding: indices of any shape
            x = self.get(args[0])
            others = (*args[1:], *kw.values())
            ok = x == 0 or (t is F.embedding and isinstance(x, int))
            return x if ok and all(self.get(a) is None for a in others) else UNKNOWN
        return UNKNOWN

    def _broadcast(self, node: fx.Node, operands: Sequence[Any], out: tuple[int, ...], matrix_dims: int = 0) -> Label:
        """The output dimension the operands' batch dimensions line up with under broadcasting
        (a matmul's last two dimensions, `matrix_dims`, left out); UNKNOWN when they disagree
        or a value the same for every sample does not broadcast along it."""
        dim = None
        for a in operands:
            lab, shape = self.get(a), _shape(a)
            if lab is UNKNOWN or isinstance(lab, tuple):
                return UNKNOWN
            if isinstance(lab, int):
                aligned = lab + len(out) - len(shape)
                if dim not in (None, aligned) or lab >= len(shape) - matrix_dims:
                    return UNKNOWN
                dim = aligned
        for a in operands:
            shape = _shape(a)
            if self.get(a) is None and shape is not None and dim is not None:
                k = dim - (len(out) - len(shape))
                if 0 <= k < len(shape) - matrix_dims and shape[k] != 1:
                    return UNKNOWN
        return dim

    def _reduction(self, node: fx.Node) -> Label:
        x, shape = self.get(node.args[0]), _shape(node.args[0])
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        keep = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
        if not isinstance(x, int) or dim is None:
            return UNKNOWN
        dims = {d % len(shape) for d in ((dim,) if isinstance(dim, int) else dim)}
        if x in dims:
            return UNKNOWN
        return x if keep else x - sum(d < x for d in dims)

    def _matmul(self, node: fx.Node, out: tuple[int, ...]) -> Label:
        a, b = node.args[:2]
        if any(_shape(x) is None or len(_shape(x)) < 2 for x in (a, b)):
            return UNKNOWN
        return self._broadcast(node, [a, b], out, matrix_dims=2)

    def _sdpa(self, node: fx.Node, out: tuple[int, ...]) -> Label:
        kw = dict(zip(("query", "key", "value", "attn_mask", "dropout_p"), node.args, strict=False))
        kw.update(node.kwargs)
        if kw.get("dropout_p", 0.0) not in (0, 0.0):
            return UNKNOWN
        q, k, v = (kw.get(n) for n in ("query", "key", "value"))
        labels = {self.get(x) for x in (q, k, v)}
        if len(labels) != 1 or not isinstance(dim := labels.pop(), int) or dim >= len(out) - 2:
            return UNKNOWN
        mask = kw.get("attn_mask")
        if mask is not None and self._broadcast(node, [q, mask], out) != dim:
            return UNKNOWN
        return dim

    def _view(self, node: fx.Node, out: tuple[int, ...]) -> Label:
        x, shape = self.get(node.args[0]), _shape(node.args[0])
        if not isinstance(x, int):
            return UNKNOWN
        before = math.prod(shape[:x])
        for k in range(len(out)):
            if math.prod(out[:k]) == before and out[k] == shape[x]:
                self._note_size_arg(node, k)
                return k
        return UNKNOWN

    def _flatten(self, node: fx.Node) -> Label:
        x, shape = self.get(node.args[0]), _shape(node.args[0])
        start = node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0) % len(shape)
        end = node.kwargs.get("end_dim", node.args[2] if len(node.args) > 2 else -1) % len(shape)
        if not isinstance(x, int) or (start <= x <= end and start != end):
            return UNKNOWN
        return x if x < start else x - (end - start)

    def _split(self, node: fx.Node) -> Label:
        x, shape = self.get(node.args[0]), _shape(node.args[0])
        unbind = node.target in ("unbind", torch.unbind)
        dim_at = 1 if unbind else 2  # unbind(x, dim), split(x, sizes, dim), chunk(x, n, dim)
        dim = node.kwargs.get("dim", node.args[dim_at] if len(node.args) > dim_at else 0)
        value = example_value(node)
        if not isinstance(x, int) or not isinstance(dim, int) or dim % len(shape) == x:
            return UNKNOWN
        inner = x - 1 if unbind and dim % len(shape) < x else x
        return tuple(inner for _ in value)

    def _cat(self, node: fx.Node, out: tuple[int, ...]) -> Label:
        parts = node.args[0]
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0) % len(out)
        labels = {self.of.get(p, UNKNOWN) for p in parts}
        if len(labels) != 1 or not isinstance(x := labels.pop(), int):
            return UNKNOWN
        if node.target is torch.stack:
            return x + 1 if dim <= x else x
        return x if dim != x else UNKNOWN

    def _expand(self, node: fx.Node, out: tuple[int, ...]) -> Label:
        x, shape = self.get(node.args[0]), _shape(node.args[0])
        lead = len(out) - len(shape)
        if isinstance(x, int):
            k = x + lead
        elif x is None:  # the same for every sample, broadcast over the batch
            ks = [k for k in range(len(out)) if out[k] == self.batch and (k < lead or shape[k - lead] == 1)]
            if len(ks) != 1:
                return UNKNOWN
            k = ks[0]
        else:
            return UNKNOWN
        self._note_size_arg(node, k)
        return k

    def _note_size_arg(self, node: fx.Node, k: int) -> None:
        """Remember where the shape argument of a view or expand gives the batch's size."""
        if "shape" in node.kwargs or "size" in node.kwargs:
            raise ValueError("shape given by keyword")
        one_list = len(node.args) == 2 and isinstance(node.args[1], (list, tuple))
        size = node.args[1][k] if one_list else node.args[1 + k]
        if size == -1:
            return
        if size != self.batch:
            raise ValueError("the batch's size is not a constant here")
        self.size_args.setdefault(node, []).append((1, k) if one_list else 1 + k)

    def _getitem(self, node: fx.Node) -> Label:
        src, idx = node.args
        lab = self.get(src)
        if isinstance(lab, tuple) and isinstance(idx, int):
            return lab[idx]
        if lab is None and not any(isinstance(i, fx.Node) for i in (idx if isinstance(idx, tuple) else (idx,))):
            return None
        if not isinstance(lab, int) or not isinstance(src, fx.Node) or _shape(src) is None:
            return UNKNOWN
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(isinstance(i, (fx.Node, list, torch.Tensor)) for i in idx):
            return UNKNOWN
        n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
        expanded: list[Any] = []
        for i in idx:
            expanded.extend([slice(None)] * (len(_shape(src)) - n_real) if i is Ellipsis else [i])
        expanded.extend([slice(None)] * (len(_shape(src)) - sum(1 for i in expanded if i is not None)))
        out_dim = in_dim = 0
        for i in expanded:
            if i is None:
                out_dim += 1
                continue
            if in_dim == lab:
                return out_dim if i == slice(None) else UNKNOWN
            in_dim += 1
            out_dim += 0 if isinstance(i, int) else 1
        return UNKNOWN


def _int_args(rest: Sequence[Any], given: Any) -> list[int]:
    if given is not None:
        return list(given)
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        return list(rest[0])
    return list(rest)


def _placeholder_label(node: fx.Node, batch: int) -> Label:
    v = example_value(node)
    if not isinstance(v, torch.Tensor):
        return None
    if isinstance(v, torch.nn.Parameter) or "_parameters_" in node.name or "_buffers_" in node.name:
        return None
    return 0 if v.ndim > 0 and v.shape[0] == batch else UNKNOWN


def _batch_size(gm: fx.GraphModule) -> int | None:
    """The first dimension every input that is not a parameter or buffer shares, if any."""
    sizes = set()
    for node in gm.graph.find_nodes(op="placeholder"):
        v = example_value(node)
        if isinstance(v, torch.Tensor) and "_parameters_" not in node.name and "_buffers_" not in node.name:
            if v.ndim == 0 or not isinstance(v.shape[0], int):
                return None
            sizes.add(v.shape[0])
    return sizes.pop() if len(sizes) == 1 else None


def _block_of(node: fx.Node) -> str | None:
    """The outermost list item (`blocks.3`, `h.11`) among the modules the node ran in: a
    block, not one of its own layers held in a list."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in stack.values():
        if path.rsplit(".", 1)[-1].isdigit():
            return path
    return None


def _blocks(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Calls grouped by block, in graph order; a block whose calls are not contiguous is left out."""
    blocks: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            key = _block_of(node)
            if key is not None:
                blocks.setdefault(key, []).append(node)
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    at = {n: i for i, n in enumerate(calls)}
    return {key: nodes for key, nodes in blocks.items() if at[nodes[-1]] - at[nodes[0]] + 1 == len(nodes)}


def _refusal(nodes: list[fx.Node], labels: _Labels) -> Refusal | None:
    inside = set(nodes)
    for n in nodes:
        if labels.of[n] is UNKNOWN:
            return Refusal(f"{n.format_node()}: not known to treat samples on their own")
        for a in n.all_input_nodes:
            if a not in inside and labels.of.get(a, UNKNOWN) is UNKNOWN:
                return Refusal(f"{a.name}, read by {n.name}: not followed from the batch")
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    if not outputs or any(not isinstance(labels.of[n], int) for n in outputs):
        return Refusal("a value leaving the block has no batch dimension")
    if not any(isinstance(labels.of.get(a), int) for n in nodes for a in n.all_input_nodes if a not in inside):
        return Refusal("nothing from the batch enters the block")
    return None


def slice_candidates(gm: fx.GraphModule) -> tuple[int | None, dict[str, list[fx.Node]], dict[str, Refusal]]:
    """The batch size, the blocks that can run over slices of it, and why the others cannot."""
    batch = _batch_size(gm)
    if batch is None or batch < 2:
        return batch, {}, {}
    labels = _Labels(gm, batch)
    ok, refused = {}, {}
    for key, nodes in _blocks(gm).items():
        why = _refusal(nodes, labels)
        if why is None:
            ok[key] = nodes
        else:
            refused[key] = why
    gm.meta["fxmem_batch_labels"] = labels
    return batch, ok, refused


def microbatch_blocks(gm: fx.GraphModule, slices: int) -> tuple[fx.GraphModule, int]:
    """A new graph in which every block that can runs over `slices` slices of the batch (at most
    one sample a slice: more slices than samples slice nothing); the number of blocks sliced.
    `gm` itself is left as it was."""
    batch, blocks, _ = slice_candidates(gm)
    labels: _Labels | None = gm.meta.pop("fxmem_batch_labels", None)
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
    graph: fx.Graph, env: dict[fx.Node, Any], nodes: list[fx.Node], labels: _Labels, sizes: list[int], batch: int
) -> None:
    inside = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    pieces: dict[fx.Node, list[Any]] = {}
    for a in inputs:
        dim = labels.of.get(a)
        if isinstance(dim, int):
            split = graph.call_function(torch.split, (env[a], sizes), {"dim": dim})
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
    out = list(args)
    for pos in positions:
        if isinstance(pos, tuple):  # a shape given as one list argument
            i, k = pos
            shape = list(out[i])
            assert shape[k] == batch, (shape, k, batch)
            shape[k] = size
            out[i] = type(args[i])(shape)
        else:
            assert out[pos] == batch, (out, pos, batch)
            out[pos] = size
    return tuple(out)

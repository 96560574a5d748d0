"""Which dimension of each value in a Dynamo graph runs over the samples of the batch.

`BatchDims(gm, batch)` labels every node, followed from the graph's batch inputs (the tensor
inputs that are not parameters or buffers, whose first dimension is the batch): an int is the
dimension that runs over the samples; None means the value is the same for every sample (a
weight, a constant); UNKNOWN means an op the analysis does not follow, or one that mixes the
samples (a reduction over the batch, BatchNorm) or draws random numbers. A tuple output (unbind,
split) has a tuple of labels. A labelled dimension holds each sample's values together: its
size is the batch's, or a multiple of it where a view merged the samples with the dimensions
after them (GPT-2's `x.view(-1, C)`: a sample's rows in a row). Views, expands and reshapes
whose shape argument gives that size are recorded in `size_args`, so a rewrite can give them
a slice's size instead.

Used by `microbatch_blocks`, which runs blocks whose every value is labelled over slices of
the batch.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxmem.ops import example_value, static_int, static_shape, writes_in_place

__all__ = ["UNKNOWN", "BatchDims", "Label", "batch_size"]


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
    torch.sigmoid, torch.rsqrt, torch.sqrt, torch.erf, torch.where, torch.masked_fill, torch.cos, torch.sin,
    F.gelu, F.relu, F.silu, F.tanh, F.sigmoid, torch.relu, torch.square, torch.abs,
    operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.invert,
    operator.and_, operator.or_, torch.logical_and, torch.logical_or, "logical_and", "logical_or",
    torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge, torch.logical_not,
    "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "square", "abs",
    "add", "sub", "mul", "div", "neg", "pow", "exp", "tanh", "sigmoid", "rsqrt", "sqrt", "erf", "cos", "sin",
    "relu", "masked_fill",
}  # fmt: skip
# One tensor's values again, in a dtype or a layout (`w.to(x)`, `w.type_as(x)`: x gives a dtype).
_CASTS = {"float", "half", "bfloat16", "to", "type", "type_as", "contiguous", "clone"}
_REDUCTIONS = {torch.mean, torch.sum, torch.amax, "mean", "sum", "amax"}
_SOFTMAX = {F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, "softmax", "log_softmax"}
_VIEWS = {"view", "reshape", torch.reshape}
_PERMUTES = {"permute", torch.permute}
_TRANSPOSES = {"transpose", torch.transpose}
_MATMULS = {operator.matmul, torch.matmul, torch.bmm, "matmul", "bmm"}
_SPLITS = {"unbind", torch.unbind, "split", "chunk", torch.split, torch.chunk}
_CONVS = {F.conv1d, F.conv2d, F.conv3d}
# Tensors made from sizes alone (no random draws): the same for every sample.
_FACTORIES = {
    torch.arange, torch.zeros, torch.ones, torch.full, torch.eye, torch.tensor, "new_ones", "new_zeros", "new_full",
}  # fmt: skip
_KNOWN = (
    _POINTWISE | _CASTS | _CONVS | {F.embedding} | _REDUCTIONS | _SOFTMAX | _VIEWS | _PERMUTES | _TRANSPOSES | _MATMULS | _SPLITS
    | {F.linear, torch.addmm, F.layer_norm, torch.layer_norm, F.scaled_dot_product_attention, "unsqueeze", torch.unsqueeze,
       "flatten", torch.flatten, torch.cat, torch.stack, "expand"}
)  # fmt: skip


def _shape(node: Any) -> tuple[int, ...] | None:
    if not isinstance(node, fx.Node):
        return None
    v = example_value(node)
    return static_shape(v) if isinstance(v, torch.Tensor) else None


class BatchDims:
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
        if writes_in_place(t if isinstance(t, str) else getattr(t, "__name__", "")):
            return UNKNOWN
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
        if t in _CASTS:
            x = self.get(args[0])
            return x if isinstance(x, int) or x is None else UNKNOWN
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
        if t is torch.addmm:
            return self._addmm(node)
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
                if dim not in (None, aligned) or aligned < 0 or lab >= len(shape) - matrix_dims:
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
        """A view keeps each sample's values together when the dimensions before the batch's
        stay as they are and one output dimension holds whole samples: merged with the
        dimensions after it (`(B, S, C)` as `(B * S, C)`: a sample's S rows in a row) or split
        from them again."""
        x, shape = self.get(node.args[0]), _shape(node.args[0])
        if not isinstance(x, int):
            return UNKNOWN
        before = math.prod(shape[:x])
        for k in range(len(out)):
            if math.prod(out[:k]) == before and out[k] and out[k] % self.batch == 0:
                self._note_size_arg(node, k)
                return k
        return UNKNOWN

    def _flatten(self, node: fx.Node) -> Label:
        x, shape = self.get(node.args[0]), _shape(node.args[0])
        start = node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0) % len(shape)
        end = node.kwargs.get("end_dim", node.args[2] if len(node.args) > 2 else -1) % len(shape)
        if not isinstance(x, int) or start < x <= end:
            return UNKNOWN  # samples interleaved with the dimensions before theirs
        return x if x <= start else x - (end - start)

    def _addmm(self, node: fx.Node) -> Label:
        """`addmm(bias, x, w)`: row by row, as a linear layer is."""
        bias, x, w = node.args[:3]
        bias_shape = _shape(bias) or ()
        fixed = all(self.get(a) is None for a in (bias, w, *node.kwargs.values()))
        return 0 if self.get(x) == 0 and fixed and (len(bias_shape) < 2 or bias_shape[0] == 1) else UNKNOWN

    def _gathered(self, node: fx.Node) -> Label:
        """`src[i, j, ...]`, an index tensor for every dimension: by sample when the batch's is
        `torch.arange(batch)` (HF's padding masks: `mask[batch_arange[:, None, None, None],
        kv_arange]`) and the others are the same for every sample."""
        src, idx = node.args
        out = _shape(node)
        lab = self.get(src)
        if out is None or len(idx) != len(_shape(src)) or any(self.get(i) is not None for i in idx):
            return UNKNOWN
        at = _batch_arange(idx[lab], self.batch)
        shape = _shape(idx[lab])
        if at is None or shape is None:
            return UNKNOWN
        dim = at + len(out) - len(shape)  # where broadcasting puts it
        others = [_shape(i) for k, i in enumerate(idx) if k != lab]
        if any(s is None or (dim - len(out) + len(s) >= 0 and s[dim - len(out) + len(s)] != 1) for s in others):
            return UNKNOWN
        return dim

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
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0) % len(out)
        # An empty 1-D tensor is skipped by cat whatever its dimension (a key/value cache's first
        # contents): it says nothing of the batch.
        parts = [p for p in node.args[0] if not (node.target is torch.cat and _shape(p) == (0,))]
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
        """Remember where the shape argument of a view or expand gives the size of the batch's
        dimension (a multiple of the batch's size: samples merged with dimensions after them)."""
        if "shape" in node.kwargs or "size" in node.kwargs:
            raise ValueError("shape given by keyword")
        one_list = len(node.args) == 2 and isinstance(node.args[1], (list, tuple))
        size = node.args[1][k] if one_list else node.args[1 + k]
        if size == -1:
            return
        if not isinstance(size, int) or size % self.batch:
            raise ValueError("the batch's size is not a constant here")
        self.size_args.setdefault(node, []).append((1, k) if one_list else 1 + k)

    def _getitem(self, node: fx.Node) -> Label:
        src, idx = node.args
        lab = self.get(src)
        if isinstance(lab, tuple) and isinstance(idx, int):
            return lab[idx]
        if isinstance(lab, int) and isinstance(idx, tuple) and all(isinstance(i, fx.Node) for i in idx):
            return self._gathered(node)
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


def _batch_arange(node: Any, batch: int) -> int | None:
    """The dimension along which `node` is `torch.arange(batch)` (with dimensions of size 1 put
    around it), or None."""
    dim = 0
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem:
        idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if any(i is not None and i != slice(None) for i in idx) or sum(i is not None for i in idx) != 1:
            return None
        dim = [k for k, i in enumerate(idx) if i is not None][0]  # where the one dimension stays
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.target is torch.arange and not node.kwargs.keys() - {"device", "dtype"}):
        return None
    bounds = node.args
    return dim if bounds in ((batch,), (0, batch), (0, batch, 1)) else None


def _int_args(rest: Sequence[Any], given: Any) -> list[int]:
    if given is not None:
        return list(given)
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        return list(rest[0])
    return list(rest)


def _is_module_state(node: fx.Node) -> bool:
    """A graph input Dynamo lifted from a module's parameters or buffers."""
    return isinstance(example_value(node), torch.nn.Parameter) or any(
        part in node.name for part in ("_parameters_", "_buffers_")
    )


def _placeholder_label(node: fx.Node, batch: int) -> Label:
    v = example_value(node)
    if not isinstance(v, torch.Tensor) or _is_module_state(node):
        return None
    return 0 if v.ndim > 0 and v.shape[0] == batch else UNKNOWN


def batch_size(gm: fx.GraphModule) -> int | None:
    """The first dimension every input that is not a parameter or buffer shares, if any."""
    sizes = set()
    for node in gm.graph.find_nodes(op="placeholder"):
        v = example_value(node)
        if isinstance(v, torch.Tensor) and not _is_module_state(node):
            first = static_int(v.shape[0]) if v.ndim else None
            if first is None:
                return None
            sizes.add(first)
    return sizes.pop() if len(sizes) == 1 else None

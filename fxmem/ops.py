"""Graph nodes by what they compute: one name per op however it is spelled, arguments by
parameter name, and which calls write in place.

Dynamo records `a @ b`, `torch.matmul(a, b)` and `a.matmul(b)` differently; `op_key` names
them all "matmul", and `canonical_args` binds each call's arguments to parameter names with
defaults filled in and dimensions made negative. The rule matcher (fxmem.rules) and the
passes compare nodes through these. Which autocast and grad modes are in force where is in
`fxmem.modes`.
"""

from __future__ import annotations

import functools
import inspect
import operator
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import is_concrete_int

__all__ = [
    "COMMUTATIVE",
    "canonical_args",
    "example_value",
    "is_identity",
    "op_key",
    "static_int",
    "static_shape",
    "storage_of",
    "storages_written",
    "writes_in_place",
    "written_in_place",
]


def example_value(node: Any) -> Any:
    """The fake tensor (or value) Dynamo recorded for `node`; literals are their own value."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def static_int(size: Any) -> int | None:
    """A size as an int when its value is fixed: an int, or a symbolic size the backend has
    specialised to its example's value (see `backend._fix_shapes`); None when it varies."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt) and is_concrete_int(size):
        return int(size)
    return None


def static_shape(t: torch.Tensor) -> tuple[int, ...] | None:
    """`t`'s shape as ints (see `static_int`), or None when a size varies."""
    sizes = tuple(static_int(d) for d in t.shape)
    return None if None in sizes else sizes


_OP_ALIASES: dict[Any, str] = {
    operator.matmul: "matmul",
    torch.matmul: "matmul",
    operator.mul: "mul",
    torch.mul: "mul",
    operator.truediv: "div",
    torch.div: "div",
    operator.add: "add",
    torch.add: "add",
    F.softmax: "softmax",
    torch.softmax: "softmax",
    F.dropout: "dropout",
    torch.where: "where",
    torch.transpose: "transpose",
    torch.masked_fill: "masked_fill",
    F.linear: "linear",
    torch._C._nn.linear: "linear",
    F.cross_entropy: "cross_entropy",
    torch.baddbmm: "baddbmm",
}
COMMUTATIVE = {"mul", "add"}
_METHOD_SIGNATURES = {  # Tensor methods, by the parameter names of their functional forms
    "transpose": ("dim0", "dim1"),
    "softmax": ("dim", "dtype"),
    "matmul": ("other",),
    "mul": ("other",),
    "div": ("other",),
    "add": ("other",),
    "masked_fill": ("mask", "value"),
    "split": ("split_size", "dim"),
    "baddbmm": ("batch1", "batch2"),
    "bmm": ("mat2",),
}
_FUNCTION_SIGNATURES = {  # for builtins without a Python signature
    "matmul": ("input", "other"),
    "mul": ("input", "other"),
    "div": ("input", "other"),
    "add": ("input", "other"),
    "where": ("condition", "input", "other"),
    "transpose": ("input", "dim0", "dim1"),
    "masked_fill": ("input", "mask", "value"),
    "linear": ("input", "weight", "bias"),
    "baddbmm": ("input", "batch1", "batch2"),
    "bmm": ("input", "mat2"),
    "scaled_dot_product_attention": (
        "query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"
    ),
}  # fmt: skip
_DEFAULTS = {
    "linear": {"bias": None},
    "softmax": {"dtype": None},
    "baddbmm": {"beta": 1, "alpha": 1},
    "scaled_dot_product_attention": {
        "attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False
    },
}  # fmt: skip
_DIM_ARGS = {"transpose": ("dim0", "dim1"), "softmax": ("dim",)}


def op_key(node: fx.Node) -> str | None:
    if node.op == "call_method":
        return node.target if isinstance(node.target, str) else None
    if node.op == "call_function":
        return _OP_ALIASES.get(node.target, getattr(node.target, "__name__", None))
    return None


def canonical_args(node: fx.Node) -> dict[str, Any]:
    """Arguments by parameter name (the first operand as "input"), defaults filled in."""
    key = op_key(node)
    args = node.args
    if key in ("view", "reshape", "expand") and len(args) == 2 and isinstance(args[1], (tuple, list)):
        args = (args[0], *args[1])  # x.view((a, b)) is x.view(a, b)
    if node.op == "call_method":
        names = ("input", *_METHOD_SIGNATURES.get(key, ()))
    elif key in _FUNCTION_SIGNATURES:
        names = _FUNCTION_SIGNATURES[key]
    else:
        names = None
    if names is not None:
        if len(args) > len(names):
            names = (*names, *(f"arg{i}" for i in range(len(names), len(args))))
        bound = dict(_DEFAULTS.get(key, {}))
        bound.update(zip(names, args, strict=False))
        bound.update(node.kwargs)
    else:
        try:
            sig = inspect.signature(node.target)
            ba = sig.bind(*node.args, **node.kwargs)
            ba.apply_defaults()
            bound = dict(ba.arguments)
        except (TypeError, ValueError):
            bound = {f"arg{i}": a for i, a in enumerate(node.args)} | dict(node.kwargs)
    if key in _DIM_ARGS:
        ndim = getattr(example_value(bound.get("input")), "ndim", None)
        for name in _DIM_ARGS[key]:
            d = bound.get(name)
            if isinstance(d, int) and ndim is not None and d >= 0:
                bound[name] = d - ndim
    if key == "transpose" and isinstance(bound.get("dim0"), int) and isinstance(bound.get("dim1"), int):
        bound["dim0"], bound["dim1"] = sorted((bound["dim0"], bound["dim1"]))
    if key == "dropout":
        bound.pop("inplace", None)
    bound.pop("_stacklevel", None)
    return bound


def is_identity(node: fx.Node) -> bool:
    """A target node that returns its input's value unchanged."""
    key = op_key(node)
    if key == "contiguous":
        return True
    if key == "dropout":
        a = canonical_args(node)
        return a.get("p") == 0 or a.get("training") is False
    if key in ("to", "float", "type"):
        src, out = example_value(node.args[0]), example_value(node)
        return (
            isinstance(src, torch.Tensor)
            and isinstance(out, torch.Tensor)
            and src.dtype == out.dtype
            and src.device == out.device
        )
    return False


# operator's in-place functions (`x += y` is operator.iadd), bare and as dunder methods
_IN_PLACE_OPERATORS = frozenset(
    f"i{op}" for op in "add and concat floordiv lshift mod mul matmul or pow rshift sub truediv xor".split()
)


# operator's functions whose names end in '_' without writing anything (`a & b` is operator.and_)
_OPERATOR_NAMES = frozenset({"and_", "or_", "not_", "is_", "contains"})


def writes_in_place(name: str) -> bool:
    """add_, relu_; iadd, __iadd__, __setitem__ — not __eq__, whose name also ends in '_', nor
    operator.and_ (`a & b`)."""
    if name.startswith("__") and name.endswith("__"):
        return name[2:-2] in _IN_PLACE_OPERATORS or name in ("__setitem__", "__delitem__")
    return (name.endswith("_") and name not in _OPERATOR_NAMES) or name in _IN_PLACE_OPERATORS


_IN_PLACE_FUNCTIONS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.iand, operator.ior, operator.ixor, operator.imatmul, operator.ilshift,
    operator.irshift, operator.setitem,
}  # fmt: skip


def written_in_place(node: fx.Node) -> list[fx.Node]:
    """The tensors `node` (of a Dynamo graph) writes in place: its first argument for an
    in-place op (`x.add_(y)`, `x += y`, `x[i] = y`, `F.relu(x, True)`, each of the lists of
    `torch._foreach_mul_`), the arguments the aten schemas of a builtin or overload mark
    written (`torch._amp_update_scale_`), what a flag makes a function write (a batch norm's
    running statistics), and `out=`."""
    if node.op not in ("call_function", "call_method"):
        return []
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return _nodes(_schema_written(node, target))
    if isinstance(target, torch._ops.OpOverloadPacket):  # torch.ops.aten.relu_, a custom op
        return _nodes([_argument(node, i, arg) for i, arg in _aten_writes(target._qualified_op_name)])
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if name in _NOT_WRITES:
        return []
    if node.op == "call_method":
        writes = writes_in_place(name)
    else:
        writes = (
            target in _IN_PLACE_FUNCTIONS
            or (writes_in_place(name) and (not name.startswith("_") or name.startswith("_foreach_")))
            or _inplace_flag(node)
        )
    written = [node.args[0] if writes and node.args else None, node.kwargs.get("out")]
    if node.op == "call_method" or _is_builtin(target):
        # a method's self is its first argument, as in aten
        written += [_argument(node, i, arg) for i, arg in _aten_writes("aten::" + name)]
    written += _flagged_writes(node)
    return list(dict.fromkeys(_nodes(written)))


# Methods whose names end in '_' that change no tensor's values.
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_"})


def _is_builtin(target: Any) -> bool:
    """torch's functions bound from C++ (`torch.relu_`, `torch._amp_update_scale_`)."""
    return isinstance(target, types.BuiltinFunctionType) and (getattr(target, "__module__", None) or "").startswith(
        "torch"
    )


@functools.cache
def _aten_writes(name: str) -> tuple[tuple[int | None, str], ...]:
    """(position, or None for keyword-only, and name) of each argument that some overload of
    the operator `name` ("aten::sort", "mylib::bump") writes. A list written counts only for
    an in-place op (`_foreach_mul_`): `sort.Tensor` sorts a list of tensors, not a tensor."""
    return tuple(
        dict.fromkeys(
            (None if arg.kwarg_only else i, arg.name)
            for schema in torch._C._jit_get_schemas_for_operator(name)
            for i, arg in enumerate(schema.arguments)
            if arg.alias_info is not None
            and arg.alias_info.is_write
            and (schema.name.endswith("_") or not isinstance(arg.type, torch.ListType))
        )
    )


def _argument(node: fx.Node, position: int | None, name: str, default: Any = None) -> Any:
    if position is not None and position < len(node.args):
        return node.args[position]
    return node.kwargs.get(name, default)


def _schema_written(node: fx.Node, op: torch._ops.OpOverload) -> list[Any]:
    return [
        _argument(node, i, arg.name)
        for i, arg in enumerate(op._schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    ]


# Functions that write arguments in place when a flag says so, which aten's composite schemas
# do not mark: the flag (position, name, default; the writes happen unless it is False or
# None) and what is written (position, name). A batch or instance norm updates its running
# statistics; embedding and embedding_bag renormalise their weight under `max_norm`.
_STATISTICS = ((1, "running_mean"), (2, "running_var"))
_BUILTIN_STATISTICS = ((3, "running_mean"), (4, "running_var"))
_FLAGGED_WRITES = {
    F.batch_norm: ((5, "training", False), _STATISTICS),
    torch.batch_norm: ((5, "training", True), _BUILTIN_STATISTICS),
    F.instance_norm: ((5, "use_input_stats", True), _STATISTICS),
    torch.instance_norm: ((5, "use_input_stats", True), _BUILTIN_STATISTICS),
    F.embedding: ((3, "max_norm", None), ((1, "weight"),)),
    F.embedding_bag: ((3, "max_norm", None), ((1, "weight"),)),
}


def _flagged_writes(node: fx.Node) -> list[Any]:
    entry = _FLAGGED_WRITES.get(node.target) if node.op == "call_function" else None
    if entry is None:
        return []
    (position, name, default), written = entry
    flag = _argument(node, position, name, default)
    return [] if flag is False or flag is None else [_argument(node, i, n) for i, n in written]


def _inplace_flag(node: fx.Node) -> bool:
    """Whether a call passes `inplace=True` (`F.dropout(x, 0.1, True, True)` included)."""
    if node.kwargs.get("inplace") is True:
        return True
    signature = _signature(node.target)
    if signature is None or "inplace" not in signature.parameters:
        return False
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError:
        return False
    return bound.arguments.get("inplace") is True


@functools.cache
def _signature(target: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):
        return None


def _nodes(values: Any) -> list[fx.Node]:
    """The graph nodes among `values`, lists and tuples opened."""
    if isinstance(values, fx.Node):
        return [values]
    if isinstance(values, (tuple, list)):
        return [n for v in values for n in _nodes(v)]
    return []


def storage_of(node: Any) -> int | None:
    """An id of the storage of `node`'s example value (None for a non-tensor)."""
    val = example_value(node)
    return val.untyped_storage()._cdata if isinstance(val, torch.Tensor) else None


def storages_written(graph: fx.Graph) -> set[int | None]:
    """The storages `graph` writes in place."""
    return {storage_of(t) for n in graph.nodes for t in written_in_place(n)}

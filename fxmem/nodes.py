"""What one node of an aten graph is, read from its op and its meta: whether running it again
gives the same values, whether it changes state, which input a view aliases, what it allocates
inside itself, and where in the user's code it came from."""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable

import torch
import torch.fx as fx

from fxmem import _torch_private as tp
from fxmem.cost import tensor_bytes

__all__ = [
    "aliased_input",
    "is_impure",
    "is_random",
    "module_path",
    "must_run_once",
    "one_element",
    "retrace_views",
    "source_line",
    "transient_bytes",
]

# Ops that must run exactly once: their values cannot be reproduced by running them again.
_RANDOM_TAG = torch.Tag.nondeterministic_seeded


def must_run_once(node: fx.Node) -> bool:
    """Whether running the node again would not give its values (`is_random`) or would change
    state a second time (`is_impure`): it is never recomputed, merged or split."""
    return is_random(node) or is_impure(node)


def is_random(node: fx.Node) -> bool:
    """Whether the node draws random numbers (dropout with a zero probability does not)."""
    target = node.target
    tags = getattr(target, "tags", ())
    if _RANDOM_TAG in tags:
        return not _dropout_off(node)
    name = str(target)
    # inductor's seed generator draws from the global generator; inductor_random given a
    # seed is a pure function of it and may be recomputed.
    return "inductor_seeds" in name


def _dropout_off(node: fx.Node) -> bool:
    """A seeded op whose only randomness is a `dropout_p` argument, called with 0 (attention
    without dropout): its outputs are a pure function of its inputs."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    for pos, arg in enumerate(schema.arguments):
        if arg.name == "dropout_p":
            value = node.args[pos] if pos < len(node.args) else node.kwargs.get("dropout_p", arg.default_value)
            return isinstance(value, (int, float)) and value == 0
    return False


def is_impure(node: fx.Node) -> bool:
    """Whether the node mutates state (a mutable schema, or what fx counts impure)."""
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    # fx counts seeded ops as impure; their randomness is `is_random`'s to judge.
    seeded = _RANDOM_TAG in getattr(node.target, "tags", ())
    return node.op == "call_function" and node.is_impure() and not seeded


def module_path(node: fx.Node) -> str:
    """Dotted path of the innermost user module the node came from ('' if unknown)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    return path_in_model(str(list(stack.values())[-1][0]))


def path_in_model(path: str) -> str:
    """A module's path as Dynamo names it (`L['self'].blocks.0`) as a path in the model (`blocks.0`)."""
    path = path.replace("L__self___", "")
    # Dynamo names the compiled module by the local it was (`L['self']`, `L['fn']` for a module
    # compiled whole, whatever `self` is called; `L['args'][0]` under a decorator's wrapper) and
    # a module a function reads by its global.
    path = re.sub(r"^L\['[^']*'\](\[\d+\])?\.?", "", path)
    return re.sub(r"^G\['([^']*)'\]", r"\1", path)


def source_line(node: fx.Node) -> str:
    """'file:line' of the user code that produced the node, from its stack trace."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File ")]
    if not lines:
        return ""
    last = lines[-1]  # innermost frame: 'File "x.py", line 12, in forward'
    try:
        fname = last.split('"')[1]
        lineno = last.split("line ")[1].split(",")[0]
        return f"{fname}:{lineno}"
    except IndexError:
        return last


# aten ops, run one by one, that allocate a temporary inside themselves (measured with the
# profiler's allocator events): dropout's backward multiplies by the mask into one buffer and
# scales into another; logsumexp writes exp(x - max) at the input's size before summing.
_TRANSIENT = {
    "aten.native_dropout_backward.default": lambda n: tensor_bytes(n.meta.get("val")),
    "aten.logsumexp.default": lambda n: tensor_bytes(n.args[0].meta.get("val")),
}


def transient_bytes(node: fx.Node) -> int:
    """Bytes an op run by itself allocates and frees within its own call: the temporaries of
    `_TRANSIENT`'s ops, and the outputs of a multi-output op that nothing reads
    (`log_sigmoid_forward`'s buffer, where only its first output is used), made and dropped
    at once."""
    if node.op != "call_function":
        return 0
    rule = _TRANSIENT.get(str(node.target))
    own = rule(node) if rule is not None else 0
    val = node.meta.get("val")
    schema = getattr(node.target, "_schema", None)
    views = schema is not None and any(r.alias_info is not None for r in schema.returns)
    if not isinstance(val, (tuple, list)) or views:  # `split`'s unused chunks are views: nothing made
        return own
    read = {u.args[1] for u in node.users if u.target is operator.getitem}
    return own + sum(tensor_bytes(v) for k, v in enumerate(val) if k not in read and isinstance(v, torch.Tensor))


def one_element(node: fx.Node) -> bool:
    """Whether the node's value is a one-element tensor (a loss's gradient, a scale): a fusing
    compiler's kernels read it as a scalar, not as a buffer they load from."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.numel() == 1


def aliased_input(node: fx.Node) -> fx.Node | None:
    """The input a view op's output aliases (None for ops that return new memory)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return None
    ret = schema.returns[0].alias_info
    if ret is None or ret.is_write:
        return None
    for arg, value in zip(schema.arguments, node.args, strict=False):
        if arg.alias_info is not None and arg.alias_info.before_set == ret.before_set:
            return value if isinstance(value, fx.Node) else None
    return None


def retrace_views(views: Iterable[fx.Node]) -> None:
    """Give `views`, views a rewrite made read another value, and the views made from them,
    fake values run again on what they read now. Their old values alias the old input's
    storage, and storages merge along views: left so, the plan would count two values as one
    storage (a value and its backward copy, see `again`; a value and its layout copy, see
    `cleanup.copy_views_of_channels_last`)."""
    todo = list(views)
    while todo:
        view = todo.pop()
        view.meta["val"] = tp.fake_rerun(view)
        todo += [u for u in view.users if aliased_input(u) is view]

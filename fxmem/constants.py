"""Values a captured graph computes from module buffers and shapes alone, and the check that
keeps a rewrite built on them honest.

nanoGPT-style attention masks its scores with `self.bias[:, :, :T, :T] == 0`, where `bias` is
a registered lower-triangular buffer. The mask is then a fact about the model, not about the
batch, and a rule may use it (attention with `is_causal=True` needs no mask tensor at all).
`fold(node)` evaluates such a value on the real tensors the graph was captured with; it
refuses values that depend on anything but module buffers, literals and shapes, or on random
ops.

A buffer is still the user's to change: `load_state_dict`, an in-place edit, or a new tensor
assigned to the attribute (the graph then receives it as the same input). So a rule that
relies on a folded value registers a `BufferCheck` on the graph, and the compiled step checks
it on every call: the buffers' addresses and version counters are compared, which costs
nothing; when one changed the value is evaluated again, and if the rule's premise no longer
holds the step raises instead of computing something else. A write through `.data` (or under
`torch.inference_mode`) leaves the version counter as it was, as it does for autograd's own
checks, and is not seen.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from fxmem import _torch_private as tp
from fxmem.nodes import is_random
from fxmem.ops import storage_of, storages_written

__all__ = ["BufferCheck", "capture_inputs", "checked", "fold", "register_check"]

_INPUTS: contextvars.ContextVar[dict[fx.Node, Any] | None] = contextvars.ContextVar("fxmem_inputs", default=None)
_CHECKS_KEY = "fxmem_buffer_checks"


@contextlib.contextmanager
def capture_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Iterator[None]:
    """Make the real example inputs of `gm`'s placeholders visible to `fold` while rules run."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    values = dict(zip(placeholders, example_inputs, strict=False)) if len(placeholders) == len(example_inputs) else {}
    token = _INPUTS.set(values)
    try:
        yield
    finally:
        _INPUTS.reset(token)


class BufferCheck:
    """A premise about buffer-derived values, checked before every call of the compiled step.

    `positions` are the graph inputs the value reads; `holds(args)` says whether the premise
    is true of the given inputs; `what` says in words what was assumed.
    """

    def __init__(self, positions: list[int], holds: Callable[[Sequence[Any]], bool], what: str):
        self.positions = positions
        self.holds = holds
        self.what = what
        self._stamps: list[tuple[int, int]] | None = None

    @staticmethod
    def _stamp(t: torch.Tensor) -> tuple[int, int]:
        return t.data_ptr(), t._version

    def verify(self, args: Sequence[Any]) -> None:
        stamps = [self._stamp(args[p]) for p in self.positions]
        if stamps == self._stamps:
            return
        if not self.holds(args):
            raise RuntimeError(
                f"fxmem: the compiled step assumed {self.what}, and that buffer has changed since; "
                "the rewrite no longer computes the same thing. Optimize the model again "
                "(torch._dynamo.reset() first if it was compiled with backend='fxmem')."
            )
        self._stamps = stamps


def fold(node: fx.Node) -> tuple[torch.Tensor, Callable[[Sequence[Any]], torch.Tensor], list[int]] | None:
    """Evaluate `node` from module buffers, literals and shapes on the captured real inputs.

    Returns (value, evaluate(args) -> value, the graph-input positions it reads), or None when
    `node` depends on anything else (a batch input, a parameter, a random op, a symbolic size),
    on a buffer the graph itself writes in place, or no real inputs are in view (see
    `capture_inputs`).
    """
    inputs = _INPUTS.get()
    if not inputs:
        return None
    placeholders = list(node.graph.find_nodes(op="placeholder"))
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(n: fx.Node) -> bool:
        if n in seen:
            return True
        seen.add(n)
        if n.op == "placeholder":
            real = inputs.get(n)
            if not (isinstance(real, torch.Tensor) and tp.is_real_tensor(real) and tp.is_module_buffer(n)):
                return False
        elif n.op in ("call_function", "call_method"):
            if _random(n) or not all(visit(a) for a in n.all_input_nodes):
                return False
        else:  # a module attribute read in place (get_attr): nothing checks it per call
            return False
        order.append(n)
        return True

    if not visit(node):
        return None
    written = storages_written(node.graph)
    if any(storage_of(n) in written for n in order):
        return None  # the graph writes a buffer it reads (`self.keep.copy_(mask)`): not the captured value
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    reads = [n for n in order if n.op == "placeholder"]
    for n in order:
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(env[node])
    module = fx.GraphModule(node.graph.owning_module, sub)
    positions = [placeholders.index(n) for n in reads]

    def evaluate(args: Sequence[Any]) -> torch.Tensor:
        with torch.no_grad(), tp.real_tensors():
            return module(*[args[p] for p in positions])

    try:
        value = evaluate([inputs.get(p) for p in placeholders])
    except Exception:  # an op that needs more than buffers (a symbolic size, say)
        return None
    if not isinstance(value, torch.Tensor):
        return None
    return value, evaluate, positions


# Dynamo records torch-level calls, which carry no aten tags: the random ones by name.
_RANDOM_CALLS = {"rand", "randn", "randint", "rand_like", "randn_like", "dropout", "bernoulli", "multinomial"}


def _random(n: fx.Node) -> bool:
    return is_random(n) or getattr(n.target, "__name__", str(n.target)) in _RANDOM_CALLS


def register_check(node: fx.Node, check: BufferCheck) -> None:
    """Attach `check` to the graph `node` belongs to; the backend runs it before every call."""
    gm = node.graph.owning_module
    if gm is not None and check.positions:
        gm.meta.setdefault(_CHECKS_KEY, []).append(check)


def checked(compiled: Callable[..., Any], gm: fx.GraphModule) -> Callable[..., Any]:
    """`compiled` with `gm`'s buffer checks run before each call (itself when there are none)."""
    checks: list[BufferCheck] = gm.meta.pop(_CHECKS_KEY, [])
    if not checks:
        return compiled

    # Dynamo calls its backend's result with the graph inputs as arguments.
    @functools.wraps(compiled)
    def run(*args: Any) -> Any:
        for c in checks:
            c.verify(args)
        return compiled(*args)

    run.__dict__.pop("_boxed_call", None)  # copied by wraps; this wrapper takes arguments unboxed
    return run

"""What is alive as a training step starts, and what may be alive at a later one.

A plan counts what is alive when its step is captured (`static_bytes`): parameters, inputs,
gradients already held, other live tensors, less what fxmem holds only while capturing
(`held_while_capturing`). Gradients held at a later step's start that were not held then
(accumulated over steps) are outside the plan: `fxmem.optimize` plans such a step again
(`gradients_held` picks it), and a step compiled by the torch.compile backend warns
(`warn_if_gradients_appear`).

What other compiled steps saved for backwards still to come is alive too (a graph break runs a
model as compiled regions in order, each holding its activations until the backward reaches
it): each step counts its own while its backward is pending (`count_saved`), and a step
captured meanwhile reserves their sum (`saved_by_pending_backwards`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from fxmem import _torch_private as tp
from fxmem.measure import live_storage_bytes
from fxmem.plan import format_bytes
from fxmem.workspaces import OUTSIDE_TENSORS, allocated_outside_tensors, create_workspaces

__all__ = [
    "GradientsHeldWarning",
    "count_saved",
    "gradients_held",
    "held_while_capturing",
    "saved_by_pending_backwards",
    "holds_gradients",
    "static_bytes",
    "warn_if_gradients_appear",
]


def holds_gradients(x: object) -> bool:
    """Whether autograd accumulates gradients into `x.grad` (a leaf tensor that requires grad)."""
    return isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf


def _gradient_held(x: object) -> torch.Tensor | None:
    return x.grad if holds_gradients(x) else None


def gradients_held(tensors: Iterable[object]) -> int:
    """How many of `tensors` hold a gradient as a step starts."""
    return sum(_gradient_held(t) is not None for t in tensors)


# Storages (data pointers) fxmem itself holds only while it captures a graph, such as the
# copy of the buffers `FxmemModule.plan_for` restores: not alive during the user's steps.
_capture_only: set[int] = set()


@contextlib.contextmanager
def held_while_capturing(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """Leave these tensors out of what a capture inside the block counts as alive."""
    ptrs = {t.untyped_storage().data_ptr() for t in tensors} - _capture_only
    _capture_only.update(ptrs)
    try:
        yield
    finally:
        _capture_only.difference_update(ptrs)


def static_bytes(example_inputs: Sequence[Any], device: torch.device) -> dict[str, int]:
    """What is alive on the device as the step starts, by category."""
    seen: set[int] = set()
    params = grads = other_inputs = 0
    for x in example_inputs:
        if not isinstance(x, torch.Tensor) or isinstance(x, tp.FakeTensor) or x.device != device:
            continue
        for t, is_grad in ((x, False), (_gradient_held(x), True)):
            if t is None:
                continue
            st = t.untyped_storage()
            if st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            if is_grad:
                grads += st.nbytes()
            elif isinstance(x, torch.nn.Parameter):
                params += st.nbytes()
            else:
                other_inputs += st.nbytes()
    if device.type == "cuda":
        create_workspaces(device)  # before the scan: what they allocate is then counted below
    storages = live_storage_bytes(device)
    live = sum(n for p, n in storages.items() if p not in _capture_only)
    out = {"parameters": params, "inputs and buffers": other_inputs}
    if grads:
        out["existing gradients"] = grads
    out["other live tensors"] = max(0, live - params - other_inputs - grads)
    outside = allocated_outside_tensors(device, sum(storages.values()))
    if outside:
        out[OUTSIDE_TENSORS] = outside
    return out


class GradientsHeldWarning(UserWarning):
    """A step started with gradients held (accumulated from earlier steps) that its plan,
    made when they were not, does not count: the step can exceed its budget by their bytes.
    `fxmem.optimize` plans again for them; under torch.compile(backend="fxmem"), zero the
    gradients with set_to_none=True between steps, or plan with them held."""


def warn_if_gradients_appear(step: Callable[..., Any], example_inputs: Sequence[Any], budget_bytes: int) -> Any:
    """`step` warning (`GradientsHeldWarning`) when a call finds gradients held on inputs
    that had none when it was planned (itself when every such input had one then)."""
    absent = [i for i, x in enumerate(example_inputs) if holds_gradients(x) and x.grad is None]
    if not absent:
        return step

    # Dynamo calls its backend's result with the graph inputs as arguments.
    @functools.wraps(step)
    def run(*args: Any) -> Any:
        held = sum(g.untyped_storage().nbytes() for i in absent if (g := args[i].grad) is not None)
        if held:
            warnings.warn(
                f"fxmem: this step starts with {format_bytes(held)} of gradients held (accumulated from an "
                f"earlier step) that its plan, made without them, does not count: it can exceed its budget "
                f"of {format_bytes(budget_bytes)}. fxmem.optimize plans again for them; under "
                "torch.compile, zero gradients with set_to_none=True between steps",
                GradientsHeldWarning,
                stacklevel=1,
            )
        return step(*args)

    run.__dict__.pop("_boxed_call", None)  # copied by wraps; this wrapper takes arguments unboxed
    return run


_pending_saved = [0]  # bytes the steps whose backward is still to come saved for it
_pending_lock = threading.Lock()  # released from autograd's threads too


def saved_by_pending_backwards() -> int:
    """Bytes fxmem's compiled steps saved for backwards that have not run yet (nor been let go)."""
    return _pending_saved[0]


def _compiled_nodes(outputs: Sequence[Any]) -> list[Any]:
    """The autograd nodes of the compiled function that made `outputs` (a returned view's node
    leads to it)."""
    found = {}
    for t in outputs:
        node = t.grad_fn if isinstance(t, torch.Tensor) else None
        if node is not None and type(node).__name__ != "CompiledFunctionBackward":
            node = next((f for f, _ in node.next_functions if type(f).__name__ == "CompiledFunctionBackward"), None)
        if node is not None:
            found[id(node)] = node
    return list(found.values())


def count_saved(step: Callable[..., Any], saved_bytes: int) -> Callable[..., Any]:
    """`step` counting the `saved_bytes` its plan saves among `saved_by_pending_backwards` from
    each forward until its backward has run, or its autograd graph is let go without one."""
    if not saved_bytes:
        return step

    # Dynamo calls its backend's result with the graph inputs as arguments.
    @functools.wraps(step)
    def run(*args: Any) -> Any:
        outputs = step(*args)
        nodes = _compiled_nodes(outputs)
        if not nodes:
            return outputs  # no backward to come (no_grad, nothing requires grad)
        with _pending_lock:
            _pending_saved[0] += saved_bytes
        released = [False]

        def release(*_: Any) -> None:
            with _pending_lock:
                if not released[0]:
                    released[0] = True
                    _pending_saved[0] -= saved_bytes

        for node in nodes:
            node.register_hook(release)
            weakref.finalize(node, release)
        return outputs

    run.__dict__.pop("_boxed_call", None)  # copied by wraps; this wrapper takes arguments unboxed
    return run

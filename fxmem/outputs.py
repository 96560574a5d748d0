"""Graph outputs that a pass finishes outside the compiled step.

A compiled step is one autograd node: when the caller's backward sends no gradient into one of
its outputs, autograd hands the backward a tensor of zeros of that output's size. For an LM
head that returns its logits beside the loss, that is a (batch x tokens x vocabulary) tensor
of zeros in every backward — as large as the logits themselves — although training code reads
only the loss. A pass can avoid it: the graph returns the value without a gradient, plus the
few values its gradient is formed from (far smaller), and a hook run on the compiled step's
outputs gives the value its gradient again, in a function of the pass's own that does nothing
when no gradient comes.

`return_outside(gm, nodes, hook)` appends `nodes` to the graph's outputs and registers `hook`;
`with_output_hooks(compiled, gm)` is the step the backend hands to Dynamo: it runs `compiled`,
lets every hook edit the output list, and returns the outputs the graph had before.

A plan made with `keep_outputs=False` counts what the step returns as let go when its backward
starts; `warn_if_outputs_held` checks that premise on every call (`OutputsHeldWarning`).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from fxmem.plan import Plan, format_bytes

__all__ = [
    "OutputHook",
    "OutputsHeldWarning",
    "output_values",
    "return_outside",
    "warn_if_outputs_held",
    "with_output_hooks",
]

# hook(outputs): edits the list of the compiled step's outputs in place; `positions` are where
# the nodes handed to `return_outside` are in it.
OutputHook = Callable[[list[Any], Sequence[int]], None]

_HOOKS_KEY = "fxmem_output_hooks"
_USER_OUTPUTS_KEY = "fxmem_user_outputs"


def output_values(gm: fx.GraphModule) -> list[Any]:
    """The values `gm` returns, as a list."""
    values = gm.graph.output_node().args[0]
    return list(values) if isinstance(values, (tuple, list)) else [values]


def return_outside(gm: fx.GraphModule, nodes: Sequence[fx.Node], hook: OutputHook) -> None:
    """Append `nodes` to `gm`'s outputs; `hook` runs on every call's outputs with their
    positions. The caller still sees only the outputs the graph had before."""
    values = output_values(gm)
    gm.meta.setdefault(_USER_OUTPUTS_KEY, len(values))
    positions = list(range(len(values), len(values) + len(nodes)))
    gm.graph.output_node().args = (tuple(values) + tuple(nodes),)
    gm.meta.setdefault(_HOOKS_KEY, []).append((hook, positions))
    gm.recompile()


def with_output_hooks(compiled: Callable[..., Any], gm: fx.GraphModule) -> Callable[..., Any]:
    """`compiled` with the hooks `gm`'s passes registered run on its outputs (itself when there
    are none)."""
    hooks = gm.meta.pop(_HOOKS_KEY, [])
    if not hooks:
        return compiled
    user_outputs = gm.meta.pop(_USER_OUTPUTS_KEY)

    # Dynamo calls its backend's result with the graph inputs as arguments.
    @functools.wraps(compiled)
    def run(*args: Any) -> Any:
        outputs = list(compiled(*args))
        for hook, positions in hooks:
            hook(outputs, positions)
        return outputs[:user_outputs]

    run.__dict__.pop("_boxed_call", None)  # copied by wraps; this wrapper takes arguments unboxed
    return run


class OutputsHeldWarning(UserWarning):
    """What a step returned was still held as its backward started, though its plan
    (`keep_outputs=False`) counted it as let go, and by more than the plan's head-room: the
    step can exceed its budget."""


def warn_if_outputs_held(step: Callable[..., Any], plans: Sequence[Plan]) -> Callable[..., Any]:
    """`step` (the backend's result, planned with `keep_outputs=False`) checking, as the
    backward of each call starts, whether the tensors the call returned are still held; when
    more bytes are than the last of `plans` (the one the step runs) left between its predicted
    peak and its budget, `OutputsHeldWarning`. The check runs in a hook on each returned tensor
    that requires grad, the first to get its gradient (the loss the backward starts from) left
    out of the count; it holds none of them."""

    # Dynamo calls its backend's result with the graph inputs as arguments.
    @functools.wraps(step)
    def run(*args: Any) -> Any:
        outputs = step(*args)
        plan = plans[-1] if plans else None
        if plan is None or plan.budget_bytes is None:
            return outputs
        tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
        refs = [weakref.ref(t) for t in tensors]
        checked = [False]

        def hook_for(k: int) -> Callable[[torch.Tensor], None]:
            def hook(_grad: torch.Tensor) -> None:
                if checked[0]:
                    return
                checked[0] = True
                held = {}
                for j, r in enumerate(refs):
                    t = r()
                    if j != k and t is not None:
                        held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                room = plan.budget_bytes - plan.predicted_peak_bytes
                if sum(held.values()) > room:
                    warnings.warn(
                        f"fxmem: {format_bytes(sum(held.values()))} of what this step returned is still held "
                        f"as its backward starts; its plan (keep_outputs=False) counted it as let go and has "
                        f"{format_bytes(room)} of head-room below its budget of {format_bytes(plan.budget_bytes)}: "
                        "the step can exceed that budget. Keep only the loss (drop the model's output before "
                        "backward()), or plan with keep_outputs=True",
                        OutputsHeldWarning,
                        stacklevel=2,
                    )

            return hook

        if torch.is_grad_enabled():
            for k, t in enumerate(tensors):
                if t.requires_grad:
                    t.register_hook(hook_for(k))
        return outputs

    run.__dict__.pop("_boxed_call", None)  # copied by wraps; this wrapper takes arguments unboxed
    return run

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
starts; `watch_outputs` checks that premise on every call (`OutputsHeldWarning`), and warns
when code outside the step computes on an output too large for what the plan left free
(`LossOutsideWarning`).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from fxmem.plan import format_bytes

__all__ = [
    "LossOutsideWarning",
    "OutputHook",
    "OutputsHeldWarning",
    "output_values",
    "return_outside",
    "watch_outputs",
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


class LossOutsideWarning(UserWarning):
    """A gradient came into one of the step's outputs from code outside the step (a loss
    computed on the model's output), and that output takes more than the plan left free below
    its budget: what that code allocates is not in the plan, and the step can exceed the
    budget."""


def _held(ref: weakref.ref) -> bool:
    t = ref()
    return t is not None and t.numel() > 1


def watch_outputs(
    step: Callable[..., Any], released: Sequence[Sequence[int]], budget_bytes: int, room: int
) -> Callable[..., Any]:
    """`step` (the backend's result, planned with a budget) checking the outputs on every call,
    in hooks on its returned tensors that require grad; the hooks hold none of them. `room` is
    what the plan left free below `budget_bytes` besides its margin.

    - `released` (`Plan.released_outputs`, planned with `keep_outputs=False`): the outputs the
      plan frees at the forward's end. As the backward starts (in the first hook to fire, that
      of this step's part of the backward), those still held are summed, and when they take
      more than `room`, `OutputsHeldWarning`. A one-element output is not counted: the loss the
      backward starts from is alive then.
    - A gradient of more than `room` bytes into an output of more than one element comes from code
      run on it outside the step (a loss over the logits, computed after the model's forward):
      the memory that code takes is not in the plan, and one such tensor more than fills what
      the plan left free. `LossOutsideWarning`.
    """

    # Dynamo calls its backend's result with the graph inputs as arguments.
    @functools.wraps(step)
    def run(*args: Any) -> Any:
        outputs = step(*args)
        watched = [
            (weakref.ref(outputs[pos]), sid, nbytes)
            for pos, sid, nbytes in released
            if pos < len(outputs) and isinstance(outputs[pos], torch.Tensor)
        ]
        checked = [not watched]

        def check_held() -> None:
            checked[0] = True
            held = sum({sid: nbytes for ref, sid, nbytes in watched if _held(ref)}.values())
            if held > room:
                warnings.warn(
                    f"fxmem: {format_bytes(held)} of what this step returned is still held as its backward "
                    f"starts; its plan (keep_outputs=False) counted it as let go when the forward ended and "
                    f"kept {format_bytes(room)} free below its budget of {format_bytes(budget_bytes)} besides "
                    "its margin: the step can exceed that budget. Keep only the loss (drop the model's output "
                    "before backward()), or plan with keep_outputs=True",
                    OutputsHeldWarning,
                    stacklevel=1,
                )

        def hook_for(t: torch.Tensor, outside: bool) -> Callable[[torch.Tensor], None]:
            shape, nbytes = tuple(t.shape), t.numel() * t.element_size()

            def hook(grad: torch.Tensor | None) -> None:
                if not checked[0]:
                    check_held()
                # An output no gradient reached gets a hook call too, with None; a gradient
                # expanded from a scalar (`out.sum()`) took no memory of the output's size.
                if outside and grad is not None and grad.untyped_storage().nbytes() > room:
                    warnings.warn(
                        f"fxmem: a gradient came into an output of this step (shape {list(shape)}, "
                        f"{format_bytes(nbytes)}) from code run on it outside the step, such as a loss computed "
                        "after the model's forward. What that code allocates is not in the plan, which kept "
                        f"{format_bytes(room)} free below its budget of {format_bytes(budget_bytes)} besides its "
                        "margin, less than this output takes: the step can exceed that budget. Compute the loss "
                        "inside the model's forward (HF models: pass the labels), or compile a function that "
                        'calls both the model and the loss with backend="fxmem"',
                        LossOutsideWarning,
                        stacklevel=1,
                    )

            return hook

        for t in outputs:
            # Not on a leaf returned as it is (a parameter): its hooks would pile up, call by
            # call. Every call runs this: a hook only where one can have something to say.
            if not (isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None):
                continue
            outside = t.numel() > 1 and t.numel() * t.element_size() > room
            if watched or outside:
                t.register_hook(hook_for(t, outside))
        return outputs

    run.__dict__.pop("_boxed_call", None)  # copied by wraps; this wrapper takes arguments unboxed
    return run

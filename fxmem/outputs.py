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
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

__all__ = ["OutputHook", "output_values", "return_outside", "with_output_hooks"]

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

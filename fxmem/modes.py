"""The autocast, grad and inference modes a Dynamo graph puts in force at each node.

Dynamo records `with torch.autocast(...)`, `torch.no_grad()`, `torch.inference_mode()` and
`torch.set_autocast_enabled` as calls in the graph. `after_switch` says which of them are in
force after one more (an exit ends its enter; a setter that puts a value back ends the one
before it); `regions_at` folds it over the graph up to a node and `modes_at` enters them, so
that a node inserted there gets its example value in the node's precision and grad mode. The
rule matcher (fxmem.rules) refuses a match whose ops do not all run in one mode.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

__all__ = ["after_switch", "modes_at", "regions_at", "switches_mode"]


# Dynamo's records of `with torch.autocast(...)`, `torch.no_grad()`, `torch.inference_mode()`
# and `torch.set_autocast_enabled`: the ops between two of them run in one precision and mode.
_MODE_SWITCHES = frozenset(
    {
        "_enter_autocast",
        "_exit_autocast",
        "_set_grad_enabled",
        "_enter_inference_mode",
        "_exit_inference_mode",
        "set_autocast_enabled",
        "set_autocast_dtype",
    }
)


def switches_mode(node: fx.Node) -> bool:
    """Whether `node` enters or leaves an autocast region or switches grad or inference mode."""
    return node.op == "call_function" and getattr(node.target, "__name__", "") in _MODE_SWITCHES


# Each switch's parameters in order: Dynamo may pass any of them by keyword, and the builtins
# have no signature to bind them with.
_PARAMETERS = {
    "_enter_autocast": ("device_type", "dtype", "enabled", "cache_enabled"),
    "_exit_autocast": ("ctx",),
    "_set_grad_enabled": ("mode",),
    "_enter_inference_mode": ("mode",),
    "_exit_inference_mode": ("ctx",),
    "set_autocast_enabled": ("device_type", "enabled"),
    "set_autocast_dtype": ("device_type", "dtype"),
}


def _arguments(switch: fx.Node) -> tuple[Any, ...]:
    """`switch`'s arguments by position, keywords placed; an autocast setter's without a
    device (the old `set_autocast_enabled(True)`) are CUDA's."""
    name = switch.target.__name__
    args = list(switch.args)
    for parameter in _PARAMETERS[name][len(args) :]:
        if parameter not in switch.kwargs:
            break
        args.append(switch.kwargs[parameter])
    if name.startswith("set_autocast_") and len(args) == 1:
        args.insert(0, "cuda")
    return tuple(args)


def _state(switch: fx.Node) -> tuple[Any, ...]:
    """What `switch` sets: one device's autocast (its enabled flag and dtype), or grad and
    inference mode. An exit restores that state as it was at its enter."""
    name = switch.target.__name__
    if name in ("_set_grad_enabled", "_enter_inference_mode", "_exit_inference_mode"):
        return ("grad",)
    args = _arguments(switch)
    if name == "_exit_autocast":
        entered = args[0] if args else None
        return _state(entered) if isinstance(entered, fx.Node) else ("autocast", None)
    return ("autocast", args[0] if args else None)


def after_switch(regions: tuple[fx.Node, ...], switch: fx.Node) -> tuple[fx.Node, ...]:
    """The switches in force after mode switch `switch`, given those in force before it
    (`regions`, oldest first). An exit ends its enter and every switch of the same state made
    since; a setter that puts back the value its key had before its last setter, with no
    switch of that state since, ends that setter (`_set_grad_enabled(False)` ... `(True)`);
    any other switch stays in force after the switches before it."""
    name = switch.target.__name__
    args = _arguments(switch)
    if name.startswith("_exit_"):
        entered = args[0] if args else None
        if entered in regions:
            at = regions.index(entered)
            state = _state(entered)
            return regions[:at] + tuple(r for r in regions[at + 1 :] if _state(r) != state)
        return (*regions, switch)
    if name in _GETTERS:
        key = (switch.target, args[:-1])
        setters = [i for i, r in enumerate(regions) if (r.target, _arguments(r)[:-1]) == key]
        if (
            setters
            and all(_state(r) != _state(switch) for r in regions[setters[-1] + 1 :])
            and args[-1:] == (_value_before(regions, setters[-1]),)
        ):
            return regions[: setters[-1]] + regions[setters[-1] + 1 :]
    return (*regions, switch)


def _value_before(regions: tuple[fx.Node, ...], at: int) -> Any:
    """The value setter `regions[at]`'s key had before it, where the switches before it tell.
    Dynamo records a grad setter only where it changes the mode, so grad was the other
    value; an autocast setter it records even where it changes nothing."""
    setter = regions[at]
    name = setter.target.__name__
    args = _arguments(setter)
    if name == "_set_grad_enabled":
        return not args[-1]
    for r in reversed(regions[:at]):
        earlier = _arguments(r)
        if r.target is setter.target and earlier[:-1] == args[:-1]:
            return earlier[-1]
        if r.target.__name__ == "_enter_autocast" and earlier[:1] == args[:1]:
            value = earlier[1 if name == "set_autocast_dtype" else 2] if len(earlier) > 2 else None
            return _UNKNOWN if value is None else value
    return _UNKNOWN


_UNKNOWN = object()  # the caller's value, not known from the graph


_GETTERS: dict[str, Callable[..., Any]] = {
    "_set_grad_enabled": torch.is_grad_enabled,
    "set_autocast_enabled": torch.is_autocast_enabled,
    "set_autocast_dtype": torch.get_autocast_dtype,
}


def regions_at(node: fx.Node) -> tuple[fx.Node, ...]:
    """The graph's mode switches in force at `node` (see `after_switch`), oldest first."""
    regions: tuple[fx.Node, ...] = ()
    for n in node.graph.nodes:
        if n is node:
            break
        if switches_mode(n):
            regions = after_switch(regions, n)
    return regions


@contextlib.contextmanager
def modes_at(node: fx.Node) -> Iterator[None]:
    """The autocast, grad and inference modes the graph's switches put in force at `node`, over
    the caller's."""
    with contextlib.ExitStack() as stack:
        for switch in regions_at(node):
            stack.callback(_enter(switch))
        yield


def _enter(switch: fx.Node) -> Callable[[], Any]:
    """Do what `switch` does; returns what undoes it."""
    name = switch.target.__name__
    args = _arguments(switch)
    if name.startswith("_exit_") or any(isinstance(a, fx.Node) for a in args):
        return lambda: None  # an exit without its enter, or a mode read from the graph's values
    if name.startswith("_enter_"):
        context = switch.target(*args)
        leave = getattr(sys.modules[switch.target.__module__], "_exit_" + name.removeprefix("_enter_"))
        return lambda: leave(context)
    before = _GETTERS[name](*args[:-1])
    switch.target(*args)
    return lambda: switch.target(*args[:-1], before)

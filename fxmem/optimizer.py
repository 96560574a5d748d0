"""What a torch optimizer adds to a training step's memory: its state, and the temporaries of
one `step()`.

The temporaries depend on which implementation torch runs, as torch picks it: `fused=True`
updates in one kernel per tensor and makes none; the single-tensor loop (torch's default on
CPU) makes a few tensors the size of the parameter it is updating; the multi-tensor
("foreach") path (torch's default on CUDA) makes them for a whole group of parameters at once.
The counts below follow torch's Adam, AdamW and SGD; other optimizers are charged as much as
the largest of those.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from fxmem import _torch_private as tp
from fxmem.cost import tensor_bytes

__all__ = ["OptimizerNotPlannedWarning", "optimizer_bytes", "step_implementation", "watch_optimizers"]


class OptimizerNotPlannedWarning(UserWarning):
    """An optimizer stepped on the parameters of an optimized module whose plans were made
    without it (`optimizer=` not given, or another one): its state and step are outside them."""


def planned_for(optimizer: torch.optim.Optimizer, planned: torch.optim.Optimizer | None) -> bool:
    """`optimizer` is the one a plan counted (or a wrapper's inner one: Accelerate's,
    ZeroRedundancyOptimizer's share its state)."""
    return planned is not None and (optimizer is planned or optimizer.state is planned.state)


# Parameters of the steps the torch.compile backend planned against a budget, each with the
# optimizer its plan counted (a weak reference; None: none): an optimizer stepping on them that
# is not that one is warned of, once. `fxmem.optimize` watches its own and plans again instead.
_planned_with: WeakIdKeyDictionary = WeakIdKeyDictionary()
_judged: weakref.WeakSet = weakref.WeakSet()  # optimizers warned of, or found planned for
_lock = threading.Lock()


def watch_optimizers(parameters: Sequence[torch.Tensor], planned: torch.optim.Optimizer | None) -> None:
    """Warn (`OptimizerNotPlannedWarning`) when an optimizer other than `planned` steps on
    `parameters`, the parameters of a step planned with `planned` counted."""
    with _lock:
        for p in parameters:
            _planned_with[p] = None if planned is None else weakref.ref(planned)
        _judged.clear()  # a new plan: each optimizer is judged against it again


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _planned_with or optimizer in _judged:
        return
    with _lock:
        _judged.add(optimizer)
        plans = [_planned_with.get(p, False) for group in optimizer.param_groups for p in group["params"]]
    plans = [ref for ref in plans if ref is not False]
    if not plans or all(ref is not None and planned_for(optimizer, ref()) for ref in plans):
        return
    warnings.warn(
        f"fxmem: an optimizer ({type(optimizer).__name__}) stepped on the parameters of a step the fxmem "
        "backend planned without it: its state and its step are outside that plan's budget. Pass it to "
        "torch.compile as options={'optimizer': ...}, or use fxmem.optimize, which plans again for it",
        OptimizerNotPlannedWarning,
        stacklevel=3,  # the caller of optimizer.step()
    )


register_optimizer_step_post_hook(_after_step)

# state tensors per parameter (the first step allocates them)
_STATE_SLOTS = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "RMSprop": 1, "Adagrad": 1, "SGD": 0}
_ADAM = ("Adam", "AdamW")


def optimizer_bytes(optimizer: torch.optim.Optimizer | None, device_type: str | None = None) -> tuple[int, int]:
    """(state bytes not yet allocated, temporaries of one step) for `optimizer`.

    `device_type`, when given, is the device the step will run on, in place of the
    parameters' own (meta tensors, for an estimate): it decides which implementation torch
    defaults to.
    """
    if optimizer is None:
        return 0, 0
    name = _known_class(optimizer)
    missing = step = 0
    for group in optimizer.param_groups:
        # torch decides on the parameters that have gradients; before the backward, those
        # that will
        params = [p for p in group["params"] if p.requires_grad]
        slots = _STATE_SLOTS.get(name, 0)
        if name == "SGD":
            slots = 1 if group.get("momentum", 0) else 0
        elif name in _ADAM and group.get("amsgrad"):
            slots = 3  # and the running maximum of the second moment
        missing += sum(slots * tensor_bytes(p) for p in params if not optimizer.state.get(p))
        if params:
            step = max(step, _group_step_bytes(name, group, params, device_type))
    return missing, step


def step_implementation(
    group: dict, params: Sequence[torch.Tensor], device_type: str | None = None, name: str = ""
) -> str:
    """The implementation torch runs for this parameter group: "fused", "foreach" or "single".

    As torch.optim decides it: only when neither `fused` nor `foreach` is given does it pick,
    foreach where every parameter is a plain tensor on a device with foreach kernels (for
    Adam, not when `differentiable`, nor with a tensor `lr` unless `capturable`). `name` is
    the optimizer's class.
    """
    if group.get("fused"):
        return "fused"
    foreach = group.get("foreach")
    if foreach is None and group.get("fused") is None:
        plain = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)
        devices = {device_type or p.device.type for p in params}
        foreach = devices <= set(tp.foreach_default_devices()) and all(type(p) in plain for p in params)
        if name != "SGD" and (
            group.get("differentiable") or (isinstance(group.get("lr"), torch.Tensor) and not group.get("capturable"))
        ):
            foreach = False
    return "foreach" if foreach else "single"


def _group_step_bytes(name: str, group: dict, params: list[torch.Tensor], device_type: str | None) -> int:
    impl = step_implementation(group, params, device_type, name)
    if impl == "fused":
        return 0
    sizes = [tensor_bytes(p) for p in params]
    copies_grad = bool(group.get("maximize")) or (
        bool(group.get("weight_decay")) and not (name == "AdamW" or group.get("decoupled_weight_decay"))
    )
    if impl == "foreach":
        # per (device, dtype) group, all at once; a copy of the gradients is dropped before
        # Adam's square root of the second moment is made, but that square root is still bound
        # while the next (device, dtype) group's is made; with tensor betas the scaled
        # gradients are made beside the copy
        widths = sorted(_by_device_and_dtype(params).values(), reverse=True)
        widest = widths[0]
        if name in _ADAM:
            tensor_betas = any(isinstance(b, torch.Tensor) for b in group.get("betas", ()))
            return widest + (widths[1] if len(widths) > 1 else 0) + (widest if tensor_betas and copies_grad else 0)
        if name == "SGD":  # Nesterov momentum is added to the gradients in place
            return widest if copies_grad else 0
        return 2 * widest
    if name in _ADAM:
        # `denom = (exp_avg_sq.sqrt() / c).add_(eps)`: the square root and the quotient at
        # once, while the previous parameter's denom is still bound; beside a copy of the
        # gradient when weight decay is added to it or it is negated
        held = 1 if copies_grad else 0
        return max((2 + held) * s + (sizes[k - 1] if k else 0) for k, s in enumerate(sizes))
    if name == "SGD":
        # each of weight decay, Nesterov momentum and maximize makes a new gradient, a second
        # while the first is alive; the negated one is made while the previous parameter's
        # gradient is still bound
        copies = min(bool(group.get("weight_decay")) + bool(group.get("nesterov")) + bool(group.get("maximize")), 2)
        previous = bool(group.get("maximize"))
        return max(copies * s + (sizes[k - 1] if k and previous else 0) for k, s in enumerate(sizes))
    return 3 * max(sizes)


def _known_class(optimizer: torch.optim.Optimizer) -> str:
    """The name of the torch optimizer `optimizer` is (a subclass of one counts as it)."""
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim") and cls.__name__ in _STATE_SLOTS:
            return cls.__name__
    return type(optimizer).__name__


def _by_device_and_dtype(params: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], int]:
    out: dict[tuple[torch.device, torch.dtype], int] = {}
    for p in params:
        key = (p.device, p.dtype)
        out[key] = out.get(key, 0) + tensor_bytes(p)
    return out

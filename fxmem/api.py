"""`fxmem.optimize(model, budget_gb)`: the same module, planned to fit a memory budget."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

from fxmem.backend import COMPILERS, Options, fxmem_backend
from fxmem.errors import BudgetError, GraphBreakError, check_budget_gb
from fxmem.plan import Plan

__all__ = ["FxmemModule", "optimize"]


def optimize(
    model: nn.Module,
    budget_gb: float,
    *,
    example_inputs: Sequence[Any] | dict[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    compiler: str = "inductor",
    passes: Sequence[str] | None = None,
    margin: float = 0.03,
) -> FxmemModule:
    """Return `model` planned so that one training step peaks at most `budget_gb` GiB.

    `budget_gb` counts GiB (2**30 bytes) of device memory in use during one forward and
    backward (and the optimizer step, when `optimizer` is given): parameters, buffers,
    inputs, gradients, optimizer state, saved activations and temporaries, as
    `fxmem.measure` reports it. The returned module shares its parameters and buffers with
    `model`; `state_dict()` keys, `train()`/`eval()` and the call signature are unchanged.

    Planning happens on the first call (or now, with `example_inputs`: a tuple of
    positional arguments or a dict of keyword arguments), and again for every new input
    shape. A budget below what any plan reaches raises `fxmem.BudgetError` before the step
    runs, naming the smallest budget that fits; the model is left as it was.

    `compiler` is "inductor" (default) or "eager" (no code generation, for debugging).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize() takes an nn.Module, got {type(model).__name__}")
    check_budget_gb(budget_gb)
    if compiler not in COMPILERS:
        raise ValueError(f"compiler must be one of {COMPILERS}, got {compiler!r}")
    options = Options.from_dict(
        {"budget_gb": budget_gb, "compiler": compiler, "optimizer": optimizer, "passes": passes, "margin": margin}
    )
    wrapped = FxmemModule(model, options)
    if example_inputs is not None:
        wrapped.plan_for(example_inputs)
    return wrapped


class FxmemModule(nn.Module):
    """A module whose training step is planned against a memory budget.

    It holds the original module without registering it as a child, and answers for it:
    parameters, buffers, `state_dict()` keys and modes are the original's own.
    """

    def __init__(self, model: nn.Module, options: Options):
        super().__init__()
        self.__dict__["_fxmem_model"] = model
        self.__dict__["_fxmem_plans"] = []
        options.on_plan = self._fxmem_plans.append
        self.__dict__["_fxmem_options"] = options

        def backend(gm, example_inputs, **_):
            return fxmem_backend(gm, example_inputs, options=options)

        self.__dict__["_fxmem_compiled"] = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
        self.training = model.training

    # -- the plan ---------------------------------------------------------------------------
    @property
    def plan(self) -> Plan | None:
        """The plan made for the most recent input shape (None before the first call)."""
        return self._fxmem_plans[-1] if self._fxmem_plans else None

    @property
    def plans(self) -> list[Plan]:
        return list(self._fxmem_plans)

    @property
    def module(self) -> nn.Module:
        """The original module."""
        return self._fxmem_model

    def plan_for(self, example_inputs: Sequence[Any] | dict[str, Any]) -> Plan:
        """Plan for these inputs without changing anything the model or the caller owns.

        The forward runs once (that is how the graph is captured); buffers it updates and the
        random-number state it draws from are put back afterwards.
        """
        args, kwargs = (), {}
        if isinstance(example_inputs, dict):
            kwargs = example_inputs
        elif isinstance(example_inputs, (tuple, list)):
            args = tuple(example_inputs)
        else:
            args = (example_inputs,)
        model = self._fxmem_model
        buffers = {k: b.detach().clone() for k, b in model.named_buffers()}
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        try:
            self(*args, **kwargs)
        finally:
            with torch.no_grad():
                for k, b in model.named_buffers():
                    b.copy_(buffers[k])
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        return self.plan

    # -- calling ----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._fxmem_compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None)
            if isinstance(inner, (BudgetError, ValueError, TypeError)):
                raise inner from None
            raise
        except torch._dynamo.exc.Unsupported as e:
            raise GraphBreakError(
                "fxmem plans one graph per step and this model does not capture as one "
                f"(torch.compile(fullgraph=True) fails): {str(e).splitlines()[0]}"
            ) from e

    # -- the original module's own state --------------------------------------------------
    def train(self, mode: bool = True) -> FxmemModule:
        self._fxmem_model.train(mode)
        self.training = mode
        return self

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator:
        return self._fxmem_model.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator:
        return self._fxmem_model.named_buffers(prefix, recurse, remove_duplicate)

    def named_children(self) -> Iterator:
        return self._fxmem_model.named_children()

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True) -> Iterator:
        return self._fxmem_model.named_modules(memo, prefix, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self._fxmem_model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self._fxmem_model.load_state_dict(state_dict, strict=strict, assign=assign)

    def _apply(self, fn: Any, recurse: bool = True) -> FxmemModule:
        self._fxmem_model._apply(fn, recurse)
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_fxmem_model"], name)

    def __deepcopy__(self, memo: dict) -> FxmemModule:
        return optimize(copy.deepcopy(self._fxmem_model, memo), **self._copy_kwargs())

    def _copy_kwargs(self) -> dict[str, Any]:
        o = self._fxmem_options
        return {"budget_gb": o.budget_gb, "compiler": o.compiler, "passes": o.passes, "margin": o.margin}

    def extra_repr(self) -> str:
        o = self._fxmem_options
        return f"budget_gb={o.budget_gb}, compiler={o.compiler!r}, module={type(self._fxmem_model).__name__}"

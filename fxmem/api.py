"""`fxmem.optimize(model, budget_gb)`: the same module, planned to fit a memory budget."""

from __future__ import annotations

import copy
import os
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from fxmem import _torch_private as tp
from fxmem.backend import COMPILERS, Options, fxmem_backend
from fxmem.errors import BudgetError, GraphBreakError, check_budget_gb, not_one_graph, why_not_captured
from fxmem.optimizer import OptimizerNotPlannedWarning, planned_for
from fxmem.partition import PlanMade, plans_only
from fxmem.passes import tie_weights as tie_weights_pass
from fxmem.plan import Plan
from fxmem.probe import probes_skipped
from fxmem.step_start import gradients_held, held_while_capturing

__all__ = ["FxmemModule", "OptimizerNotPlannedWarning", "optimize"]


def optimize(
    model: nn.Module,
    budget_gb: float,
    *,
    example_inputs: Sequence[Any] | dict[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    compiler: str = "inductor",
    passes: Sequence[str] | None = None,
    precision: str = "fp32",
    tie_weights: bool | Sequence[tuple[str, str]] = False,
    margin: float = 0.03,
    keep_outputs: bool = True,
    plan: str | os.PathLike | Plan | None = None,
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

    `passes` names the rewrite passes to run (default: the exact ones, `swap_sdpa`,
    `fuse_projections`, `chunked_attention`, `chunked_lm_loss`; `()` runs none). `precision="bf16"` also runs
    `bf16_regions`: autocast's bf16 policy over the step, fp32 master weights — numerics
    change, so it is opt-in. Naming `microbatch_blocks` lets a budget below the floor run
    repeated blocks over slices of the batch (see its docstring; opt-in).

    `tie_weights=True` ties parameters with equal shapes and values into one tensor (a tied
    checkpoint loaded untied), but not the same weight of repeated blocks built as copies of
    one (names that differ only in block indices; a warning names them); a list of `(keep, replace)` name pairs ties those. Numerics of
    training change, so it is opt-in; `plan.tie_candidates` lists what could be tied and
    `plan.tied_weights` what is one tensor. Build the optimizer after tying.

    `keep_outputs=False` plans for a training loop that keeps only the loss
    (`model(**batch).loss.backward()`): what else the step returns (an LM's logits, its
    key/value caches) is counted until the forward ends, not through the backward, which can
    lower the peak by as much as those outputs take. Each call with a budget checks the
    premise as its backward starts, and warns (`fxmem.OutputsHeldWarning`) when the outputs
    the plan let go are still held and take more than the plan left free below the budget
    besides its margin. A saved plan applies only with the setting it was made with.

    `plan`, a saved `plan.json` (or the folder `Plan.save` wrote), applies that plan's
    decisions instead of planning again; `fxmem.PlanMismatchError` is raised, naming the
    first difference, if it was made for another graph (other model, shapes or dtypes).

    A copy (`copy.deepcopy`, `torch.save` and `torch.load`) keeps these settings, except
    `optimizer=`, whose parameters are not the copy's, and plans again at its first call.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize() takes an nn.Module, got {type(model).__name__}")
    if isinstance(model, FxmemModule):
        raise TypeError(
            "this module is already optimized by fxmem: pass the original (its .module) to plan it with other settings"
        )
    check_budget_gb(budget_gb)
    if compiler not in COMPILERS:
        raise ValueError(f"compiler must be one of {COMPILERS}, got {compiler!r}")
    options = Options.from_dict(
        {
            "budget_gb": budget_gb,
            "compiler": compiler,
            "optimizer": optimizer,
            "passes": passes,
            "precision": precision,
            "margin": margin,
            "keep_outputs": keep_outputs,
            "plan": plan,
        }
    )
    undo = tie_weights_pass.tie(model, tie_weights)
    try:
        wrapped = FxmemModule(model, options, ties=len(undo), weights=tie_weights_pass.detect(model))
        if example_inputs is not None:
            wrapped.plan_for(example_inputs)
    except BaseException:
        tie_weights_pass.untie(undo)
        raise
    return wrapped


class FxmemModule(nn.Module):
    """A module whose training step is planned against a memory budget.

    It holds the original module without registering it as a child, and answers for it:
    parameters, buffers, `state_dict()` keys and modes are the original's own.
    """

    def __init__(
        self, model: nn.Module, options: Options, ties: int = 0, weights: tie_weights_pass.TieReport | None = None
    ):
        super().__init__()
        self.__dict__["_fxmem_model"] = model
        self.__dict__["_fxmem_plans"] = []
        self.__dict__["_fxmem_ties"] = ties
        self.__dict__["_fxmem_weights"] = weights or tie_weights_pass.detect(model)
        options.on_plan = _weakly(self._record_plan)
        self.__dict__["_fxmem_options"] = options

        # Per number of gradients held as a step starts, the step compiled (and planned) for
        # it: accumulating gradients over steps holds them through the next forward and
        # backward, which a plan made without them would not count.
        self.__dict__["_fxmem_compiled"] = {}
        self.__dict__["_fxmem_unprobed"] = set()  # counts whose plan lacks kernels' workspaces
        # Optimizers seen stepping and judged (warned of, or training other parameters).
        self.__dict__["_fxmem_seen_optimizers"] = weakref.WeakSet()
        _watched.add(self)
        # The plan each kind of call runs (`_call_kind`), for `plan_for`.
        self.__dict__["_fxmem_plan_by_call"] = {}
        # `_call_kind`'s arguments, for the call running in each thread (`.args`).
        self.__dict__["_fxmem_calling"] = threading.local()
        self.training = model.training

    def _gradients_held(self, inputs: list[torch.Tensor]) -> int:
        return gradients_held([*self._fxmem_model.parameters(), *inputs])

    @staticmethod
    def _call_kind(held: int, inputs: list[torch.Tensor], grad_mode: bool) -> tuple:
        """What a call's plan depends on: gradients held, inputs' shapes and dtypes, grad mode."""
        return held, tuple((tuple(x.shape), x.dtype) for x in inputs), grad_mode

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer stepped: one that trains this module's parameters, but was not the
        `optimizer=` planned for, holds state the plans do not count. Warned once per
        optimizer; every step is planned again at its next call, counting that state."""
        planned = self._fxmem_options.optimizer
        if optimizer in self._fxmem_seen_optimizers or planned_for(optimizer, planned):
            return
        self._fxmem_seen_optimizers.add(optimizer)
        mine = {id(p) for p in self._fxmem_model.parameters()}
        if not any(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
            return
        warnings.warn(
            f"fxmem: an optimizer ({type(optimizer).__name__}) that trains this module's parameters stepped, but its plans "
            "were made for "
            + ("no optimizer" if planned is None else "another optimizer")
            + ": its state and its step are outside them. The next call plans again, counting the state as "
            "it finds it; pass optimizer= to fxmem.optimize to plan for the step too",
            OptimizerNotPlannedWarning,
            stacklevel=4,  # the caller of optimizer.step()
        )
        self._fxmem_compiled.clear()

    def _compiled_step(self, held: int) -> Any:
        if held in self._fxmem_unprobed and not torch.autograd._profiler_enabled():
            # Planned under a profiler (fxmem.measure around the first call), where kernels'
            # workspaces cannot be measured: compiled and planned again, now that they can.
            self._fxmem_unprobed.discard(held)
            self._fxmem_compiled.pop(held, None)
        compiled = self._fxmem_compiled.get(held)
        if compiled is None:
            # A backend of its own: Dynamo would otherwise run the step compiled for another
            # count, its guards being the same.
            compiled = torch.compile(
                self._fxmem_model,
                backend=_backend(weakref.ref(self._fxmem_options)),
                fullgraph=True,
                dynamic=False,
                **tp.own_recompiles(),
            )
            self._fxmem_compiled[held] = compiled
        return compiled

    # -- the plan ---------------------------------------------------------------------------
    def _record_plan(self, plan: Plan) -> None:
        report = self._fxmem_weights  # found at optimize(): planning runs under fake tensors
        plan.tied_weights, plan.tie_candidates = report.shared, report.candidates
        if self._fxmem_ties:
            plan.rewrites["tie_weights"] = self._fxmem_ties
        self._fxmem_plans.append(plan)
        calling = getattr(self._fxmem_calling, "args", None)
        if calling is not None:
            self._fxmem_plan_by_call[self._call_kind(*calling)] = plan

    @property
    def plan(self) -> Plan | None:
        """The plan made most recently (None before the first call): plans are made for each new
        input shape, and again where a step starts with gradients held that earlier steps'
        plans did not count (accumulated over steps)."""
        return self._fxmem_plans[-1] if self._fxmem_plans else None

    @property
    def plans(self) -> list[Plan]:
        return list(self._fxmem_plans)

    @property
    def module(self) -> nn.Module:
        """The original module."""
        return self._fxmem_model

    def plan_for(self, example_inputs: Sequence[Any] | dict[str, Any], *, compile: bool = True) -> Plan | None:
        """Plan for these inputs without changing anything the model or the caller owns; None
        when the step has no backward (nothing it returns requires a gradient).

        The forward runs once (that is how the graph is captured); buffers it updates and the
        random-number state it draws from are put back afterwards. The step is compiled too,
        so the first call with inputs of these shapes runs at once. `compile=False` stops once
        the plan is made: nothing is compiled or run, in a fraction of the time compiling
        takes, and the first call plans again (the same plan: planning is deterministic)
        before it compiles. (A step with no backward has no plan to stop at: it compiles.)
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
        inputs = _tensors(args, kwargs)
        kind = self._call_kind(self._gradients_held(inputs), inputs, torch.is_grad_enabled())
        try:
            # (the copies kept to put back are this call's own: not counted as alive at the step)
            with held_while_capturing([*buffers.values(), cpu_rng]):
                if compile:
                    self(*args, **kwargs)
                else:
                    self._plan_only(args, kwargs)
            planned = self._fxmem_plan_by_call.get(kind)
        finally:
            with torch.no_grad():
                for k, b in model.named_buffers():
                    b.copy_(buffers[k])
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            # A BudgetError's traceback keeps this frame: a plan made while the caller holds the
            # error (a retry at its floor, in the `except` block) would count these copies as
            # live tensors, and its floor would be higher by their bytes.
            del buffers, cpu_rng, cuda_rng, inputs
        return planned

    def _plan_only(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """Capture and plan the step for these inputs, stopping before code generation. (A
        whole-graph capture raises the stop even with Dynamo's errors suppressed, which would
        otherwise run the step uncompiled.)"""
        with plans_only():
            try:
                self(*args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as e:
                if not isinstance(getattr(e, "inner_exception", None), PlanMade):
                    raise
        # Dynamo keeps no code for a compilation that raised: the first call compiles.

    # -- calling ----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inputs = _tensors(args, kwargs)
        held = self._gradients_held(inputs)
        self._fxmem_calling.args = (held, inputs, torch.is_grad_enabled())  # read when a plan is made
        skipped = probes_skipped()
        try:
            with tp.logging_calls_skipped():
                return self._compiled_step(held)(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None)
            if isinstance(inner, BudgetError):
                refused = inner  # raised below, outside this handler
            elif isinstance(inner, (ValueError, TypeError)):
                raise inner from None
            else:
                raise
        except tp.RECOMPILE_LIMIT_ERRORS as e:
            limit = torch._dynamo.config.recompile_limit
            raise RuntimeError(
                "fxmem compiles and plans the step once per kind of call (input shapes, values of "
                "non-tensor arguments, mode: training, eval(), no_grad()), and this module's step has "
                f"been compiled {limit} times, Dynamo's limit (torch._dynamo.config.recompile_limit; "
                "its warning above names what changed last): pad inputs to a few sizes, pass values "
                "that change as tensors, or raise that limit before the new calls come"
            ) from e
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
            unsupported = isinstance(e, torch._dynamo.exc.Unsupported)
            if ("guard on data-dependent" if unsupported else "data-dependent") not in str(e):
                if unsupported:
                    raise not_one_graph(e) from e
                raise
            # A branch on a tensor's value (`if x.sum().item() > 0`): the graph would differ by
            # data (torch 2.11's Dynamo says so with Unsupported, later ones with UserError).
            raise GraphBreakError(
                "fxmem plans one graph per step and this model branches on a tensor's value, which "
                "decides the graph: compute both sides (torch.where) or branch outside the step; "
                f"{why_not_captured(e)}"
            ) from e
        finally:
            self._fxmem_calling.args = None
            if probes_skipped() != skipped:
                self._fxmem_unprobed.add(held)
        # Raised here, without the frames of the capture and the planning it came through:
        # they hold tensors of the step (the random-number state dynamo keeps), which a plan
        # made while the caller holds the error (a retry at its floor) would count as live.
        raise refused.with_traceback(None)

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

    # A copy keeps every setting but `optimizer=`, whose parameters are not the copy's: an
    # optimizer of the copy's warns at its first step, and the copy plans again counting it.
    # Weights tied by `tie_weights` stay one tensor in the copied model, and its plans say so.
    def __deepcopy__(self, memo: dict) -> FxmemModule:
        return _reoptimized(copy.deepcopy(self._fxmem_model, memo), self._copy_kwargs(), self._fxmem_ties)

    def __reduce__(self) -> tuple:
        # Pickled (`torch.save(module)`) as the original module and the settings: the compiled
        # steps are code of this process, and the copy plans again on its first call.
        return _reoptimized, (self._fxmem_model, self._copy_kwargs(), self._fxmem_ties)

    def _copy_kwargs(self) -> dict[str, Any]:
        o = self._fxmem_options
        return {
            "budget_gb": o.budget_gb,
            "compiler": o.compiler,
            "passes": o.passes,
            "precision": o.precision,
            "margin": o.margin,
            "keep_outputs": o.keep_outputs,
            "plan": o.plan,
        }

    def extra_repr(self) -> str:
        o = self._fxmem_options
        return f"budget_gb={o.budget_gb}, compiler={o.compiler!r}, module={type(self._fxmem_model).__name__}"


_watched: weakref.WeakSet[FxmemModule] = weakref.WeakSet()


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for module in list(_watched):
        module._optimizer_stepped(optimizer)


register_optimizer_step_post_hook(_after_optimizer_step)


def _reoptimized(model: nn.Module, kwargs: dict[str, Any], ties: int = 0) -> FxmemModule:
    wrapped = optimize(model, **kwargs)
    wrapped.__dict__["_fxmem_ties"] = ties  # tied when the original was optimized
    return wrapped


def _backend(options_ref: weakref.ref) -> Any:
    # torch keeps every backend it compiled with until torch._dynamo.reset(): held weakly, the
    # options (and through them the module and the model) go when the user drops them.
    def backend(gm, example_inputs, **_):
        opts = options_ref()
        if opts is None:  # only the module compiles with it, and it holds the options
            raise RuntimeError("fxmem: the optimized module was freed during compilation")
        # The module picks the step by the gradients held (`_compiled_step`): nothing to watch.
        return fxmem_backend(gm, example_inputs, options=opts, watch_gradients=False)

    return backend


def _tensors(args: tuple, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    return [x for x in tp.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]


def _weakly(method: Any) -> Any:
    """`method`, called through a weak reference to its object: what keeps the callback (the
    options a compiled step closes over, held by Dynamo's cache and, on torch 2.11, by what it
    keeps of a compiled step beyond the garbage collector's sight) does not keep the module and
    its parameters alive."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call

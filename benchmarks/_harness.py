"""Shared benchmark harness: build configurations over one model, measure them alternately.

All configurations of one model share the model's parameter and buffer tensors (the
checkpointing configuration runs a deep copy whose parameters *are* the original's), so that
what `fxmem.measure` counts as alive at entry — parameters, buffers, the batch — is the same
for every configuration, and they can run round-robin in one process: step i of every
configuration runs before step i + 1 of any, and the order rotates every round, so a slow
moment of a shared machine is spread over all of them instead of landing on one.

Per configuration: one warm-up step (compilation and fxmem's planning included: reported as
"first call"), then `steps` rounds; in each round one plain step timed with
`time.perf_counter` (its time; CUDA is synchronised around it), and in the first and the last
round one more step inside `fxmem.measure` (the peak: the largest of these and the warm-up's).
Past the time limit no configuration starts, and the round that starts is the last once
`MIN_ROUNDS` have run (the report says so: its medians are of fewer steps).
On CPU `fxmem.measure` runs the torch profiler, whose per-op overhead would bias the time
against configurations that run many small ops (eager), hence the separate timed step.
Gradients are compared once per configuration, on the first measured step, against the
reference of the same random-number stream (see `Config.family`).

The reference gradients are numpy copies, so no extra torch tensor is alive while another
configuration is measured.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import math
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn as nn

import fxmem
from benchmarks._models import Batch, ModelSpec
from benchmarks._records import MIN_ROUNDS, SEED, UNCONSTRAINED_GB, Config, GiB, MiB, Options, Result
from fxmem.pipeline import default_passes

__all__ = [
    "KEEP_OUTPUTS",
    "Runner",
    "allow_many_compiles",
    "bench_model",
    "call_model",
    "compiled_err",
    "floor_of",
    "free_memory",
    "fxmem_config",
    "eager_at",
    "fxmem_at",
    "grads_of",
    "overall_rel_err",
    "train_step",
    "warm_up_at_floor",
    "zero_grads",
]


# -- small helpers ---------------------------------------------------------------------------------
def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _loss(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def call_model(module: Callable, batch: Batch) -> Any:
    return module(**batch) if isinstance(batch, dict) else module(*batch)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def to_device(model: nn.Module, batch: Batch, device: torch.device | str) -> Batch:
    """Move `model` to `device` in training mode; return `batch` there (a dict or a tuple)."""
    model.to(device).train()
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    return tuple(v.to(device) for v in batch)


def zero_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def overall_rel_err(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Relative error of all gradients together (inf when the parameter sets differ). Robust to
    gradients that are zero in exact arithmetic — a convolution's bias before a batch norm, a
    key projection's bias — whose own relative error is noise over noise."""
    if got.keys() != ref.keys():
        return float("inf")
    diff = sum(((got[k] - ref[k]).double() ** 2).sum() for k in ref) ** 0.5
    norm = sum((ref[k].double() ** 2).sum() for k in ref) ** 0.5
    return float(diff / norm)


# Every step here keeps only the loss (`train_step`, `Runner._step`): what else the model
# returns is let go before the backward, for every configuration, so fxmem plans for that.
KEEP_OUTPUTS = False


def train_step(module: Callable, batch: Batch) -> torch.Tensor:
    """Forward and backward of one batch, keeping only the loss; returns it, detached."""
    loss = _loss(call_model(module, batch))
    loss.backward()
    return loss.detach()


def holding_step(module: Callable, batch: Batch) -> torch.Tensor:
    """As `train_step`, but what the model returns (logits, caches) is held until the
    backward has run: the step a plan with `keep_outputs=True` is made for."""
    out = call_model(module, batch)
    loss = _loss(out)
    loss.backward()
    return loss.detach()


def eager_at(
    model: nn.Module, batch: Batch, state: dict[str, torch.Tensor], step: Callable = train_step
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Eager's measured `step` (after a warm-up step) and its gradients. `state` (the model's
    state dict: batch norm's running statistics) is put back before each step; the model is
    left without gradients, in that state."""
    step(model, batch)
    zero_grads(model)
    model.load_state_dict(state)
    measured = fxmem.measure(step, model, batch)
    grads = grads_of(model)
    zero_grads(model)
    model.load_state_dict(state)
    return measured, grads


def compiled_err(model: nn.Module, batch: Batch, state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Plain `torch.compile`'s gradients' error against `ref` (`overall_rel_err`): how exact
    inductor is on its own. The model is left without gradients, in `state`."""
    train_step(torch.compile(model), batch)
    err = overall_rel_err(grads_of(model), ref)
    zero_grads(model)
    model.load_state_dict(state)
    torch._dynamo.reset()
    return err


def fxmem_at(
    model: nn.Module,
    batch: Batch,
    state: dict[str, torch.Tensor],
    budget_bytes: int,
    compiler: str,
    ref: dict[str, torch.Tensor],
    keep_outputs: bool = KEEP_OUTPUTS,
    step: Callable = train_step,
) -> tuple[nn.Module, float, float, Any]:
    """`fxmem.optimize` at `budget_bytes`: the module, the first `step`'s seconds (planning and
    compiling; a refused budget raises its BudgetError), that step's gradients' error against
    `ref` (`overall_rel_err`), and one measured step (no copy of the gradients alive in it).
    `state` is put back before each step, as in `eager_at`."""
    module = fxmem.optimize(model, (budget_bytes + 0.5) / 2**30, compiler=compiler, keep_outputs=keep_outputs)
    t0 = time.perf_counter()
    step(module, batch)
    first_s = time.perf_counter() - t0
    grad_err = overall_rel_err(grads_of(model), ref)
    zero_grads(model)
    model.load_state_dict(state)
    measured = fxmem.measure(step, module, batch)
    zero_grads(model)
    model.load_state_dict(state)
    return module, first_s, grad_err, measured


def _grads_numpy(model: nn.Module) -> dict[str, np.ndarray]:
    return {n: p.grad.detach().float().cpu().numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


def _max_rel_err(model: nn.Module, ref: dict[str, np.ndarray]) -> float:
    """Worst relative L2 error of the model's gradients against ref, in float64 on the
    gradients' device, without copying a ~1B-parameter model's gradients to the host in float64
    for each configuration."""
    got = dict(model.named_parameters())
    missing = sorted(k for k in ref if got.get(k) is None or got[k].grad is None)
    if missing:
        raise RuntimeError(f"no gradient for {missing[:3]}")
    errs = []
    with torch.no_grad():
        for k, r in ref.items():
            g = got[k].grad.double()
            r64 = torch.from_numpy(r).to(g.device, torch.float64)
            errs.append(float(torch.linalg.vector_norm(g - r64) / max(float(torch.linalg.vector_norm(r64)), 1e-12)))
            del g, r64
    return max(errs) if all(math.isfinite(e) for e in errs) else math.inf  # max() would pass over a NaN


def _shared_copy(model: nn.Module) -> nn.Module:
    """A deep copy of the module tree whose parameters and buffers are the original tensors."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def allow_many_compiles() -> None:
    """Every configuration compiles the same forward code object (one cache entry each, told
    apart by backend); Dynamo's default limit of 8 would silently fall back to eager."""
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)


# -- building the configurations ------------------------------------------------------------------
def _amb_context(amb: float) -> Callable[[], contextlib.AbstractContextManager]:
    # Held around every call of the compiled module, not only the first, so that a recompile
    # (there should be none) would see the same setting.
    return lambda: torch._functorch.config.patch(activation_memory_budget=amb)


def _inductor_with_budget(amb: float) -> Callable:
    """torch.compile's inductor backend, partitioned under activation_memory_budget=amb.

    A backend of its own: torch.compile(model) twice with the default backend would share one
    Dynamo cache entry (inductor wrappers with equal options compare equal), so a second
    setting would silently reuse the first compilation.
    """

    def inductor_amb(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        with torch._functorch.config.patch(activation_memory_budget=amb):
            return compile_fx(gm, example_inputs)

    return inductor_amb


def _anchor_configs(spec: ModelSpec, model: nn.Module, opts: Options) -> list[Config]:
    configs = [Config("eager", "eager", call=lambda b: call_model(model, b))]

    ckpt_model = _shared_copy(model)
    spec.checkpoint(ckpt_model)
    configs.append(Config("eager + checkpoint every block", "ckpt", call=lambda b: call_model(ckpt_model, b)))

    offload = Config("eager + save_on_cpu(pin_memory=True)", "offload", call=lambda b: call_model(model, b))
    if opts.device == "cuda":
        offload.context = lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)
    else:
        offload.na = "activation offloading moves tensors to host memory; on a CPU there is nothing to move to"
    configs.append(offload)

    for amb in (None, *opts.amb_values):
        compiled = torch.compile(model) if amb is None else torch.compile(model, backend=_inductor_with_budget(amb))
        name = "torch.compile" if amb is None else f"torch.compile, activation_memory_budget={amb}"
        configs.append(
            Config(
                name,
                "compile" if amb is None else "amb",
                call=lambda b, m=compiled: call_model(m, b),
                context=_amb_context(1.0 if amb is None else amb),
                amb=amb,
            )
        )
    return configs


def fxmem_config(
    model: nn.Module, budget_bytes: int | None, passes: tuple[str, ...] | None, label: str, kind: str = ""
) -> Config:
    kind = kind or ("fxmem" if passes is None else "fxmem-remat")
    # +0.5 byte: fxmem truncates budget_gb * 2**30 to bytes, and a float can land one below
    budget_gb = UNCONSTRAINED_GB if budget_bytes is None else (budget_bytes + 0.5) / GiB
    module = fxmem.optimize(model, budget_gb, passes=passes, keep_outputs=KEEP_OUTPUTS, **_FXMEM_KINDS[kind][1])
    name = f"fxmem{_FXMEM_KINDS[kind][0]}, {label}"
    return Config(name, kind, call=lambda b: call_model(module, b), budget_bytes=budget_bytes, fxmem_module=module)


# fxmem's configurations besides its default: kind -> (what the name adds, fxmem.optimize options)
SLICED_PASSES = (*default_passes(), "microbatch_blocks")
_FXMEM_KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "fxmem": ("", {}),
    "fxmem-remat": (" remat only (passes=())", {}),
    "fxmem-sliced": (' compiler="eager" + microbatch_blocks', {"compiler": "eager"}),
}


# -- running ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def _recorded_warnings(config: Config) -> Iterator[None]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        msg = str(w.message).split(";")[0]
        if "fxmem.measure" in msg and msg not in config.notes:
            config.notes.append("measure warning: " + msg)


class Runner:
    def __init__(self, model: nn.Module, batch: Batch, device: str, log: Callable[[str], None]):
        self.model, self.batch, self.device, self.log = model, batch, device, log

    def _step(self, config: Config, batch: Batch) -> torch.Tensor:
        with config.context():
            loss = _loss(config.call(batch))
            loss.backward()
        return loss.detach()

    def warm_up(self, config: Config) -> None:
        """Compile (and plan) with one step; record its time, the plan, and one measured peak."""
        zero_grads(self.model)
        try:
            torch.manual_seed(SEED)
            _sync(self.device)
            t0 = time.perf_counter()
            self._step(config, self.batch)
            _sync(self.device)
            config.first_s = time.perf_counter() - t0
            module = config.fxmem_module
            if module is not None and module.plan is not None:
                plan = module.plan
                config.planning_s = plan.planning_s
                config.plan_floor_bytes = plan.floor_bytes
                config.predicted_peak_bytes = plan.predicted_peak_bytes
                config.rewrites = {k: v for k, v in plan.rewrites.items() if v}
            zero_grads(self.model)
            self.measure(config)  # a first peak, and the step that makes fxmem.measure exact
        except fxmem.BudgetError as e:
            config.error = f"BudgetError: floor {e.floor_bytes / MiB:.1f} MiB"
            config.plan_floor_bytes = e.floor_bytes
        except Exception as e:  # noqa: BLE001 - a failing configuration is a row, not a crash
            config.error = _first_line(e)
        zero_grads(self.model)
        self._report(config, "warm-up")

    def measure(
        self, config: Config, grad_ref: dict[str, np.ndarray] | None = None, keep_grads: bool = False
    ) -> dict[str, np.ndarray] | None:
        """One step inside fxmem.measure: its peak; with grad_ref, the gradient error too.

        With keep_grads, returns numpy copies of the gradients (to serve as a reference).
        """
        torch.manual_seed(SEED)
        with _recorded_warnings(config):
            m = fxmem.measure(self._step, config, self.batch)
        config.peaks.append(m.peak_bytes)
        config.entries.append(m.entry_bytes)
        config.profiled_times.append(m.seconds)
        del m
        if grad_ref is not None:
            config.grad_err = _max_rel_err(self.model, grad_ref)
        grads = _grads_numpy(self.model) if keep_grads else None
        zero_grads(self.model)
        return grads

    def time_step(self, config: Config) -> None:
        torch.manual_seed(SEED)
        _sync(self.device)
        t0 = time.perf_counter()
        self._step(config, self.batch)
        _sync(self.device)
        config.times.append(time.perf_counter() - t0)
        zero_grads(self.model)

    def _report(self, config: Config, what: str) -> None:
        if config.na:
            self.log(f"  {config.name}: n/a ({config.na})")
        elif config.error:
            self.log(f"  {config.name}: {config.error}")
        else:
            extra = f", plan {config.planning_s:.2f} s" if config.planning_s is not None else ""
            budget = f", budget {config.budget_bytes / MiB:.1f} MiB" if config.budget_bytes else ""
            self.log(
                f"  {config.name}: {what} {config.first_s:.1f} s{extra}, peak {config.peak_bytes / MiB:.1f} MiB{budget}"
            )


def _fxmem_budgets(floor: int, top: int, anchor_peaks: list[int], points: int) -> list[int]:
    """Budgets from fxmem's floor up to (not including) its unconstrained peak.

    The anchors' measured peaks inside that range come first — at those budgets the goal
    (fxmem at most as slow as every anchor that fits) is tested head-on — then evenly spaced
    fill-ins; points closer than 4% are merged.
    """
    budgets = [floor]
    if top <= floor * 1.04:
        return budgets
    candidates = sorted({p for p in anchor_peaks if floor * 1.04 < p < top * 0.96}, reverse=True)
    for p in candidates:
        if len(budgets) >= points:
            break
        if all(abs(p - b) > 0.04 * b for b in budgets):
            budgets.append(p)
    k = 1
    while len(budgets) < points and k < 4 * points:
        fill = int(floor + (top - floor) * k / (points + 1))
        if all(abs(fill - b) > 0.04 * b for b in budgets) and fill < top * 0.96:
            budgets.append(fill)
        k += 1
    return sorted(budgets)


def warm_up_at_floor(runner: Runner, model: nn.Module, floor: int, passes: tuple[str, ...] | None) -> Config:
    """fxmem at a floor found earlier, warmed up. Bytes kept alive since then (another planned
    module's) count too, so that budget can be refused: then at the floor the refusal names,
    with a note saying so."""
    c = fxmem_config(model, floor, passes, "at its floor")
    runner.warm_up(c)
    if c.error and c.error.startswith("BudgetError") and c.plan_floor_bytes:
        c = fxmem_config(model, c.plan_floor_bytes, passes, "at its floor")
        c.notes.append(f"the floor found first ({floor / MiB:.1f} MiB) was refused; retried")
        runner.warm_up(c)
    return c


def floor_of(
    model: nn.Module,
    batch: Batch,
    passes: tuple[str, ...] | None,
    keep_outputs: bool = KEEP_OUTPUTS,
    **options: Any,
) -> tuple[int | None, str]:
    """fxmem's floor for this model, read from the BudgetError an impossible budget raises."""
    try:
        fxmem.optimize(model, 1e-6, example_inputs=batch, passes=passes, keep_outputs=keep_outputs, **options)
    except fxmem.BudgetError as e:
        if passes == SLICED_PASSES and e.plan is not None and e.plan.batch_slices == 1:
            return None, "no block of this model can run over slices of the batch"
        return e.floor_bytes, ""
    except Exception as e:  # noqa: BLE001
        return None, _first_line(e)
    return None, "a 1 KiB budget was accepted"


def bench_model(spec: ModelSpec, size_key: str, opts: Options, log: Callable[[str], None]) -> Result:
    """Every configuration of one model, measured round-robin; see the module docstring."""
    t_start = time.perf_counter()
    size = spec.sizes[size_key]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, batch = size.build()
    device = torch.device(opts.device)
    batch = to_device(model, batch, device)
    runner = Runner(model, batch, opts.device, log)
    log(f"[{spec.name}] {size.label}")

    cut: list[str] = []  # configurations the time limit left out

    def in_time(name: str) -> bool:
        if opts.out_of_time():
            cut.append(name)
            return False
        return True

    configs = _anchor_configs(spec, model, opts)
    # Warmed up in the order that answers most when a time limit cuts the run short: the plain
    # anchors, fxmem unconstrained and at its floor, then the activation_memory_budget sweep,
    # then fxmem's other budgets (some of them are those anchors' peaks).
    for c in [c for c in configs if c.kind != "amb"]:
        if c.na is None and in_time(c.name):
            runner.warm_up(c)

    # fxmem unconstrained first: its plan names the floor, from which the sweep is chosen.
    fx_free = fxmem_config(model, None, None, "unconstrained")
    fx_points = []
    if in_time(fx_free.name):
        runner.warm_up(fx_free)
        fx_points.append(fx_free)
    floor = fx_free.plan_floor_bytes
    if fx_free.ok and floor is not None and in_time("fxmem, at its floor"):
        fx_points.append(warm_up_at_floor(runner, model, floor, None))

    for c in [c for c in configs if c.kind == "amb"]:
        if in_time(c.name):
            runner.warm_up(c)
    configs = [c for c in configs if c.name not in cut] + fx_points

    if fx_free.ok and floor is not None:
        anchor_peaks = [c.peak_bytes for c in configs if c.is_anchor and c.ok]
        top = max(fx_free.peak_bytes, fx_free.predicted_peak_bytes or 0)
        eager = next((c for c in configs if c.kind == "eager" and c.ok), None)
        fractions = {int(f * eager.peak_bytes): f for f in opts.eager_fractions if eager} if eager else {}
        budgets = _fxmem_budgets(floor, top, anchor_peaks, opts.fxmem_points)
        for b, f in fractions.items():
            if b >= top:  # the unconstrained plan already fits: it would be the same plan
                fx_free.notes.append(f"{f:.0%} of eager's peak ({b / MiB:.1f} MiB) is above this plan's peak")
            elif b > floor and all(abs(b - x) > 0.02 * x for x in budgets):
                budgets.append(b)
        for budget in sorted(b for b in budgets if b != floor):  # the floor is measured above
            label = (
                f"{fractions[budget]:.0%} of eager's peak" if budget in fractions else f"budget {budget / MiB:.0f} MiB"
            )
            if in_time(f"fxmem, {label}"):
                c = fxmem_config(model, budget, None, label)
                runner.warm_up(c)
                configs.append(c)
    fired = any(c.rewrites for c in configs if c.kind == "fxmem")
    remat = opts.remat_only and spec.remat_only
    if remat and not fired and fx_free.ok:
        result_note = "no pass fired on this model, so fxmem with passes=() would make the same plans: not run"
        fx_free.notes.append(result_note)
    elif remat and in_time("fxmem remat only (passes=()), at its floor"):
        # Its floor from a refusal (planned, nothing compiled), then one compiled point there.
        t0 = time.perf_counter()
        rem_floor, why = floor_of(model, batch, passes=())
        if rem_floor is None:
            configs.append(Config("fxmem remat only (passes=()), at its floor", "fxmem-remat", error=why))
        else:
            c = warm_up_at_floor(runner, model, rem_floor, ())
            if c.first_s is not None:
                c.notes.append(f"floor found by a refused plan in {time.perf_counter() - t0 - c.first_s:.1f} s")
            configs.append(c)

    if opts.sliced and spec.sliced and in_time(f"fxmem{_FXMEM_KINDS['fxmem-sliced'][0]}, at its floor"):
        # At its floor only (microbatch_blocks is opt-in), with compiler="eager": without
        # inductor's fused buffers the sliced ViT measures 28.8 MiB there, under inductor 32.8.
        t0 = time.perf_counter()
        sliced_floor, why = floor_of(model, batch, SLICED_PASSES, **_FXMEM_KINDS["fxmem-sliced"][1])
        if sliced_floor is None:
            fx_free.notes.append(f"{_FXMEM_KINDS['fxmem-sliced'][0].strip()}: not run ({why})")
        else:
            c = fxmem_config(model, sliced_floor, SLICED_PASSES, "at its floor", kind="fxmem-sliced")
            runner.warm_up(c)
            if c.first_s is not None:
                c.notes.append(f"floor found by refused plans in {time.perf_counter() - t0 - c.first_s:.1f} s")
            configs.append(c)

    # Round-robin: gradients on round 0 (family references first), then rotating order.
    live = [c for c in configs if c.error is None and c.na is None]
    rounds = _rounds(runner, live, opts, spec.random_ops, log) if live else 0
    for c in configs:
        if c.fxmem_module is not None and len(c.fxmem_module.plans) > 1:
            c.notes.append(f"{len(c.fxmem_module.plans)} plans were made (re-planned during the measured steps)")
        if c.entries and max(c.entries) - min(c.entries) > 2**10:
            c.notes.append(f"entry bytes varied: {min(c.entries)}..{max(c.entries)}")
        if len(set(c.peaks)) > 1:
            c.notes.append("peaks MiB: " + ", ".join(f"{p / MiB:.1f}" for p in c.peaks))

    # The result keeps numbers only: a model left alive would be counted in the next model's peaks.
    for c in configs:
        c.call, c.fxmem_module, c.context = None, None, contextlib.nullcontext
    result = Result(spec, size.label, configs, fxmem_floor_bytes=floor, cut_short=cut)
    result.rounds, result.rounds_wanted = rounds, opts.steps
    del runner, configs, model, batch, live
    torch._dynamo.reset()
    free_memory(opts.device)
    result.wall_s = time.perf_counter() - t_start
    return result


def _rounds(runner: Runner, live: list[Config], opts: Options, random_ops: bool, log: Callable[[str], None]) -> int:
    """The timed rounds over the configurations warmed up: gradients compared on round 0
    (family references first), each configuration's peak measured again on the last, one
    timed step each in every round, in rotating order. Past the time limit the round that
    starts is the last, once MIN_ROUNDS have run (a 1B model's first calls can take the whole
    limit: its steps are still timed). Returns the number of rounds run."""
    refs: dict[str, dict[str, np.ndarray]] = {}
    for rnd in range(opts.steps):
        last = rnd == opts.steps - 1 or (rnd >= MIN_ROUNDS - 1 and opts.out_of_time())
        order = live if rnd == 0 else live[rnd % len(live) :] + live[: rnd % len(live)]
        for c in order:
            if c.error is not None:
                continue
            try:
                if rnd == 0:
                    _check_grads(runner, c, refs, random_ops)
                elif last:
                    runner.measure(c)  # peaks are the same step after step; see the notes
                runner.time_step(c)
            except Exception as e:  # noqa: BLE001
                c.error = _first_line(e)
                zero_grads(runner.model)
        ended = " (the time limit ends the rounds here)" if last and rnd < opts.steps - 1 else ""
        log(f"  round {rnd + 1}/{opts.steps} done{ended}")
        if last:
            return rnd + 1
    return opts.steps


def _check_grads(runner: Runner, c: Config, refs: dict[str, dict[str, np.ndarray]], random_ops: bool) -> None:
    """First measured step of c; its gradients become, or are compared with, a reference.

    Without random ops every configuration is compared with eager. With them (dropout), each
    family (see Config.family) is compared with its first member, run in the same round from
    the same seed, since different families draw different masks.
    """
    family = c.family if random_ops else "eager"
    if family == "amb":
        runner.measure(c)
        c.grad_ref = "not compared: its own dropout masks"
        return
    ref = refs.get(family)
    grads = runner.measure(c, grad_ref=ref, keep_grads=ref is None)
    if ref is None:
        refs[family] = grads
        c.grad_err = 0.0
        c.grad_ref = "reference" if family == "eager" else f"reference of the {family} RNG family"
    else:
        c.grad_ref = "eager" if family == "eager" else f"{family} family"

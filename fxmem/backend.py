"""The `fxmem` torch.compile backend: Dynamo graph -> rule passes -> AOTAutograd -> compiler.

Registered under the `torch_dynamo_backends` entry point, so
`torch.compile(model, backend="fxmem", options={"budget_gb": 8})` works with only `import torch`.
torch's `aot_autograd(...)` helper drops unknown keyword arguments, so the options are read
here, once, into an `Options`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import numbers
import operator
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._decomp import get_decompositions
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from fxmem import _torch_private as tp
from fxmem.batch_dims import batch_size
from fxmem.constants import checked
from fxmem.errors import BudgetError, DataDependentShapeError, check_budget_gb, with_hint
from fxmem.nodes import source_line
from fxmem.ops import static_int
from fxmem.optimizer import optimizer_bytes, watch_optimizers
from fxmem.outputs import watch_outputs, with_output_hooks
from fxmem.partition import PlanRequest, make_partition_fn, margin_for
from fxmem.passes.microbatch_blocks import MAX_SLICES, microbatch_blocks, why_none_sliced
from fxmem.pipeline import MICROBATCH, check_pass_names, default_passes, run_passes
from fxmem.plan import Plan, format_bytes
from fxmem.plan_log import emit_plan
from fxmem.step_start import count_saved, saved_by_pending_backwards, static_bytes, warn_if_gradients_appear
from fxmem.workspaces import OUTSIDE_TENSORS

__all__ = ["Options", "fxmem_backend", "recent_plans"]

log = logging.getLogger("fxmem")
_FLOOR = operator.attrgetter("floor_bytes")  # of a BudgetError
FUSE = "fuse_projections"  # planned without when the budget is below the floor with it

# Compiles a graph (rewrites fired, batch slices) under a budget in bytes; raises BudgetError.
CompileGraph = Callable[[fx.GraphModule, dict[str, int], int, "int | None"], Any]

COMPILERS = ("inductor", "eager")
PRECISIONS = ("fp32", "bf16")

# Dropout as `rand_like(x) > p` and a multiply: the mask is then a bool value of its own, which
# is what the backward keeps, and the random draw itself is never run twice.
# Ops that, run one by one, allocate temporaries inside themselves the plan would not see
# (`mse_loss` its difference, its backward the difference and its scale): decomposed, those
# temporaries are nodes of the graph, planned as any other.
_aten = torch.ops.aten
_EAGER_DECOMPOSITIONS = get_decompositions(
    [
        _aten.native_dropout,
        _aten.mse_loss,
        _aten.mse_loss_backward,
        _aten.smooth_l1_loss,
        _aten.smooth_l1_loss_backward,
        _aten.huber_loss,
        _aten.huber_loss_backward,
        _aten.binary_cross_entropy,
        _aten.binary_cross_entropy_backward,
        _aten.binary_cross_entropy_with_logits,
        _aten.soft_margin_loss,
        _aten.soft_margin_loss_backward,
    ]
)

_recent: list[Plan] = []
_RECENT_KEPT = 16


def _region_id() -> object:
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    return getattr(compile_id, "frame_id", None)


def recent_plans() -> list[Plan]:
    """Plans made by this process's fxmem backends, oldest first (the last 16)."""
    return list(_recent)


@dataclass
class Options:
    budget_gb: float | None = None
    compiler: str = "inductor"
    optimizer: torch.optim.Optimizer | None = None
    passes: Sequence[str] | None = None  # None: the default (exact) passes
    precision: str = "fp32"  # "bf16": also run bf16_regions
    margin: float = 0.03
    keep_outputs: bool = True  # False: the caller lets what the step returns go before the backward
    on_plan: Callable[[Plan], None] | None = field(default=None, repr=False)
    dump: str | None = None  # folder to save every plan into (default: $FXMEM_DUMP)
    plan: str | Plan | None = field(default=None, repr=False)  # a saved plan.json (or its folder) to apply

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> Options:
        options = dict(options or {})
        if "tie_weights" in options:
            raise ValueError(
                "tie_weights changes which tensors a module holds, which a torch.compile backend "
                "cannot do; use fxmem.optimize(model, budget_gb, tie_weights=...)"
            )
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown fxmem option(s) {unknown}; known: {sorted(known)}")
        opts = cls(**options)
        if opts.budget_gb is not None:
            check_budget_gb(opts.budget_gb)
        if opts.compiler not in COMPILERS:
            raise ValueError(f"compiler must be one of {COMPILERS}, got {opts.compiler!r}")
        if opts.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {opts.precision!r}")
        if opts.optimizer is not None and not isinstance(opts.optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(opts.optimizer).__name__}")
        if not isinstance(opts.keep_outputs, bool):
            raise TypeError(f"keep_outputs must be True or False, got {opts.keep_outputs!r}")
        if isinstance(opts.margin, bool) or not isinstance(opts.margin, numbers.Real) or not 0 <= opts.margin < 0.5:
            raise ValueError(f"margin must be a fraction in [0, 0.5), got {opts.margin!r}")
        if opts.passes is not None:
            if isinstance(opts.passes, (str, bytes)) or not isinstance(opts.passes, Iterable):
                raise TypeError(f"passes takes a list of pass names (() for none), got {opts.passes!r}")
            opts.passes = list(opts.passes)
            check_pass_names(opts.passes)
        if opts.plan is not None and not isinstance(opts.plan, Plan):
            path = os.fspath(opts.plan)
            opts.plan = Plan.load(os.path.join(path, "plan.json") if os.path.isdir(path) else path)
        return opts

    def pass_names(self) -> list[str]:
        names = list(default_passes() if self.passes is None else self.passes)
        if self.precision == "bf16" and "bf16_regions" not in names:
            names.append("bf16_regions")
        return names

    @property
    def budget_bytes(self) -> int | None:
        return None if self.budget_gb is None else check_budget_gb(self.budget_gb)


def _device_of(example_inputs: Sequence[Any]) -> torch.device:
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.device.type != "meta":
            return x.device
    return torch.device("cpu")


def _fix_shapes(example_inputs: Sequence[Any]) -> None:
    """Specialise the graph to its example inputs' sizes.

    A plan holds its budget for the sizes it was made for, so fxmem plans one graph per input
    shape. Dynamo hands over symbolic sizes when the shapes change between calls
    (`dynamic=None`, from the second shape on) or with `dynamic=True`; reading each as an int
    adds a guard on its value, so a call with other sizes compiles, and plans, again (within
    Dynamo's recompile limit). Sizes the user marked dynamic (`torch._dynamo.mark_dynamic`)
    raise Dynamo's constraint error here."""
    symbolic = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            symbolic += [d for d in (*x.shape, *x.stride(), x.storage_offset()) if isinstance(d, torch.SymInt)]
        elif isinstance(x, torch.SymInt):
            symbolic.append(x)
    if symbolic:
        log.info("fxmem plans for fixed sizes: specialising %d symbolic sizes to %s", len(symbolic), symbolic)
        for d in symbolic:
            int(d)


def _inline_fixed_sizes(gm: fx.GraphModule) -> None:
    """Write the sizes `_fix_shapes` fixed into the graph as ints: a view's shape argument
    `(4, s0, 4, 16)` becomes `(4, 256, 4, 16)`, so the passes rewrite the graph as they would
    one captured at fixed sizes; and the module's floats Dynamo reads from tensors, as
    floats. The size inputs stay (Dynamo passes them), unread; the arithmetic on them goes."""
    fixed: dict[fx.Node, int | float] = {}
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt) and (size := static_int(value)) is not None:
            fixed[node] = size
        elif isinstance(value, torch.SymFloat) and value.node.hint is not None:
            # A float the module holds (a dropout's p, a norm's eps), which Dynamo passes in as
            # a tensor under `dynamic=True`: read as a float it is guarded on its value, as the
            # sizes are, and the passes see a number (`swap_sdpa` hands `p` to the fused kernel).
            fixed[node] = float(value)
    if not fixed:
        return
    for node in gm.graph.nodes:
        if node not in fixed:
            node.args, node.kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: fixed.get(a, a))
    for node in reversed(list(fixed)):
        if node.op != "placeholder" and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()


def _graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` whose graph the passes may rewrite while `gm` stays as it is (the
    nodes' example values are shared), with what Dynamo records beside the graph: the sources
    of its inputs and parameters, which AOTAutograd reads."""
    copied = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    copied.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copied._param_name_to_source = gm._param_name_to_source
    for old, new in zip(gm.graph.find_nodes(op="placeholder"), copied.graph.find_nodes(op="placeholder"), strict=True):
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    return copied


def _refuse_data_dependent_sizes(gm: fx.GraphModule) -> None:
    """Raise `DataDependentShapeError` naming the first value whose size the data decides."""
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        values = value if isinstance(value, (list, tuple)) else [value]
        if not any(isinstance(v, torch.Tensor) and free_unbacked_symbols(v.shape) for v in values):
            continue  # a scalar the data decides (`.item()`) is no size
        where = f" at {source_line(node)}" if source_line(node) else ""
        raise DataDependentShapeError(
            f"{node.name!r}{where} is a value whose size depends on the data, and a plan "
            "holds its budget for the sizes it was made for. Leave "
            "torch._dynamo.config.capture_dynamic_output_shape_ops (and capture_scalar_outputs) off, "
            'so that torch.compile(backend="fxmem") plans the graphs on either side of it, or '
            "compute at a fixed size (torch.where or a multiplication by the mask instead of "
            "indexing with it)"
        )


def fxmem_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: dict | None = None,
    *,
    watch_gradients: bool = True,
    **kwargs: Any,
):
    """torch.compile backend. `options`: budget_gb, compiler, optimizer, passes, precision,
    margin, keep_outputs (see `fxmem.optimize`), dump (a folder to save every plan into;
    default $FXMEM_DUMP), plan (a saved plan.json to apply), on_plan (called with each plan as
    it is made). `watch_gradients`: warn when a call starts with gradients held that the plan
    did not count, or an optimizer it did not count steps on its parameters (`fxmem.optimize`
    plans again for either instead)."""
    if kwargs.get("mode"):
        log.warning("fxmem ignores torch.compile mode=%r", kwargs["mode"])
    opts = options if isinstance(options, Options) else Options.from_dict(options)
    region = _region_id()
    device = _device_of(example_inputs)
    if any(isinstance(x, torch.Tensor) and x.device.type == "meta" for x in example_inputs):
        raise ValueError(
            "the model or its inputs are on the meta device, where nothing runs: load or materialize "
            "them first (module.to_empty(device=...)); `fxmem estimate` plans a model built on meta"
        )
    _fix_shapes(example_inputs)
    _inline_fixed_sizes(gm)
    _refuse_data_dependent_sizes(gm)
    names = opts.pass_names()
    # Passes named explicitly run as named; by default, fused projections that raise the floor
    # above the budget are planned apart (see below).
    captured = _graph_copy(gm) if opts.passes is None and FUSE in names else None
    gm, fired = run_passes(gm, example_inputs, names)
    state_bytes, step_bytes = optimizer_bytes(opts.optimizer)

    made: list[Plan] = []  # this graph's plans; the last is the one it runs

    def on_plan(plan: Plan) -> None:
        made.append(plan)
        emit_plan(plan, opts.dump, region)
        _recent.append(plan)
        del _recent[:-_RECENT_KEPT]
        if opts.on_plan is not None:
            opts.on_plan(plan)

    static = static_bytes(example_inputs, device)
    earlier = saved_by_pending_backwards()
    if earlier:
        # Earlier regions' saved tensors are alive now, held by autograd in C++ (then counted
        # outside tensors, on CUDA) or visible to the live-tensor scan: reserve them once.
        left = earlier
        for key in (OUTSIDE_TENSORS, "other live tensors"):
            if key in static:
                taken = min(left, static[key])
                static[key] -= taken
                left -= taken
        static["earlier regions' activations"] = earlier

    def compile_graph(graph: fx.GraphModule, rewrites: dict[str, int], slices: int, budget: int | None) -> Any:
        req = PlanRequest(
            budget_bytes=budget,
            device=device,
            static_bytes=static,
            optimizer_bytes=state_bytes,
            optimizer_step_bytes=step_bytes,
            compiler=opts.compiler,
            margin_fraction=opts.margin,
            rewrites=rewrites,
            batch_slices=slices,
            keep_outputs=opts.keep_outputs,
            on_plan=on_plan,
            reuse=opts.plan,
        )
        partition_fn = make_partition_fn(req)
        if opts.compiler == "inductor":
            return tp.inductor_compile(graph, list(example_inputs), partition_fn)
        return tp.aot_autograd(
            fw_compiler=lambda g, _: tp.boxed_graph_function(g),
            bw_compiler=lambda g, _: tp.boxed_graph_function(g),
            partition_fn=partition_fn,
            decompositions=_EAGER_DECOMPOSITIONS,
        )(graph, example_inputs)

    def compile_step(graph: fx.GraphModule, rewrites: dict[str, int]) -> Any:
        if opts.plan is not None and opts.plan.batch_slices > 1:  # the graph the saved plan was made for
            sliced, blocks = microbatch_blocks(graph, opts.plan.batch_slices)
            return compile_graph(sliced, {**rewrites, MICROBATCH: blocks}, opts.plan.batch_slices, opts.budget_bytes)
        if MICROBATCH in names:
            return _compile_sliced_if_needed(graph, rewrites, compile_graph, opts.budget_bytes)
        return compile_graph(graph, rewrites, 1, opts.budget_bytes)

    def apart() -> tuple[fx.GraphModule, dict[str, int]]:
        assert captured is not None
        graph, rewrites = run_passes(captured, example_inputs, [n for n in names if n != FUSE])
        return graph, {n: rewrites.get(n, 0) for n in fired}

    may_part = captured is not None and fired[FUSE] > 0  # fused projections, which may be planned apart
    if may_part and opts.plan is not None and not opts.plan.rewrites.get(FUSE):
        gm, fired = apart()  # the saved plan was made with the projections apart
    try:
        compiled = compile_step(gm, fired)
    except BudgetError as fused:
        if not may_part or opts.plan is not None:
            raise
        # Fused, a group's output lives until its last part is read, and the backward
        # concatenates the parts' gradients: below the floor so, plan them apart.
        log.info(
            "budget below the floor of %s with projections fused; planning them apart", format_bytes(fused.floor_bytes)
        )
        gm, fired = apart()
        try:
            compiled = compile_step(gm, fired)
        except BudgetError as e:
            raise min(fused, e, key=_FLOOR) from None
    # Premises the passes took about module buffers; outputs they finish outside the step;
    # outputs the plan counted as let go before the backward.
    step = checked(with_output_hooks(compiled, gm), gm)
    if not made:
        # No backward, so nothing to plan: called under torch.no_grad() or inference_mode(),
        # or nothing in the step requires a gradient. AOTAutograd compiled the forward alone,
        # and it saves nothing.
        log.info("no backward to plan: the forward runs as compiled")
        return step
    plan = made[-1]  # made while compiling: the plan the step runs
    step = count_saved(step, plan.saved_bytes)
    if watch_gradients and plan.budget_bytes is not None:
        step = warn_if_gradients_appear(step, example_inputs, plan.budget_bytes)
        watch_optimizers([x for x in example_inputs if isinstance(x, torch.nn.Parameter)], opts.optimizer)
    if plan.budget_bytes is None:
        return step
    # Numbers only: the step outlives its module in caches beyond fxmem's reach (Dynamo's,
    # transformers'), and must not keep the module's parameters alive through them.
    margin = margin_for(plan.budget_bytes, margin_fraction=opts.margin)
    room = max(0, plan.budget_bytes - margin - plan.predicted_peak_bytes)
    released = [] if opts.keep_outputs else plan.released_outputs
    return watch_outputs(step, released, plan.budget_bytes, room)


def _compile_sliced_if_needed(
    gm: fx.GraphModule, fired: dict[str, int], compile_graph: CompileGraph, budget_bytes: int
) -> Any:
    """Compile the graph as it is; when the budget is below its floor, with its blocks over
    slices of the batch: 2, then the fewest that the floors say the budget needs (see
    `_next_slices`), more while a plan does not fit. When none fits, the BudgetError with the
    lowest floor is raised."""
    try:
        return compile_graph(gm, {**fired, MICROBATCH: 0}, 1, budget_bytes)
    except BudgetError as unsliced:
        lowest = unsliced
    most = min(MAX_SLICES, batch_size(gm) or 1)
    floors: dict[int, int] = {}
    slices: int | None = 2
    while slices is not None and slices <= most:
        sliced, blocks = microbatch_blocks(gm, slices)
        if not blocks:
            lowest = with_hint(lowest, why_none_sliced(gm))
            break
        log.info(
            "budget below the floor of %s; planning again with %d blocks over %d batch slices",
            format_bytes(lowest.floor_bytes),
            blocks,
            slices,
        )
        try:
            return compile_graph(sliced, {**fired, MICROBATCH: blocks}, slices, budget_bytes)
        except BudgetError as e:
            floors[slices] = e.floor_bytes
            lowest = min(lowest, e, key=_FLOOR)
        if most not in floors and slices < most - 1:
            # The floor over the most slices: whether any count fits, and, beside the floor just
            # found, how many do.
            at_most = _floor_only(gm, fired, compile_graph, most, budget_bytes)
            floors[most] = at_most.floor_bytes
            lowest = min(lowest, at_most, key=_FLOOR)
            if budget_bytes < at_most.floor_bytes:
                break
        slices = _next_slices(floors, slices, budget_bytes, most)
    raise lowest


def _floor_only(
    gm: fx.GraphModule, fired: dict[str, int], compile_graph: CompileGraph, slices: int, budget_bytes: int
) -> BudgetError:
    """The refusal of the graph with its blocks over `slices` slices, planned without compiling
    (a budget of 0 fits no plan), restated for the budget asked."""
    sliced, blocks = microbatch_blocks(gm, slices)
    try:
        compile_graph(sliced, {**fired, MICROBATCH: blocks}, slices, 0)
    except BudgetError as e:
        plan = None if e.plan is None else dataclasses.replace(e.plan, budget_bytes=budget_bytes)
        return BudgetError(budget_bytes, e.floor_bytes, e.breakdown, plan)
    raise RuntimeError("fxmem: a plan fitted a budget of 0 bytes")


def _next_slices(floors: dict[int, int], last: int, budget_bytes: int, most: int) -> int | None:
    """The slice count to plan after `last` did not fit, from the floors planned so far (slices
    -> floor bytes); None when more slices would not help.

    A sliced block holds 1/n of its activations, so the floor over n slices is about a + b/n
    (a: what slicing leaves alone). Fitted to the floors at `last` and at the most slices, that
    names the fewest slices the budget needs; with a budget the fit puts below `a`, the most."""
    if last >= most:
        return None
    if most not in floors:
        return last + 1
    f_last, f_most = floors[last], floors[most]
    if f_most >= f_last:
        return None
    b = (f_last - f_most) / (1 / last - 1 / most)
    a = f_most - b / most
    want = most if budget_bytes <= a else math.ceil(b / (budget_bytes - a))
    return min(most, max(last + 1, want))

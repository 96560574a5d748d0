"""Will one training step fit in a device's memory? Answered without running the model.

The model and its example inputs are built on the `meta` device (no weights allocated), the
joint forward+backward graph is traced on them, and the same simulation and planner that
`fxmem.optimize` uses give the peak with nothing recomputed and the floor fxmem reaches by
recomputing. Parameters, gradients and optimizer state are counted from the parameters'
sizes: AdamW/Adam keep two states per parameter in its dtype, SGD with momentum one, plain SGD
none, and 8-bit Adam (bitsandbytes) one byte per state and element plus a float32 scale per
256-element block (tensors under 4096 elements keep 32-bit states, as bitsandbytes does).

    est = estimate(lambda: (LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}), "adamw")
    print(est.table(device_memory_bytes=24 * 2**30))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxmem import _torch_private as tp
from fxmem.backend import _EAGER_DECOMPOSITIONS
from fxmem.cost import tensor_bytes
from fxmem.errors import not_one_graph
from fxmem.optimizer import optimizer_bytes
from fxmem.partition import _MARGIN_BYTES, _MARGIN_FRACTION, PlanRequest, make_partition_fn
from fxmem.pipeline import run_passes
from fxmem.plan import Plan, format_bytes
from fxmem.plan_record import category_curves

__all__ = ["OPTIMIZERS", "Estimate", "estimate", "split_inputs"]

OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adam8bit", "none")
_BNB_BLOCK = 256
_BNB_MIN_8BIT = 4096


@dataclass
class Estimate:
    """Bytes of one training step, by what fills them. `plan` is the unconstrained plan."""

    model: str
    parameters: int
    parameter_bytes: int
    input_bytes: int  # example inputs and buffers
    gradient_bytes: int
    optimizer: str
    optimizer_state_bytes: int
    optimizer_step_bytes: int  # temporaries of the optimizer step
    activation_bytes: int  # most alive in forward/backward besides gradients, nothing recomputed
    peak_bytes: int  # the whole step, nothing recomputed
    floor_bytes: int  # the smallest budget fxmem plans for (recomputing), margin included
    plan: Plan

    def verdict(self, device_memory_bytes: int) -> str:
        have = format_bytes(device_memory_bytes)
        if self.peak_bytes <= device_memory_bytes:
            return f"fits in {have} as it is (peak {format_bytes(self.peak_bytes)})"
        if self.floor_bytes <= device_memory_bytes:
            return (
                f"fits in {have} with fxmem recomputing activations "
                f"(fxmem.optimize(model, budget_gb={device_memory_bytes / 2**30:g}); floor "
                f"{format_bytes(self.floor_bytes)})"
            )
        return (
            f"does NOT fit in {have}: even recomputing everything fxmem can, the step needs "
            f"{format_bytes(self.floor_bytes)}"
        )

    def table(self, device_memory_bytes: int | None = None) -> str:
        rows = [
            ("parameters", self.parameter_bytes, _count(self.parameters, "parameters")),
            ("gradients", self.gradient_bytes, ""),
            (f"optimizer state ({self.optimizer})", self.optimizer_state_bytes, ""),
            ("inputs and buffers", self.input_bytes, ""),
            ("activations", self.activation_bytes, "saved + temporaries, at their largest"),
            ("optimizer step temporaries", self.optimizer_step_bytes, ""),
        ]
        lines = [f"fxmem estimate for {self.model} (meta tensors: nothing was allocated or run)"]
        lines += [f"  {name:<30} {format_bytes(b):>11}  {note}" for name, b, note in rows]
        head_room = f"{format_bytes(_MARGIN_BYTES)} + {_MARGIN_FRACTION:.0%}"
        lines.append(f"  {'peak, nothing recomputed':<30} {format_bytes(self.peak_bytes):>11}  no head-room")
        lines.append(
            f"  {'floor with fxmem recomputation':<30} {format_bytes(self.floor_bytes):>11}  "
            f"the smallest budget: the lowest peak plus head-room ({head_room} of the budget)"
        )
        if device_memory_bytes is not None:
            lines.append("  => " + self.verdict(device_memory_bytes))
        return "\n".join(lines)


def _count(n: int, what: str) -> str:
    """'173,568 parameters', '1,235,814,400 parameters (1.24 billion)'."""
    for scale, word in ((1e9, "billion"), (1e6, "million")):
        if n >= scale:
            return f"{n:,} {what} ({n / scale:.2f} {word})"
    return f"{n:,} {what}"


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """(args, kwargs) from a tuple/list of positional arguments, a dict of keyword arguments,
    or a single tensor."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _unique_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += tensor_bytes(t)
    return total


def _optimizer_bytes(model: nn.Module, name: str) -> tuple[int, int]:
    """(state bytes, step temporaries) for the optimizer `name` over `model`'s parameters."""
    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    if name == "none" or not params:
        return 0, 0
    if name == "adam8bit":
        state = 0
        for p in params:
            n = p.numel()
            state += 2 * (n + 4 * -(-n // _BNB_BLOCK)) if n >= _BNB_MIN_8BIT else 2 * 4 * n
        return state, 0  # bitsandbytes updates in one fused kernel per tensor
    opt_cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
    kwargs = {"momentum": 0.9} if name == "sgd-momentum" else {}
    opt = opt_cls.get(name, torch.optim.SGD)(params, lr=1e-3, **kwargs)
    return optimizer_bytes(opt, device_type="cuda")  # torch's implementation there: foreach


_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


@contextlib.contextmanager
def _cross_entropy_for_meta() -> Iterator[None]:
    """Within the block, 2-D `F.cross_entropy` calls `aten.nll_loss_forward` itself.

    Traced on meta tensors, `aten.nll_loss` (what cross_entropy calls) finds torch's meta
    kernel before any autograd formula, so the loss has no gradient and the joint graph no
    backward (torch 2.13). `nll_loss_forward` has its formula; on a real device
    cross_entropy reaches the same ops, so the graph is the one a real run traces.
    """
    original = F.cross_entropy

    def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                      reduction="mean", label_smoothing=0.0):  # fmt: skip
        if input.dim() != 2 or label_smoothing or size_average is not None or reduce is not None:
            return original(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        lsm = torch.log_softmax(input, 1)
        return torch.ops.aten.nll_loss_forward(lsm, target, weight, _REDUCTIONS[reduction], ignore_index)[0]

    F.cross_entropy = cross_entropy
    try:
        yield
    finally:
        F.cross_entropy = original


def estimate(
    factory: Callable[[], tuple[nn.Module, Any]],
    optimizer: str = "adamw",
    *,
    compiler: str = "inductor",
    passes: Sequence[str] | None = None,
) -> Estimate:
    """Estimate one training step of the model `factory()` builds, without allocating it.

    `factory` returns `(model, example_inputs)`; it runs under `torch.device("meta")`, so
    modules and tensors it creates have sizes but no memory. It must not move them to another
    device. `compiler` picks the memory model: "inductor" (fused elementwise ops never write
    their intermediates) or "eager". The optimizer step is counted as torch runs it on CUDA
    (its multi-tensor implementation). Library kernels' workspaces (attention's, and under
    "eager" convolutions' and batch norm's), which planning measures by running the kernels on
    the device, are not counted.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    with torch.device("meta"):
        model, example_inputs = factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"the factory must return (nn.Module, example_inputs), got {type(model).__name__}")
    args, kwargs = split_inputs(example_inputs)
    off_meta = [t for t in [*model.parameters(), *model.buffers()] if t.device.type != "meta"]
    if off_meta:
        raise ValueError("the factory moved tensors off the meta device; build them without .to(device) for estimate")
    params = list(dict.fromkeys(model.parameters()))
    param_bytes = _unique_bytes(params)
    grad_bytes = _unique_bytes([p for p in params if p.requires_grad])
    leaves = [x for x in [*args, *kwargs.values()] if isinstance(x, torch.Tensor)]
    input_bytes = _unique_bytes(list(model.buffers()) + leaves)
    state_bytes, step_bytes = _optimizer_bytes(model, optimizer)

    plans: list[Plan] = []
    req = PlanRequest(
        budget_bytes=None,
        device=torch.device("cpu"),  # for the cost model only: which values are cheap to recompute
        static_bytes={"parameters": param_bytes, "inputs and buffers": input_bytes},
        optimizer_bytes=state_bytes,
        optimizer_step_bytes=step_bytes,
        compiler=compiler,
        on_plan=plans.append,
    )

    def backend(gm: torch.fx.GraphModule, example: Sequence[Any], **_: Any) -> Any:
        gm, fired = run_passes(gm, example, passes)
        req.rewrites = fired
        return tp.aot_autograd(
            fw_compiler=lambda g, _: tp.boxed_graph_function(g),
            bw_compiler=lambda g, _: tp.boxed_graph_function(g),
            partition_fn=make_partition_fn(req),
            decompositions=_EAGER_DECOMPOSITIONS,
        )(gm, example)

    was_training = model.training
    model.train()
    try:
        compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
        with _cross_entropy_for_meta(), tp.logging_calls_skipped():
            compiled(*args, **kwargs)  # traces and plans; the meta forward computes nothing
    except torch._dynamo.exc.Unsupported as e:
        raise not_one_graph(e) from e
    except torch._dynamo.exc.TorchRuntimeError as e:
        # HF's key/value caches start as empty tensors the trace keeps as constants, which on
        # meta are real meta tensors beside the trace's fake ones.
        caching = kwargs.get("use_cache", getattr(getattr(model, "config", None), "use_cache", False))
        if "FakeTensor" in str(e) and caching:
            raise ValueError(
                "the model's key/value cache (use_cache=True) cannot be traced on the meta device: "
                "pass use_cache=False in the example inputs (fxmem.optimize counts the caches of a real step)"
            ) from e
        raise
    finally:
        model.train(was_training)
    if not plans:
        raise ValueError(
            "the step has no backward to plan, as nothing its output depends on requires grad: "
            "set requires_grad=True on the parameters it trains"
        )
    plan = plans[-1]
    # Activations: the most that is alive in the forward and backward besides gradients.
    curves = category_curves(plan.timeline)
    curves.pop("gradients", None)
    phases = [phase for _, phase in plan.timeline["steps"]]
    activations = max(
        (sum(c[t] for c in curves.values()) for t in range(len(phases)) if phases[t] != "optimizer"), default=0
    )
    return Estimate(
        model=type(model).__name__,
        parameters=sum(p.numel() for p in params),
        parameter_bytes=param_bytes,
        input_bytes=input_bytes,
        gradient_bytes=grad_bytes,
        optimizer=optimizer,
        optimizer_state_bytes=state_bytes,
        optimizer_step_bytes=step_bytes,
        activation_bytes=activations,
        peak_bytes=plan.predicted_peak_bytes,
        floor_bytes=plan.floor_bytes,
        plan=plan,
    )

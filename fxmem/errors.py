"""Errors fxmem raises on purpose."""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING

from fxmem.plan import format_bytes

if TYPE_CHECKING:
    from fxmem.plan import Plan

__all__ = ["BudgetError", "DataDependentShapeError", "GraphBreakError", "PlanMismatchError", "check_budget_gb"]


class BudgetError(ValueError):
    """No plan fits the budget. Raised before the step runs; the model is left as it was.

    `floor_bytes` is the smallest budget fxmem found a plan for; `plan` is that plan.
    """

    def __init__(
        self, budget_bytes: int, floor_bytes: int, breakdown: dict[str, int], plan: Plan | None, hint: str = ""
    ):
        self.budget_bytes = budget_bytes
        self.floor_bytes = floor_bytes
        self.breakdown = breakdown
        self.plan = plan
        self.hint = hint
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in breakdown.items())
        # The floor is a budget: the lowest predicted peak and the head-room every budget keeps.
        peak = f": its lowest predicted peak, {format_bytes(plan.predicted_peak_bytes)}, and head-room" if plan else ""
        super().__init__(
            f"budget {format_bytes(budget_bytes)} is below the smallest budget fxmem can plan this step for, "
            f"{format_bytes(floor_bytes)} (budget_gb >= {gib_at_least(floor_bytes)}){peak}; "
            f"at that peak: {parts}" + (f"; {hint}" if hint else "")
        )


def with_hint(e: BudgetError, hint: str) -> BudgetError:
    """`e` with one more hint after its own."""
    return BudgetError(e.budget_bytes, e.floor_bytes, e.breakdown, e.plan, "; ".join(h for h in (e.hint, hint) if h))


def gib_at_least(nbytes: int) -> str:
    """`nbytes` in GiB to four significant digits, rounded up: a budget_gb that admits it."""
    gib = nbytes / 2**30
    digits = max(3 - math.floor(math.log10(gib)), 0) if gib > 0 else 4
    return f"{math.ceil(gib * 10**digits) / 10**digits:.{digits}f}"


def why_not_captured(e: Exception) -> str:
    """Dynamo's reason for a graph break in a line: its summary, its explanation (torch 2.15's
    summary can be only "Unsupported function call (delayed)", the reason, an LSTM say, is in
    the explanation) and the user's line it stopped at."""
    lines = [line.strip() for line in str(e).splitlines()]
    parts = lines[:1]
    parts += [line.removeprefix("Explanation:").strip() for line in lines if line.startswith("Explanation:")]
    if "from user code:" in lines:
        where = lines[lines.index("from user code:") + 1 :]
        parts += [line for line in where if line.startswith("File ")][-1:]
    return "; ".join(p.rstrip(".") for p in parts if p)


def not_one_graph(e: Exception) -> GraphBreakError:
    """The error for a step Dynamo could not capture whole (`e`: its `Unsupported`)."""
    return GraphBreakError(
        "fxmem plans one graph per step and this model does not capture as one "
        f"(torch.compile(fullgraph=True) fails): {why_not_captured(e)}"
    )


class PlanMismatchError(ValueError):
    """A saved plan was applied to a graph it was not made for; the message names the difference."""


class GraphBreakError(RuntimeError):
    """The model does not capture as one graph, so one budget cannot be planned across it."""


class DataDependentShapeError(ValueError):
    """The graph makes a tensor whose size depends on the data (boolean-mask indexing,
    `nonzero`, `.item()` sizes captured under `capture_dynamic_output_shape_ops`): no one plan
    holds a budget for every size it may take. Raised before the step runs."""


def check_budget_gb(budget_gb: object) -> int:
    """Validate a budget in GiB (2**30 bytes) and return it in bytes."""
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, numbers.Real):
        raise TypeError(f"budget_gb must be a number of GiB (2**30 bytes), got {budget_gb!r}")
    value = float(budget_gb)
    if math.isnan(value) or math.isinf(value) or value <= 0:
        raise ValueError(f"budget_gb must be a finite number of GiB greater than 0, got {budget_gb!r}")
    return int(value * 2**30)

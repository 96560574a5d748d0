"""fxmem: fit a PyTorch training step into an absolute memory budget by rewriting its graph.

    import fxmem
    model = fxmem.optimize(model, budget_gb=8)      # GiB: 2**30 bytes, measured peak of a step
    loss = model(x, y); loss.backward()
    print(model.plan.summary())

or, without importing fxmem: torch.compile(model, backend="fxmem", options={"budget_gb": 8}).
"""

from fxmem.api import FxmemModule, OptimizerNotPlannedWarning, optimize
from fxmem.backend import fxmem_backend, recent_plans
from fxmem.errors import BudgetError, DataDependentShapeError, GraphBreakError, PlanMismatchError
from fxmem.measure import Measurement, measure
from fxmem.outputs import LossOutsideWarning, OutputsHeldWarning
from fxmem.plan import Decision, Plan
from fxmem.step_start import GradientsHeldWarning

__all__ = [
    "BudgetError",
    "DataDependentShapeError",
    "Decision",
    "FxmemModule",
    "GradientsHeldWarning",
    "GraphBreakError",
    "Measurement",
    "LossOutsideWarning",
    "OptimizerNotPlannedWarning",
    "OutputsHeldWarning",
    "Plan",
    "PlanMismatchError",
    "fxmem_backend",
    "measure",
    "optimize",
    "recent_plans",
]

__version__ = "0.1.0"

"""Inductor's fusion heuristics as fxmem compiles with them (see `_torch_private._fusion_choices`).

Imported only when inductor compiles for fxmem: it imports inductor.
"""

from __future__ import annotations

from torch._inductor.choices import InductorChoices

from fxmem.kernels import any_between

__all__ = ["FxmemChoices3"]


def _call_between(scheduler, first: int, last: int) -> bool:
    """Whether a library call (an extern kernel) runs after position `first` and before `last`."""
    calls = getattr(scheduler, "_fxmem_library_calls", None)
    if calls is None:
        calls = sorted(n.min_order for n in scheduler.nodes if n.is_extern())
        scheduler._fxmem_library_calls = calls
    return any_between(calls, first, last)


class FxmemChoices3(InductorChoices):
    # Inductor keys its cache by this class: torch 2.11 by its name, later versions by uuid().
    # When the heuristics change, change both (a new uuid and a new name).
    @staticmethod
    def can_fuse_horizontal(scheduler, node1, node2, shared_data_score):
        first, last = min(node1.max_order, node2.max_order), max(node1.min_order, node2.min_order)
        if _call_between(scheduler, first, last):
            return False
        return InductorChoices.can_fuse_horizontal(scheduler, node1, node2, shared_data_score)

    @staticmethod
    def can_fuse_vertical(scheduler, node1, node2, shared_data_score):
        if _call_between(scheduler, node1.max_order, node2.min_order):
            return False
        return InductorChoices.can_fuse_vertical(scheduler, node1, node2, shared_data_score)

    def uuid(self) -> str:
        return "fxmem-no-fusion-across-library-calls-3"

"""Choose which forward values to save and which to recompute, against the simulated peak.

The planner walks from "save everything the backward reads" (fastest) towards the smallest
peak it can reach, twice (`fxmem.walks`: most bytes per second of added recomputation first,
and most bytes first). The trajectory is the menu: a budget takes the cheapest state whose
peak fits, or what a short walk from the states just above its limit reaches where that
recomputes less (`fit`); then a polishing pass saves again whatever recomputation the budget
still has room for. The lowest peak along the trajectory is the floor; a budget below it
sends the search below where the walks stall (`fxmem.kicks`), once.

This is not a knapsack on summed saved bytes: every decision is judged by the peak over time
that `simulate` reports, in bytes. The searches run on a thread of their own (`own_stack`).
"""

from __future__ import annotations

from collections.abc import Callable

from fxmem.graph import JointGraph
from fxmem.kicks import kicked
from fxmem.walks import Choice, Effort, by_bytes, by_rate, capped, fit, timeline_within, walk

__all__ = ["Choice", "Trajectory", "plan_trajectory"]

_POLISH_TRIES = 40
# `fit` walks from the states over a budget's limit closest to it, this many, for at most
# this many simulations in all (and no more than `capped` allows)
_FIT_STARTS = 3
_FIT_SIMULATIONS = 40


class Trajectory:
    """States from fastest to smallest peak; `choose(limit)` picks one for a budget.

    `below` searches for states under the lowest of `states` (see `kicked`); `choose` runs it,
    once, for a limit no state fits: the planning time it costs (up to that of the walks
    again) is spent only where the budget would otherwise be refused."""

    def __init__(
        self,
        jg: JointGraph,
        states: list[Choice],
        floor_bytes: int = 0,
        below: Callable[[], list[Choice]] | None = None,
    ):
        self.jg = jg
        self.states = states
        self.floor_bytes = floor_bytes  # a peak no plan goes below (the optimizer step's)
        self._below = below

    def peak(self, choice: Choice) -> int:
        return max(choice.timeline.peak_bytes, self.floor_bytes)

    @property
    def unconstrained(self) -> Choice:
        return self.states[0]

    @property
    def smallest(self) -> Choice:
        return min(self.states, key=lambda c: (self.peak(c), c.timeline.recompute_s))

    def choose(self, limit_bytes: int) -> Choice | None:
        """The state for a budget's limit: None if none reaches it."""
        fitting = [c for c in self.states if self.peak(c) <= limit_bytes]
        if not fitting and self._below is not None:
            self.states += self._below()
            self._below = None
            return self.choose(limit_bytes)
        if not fitting:
            return None
        best = min(fitting, key=lambda c: c.timeline.recompute_s)
        effort = Effort(limit=capped(self.jg, _FIT_SIMULATIONS))
        starts = self._fit_starts(limit_bytes, best)
        fitted = [c for c in (fit(self.jg, s, limit_bytes, effort) for s in starts) if c is not None]
        candidates = [best]
        if fitted:  # polishing is greedy: from less recomputation it can end with more, so both
            candidates.append(min(fitted, key=lambda c: c.timeline.recompute_s))
        return min((self._polish(c, limit_bytes) for c in candidates), key=lambda c: c.timeline.recompute_s)

    def _fit_starts(self, limit_bytes: int, best: Choice) -> list[Choice]:
        """The states over the limit closest to it that recompute less than `best` does."""
        over = [
            c for c in self.states if self.peak(c) > limit_bytes and c.timeline.recompute_s < best.timeline.recompute_s
        ]
        return sorted(over, key=lambda c: c.timeline.peak_bytes)[:_FIT_STARTS]

    def _polish(self, choice: Choice, limit_bytes: int) -> Choice:
        """Save again the costliest recomputed values while the peak stays within the limit."""
        jg = self.jg
        tried = 0
        for i in sorted(set(choice.timeline.recomputed), key=lambda i: -jg.cost_s[i]):
            if tried >= _POLISH_TRIES or jg.cost_s[i] <= 0:
                break
            if jg.storage[i] < 0:
                continue  # a tuple-valued op: its outputs are the values to save
            if i not in set(choice.timeline.recomputed):
                continue  # no longer recomputed thanks to an earlier re-save
            tried += 1
            trial = choice.saved.copy()
            trial[i] = True
            tl = timeline_within(jg, trial, limit_bytes)
            if tl is not None and tl.recompute_s < choice.timeline.recompute_s:
                choice = Choice(trial, tl)
        return choice


def plan_trajectory(jg: JointGraph, floor_bytes: int = 0) -> Trajectory:
    """Two walks from "save everything": one takes the most bytes per second of added
    recomputation first, the other the most bytes first. A greedy walk can stall above the
    floor when the cheap moves it took early leave no move that lowers the peak; which one
    reaches further depends on the graph, so both are the menu, and what `kicked` finds
    below where each ended joins it when a budget needs it. (Partitioning runs it on a stack of
    its own: see `own_stack`.)"""
    rate_effort, bytes_effort = Effort(), Effort()
    refused: dict[bytes, int] = {}  # saved sets a walk refused -> the peak they were to stay under
    rate_states = walk(jg, by_rate, rate_effort, refused=refused)
    bytes_states = walk(jg, by_bytes, bytes_effort, refused=refused)

    def below() -> list[Choice]:
        return kicked(jg, by_rate, rate_states, rate_effort.spent, refused) + kicked(
            jg, by_bytes, bytes_states, bytes_effort.spent, refused
        )

    return Trajectory(jg, rate_states + bytes_states[1:], floor_bytes, below)

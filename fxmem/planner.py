"""Choose which forward values to save and which to recompute, against the simulated peak.

The solver walks one trajectory from "save everything the backward reads" (fastest) towards
the smallest peak it can reach. Each step looks at the moment of the current peak, takes the
saved storages alive then, and unsaves those that free the most bytes per second of added
recomputation, re-simulating after each batch; a batch that raises the peak is undone, and
the walk goes on one move at a time until a move is taken (where one move raises the peak, the
next batch, which would hold the next best moves, mostly does too). A saved set refused at a
peak no lower than the current one is not simulated again: after a refused batch and one of
its moves taken, the next batch is often that set. The trajectory is the menu: a budget
takes the cheapest state whose peak fits, or what a short walk from the states just above its
limit reaches where that recomputes less (`_fit`); then a polishing pass saves again whatever
recomputation the budget still has room for. The lowest peak along the trajectory is the
floor.

A walk ends where no single move lowers the peak, which is not always the lowest peak there
is: a value recomputed early in the backward (a residual, rebuilt for an MLP's backward from
its block's attention) can hold what it is made of alive through a later peak, and saving it
instead first raises the peak somewhere else, which the walk never accepts. So from each
walk's lowest state, the planner saves one such value, keeps it saved, and walks on; the
first that ends lower is taken and the search goes on from there (`_kicked`). Where no such
value does, it swaps: one saved storage alive at the peak recomputed, one recomputed value
saved instead, where that lowers the peak (`_swapped`), and walks on. It runs only for a
budget below the walks' lowest peak.

This is not a knapsack on summed saved bytes: every decision is judged by the peak over time
that `simulate` reports, in bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from fxmem.graph import FWD, PRIMAL, TANGENT, JointGraph
from fxmem.schedule import InfeasibleSave
from fxmem.simulate import Timeline, simulate

__all__ = ["Choice", "Trajectory", "plan_trajectory"]

_BATCH_FRACTION = 0.04  # bytes unsaved per step, as a share of the current peak
_POLISH_TRIES = 40
_RETRIES = 2  # walks on after moves refused before were allowed again
# `_kicked` may simulate as often as the walk it starts from did, or 50 times on a short walk,
# but no more than this many nodes' worth of simulation in all (a 7,000-node graph: 285 times)
_KICK_SIMULATIONS = 50
_KICK_NODE_STEPS = 2_000_000
# `_fit` walks from the states over a budget's limit closest to it, this many, for at most
# this many simulations in all (and no more than `_KICK_NODE_STEPS` nodes' worth)
_FIT_STARTS = 3
_FIT_SIMULATIONS = 40


@dataclass
class Choice:
    saved: list[bool]
    timeline: Timeline


@dataclass
class _Move:
    sid: int
    unsave: tuple[int, ...]
    also_save: tuple[int, ...]
    gain_bytes: int
    cost_s: float

    @property
    def score(self) -> float:
        return self.gain_bytes / (self.cost_s + 1e-9)


def _initial_saved(jg: JointGraph) -> list[bool]:
    saved = [False] * len(jg.nodes)
    for i in jg.boundary():
        saved[i] = True
    return saved


def _moves(jg: JointGraph, saved: list[bool], tl: Timeline, tried: set[int]) -> list[_Move]:
    """Ways to lower the peak by unsaving one storage that is alive at the peak."""
    alive = [s for s in _at_peak(tl, tl.saved_interval) if s not in tried]
    if not alive:
        return []
    members = _saved_members(jg, saved, tl)
    recomputed = set(tl.recomputed)
    saved_sids = set(tl.saved_interval)
    moves = []
    for sid in alive:
        group = members.get(sid, [])
        if not group or any(jg.banned[i] for i in group):
            continue
        in_group = set(group)

        def available(j: int, in_group: set[int] = in_group) -> bool:
            return (
                jg.kind[j] in (PRIMAL, TANGENT) or jg.is_sym[j] or (saved[j] and j not in in_group) or j in recomputed
            )

        # Variant 1: recompute the chain back to whatever is available.
        cost, extra, seen, todo = 0.0, set(), set(group), list(group)
        while todo:
            i = todo.pop()
            cost += jg.cost_s[i]
            for j in jg.inputs[i]:
                if j in seen or available(j):
                    continue
                seen.add(j)
                if jg.banned[j]:
                    extra.add(j)
                else:
                    todo.append(j)
        gain = jg.storage_bytes[sid] - _new_bytes(jg, extra, saved_sids)
        if gain > 0:
            moves.append(_Move(sid, tuple(group), tuple(extra), gain, cost))
        # Variant 2: recompute only the group, saving its missing inputs instead.
        frontier = {j for i in group for j in jg.inputs[i] if j not in in_group and not available(j)}
        if frontier and frontier != extra and all(jg.storage[j] >= 0 for j in frontier):
            gain2 = jg.storage_bytes[sid] - _new_bytes(jg, frontier, saved_sids)
            cost2 = sum(jg.cost_s[i] for i in group)
            if gain2 > 0:
                moves.append(_Move(sid, tuple(group), tuple(frontier), gain2, cost2))
    return moves


def _at_peak(tl: Timeline, intervals: dict[int, tuple[int, int]]) -> list[int]:
    """The storages of `intervals` (storage -> (alloc step, free step)) alive at `tl`'s peak."""
    return [s for s, (a, f) in intervals.items() if a <= tl.peak_pos <= f]


def _saved_members(jg: JointGraph, saved: list[bool], tl: Timeline) -> dict[int, list[int]]:
    """Per storage `tl` saves, the forward nodes of it that `saved` saves."""
    members: dict[int, list[int]] = {}
    for i, k in enumerate(jg.kind):
        if k == FWD and saved[i] and jg.storage[i] in tl.saved_interval:
            members.setdefault(jg.storage[i], []).append(i)
    return members


def _save_instead(jg: JointGraph, tl: Timeline, saved: list[bool], tried: set[int]) -> list[_Move]:
    """Ways to lower the peak by saving what a recomputed value alive at the peak is read by.

    Recomputing a forward value (dropout's random numbers, say) can cost more bytes in the
    backward than saving the smaller values made from it (dropout's mask): then save those,
    and the value need not be recomputed at all. Faster and smaller at once.
    """
    rset = set(tl.recomputed)
    saved_sids = set(tl.saved_interval)
    groups: dict[int, list[int]] = {}
    for i in tl.recomputed:
        groups.setdefault(jg.storage[i], []).append(i)
    moves = []
    for sid in _at_peak(tl, tl.recomputed_interval):
        if sid in tried:
            continue
        group = groups.get(sid, [])
        readers = {u for i in group for u in jg.users[i] if jg.storage[u] != sid and (u in rset or jg.kind[u] != FWD)}
        if not readers or any(jg.kind[u] != FWD or jg.storage[u] < 0 or saved[u] for u in readers):
            continue
        gain = jg.storage_bytes[sid] - _new_bytes(jg, readers, saved_sids)
        if gain > 0:
            moves.append(_Move(sid, (), tuple(sorted(readers)), gain, 0.0))
    return moves


def _new_bytes(jg: JointGraph, nodes: set[int], saved_sids: set[int]) -> int:
    sids = {jg.storage[j] for j in nodes if jg.storage[j] >= 0} - saved_sids
    return sum(jg.storage_bytes[s] for s in sids)


def _apply(saved: list[bool], moves: list[_Move]) -> list[bool]:
    out = saved.copy()
    for m in moves:
        for i in m.unsave:
            out[i] = False
    for m in moves:
        for j in m.also_save:
            out[j] = True
    return out


class Trajectory:
    """States from fastest to smallest peak; `choose(limit)` picks one for a budget.

    `below` searches for states under the lowest of `states` (see `_kicked`); `choose` runs it,
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
        fitting = [c for c in self.states if self.peak(c) <= limit_bytes]
        if not fitting and self._below is not None:
            self.states += self._below()
            self._below = None
            return self.choose(limit_bytes)
        if not fitting:
            return None
        best = min(fitting, key=lambda c: c.timeline.recompute_s)
        effort = _Effort(limit=_capped(self.jg, _FIT_SIMULATIONS))
        starts = self._fit_starts(limit_bytes, best)
        fitted = [c for c in (_fit(self.jg, s, limit_bytes, effort) for s in starts) if c is not None]
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
            tl = _trial(jg, trial, limit_bytes)
            if tl is not None and tl.recompute_s < choice.timeline.recompute_s:
                choice = Choice(trial, tl)
        return choice


def _trial(jg: JointGraph, saved: list[bool], above: int) -> Timeline | None:
    """The timeline of `saved`, or None if its peak passes `above` or the backward cannot be
    scheduled with those values saved."""
    try:
        return simulate(jg, saved, above=above)
    except InfeasibleSave:
        return None


def _capped(jg: JointGraph, simulations: int) -> int:
    """`simulations`, or fewer on a graph where that many would pass `_KICK_NODE_STEPS`."""
    return min(simulations, _KICK_NODE_STEPS // max(1, len(jg.nodes)))


def _fit(jg: JointGraph, start: Choice, limit_bytes: int, effort: _Effort) -> Choice | None:
    """A state within the limit walked to from `start`, a state over it: each move is the
    cheapest to recompute of those that free at least the excess at the peak, or else the
    one that frees the most bytes per second. None if the walk ends over the limit.

    The walks' states step down by batches of moves (4% of the peak at a time, or a whole
    block's largest value), so the cheapest state within a limit can be far below it and
    recompute more than the budget asks; walking from a state just above the limit frees
    only what the limit needs."""
    saved, tl = start.saved, start.timeline
    tried: set[int] = set()
    kept: set[int] = set()  # storages saved by a _save_instead move
    while tl.peak_bytes > limit_bytes:
        excess = tl.peak_bytes - limit_bytes
        moves = _moves(jg, saved, tl, tried | kept) + _save_instead(jg, tl, saved, tried)
        if not moves or not effort.spend():
            return None
        move = min(moves, key=lambda m: (0, m.cost_s, m.sid) if m.gain_bytes >= excess else (1, -m.score, m.sid))
        trial = _apply(saved, [move])
        new_tl = _trial(jg, trial, tl.peak_bytes)
        if new_tl is None:
            tried.add(move.sid)
            continue
        saved, tl = trial, new_tl
        if not move.unsave:
            tried.add(move.sid)
            kept |= {jg.storage[j] for j in move.also_save}
    return Choice(saved, tl)


def plan_trajectory(jg: JointGraph, floor_bytes: int = 0) -> Trajectory:
    """Two walks from "save everything": one takes the most bytes per second of added
    recomputation first, the other the most bytes first. A greedy walk can stall above the
    floor when the cheap moves it took early leave no move that lowers the peak; which one
    reaches further depends on the graph, so both are the menu, and what `_kicked` finds
    below where each ended joins it when a budget needs it."""
    rate_effort, bytes_effort = _Effort(), _Effort()
    refused: dict[bytes, int] = {}  # saved sets a walk refused -> the peak they were to stay under
    by_rate = _walk(jg, _by_rate, rate_effort, refused=refused)
    by_bytes = _walk(jg, _by_bytes, bytes_effort, refused=refused)

    def below() -> list[Choice]:
        return _kicked(jg, _by_rate, by_rate, rate_effort.spent, refused) + _kicked(
            jg, _by_bytes, by_bytes, bytes_effort.spent, refused
        )

    return Trajectory(jg, by_rate + by_bytes[1:], floor_bytes, below)


@dataclass
class _Effort:
    """Trials (simulations, and saved sets known to be refused), against an optional limit."""

    limit: int | None = None
    spent: int = 0

    def spend(self) -> bool:
        """Count one trial; False when it is over the limit (and so not to be run)."""
        self.spent += 1
        return self.limit is None or self.spent <= self.limit


def _by_rate(m: _Move) -> tuple:
    return (-m.score, m.sid)


def _by_bytes(m: _Move) -> tuple:
    return (-m.gain_bytes, m.cost_s, m.sid)


def _kicked(
    jg: JointGraph,
    order: Callable[[_Move], tuple],
    states: list[Choice],
    walked_for: int,
    refused: dict[bytes, int] | None = None,
) -> list[Choice]:
    """States below the lowest of `states`, walked to from it by saving a recomputed value.

    The values tried are those read by a recomputed storage alive at the lowest state's peak
    that are recomputed themselves and not alive then: saving one lets the backward recompute
    what it is made of later, or not at all. Its peak may rise elsewhere first; the walk on
    from there keeps it saved. Where none ends lower, a swap that lowers the peak at once
    (`_swapped`) is walked on from, the value it saves kept saved. Kicks and swaps together
    simulate at most as often as the walk to `states` did (`walked_for` times), or
    `_KICK_SIMULATIONS` times on a short walk: they cost at most about as much planning time
    again. On large graphs (tens of thousands of nodes, where a walk takes minutes)
    `_KICK_NODE_STEPS` bounds it lower."""
    best = min(states, key=lambda c: c.timeline.peak_bytes)
    found: list[Choice] = []
    limit = _capped(jg, max(walked_for, _KICK_SIMULATIONS))
    effort = _Effort(limit=limit)
    lowered = True
    while lowered:
        lowered = False
        for u in _readers_to_save(jg, best):
            start = best.saved.copy()
            start[u] = True
            try:
                walked = _walk(jg, order, effort, start, kept={jg.storage[u]}, retries=0, refused=refused)
            except InfeasibleSave:
                continue
            if not walked:
                return found  # effort spent
            lowest = min(walked, key=lambda c: c.timeline.peak_bytes)
            if lowest.timeline.peak_bytes < best.timeline.peak_bytes:
                found += walked
                best, lowered = lowest, True
                break
        if lowered:
            continue
        swapped = _swapped(jg, best, effort)
        if swapped is None:
            return found
        start, u = swapped
        walked = _walk(
            jg, order, effort, start.saved, kept={jg.storage[u]}, retries=0, timeline=start.timeline, refused=refused
        )
        found += walked
        best, lowered = min(walked, key=lambda c: c.timeline.peak_bytes), True
    return found


def _swapped(jg: JointGraph, choice: Choice, effort: _Effort) -> tuple[Choice, int] | None:
    """`choice` with one saved storage alive at its peak recomputed and one recomputed forward
    value saved instead, the first such swap found that lowers the peak, and that value; None
    if none does (or `effort` is spent first).

    Two residuals of a ConvNeXt: the walk saved the first stage's and recomputes a later
    one's; saving the later one lets the backward rebuild the first where it needs it, after
    the peak. Neither an unsave nor a kick reaches it, since each half alone raises the peak.
    The largest saved storages are tried first; for each, the values no larger than it, the
    closest in size first (a residual for a residual); then the larger ones."""
    tl = choice.timeline
    members = _saved_members(jg, choice.saved, tl)
    alive = [s for s in _at_peak(tl, tl.saved_interval) if s in members and not any(jg.banned[i] for i in members[s])]
    first: dict[int, int] = {}  # per recomputed storage saved nowhere, the node that makes it
    for i in tl.recomputed:
        s = jg.storage[i]
        if jg.kind[i] == FWD and s >= 0 and s not in tl.saved_interval and not choice.saved[i]:
            first[s] = min(first.get(s, i), i)
    size = jg.storage_bytes
    alive.sort(key=lambda s: (-size[s], s))

    def pairs() -> Iterator[tuple[int, int]]:
        for larger in (False, True):
            for s in alive:
                us = [u for su, u in first.items() if (size[su] > size[s]) == larger]
                yield from ((s, u) for u in sorted(us, key=lambda u: (abs(size[s] - size[jg.storage[u]]), u)))

    for s, u in pairs():
        if not effort.spend():
            return None
        trial = choice.saved.copy()
        trial[u] = True
        for i in members[s]:
            trial[i] = False
        new_tl = _trial(jg, trial, tl.peak_bytes - 1)
        if new_tl is not None:
            return Choice(trial, new_tl), u
    return None


def _readers_to_save(jg: JointGraph, choice: Choice) -> list[int]:
    """Recomputed nodes, one a storage, that read a recomputed storage alive at the peak and
    are not alive then themselves."""
    tl = choice.timeline
    recomputed = set(tl.recomputed)
    alive = set(_at_peak(tl, tl.recomputed_interval))
    first: dict[int, int] = {}
    for s in sorted(alive):
        for i in jg.storage_nodes[s]:
            for u in jg.users[i]:
                su = jg.storage[u]
                if u in recomputed and su >= 0 and su not in alive and not choice.saved[u]:
                    first[su] = min(first.get(su, u), u)
    return sorted(first.values())


def _walk(
    jg: JointGraph,
    order: Callable[[_Move], tuple],
    effort: _Effort,
    saved: list[bool] | None = None,
    kept: set[int] | None = None,
    retries: int = _RETRIES,
    timeline: Timeline | None = None,
    refused: dict[bytes, int] | None = None,
) -> list[Choice]:
    """States from `saved` (default: everything the backward reads) down, each lowering the
    peak or keeping it, until no move does or `effort` is spent (none, if it is spent before
    the first); storages in `kept` are never unsaved. `timeline`: `saved`'s, already
    simulated (the first state then always is). `refused`: saved sets refused before -> the
    peak they were to stay under, on this graph; the walk adds those it refuses."""
    saved = _initial_saved(jg) if saved is None else saved
    if timeline is None:
        if not effort.spend():
            return []
        timeline = simulate(jg, saved)
    tl = timeline
    states = [Choice(saved, tl)]
    tried: set[int] = set()
    kept = set() if kept is None else set(kept)  # also storages saved by a _save_instead move
    single = False
    refused = {} if refused is None else refused
    while True:
        moves = sorted(_moves(jg, saved, tl, tried | kept) + _save_instead(jg, tl, saved, tried), key=order)
        if not moves and tried and retries:
            # A move refused at an earlier peak may lower the peak the walk ended at.
            retries -= 1
            tried = set()
            continue
        # A trial known to be refused counts as one too: the searches below the walks may take
        # as many as the walks did (`_kicked`), whatever they cost.
        if not moves or not effort.spend():
            break
        want = 1 if single else max(1, int(_BATCH_FRACTION * tl.peak_bytes))
        batch, total = [], 0
        for m in moves:
            batch.append(m)
            total += m.gain_bytes
            if total >= want:
                break
        trial = _apply(saved, batch)
        key = bytes(trial)
        if refused.get(key, -1) >= tl.peak_bytes:
            # Refused before at a peak no lower than this one: after a refused batch and a
            # single move taken from it, the next batch is often the same saved set again.
            new_tl = None
        else:
            new_tl = _trial(jg, trial, tl.peak_bytes)
            if new_tl is None:
                refused[key] = tl.peak_bytes
        if new_tl is not None:
            saved, tl, single = trial, new_tl, False
            kept |= {jg.storage[j] for m in batch if not m.unsave for j in m.also_save}
            tried |= {m.sid for m in batch if not m.unsave}
            states.append(Choice(saved, tl))
        elif len(batch) == 1:
            tried.add(batch[0].sid)
        else:
            single = True
    return states

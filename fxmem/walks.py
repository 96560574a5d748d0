"""The planner's walks: from a saved set towards a smaller peak, one batch of moves at a time.

A walk starts from "save everything the backward reads" (fastest) or from any saved set. Each
step looks at the moment of the current peak, takes the saved storages alive then, and
unsaves those that free the most bytes per second of added recomputation (or the most bytes:
`by_rate`, `by_bytes`), re-simulating after each batch; a batch that raises the peak is
undone, and the walk goes on one move at a time until a move is taken (where one move raises
the peak, the next batch, which would hold the next best moves, mostly does too). A saved set
refused at a peak no lower than the current one is not simulated again: after a refused batch
and one of its moves taken, the next batch is often that set. A move may also save what a
recomputed value alive at the peak is read by (`_save_instead`). `fit` walks from a state
over a budget's limit to one within it, freeing only what the limit needs.

Every decision is judged by the peak over time that `simulate` reports, in bytes; `Effort`
counts the simulations a search may spend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fxmem.graph import FWD, JointGraph
from fxmem.schedule import InfeasibleSave
from fxmem.simulate import Timeline, simulate

__all__ = [
    "Choice",
    "Effort",
    "Move",
    "at_peak",
    "by_bytes",
    "by_rate",
    "capped",
    "fit",
    "saved_members",
    "timeline_within",
    "walk",
]

_BATCH_FRACTION = 0.04  # bytes unsaved per step, as a share of the current peak
_RETRIES = 2  # walks on after moves refused before were allowed again
# the most nodes' worth of simulation a search beyond the walks may spend (`capped`; a
# 7,000-node graph: 285 simulations)
_NODE_STEPS = 2_000_000


@dataclass
class Choice:
    saved: list[bool]
    timeline: Timeline


@dataclass
class Move:
    sid: int
    unsave: tuple[int, ...]
    also_save: tuple[int, ...]
    gain_bytes: int
    cost_s: float

    @property
    def score(self) -> float:
        return self.gain_bytes / (self.cost_s + 1e-9)


@dataclass
class Effort:
    """Trials (simulations, and saved sets known to be refused), against an optional limit."""

    limit: int | None = None
    spent: int = 0

    def spend(self) -> bool:
        """Count one trial; False when it is over the limit (and so not to be run)."""
        self.spent += 1
        return self.limit is None or self.spent <= self.limit


def _initial_saved(jg: JointGraph) -> list[bool]:
    saved = [False] * len(jg.nodes)
    for i in jg.boundary():
        saved[i] = True
    return saved


def _moves(jg: JointGraph, saved: list[bool], tl: Timeline, tried: set[int]) -> list[Move]:
    """Ways to lower the peak by unsaving one storage that is alive at the peak."""
    alive = [s for s in at_peak(tl, tl.saved_interval) if s not in tried]
    if not alive:
        return []
    members = saved_members(jg, saved, tl)
    recomputed = set(tl.recomputed)
    saved_sids = set(tl.saved_interval)
    there, fixed = jg.there_before_backward, jg.read_not_recomputed
    moves = []
    for sid in alive:
        group = members.get(sid, [])
        if not group or any(jg.banned[i] for i in group):
            continue
        in_group = set(group)

        def available(j: int, in_group: set[int] = in_group) -> bool:
            return there[j] or (saved[j] and j not in in_group) or j in recomputed

        # Variant 1: recompute the chain back to whatever is available.
        cost, extra, seen, todo = 0.0, set(), set(group), list(group)
        while todo:
            i = todo.pop()
            cost += jg.cost_s[i]
            for j in jg.inputs[i]:
                if j in seen or available(j):
                    continue
                seen.add(j)
                if jg.banned[j] or jg.storage[j] in fixed:
                    extra.add(j)
                else:
                    todo.append(j)
        gain = jg.storage_bytes[sid] - _new_bytes(jg, extra, saved_sids)
        if gain > 0:
            moves.append(Move(sid, tuple(group), tuple(extra), gain, cost))
        # Variant 2: recompute only the group, saving its missing inputs instead.
        frontier = {j for i in group for j in jg.inputs[i] if j not in in_group and not available(j)}
        if frontier and frontier != extra and all(jg.storage[j] >= 0 for j in frontier):
            gain2 = jg.storage_bytes[sid] - _new_bytes(jg, frontier, saved_sids)
            cost2 = sum(jg.cost_s[i] for i in group)
            if gain2 > 0:
                moves.append(Move(sid, tuple(group), tuple(frontier), gain2, cost2))
    return moves


def at_peak(tl: Timeline, intervals: dict[int, tuple[int, int]], step: int | None = None) -> list[int]:
    """The storages of `intervals` (storage -> (alloc step, free step)) alive at `tl`'s peak,
    or at `step`."""
    at = tl.peak_pos if step is None else step
    return [s for s, (a, f) in intervals.items() if a <= at <= f]


def saved_members(jg: JointGraph, saved: list[bool], tl: Timeline) -> dict[int, list[int]]:
    """Per storage `tl` saves, the forward nodes of it that `saved` saves: the values a move may
    recompute instead. Not those the backward reads rather than recomputes
    (`JointGraph.read_not_recomputed`: an output the caller keeps costs nothing to save)."""
    members: dict[int, list[int]] = {}
    fixed = jg.read_not_recomputed
    for i, k in enumerate(jg.kind):
        if k == FWD and saved[i] and jg.storage[i] in tl.saved_interval and jg.storage[i] not in fixed:
            members.setdefault(jg.storage[i], []).append(i)
    return members


def _save_instead(jg: JointGraph, tl: Timeline, saved: list[bool], tried: set[int]) -> list[Move]:
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
    for sid in at_peak(tl, tl.recomputed_interval):
        if sid in tried:
            continue
        group = groups.get(sid, [])
        readers = {u for i in group for u in jg.users[i] if jg.storage[u] != sid and (u in rset or jg.kind[u] != FWD)}
        if not readers or any(jg.kind[u] != FWD or jg.storage[u] < 0 or saved[u] for u in readers):
            continue
        gain = jg.storage_bytes[sid] - _new_bytes(jg, readers, saved_sids)
        if gain > 0:
            moves.append(Move(sid, (), tuple(sorted(readers)), gain, 0.0))
    return moves


def _new_bytes(jg: JointGraph, nodes: set[int], saved_sids: set[int]) -> int:
    sids = {jg.storage[j] for j in nodes if jg.storage[j] >= 0} - saved_sids
    return sum(jg.storage_bytes[s] for s in sids)


def _apply(saved: list[bool], moves: list[Move]) -> list[bool]:
    out = saved.copy()
    for m in moves:
        for i in m.unsave:
            out[i] = False
    for m in moves:
        for j in m.also_save:
            out[j] = True
    return out


def timeline_within(jg: JointGraph, saved: list[bool], above: int) -> Timeline | None:
    """The timeline of `saved`, or None if its peak passes `above` or the backward cannot be
    scheduled with those values saved."""
    try:
        return simulate(jg, saved, above=above)
    except InfeasibleSave:
        return None


def capped(jg: JointGraph, simulations: int) -> int:
    """`simulations`, or fewer on a graph where that many would pass `_NODE_STEPS`."""
    return min(simulations, _NODE_STEPS // max(1, len(jg.nodes)))


def by_rate(m: Move) -> tuple:
    return (-m.score, m.sid)


def by_bytes(m: Move) -> tuple:
    return (-m.gain_bytes, m.cost_s, m.sid)


def walk(
    jg: JointGraph,
    order: Callable[[Move], tuple],
    effort: Effort,
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
        # as many as the walks did (`kicked`), whatever they cost.
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
            new_tl = timeline_within(jg, trial, tl.peak_bytes)
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


def fit(jg: JointGraph, start: Choice, limit_bytes: int, effort: Effort) -> Choice | None:
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
        new_tl = timeline_within(jg, trial, tl.peak_bytes)
        if new_tl is None:
            tried.add(move.sid)
            continue
        saved, tl = trial, new_tl
        if not move.unsave:
            tried.add(move.sid)
            kept |= {jg.storage[j] for j in move.also_save}
    return Choice(saved, tl)

"""Below where the planner's walks stall: kicks and swaps.

A walk ends where no single move lowers the peak, which is not always the lowest peak there
is: a value recomputed early in the backward (a residual, rebuilt for an MLP's backward from
its block's attention) can hold what it is made of alive through a later peak, and saving it
instead first raises the peak somewhere else, which the walk never accepts. So from each
walk's lowest state, `kicked` saves one such value, keeps it saved, and walks on; the first
that ends lower is taken and the search goes on from there. Where no such value does, it
swaps: one saved storage alive at the peak recomputed, one recomputed value saved instead,
where that lowers the peak (`_swapped`), and walks on. With the peak in the forward, where
nothing recomputed is alive, the values kicked are those the backward's highest step holds
(`_backward_high`). The planner runs it only for a budget below the walks' lowest peak.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from fxmem.graph import FWD, JointGraph
from fxmem.schedule import InfeasibleSave
from fxmem.simulate import Timeline
from fxmem.walks import Choice, Effort, Move, at_peak, capped, saved_members, timeline_within, walk

__all__ = ["kicked"]

# `kicked` may simulate as often as the walk it starts from did, or on a short walk this many
# nodes' worth of simulation, between the least and most simulations below (and no more than
# `capped` allows): a swap that lowers the peak can be ninety trials in (Llama's 850 nodes)
_KICK_NODE_STEPS = 100_000
_KICK_SIMULATIONS = (50, 120)


def kicked(
    jg: JointGraph,
    order: Callable[[Move], tuple],
    states: list[Choice],
    walked_for: int,
    refused: dict[bytes, int] | None = None,
) -> list[Choice]:
    """States below the lowest of `states`, walked to from it by saving a recomputed value.

    The values tried are those that read a recomputed storage alive at the lowest state's peak
    and are recomputed themselves: saving one lets the backward recompute what it is made of
    later, or not at all. Its peak may rise elsewhere first; the walk on from there keeps it
    saved. Where none ends lower, a swap that lowers the peak at once (`_swapped`) is walked
    on from, the value it saves kept saved. Kicks and swaps together simulate at most as often
    as the walk to `states` did (`walked_for` times), or, on a short walk, as `_KICK_NODE_STEPS`
    allows (50 to 120 times): they cost about as much planning time again, or a fraction of a
    second. On large graphs (tens of thousands of nodes, where a walk takes minutes) `capped`
    bounds it lower. A peak in the forward (what the plan saves, all alive as the backward
    starts) has no recomputed value alive at it; where no swap lowers it either, the values
    kicked are those alive at the backward's highest step (`_backward_high`), with as much
    effort again, once: this search, where the others end, is the one planning time grows for."""
    best = min(states, key=lambda c: c.timeline.peak_bytes)
    found: list[Choice] = []
    least, most = _KICK_SIMULATIONS
    short_walk = min(most, max(least, _KICK_NODE_STEPS // max(1, len(jg.nodes))))
    allowance = capped(jg, max(walked_for, short_walk))
    effort = Effort(limit=allowance)
    extended = False  # the effort given once more, for the kicks at the backward's highest step
    while True:
        tl = best.timeline
        walked = _kick(jg, order, effort, best, _readers_to_save(jg, best, tl.peak_pos), refused)
        if walked is None:
            swapped = _swapped(jg, best, effort)
            if swapped is not None:
                start, u = swapped
                walked = walk(
                    jg,
                    order,
                    effort,
                    start.saved,
                    kept={jg.storage[u]},
                    retries=0,
                    timeline=start.timeline,
                    refused=refused,
                )
        if walked is None and tl.peak_pos < tl.boundary < len(tl.curve):
            if not extended:
                effort.limit = min(effort.spent, allowance) + allowance
                extended = True
            walked = _kick(jg, order, effort, best, _readers_to_save(jg, best, _backward_high(tl)), refused)
        if not walked:
            return found  # nothing lowers the peak, or the effort is spent
        found += walked
        best = min(walked, key=lambda c: c.timeline.peak_bytes)


def _kick(
    jg: JointGraph,
    order: Callable[[Move], tuple],
    effort: Effort,
    best: Choice,
    tries: list[int],
    refused: dict[bytes, int] | None,
) -> list[Choice] | None:
    """The walk from `best` with the first of `tries` saved (and kept saved) whose lowest state
    is below `best`'s peak; None if none is, [] if `effort` is spent first."""
    for u in tries:
        start = best.saved.copy()
        start[u] = True
        try:
            walked = walk(jg, order, effort, start, kept={jg.storage[u]}, retries=0, refused=refused)
        except InfeasibleSave:
            continue
        if not walked:
            return []
        if min(c.timeline.peak_bytes for c in walked) < best.timeline.peak_bytes:
            return walked
    return None


def _swapped(jg: JointGraph, choice: Choice, effort: Effort) -> tuple[Choice, int] | None:
    """`choice` with one saved storage alive at its peak recomputed and one recomputed forward
    value saved instead, the first such swap found that lowers the peak, and that value; None
    if none does (or `effort` is spent first).

    Two residuals of a ConvNeXt: the walk saved the first stage's and recomputes a later
    one's; saving the later one lets the backward rebuild the first where it needs it, after
    the peak. Neither an unsave nor a kick reaches it, since each half alone raises the peak.
    The largest saved storages are tried first; for each, the values no larger than it, the
    closest in size first (a residual for a residual); then the larger ones."""
    tl = choice.timeline
    members = saved_members(jg, choice.saved, tl)
    alive = [s for s in at_peak(tl, tl.saved_interval) if s in members and not any(jg.banned[i] for i in members[s])]
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
        new_tl = timeline_within(jg, trial, tl.peak_bytes - 1)
        if new_tl is not None:
            return Choice(trial, new_tl), u
    return None


def _backward_high(tl: Timeline) -> int:
    """The backward's highest step, for a peak in the forward. Every unsave that would lower
    that peak raises the backward's above it; a kick that lowers the backward's leaves the walk
    room to unsave. Gemma 2 at some rates: the walks end with the peak at the forward's last
    chunk of logits, saving five values of 1 MiB where three would do (26.05 MiB); kicked at
    the backward's highest step, 24.05 MiB, as the walks reach at other rates."""
    return max(range(tl.boundary, len(tl.curve)), key=lambda p: (tl.curve[p], -p))


def _readers_to_save(jg: JointGraph, choice: Choice, at: int) -> list[int]:
    """Recomputed nodes, one a storage, that read another recomputed storage alive at step
    `at` (the peak's, or the backward's highest: `_backward_high`).
    Those alive then too are tried, after the others: GPT-J's first LayerNorm output,
    recomputed early in the backward, holds the embedding it is made from alive through the
    peak beside it. Tried among the others, one of them was taken first where the others led
    lower (Qwen3's loss-only floor under inductor, 5% higher). Within each part, those reading
    the most bytes alive at the peak come first, then graph order: on T5 the kicks' simulations
    ran out on the attention's chunks, each reading a small concatenation, before they reached
    the residuals that read a block's feed-forward output (its floor 3.5% higher)."""
    tl = choice.timeline
    recomputed = set(tl.recomputed)
    alive = set(at_peak(tl, tl.recomputed_interval, at))
    first: dict[int, int] = {}
    reads: dict[int, set[int]] = {}  # per candidate storage, the alive storages it reads
    for s in sorted(alive):
        for i in jg.storage_nodes[s]:
            for u in jg.users[i]:
                su = jg.storage[u]
                if u in recomputed and su >= 0 and su != s and not choice.saved[u]:
                    first[su] = min(first.get(su, u), u)
                    reads.setdefault(su, set()).add(s)
    freed = {su: sum(jg.storage_bytes[s] for s in read) for su, read in reads.items()}
    return sorted(first.values(), key=lambda u: (jg.storage[u] in alive, -freed[jg.storage[u]], u))

"""Which buffer a fusing compiler's kernel writes its output over.

Inductor writes a kernel's output over a buffer that dies in that kernel when the kernel reads
it at the very index it writes (`reads_in_place`); `simulate` then frees that buffer as the new
value is made rather than after it.
"""

from __future__ import annotations

from collections.abc import Callable

from fxmem.graph import JointGraph
from fxmem.kernels import NEVER_WRITTEN_OVER, op_name, reach

__all__ = ["reads_in_place"]


def reads_in_place(jg: JointGraph, i: int, maker: int, cost: list[int]) -> bool:
    """Whether node `i` reads the buffer `maker` wrote at the very index it writes, directly or
    through values its kernel computes inline: only then does inductor write its output over
    that buffer. The buffer's layout is its maker's: `i` must have the maker's shape and
    strides, or be a reshape of it that no reduction reads (an mm's (B*T, 4C) output read as
    (B, T, 4C) by GELU's backward is overwritten; a bmm's (B*H, T, T) output read as
    (B, H, T, T) by a softmax is not), and read it through views that keep its layout (not a
    transpose). Never a buffer a scatter filled or a concatenation's (`NEVER_WRITTEN_OVER`).

    The answer depends on the plan only through which storages are stored (`cost`): each
    answer is kept with the storages it asked about (`JointGraph.in_place_answers`), and
    holds again wherever those are stored alike."""
    known = jg.in_place_answers.setdefault((i, maker), [])
    for sids, unstored, answer in known:
        if all((not cost[s]) == u for s, u in zip(sids, unstored, strict=True)):
            return answer
    asked: dict[int, bool] = {}

    def is_unstored(s: int) -> bool:
        if s not in asked:
            asked[s] = not cost[s]
        return asked[s]

    answer = _reads_in_place_asking(jg, i, maker, is_unstored)
    known.append((tuple(asked), tuple(asked.values()), answer))
    return answer


def _reads_in_place_asking(jg: JointGraph, i: int, maker: int, is_unstored: Callable[[int], bool]) -> bool:
    layouts = jg.layouts
    want, made = layouts[i], layouts[maker]
    if want is None or made is None:
        return False
    r = jg.storage[maker]
    if any(op_name(jg.nodes[j]) in NEVER_WRITTEN_OVER for j in jg.storage_nodes[r]):
        return False  # made by, or written into, such a buffer
    if want != made:
        # one a reshape of the other: as many elements, both dense and row-major
        if jg.dense_numel[i] < 0 or jg.dense_numel[i] != jg.dense_numel[maker] or _reduced(jg, r, is_unstored):
            return False

    def through(j: int) -> list[int]:  # values i's kernel computes inline: their inputs too
        sj = jg.storage[j]
        return jg.inputs[j] if sj != r and sj >= 0 and jg.inlinable[j] and is_unstored(sj) else []

    return any(jg.storage[j] == r and layouts[j] == want for j in reach(jg.inputs[i], through))


def _reduced(jg: JointGraph, r: int, is_unstored: Callable[[int], bool]) -> bool:
    """Whether a reduction reads storage `r`, directly or through values computed inline."""

    def onward(u: int) -> list[int]:  # views of r, and values computed inline from it
        su = jg.storage[u]
        return jg.users[u] if su == r or (su >= 0 and jg.inlinable[u] and is_unstored(su)) else []

    readers = [u for j in jg.storage_nodes[r] for u in jg.users[j]]
    return any(jg.fusible[u] and not jg.inlinable[u] and jg.storage[u] != r for u in reach(readers, onward))

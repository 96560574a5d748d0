"""Memory over time for one training step, given which forward values are saved.

The step runs in the order `schedule` gives. Every storage is freed after its last reader;
saved storages live from the forward into the backward; outputs (the loss, gradients) live to
the end, or, what the step returns when the caller lets it go before the backward
(`keep_outputs=False`), to the forward's end. Primal storages (parameters, buffers, inputs) are
static: the caller adds them.

For a fusing compiler (inductor) the simulation follows its kernels rather than its ops: a
value only fusible ops read is never stored, so its inputs live until its last reader (each
reader's kernel computes it again); a kernel holds what it reads until it has written what it
makes, and writes its output over a buffer that dies in it when it reads that buffer at the
index it writes (see `in_place.reads_in_place`); recomputed values are stored unless their readers can
compute them inline (see `buffers.stored_on_reuse`); a forward value several kernels of the
forward read is stored there when its code is costly (`buffers.stored_in_forward`); an
element-wise value a library call alone reads is computed right before that call, not where
the graph has it (see `schedule.as_realized`). Kernels never merge across a library call:
fxmem's compile keeps inductor from fusing kernels across one (see
`_torch_private._fusion_choices`). Each rule was checked against inductor's generated code
and `fxmem.measure` on GPT, GPT-with-dropout and ViT floors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fxmem import _torch_private as tp
from fxmem.buffers import inline_code, is_costly
from fxmem.graph import JointGraph
from fxmem.in_place import reads_in_place
from fxmem.nodes import transient_bytes
from fxmem.own_stack import stop_if_abandoned
from fxmem.probe import workspace_bytes
from fxmem.schedule import as_realized, backward_order, kernel_ends, outputs_made_at

__all__ = ["Timeline", "simulate"]


@dataclass
class Timeline:
    peak_bytes: int  # activation/gradient bytes at the worst moment (static excluded)
    peak_pos: int
    curve: list[int]  # bytes in use after each step's allocation
    order: list[int]  # node index run at each step
    boundary: int  # steps < boundary are forward
    recomputed: list[int]  # forward nodes run again in backward
    recompute_s: float
    saved_interval: dict[int, tuple[int, int]]  # saved storage -> (alloc step, free step)
    kinds: list[str]  # per step: "fwd", "bwd" or "recompute"
    alive_at_snapshot: dict[int, int] = field(default_factory=dict)  # storage -> bytes charged
    # recomputed storage that costs bytes -> (alloc step, free step) in the backward
    recomputed_interval: dict[int, tuple[int, int]] = field(default_factory=dict)
    # With `record_events`: (step, storage, +bytes) when a storage is charged, (step, storage,
    # -bytes) when freed after that step's reading; they sum to `curve` (see plan_files). A
    # negative key is memory no storage holds: an op's temporaries, the copies made for a call.
    events: list[tuple[int, int, int]] | None = None
    # What the step returns that the caller lets go (`keep_outputs=False`) and the plan frees
    # at the forward's end: not saved, nor held to the backward's end.
    released: frozenset[int] = frozenset()
    # The backward's nodes in the order the backward graph is emitted; `order` is the order a
    # fusing compiler runs them in (see `schedule.as_realized`). None: the same.
    emitted: list[int] | None = None


def simulate(
    jg: JointGraph, saved: list[bool], snapshot_at: int = -1, record_events: bool = False, above: int | None = None
) -> Timeline | None:
    """Run the step on paper; `snapshot_at` records the storages alive at that step, with the
    bytes each is charged (nothing for a value a fusing compiler never writes out). With
    `above`, None as soon as the bytes in use exceed it (the caller only wants a peak no
    higher)."""
    stop_if_abandoned()
    events: list[tuple[int, int, int]] | None = [] if record_events else None
    fwd_order = jg.forward_nodes
    bwd_order, recomputed = backward_order(jg, saved)
    # Gradients of the outputs arrive as the backward starts: for outputs the loss does not
    # depend on (logits, caches) autograd materialises full-size zeros.
    emitted = fwd_order + jg.tangent_nodes + bwd_order
    boundary = len(fwd_order)
    order = as_realized(jg, emitted, boundary) if jg.fusible else emitted
    storage, sbytes = jg.storage, jg.storage_bytes

    static = jg.primal_storages
    kept_end = jg.kept_to_end
    released = _let_go(jg, kept_end)
    # A value saved for no reader in the backward (nor a recomputed one) is not saved.
    rset = set(recomputed)
    read_back = jg.read_back(rset)
    saved_sids = {storage[i] for i in fwd_order if saved[i] and i in read_back and i not in rset} - static
    saved_sids.discard(-1)

    # Last reader of each storage, per phase: a value freed in the forward and recomputed in
    # the backward is two allocations. The forward runs the same steps whatever is saved.
    # What the caller lets go before the backward lives to the forward's end.
    last_f = dict(jg.forward_last_reads)
    last_f.update((s, max(last_f.get(s, boundary - 1), boundary - 1)) for s in released)
    last_b = jg.last_reads(order, boundary)

    # What a storage costs while alive, per phase: nothing if a fusing compiler never writes it
    # out. What the caller lets go is stored in the forward, which returns it, and no more in
    # the backward, which may compute it again.
    held = saved_sids | kept_end | released
    kept_b = saved_sids | kept_end
    cost = _costs(jg, held)
    costs = (_stored_in_forward(jg, cost), _costs(jg, kept_b) if released else cost)
    fusible = jg.fusible

    # The element-wise code computing each recomputed value inline in the backward: whether it
    # applies a heavy op, and the stored buffers it reads (`buffers.inline_code`). Saved values
    # and those the backward does not compute again are buffers there; the plan decides which
    # (`buffers.stored_on_reuse` judges on the joint graph, where a value saved here may be
    # code computed inline).
    heavy: dict[int, bool] = {}
    reads: dict[int, frozenset[int]] = {}
    inline_at: dict[int, bool] = {}

    def judge(i: int) -> bool:
        """A recomputed value a fusing compiler never writes out: it is not materialised,
        and the fusible ops that read it in the backward each compute it inside their own
        kernel (a value several kernels read is stored when its code is costly: see
        buffers.stored_on_reuse). The values it reads are judged first."""
        if not jg.inlinable or not jg.inlinable[i] or jg.materialized[storage[i]]:
            return False
        heavy[i], reads[i] = inline_code(
            jg.heavy[i], jg.inputs[i], storage, reads, heavy, lambda j: not inline_at.get(j)
        )
        if i in jg.copied_per_reader:
            return True  # each attention call that reads it copies it (see `copies` below)
        # Its readers and its views' (a view of a value computed inline is computed inline):
        # the backward's, and the forward's it computes again.
        readers, all_fusible, forward_readers = jg.readers_by_side[storage[i]]
        if not all_fusible:
            return False
        for u in forward_readers:
            if u in rset:
                if not fusible[u]:
                    return False
                readers += 1
        return readers <= 1 or not is_costly(heavy[i], reads[i])

    def inlined(i: int) -> bool:
        """Whether the backward computes recomputed value `i` inline (see `judge`)."""
        return inline_at.get(i, False)

    if jg.fusible:
        for i in sorted(rset):  # graph order: a value's inputs before it
            inline_at[i] = judge(i)
        _extend_through_unstored(jg, order, boundary, last_f, last_b, costs, rset, inlined)
    copies = (_copies(jg, held), _copies(jg, kept_b))

    frees: dict[int, list[int]] = {}
    end = len(order)
    for s, t in last_f.items():
        if s in static:
            continue
        if s in kept_end:
            t = end
        elif s in saved_sids:
            t = last_b.get(s, boundary - 1)
        frees.setdefault(t, []).append(s)
    for s, t in last_b.items():
        if s in static or s in saved_sids or (s in kept_end and s in last_f):
            continue
        frees.setdefault(end if s in kept_end else t, []).append(s)

    # A fused kernel frees what it last reads when it ends, or writes an output of the same
    # size over it (inductor reuses a buffer that dies in the kernel that makes the new one,
    # the kernel's last op included: MobileViT's and RegNet's SiLU and batch-norm gradients);
    # `frees` becomes kernel end -> the storages last read inside that kernel.
    last_read_at: dict[int, dict[int, int]] = {}  # kernel end -> storage -> step of the last read
    kernel_end: list[int] = []
    if jg.fusible:
        kernel_end = kernel_ends([fusible[i] for i in order])
        moved: dict[int, list[int]] = {}
        for t, sids in frees.items():
            k = kernel_end[t] if t < end else t
            moved.setdefault(k, []).extend(sids)
            last_read_at.setdefault(k, {}).update(dict.fromkeys(sids, t))
        frees = moved

    alive: set[int] = set()
    charged: dict[int, int] = {}
    snapshot: dict[int, int] = {}
    alloc_at: dict[int, int] = {}
    made_by: dict[int, int] = {}  # storage -> the node that allocated it
    cur = peak = peak_pos = 0
    curve = []
    recomputed_sids = {storage[i] for i in recomputed}
    recomputed_interval: dict[int, tuple[int, int]] = {}
    made_at = outputs_made_at(jg, order)
    transient = jg.transient or [0] * len(storage)
    rewritten = _rewritten(jg, rset) if rset and jg.call_outputs else {}
    phase_cost, phase_copies, backward = costs[0], copies[0], False
    # Inductor makes the copies a library call reads as it lowers the call, after the call's
    # other inputs, and fuses their code into the kernel that runs right before the call (T5's
    # cross-attention mask, written by the kernel that copies its keys and values out of their
    # projection): they are alive with everything that kernel reads, before it frees any of it.
    ahead = 0  # the next call's copies, written by the kernel ending at this step
    copy_key = -2 - len(storage)  # events' keys for those copies, below the transients' -2 - i
    for t, i in enumerate(order):
        if t == boundary:
            phase_cost, phase_copies, backward = costs[1], copies[1], True
        # A library call writes all its outputs while its inputs live (`outputs_made_at`).
        made = made_at.get(t)
        for s in (*made, storage[i]) if made else (storage[i],):
            if s < 0 or s in static or s in alive:
                continue
            alive.add(s)
            alloc_at[s] = t
            made_by[s] = i
            # Recomputed values are written out in full in the backward, unless a fusing
            # compiler can compute them inside the kernels that read them (see `inlined`); the
            # forward is the same whatever the backward computes again.
            if s != storage[i]:
                c = sbytes[s]
            elif not backward and s in jg.stored_in_forward and kernel_end and last_f.get(s, t) <= kernel_end[t]:
                c = cost[s]  # read only inside the kernel computing it: a local of that kernel
            elif not backward or i not in rset or inlined(i):
                c = phase_cost[s]
            else:
                c = sbytes[s]
            charged[s] = c
            if c and kernel_end and fusible[i]:
                k = kernel_end[t]
                for r in frees.get(k, ()):
                    if (
                        r in alive
                        and charged[r] == c
                        and last_read_at[k][r] <= t
                        and reads_in_place(jg, i, made_by[r], cost if backward else phase_cost)
                    ):
                        alive.discard(r)  # the new value is written over it
                        if r in recomputed_sids and alloc_at[r] >= boundary:
                            recomputed_interval[r] = (alloc_at[r], t)
                        cur -= c
                        if events is not None:  # gone before this step's snapshot: freed after the last one
                            events.append((t - 1, r, -c))
                        break
            cur += c
            if events is not None:
                events.append((t, s, c))
        # inside the op: allocated, then freed
        extra = transient[i] + phase_copies.get(i, 0) if phase_copies else transient[i]
        if backward and rewritten:
            extra += rewritten.get(i, 0)
        carried, ahead = ahead, 0
        if phase_copies and kernel_end and kernel_end[t] == t and fusible[i] and t + 1 not in (end, boundary):
            ahead = phase_copies.get(order[t + 1], 0)
        if events is not None:
            if extra > carried:
                events.append((t, -2 - i, extra - carried))
                events.append((t, -2 - i, carried - extra))
            if ahead:
                events.append((t, copy_key - order[t + 1], ahead))
            if carried:
                events.append((t, copy_key - i, -carried))
        now = cur + extra + ahead
        curve.append(now)
        if t == snapshot_at:
            snapshot = {s: charged[s] for s in alive}
        if now > peak:
            peak, peak_pos = now, t
            if above is not None and peak > above:
                return None
        for s in frees.get(t, ()):
            if s in alive:
                alive.discard(s)
                cur -= charged[s]
                if s in recomputed_sids and charged[s] and alloc_at[s] >= boundary:
                    recomputed_interval[s] = (alloc_at[s], t)
                if events is not None:
                    events.append((t, s, -charged[s]))

    saved_interval = {}
    for s in saved_sids:
        free_t = last_b.get(s, boundary - 1)
        saved_interval[s] = (alloc_at.get(s, 0), end if s in kept_end else free_t)
    kinds = ["fwd"] * boundary + ["recompute" if i in rset else "bwd" for i in order[boundary:]]
    return Timeline(
        peak_bytes=peak,
        peak_pos=peak_pos,
        curve=curve,
        order=order,
        boundary=boundary,
        recomputed=recomputed,
        recompute_s=sum(jg.cost_s[i] for i in recomputed),
        saved_interval=saved_interval,
        kinds=kinds,
        alive_at_snapshot=snapshot,
        events=events,
        recomputed_interval=recomputed_interval,
        emitted=None if order == emitted else emitted[boundary:],
        released=frozenset(released - saved_sids),
    )


def _costs(jg: JointGraph, held: set[int]) -> list[int]:
    """Per storage, its bytes while alive: nothing if a fusing compiler never writes it out
    and the plan does not hold it (`held`: saved, returned)."""
    out = jg.materialized_bytes.copy()
    sbytes = jg.storage_bytes
    for s in held:
        out[s] = sbytes[s]
    return out


def _stored_in_forward(jg: JointGraph, cost: list[int]) -> list[int]:
    """`cost` in the forward: with the storages its graph writes out because several of its
    kernels read them (`JointGraph.stored_in_forward`)."""
    if not jg.stored_in_forward:
        return cost
    out = cost.copy()
    for s in jg.stored_in_forward:
        out[s] = jg.storage_bytes[s]
    return out


def _rewritten(jg: JointGraph, rset: set[int]) -> dict[int, int]:
    """Per multi-output library call the backward computes again, the bytes of the outputs it
    writes that the backward does not compute again there (saved, or not read): each is a new
    buffer while the call runs (an attention recomputed for its output writes its log-sum-exp
    again beside the saved one)."""
    out: dict[int, int] = {}
    for i, parts in jg.call_outputs.items():
        if i in rset:
            nbytes = sum(jg.storage_bytes[s] for u, s in parts if u not in rset)
            if nbytes:
                out[i] = nbytes
    return out


def _copies(jg: JointGraph, held: set[int]) -> dict[int, int]:
    """Per attention call, the bytes of the copies a fusing compiler makes for it of the
    values it reads that are not stored (`buffers.copied_per_reader`; `held`: stored), alive
    for the call, and from the kernel right before it when one runs there (see `simulate`)."""
    out: dict[int, int] = {}
    for v in jg.copied_per_reader:
        s = jg.storage[v]
        if s not in held:
            for u in jg.storage_readers[s]:
                if not jg.fusible[u]:
                    out[u] = out.get(u, 0) + jg.storage_bytes[s]
    return out


def _let_go(jg: JointGraph, kept_end: frozenset[int]) -> set[int]:
    """Storages of what the step returns that the caller lets go before the backward
    (`keep_outputs=False`): not those of parameters or inputs, nor those another output keeps."""
    released = {jg.storage[i] for i in jg.released_outputs if jg.storage[i] >= 0}
    return released - kept_end - jg.primal_storages


def _extend_through_unstored(
    jg: JointGraph,
    order: list[int],
    boundary: int,
    last_f: dict[int, int],
    last_b: dict[int, int],
    costs: tuple[list[int], list[int]],
    rset: set[int],
    inlined: Callable[[int], bool],
) -> None:
    """Keep the inputs of values a fusing compiler never stores alive until those values' last
    readers: each reader's kernel computes the value again from them (Falcon's key gradients,
    summed over the heads that share a key, are computed where the gradients of all chunks are
    concatenated, at the end of the attention's backward: each chunk's product of all heads
    lives until then). So too for a reduction a concatenation alone reads: inductor computes it
    into the concatenation's buffer, when it makes that (per-chunk bias gradients, summed over
    the batch, concatenated per head); and for a matmul folded into its reader's addmm, which
    runs where that add is (a tied LM head's weight gradient, added to the embedding's at the
    end of the backward, holds the logits' gradient and the head's input until then)."""
    storage, reads, candidate = jg.storage, jg.input_storages, jg.computed_in_readers
    # The backward's steps, then the forward's: each phase has its own last reads. The
    # forward's steps are the same whatever is saved.
    steps_b = [t for t in range(boundary, len(order)) if candidate[order[t]]]
    for ts, cost, last, backward in (
        (steps_b, costs[1], last_b, True),
        (jg.forward_candidates, costs[0], last_f, False),
    ):
        for t in reversed(ts):
            i = order[t]
            s = storage[i]
            if cost[s] or (backward and i in rset and not inlined(i)):
                continue
            until = last.get(s, t)
            for sj in reads[i]:
                if last.get(sj, -1) < until:
                    last[sj] = until


def _storage_key(node, remap: dict[int, int]) -> int | None:
    val = node.meta.get("val") if hasattr(node, "meta") else None
    if not hasattr(val, "untyped_storage"):
        return None
    try:
        key = val.untyped_storage()._cdata
    except Exception:
        return None
    while key in remap:
        key = remap[key]
    return key


def simulate_modules(fw, bw, remap: dict[int, int] | None = None) -> tuple[int, list[str]]:
    """Peak bytes (static inputs excluded) of running the emitted forward then backward.

    This reads the graphs exactly as they will run, so it checks `simulate`'s schedule.
    Returns the peak and the names of the nodes alive at it.
    """
    remap = remap or {}
    nbytes: dict[int, int] = {}
    names: dict[int, str] = {}

    def key(n):
        k = _storage_key(n, remap)
        if k is not None and k not in nbytes:
            nbytes[k] = int(n.meta["val"].untyped_storage().nbytes())
            names[k] = n.name
        return k

    fw_out = next(iter(fw.graph.find_nodes(op="output")))
    bw_out = next(iter(bw.graph.find_nodes(op="output")))
    bw_inputs = [n.name for n in bw.graph.find_nodes(op="placeholder")]
    static = {key(n) for n in fw.graph.find_nodes(op="placeholder")} - {None}
    fw_outputs = [a for a in fw_out.all_input_nodes]
    by_name = {n.name: n for n in fw_outputs}
    saved = {key(by_name[nm]) for nm in bw_inputs if nm in by_name} - {None}
    user_outs = {key(n) for n in fw_outputs if n.name not in bw_inputs} - {None}
    grads = {key(n) for n in bw_out.all_input_nodes} - {None}

    steps: list[tuple[object, int]] = []
    for phase, gm in ((0, fw), (1, bw)):
        steps += [(n, phase) for n in gm.graph.nodes if n.op == "call_function" or "tangent" in n.name]
    last: dict[tuple[int, int], int] = {}
    for t, (n, phase) in enumerate(steps):
        for m in [n, *n.all_input_nodes]:
            k = key(m)
            if k is not None:
                last[(k, phase)] = t
    end = len(steps)
    alive: dict[int, int] = {}  # key -> free step
    cur = peak = 0
    peak_alive: list[str] = []
    bw_start = sum(1 for _, p in steps if p == 0)
    for t, (n, phase) in enumerate(steps):
        k = key(n)
        if k is not None and k not in static and k not in alive:
            held = tp.TANGENTS_HELD_THROUGH_BACKWARD and n.op == "placeholder" and phase == 1
            if k in user_outs or k in grads or held:  # a gradient of an output, held by the call
                free = end
            elif k in saved and phase == 0:
                free = last.get((k, 1), bw_start)
            else:
                free = last.get((k, phase), t)
            alive[k] = free
            cur += nbytes[k]
        extra = transient_bytes(n) + workspace_bytes(n) if n.op == "call_function" else 0
        if cur + extra > peak:
            peak, peak_alive = cur + extra, [names[a] for a in alive]
        for a in [a for a, f in alive.items() if f == t]:
            del alive[a]
            cur -= nbytes[a]
    return peak, peak_alive

"""Which storage each value of an aten graph lives in, and which storages the step writes.

Two nodes whose values share a storage (a view and its base) share one storage id; the
bytes of each id are the storage's. A step that updates one of its inputs in place (a
BatchNorm's running statistics) writes that input's storage: values read from it before the
update are not what a recomputation after it would read.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any

import torch
import torch.fx as fx

from fxmem.kernels import op_name
from fxmem.nodes import aliased_input

__all__ = ["concatenated_in_place", "node_storages", "written_storages"]


def node_storages(nodes: list[fx.Node], storage_remap: dict[int, int] | None = None) -> tuple[list[int], list[int]]:
    """Per node, the id of the storage its value lives in (-1 for a non-tensor), and per id its
    bytes. `storage_remap` maps storages a pass made redundant to the ones they stand for."""
    storage: list[int] = []
    storage_bytes: list[int] = []
    by_key: dict[int, int] = {}
    for n in nodes:
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            storage.append(-1)
            continue
        try:
            st = val.untyped_storage()
            key, nbytes = st._cdata, int(st.nbytes())
            while storage_remap and key in storage_remap:
                key = storage_remap[key]
        except Exception:  # tensor subclasses without a plain storage
            key, nbytes = id(val), val.numel() * val.element_size()
        sid = by_key.get(key)
        if sid is None:
            sid = by_key[key] = len(storage_bytes)
            storage_bytes.append(nbytes)
        storage.append(sid)
    return _merge_view_storages(nodes, storage, storage_bytes)


def written_storages(nodes: list[fx.Node], storage: list[int], descs: list[Any]) -> set[int]:
    """The storages of the step's inputs that it updates in place: in the graph (`copy_` into
    a buffer, as inductor keeps BatchNorm's running stats) or after the forward, from an
    output AOTAutograd writes back (`InputMutationAOTOutput`)."""
    mutated = [d.mutated_input for d in descs if type(d).__name__ == "InputMutationAOTOutput"]
    index = {n: i for i, n in enumerate(nodes)}
    written = set()
    for i, n in enumerate(nodes):
        if n.op == "placeholder" and mutated and n.meta.get("desc") in mutated:
            written.add(storage[i])
        elif n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            for k, a in enumerate(n.target._schema.arguments):
                if a.alias_info is None or not a.alias_info.is_write:
                    continue
                arg = n.args[k] if k < len(n.args) else n.kwargs.get(a.name)
                for x in arg if isinstance(arg, (list, tuple)) else [arg]:
                    if isinstance(x, fx.Node):
                        written.add(storage[index[x]])
    written.discard(-1)
    return written


def _merge_view_storages(
    nodes: list[fx.Node], storage: list[int], storage_bytes: list[int]
) -> tuple[list[int], list[int]]:
    """Give every view the storage of its base, whatever its fake value says.

    Graph passes that rebuild a node (inductor's joint-graph passes, for one) can leave a view
    with a fake value of its own storage: `expand(div)` then looks like a second copy of `div`,
    and a plan saving both would be charged twice for memory that exists once. So too the parts
    of a multi-output view (`split`) whose fake values were not made again with it: a chunk of
    T5's keys, apart from the keys, let them die before the chunk's last reader.
    """
    index = {n: i for i, n in enumerate(nodes)}
    pairs = []
    for i, n in enumerate(nodes):
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            base = _parts_view_of(n.args[0])  # one part of a multi-output view (`split`, `unbind`)
        else:
            base = aliased_input(n) if n.op == "call_function" else None
        j = index.get(base) if base is not None else None
        if j is not None and storage[i] >= 0 and storage[j] >= 0:
            pairs.append((storage[j], storage[i]))
    return _merged(pairs, storage, storage_bytes)


def _parts_view_of(node: fx.Node) -> fx.Node | None:
    """The input whose views a multi-output op returns (`split(Tensor(a -> *) self) ->
    Tensor(a)[]`), or None."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    alias = schema.arguments[0].alias_info
    if alias is None or alias.is_write or "*" not in alias.after_set:
        return None
    return node.args[0]


# Library matmuls whose output inductor writes straight into the buffer of a concatenation
# that reads it (`ConcatKernel.realize_into`: an extern kernel's output of flexible layout).
_WRITTEN_INTO_CONCATENATION = {"mm", "bmm", "addmm", "baddbmm"}


def concatenated_in_place(
    nodes: list[fx.Node], users: list[list[int]], storage: list[int], storage_bytes: list[int], backward: list[bool]
) -> tuple[list[int], list[int]]:
    """Under a fusing compiler: give a matmul of the backward that a concatenation alone reads
    the concatenation's storage. Inductor makes the concatenation's buffer before the first
    such matmul runs and has each write its part of it (the chunked LM loss's gradients of
    its input, chunk by chunk), so the buffer lives from the first matmul and the matmuls' own
    outputs are never buffers of their own. Only in the backward: a forward concatenation
    the backward computes again from saved parts would copy them into a buffer of its own."""
    holders = Counter(storage)
    pairs = []
    for i, n in enumerate(nodes):
        if (
            backward[i]
            and storage[i] >= 0
            and op_name(n) in _WRITTEN_INTO_CONCATENATION
            and len(users[i]) == 1
            and op_name(nodes[users[i][0]]) == "cat"
            and backward[users[i][0]]
            and holders[storage[i]] == 1  # no view of it: the concatenation reads it as made
        ):
            pairs.append((storage[users[i][0]], storage[i]))
    return _merged(pairs, storage, storage_bytes)


def _merged(pairs: list[tuple[int, int]], storage: list[int], storage_bytes: list[int]) -> tuple[list[int], list[int]]:
    """Storage ids with each pair's two storages made one, renumbered from 0 in their
    order; a merged storage has the bytes of its largest part."""
    parent = list(range(len(storage_bytes)))

    def root(s: int) -> int:
        while parent[s] != s:
            parent[s] = parent[parent[s]]
            s = parent[s]
        return s

    for x, y in pairs:
        a, b = root(x), root(y)
        if a != b:
            parent[max(a, b)] = min(a, b)  # the earlier storage (a view's base) names the group
    if all(parent[s] == s for s in range(len(parent))):
        return storage, storage_bytes
    new_id: dict[int, int] = {}
    merged_bytes: list[int] = []
    for s in range(len(storage_bytes)):
        r = root(s)
        if r not in new_id:
            new_id[r] = len(merged_bytes)
            merged_bytes.append(0)
        merged_bytes[new_id[r]] = max(merged_bytes[new_id[r]], storage_bytes[s])
    return [new_id[root(s)] if s >= 0 else -1 for s in storage], merged_bytes

"""Which storage each value of an aten graph lives in, and which storages the step writes.

Two nodes whose values share a storage (a view and its base) share one storage id; the
bytes of each id are the storage's. A step that updates one of its inputs in place (a
BatchNorm's running statistics) writes that input's storage: values read from it before the
update are not what a recomputation after it would read.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from fxmem.nodes import aliased_input

__all__ = ["node_storages", "written_storages"]


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
    and a plan saving both would be charged twice for memory that exists once.
    """
    parent = list(range(len(storage_bytes)))

    def root(s: int) -> int:
        while parent[s] != s:
            parent[s] = parent[parent[s]]
            s = parent[s]
        return s

    index = {n: i for i, n in enumerate(nodes)}
    for i, n in enumerate(nodes):
        base = aliased_input(n) if n.op == "call_function" else None
        j = index.get(base) if base is not None else None
        if j is None or storage[i] < 0 or storage[j] < 0:
            continue
        a, b = root(storage[j]), root(storage[i])
        if a != b:
            parent[max(a, b)] = min(a, b)  # the earlier storage (the base) names the group
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

"""tie_weights: find parameters that are, or could be, one tensor; tie them when asked.

Detection always runs (`fxmem.optimize`): parameters that already are one tensor under
several names (a tied LM head and embedding) are counted once in memory and listed in the
plan as `tied_weights`; parameters with the same shape, dtype and values that are separate
tensors (a tied checkpoint loaded into an untied model) are listed as `tie_candidates` —
except constant tensors (LayerNorm's ones and zeros at init), which match without being one
weight.

Tying is opt-in, since it changes training: two tensors that were updated separately
become one. `fxmem.optimize(model, budget_gb, tie_weights=True)` ties every candidate group but
those whose names differ only in block indices (repeated blocks built by copying one are
equal until trained; a warning names them);
`tie_weights=[("lm_head.weight", "wte.weight")]` ties the named pairs (the second name then
refers to the first name's parameter; their shapes and dtypes must agree). Before::

    model.lm_head.weight is model.wte.weight        # False: two (V, d) tensors

After::

    model.lm_head.weight is model.wte.weight        # True: one tensor, one gradient

The parameters of the memory budget shrink by the second tensor, and its gradient and
optimizer state vanish with it. Build the optimizer after `optimize` (or pass one built
after tying), since an optimizer made before still holds the replaced tensor. Saving a tied
model: `safetensors.torch.save_model` / `load_model` handle shared tensors (`save_file`
refuses them). A failed `optimize` unties what it tied.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Sequence

import torch
import torch.nn as nn

from fxmem.rules import Refusal

__all__ = ["TieReport", "detect", "tie", "untie"]


class TieReport:
    """Parameter names grouped: `shared` are one tensor already; `candidates` could be."""

    def __init__(self, shared: list[list[str]], candidates: list[list[str]]):
        self.shared = shared
        self.candidates = candidates

    def __repr__(self) -> str:
        return f"TieReport(shared={self.shared}, candidates={self.candidates})"


def detect(model: nn.Module) -> TieReport:
    by_tensor: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    shared = [names for names in by_tensor.values() if len(names) > 1]
    by_kind: dict[tuple, list[int]] = {}
    for key, p in tensors.items():
        # A constant tensor (LayerNorm's ones and zeros at init) equals every other of its
        # shape without being the same weight: never a candidate.
        if p.device.type != "meta" and p.numel() > 1 and not bool((p == p.reshape(-1)[0]).all()):
            by_kind.setdefault((tuple(p.shape), p.dtype, p.device), []).append(key)
    candidates = []
    for keys in _by_sample(by_kind, tensors):
        groups: list[list[int]] = []
        for key in keys:
            for group in groups:
                if torch.equal(tensors[group[0]], tensors[key]):
                    group.append(key)
                    break
            else:
                groups.append([key])
        candidates += [[by_tensor[k][0] for k in group] for group in groups if len(group) > 1]
    return TieReport(shared, candidates)


def _by_sample(by_kind: dict[tuple, list[int]], tensors: dict[int, torch.Tensor]) -> list[list[int]]:
    """Split each shape group by a few sampled values, so only likely-equal tensors are compared."""
    out = []
    for keys in by_kind.values():
        if len(keys) < 2:
            continue
        numel = tensors[keys[0]].numel()
        # Integer positions: a float32 linspace rounds past the last element once numel > 2**24.
        steps = min(numel, 16)
        index = torch.arange(steps, dtype=torch.int64) * (numel - 1) // (steps - 1)
        groups: dict[tuple, list[int]] = {}
        for key in keys:
            sample = tensors[key].detach().reshape(-1)[index.to(tensors[key].device)].tolist()
            groups.setdefault(tuple(sample), []).append(key)
        out += [g for g in groups.values() if len(g) > 1]
    return out


def guard(model: nn.Module, keep: str, replace: str) -> Refusal | None:
    params = dict(model.named_parameters(remove_duplicate=False))
    for name in (keep, replace):
        if name not in params:
            return Refusal(f"{name!r} is not a parameter of the model")
    a, b = params[keep], params[replace]
    if a is b:
        return Refusal(f"{keep!r} and {replace!r} are already one tensor")
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return Refusal(f"{keep!r} {tuple(a.shape)} {a.dtype} and {replace!r} {tuple(b.shape)} {b.dtype} differ")
    return None


def _repeated_block(group: Sequence[str]) -> bool:
    """Whether the names differ only in block indices (`layers.0.fc.weight`, `layers.1.fc.weight`):
    the same weight of repeated blocks, equal because they were built by copying one block
    (`nn.TransformerEncoder`), not a tied checkpoint loaded untied."""
    return len({re.sub(r"(^|\.)\d+(?=\.|$)", r"\1#", name) for name in group}) == 1


def _pairs(model: nn.Module, request: bool | Iterable[Sequence[str]]) -> list[tuple[str, str]]:
    if request is True:
        groups = detect(model).candidates
        repeated = [g for g in groups if _repeated_block(g)]
        if repeated:
            warnings.warn(
                f"tie_weights=True leaves {len(repeated)} group(s) of equal weights untied whose names differ "
                f"only in block indices ({', '.join(repeated[0][:2])}, ...): blocks built as copies of one are "
                "equal until trained, not one weight. Name the pairs to tie them",
                stacklevel=4,
            )
        return [(g[0], other) for g in groups if not _repeated_block(g) for other in g[1:]]
    if request is False or request is None:
        return []
    if isinstance(request, (str, bytes)) or not isinstance(request, Iterable):
        raise ValueError(f"tie_weights takes True, False or pairs of parameter names, got {request!r}")
    pairs = []
    for pair in request:
        if isinstance(pair, str) or len(pair) != 2:
            raise ValueError(f"tie_weights takes True or pairs of parameter names, got {pair!r}")
        pairs.append((str(pair[0]), str(pair[1])))
    return pairs


def tie(model: nn.Module, request: bool | Iterable[Sequence[str]]) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Tie what `request` names; returns what `untie` needs to undo it. Checks every pair first."""
    pairs = _pairs(model, request)
    for keep, replace in pairs:
        refusal = guard(model, keep, replace)
        if refusal is not None:
            raise ValueError(f"cannot tie {keep!r} and {replace!r}: {refusal.reason}")
    undo = []
    for keep, replace in pairs:
        kept = dict(model.named_parameters(remove_duplicate=False))[keep]  # after earlier ties
        owner_name, _, attr = replace.rpartition(".")
        owner = model.get_submodule(owner_name)
        undo.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, kept)
    return undo


def untie(undo: list[tuple[nn.Module, str, nn.Parameter]]) -> None:
    for owner, attr, original in reversed(undo):
        setattr(owner, attr, original)

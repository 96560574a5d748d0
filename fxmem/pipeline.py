"""The ordered list of rule passes run on the captured torch-level graph, before AOTAutograd.

Each pass takes a graph and returns it and how many times its rules fired. The order is
part of the design: a comment beside each entry says why it stands where it does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from fxmem.passes.bf16_regions import bf16_regions
from fxmem.passes.chunked_attention import chunked_attention
from fxmem.passes.chunked_lm_loss import chunked_lm_loss
from fxmem.passes.detach_caches import detach_caches
from fxmem.passes.fuse_projections import fuse_projections
from fxmem.passes.index_as_slice import index_as_slice
from fxmem.passes.swap_sdpa import swap_sdpa

__all__ = ["PASSES", "check_pass_names", "default_passes", "run_passes"]

PassFn = Callable[[fx.GraphModule, Sequence[Any]], tuple[fx.GraphModule, int]]

# name -> (pass function, exact?). Exact passes run by default; the others only when named.
PASSES: dict[str, tuple[PassFn, bool]] = {
    # First: turns gathered copies into views, so the passes after it read plain slices.
    "index_as_slice": (index_as_slice, True),
    # First: reads attention as written, before projections are fused or regions cast.
    "swap_sdpa": (swap_sdpa, True),
    # After swap_sdpa, which reads q/k/v as separate values; before casts of whole regions.
    "fuse_projections": (fuse_projections, True),
    # After swap_sdpa, whose SDPA calls it splits into groups of heads where SDPA runs its math form.
    "chunked_attention": (chunked_attention, True),
    # Last: reads the LM head as the passes before it leave it.
    "chunked_lm_loss": (chunked_lm_loss, True),
    # Reads only the returned values; after chunked_lm_loss, whose returned logits it may hang from.
    "detach_caches": (detach_caches, True),
    # Last: wraps what the other passes leave in one autocast region (opt-in: precision="bf16").
    "bf16_regions": (bf16_regions, False),
}


# Not in the ordered list: when `passes=` names it, the backend runs it on what the passes above
# leave, only if the budget is below the floor without it, and plans again (`microbatch_blocks`).
# Opt-in: exact, but under inductor its plans predict less than is measured.
MICROBATCH = "microbatch_blocks"


def default_passes() -> list[str]:
    """The exact passes, which run unless `passes=` names others."""
    return [n for n, (_, exact) in PASSES.items() if exact]


def check_pass_names(names: Sequence[str]) -> None:
    unknown = sorted(set(names) - set(PASSES) - {MICROBATCH}, key=repr)
    if unknown:
        raise ValueError(f"unknown pass(es) {unknown}; available: {sorted([*PASSES, MICROBATCH])}")


def run_passes(
    gm: fx.GraphModule, example_inputs: Sequence[Any], names: Sequence[str] | None
) -> tuple[fx.GraphModule, dict[str, int]]:
    """Run the named passes (None: every exact pass) in pipeline order."""
    if names is None:
        selected = default_passes()
    else:
        check_pass_names(names)
        selected = [n for n in PASSES if n in set(names)]
    fired: dict[str, int] = {}
    for name in selected:
        fn, _ = PASSES[name]
        gm, count = fn(gm, example_inputs)
        fired[name] = count
    return gm, fired

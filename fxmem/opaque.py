"""Opaque ops written into the graphs a fusing compiler (inductor) compiles.

`rows` copies rows of a tensor in an op inductor cannot see through, so the kernels reading the
copy read from the start of a buffer of their own rather than at an offset written into their
code: kernels that differed only in that offset become one. `row_chunks` copies a tensor's
rows chunk by chunk so, in one call. `seeds_from_buffers` reads each random op's seed through
`rows` (identical dropouts compile one kernel); `chunked_lm_loss` reads each chunk's targets,
and in the backward their log-sum-exps, through `row_chunks`. `addmm` adds a matmul to a
running sum in one library call that inductor cannot take apart, and `add` adds a value to one
(`cleanup.realize_running_sums`).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.flop_counter import mm_flop, register_flop_formula

from fxmem import _torch_private as tp

__all__ = ["add", "addmm", "row_chunks", "rows", "seeds_from_buffers"]


@torch.library.custom_op("fxmem::rows", mutates_args=())
def rows(x: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """A copy of rows start .. start + length of `x`, in a buffer of its own.

    An opaque op to a fusing compiler, so the kernels that read it read from the start of that
    buffer: read through a slice, the offset is written into each reader's code, and each
    offset compiles a kernel of its own where one serves them all.
    """
    return x.narrow(0, start, length).clone()


@rows.register_fake
def _(x, start, length):
    return x.new_empty((length, *x.shape[1:]))


@torch.library.custom_op("fxmem::row_chunks", mutates_args=())
def row_chunks(x: torch.Tensor, length: int) -> list[torch.Tensor]:
    """Copies of `x`'s rows in chunks of `length` (the last may be shorter), each in a buffer
    of its own: `rows` for every chunk of a loop in one call, where a call per chunk and per
    tensor cost the chunked loss 3 calls a chunk (13 us each on a CPU)."""
    return [chunk.clone() for chunk in x.split(length)]


@row_chunks.register_fake
def _(x, length):
    n = x.shape[0]
    return [x.new_empty((min(length, n - start), *x.shape[1:])) for start in range(0, n, length)]


@torch.library.custom_op("fxmem::addmm", mutates_args=())
def addmm(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`total + a @ b` as `torch.addmm`: one library call, which writes the new sum.

    A running sum over a loop of matmuls (the chunked loss's weight gradient) holds two sums
    alive at a time only while each step is an addmm. On a GPU inductor splits an addmm whose
    readers are all pointwise into its matmul and an add fused into those readers; the add
    then reads the addmm before it, which is split in turn, down the whole loop: every
    chunk's product is written on its own and one kernel sums them, as many at a time as it
    may read (HF GPT-2 small's (50257, 768) weight gradient: 13 products alive on a CPU with
    that split forced, 1.3 GiB over the plan). Opaque, the op cannot be split.
    """
    return torch.addmm(total, a, b)


@addmm.register_fake
def _(total, a, b):
    return total.new_empty((a.shape[0], b.shape[1]))


@register_flop_formula(torch.ops.fxmem.addmm)
def _(total_shape, a_shape, b_shape, *args, **kwargs) -> int:
    return mm_flop(a_shape, b_shape)


@torch.library.custom_op("fxmem::add", mutates_args=())
def add(total: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`total + x` in a buffer laid out as `total`, in one call a fusing compiler cannot take
    apart: a running sum written out as each term arrives, where fused its adds would be
    computed in the kernel that reads the sum, with every term alive until then."""
    return torch.add(total, x, out=torch.empty_like(total))


@add.register_fake
def _(total, x):
    return torch.empty_like(total)


def seeds_from_buffers(gm: fx.GraphModule) -> int:
    """Make each of inductor's random ops read its seed from a buffer of its own; returns how many.

    Inductor gives every random op of a graph an index into one tensor of seeds and writes that
    index into the op's kernel, so identical dropouts (one per layer, one per head group of a
    split attention) compile a kernel each that differs only in that number. Read through
    `rows`, the seed is an input like any other and one kernel serves them all. The values
    drawn are the same: each op still gets seed `index` of the same tensor. In the backward
    (a dropout drawn again where the plan recomputes it) the opaque read also ends the kernel
    before it, as the simulation has it (`inductor_lookup_seed` is not fusible there): read by
    index, the draw joined the recomputed softmax's kernel, which then held the scores, the
    random numbers, the softmax and the dropped-out weights at once.
    """
    graph = gm.graph
    lookups = graph.find_nodes(op="call_function", target=torch.ops.prims.inductor_lookup_seed.default)
    for node in lookups:
        seeds, index = node.args
        with graph.inserting_before(node):
            row = graph.call_function(torch.ops.fxmem.rows.default, (seeds, index, 1))
            seed = graph.call_function(torch.ops.aten.view.default, (row, []))
        row.meta = tp.meta_for(row, node)
        seed.meta = tp.meta_for(seed, node)
        node.replace_all_uses_with(seed)
        gm.graph.erase_node(node)
    if lookups:
        gm.recompile()
    return len(lookups)

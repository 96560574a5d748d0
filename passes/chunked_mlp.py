"""chunked_mlp: a transformer's MLP runs over chunks of rows.

Before (ViT, GPT; HF Llama/Mistral write the gated form, `down(act(gate(x)) * up(x))`)::

    y = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)          # (B, T, 4C) hidden values

After::

    y = torch.cat([F.linear(F.gelu(F.linear(x_c, w1, b1)), w2, b2)
                   for x_c in torch.chunk(x, n, dim=0)], dim=0)

Every row of an MLP is computed on its own, so each chunk is an MLP of its own: the planner
saves or recomputes it on its own, and the backward works one chunk at a time, so one chunk's
hidden values and their gradients are alive, not the whole layer's. That is most of a
block's backward at a low budget: the hidden values are `ratio` times the block's input,
their gradient as large again. Chunks are as few as make one chunk's hidden values no
larger than the MLP's input (at least ceil(hidden / C)), along the first dimension that has
that many entries, and keep at least `_MIN_ROWS` rows: on fewer the matmuls read their
weights more often than they work.

Exact: each row's two matmuls and activation are the same computation; the weights'
gradients are sums over the chunks of the same products, to float rounding. Fires where the
hidden width is at least `_MIN_RATIO` times the input's and something needs a gradient.
Runs before fuse_projections, which then fuses each chunk's gate and up projections.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fxmem.rules import Match, Refusal, Rule, RulePass

__all__ = ["chunked_mlp"]

_MIN_RATIO = 2  # hidden width over input width: below it the hidden values are not the peak
_MIN_ROWS = 64  # rows a chunk keeps at least
_ACTIVATIONS = {
    "gelu": lambda h, approximate: F.gelu(h, approximate=approximate),
    "relu": lambda h, approximate: F.relu(h),
    "silu": lambda h, approximate: F.silu(h),
}
_SCALARS = ("b1", "b2", "b3", "approximate")


# 1: fc2(act(fc1(x))) — ViT, GPT, BERT, OPT
def pattern_gelu(x, w1, b1, w2, b2, approximate):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate=approximate), w2, b2)


def pattern_relu(x, w1, b1, w2, b2):
    return F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)


def pattern_silu(x, w1, b1, w2, b2):
    return F.linear(F.silu(F.linear(x, w1, b1)), w2, b2)


# 2: down(act(gate(x)) * up(x)) — Llama, Mistral, Qwen2 (SiLU); Gemma (tanh GELU)
def pattern_gated_silu(x, w1, b1, w2, b2, w3, b3):
    return F.linear(F.silu(F.linear(x, w1, b1)) * F.linear(x, w3, b3), w2, b2)


def pattern_gated_gelu(x, w1, b1, w2, b2, w3, b3, approximate):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate=approximate) * F.linear(x, w3, b3), w2, b2)


def _replacement(act: str):
    activation = _ACTIVATIONS[act]

    def replacement(x, w1, b1, w2, b2, chunks, dim, w3=None, b3=None, approximate="none"):
        parts = torch.chunk(x, chunks, dim=dim)
        outs = []
        for c in range(chunks):
            part = parts[c]  # one node: fuse_projections groups the linears that read it
            hidden = activation(F.linear(part, w1, b1), approximate)
            if w3 is not None:
                hidden = hidden * F.linear(part, w3, b3)
            outs.append(F.linear(hidden, w2, b2))
        return torch.cat(outs, dim=dim)

    replacement.__name__ = f"chunked_{act}_mlp"
    return replacement


def guard(m: Match) -> Refusal | None:
    x, w1, w2 = m.val("x"), m.val("w1"), m.val("w2")
    if not all(isinstance(t, torch.Tensor) for t in (x, w1, w2)) or w1.ndim != 2 or w2.ndim != 2:
        return Refusal("the input is not a tensor or a weight is not 2-D")
    if x.ndim < 2:
        return Refusal("one row: nothing to split")
    if not all(isinstance(n, int) for n in x.shape):
        return Refusal("symbolic shapes: the chunks need sizes")
    hidden, width = w1.shape
    if hidden < _MIN_RATIO * width:
        return Refusal(f"hidden width {hidden} is under {_MIN_RATIO}x the input's {width}")
    w3 = m.val("w3") if "w3" in m.bindings else None
    if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in (x, w1, w2, w3)):
        return Refusal("nothing here needs a gradient: no backward to hold the hidden values")
    rows = x.numel() // x.shape[-1]
    wanted = min(math.ceil(hidden / width), rows // _MIN_ROWS)
    if wanted < 2:
        return Refusal(f"{rows} rows: too few for chunks of {_MIN_ROWS} rows or more")
    # the first dimension torch.chunk splits into the most chunks, up to `wanted`
    made = [_chunks_made(x.shape[d], wanted) for d in range(x.ndim - 1)]
    dim = made.index(max(made))
    chunks = made[dim]
    if chunks < 2:
        return Refusal(f"{rows} rows: too few for chunks of {_MIN_ROWS} rows or more")
    m.bindings["chunks"], m.bindings["dim"] = chunks, dim - x.ndim
    return None


def _chunks_made(size: int, wanted: int) -> int:
    """How many chunks `torch.chunk(t, wanted)` makes of a dimension of `size` (it makes
    chunks of ceil(size / wanted), so sometimes fewer than asked)."""
    return math.ceil(size / math.ceil(size / wanted)) if size >= wanted else size


chunked_mlp = RulePass(
    "chunked_mlp",
    [
        Rule("gelu", pattern_gelu, _replacement("gelu"), guard=guard, scalars=_SCALARS),
        Rule("relu", pattern_relu, _replacement("relu"), guard=guard, scalars=_SCALARS),
        Rule("silu", pattern_silu, _replacement("silu"), guard=guard, scalars=_SCALARS),
        Rule("gated_silu", pattern_gated_silu, _replacement("silu"), guard=guard, scalars=_SCALARS),
        Rule("gated_gelu", pattern_gated_gelu, _replacement("gelu"), guard=guard, scalars=_SCALARS),
    ],
)

"""chunked_attention: attention that keeps its (T, S) weights runs in groups of heads.

Where no fused SDPA kernel applies — on CPU with dropout, the usual case — SDPA makes the
whole (B, heads, T, S) weights, their dropout mask and, in the backward, their gradient. A
recomputed attention then holds several (B, heads, T, S) values at once in the backward,
which is most of a small model's lowest peak. Before::

    y = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=0.1)   # (B, H, T, S) weights

After::

    y = torch.cat([F.scaled_dot_product_attention(q_g, k_g, v_g, attn_mask=m_g, dropout_p=0.1)
                   for q_g, k_g, v_g, m_g in head groups], dim=-3)

Each group is an attention of its own: the planner saves or recomputes it on its own, and the
backward works one group at a time, so one group's weights are alive, not all of them.
Groups are as few as make one group's weights no larger than q (at least ceil(S / head_dim)
groups; a group holds whole key/value heads under GQA). Fires only where SDPA would run its
math form (asked of torch for a small probe of the same dtype, heads, mask kind and dropout);
the fused kernels keep no weights, and splitting their work would only slow them.

Hand-written attention that caps its scores with tanh before the softmax (Gemma 2, Grok)::

    att = torch.tanh(q @ k.transpose(-2, -1) * scale / cap) * cap + mask
    y = F.dropout(F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype), p) @ v

has no SDPA form (swap_sdpa leaves it), so on every device it makes, saves and differentiates
the whole weights, and the scores before and after the cap besides. Nor has ALiBi as BLOOM
writes it, a bias per head added by `baddbmm` with the heads flattened into the batch::

    att = alibi.baddbmm(q, k, beta=1.0, alpha=scale).view(B, heads, T, S) + mask   # q: (B * heads, T, D)
    y = torch.bmm(F.softmax(att, dim=-1).view(B * heads, T, S), v)

Both run in the same groups, each group the same hand-written computation (ALiBi's on the
group's (sequences, heads) unflattened and flattened again).

Exact: each head's scores, mask, softmax and weighted sum are the same computation; with
dropout each group draws its own mask (the same distribution, not the unsplit draw). A mask
shared by several groups gets its gradient as the sum of theirs: the same sum in another
order, equal to rounding.
Runs after swap_sdpa, whose SDPA calls it splits.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxmem.ops import static_shape
from fxmem.rules import Match, Refusal, Rule, RulePass

__all__ = ["chunked_attention"]

_SCALARS = ("mask", "p", "causal", "scale", "gqa")
_MATH = 0  # torch._fused_sdp_choice: SDPBackend.MATH
_PROBE_LEN = 8  # sequence length of the probe asked which kernel runs


def pattern(q, k, v, mask, p, causal, scale, gqa):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, scale=scale, enable_gqa=gqa
    )


def replacement(q, k, v, mask, p, causal, scale, gqa, groups, mask_split):
    def sdpa(q, k, v, mask):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, scale=scale, enable_gqa=gqa
        )

    return _in_groups(sdpa, (q, k, v), mask, groups, mask_split)


# Scores capped by tanh before the softmax (Gemma 2, Grok): no SDPA kernel computes this.
def pattern_softcap(q, k, v, scale, cap, mask, softmax_dtype, dtype, p, training):
    att = torch.tanh(torch.matmul(q, k.transpose(-2, -1)) * scale / cap) * cap + mask
    att = F.softmax(att, dim=-1, dtype=softmax_dtype).to(dtype)
    return torch.matmul(F.dropout(att, p=p, training=training), v)


def replacement_softcap(q, k, v, scale, cap, mask, softmax_dtype, dtype, p, training, groups, mask_split):
    def softcapped(q, k, v, mask):
        att = torch.tanh(torch.matmul(q, k.transpose(-2, -1)) * scale / cap) * cap + mask
        att = F.softmax(att, dim=-1, dtype=softmax_dtype)
        if dtype is not None:
            att = att.to(dtype)
        return torch.matmul(F.dropout(att, p=p, training=training), v)

    return _in_groups(softcapped, (q, k, v), mask, groups, mask_split)


# ALiBi (BLOOM): a per-head bias on the scores added by baddbmm, heads flattened into the batch.
def pattern_alibi(q, k, v, bias, beta, alpha, b, h, t, s, n, rows, cols, mask, softmax_dtype, dtype, p, training):
    att = bias.baddbmm(q, k, beta=beta, alpha=alpha).view(b, h, t, s) + mask
    att = F.softmax(att, dim=-1, dtype=softmax_dtype).to(dtype)
    return torch.bmm(F.dropout(att, p=p, training=training).view(n, rows, cols), v)


def replacement_alibi(
    q, k, v, bias, beta, alpha, b, h, t, s, mask, softmax_dtype, dtype, p, training, groups, mask_split
):
    rows, heads = b // groups[0], h // groups[1]  # one group's

    def alibi(q, k, v, bias, mask):  # (B, heads, ...) groups of the flat (B * heads, ...) tensors
        q, k, v, bias = (x.flatten(0, 1) for x in (q, k, v, bias))
        att = bias.baddbmm(q, k, beta=beta, alpha=alpha).view(rows, heads, t, s) + mask
        att = F.softmax(att, dim=-1, dtype=softmax_dtype)
        if dtype is not None:
            att = att.to(dtype)
        out = torch.bmm(F.dropout(att, p=p, training=training).flatten(0, 1), v)
        return out.view(rows, heads, t, -1)

    q, k, v, bias = (x.unflatten(0, (b, h)) for x in (q, k, v, bias))
    return _in_groups(alibi, (q, k, v, bias), mask, groups, mask_split).flatten(0, 1)


def _in_groups(attention, tensors, mask, groups, mask_split):
    """`attention(*tensors, mask)` over `groups[dim]` chunks of each (B, heads) dimension in
    turn, joined: each tensor is chunked along both, the mask where `mask_split` says."""

    def attend(tensors, mask, dim):
        if dim == len(groups):
            return attention(*tensors, mask)
        n, axis = groups[dim], dim - 4
        if n == 1:
            return attend(tensors, mask, dim + 1)
        parts = [torch.chunk(x, n, dim=dim) for x in tensors]
        masks = torch.chunk(mask, n, dim=axis) if mask_split[dim] else [mask] * n
        return torch.cat([attend([x[g] for x in parts], masks[g], dim + 1) for g in range(n)], dim=dim)

    return attend(tensors, mask, 0)


def _runs_math(q, k, v, mask, p, causal, scale, gqa) -> bool:
    """Whether SDPA picks its math form for tensors like these (a small real probe: the
    choice reads dtypes, head counts and sizes, the mask's kind and dropout, not T)."""

    def probe(t, heads):
        return torch.zeros(1, heads, _PROBE_LEN, t.shape[-1], dtype=t.dtype, requires_grad=t.requires_grad)

    pq, pk, pv = probe(q, q.shape[-3]), probe(k, k.shape[-3]), probe(v, v.shape[-3])
    pm = None
    if mask is not None:
        full = (1, q.shape[-3], _PROBE_LEN, _PROBE_LEN)[4 - mask.ndim :]
        shape = [1 if s == 1 else n for s, n in zip(mask.shape, full, strict=True)]
        pm = torch.zeros(shape, dtype=mask.dtype, requires_grad=mask.requires_grad)
    choice = torch._fused_sdp_choice(pq, pk, pv, pm, p, causal, scale=scale, enable_gqa=gqa)
    return int(choice) == _MATH


def guard(m: Match) -> Refusal | None:
    q, k, v = m.val("q"), m.val("k"), m.val("v")
    if isinstance(q, torch.Tensor) and q.device.type != "cpu":
        return Refusal(f"on {q.device.type} SDPA's fused kernels keep no (T, S) weights")
    shaped = _shapes(m)
    if shaped is not None:
        return shaped
    scalars = {name: m.bindings[name] for name in ("p", "causal", "scale", "gqa")}
    if not all(isinstance(x, (int, float, bool, type(None))) for x in scalars.values()):
        return Refusal("dropout, causality, scale or GQA is not a constant")
    if not _runs_math(q, k, v, m.val("mask"), **scalars):
        return Refusal("SDPA runs a fused kernel here: it keeps no (T, S) weights")
    return _groups(m, q.shape, k.shape[:2], k.shape[-2])


def guard_softcap(m: Match) -> Refusal | None:
    shaped = _shapes(m)
    if shaped is not None:
        return shaped
    scalars = [m.bindings[name] for name in ("scale", "cap", "p", "training", "softmax_dtype", "dtype")]
    if any(isinstance(x, fx.Node) for x in scalars):
        return Refusal("the scale, cap, dropout or dtypes are not constants")
    if not m.bindings["cap"]:
        return Refusal("a cap of 0")
    q, k = m.val("q"), m.val("k")
    if k.shape[-3] not in (1, q.shape[-3]):
        return Refusal("keys with other heads than the queries' (matmul broadcasts them)")
    return _groups(m, q.shape, k.shape[:2], k.shape[-2])


def guard_alibi(m: Match) -> Refusal | None:
    q, k, v, bias, mask = (m.val(name) for name in ("q", "k", "v", "bias", "mask"))
    if not all(isinstance(x, torch.Tensor) and x.ndim == 3 for x in (q, k, v, bias)):
        return Refusal("q, k, v and the bias are not 3-D (B * heads, ...)")
    if None in [static_shape(x) for x in (q, k, v, bias)]:
        return Refusal("symbolic shapes: the groups need sizes")
    if not isinstance(mask, torch.Tensor) or mask.ndim > 4 or static_shape(mask) is None:
        return Refusal("the mask is not a tensor of at most 4 static dimensions")
    names = ("beta", "alpha", "b", "h", "t", "s", "n", "rows", "cols", "p", "training", "softmax_dtype", "dtype")
    if any(isinstance(m.bindings[name], fx.Node) for name in names):
        return Refusal("the scale, shapes, dropout or dtypes are not constants")
    flat, length, keys = q.shape[0], q.shape[1], k.shape[-1]
    heads = _sizes([m.bindings[name] for name in ("b", "h", "t", "s")], flat * length * keys)
    weights = _sizes([m.bindings[name] for name in ("n", "rows", "cols")], flat * length * keys)
    if heads is None or heads[0] * heads[1] != flat or heads[2:] != [length, keys]:
        return Refusal(f"the scores are not viewed as (sequences, heads, {length}, {keys})")
    if weights != [flat, length, keys]:
        return Refusal(f"the weights are not viewed back as ({flat}, {length}, {keys})")
    if not all(x.shape[0] == flat for x in (k, v, bias)):
        return Refusal(f"q, k, v and the bias do not all hold {flat} heads")
    m.bindings.update(zip(("b", "h", "t", "s"), heads, strict=True))  # -1 resolved
    return _groups(m, (heads[0], heads[1], *q.shape[1:]), heads[:2], keys)


def _sizes(view: list, numel: int) -> list[int] | None:
    """The sizes `x.view(*view)` gives a tensor of `numel` elements (one -1 resolved), or None
    where they are not integers or do not fit."""
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= -1 for x in view) or view.count(-1) > 1:
        return None
    known = math.prod(x for x in view if x != -1)
    if -1 in view:
        if known == 0 or numel % known:
            return None
        view = [numel // known if x == -1 else x for x in view]
    return view if math.prod(view) == numel else None


def _shapes(m: Match) -> Refusal | None:
    """Whether q, k, v and the mask have the static (B, heads, T, head_dim) shapes groups need."""
    q, k, v = m.val("q"), m.val("k"), m.val("v")
    if not all(isinstance(t, torch.Tensor) and t.ndim == 4 for t in (q, k, v)):
        return Refusal("q, k, v are not 4-D (B, heads, T, head_dim)")
    if None in [static_shape(t) for t in (q, k, v)]:
        return Refusal("symbolic shapes: the groups need sizes")
    if v.shape[:2] != k.shape[:2]:
        return Refusal("values with other sequences or heads than the keys' (broadcast)")
    mask = m.val("mask")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.ndim > 4 or static_shape(mask) is None):
        return Refusal("the mask is not a tensor of at most 4 static dimensions")
    return None


def _groups(m: Match, q_shape, k_heads, length: int) -> Refusal | None:
    """Bind `groups` (sequences, heads) and `mask_split`: as few groups as keep one group's
    (T, S) weights no larger than q, whole key/value heads in each. `q_shape`: (B, heads, T,
    head_dim); `k_heads`: the keys' (B, heads); `length`: S."""
    mask = m.val("mask")
    (batch, heads, _, width), (k_batch, kv_heads) = q_shape, k_heads
    wanted = math.ceil(length / width)
    if wanted < 2:
        return Refusal(f"{length} keys of width {width}: the weights are no larger than q")
    by_heads = _divisor_at_least(kv_heads, wanted)
    by_batch = _divisor_at_least(batch, math.ceil(wanted / by_heads)) if k_batch == batch else 1
    if by_heads * by_batch < 2:
        return Refusal("one head of one sequence: nothing to split")
    m.bindings["groups"] = (by_batch, by_heads)
    m.bindings["mask_split"] = tuple(
        mask is not None and mask.ndim >= 4 - dim and mask.shape[dim - 4] == size > 1
        for dim, size in enumerate((batch, heads))
    )
    return None


def _divisor_at_least(n: int, wanted: int) -> int:
    """The smallest divisor of n that is at least `wanted`, or n."""
    return next((d for d in range(1, n + 1) if n % d == 0 and d >= wanted), n)


chunked_attention = RulePass(
    "chunked_attention",
    [
        Rule("sdpa", pattern, replacement, guard=guard, scalars=_SCALARS),
        Rule(
            "softcap",
            pattern_softcap,
            replacement_softcap,
            guard=guard_softcap,
            scalars=("scale", "cap", "softmax_dtype", "dtype", "p", "training"),
            optional=("dropout", "to"),
            absent={"p": 0.0, "training": False, "dtype": None},
        ),
        Rule(
            "alibi",
            pattern_alibi,
            replacement_alibi,
            guard=guard_alibi,
            scalars=(
                "beta",
                "alpha",
                "b",
                "h",
                "t",
                "s",
                "n",
                "rows",
                "cols",
                "softmax_dtype",
                "dtype",
                "p",
                "training",
            ),
            optional=("dropout", "to"),
            absent={"p": 0.0, "training": False, "dtype": None},
        ),
    ],
)

"""swap_sdpa: hand-written attention becomes `F.scaled_dot_product_attention`.

Before (nanoGPT)::

    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))   # (B, nh, T, T)
    att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
    att = self.attn_dropout(F.softmax(att, dim=-1))
    y = att @ v                                                        # (B, nh, T, hs)

After::

    y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, :, :T, :T] != 0,
                                       dropout_p=p if training else 0.0, scale=...)

The fused kernels keep no (B, nh, T, T) weights for the backward — only a (B, nh, T)
log-sum-exp — which is most of the activation memory of attention at long sequence lengths.
Runs first among the passes: the rules below read the graph as the model author wrote it.

Exact: the same scores, mask, softmax and weighted sum, to float rounding. Masks keep their
meaning — a boolean "masked" fill with -inf becomes a boolean "attend" mask, a finite fill
(`finfo.min`) an additive one, and additive masks pass through. A fill that would not drop the
score (0, -1e4: masked_fill replaces scores, an additive mask shifts them) is refused. Where a
finite mask drops every key of a row (left padding under a causal mask), eager's softmax is
uniform over the row, and SDPA's fused kernels give other outputs or gradients (CPU's; CUDA's
memory-efficient and cuDNN kernels, measured on an H200 with torch 2.11). A finite mask that
comes with the batch (an HF `attention_mask`) may do so on any step: SDPA then runs with those
rows attending to every key, and eager's result replaces them, computed without (T, T) weights
(`_dropped_rows`); with attention dropout it is refused. So does one made from module buffers
and shapes that drops a row whole; one that keeps a key in every row runs as SDPA alone, and
the compiled step checks that again whenever one of its buffers changes. An additive mask
that needs a gradient and can drop a row whole is refused (those rows pass it none). A row a
-inf mask drops whole is NaN in eager's softmax and 0 in SDPA's: a -inf mask is taken as it
is, such rows being a model's error rather than its padding.
GQA's `repeat_kv` is undone and
`enable_gqa=True` set, so the repeated keys and values are not materialised — unless that would
leave torch no fused kernel where the repeated ones have one (CUDA in fp32: only flash attention
takes grouped heads, in half precision), then the repeat stays. With dropout the
kernel draws its own mask (the same distribution, not eager's draw); the planner never
recomputes random ops, so the backward sees the forward's mask. Does not fire when the weights
escape (`output_attentions=True`): they would have to be materialised anyway.

A mask made only from module buffers and shapes (nanoGPT's `bias` buffer, a mask built from
`arange` or `triu` of the sequence length) is a fact about the model: when it is exactly the
causal pattern, SDPA runs with `is_causal=True` and no (T, T) mask tensor is made at all (the
kernels also skip the blocks it would drop). Buffers can still change, so the compiled step
checks the ones the mask was made from before every call (addresses and version counters; the
mask is evaluated again only when one changed) and raises rather than run a wrong rewrite
(see `fxmem.constants`). A mask that arrives with the batch is never assumed causal.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxmem import _torch_private, constants
from fxmem.ops import example_value, op_key, static_int, storage_of, storages_written
from fxmem.rules import Match, Refusal, Rule, RulePass

__all__ = ["swap_sdpa"]

_SCALARS = ("scale", "fill", "softmax_dtype", "p", "training", "dtype")
_OPTIONAL = ("dropout", "to")
_ABSENT = {"p": 0.0, "training": False, "dtype": None}


# 1: nanoGPT — scale by multiply, masked_fill with -inf, softmax, dropout.
def pattern_1(q, k, v, scale, mask, fill, softmax_dtype, dtype, p, training):
    att = (q @ k.transpose(-2, -1)) * scale
    att = att.masked_fill(mask, fill)
    att = F.softmax(att, dim=-1, dtype=softmax_dtype).to(dtype)
    return F.dropout(att, p=p, training=training) @ v


def replacement_1(q, k, v, scale, mask, fill, p, training, gqa, causal, padded=False):
    dropped = mask if padded else None
    return _sdpa(q, k, v, _not_masked(mask, fill), _inverse(scale, False), p, training, gqa, causal, dropped, padded)


# 2: as 1 with the scale divided in (`att / math.sqrt(hs)`, GPT-2 research code).
def pattern_2(q, k, v, scale, mask, fill, softmax_dtype, dtype, p, training):
    att = (q @ k.transpose(-2, -1)) / scale
    att = att.masked_fill(mask, fill)
    att = F.softmax(att, dim=-1, dtype=softmax_dtype).to(dtype)
    return F.dropout(att, p=p, training=training) @ v


def replacement_2(q, k, v, scale, mask, fill, p, training, gqa, causal, padded=False):
    dropped = mask if padded else None
    return _sdpa(q, k, v, _not_masked(mask, fill), _inverse(scale, True), p, training, gqa, causal, dropped, padded)


# 3: HF Llama / GPT-2 / BERT eager — scale by multiply, additive 4-D mask, softmax in fp32 cast back.
def pattern_3(q, k, v, scale, mask, softmax_dtype, dtype, p, training):
    att = torch.matmul(q, k.transpose(-2, -1)) * scale + mask
    att = F.softmax(att, dim=-1, dtype=softmax_dtype).to(dtype)
    return torch.matmul(F.dropout(att, p=p, training=training), v)


def replacement_3(q, k, v, scale, mask, p, training, gqa, causal, padded=False, drop_below=None):
    dropped = mask <= drop_below if padded else None
    return _sdpa(q, k, v, mask, _inverse(scale, False), p, training, gqa, causal, dropped, padded, mask)


# 4: as 3 with the scale divided in (older HF BERT: `scores / math.sqrt(head_size) + mask`).
def pattern_4(q, k, v, scale, mask, softmax_dtype, dtype, p, training):
    att = torch.matmul(q, k.transpose(-2, -1)) / scale + mask
    att = F.softmax(att, dim=-1, dtype=softmax_dtype).to(dtype)
    return torch.matmul(F.dropout(att, p=p, training=training), v)


def replacement_4(q, k, v, scale, mask, p, training, gqa, causal, padded=False, drop_below=None):
    dropped = mask <= drop_below if padded else None
    return _sdpa(q, k, v, mask, _inverse(scale, True), p, training, gqa, causal, dropped, padded, mask)


# 5: `torch.where(causal, scores, min)` (HF GPT-2 before the 4-D masks, GPT-J, CodeGen).
def pattern_5(q, k, v, scale, mask, fill, softmax_dtype, dtype, p, training):
    att = torch.where(mask, torch.matmul(q, k.transpose(-2, -1)) * scale, fill)
    att = F.softmax(att, dim=-1, dtype=softmax_dtype).to(dtype)
    return torch.matmul(F.dropout(att, p=p, training=training), v)


def replacement_5(q, k, v, scale, mask, fill, p, training, gqa, causal, padded=False):
    dropped = torch.logical_not(mask) if padded else None
    return _sdpa(q, k, v, _attend(mask, fill), _inverse(scale, False), p, training, gqa, causal, dropped, padded)


# 6: no mask (HF BERT eager without padding, ViT, encoder blocks).
def pattern_6(q, k, v, scale, softmax_dtype, dtype, p, training):
    att = torch.matmul(q, k.transpose(-2, -1)) * scale
    att = F.softmax(att, dim=-1, dtype=softmax_dtype).to(dtype)
    return torch.matmul(F.dropout(att, p=p, training=training), v)


def replacement_6(q, k, v, scale, p, training, gqa):
    return _sdpa(q, k, v, None, _inverse(scale, False), p, training, gqa)


# 7: as 6 with the scale divided in.
def pattern_7(q, k, v, scale, softmax_dtype, dtype, p, training):
    att = torch.matmul(q, k.transpose(-2, -1)) / scale
    att = F.softmax(att, dim=-1, dtype=softmax_dtype).to(dtype)
    return torch.matmul(F.dropout(att, p=p, training=training), v)


def replacement_7(q, k, v, scale, p, training, gqa):
    return _sdpa(q, k, v, None, _inverse(scale, True), p, training, gqa)


# --- replacement helpers (run with proxies: they branch on numbers, never on tensors) ----------


def _sdpa(q, k, v, mask, scale, p, training, gqa, causal=False, dropped=None, padded=None, additive=None):
    """SDPA; with `dropped` (which keys a finite mask that can drop whole rows drops) and the
    guard's `padded` (heads per key head, keys), eager's attention on the rows that drop every
    key (`_dropped_rows`). `additive`: the additive mask `dropped` was read from."""
    if gqa is not None:
        k, v = gqa
    rows = None if dropped is None else dropped.all(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask if rows is None else torch.where(rows, 0.0, mask),  # those rows: every key, finite
        dropout_p=float(p) if training else 0.0,
        is_causal=causal,
        scale=scale,
        enable_gqa=gqa is not None,
    )
    return out if rows is None else _dropped_rows(out, q, k, v, scale, rows, *padded, additive)


def _dropped_rows(out, q, k, v, scale, rows, n, t, wide, additive):
    """`out` (SDPA's) on the rows the mask keeps a key of; eager's attention on `rows`, which it
    drops whole: `n` heads per key head, `t` keys; `wide`, the dtype the added mask's gradient
    terms are computed in (None: q's).

    There every score is replaced by the fill (masked_fill, where) or plus the mask rounds to it
    (an `additive` mask of finfo.min), so eager's softmax is uniform and the row's output is the
    mean of the values; SDPA's fused kernels give another (CPU's; CUDA's memory-efficient and
    cuDNN kernels). A fill passes the scores no gradient. An added mask passes it on, and the
    gradient is the softmax's at uniform weights, d out_i / d s_ij = (v_j - mean v) / t: the
    same comes from (x - sg(x)) terms, which are 0 and carry the gradient, with s_ij = scale
    q_i . k_j, sum_j s_ij v_j / t = scale q_i (K^T V) / t and sum_j s_ij / t = scale q_i . mean k;
    nothing (t, t) is made. A row of an additive mask that drops every key with entries not all
    equal is not uniform in eager's softmax: it gives NaN rather than a wrong number. Eager gives
    NaN for such a row of -inf too, but where -inf sits beside finfo.min (a causal -inf mask
    added to a padding mask of finfo.min) eager's softmax is uniform over the finfo.min keys,
    which this does not compute: NaN there as well. K^T V has no bound eager's attention keeps
    under (eager never forms it): in fp16 it can overflow where eager's scores and outputs do not,
    and the terms, 0 in value, would be NaN, so fp16 computes them in fp32.
    """
    v_mean = v.mean(dim=-2, keepdim=True)
    if n > 1:  # grouped heads
        v_mean = v_mean.repeat_interleave(n, dim=1)
    uniform = v_mean
    if additive is not None:
        if wide is not None:
            q, k, v = q.to(wide), k.to(wide), v.to(wide)
        kv = torch.matmul(k.transpose(-2, -1), v.detach())  # (B, key heads, D, Dv)
        k_mean = k.mean(dim=-2, keepdim=True)
        if n > 1:
            kv, k_mean = kv.repeat_interleave(n, dim=1), k_mean.repeat_interleave(n, dim=1)
        along = torch.matmul(q, kv) * (scale / t)
        centre = (q * k_mean).sum(dim=-1, keepdim=True) * scale
        uniform = uniform + (along - along.detach()) - (centre - centre.detach()) * v_mean.detach()
        top = additive.amax(dim=-1, keepdim=True)
        uneven = (top != additive.amin(dim=-1, keepdim=True)) | (top == float("-inf"))  # eager: NaN too
        uniform = torch.where(uneven, float("nan"), uniform)
    return torch.where(rows, uniform.to(out.dtype), out)


def _inverse(scale, divided: bool) -> float:
    return 1.0 / scale if divided else scale


def _not_masked(mask, fill):
    """masked_fill(mask, fill) as an SDPA mask: -inf drops, a finite fill adds itself."""
    if mask is None:  # causal: SDPA's is_causal stands for it
        return None
    if fill == float("-inf"):
        return torch.logical_not(mask)
    return torch.where(mask, fill, 0.0)


def _attend(mask, fill):
    """where(mask, scores, fill) as an SDPA mask."""
    if mask is None:  # causal: SDPA's is_causal stands for it
        return None
    if fill == float("-inf"):
        return mask
    return torch.where(mask, 0.0, fill)


# --- the guard shared by every rule -------------------------------------------------------------


def _scalar(value):
    """A number, or a 0-d `torch.full`/`torch.tensor` node of a number (HF's mask and scale
    values) as its dtype holds it (a scale of 11.3137 made in bf16 divides by 11.3125)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not (isinstance(value, fx.Node) and value.op == "call_function"):
        return None
    if value.target is torch.full and tuple(value.args[0]) == () and isinstance(value.args[1], (int, float)):
        number = value.args[1]
    elif value.target is torch.tensor and isinstance(value.args[0], (int, float)):
        number = value.args[0]
    else:
        return None
    return float(torch.tensor(number, dtype=value.kwargs.get("dtype")).item())


def _unrepeat(kv: fx.Node) -> tuple[fx.Node, int] | None:
    """HF's repeat_kv: x[:, :, None, :, :].expand(b, h_kv, n, t, d).reshape(b, h_kv * n, t, d) -> (x, n)."""
    if op_key(kv) != "reshape" or len(kv.users) != 1:
        return None
    expand = kv.args[0]
    if not isinstance(expand, fx.Node) or op_key(expand) != "expand" or len(expand.users) != 1:
        return None
    index = expand.args[0]
    if not isinstance(index, fx.Node) or op_key(index) != "getitem" or len(index.users) != 1:
        return None
    base, key = index.args
    if not (isinstance(key, tuple) and len(key) == 5 and key[2] is None):
        return None
    if any(k != slice(None) for i, k in enumerate(key) if i != 2):
        return None
    b, h_kv, t, d = example_value(base).shape
    shape = example_value(kv).shape
    if len(shape) != 4 or shape[1] % h_kv or (shape[0], shape[2], shape[3]) != (b, t, d):
        return None  # not (b, h_kv * n, t, d): the heads are not each key head's n copies
    return base, shape[1] // h_kv


def _any_row_dropped(mask: torch.Tensor, masked: bool) -> bool:
    """Whether `mask` drops every key of some row: where it is True (`masked`) or False (a
    keep-mask), or, additive, at most half of the most negative finite value."""
    if mask.dtype == torch.bool:
        dropped = mask if masked else ~mask
    else:
        dropped = mask <= torch.finfo(mask.dtype).min / 2
    return bool(dropped.all(dim=-1).any())


def _check_rows_kept(m: Match, folded: tuple, masked: bool) -> None:
    """The buffers a finite mask is made from (`folded`: `constants.fold`'s) may change later:
    the compiled step checks before every call that the mask still keeps a key in every row."""
    _, evaluate, positions = folded

    def holds(args) -> bool:
        return not _any_row_dropped(evaluate(args), masked)

    constants.register_check(
        m.output, constants.BufferCheck(positions, holds, "a finite attention mask that keeps a key in every row")
    )


def guard(m: Match, masked: bool = False) -> Refusal | None:
    """`masked`: the rule's boolean mask marks what to drop (masked_fill), not what to keep."""
    q, k, v = m.val("q"), m.val("k"), m.val("v")
    if not all(isinstance(t, torch.Tensor) and t.ndim == 4 for t in (q, k, v)):
        return Refusal("q, k, v are not 4-D (B, heads, T, head_dim)")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        return Refusal(f"q/k/v dtypes differ or are not floating: {q.dtype}, {k.dtype}, {v.dtype}")
    softmax_dtype, out_dtype = m.bindings.get("softmax_dtype"), m.bindings.get("dtype")
    if softmax_dtype not in (None, torch.float32) or out_dtype not in (None, q.dtype):
        return Refusal(f"softmax in {softmax_dtype} cast to {out_dtype}: not attention in {q.dtype}")
    if softmax_dtype == torch.float32 and out_dtype is None and q.dtype != torch.float32:
        return Refusal("the fp32 softmax is not cast back: the weights stay fp32")
    scale = _scalar(m.bindings["scale"])
    if scale is None or scale == 0:
        return Refusal(f"the scale is not a constant number ({m.bindings['scale']})")
    m.bindings["scale"] = scale
    if "fill" in m.bindings:
        fill = _scalar(m.bindings["fill"])
        if fill is None:
            return Refusal("the mask fill value is not a constant number")
        if fill != float("-inf") and fill > torch.finfo(q.dtype).min / 2:
            # A fill replaces the score; as an SDPA mask it would be added to it: the same
            # only where the sum rounds to the fill (finfo.min) or it is -inf.
            return Refusal(f"the mask fill {fill} replaces scores, which an additive mask cannot")
        m.bindings["fill"] = fill
    if storage_of(m.output) in storages_written(m.output.graph):  # made by the match: written after it
        # Eager's matmul saves its inputs; SDPA's backward reads its own output as well.
        return Refusal("the attention's output is written in place later")
    mask = m.val("mask") if "mask" in m.bindings else None
    folded = None  # the mask's value when made from module buffers and shapes (`constants.fold`)
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            return Refusal("the mask is not a tensor")
        scores = (*q.shape[:-1], k.shape[-2])
        # (The graph traced, so the mask broadcasts with the scores: the question is whether it enlarges them.)
        if not 2 <= mask.ndim <= 4 or torch.broadcast_shapes(mask.shape, scores) != torch.Size(scores):
            return Refusal(f"the mask's shape {tuple(mask.shape)} does not broadcast to the scores' {scores}")
        wants_bool = "fill" in m.bindings
        if wants_bool != (mask.dtype == torch.bool):
            return Refusal(f"mask dtype {mask.dtype} does not suit this rule")
        if not wants_bool and mask.dtype != q.dtype:
            return Refusal(f"additive mask dtype {mask.dtype} differs from q's {q.dtype}")
        finite = not wants_bool or m.bindings["fill"] != float("-inf")
        folded = constants.fold(m.bindings["mask"])
        # From the batch (not folded), any row may drop every key; a folded mask is evaluated.
        drops = finite and (folded is None or _any_row_dropped(folded[0], masked))
        if drops:  # those rows are computed apart (`_dropped_rows`)
            if m.bindings.get("training") and float(m.bindings.get("p") or 0.0) > 0:
                return Refusal(
                    "a finite mask that can drop every key of a row (an HF attention_mask with left "
                    "padding), with attention dropout: those rows would need eager's dropout of uniform weights"
                )
            if not wants_bool and mask.requires_grad:
                return Refusal(
                    "an additive mask that needs a gradient and can drop every key of a row: those rows, "
                    "computed apart, pass the mask none"
                )
            m.bindings["padded"] = True
            if not wants_bool:
                m.bindings["drop_below"] = torch.finfo(mask.dtype).min / 2
    m.bindings["causal"] = folded is not None and _causal_mask(m, folded, q, k, masked)
    if folded is not None and finite and not m.bindings["causal"] and not m.bindings.get("padded"):
        _check_rows_kept(m, folded, masked)  # a buffer mask that keeps a key in every row (causal: the diagonal)
    if m.bindings["causal"]:  # no mask tensor; the node stays bound so the rewrite erases it
        m.bindings["folded_mask"], m.bindings["mask"] = m.bindings["mask"], None
    m.bindings["gqa"] = None
    ks, vs = _unrepeat(m.bindings["k"]), _unrepeat(m.bindings["v"])
    repeated = ks is not None and vs is not None and ks[1] == vs[1] and ks[1] > 1
    if repeated and _grouped_stays_fused(m, q, example_value(ks[0]), example_value(vs[0])):
        m.bindings["gqa"] = (ks[0], vs[0])
    if m.bindings.get("padded"):  # heads per key head, keys and the wide dtype, for `_dropped_rows`
        keys = static_int(k.shape[-2])
        if keys is None:
            return Refusal("a finite mask from the batch with a symbolic number of keys")
        wide = torch.float32 if q.dtype == torch.float16 else None
        m.bindings["padded"] = (ks[1] if m.bindings["gqa"] is not None else 1, keys, wide)
    return None


def _grouped_stays_fused(m: Match, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether SDPA with `enable_gqa=True` and the keys and values unrepeated (`k`, `v`) keeps a fused
    kernel wherever the repeated ones would have one. On CUDA only flash attention takes grouped
    heads, and only in half precision: in fp32 `enable_gqa` falls back to the math kernel, which
    keeps the (B, heads, T, T) weights for the backward, while the repeated keys and values run
    the memory-efficient kernel. Asked of torch's own dispatch, on small real tensors of the
    same device, dtypes, heads and head size."""
    if q.device.type == "meta":
        return True
    mask = m.val("mask") if m.bindings.get("mask") is not None else None
    fill = m.bindings.get("fill")
    dropout = float(m.bindings.get("p") or 0.0) if m.bindings.get("training") else 0.0
    t, n, grad = 64, q.shape[1], q.requires_grad or k.requires_grad
    with _torch_private.real_tensors():

        def like(x: torch.Tensor, heads: int) -> torch.Tensor:
            return torch.zeros(1, heads, t, x.shape[-1], dtype=x.dtype, device=x.device, requires_grad=grad)

        kwargs = {"dropout_p": dropout, "is_causal": bool(m.bindings["causal"])}
        if mask is not None:
            bool_mask = mask.dtype == torch.bool and (fill is None or fill == float("-inf"))
            kwargs["attn_mask"] = torch.zeros(
                (1,) * (mask.ndim - 2) + (t, t), dtype=torch.bool if bool_mask else q.dtype, device=q.device
            )
        qs = like(q, n)
        grouped = _torch_private.sdpa_backend(qs, like(k, k.shape[1]), like(v, v.shape[1]), enable_gqa=True, **kwargs)
        whole = _torch_private.sdpa_backend(qs, like(k, n), like(v, n), **kwargs)
    math = type(grouped).MATH
    return not (grouped == math and whole != math)


def _attends(mask: torch.Tensor, rule_fill: float | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Where a folded mask lets a query see a key (True), or None where it does more than
    drop: a finite fill or additive value above `finfo.min / 2` shifts scores rather than
    removing them."""
    drop = torch.finfo(dtype).min / 2
    if rule_fill is not None:  # a boolean mask with a fill value
        return None if rule_fill > drop else mask
    if not mask.is_floating_point():
        return None
    kept = mask == 0
    return kept if bool(((mask <= drop) | kept).all()) else None


def _is_causal(mask: torch.Tensor, masked: bool, fill: float | None, dtype: torch.dtype, t: int) -> bool:
    """Whether `mask` (broadcast over batch and heads) is the (t, t) causal pattern."""
    if mask.ndim < 2 or tuple(mask.shape[-2:]) != (t, t):
        return False
    attend = _attends(~mask if masked else mask, fill, dtype)
    return attend is not None and bool(
        (attend == torch.ones(t, t, dtype=torch.bool, device=attend.device).tril()).all()
    )


def _causal_mask(m: Match, folded: tuple, q: torch.Tensor, k: torch.Tensor, masked: bool) -> bool:
    """Whether the mask, a fact about the model (`folded`: `constants.fold`'s, made from module
    buffers and shapes), says exactly "causal": then SDPA runs with `is_causal=True` and no mask
    tensor is made. The buffers may change later, so the compiled step checks them before every
    call."""
    t = static_int(q.shape[-2])
    if t is None or static_int(k.shape[-2]) != t:
        return False
    value, evaluate, positions = folded
    fill = m.bindings.get("fill")
    dtype = q.dtype

    def holds(args) -> bool:
        return _is_causal(evaluate(args), masked, fill, dtype, t)

    if not _is_causal(value.to(q.device), masked, fill, dtype, t):
        return False
    constants.register_check(m.output, constants.BufferCheck(positions, holds, "a causal attention mask"))
    return True


_RULES = [
    Rule(
        f"attention_{i}",
        pat,
        rep,
        guard=functools.partial(guard, masked=i in (1, 2)),
        scalars=_SCALARS,
        optional=_OPTIONAL,
        absent=_ABSENT,
    )
    for i, (pat, rep) in enumerate(
        [
            (pattern_1, replacement_1),
            (pattern_2, replacement_2),
            (pattern_3, replacement_3),
            (pattern_4, replacement_4),
            (pattern_5, replacement_5),
            (pattern_6, replacement_6),
            (pattern_7, replacement_7),
        ],
        start=1,
    )
]

swap_sdpa = RulePass("swap_sdpa", _RULES)

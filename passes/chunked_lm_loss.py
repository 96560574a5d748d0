"""chunked_lm_loss: the LM head and cross-entropy run over chunks of rows.

Before (nanoGPT; HF `*ForCausalLM` with `ForCausalLMLoss`)::

    logits = F.linear(h, w_vocab)                                    # (B, T, V)
    loss = F.cross_entropy(logits.float().view(-1, V), y.view(-1), ignore_index=-100)

After::

    loss = chunked_cross_entropy(h, w_vocab, None, y, ignore_index=-100, reduction="mean", rows=...)

Heads that do one more thing to their logits before the loss are chunked with it: a scale
(Cohere's `logits * logit_scale`, Granite's `logits / logits_scaling`), a soft cap (Gemma 2's
`tanh(logits / c) * c`), each by a number, and a bias buffer added (BART's
`final_logits_bias`, folded into the head's bias). Each chunk applies it to its logits and
takes its gradient back through it.

Each chunk of rows forms its logits, its log-sum-exp, its loss and — in the forward, at once —
its gradient with respect to `h` and `w_vocab` (softmax minus one-hot, times the chunk's
inputs), so neither the (B*T, V) logits nor their log-softmax nor their gradient is ever
whole in memory; the backward only scales the gradients it was handed by the loss's
gradient. The planner sees the chunk loop as ordinary forward ops: it keeps the gradients,
or, under memory pressure, runs the loop again in the backward, chunk by chunk. When the logits
are also returned (HF models return them beside the loss), they are computed once and each
chunk reads its rows of them. Logits the graph only returns leave the compiled step without a
gradient, `h` (and `w`, `b`) beside them, and an output hook (`fxmem.outputs`) gives them their
gradient again outside the step. They are not saved for the backward, which forms each
chunk's logits again from `h` (one more pass of the head's matmul) and reads nothing the caller
holds: a step that keeps only the loss (`model(**batch).loss.backward()`) frees them when the
forward ends, edits to them cannot reach the gradients, and a backward of the loss alone
runs nothing for them, where a compiled step's backward would receive a tensor of zeros as
large as the logits (HF GPT-2 small, 8 x 1024 tokens: 1.5 GiB). Logits the graph reads again,
or makes in a no_grad region, take whatever gradient the caller sends inside the step, whose
backward then works chunk by chunk from the saved logits. The logits so returned are a view
made by that function: edited in place while grad is on, they raise autograd's error for such
views (clone them first).

Exact: the same log-sum-exp and picked logit per row, summed in chunks, to float rounding;
`ignore_index` rows count neither in the sum nor in the mean's denominator. Fires when the
vocabulary is at least `_MIN_VOCAB_RATIO` times the hidden size (below that the logits are no
larger than the activations around them). Runs last: it reads the head the other passes leave.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fxmem.opaque import addmm as opaque_addmm
from fxmem.opaque import row_chunks
from fxmem.ops import example_value, op_key, static_shape
from fxmem.outputs import output_values, return_outside
from fxmem.rules import Match, Refusal, Rule, RulePass, call_leaf

__all__ = ["chunked_cross_entropy", "chunked_lm_loss"]

_MIN_VOCAB_RATIO = 4
# Chunks: as many as make one chunk's logits about the size of the head's input h, at most
# _MAX_CHUNKS, and of at least hidden/2 rows: every chunk reads the (V, H) weight twice and
# writes into its gradient once, so with fewer rows the weight's traffic outweighs the chunk's
# own work (CPU, GPT of d192, V 8192, 1536 rows: 32 chunks of 48 rows 0.556 s a step, 16 of 96
# rows 0.493 s, the same floor).
_MAX_CHUNKS = 32
_SCALARS = ("b", "rows", "vocab", "weight", "ignore_index", "reduction", "label_smoothing", "e")


# 1: nanoGPT / HF ForCausalLMLoss — linear head, optional fp32 upcast, flatten, cross-entropy.
def pattern_1(h, w, b, y, rows, vocab, weight, ignore_index, reduction, label_smoothing):
    logits = F.linear(h, w, b).float().view(rows, vocab)
    return F.cross_entropy(logits, y, weight, None, ignore_index, None, reduction, label_smoothing)


# 2: as 1, flattened with reshape.
def pattern_2(h, w, b, y, rows, vocab, weight, ignore_index, reduction, label_smoothing):
    logits = F.linear(h, w, b).float().reshape(rows, vocab)
    return F.cross_entropy(logits, y, weight, None, ignore_index, None, reduction, label_smoothing)


# 3: HF Cohere — the logits scaled (`logits * self.logit_scale`).
def pattern_3(h, w, b, y, rows, vocab, weight, ignore_index, reduction, label_smoothing, e):
    logits = (F.linear(h, w, b) * e).float().view(rows, vocab)
    return F.cross_entropy(logits, y, weight, None, ignore_index, None, reduction, label_smoothing)


# 4: HF Granite — the logits divided (`logits / self.config.logits_scaling`).
def pattern_4(h, w, b, y, rows, vocab, weight, ignore_index, reduction, label_smoothing, e):
    logits = (F.linear(h, w, b) / e).float().view(rows, vocab)
    return F.cross_entropy(logits, y, weight, None, ignore_index, None, reduction, label_smoothing)


# 5: HF Gemma 2 / Gemma 3 — the logits capped softly (`final_logit_softcapping`).
def pattern_5(h, w, b, y, rows, vocab, weight, ignore_index, reduction, label_smoothing, e):
    logits = (torch.tanh(F.linear(h, w, b) / e) * e).float().view(rows, vocab)
    return F.cross_entropy(logits, y, weight, None, ignore_index, None, reduction, label_smoothing)


# 6: HF BART / mBART / Pegasus — a bias buffer added to the logits (`final_logits_bias`).
def pattern_6(h, w, b, y, rows, vocab, weight, ignore_index, reduction, label_smoothing, e):
    logits = (F.linear(h, w, b) + e).float().view(rows, vocab)
    return F.cross_entropy(logits, y, weight, None, ignore_index, None, reduction, label_smoothing)


def replacement(h, w, b, y, ignore_index, reduction, chunk_rows, return_logits, logits_grad, epilogue=None, bias=None):
    if bias is not None:  # pattern 6: the added bias is the head's
        b = bias.reshape(-1) if b is None else b + bias.reshape(-1)
    out = call_leaf(
        chunked_cross_entropy, h, w, b, y, ignore_index, reduction, chunk_rows, return_logits, logits_grad, epilogue
    )
    return (out[0], out[1]) if return_logits else (out,)


def _guard(epilogue: str | None, logits: str) -> Callable[[Match], Refusal | None]:
    """The guard of a rule whose logits are the pattern node `logits`, made from the head's
    output by `epilogue` ("mul", "div", "softcap" by the number `e`; "bias": `e` added)."""

    def guard(m: Match) -> Refusal | None:
        refused = _epilogue_refused(m, epilogue)  # a Refusal is falsy: no `or` here
        return _head_refused(m, logits) if refused is None else refused

    return guard


def _epilogue_refused(m: Match, epilogue: str | None) -> Refusal | None:
    if epilogue is None:
        return None
    e = m.bindings["e"]
    if epilogue == "bias":
        bias, w = m.val("e"), m.val("w")
        vocab = w.shape[0] if isinstance(w, torch.Tensor) and w.ndim == 2 else None
        if not isinstance(bias, torch.Tensor) or bias.shape[-1:] != (vocab,) or bias.numel() != vocab:
            return Refusal("what is added to the logits is not one bias per word")
        if bias.dtype != w.dtype or bias.device != w.device:
            return Refusal("the bias added to the logits is not of the head's dtype and device")
        linear, added = (next(n for n in m.nodes if op_key(n) == k) for k in ("linear", "add"))
        if example_value(added).dtype != example_value(linear).dtype:
            # Under autocast the head's output is bf16 and the fp32 bias promotes the sum: folded
            # into the head, the bias and the logits would be rounded to bf16.
            return Refusal("adding the bias changes the logits' dtype")
        m.bindings["bias"] = e
        return None
    if isinstance(e, bool) or not isinstance(e, (int, float)):
        return Refusal(f"the logits' {epilogue} is by a tensor, not a number")
    if epilogue != "mul" and e == 0:
        return Refusal(f"the logits' {epilogue} is by zero")
    m.bindings["epilogue"] = (epilogue, float(e))
    return None


def _head_refused(m: Match, logits: str) -> Refusal | None:
    h, w, y = m.val("h"), m.val("w"), m.val("y")
    if m.bindings["weight"] is not None or m.bindings["label_smoothing"] != 0.0:
        return Refusal("class weights or label smoothing")
    if m.bindings["reduction"] not in ("mean", "sum"):
        return Refusal(f"reduction={m.bindings['reduction']!r} keeps per-row losses")
    if not isinstance(w, torch.Tensor) or w.ndim != 2 or m.bindings["vocab"] not in (w.shape[0], -1):
        return Refusal("the head's weight is not (V, H) with V the flattened width")
    if not isinstance(y, torch.Tensor) or y.dtype not in (torch.int64, torch.int32) or y.ndim != 1:
        return Refusal("targets are not class indices flattened to one dimension")
    shapes = [static_shape(t) for t in (h, w, y)]
    if None in shapes:
        return Refusal("symbolic shapes: the chunks need a row count")
    h_shape, (vocab, hidden), (n,) = shapes
    if vocab < _MIN_VOCAB_RATIO * hidden:
        return Refusal(f"vocabulary {vocab} is under {_MIN_VOCAB_RATIO}x the hidden size {hidden}")
    if math.prod(h_shape) != n * hidden:
        return Refusal("the head's input rows do not match the targets")
    chunks = min(_MAX_CHUNKS, max(1, math.ceil(vocab / hidden)), math.ceil(2 * n / hidden), n)
    m.bindings["chunk_rows"] = math.ceil(n / chunks)
    returned = m.escaped.get(logits, [])
    m.bindings["return_logits"] = bool(returned)
    # Logits only returned to the caller, and with a gradient where the graph makes them (not
    # in a no_grad region), get it outside the compiled step (see
    # `_give_logits_their_gradient`); logits the graph reads again keep it inside.
    matched = set(m.nodes)
    outside = [u for n in returned for u in n.users if u not in matched]
    only_returned = bool(returned) and all(u.op == "output" for u in outside)
    m.bindings["logits_grad"] = not (only_returned and getattr(example_value(returned[0]), "requires_grad", False))
    return None


# --- the chunked computation -------------------------------------------------------------------


def _scaled(x, epilogue):
    """`x` times or divided by the epilogue's number: the logits from the head's output, and
    (the epilogue being linear) the head's output's gradient from the logits'."""
    op, e = epilogue
    return x * e if op == "mul" else x / e


def _epilogue(raw, epilogue):
    """The logits from the head's output `raw`, as the model makes them: `epilogue` is None or
    ("mul" | "div" | "softcap", number)."""
    if epilogue is None:
        return raw
    if epilogue[0] == "softcap":
        return torch.tanh(raw / epilogue[1]) * epilogue[1]
    return _scaled(raw, epilogue)


def _from_logits(grad, logits, epilogue):
    """The gradient `grad` of the logits `logits` taken back through `epilogue` to the head's
    output: d tanh(x/c)·c / dx = 1 - (tanh(x/c))²."""
    if epilogue is None:
        return grad
    if epilogue[0] == "softcap":
        return grad * (1 - (logits / epilogue[1]).square())
    return _scaled(grad, epilogue)


def _chunk_grad(logits, lse, y, valid):
    """d(sum of row losses)/d(logits) for one chunk: softmax - one-hot, zero on ignored rows."""
    grad = torch.exp(logits - lse[:, None])
    picked = torch.zeros_like(grad).scatter_(1, y[:, None], 1.0)
    return (grad - picked) * valid[:, None]


def _chunk_loss(logits, y, valid):
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, y[:, None]).squeeze(1)
    return ((lse - picked) * valid).sum(), lse


def _matmul_weight(w):
    """`w` as autocast feeds it to a matmul, cast once: cast in every chunk, a fusing compiler
    makes all the copies in one kernel (one per chunk alive at once)."""
    device = w.device.type
    if torch.is_autocast_enabled(device):
        return w.to(torch.get_autocast_dtype(device))
    return w


def _accumulate(dw, grad, h, dtype):
    """dw + grad.T @ h as one addmm in the weight's dtype, outside any autocast region, which a
    fusing compiler cannot split (see `fxmem.opaque.addmm`).

    Under bf16 autocast a bf16 product added to a running sum becomes a cast and an add; a
    fusing compiler then sums every chunk's product in one kernel at the end, so all of them
    are alive at once (and the sum is rounded to bf16 chunk by chunk). One addmm per chunk
    keeps one running sum in the master weight's precision, as the unchunked backward's single
    matmul accumulates in fp32.
    """
    with torch.autocast(grad.device.type, enabled=False):
        grad, h = grad.to(dtype), h.to(dtype)
        return grad.t() @ h if dw is None else opaque_addmm(dw, grad.t(), h)


@torch.library.custom_op("fxmem::loss_with_grads", mutates_args=())
def _loss_with_grads(loss: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """`loss`, made to depend on `grads` in the traced graph (it reads nothing of them).

    The gradients the loss forms in its forward are read only by the backward; left alone,
    AOTAutograd's joint graph would count them as backward work and run the whole chunk loop
    again there. Hanging them on the loss keeps them forward values: computed once with the
    loss, then saved or recomputed as the plan decides.
    """
    return loss.clone()


@_loss_with_grads.register_fake
def _(loss, grads):
    return torch.empty_like(loss)


class _LossAndGrads(torch.autograd.Function):
    """Loss only as output; the gradients are formed in the forward, chunk by chunk."""

    @staticmethod
    def forward(ctx, h, w, b, y, valid, denominator, chunk_rows, epilogue):
        hidden, w_mm = w.shape[1], _matmul_weight(w)
        h2 = h.reshape(-1, hidden)
        total = h2.new_zeros((), dtype=torch.float32)
        dh_parts, dw, db = [], None, None
        chunks = zip(h2.split(chunk_rows), row_chunks(y, chunk_rows), row_chunks(valid, chunk_rows), strict=True)
        for hc, yc, vc in chunks:
            logits = _epilogue(F.linear(hc, w_mm, b), epilogue).float()  # (rows, V)
            loss, lse = _chunk_loss(logits, yc, vc)
            total = total + loss
            grad = _from_logits(_chunk_grad(logits, lse, yc, vc), logits, epilogue).to(w.dtype)
            dh_parts.append(grad @ w_mm)
            dw = _accumulate(dw, grad, hc, w.dtype)
            if b is not None:
                db = grad.sum(0) if db is None else db + grad.sum(0)
        dh = torch.cat(dh_parts).view(h.shape)
        ctx.save_for_backward(dh, dw, *(() if db is None else (db,)), denominator)
        ctx.has_bias = b is not None
        return _loss_with_grads(total / denominator, [dh, dw] + ([] if db is None else [db]))

    @staticmethod
    def backward(ctx, grad_loss):
        saved = ctx.saved_tensors
        dh, dw, denominator = saved[0], saved[1], saved[-1]
        scale = grad_loss / denominator.clamp_min(1)  # no valid row: gradients 0, as eager's
        db = saved[2] * scale.to(saved[2].dtype) if ctx.has_bias else None
        return dh * scale.to(dh.dtype), dw * scale.to(dw.dtype), db, None, None, None, None, None


class _LossAndLogits(torch.autograd.Function):
    """Loss and the full logits as outputs; the backward works chunk by chunk. With
    `logits_grad` (logits the graph reads again) the logits take their gradient inside the step
    and the backward reads the saved logits. Without, the logits leave without a gradient
    (`_LogitsGradient` gives them theirs, outside) and are not saved: the backward forms each
    chunk's logits again from `h`, so it reads nothing the caller holds — a step keeping only
    the loss frees them when the forward ends, and edits to them cannot reach the gradients."""

    @staticmethod
    def forward(ctx, h, w, b, y, valid, denominator, chunk_rows, logits_grad, epilogue):
        logits = _epilogue(F.linear(h, w, b), epilogue)
        flat = logits.view(-1, w.shape[0])
        total = flat.new_zeros((), dtype=torch.float32)
        lses = []
        for start in range(0, flat.shape[0], chunk_rows):
            end = start + chunk_rows
            loss, lse = _chunk_loss(flat[start:end].float(), y[start:end], valid[start:end])
            total = total + loss
            lses.append(lse)
        if not logits_grad:
            ctx.mark_non_differentiable(logits)
            ctx.set_materialize_grads(False)
        saved_logits = logits if logits_grad else None  # without: formed again from h
        ctx.save_for_backward(h, w, b, saved_logits, torch.cat(lses), y, valid, denominator)
        ctx.chunk_rows, ctx.dtype, ctx.epilogue = chunk_rows, logits.dtype, epilogue
        return total / denominator, logits

    @staticmethod
    def backward(ctx, grad_loss, grad_logits):
        h, w, b, logits, lse, y, valid, denominator = ctx.saved_tensors
        if grad_loss is None:
            return (None,) * 9
        hidden, rows, vocab = w.shape[1], ctx.chunk_rows, w.shape[0]
        h2 = h.reshape(-1, hidden)
        flat = None if logits is None else logits.view(-1, vocab)
        if flat is None:  # formed again as the forward made them: F.linear in the logits' dtype
            w_dt, b_dt = w.to(ctx.dtype), None if b is None else b.to(ctx.dtype)
        g_flat = None if grad_logits is None else grad_logits.reshape(-1, vocab)
        scale = grad_loss / denominator.clamp_min(1)  # no valid row: gradients 0, as eager's
        dh_parts, dw, db, w_mm = [], None, None, _matmul_weight(w)
        lses, ys, valids = (row_chunks(t, rows) for t in (lse, y, valid))
        for start, lc, yc, vc in zip(range(0, h2.shape[0], rows), lses, ys, valids, strict=True):
            end = start + rows
            if flat is not None:
                chunk = flat[start:end].float()
            else:
                chunk = _epilogue(F.linear(h2[start:end].to(ctx.dtype), w_dt, b_dt), ctx.epilogue).float()
            grad = _chunk_grad(chunk, lc, yc, vc) * scale
            if g_flat is not None:
                grad = grad + g_flat[start:end].float()
            grad = _from_logits(grad, chunk, ctx.epilogue).to(w.dtype)
            dh_parts.append(grad @ w_mm)
            dw = _accumulate(dw, grad, h2[start:end], w.dtype)
            if b is not None:
                db = grad.sum(0) if db is None else db + grad.sum(0)
        return torch.cat(dh_parts).view(h.shape), dw, db, None, None, None, None, None, None


class _LogitsGradient(torch.autograd.Function):
    """The logits `F.linear(h, w, b)` (through `epilogue`) the compiled step returned without a
    gradient, given it again: their gradient `g`, taken back through the epilogue, goes to `h`
    (`g @ w`), `w` (`g.T @ h`) and `b`. When the caller's backward sends none — the loss alone
    is trained on — nothing runs, and the step's backward receives zeros the size of `h` for it
    instead of zeros the size of the logits. A soft cap's slope reads the logits: they are
    formed again from `h` (the caller's may have been freed or edited)."""

    @staticmethod
    def forward(ctx, logits, h, w, b, epilogue):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(h, w, b)
        ctx.bias_dtype = None if b is None else b.dtype
        ctx.epilogue = epilogue
        return logits

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None, None, None, None
        h, w, b = ctx.saved_tensors
        with torch.autocast(grad.device.type, enabled=False):
            g = grad.reshape(-1, w.shape[0])
            logits = None
            if ctx.epilogue is not None and ctx.epilogue[0] == "softcap":
                b_g = None if b is None else b.to(g.dtype)
                logits = _epilogue(F.linear(h.reshape(g.shape[0], -1).to(g.dtype), w.to(g.dtype), b_g), ctx.epilogue)
            g = _from_logits(g, logits, ctx.epilogue)
            dh = (g @ w.to(g.dtype)).view(h.shape).to(h.dtype) if ctx.needs_input_grad[1] else None
            dw = (g.t() @ h.reshape(-1, w.shape[1]).to(g.dtype)).to(w.dtype) if ctx.needs_input_grad[2] else None
            db = g.sum(0).to(ctx.bias_dtype) if ctx.needs_input_grad[3] else None
        return None, dh, dw, db, None


def _logits_hook(logits_at: list[int], epilogue):
    """The output hook for logits returned at `logits_at`, formed from the outputs `h`, `w`
    (and `b`) the graph returns beside them, through `epilogue`."""

    def hook(outputs: list, positions: list[int]) -> None:
        h, w, b = [outputs[p] for p in positions] + [None] * (3 - len(positions))
        logits = outputs[logits_at[0]]
        # The graph made them with a gradient (whatever the caller's grad mode: a forward may
        # enable it itself); the step's h, w, b carry theirs.
        if any(t is not None and t.requires_grad for t in (h, w, b)):
            with torch.enable_grad():
                logits = _LogitsGradient.apply(logits, h, w, b, epilogue)
        for p in logits_at:
            outputs[p] = logits

    return hook


def _give_logits_their_gradient(gm) -> None:
    """For each chunked loss whose logits are only returned: the graph returns them without a
    gradient, and `h`, `w`, `b` beside them, which `_LogitsGradient` forms it from."""
    outputs = output_values(gm)
    for node in list(gm.graph.nodes):
        if node.target is not chunked_cross_entropy or not node.args[7] or node.args[8]:
            continue
        logits = {u for u in node.users if u.target is operator.getitem and u.args[1] == 1}
        logits_at = [i for i, v in enumerate(outputs) if v in logits]
        h, w, b = node.args[:3]
        return_outside(gm, [h, w] if b is None else [h, w, b], _logits_hook(logits_at, node.args[9]))


def chunked_cross_entropy(
    h,
    w,
    b,
    y,
    ignore_index=-100,
    reduction="mean",
    chunk_rows=1024,
    return_logits=False,
    logits_grad=True,
    epilogue=None,
):
    """`F.cross_entropy(F.linear(h, w, b).float().view(-1, V), y, ...)` by chunks of `chunk_rows`
    rows. With `return_logits`, `(loss, logits)`; `logits_grad=False` returns the logits
    without a gradient (the step's output hook gives them theirs). `epilogue`: None, or the
    logits made from the head's output by ("mul", s), ("div", s) or ("softcap", c), the last
    `tanh(x / c) * c`."""
    y = y.reshape(-1)
    valid = y != ignore_index
    safe_y = torch.where(valid, y, 0)
    valid_f = valid.float()
    denominator = valid_f.sum() if reduction == "mean" else torch.ones((), device=y.device)
    if return_logits:
        return _LossAndLogits.apply(h, w, b, safe_y, valid_f, denominator, chunk_rows, logits_grad, epilogue)
    if not torch.is_grad_enabled():  # no backward to prepare for
        h2 = h.reshape(-1, w.shape[1])
        total = sum(
            _chunk_loss(
                _epilogue(F.linear(h2[s : s + chunk_rows], w, b), epilogue).float(),
                safe_y[s : s + chunk_rows],
                valid_f[s : s + chunk_rows],
            )[0]
            for s in range(0, h2.shape[0], chunk_rows)
        )
        return total / denominator
    return _LossAndGrads.apply(h, w, b, safe_y, valid_f, denominator, chunk_rows, epilogue)


# pattern, what makes the logits from the head's output, the pattern node holding the logits
_TABLE = [
    (pattern_1, None, "linear"),
    (pattern_2, None, "linear"),
    (pattern_3, "mul", "mul"),
    (pattern_4, "div", "truediv"),
    (pattern_5, "softcap", "mul"),
    (pattern_6, "bias", "add"),
]
_RULES = [
    Rule(
        f"lm_loss_{i}",
        pattern,
        replacement,
        guard=_guard(epilogue, logits),
        scalars=_SCALARS,
        optional=("float",),
        may_escape=(logits,),
    )
    for i, (pattern, epilogue, logits) in enumerate(_TABLE, start=1)
]

_rule_pass = RulePass("chunked_lm_loss", _RULES)


def chunked_lm_loss(gm, example_inputs=()):
    gm, fired = _rule_pass(gm, example_inputs)
    if fired:
        _give_logits_their_gradient(gm)
    return gm, fired


chunked_lm_loss.refusals = _rule_pass.refusals

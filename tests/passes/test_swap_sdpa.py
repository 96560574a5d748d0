"""swap_sdpa: each attention form it claims becomes one SDPA call, forward and backward exact.

Most tests run the pass directly on a captured Dynamo graph (`_graphs.capture`), then call the
rewritten graph on the same tensors and compare with eager: outputs and the gradients of every
input and parameter to 1e-5 relative (fp32). HF models and the dropout/budget case go end to end
through `fxmem.optimize`.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _graphs import (
    assert_dropped_attention_weights,
    calls,
    capture,
    compare_with_eager,
    compile_with_pass,
    grad_err,
    run_graph,
)
from conftest import grads_of, max_rel_err, step, zero_grads
from fxmem.passes.swap_sdpa import swap_sdpa

import fxmem
from fxmem.testing import GPT, GPTConfig, gpt_batch

B, H, T, D = 2, 4, 16, 8
TOL = 1e-5


def _qkv(dtype=torch.float32, kv_heads=H, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, kv_heads, T, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, kv_heads, T, D, generator=g).to(dtype).requires_grad_()
    return q, k, v


def causal() -> torch.Tensor:
    """The (T, T) causal mask, made per test: a tensor kept at module level would be alive
    through every test of the worker."""
    return torch.tril(torch.ones(T, T, dtype=torch.bool))


def _swap(fn, *args, **kwargs):
    """Capture `fn(*args, **kwargs)`, run swap_sdpa on it; the graph must lint afterwards."""
    gm, ex = capture(fn, *args, **kwargs)
    swap_sdpa.refusals.clear()
    gm, fired = swap_sdpa(gm, ex)
    gm.graph.lint()
    return gm, ex, fired


def _assert_exact(fn, args, gm, ex, tol=TOL):
    """The rewritten graph computes eager's `fn(*args)` and eager's gradients of every leaf."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    weight = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1))

    def loss(out):
        y = out[0] if isinstance(out, (tuple, list)) else out
        return (y.float() * weight).sum()

    loss_err, grad_err = compare_with_eager(lambda: fn(*args), lambda: run_graph(gm, ex), leaves, loss)
    assert loss_err < tol and grad_err < tol, (loss_err, grad_err)


def _check(fn, *args, rule: int | None = None, tol=TOL):
    """swap_sdpa fires once on fn(*args), leaves no softmax, and is exact."""
    gm, ex, fired = _swap(fn, *args)
    assert fired == 1, swap_sdpa.refusals
    assert len(calls(gm, F.scaled_dot_product_attention)) == 1
    assert not calls(gm, F.softmax) and not calls(gm, "softmax"), gm.code
    _assert_exact(fn, args, gm, ex, tol)
    return gm


# --- the forms the pass claims, one function each ----------------------------------------------


def nanogpt_mul(q, k, v, causal):  # nanoGPT: mul scale, masked_fill(-inf) where the buffer is 0
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(causal == 0, float("-inf"))
    att = F.softmax(att, dim=-1)
    return att @ v


def nanogpt_div(q, k, v, causal):  # GPT-2 research code: div scale
    att = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(k.size(-1))
    att = att.masked_fill(~causal, float("-inf"))
    return att.softmax(-1) @ v


def masked_fill_finfo_min(q, k, v, causal):  # a finite fill: an additive mask
    att = (q @ k.transpose(-2, -1)) * D**-0.5
    att = att.masked_fill(~causal, torch.finfo(q.dtype).min)
    return F.softmax(att, dim=-1) @ v


def where_finfo_min(q, k, v, causal):  # HF GPT-2 before 4-D masks, GPT-J: torch.where(causal, s, min)
    scores = torch.matmul(q, k.transpose(-1, -2)) * D**-0.5
    att = torch.where(causal, scores, torch.finfo(q.dtype).min)
    return torch.matmul(F.softmax(att, dim=-1), v)


def where_full_tensor(q, k, v, causal):  # the fill as a 0-d torch.full, as HF wrote it
    scores = torch.matmul(q, k.transpose(-1, -2)) * D**-0.5
    fill = torch.full([], torch.finfo(scores.dtype).min, dtype=scores.dtype)
    att = torch.where(causal, scores, fill)
    return torch.matmul(F.softmax(att, dim=-1), v)


def where_neg_inf(q, k, v, causal):
    scores = torch.matmul(q, k.transpose(-1, -2)) * D**-0.5
    att = torch.where(causal, scores, float("-inf"))
    return torch.matmul(F.softmax(att, dim=-1), v)


def additive_mask(q, k, v, mask):  # HF Llama / BERT eager: scores * scale + mask
    att = torch.matmul(q, k.transpose(2, 3)) * D**-0.5 + mask
    return torch.matmul(F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype), v)


def additive_mask_div(q, k, v, mask):  # older HF BERT: scores / sqrt(d) + mask
    att = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
    att = att + mask
    return torch.matmul(F.softmax(att, dim=-1), v)


def no_mask(q, k, v):  # encoders, ViT
    return torch.matmul(F.softmax(torch.matmul(q, k.transpose(-2, -1)) * D**-0.5, dim=-1), v)


def no_mask_div(q, k, v):
    att = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    return att.softmax(dim=-1).contiguous() @ v


def fp32_softmax_cast_back(q, k, v, causal):  # softmax in fp32, cast back to q's dtype
    att = (q @ k.transpose(-2, -1)) * D**-0.5
    att = att.masked_fill(~causal, float("-inf"))
    return F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def _additive(dtype=torch.float32):
    g = torch.Generator().manual_seed(2)
    pad = torch.rand(B, 1, 1, T, generator=g) < 0.2
    pad[..., 0] = False  # every row attends to something
    mask = torch.zeros(B, 1, T, T).masked_fill(pad | ~causal(), torch.finfo(dtype).min)
    return mask.to(dtype)


@pytest.mark.parametrize(
    "fn",
    [nanogpt_mul, nanogpt_div, masked_fill_finfo_min, where_finfo_min, where_full_tensor, where_neg_inf,
     fp32_softmax_cast_back],
)  # fmt: skip
def test_bool_masked_forms_swap_and_are_exact(fn):
    mask = causal().float() if fn is nanogpt_mul else causal()  # nanoGPT compares a float buffer with 0
    gm = _check(fn, *_qkv(), mask)
    (sdpa,) = calls(gm, F.scaled_dot_product_attention)
    assert sdpa.kwargs["attn_mask"] is not None
    assert sdpa.kwargs["dropout_p"] == 0.0 and not sdpa.kwargs["enable_gqa"]
    assert sdpa.kwargs["scale"] == pytest.approx(D**-0.5)


@pytest.mark.parametrize("fn", [additive_mask, additive_mask_div])
def test_additive_float_mask_swaps_and_is_exact(fn):
    gm = _check(fn, *_qkv(), _additive())
    (sdpa,) = calls(gm, F.scaled_dot_product_attention)
    assert sdpa.kwargs["attn_mask"].meta["example_value"].dtype == torch.float32  # passed through


@pytest.mark.parametrize("fn", [no_mask, no_mask_div])
def test_no_mask_swaps_and_is_exact(fn):
    gm = _check(fn, *_qkv())
    (sdpa,) = calls(gm, F.scaled_dot_product_attention)
    assert sdpa.kwargs["attn_mask"] is None
    assert sdpa.kwargs["scale"] == pytest.approx(D**-0.5)


@pytest.mark.parametrize("fill", [0.0, -1e4])
def test_a_fill_that_does_not_drop_the_score_is_refused(fill):
    """masked_fill replaces a score with the fill; an SDPA mask adds to it: with a fill of 0 the
    loss moved (0.05597 -> 0.05677) and gradients were 15% off."""

    def fn(q, k, v, causal):
        att = ((q @ k.transpose(-2, -1)) * D**-0.5).masked_fill(~causal, fill)
        return F.softmax(att, dim=-1) @ v

    gm, _, fired = _swap(fn, *_qkv(), causal())
    assert fired == 0 and not calls(gm, F.scaled_dot_product_attention)
    assert any("replaces scores" in str(r) for r in swap_sdpa.refusals), swap_sdpa.refusals


def _left_padded(dtype=torch.float32):
    """Causal, with three pads on the left of the second sample: its first three rows keep no key."""
    keep = causal().expand(B, 1, T, T).clone()
    keep[1, ..., :3] = False
    return keep, torch.zeros(B, 1, T, T).masked_fill(~keep, torch.finfo(dtype).min)


@pytest.mark.parametrize("form", [additive_mask, where_finfo_min, masked_fill_finfo_min])
@pytest.mark.parametrize("kv_heads", [H, H // 2], ids=["heads", "grouped"])
def test_rows_a_finite_mask_from_the_batch_drops_whole_are_eagers(form, kv_heads):
    """Left padding under a causal mask drops every key of the first rows. Eager's softmax there
    is uniform; SDPA's fused kernels are not eager there (CPU's backward: q 8.8 off, against 1.7
    at most; CUDA's, tests/test_cuda.py). Those rows are computed apart: outputs and gradients are
    eager's, the added mask passing the scores their gradient and a fill none; with grouped
    heads (HF's repeat_kv, undone by the pass) too."""
    keep, additive = _left_padded()
    mask = additive if form is additive_mask else keep
    n = H // kv_heads

    def fn(q, k, v, mask):
        if n > 1:
            k, v = (x[:, :, None, :, :].expand(B, kv_heads, n, T, D).reshape(B, H, T, D) for x in (k, v))
        return form(q, k, v, mask)

    q, k, v = _qkv(kv_heads=kv_heads)
    dropped_rows = fn(q, k, v, mask)[1, :, :3]  # eager's: the mean of the values, uniform weights
    assert torch.allclose(dropped_rows, v[1].repeat_interleave(n, dim=0).mean(dim=-2, keepdim=True).expand(H, 3, D))
    gm = _check(fn, q, k, v, mask)
    (sdpa,) = calls(gm, F.scaled_dot_product_attention)
    assert sdpa.kwargs["attn_mask"] is not None and not sdpa.kwargs["is_causal"]
    assert sdpa.kwargs["enable_gqa"] == (n > 1)


@pytest.mark.parametrize("odd", ["uneven", "-inf"])
def test_a_padded_row_eager_has_no_uniform_softmax_for_gives_nan(odd):
    """A row an additive mask drops whole with entries that are not all equal is not uniform in
    eager's softmax (the largest entry takes it all), and one of -inf gives eager NaN: NaN there
    rather than a wrong number."""
    _, mask = _left_padded()
    if odd == "uneven":
        mask[1, 0, 0, 0] = torch.finfo(torch.float32).min / 1.5
    else:
        mask[1, 0, 0] = float("-inf")
    gm, ex, fired = _swap(additive_mask, *_qkv(), mask)
    assert fired == 1, swap_sdpa.refusals
    out = run_graph(gm, ex)
    out = out[0] if isinstance(out, (tuple, list)) else out
    assert out[1, :, 0].isnan().all() and not out[1, :, 1:].isnan().any() and not out[0].isnan().any()


def test_a_finite_mask_from_the_batch_with_attention_dropout_is_refused():
    def fn(q, k, v, mask):
        att = torch.matmul(q, k.transpose(2, 3)) * D**-0.5 + mask
        return torch.matmul(F.dropout(F.softmax(att, dim=-1), p=0.1, training=True), v)

    _, mask = _left_padded()
    gm, _, fired = _swap(fn, *_qkv(), mask)
    assert fired == 0 and not calls(gm, F.scaled_dot_product_attention)
    assert any("attention dropout" in str(r) for r in swap_sdpa.refusals), swap_sdpa.refusals


class _KeepMasked(nn.Module):
    """Attention whose boolean keep-mask is a module buffer (a fact about the model)."""

    def __init__(self, keep):
        super().__init__()
        self.register_buffer("keep", keep)

    def forward(self, q, k, v):
        att = torch.where(self.keep, (q @ k.transpose(-2, -1)) * D**-0.5, torch.finfo(q.dtype).min)
        return F.softmax(att, dim=-1) @ v


def test_a_buffer_mask_is_checked_only_when_every_row_keeps_a_key():
    """A finite mask made from module buffers is evaluated. One whose rows drop every key has
    them computed apart, as a mask from the batch. One that keeps a key in every row runs as
    SDPA alone and is exact, and the compiled step raises once the buffer changes so that a row
    drops every key."""
    keep, _ = _left_padded()
    _swap_compiled(_KeepMasked(keep), *_qkv())  # exact (asserted inside)

    band = causal() & ~torch.tril(torch.ones(T, T, dtype=torch.bool), diagonal=-4)  # not causal: a mask tensor
    module = _KeepMasked(band.expand(B, 1, T, T).clone())
    node = _swap_compiled(module, *_qkv())
    assert node.kwargs["attn_mask"] is not None and node.kwargs["is_causal"] is False
    m = fxmem.optimize(module, 4.0, compiler="eager", passes=("swap_sdpa",))
    m(*_qkv()).sum().backward()
    assert m.plan.rewrites == {"swap_sdpa": 1}
    with torch.no_grad():
        module.keep[1, :, :3] = False
    with pytest.raises(RuntimeError, match="keeps a key in every row"):
        m(*_qkv())


def test_fp32_softmax_cast_back_in_bf16():
    q, k, v = _qkv(torch.bfloat16)
    gm, ex, fired = _swap(fp32_softmax_cast_back, q, k, v, causal())
    assert fired == 1, swap_sdpa.refusals
    (sdpa,) = calls(gm, F.scaled_dot_product_attention)
    assert sdpa.meta["example_value"].dtype == torch.bfloat16
    # bf16 rounds differently inside the fused kernel: compare loosely
    _assert_exact(fp32_softmax_cast_back, (q, k, v, causal()), gm, ex, tol=2e-2)


def test_fp32_softmax_not_cast_back_is_refused():
    def fn(q, k, v):
        att = F.softmax((q @ k.transpose(-2, -1)) * D**-0.5, dim=-1, dtype=torch.float32)
        return att @ v.float()

    gm, _, fired = _swap(fn, *_qkv(torch.bfloat16))
    assert fired == 0
    assert not calls(gm, F.scaled_dot_product_attention)


# --- dropout ----------------------------------------------------------------------------------


def _dropout_attention(p, training):
    def fn(q, k, v):
        att = torch.matmul(q, k.transpose(-2, -1)) * D**-0.5
        att = F.dropout(F.softmax(att, dim=-1), p=p, training=training)
        return torch.matmul(att, v)

    return fn


def test_dropout_passes_p_and_training_to_sdpa():
    gm, _, fired = _swap(_dropout_attention(0.3, True), *_qkv())
    assert fired == 1
    (sdpa,) = calls(gm, F.scaled_dot_product_attention)
    assert sdpa.kwargs["dropout_p"] == pytest.approx(0.3)
    # the eager dropout is gone with the weights it dropped: no T x T value is left to compute
    assert not calls(gm, F.dropout) and not calls(gm, F.softmax), gm.code


def test_dropout_not_training_is_exact():
    fn = _dropout_attention(0.3, False)
    gm = _check(fn, *_qkv())
    assert calls(gm, F.scaled_dot_product_attention)[0].kwargs["dropout_p"] == 0.0


def test_dropout_output_is_a_dropout_of_the_attention_weights():
    # With v = I (head_dim = T) the output *is* the dropped-out weights: every entry is either 0 or
    # eager's weight / (1 - p), and about p of the non-zero weights are dropped.
    p, t = 0.5, T
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(8, H, t, t, generator=g), torch.randn(8, H, t, t, generator=g)
    v = torch.eye(t).expand(8, H, t, t).contiguous()
    fn = _dropout_attention(p, True)
    gm, ex, fired = _swap(fn, q, k, v)
    assert fired == 1
    torch.manual_seed(0)
    # 8*4*16*16 = 8192 draws: 5 sigma is +-0.028
    assert_dropped_attention_weights(run_graph(gm, ex), q, k, p, band=0.05, scale=D**-0.5)


def test_dropout_p1_drops_everything():
    fn = _dropout_attention(1.0, True)
    q, k, v = _qkv()
    gm, ex, fired = _swap(fn, q, k, v)
    assert fired == 1
    y = run_graph(gm, ex)
    assert torch.equal(y, torch.zeros_like(y)) and torch.equal(y, fn(q, k, v))


def test_gpt_dropout_same_seed_same_loss_and_grads_at_any_budget():
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32, dropout=0.2)
    torch.manual_seed(0)
    model = GPT(cfg)
    batch = gpt_batch(cfg, 2, 64)
    results = []
    for budget_gb in (4.0, None):
        if budget_gb is None:  # just above the floor: the gradients of the first run are alive too
            budget_gb = 1.1 * results[0][2].floor_bytes / 2**30
        torch._dynamo.reset()
        m = fxmem.optimize(model, budget_gb, compiler="eager")
        torch.manual_seed(123)
        loss = step(m, *batch)
        results.append((loss, grads_of(model), m.plan))
        zero_grads(model)
    (loss_free, g_free, free), (loss_tight, g_tight, tight) = results
    assert free.rewrites["swap_sdpa"] == tight.rewrites["swap_sdpa"] == cfg.n_layer
    assert tight.recomputed, "the tight plan must recompute something"
    assert torch.equal(loss_free, loss_tight)
    assert max_rel_err(g_tight, g_free) < 1e-6


# --- refusals: nothing is rewritten ------------------------------------------------------------


def test_weights_returned_are_not_rewritten():
    def fn(q, k, v, causal):
        att = (q @ k.transpose(-2, -1)) * D**-0.5
        att = F.softmax(att.masked_fill(~causal, float("-inf")), dim=-1)
        return att @ v, att

    q, k, v = _qkv()
    gm, ex, fired = _swap(fn, q, k, v, causal())
    assert fired == 0
    assert not calls(gm, F.scaled_dot_product_attention)
    assert any("also used outside" in reason for _, _, reason in swap_sdpa.refusals), swap_sdpa.refusals
    y, att = run_graph(gm, ex)
    y_ref, att_ref = fn(q, k, v, causal())
    assert torch.equal(y, y_ref) and torch.equal(att, att_ref)


def test_scores_used_elsewhere_are_not_rewritten():
    def fn(q, k, v):
        scores = (q @ k.transpose(-2, -1)) * D**-0.5
        return F.softmax(scores, dim=-1) @ v, scores.logsumexp(-1)

    _, _, fired = _swap(fn, *_qkv())
    assert fired == 0


def test_three_dimensional_attention_is_refused():
    def fn(q, k, v):
        return F.softmax((q @ k.transpose(-2, -1)) * D**-0.5, dim=-1) @ v

    q, k, v = (t.flatten(0, 1).detach() for t in _qkv())  # (B*H, T, D)
    _, _, fired = _swap(fn, q, k, v)
    assert fired == 0
    assert any("4-D" in reason for _, _, reason in swap_sdpa.refusals)


def test_scale_from_a_tensor_is_refused():
    def fn(q, k, v, scale):
        return F.softmax((q @ k.transpose(-2, -1)) * scale, dim=-1) @ v

    _, _, fired = _swap(fn, *_qkv(), torch.tensor(0.3))
    assert fired == 0


def test_a_scale_made_in_a_narrower_dtype_divides_by_the_value_that_dtype_holds():
    def fn(q, k, v):
        scale = torch.full([], math.sqrt(D) * 1.01, dtype=torch.bfloat16)  # 2.8567 in bf16: 2.859375
        return F.softmax((q @ k.transpose(-2, -1)) / scale, dim=-1) @ v

    _check(fn, *_qkv())


def test_softmax_over_another_dim_is_not_attention():
    def fn(q, k, v):
        return F.softmax((q @ k.transpose(-2, -1)) * D**-0.5, dim=-2) @ v

    _, _, fired = _swap(fn, *_qkv())
    assert fired == 0


def test_no_attention_no_change():
    def fn(x, w):
        return F.softmax(x @ w, dim=-1).sum()

    gm, _, fired = _swap(fn, torch.randn(4, 8), torch.randn(8, 8))
    assert fired == 0 and calls(gm, F.softmax)


# --- Hugging Face models, eager attention -------------------------------------------------------

transformers = pytest.importorskip("transformers")
VOCAB, SEQ = 128, 32


def _gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")


def _llama(**overrides):
    cfg = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )  # fmt: skip
    cfg.update(overrides)
    return transformers.LlamaForCausalLM._from_config(transformers.LlamaConfig(**cfg), attn_implementation="eager")


def _bert():
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForMaskedLM._from_config(cfg, attn_implementation="eager")


def _hf_batch(model_name):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=g)
    kwargs = {"input_ids": ids, "labels": ids}
    if model_name in ("bert", "llama-left-padded"):  # padding on the second row: the mask matters
        mask = torch.ones(2, SEQ, dtype=torch.long)
        if model_name == "bert":
            mask[1, -5:] = 0
        else:  # left padding: the first rows attend to nothing
            mask[1, :5] = 0
            kwargs["labels"] = ids.masked_fill(mask == 0, -100)
        kwargs["attention_mask"] = mask
    return kwargs


HF = {"gpt2": _gpt2, "llama": _llama, "bert": _bert, "llama-left-padded": _llama}


def _hf_swapped(name, **kw):
    """An HF model (train mode) and its batch; swap_sdpa run on its graph by a backend of its own."""
    torch.manual_seed(0)
    model = HF[name](**kw).train()
    kwargs = _hf_batch(name)
    swap_sdpa.refusals.clear()
    compiled, seen = compile_with_pass(swap_sdpa, model)
    return model, kwargs, compiled, seen


@pytest.mark.parametrize("name", sorted(HF))
def test_hf_eager_attention_swaps_and_is_exact(name):
    model, kwargs, compiled, seen = _hf_swapped(name)
    params = list(model.parameters())
    loss_err, grad_err = compare_with_eager(
        lambda: model(**kwargs).loss, lambda: compiled(**kwargs).loss, params, loss=lambda x: x
    )
    ((gm, fired),), n_layer = seen, model.config.num_hidden_layers
    assert fired == n_layer, swap_sdpa.refusals
    assert len(calls(gm, F.scaled_dot_product_attention)) == n_layer
    assert not calls(gm, F.softmax), gm.code
    assert loss_err < TOL and grad_err < TOL, (loss_err, grad_err)


def test_llama_gqa_uses_enable_gqa_without_repeating_kv():
    model, kwargs, compiled, seen = _hf_swapped("llama")
    out = compiled(**kwargs)
    ((gm, fired),), ref = seen, model(**kwargs)
    assert torch.allclose(out.logits, ref.logits, rtol=TOL, atol=1e-6)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    sdpas = calls(gm, F.scaled_dot_product_attention)
    assert fired == len(sdpas) == 2
    for sdpa in sdpas:
        assert sdpa.kwargs["enable_gqa"] is True
        q, k, v = (a.meta["example_value"] for a in sdpa.args[:3])
        assert q.shape[1] == 4 and k.shape[1] == v.shape[1] == 2  # the (B, 2, T, hs) keys, not repeated
    repeats = [n for n in calls(gm, "expand") if n.meta["example_value"].ndim == 5]
    assert not repeats, "repeat_kv's (B, kv, n_rep, T, hs) expand is gone"


def test_llama_gqa_keeps_the_repeat_where_grouped_heads_lose_the_fused_kernel(monkeypatch):
    """CUDA in fp32: only flash attention takes grouped heads, and only in half precision, so
    `enable_gqa=True` would run the math kernel (keeping the (B, heads, T, T) weights) where the
    repeated keys and values run the memory-efficient one. torch's dispatch answers so here."""
    from torch.nn.attention import SDPBackend

    choose = torch._fused_sdp_choice
    asked = []

    def cuda_fp32(q, k, v, *args, enable_gqa=False, **kwargs):
        asked.append(enable_gqa)
        if enable_gqa and k.shape[1] != q.shape[1]:
            return SDPBackend.MATH.value
        return SDPBackend.EFFICIENT_ATTENTION.value

    monkeypatch.setattr(torch, "_fused_sdp_choice", cuda_fp32)
    model, kwargs, compiled, seen = _hf_swapped("llama")
    compiled(**kwargs)  # compiles, the pass asking the dispatch above
    monkeypatch.setattr(torch, "_fused_sdp_choice", choose)
    loss_err, grad_err = compare_with_eager(
        lambda: model(**kwargs).loss, lambda: compiled(**kwargs).loss, list(model.parameters()), loss=lambda x: x
    )
    ((gm, fired),) = seen
    sdpas = calls(gm, F.scaled_dot_product_attention)
    assert fired == len(sdpas) == 2 and True in asked and False in asked
    for sdpa in sdpas:
        assert not sdpa.kwargs["enable_gqa"]
        q, k, v = (a.meta["example_value"] for a in sdpa.args[:3])
        assert q.shape[1] == k.shape[1] == v.shape[1] == 4  # repeat_kv's keys and values
    assert loss_err < TOL and grad_err < TOL, (loss_err, grad_err)


def test_llama_without_gqa_does_not_enable_it():
    _, kwargs, compiled, seen = _hf_swapped("llama", num_key_value_heads=4)
    compiled(**kwargs)
    ((gm, fired),) = seen
    assert fired == 2
    assert all(not n.kwargs["enable_gqa"] for n in calls(gm, F.scaled_dot_product_attention))


def test_llama_output_attentions_is_not_rewritten():
    torch.manual_seed(0)
    model = _llama().train()
    kwargs = _hf_batch("llama")
    # transformers installs its output-capturing hooks under a lock on the first such call,
    # which Dynamo cannot trace: make that call eagerly (it is also the reference).
    ref = model(**kwargs, output_attentions=True)
    compiled, seen = compile_with_pass(swap_sdpa, lambda **a: model(**a, output_attentions=True))
    compiled(**kwargs)
    assert seen[0][1] == 0
    assert any("also used outside" in reason for _, _, reason in swap_sdpa.refusals)
    torch._dynamo.reset()
    m = fxmem.optimize(model, 4.0, compiler="eager")
    out = m(**kwargs, output_attentions=True)
    assert m.plan.rewrites["swap_sdpa"] == 0
    assert len(out.attentions) == 2
    for a, b in zip(out.attentions, ref.attentions, strict=True):
        assert torch.allclose(a, b, rtol=TOL, atol=1e-7)
    assert torch.allclose(out.loss, ref.loss, rtol=TOL)


@pytest.mark.parametrize("name", ["bert"])  # Llama: through optimize, every pass, in test_chunked_lm_loss
def test_hf_end_to_end_through_optimize(name):
    torch.manual_seed(0)
    model = HF[name]().train()
    kwargs = _hf_batch(name)
    ref = step(model, **kwargs)
    ref_grads = grads_of(model)
    zero_grads(model)
    m = fxmem.optimize(model, 4.0, compiler="eager", passes=("swap_sdpa",))
    got = step(m, **kwargs)
    assert m.plan.rewrites == {"swap_sdpa": model.config.num_hidden_layers}
    assert torch.allclose(got, ref, rtol=TOL)
    assert grad_err(grads_of(model), ref_grads) < TOL


def test_left_padded_layers_share_one_mask_with_those_rows_opened():
    """Every layer's SDPA reads the batch's mask with the rows it drops whole opened to every key
    (`where(rows, 0, mask)`, (B, 1, T, T) floats): the same value in each layer, which the plan
    holds once (the partitioner merges values computed twice), not once a layer."""
    torch.manual_seed(0)
    model = _llama(num_hidden_layers=3).train()
    kwargs = _hf_batch("llama-left-padded")
    ref = step(model, **kwargs)
    ref_grads = grads_of(model)
    zero_grads(model)
    m = fxmem.optimize(model, 4.0, compiler="eager", passes=("swap_sdpa",))
    got = step(m, **kwargs)
    assert m.plan.rewrites == {"swap_sdpa": 3}
    opened = [d.name for d in m.plan.decisions if d.op == "aten.where.self" and d.nbytes == 2 * SEQ * SEQ * 4]
    assert len(opened) == 1, opened
    assert torch.allclose(got, ref, rtol=TOL)
    assert grad_err(grads_of(model), ref_grads) < TOL


def test_nanogpt_with_inductor():
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    batch = gpt_batch(cfg, 2, 32)
    ref = step(model, *batch)
    ref_grads = grads_of(model)
    zero_grads(model)
    m = fxmem.optimize(model, 4.0, passes=("swap_sdpa",))  # inductor
    got = step(m, *batch)
    assert m.plan.rewrites == {"swap_sdpa": 2}
    assert torch.allclose(got, ref, rtol=TOL)
    assert max_rel_err(grads_of(model), ref_grads) < 1e-4  # inductor's fused kernels reorder sums


class _AttnReturningWeights(nn.Module):
    """A tiny attention block that returns its weights beside its output."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D * H, 3 * D * H)

    def forward(self, x):
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        att = F.softmax((q @ k.transpose(-2, -1)) * D**-0.5, dim=-1)
        return (att @ v).sum(), att


def test_module_returning_weights_end_to_end():
    torch.manual_seed(0)
    model = _AttnReturningWeights()
    x = torch.randn(B, T, D * H)
    m = fxmem.optimize(model, 4.0, compiler="eager", passes=("swap_sdpa",))
    y, att = m(x)
    y.backward()
    assert m.plan.rewrites == {"swap_sdpa": 0}
    g = grads_of(model)
    zero_grads(model)
    y_ref, att_ref = model(x)
    y_ref.backward()
    assert torch.allclose(y, y_ref, rtol=TOL) and torch.allclose(att, att_ref, rtol=TOL, atol=1e-7)
    assert max_rel_err(g, grads_of(model)) < TOL


# --- masks that are facts about the model: `is_causal` ------------------------------------------


class _BufferMasked(nn.Module):
    """nanoGPT's attention core: the mask is a registered buffer, sliced to the sequence."""

    def __init__(self, mask: torch.Tensor):
        super().__init__()
        self.register_buffer("bias", mask.float().view(1, 1, *mask.shape), persistent=False)

    def forward(self, q, k, v):
        t = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * D**-0.5
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        return F.softmax(att, dim=-1) @ v


def _sdpa_call(gm):
    (node,) = calls(gm, F.scaled_dot_product_attention)
    return node


def _swap_compiled(fn, *args):
    """swap_sdpa run inside a backend, as fxmem runs it (Dynamo's record of where each input
    came from is there only then); the compiled function matches eager's output and gradients."""
    compiled, seen = compile_with_pass(swap_sdpa, fn)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    weight = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1))
    errs = compare_with_eager(lambda: fn(*args), lambda: compiled(*args), leaves, lambda y: (y * weight).sum())
    assert max(errs) < TOL, errs
    (gm, fired), *_ = seen
    assert fired == 1
    return _sdpa_call(gm)


def test_a_causal_buffer_mask_becomes_is_causal_and_is_exact():
    node = _swap_compiled(_BufferMasked(torch.tril(torch.ones(2 * T, 2 * T))), *_qkv())
    assert node.kwargs["is_causal"] is True and node.kwargs["attn_mask"] is None


def test_a_buffer_mask_that_is_not_causal_stays_a_mask():
    window = torch.tril(torch.ones(T, T)) - torch.tril(torch.ones(T, T), diagonal=-4)  # sliding window
    node = _swap_compiled(_BufferMasked(window), *_qkv())
    assert node.kwargs["is_causal"] is False and node.kwargs["attn_mask"] is not None


def test_a_mask_passed_with_the_batch_is_not_assumed_causal():
    node = _swap_compiled(nanogpt_mul, *_qkv(), causal())  # causal values, but an input: may change
    assert node.kwargs["is_causal"] is False and node.kwargs["attn_mask"] is not None


def test_an_additive_causal_mask_made_from_shapes_becomes_is_causal():
    def fn(q, k, v):
        t = q.size(-2)
        mask = torch.full((t, t), torch.finfo(q.dtype).min).triu(1)  # HF's causal mask, from shapes
        return additive_mask(q, k, v, mask[None, None])

    assert _swap_compiled(fn, *_qkv()).kwargs["is_causal"] is True


def test_a_changed_causal_buffer_is_an_error_not_a_wrong_answer():
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    batch = gpt_batch(cfg, 2, 32)
    m = fxmem.optimize(model, 4.0, compiler="eager", passes=("swap_sdpa",))
    step(m, *batch)
    model.load_state_dict(model.state_dict())  # same values written again: still causal
    with torch.no_grad():
        model.h[1].attn.bias.copy_(model.h[1].attn.bias.clone())
    step(m, *batch)
    with torch.no_grad():
        model.h[1].attn.bias.fill_(1.0)  # attend everywhere: the rewrite would now be wrong
    with pytest.raises(RuntimeError, match="causal attention mask"):
        step(m, *batch)


class _KeepWritten(nn.Module):
    """A causal mask buffer the forward overwrites with the batch's mask before reading it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("keep", causal())

    def forward(self, q, k, v, keep):
        self.keep.copy_(keep)
        att = (q @ k.transpose(-2, -1)) * D**-0.5
        return F.softmax(att.masked_fill(~self.keep, float("-inf")), -1) @ v


def test_a_buffer_the_forward_writes_is_not_taken_for_its_captured_value():
    q, k, v = (t.detach() for t in _qkv())
    everywhere = torch.ones(T, T, dtype=torch.bool)  # this batch's mask: not causal
    fn, seen = compile_with_pass(swap_sdpa, _KeepWritten())
    got = fn(q, k, v, everywhere)
    ((gm, fired),) = seen
    (node,) = calls(gm, F.scaled_dot_product_attention)
    assert fired == 1 and node.kwargs["is_causal"] is False
    torch.testing.assert_close(got, _KeepWritten()(q, k, v, everywhere))


def test_an_attention_output_written_in_place_later_is_refused():
    """SDPA's backward reads its own output; eager's matmul does not."""

    def fn(q, k, v, keep):
        y = nanogpt_mul(q, k, v, keep)
        y.mul_(2.0)
        return y

    args = (*_qkv(), causal())
    gm, ex, fired = _swap(fn, *args)
    assert fired == 0 and "written in place later" in swap_sdpa.refusals[0][2]
    _assert_exact(fn, args, gm, ex)


@pytest.mark.parametrize(
    ("mask_shape", "q_batch"),
    [((T,), B), ((3, 1, 1, T, T), B), ((B, 1, T, T), 1)],
    ids=["1-D", "5-D", "batch-only-in-the-mask"],
)
def test_a_mask_that_does_not_broadcast_to_the_scores_is_refused(mask_shape, q_batch):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(q_batch, H, T, D, generator=g).requires_grad_() for _ in range(3))
    mask = torch.randn(*mask_shape, generator=g)
    gm, ex, fired = _swap(additive_mask, q, k, v, mask)
    assert fired == 0 and "does not broadcast" in swap_sdpa.refusals[0][2]
    want = additive_mask(q, k, v, mask)
    torch.testing.assert_close(run_graph(gm, ex), want)


def test_keys_expanded_and_reshaped_otherwise_than_repeat_kv_stay_repeated():
    """x[:, :, None].expand(...).reshape(b, h, t, d) with other (h, t) than (h_kv * n, t) is not
    HF's repeat_kv: its heads are not each key head's copies, and `enable_gqa` would read it so."""
    kv, n = 2, 2
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, kv * n * 2, T // 2, D, generator=g).requires_grad_()
    k, v = (torch.randn(B, kv, T, D, generator=g).requires_grad_() for _ in range(2))

    def fn(q, k, v):
        k, v = (x[:, :, None, :, :].expand(B, kv, n, T, D).reshape(B, kv * n * 2, T // 2, D) for x in (k, v))
        return torch.matmul(F.softmax(torch.matmul(q, k.transpose(-2, -1)) * D**-0.5, -1), v)

    gm, ex, fired = _swap(fn, q, k, v)
    (node,) = calls(gm, F.scaled_dot_product_attention)
    assert fired == 1 and node.kwargs["enable_gqa"] is False
    loss_err, grad_err = compare_with_eager(lambda: fn(q, k, v), lambda: run_graph(gm, ex), [q, k, v], torch.sum)
    assert loss_err < TOL and grad_err < TOL


def test_an_additive_mask_that_needs_a_gradient_and_can_drop_rows_is_refused():
    """The rows it drops whole are computed apart and would pass the mask no gradient."""
    q, k, v = _qkv()
    mask = torch.randn(B, 1, T, T, generator=torch.Generator().manual_seed(2)).requires_grad_()
    gm, ex, fired = _swap(additive_mask, q, k, v, mask)
    assert fired == 0 and "needs a gradient" in swap_sdpa.refusals[0][2]
    leaves = [q, k, v, mask]
    loss_err, grad_err = compare_with_eager(
        lambda: additive_mask(q, k, v, mask), lambda: run_graph(gm, ex), leaves, torch.sum
    )
    assert loss_err < TOL and grad_err < TOL


def test_padded_rows_in_fp16_do_not_overflow_where_eager_does_not():
    """The rows left padding drops whole, under an added mask, carry their gradient through
    K^T V, which eager never forms: with keys and values of a few hundred it is past fp16's
    range while eager's scores and outputs are not, and was NaN in every output and gradient.
    fp16 computes those terms in fp32."""
    q, k, v = _qkv(torch.float16)
    with torch.no_grad():
        q.mul_(0.01), k.mul_(150), v.mul_(150)
    assert not (k.transpose(-2, -1) @ v).isfinite().all()  # fp16 overflows
    _, mask = _left_padded(torch.float16)
    mask = mask.to(torch.float16)
    assert additive_mask(q, k, v, mask).isfinite().all()  # eager does not
    _check(additive_mask, q, k, v, mask, tol=1e-2)

"""chunked_lm_loss: cross_entropy(linear(h).view(-1, V), y) runs by chunks of rows, exactly.

A tiny head (a body layer so `h` has parameters behind it, then the LM head and the loss) in
each form the pass claims — view/reshape, bias, ignore_index -100 and -1, reduction mean/sum,
logits also returned — and nanoGPT and HF *ForCausalLM models. Loss and the gradients of every
parameter equal eager's to 1e-5 relative; the counter fired exactly; the graph lints. Refusals:
label smoothing, per-row losses, a vocabulary under 4x the hidden size, logits used before the
loss.
"""

from __future__ import annotations

import contextlib
import math
import operator
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _graphs import calls, capture, compare_with_eager, compile_with_pass, grad_err
from conftest import grads_of, step, zero_grads
from fxmem.passes.chunked_lm_loss import chunked_cross_entropy, chunked_lm_loss
from torch._inductor.utils import run_and_get_code

import fxmem
from fxmem.pipeline import run_passes
from fxmem.testing import GPT, GPTConfig, gpt_batch

TOL = 1e-5
HIDDEN, VOCAB = 16, 128  # 8x: the pass fires (it needs 4x)


# What a head's logits go through before the loss, as HF writes it (a cap of 2: the logits
# of this head reach it, so the tanh bends them).
EPILOGUES = {
    "mul": lambda m, logits: logits * 0.0625,  # Cohere
    "div": lambda m, logits: logits / 3.0,  # Granite
    "softcap": lambda m, logits: torch.tanh(logits / 2.0) * 2.0,  # Gemma 2
    "bias": lambda m, logits: logits + m.final_logits_bias,  # BART
}


class Head(nn.Module):
    def __init__(
        self,
        vocab=VOCAB,
        bias=False,
        flatten="view",
        return_logits=False,
        contiguous=False,
        epilogue=None,
        **loss_kwargs,
    ):
        super().__init__()
        self.body = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, vocab, bias=bias)
        self.flatten, self.return_logits, self.loss_kwargs = flatten, return_logits, loss_kwargs
        self.contiguous, self.epilogue = contiguous, epilogue
        self.register_buffer("final_logits_bias", torch.randn(1, vocab))

    def forward(self, x, y):
        logits = self.head(torch.tanh(self.body(x)))  # (B, T, V)
        if self.contiguous:  # as OPT's head
            logits = logits.contiguous()
        if self.epilogue:
            logits = EPILOGUES[self.epilogue](self, logits)
        flat = getattr(logits, self.flatten)(-1, logits.size(-1))
        loss = F.cross_entropy(flat, y.view(-1), **self.loss_kwargs)
        return (loss, logits) if self.return_logits else loss


def _batch(vocab=VOCAB, T=25, ignore=None, seed=0):
    """(x, y) of 2 x 25 rows — 50 rows: the last chunk is short."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, T, HIDDEN, generator=g)
    y = torch.randint(0, vocab, (2, T), generator=g)
    if ignore is not None:
        y[0, :7] = ignore
        y[1, -3:] = ignore
    return x, y


def _chunk(model, *args, expect=1):
    """Capture, run only chunked_lm_loss (through run_passes, as the backend does); lints."""
    gm, ex = capture(model, *args)
    chunked_lm_loss.refusals.clear()
    gm, fired = run_passes(gm, ex, ["chunked_lm_loss"])
    gm.graph.lint()
    assert fired == {"chunked_lm_loss": expect}, chunked_lm_loss.refusals
    return gm


def _assert_exact(model, x, y, loss=lambda out: out):
    compiled, seen = compile_with_pass(chunked_lm_loss, model)
    loss_err, worst = compare_with_eager(lambda: model(x, y), lambda: compiled(x, y), list(model.parameters()), loss)
    assert loss_err < TOL and worst < TOL, (loss_err, worst)
    ((gm, fired),) = seen
    return gm, fired


def _chunked_nodes(gm):
    return calls(gm, chunked_cross_entropy)


@pytest.mark.parametrize(
    "kwargs, ignore",
    [
        ({}, None),
        ({"bias": True}, None),
        ({"flatten": "reshape"}, None),
        ({}, -100),  # HF's default ignore_index, rows masked out
        ({"ignore_index": -1}, -1),  # nanoGPT's
        ({"reduction": "sum"}, -100),
        ({"reduction": "sum", "bias": True, "ignore_index": 7}, 7),
        ({"contiguous": True}, -100),
        ({"epilogue": "mul"}, -100),
        ({"epilogue": "div", "reduction": "sum"}, None),
        ({"epilogue": "softcap"}, -100),
        ({"epilogue": "softcap", "bias": True}, None),
        ({"epilogue": "bias"}, -100),
        ({"epilogue": "bias", "bias": True}, None),
    ],
    ids=[
        "plain", "bias", "reshape", "ignore-100", "ignore-1", "sum", "sum-bias-ignore7", "contiguous",
        "scaled", "divided-sum", "softcapped", "softcapped-bias", "bias-added", "bias-added-to-bias",
    ],
)  # fmt: skip
def test_head_forms_chunked_and_exact(kwargs, ignore):
    torch.manual_seed(0)
    model = Head(**kwargs)
    x, y = _batch(ignore=ignore)
    gm = _chunk(model, x, y)
    (node,) = _chunked_nodes(gm)
    assert not calls(gm, F.cross_entropy) and not calls(gm, F.linear)[1:], gm.code  # only the body's linear
    assert node.args[4] == kwargs.get("ignore_index", -100) and node.args[5] == kwargs.get("reduction", "mean")
    assert node.args[6] < 50, "more than one chunk"
    epilogue = kwargs.get("epilogue")
    expected = {"mul": ("mul", 0.0625), "div": ("div", 3.0), "softcap": ("softcap", 2.0)}.get(epilogue)
    assert node.args[9] == expected
    assert not calls(gm, torch.tanh)[1:] and not calls(gm, operator.mul), gm.code  # only the body's tanh
    gm, fired = _assert_exact(model, x, y)
    assert fired == 1


@pytest.mark.parametrize("return_logits", [False, True])
def test_a_batch_with_every_label_ignored_gives_zero_gradients_as_eager(return_logits):
    """A micro-batch of prompt tokens only (every label -100): eager's mean loss is NaN (0/0)
    and its gradients 0; the chunked backward scaled its zero gradients by 1/0, all NaN."""
    torch.manual_seed(0)
    model = Head(return_logits=return_logits)
    x, y = _batch()
    y[:] = -100
    compiled, seen = compile_with_pass(chunked_lm_loss, model)
    for run in (model, compiled):
        out = run(x, y)
        loss = out[0] if return_logits else out
        assert torch.isnan(loss)
        loss.backward()
    ((_, fired),) = seen
    assert fired == 1
    assert all(torch.equal(p.grad, torch.zeros_like(p.grad)) for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"contiguous": True}, {"bias": True}, *({"epilogue": e, "bias": True} for e in EPILOGUES)],
    ids=["linear", "contiguous", "bias", *(f"{e}-epilogue" for e in EPILOGUES)],
)
def test_logits_returned_are_eagers_and_carry_their_gradient(kwargs):
    """Logits only returned leave the step without a gradient and get it outside (the graph
    returns the head's input beside them); a loss on the logits alone, or on both, trains as
    eager does, through what the head does to its logits."""
    torch.manual_seed(0)
    model = Head(return_logits=True, **kwargs)
    x, y = _batch(ignore=-100)
    compiled, seen = compile_with_pass(chunked_lm_loss, model)
    for loss in (lambda out: out[0] + out[1].square().mean(), lambda out: out[1].square().mean()):
        loss_err, worst = compare_with_eager(
            lambda: model(x, y), lambda: compiled(x, y), list(model.parameters()), loss
        )
        assert loss_err < TOL and worst < TOL, (loss_err, worst)
    ((gm, fired),) = seen
    assert fired == 1
    (node,) = _chunked_nodes(gm)
    assert node.args[7] is True and node.args[8] is False, "returns the logits, their gradient outside"
    loss, logits = compiled(x, y)
    ref_loss, ref_logits = model(x, y)
    assert logits.requires_grad
    assert torch.allclose(logits, ref_logits, rtol=TOL, atol=1e-6)
    assert torch.allclose(loss, ref_loss, rtol=TOL)


class _NoGradHead(Head):
    """The head and loss in a no_grad region (an evaluation metric); the logits returned."""

    def forward(self, x, y):
        h = torch.tanh(self.body(x))
        with torch.no_grad():
            logits = self.head(h)
            metric = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        return h.square().mean(), metric, logits


class _GradHead(Head):
    """A forward that enables grad itself, called under no_grad."""

    def forward(self, x, y):
        with torch.enable_grad():
            logits = self.head(torch.tanh(self.body(x)))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)), logits


@pytest.mark.parametrize("model_cls", [_NoGradHead, _GradHead], ids=["no-grad-region", "grad-enabled-inside"])
def test_returned_logits_have_a_gradient_exactly_where_eagers_do(model_cls):
    torch.manual_seed(0)
    model = model_cls()
    x, y = _batch(ignore=-100)
    compiled = torch.compile(model, backend="fxmem", options={"compiler": "eager", "passes": ["chunked_lm_loss"]})
    context = torch.no_grad if model_cls is _GradHead else contextlib.nullcontext
    with context():
        got, ref = compiled(x, y), model(x, y)
    assert [t.requires_grad for t in got] == [t.requires_grad for t in ref]
    assert fxmem.recent_plans()[-1].rewrites == {"chunked_lm_loss": 1}

    def loss(out):  # what the caller can train on: the logits, and the loss where it has a gradient
        trained = [t for t in out if t.requires_grad]
        return sum(t.square().mean() for t in trained)

    ref_grads, got_grads = [], []
    for out, grads in ((ref, ref_grads), (got, got_grads)):
        zero_grads(model)
        loss(out).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in ref_grads[0].items():
        other = got_grads[0][name]
        assert (g is None) == (other is None), name
        if g is not None:
            assert torch.allclose(other, g, rtol=TOL, atol=1e-7), name


@pytest.mark.parametrize("epilogue", [None, "softcap", "bias"])
def test_logits_the_graph_reads_again_keep_their_gradient_inside(epilogue):
    class Softmaxed(Head):
        def forward(self, x, y):
            logits = self.head(torch.tanh(self.body(x)))
            if self.epilogue:
                logits = EPILOGUES[self.epilogue](self, logits)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)), logits.softmax(-1)

    torch.manual_seed(0)
    model = Softmaxed(bias=True, epilogue=epilogue)
    x, y = _batch(ignore=-100)
    gm, fired = _assert_exact(model, x, y, loss=lambda out: out[0] + out[1][..., 0].sum())
    assert fired == 1
    (node,) = _chunked_nodes(gm)
    assert node.args[7] is True and node.args[8] is True


def test_returned_logits_cost_no_gradient_when_only_the_loss_trains():
    """A compiled step's backward receives zeros for every output that gets no gradient; for
    returned logits that would be a second copy of them. Measured: while the caller holds the
    logits and backpropagates the loss alone, the step holds little beyond one copy."""
    torch.manual_seed(0)
    vocab, rows = 4096, 1024
    model = Head(vocab=vocab, return_logits=True)
    x, y = _batch(vocab=vocab, T=rows // 2)
    logits_bytes = rows * vocab * 4  # 16 MiB; parameters and batch: 0.3 MiB

    def train(m):
        loss, logits = m(x, y)
        loss.backward()
        return loss, logits

    ref_loss = train(model)[0]
    ref_grads = grads_of(model)
    zero_grads(model)
    m = fxmem.optimize(model, 4.0, compiler="eager", passes=("chunked_lm_loss",))
    train(m)  # compiles and plans
    zero_grads(model)
    measured = fxmem.measure(train, m)
    assert m.plan.rewrites == {"chunked_lm_loss": 1}
    assert measured.peak_bytes < 1.25 * logits_bytes, (measured.peak_bytes, logits_bytes)
    assert measured.peak_bytes <= m.plan.predicted_peak_bytes * 1.02
    assert torch.allclose(measured.result[0], ref_loss, rtol=TOL)
    assert grad_err(grads_of(model), ref_grads) < TOL


@pytest.mark.parametrize("compiler", ["inductor", "eager"])
def test_the_backward_reads_nothing_of_returned_logits(compiler):
    """Logits only returned are no saved value of the step: a caller keeping only the loss
    frees them when the forward ends, and the caller's edits to them before the backward (in
    place under no_grad, through `.data`) leave the gradients exact. (Read from the saved
    logits, such edits made inductor's gradients 14% wrong, and raised under eager.)"""
    torch.manual_seed(0)
    model = Head(vocab=4 * HIDDEN, bias=True, return_logits=True)
    x, y = _batch(vocab=4 * HIDDEN, ignore=-100)
    model(x, y)[0].backward()
    ref_grads = grads_of(model)
    zero_grads(model)
    m = fxmem.optimize(model, 4.0, compiler=compiler, passes=("chunked_lm_loss",))
    shapes = []
    for edit in (lambda t: t.mul_(2), lambda t: t.data.fill_(0.0)):
        shapes.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            loss, logits = m(x, y)
        assert m.plan.rewrites == {"chunked_lm_loss": 1}
        # Saved: the head's h, w, b and per-row values (log-sum-exp, targets); no logits.
        assert shapes and all(math.prod(s) < logits.numel() for s in shapes), (shapes, logits.shape)
        with torch.no_grad():
            edit(logits)
        loss.backward()
        assert grad_err(grads_of(model), ref_grads) < 1e-4  # inductor's kernels reorder sums
        zero_grads(model)


def test_no_grad_forward_is_eagers_loss():
    torch.manual_seed(0)
    model = Head(bias=True)
    x, y = _batch(ignore=-100)
    compiled, seen = compile_with_pass(chunked_lm_loss, model)
    with torch.no_grad():
        got, ref = compiled(x, y), model(x, y)
    assert seen[0][1] == 1
    assert torch.allclose(got, ref, rtol=TOL)


def test_no_grad_loss_and_logits_run_the_head_once():
    """Evaluation with labels (an HF model's loss and logits under no_grad) forms no gradients:
    one matmul, the logits', and the loss from their rows."""
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(2, 25, HIDDEN, generator=g), torch.randn(VOCAB, HIDDEN, generator=g)
    y = torch.randint(0, VOCAB, (50,), generator=g)
    matmuls = (F.linear, torch.matmul, torch.Tensor.__matmul__, torch.mm, torch.addmm)
    calls = []

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in matmuls:
                calls.append(func)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count():
        loss, logits = chunked_cross_entropy(h, w, None, y, chunk_rows=16, return_logits=True, logits_grad=False)
    assert calls == [F.linear]
    assert torch.equal(logits, F.linear(h, w))
    assert torch.allclose(loss, F.cross_entropy(logits.view(-1, VOCAB), y), rtol=TOL)


def test_nanogpt_head_end_to_end():
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx, tgt = gpt_batch(cfg, 2, 64)
    ref = step(model, idx, tgt)
    ref_grads = grads_of(model)
    zero_grads(model)
    m = fxmem.optimize(model, 4.0, compiler="eager", passes=("chunked_lm_loss",))
    got = step(m, idx, tgt)
    assert m.plan.rewrites == {"chunked_lm_loss": 1}
    assert torch.allclose(got, ref, rtol=TOL)
    assert grad_err(grads_of(model), ref_grads) < TOL


def _floor(model, batch, passes):
    """(floor bytes, bytes the step itself allocates at the floor's peak)."""
    try:
        fxmem.optimize(model, 1e-6, compiler="eager", passes=passes, example_inputs=batch)
    except fxmem.BudgetError as e:
        static = ("parameters", "inputs and buffers", "other live tensors")
        return e.floor_bytes, sum(v for k, v in e.breakdown.items() if k not in static)
    raise AssertionError("a 1 KiB budget was accepted")


def test_at_its_floor_the_logits_are_never_whole():
    """The backward runs the chunk loop chunk by chunk: at the floor, measured, far less than
    one copy of the logits is alive beyond what the step must keep, and gradients are exact."""
    torch.manual_seed(0)
    model = Head(vocab=2048)
    x, y = _batch(vocab=2048, T=200)  # 400 rows: logits 3.1 MiB, 31 chunks of 13 rows
    logits_bytes = 400 * 2048 * 4
    ref = step(model, x, y)
    ref_grads = grads_of(model)
    zero_grads(model)
    floor, step_bytes = _floor(model, (x, y), ("chunked_lm_loss",))
    assert step_bytes < logits_bytes / 2, step_bytes
    assert _floor(model, (x, y), ())[1] > 2 * logits_bytes  # without the pass: logits and their gradient
    m = fxmem.optimize(model, (floor + 1) / 2**30, compiler="eager", passes=("chunked_lm_loss",))
    step(m, x, y)  # compiles and plans
    zero_grads(model)
    measured = fxmem.measure(step, m, x, y)
    assert m.plan.rewrites == {"chunked_lm_loss": 1}
    assert measured.peak_bytes <= m.plan.budget_bytes
    assert torch.allclose(measured.result, ref, rtol=TOL)
    assert grad_err(grads_of(model), ref_grads) < TOL


@pytest.mark.parametrize("return_logits", [False, True], ids=["loss", "loss-and-logits"])
def test_head_with_inductor(return_logits):
    torch.manual_seed(0)
    model = Head(vocab=80, bias=True, return_logits=return_logits)  # 5 chunks: as few as still show the aliasing
    x, y = _batch(vocab=80, ignore=-100)

    def train(m):  # with the logits: a loss on them too, their gradient formed outside the step
        out = m(x, y)
        loss = out[0] + out[1].square().mean() if return_logits else out
        loss.backward()
        return loss.detach()

    ref = train(model)
    ref_grads = grads_of(model)
    zero_grads(model)
    m = fxmem.optimize(model, 4.0, passes=("chunked_lm_loss",))  # inductor
    got = train(m)
    assert m.plan.rewrites == {"chunked_lm_loss": 1}
    assert torch.allclose(got, ref, rtol=TOL)
    assert grad_err(grads_of(model), ref_grads) < 1e-4  # inductor's kernels reorder sums


@pytest.mark.parametrize("return_logits", [False, True], ids=["loss", "loss-and-logits"])
def test_the_chunks_share_their_kernels_under_inductor(return_logits):
    """Each chunk reads its targets (and, in a backward working chunk by chunk, its log-sum-exps)
    from a buffer of its own (`fxmem.opaque.row_chunks`): read through a slice, the chunk's row
    offset is written into its kernels' code, and each of the 5 chunks compiles kernels of its
    own (an LM returning its logits, 32 chunks: 40 kernels in all and a 36 s first call on 2
    CPU cores; 10 kernels and 24 s so)."""
    torch.manual_seed(0)
    model = Head(vocab=80, bias=True, return_logits=return_logits)  # 5 chunks of 10 rows
    x, y = _batch(vocab=80, ignore=-100)
    ref = model(x, y)
    (ref[0] if return_logits else ref).backward()
    ref_grads = grads_of(model)
    zero_grads(model)
    m = fxmem.optimize(model, 4.0, passes=("chunked_lm_loss",))

    def train():
        out = m(x, y)
        (out[0] if return_logits else out).backward()

    _, codes = run_and_get_code(train)
    assert m.plan.rewrites == {"chunked_lm_loss": 1}
    assert grad_err(grads_of(model), ref_grads) < 1e-4  # inductor's kernels reorder sums
    # One kernel exponentiates each chunk's logits, whichever chunk it is called for.
    exps = {name for code in codes for name in re.findall(r"^(cpp_fused\w*_exp_\w*) = ", code, re.M)}
    assert len(exps) == 1, sorted(exps)


def test_the_weight_gradient_sum_stays_two_buffers_where_inductor_splits_addmm(monkeypatch):
    """On a GPU inductor splits an addmm whose readers are all pointwise into its matmul and an
    add fused into them. The backward's weight gradient is a chain of addmms, one per chunk,
    whose last one a tied embedding's gradient is added to: split down the chain, every
    chunk's product was written on its own and summed in one kernel. With that split forced on
    the CPU, measured: the backward holds the running sums, the embedding's gradient and one
    chunk, not a product per chunk (split: 142 MiB over what the forward left, here 22)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    import torch._inductor.fx_passes.post_grad as post_grad

    monkeypatch.setattr(post_grad, "is_gpu", lambda device: True)
    vocab, hidden, rows = 8192, 256, 2048  # 16 chunks of 128 rows; the weight 8 MiB
    g = torch.Generator().manual_seed(0)
    ids, y = torch.randint(0, vocab, (rows,), generator=g), torch.randint(0, vocab, (rows,), generator=g)
    w = torch.randn(vocab, hidden, generator=g, requires_grad=True)

    def tied(ids, w, y, loss):  # the head's weight is the embedding's
        return loss(F.embedding(ids, w) * 2, w, y)

    def chunked(h, w, y):
        return chunked_cross_entropy(h, w, None, y, -100, "mean", 128, True, False)[0]

    tied(ids, w, y, lambda h, w, y: F.cross_entropy(F.linear(h, w), y)).backward()
    ref, w.grad = w.grad, None
    with (
        inductor_config.patch(fx_graph_cache=False),  # compiled here, with the split
        functorch_config.patch(enable_autograd_cache=False),
    ):
        compiled = torch.compile(tied, backend="inductor")
        compiled(ids, w, y, chunked).backward()  # compiles
        w.grad = None
        loss = fxmem.measure(compiled, ids, w, y, chunked).result  # what the backward frees, seen made
        measured = fxmem.measure(loss.backward)
    weight_bytes = vocab * hidden * 4
    assert measured.peak_bytes - measured.entry_bytes < 4 * weight_bytes, (measured.peak_bytes, measured.entry_bytes)
    assert grad_err({"w": w.grad}, {"w": ref}) < 1e-4  # inductor's kernels reorder sums


# --- Hugging Face *ForCausalLM: the loss and the logits both come back --------------------------

transformers = pytest.importorskip("transformers")


def _hf(name):
    torch.manual_seed(0)
    if name == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=None,
        )  # fmt: skip
        return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager")
    if name == "opt":  # its logits are `lm_head(h).contiguous()`
        # Without biases: a key bias's gradient is zero in exact arithmetic, rounding noise here.
        cfg = transformers.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
            enable_bias=False,
        )  # fmt: skip
        return transformers.OPTForCausalLM._from_config(cfg, attn_implementation="eager")
    if name in ("cohere", "gemma2"):  # logits scaled; logits capped softly
        config, model = {
            "cohere": (transformers.CohereConfig, transformers.CohereForCausalLM),
            "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        }[name]
        extra = {"final_logit_softcapping": 1.0} if name == "gemma2" else {}  # its logits reach 1
        cfg = config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
            **extra,
        )  # fmt: skip
        return model._from_config(cfg, attn_implementation="eager")
    if name == "bart":  # a bias buffer added to the logits
        cfg = transformers.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=0,
            eos_token_id=0, decoder_start_token_id=0,
        )  # fmt: skip
        model = transformers.BartForConditionalGeneration._from_config(cfg, attn_implementation="eager")
        with torch.no_grad():  # zeros when made
            model.final_logits_bias.normal_()
        return model
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")


@pytest.mark.parametrize("name", ["llama", "gpt2", "opt", "cohere", "gemma2", "bart"])
def test_hf_causal_lm_loss_and_logits(name):
    model = _hf(name).train()
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt the loss ignores
    kwargs = {"input_ids": ids, "labels": labels}
    params = list(model.parameters())
    compiled, seen = compile_with_pass(chunked_lm_loss, model)

    def both(out):  # a loss that reads the logits too: their gradient must add in
        return out.loss + out.logits.square().mean()

    loss_err, worst = compare_with_eager(lambda: model(**kwargs), lambda: compiled(**kwargs), params, both)
    assert loss_err < TOL and worst < TOL, (loss_err, worst)
    ((gm, fired),) = seen
    assert fired == 1
    (node,) = _chunked_nodes(gm)
    assert node.args[7] is True
    out, ref = compiled(**kwargs), model(**kwargs)
    assert torch.allclose(out.logits, ref.logits, rtol=TOL, atol=1e-6)
    assert torch.allclose(out.loss, ref.loss, rtol=TOL)
    # and with the loss alone backpropagated (no gradient sent into the logits)
    loss_err, worst = compare_with_eager(lambda: model(**kwargs).loss, lambda: compiled(**kwargs).loss, params)
    assert loss_err < TOL and worst < TOL, (loss_err, worst)


def test_hf_llama_end_to_end_all_passes():
    model = _hf("llama").train()
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    ref = model(input_ids=ids, labels=ids)
    (ref.loss + ref.logits.square().mean()).backward()
    ref_grads = grads_of(model)
    zero_grads(model)
    m = fxmem.optimize(model, 4.0, compiler="eager")
    out = m(input_ids=ids, labels=ids)
    (out.loss + out.logits.square().mean()).backward()
    assert m.plan.rewrites == {
        "index_as_slice": 0,
        "swap_sdpa": 1,
        "fuse_projections": 2,
        "chunked_attention": 0,
        "chunked_lm_loss": 1,
        "detach_caches": 2,  # its one layer's keys and values
    }
    assert torch.allclose(out.logits, ref.logits, rtol=TOL, atol=1e-6)
    assert torch.allclose(out.loss, ref.loss, rtol=TOL)
    assert grad_err(grads_of(model), ref_grads) < TOL


# --- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"label_smoothing": 0.1}, "label smoothing"),
        ({"reduction": "none"}, "per-row"),
        ({"vocab": 3 * HIDDEN}, "under 4x"),
    ],
    ids=["label_smoothing", "reduction-none", "small-vocab"],
)
def test_refused_and_untouched(kwargs, reason):
    torch.manual_seed(0)
    vocab = kwargs.get("vocab", VOCAB)
    model = Head(**kwargs)
    x, y = _batch(vocab=vocab)
    gm = _chunk(model, x, y, expect=0)
    assert any(reason in r for _, _, r in chunked_lm_loss.refusals), chunked_lm_loss.refusals
    assert calls(gm, F.cross_entropy) and not _chunked_nodes(gm)
    _, fired = _assert_exact(model, x, y, loss=lambda out: out.sum())
    assert fired == 0


class _LearnedScale(Head):
    """Logits scaled by a parameter: the scale's gradient reads the logits."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x, y):
        logits = self.head(torch.tanh(self.body(x))) * self.scale
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


class _PerRowBias(Head):
    """A bias per row added to the logits: none of the head's."""

    def forward(self, x, y):
        h = torch.tanh(self.body(x))
        logits = self.head(h) + h.mean(-1, keepdim=True)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


class _BiasUnderAutocast(Head):
    """BART's head under bf16 autocast: the fp32 bias promotes the bf16 logits to fp32, which
    folded into the head's bias would be rounded to bf16."""

    def __init__(self):
        super().__init__(epilogue="bias")

    def forward(self, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(x, y)


@pytest.mark.parametrize(
    "model_cls, reason",
    [
        (_LearnedScale, "by a tensor"),
        (_PerRowBias, "not one bias per word"),
        (_BiasUnderAutocast, "changes the logits' dtype"),
    ],
    ids=["learned-scale", "per-row-bias", "bias-promoting"],
)
def test_logits_made_by_tensors_are_refused(model_cls, reason):
    torch.manual_seed(0)
    model = model_cls()
    x, y = _batch()
    _chunk(model, x, y, expect=0)
    assert any(reason in r for _, _, r in chunked_lm_loss.refusals), chunked_lm_loss.refusals
    _, fired = _assert_exact(model, x, y)
    assert fired == 0


def test_symbolic_sizes_are_refused():
    # The backend fixes symbolic sizes before its passes run; a graph handed over with them
    # (dynamic=True) is left alone rather than chunked by a row count it cannot know.
    graphs = []

    def be(gm, ex):
        graphs.append((gm, ex))
        return gm.forward

    torch.manual_seed(0)
    model = Head()
    x, y = _batch()
    torch.compile(model, backend=be, fullgraph=True, dynamic=True)(x, y)
    ((gm, ex),) = graphs
    chunked_lm_loss.refusals.clear()
    gm, fired = run_passes(gm, ex, ["chunked_lm_loss"])
    assert fired == {"chunked_lm_loss": 0}
    assert any("symbolic shapes" in r for _, _, r in chunked_lm_loss.refusals), chunked_lm_loss.refusals
    assert calls(gm, F.cross_entropy) and not _chunked_nodes(gm)


def test_logits_used_before_the_loss_are_refused():
    class EarlyUse(Head):
        def forward(self, x, y):
            logits = self.head(torch.tanh(self.body(x)))
            z = logits.square().mean()  # a use of the logits that comes before the loss
            return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)) + z

    torch.manual_seed(0)
    model = EarlyUse()
    x, y = _batch()
    _chunk(model, x, y, expect=0)
    assert any("before its end" in r for _, _, r in chunked_lm_loss.refusals)
    _, fired = _assert_exact(model, x, y)
    assert fired == 0


def test_flattened_logits_used_elsewhere_are_refused():
    class FlatEscapes(Head):
        def forward(self, x, y):
            flat = self.head(torch.tanh(self.body(x))).view(-1, VOCAB)
            return F.cross_entropy(flat, y.view(-1)), flat

    torch.manual_seed(0)
    model = FlatEscapes()
    x, y = _batch()
    _chunk(model, x, y, expect=0)
    assert any("also used outside" in r for _, _, r in chunked_lm_loss.refusals)

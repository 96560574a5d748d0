"""microbatch_blocks: repeated blocks run over slices of the batch when the budget needs it.

The pass on its own (Dynamo's graph, run eagerly): which blocks it slices, exactness against
eager, what it refuses. Through `fxmem.optimize`: only a budget below the unsliced floor
slices, the floor drops, the budget holds as measured and the gradients are eager's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _graphs import calls, compile_with_pass
from conftest import grads_of, max_rel_err, step, zero_grads
from fxmem.passes.microbatch_blocks import microbatch_blocks, slice_candidates

import fxmem
from fxmem.pipeline import default_passes
from fxmem.testing import GPT, GPTConfig, ViT, ViTConfig, gpt_batch, vit_batch

TOL = 1e-5
SLICING = [*default_passes(), "microbatch_blocks"]
VIT = ViTConfig(image_size=32, patch_size=8, n_layer=2, n_head=2, n_embd=64)


def _sliced(slices):
    def run(gm, ex):
        return microbatch_blocks(gm, slices)

    return run


def _eager_grads(model, batch, **kwargs):
    zero_grads(model)
    loss = step(model, *batch, **kwargs)
    grads = grads_of(model)
    zero_grads(model)
    return loss, grads


@pytest.mark.parametrize("slices", [2, 3])
def test_vit_blocks_run_over_slices_exactly(slices):
    torch.manual_seed(0)
    model, batch = ViT(VIT), vit_batch(VIT, 4)
    ref_loss, ref = _eager_grads(model, batch)
    fn, seen = compile_with_pass(_sliced(slices), model)
    loss = step(fn, *batch)
    gm, fired = seen[0]
    assert fired == VIT.n_layer
    assert len(calls(gm, F.scaled_dot_product_attention)) == VIT.n_layer * slices
    assert torch.allclose(loss, ref_loss, rtol=TOL)
    assert max_rel_err(grads_of(model), ref) < TOL


def test_the_original_graph_is_left_as_it_was():
    torch.manual_seed(0)
    model, batch = ViT(VIT), vit_batch(VIT, 4)
    kept = []

    def run(gm, ex):
        before = str(gm.graph)
        new, fired = microbatch_blocks(gm, 2)
        kept.append((before, str(gm.graph), fired, new is gm))
        return new, fired

    fn, _ = compile_with_pass(run, model)
    step(fn, *batch)
    before, after, fired, same = kept[0]
    assert fired == VIT.n_layer and before == after and not same


class _NormBlock(nn.Module):
    """A block whose BatchNorm mixes the samples: it cannot run over slices."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)

    def forward(self, x):
        return x + self.bn(self.fc(x))


class _DropBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + F.dropout(self.fc(x), 0.1, training=True)


class _InPlaceBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        h = self.fc(x)
        h.mul_(2)
        return x + h


class _MeanBlock(nn.Module):
    """Each sample minus the batch's mean: a reduction over the batch."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        h = self.fc(x)
        return x + h - h.mean(0, keepdim=True)


class _InterleavedBlock(nn.Module):
    """Rows of every sample, position by position: one sample's rows are not together."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width // 4, width // 4)

    def forward(self, x):
        b, c = x.shape
        h = x.view(b, 4, c // 4).transpose(0, 1).reshape(-1, c // 4)  # (4 * b, c / 4)
        return x + self.fc(h).view(4, b, c // 4).transpose(0, 1).reshape(b, c)


class _ReversedBlock(nn.Module):
    """Each sample gathered from another's place: an index over the batch that is not arange."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        b, c = x.shape
        h = self.fc(x)
        return x + h[torch.arange(b - 1, -1, -1)[:, None], torch.arange(c)[None, :]]


class _TransposedOutBlock(nn.Module):
    """(B, C, S) in and out, a transposed view: rebuilt by cat, the output would be contiguous,
    and the next block's `.view` of it transposed back would fail."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        h = x.transpose(1, 2)
        b, s, c = h.shape
        return self.fc(h.view(-1, c)).tanh().view(b, s, c).transpose(1, 2)


class _Stack(nn.Module):
    def __init__(self, block, width=16, n=2):
        super().__init__()
        self.blocks = nn.ModuleList(block(width) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


@pytest.mark.parametrize(
    "block,reason",
    [
        (_NormBlock, "_bn_"),
        (_DropBlock, "dropout"),
        (_InPlaceBlock, "mul_"),
        (_MeanBlock, "mean"),
        (_InterleavedBlock, "reshape"),
        (_ReversedBlock, "getitem"),
    ],
)
def test_blocks_that_mix_samples_or_draw_are_left_whole(block, reason):
    torch.manual_seed(0)
    model = _Stack(block)
    x = torch.randn(8, 16)
    seen = []

    def run(gm, ex):
        batch, ok, refused = slice_candidates(gm)
        seen.append((batch, ok, refused))
        return microbatch_blocks(gm, 2)

    fn, fired = compile_with_pass(run, model)
    fn(x)
    batch, ok, refused = seen[0]
    assert batch == 8 and not ok and fired[0][1] == 0
    assert len(refused) == 2 and reason in refused["L['self'].blocks.0"].reason, refused


def test_a_block_whose_output_is_a_strided_view_is_left_whole():
    torch.manual_seed(0)
    model = _Stack(_TransposedOutBlock, width=8)
    x = torch.randn(8, 5, 8).transpose(1, 2)  # (B, C, S), a transposed view
    ref = model(x)
    seen = []

    def run(gm, ex):
        seen.append(slice_candidates(gm)[2])
        return microbatch_blocks(gm, 2)

    fn, fired = compile_with_pass(run, model)
    assert torch.allclose(fn(x), ref, rtol=TOL)
    assert fired[0][1] == 0 and "is not contiguous" in seen[0]["L['self'].blocks.0"].reason


class _PositionStack(nn.Module):
    """A table the same for every sample, cast with `type_as(x)`: x gives a dtype, not a shape
    (its features as many as the batch's samples, 4)."""

    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.fc = nn.Linear(width, width)

        def forward(self, x, pe):
            return self.fc(x + pe).tanh()

    def __init__(self, seq=5, width=4):
        super().__init__()
        self.pe = nn.Parameter(torch.randn(seq, width))
        self.blocks = nn.ModuleList(self.Block(width) for _ in range(2))

    def forward(self, x):
        pe = self.pe.type_as(x)
        for b in self.blocks:
            x = b(x, pe)
        return x.square().mean()


@pytest.mark.parametrize("slices", [2, 4])
def test_a_cast_like_the_batch_keeps_its_own_shape(slices):
    torch.manual_seed(0)
    model, x = _PositionStack(), torch.randn(4, 5, 4)
    ref_loss, ref = _eager_grads(model, (x,))
    fn, seen = compile_with_pass(_sliced(slices), model)
    loss = step(fn, x)
    assert seen[0][1] == 2
    assert torch.allclose(loss, ref_loss, rtol=TOL)
    assert max_rel_err(grads_of(model), ref) < TOL


def test_a_refused_budget_says_why_no_block_was_sliced():
    torch.manual_seed(0)
    e = _floor(_Stack(_NormBlock), (torch.randn(8, 16),), compiler="eager", passes=SLICING)
    assert e.plan.batch_slices == 1
    assert "microbatch_blocks left every block whole (2), blocks.0 because of" in str(e), e
    assert "_bn_" in str(e) and "writes in place" in str(e), e


def test_a_plain_stack_of_blocks_is_sliced():
    torch.manual_seed(0)
    model = _Stack(lambda w: nn.Sequential(nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w)))
    x = torch.randn(8, 16, requires_grad=True)
    ref = model(x)
    fn, seen = compile_with_pass(_sliced(4), model)
    out = fn(x)
    assert seen[0][1] == 2
    assert torch.allclose(out, ref, rtol=TOL)


class _RowsBlock(nn.Module):
    """GPT-2's Conv1D: the samples' rows merged into one dimension (`view(-1, C)`, or
    `flatten(0, 1)`), a matmul over rows, and the shape given back with the batch's size."""

    def __init__(self, width, flatten=False):
        super().__init__()
        self.w = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.b = nn.Parameter(torch.randn(width))
        self.flatten = flatten

    def forward(self, x):
        rows = x.flatten(0, 1) if self.flatten else x.view(-1, x.size(-1))
        return x + torch.addmm(self.b, rows, self.w).view(x.size()[:-1] + (self.w.shape[1],)).tanh()


@pytest.mark.parametrize("flatten", [False, True])
def test_blocks_over_the_rows_of_merged_samples_are_sliced_exactly(flatten):
    torch.manual_seed(0)
    model = _Stack(lambda w: _RowsBlock(w, flatten), n=3)
    x = torch.randn(8, 5, 16)
    ref_loss, ref = _eager_grads(model, (x,))
    fn, seen = compile_with_pass(_sliced(4), model)
    loss = step(fn, x)
    assert seen[0][1] == 3
    assert torch.allclose(loss, ref_loss, rtol=TOL)
    assert max_rel_err(grads_of(model), ref) < TOL


@pytest.mark.parametrize("name,padded", [("gpt2", False), ("llama", False), ("llama", True)])
def test_hf_decoder_layers_are_sliced_exactly(name, padded):
    """GPT-2's Conv1D rows; Llama's rotary tables (one for the batch) and float32 casts; both
    layers' key/value cache made from an empty tensor; a padding mask gathered by sample
    (`mask[arange(batch)[:, None, None, None], kv]`), with rows that attend to nothing."""
    pytest.importorskip("transformers")
    from test_hf_models import MODELS

    torch.manual_seed(0)
    model = MODELS[name](2)
    ids = torch.randint(0, 512, (4, 32))
    batch = {"input_ids": ids, "labels": ids}
    if padded:
        mask = torch.ones_like(ids)
        mask[1, :5] = mask[2, :17] = 0  # left padding
        batch.update(attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    ref_loss, ref = _eager_grads(model, (), **batch)
    fn, seen = compile_with_pass(_sliced(2), model)
    loss = step(fn, **batch)
    assert seen[0][1] == 2
    assert torch.allclose(loss, ref_loss, rtol=TOL)
    assert max_rel_err(grads_of(model), ref) < TOL


def _vit_case():
    cfg = ViTConfig(image_size=32, patch_size=4, n_layer=2, n_head=2, n_embd=64, classes=10)
    torch.manual_seed(0)
    return ViT(cfg), vit_batch(cfg, 16)


def _floor(model, batch, **kwargs):
    with pytest.raises(fxmem.BudgetError) as e:
        fxmem.optimize(model, 1e-6, example_inputs=batch, **kwargs)
    return e.value


def test_only_a_budget_below_the_unsliced_floor_slices_and_it_holds():
    model, batch = _vit_case()
    _, ref = _eager_grads(model, batch)
    whole = _floor(model, batch, compiler="eager")
    sliced = _floor(model, batch, compiler="eager", passes=SLICING)
    assert whole.plan.batch_slices == 1 and "microbatch_blocks" not in whole.plan.rewrites  # opt-in
    assert sliced.plan.batch_slices == 8 and sliced.plan.rewrites["microbatch_blocks"] == 2
    assert sliced.floor_bytes < 0.8 * whole.floor_bytes, (sliced.floor_bytes, whole.floor_bytes)

    roomy = fxmem.optimize(
        model, whole.floor_bytes * 1.5 / 2**30, example_inputs=batch, compiler="eager", passes=SLICING
    )
    assert roomy.plan.batch_slices == 1 and roomy.plan.rewrites["microbatch_blocks"] == 0

    budget = (sliced.floor_bytes + whole.floor_bytes) / 2
    m = fxmem.optimize(model, budget / 2**30, example_inputs=batch, compiler="eager", passes=SLICING)
    assert 1 < m.plan.batch_slices < sliced.plan.batch_slices  # fewer slices than the floor needs
    assert "batch slices" in m.plan.summary()
    # planned without compiling: the same slices, the same plan
    ahead = fxmem.optimize(model, budget / 2**30, compiler="eager", passes=SLICING).plan_for(batch, compile=False)
    assert (ahead.batch_slices, ahead.saved_nodes) == (m.plan.batch_slices, m.plan.saved_nodes)
    step(m, *batch)
    assert max_rel_err(grads_of(model), ref) < 1e-5
    zero_grads(model)
    measured = fxmem.measure(step, m, *batch).peak_bytes
    assert measured <= m.plan.budget_bytes, (measured, m.plan.budget_bytes)
    assert abs(m.plan.predicted_peak_bytes - measured) <= 0.10 * measured, (m.plan.predicted_peak_bytes, measured)


def test_a_saved_sliced_plan_applies_to_the_same_model(tmp_path):
    model, batch = _vit_case()
    sliced = _floor(model, batch, compiler="eager", passes=SLICING)  # the plan at the floor: 8 slices
    assert sliced.plan.batch_slices == 8
    path = sliced.plan.save(tmp_path, files=False)
    budget_gb = sliced.floor_bytes * 1.05 / 2**30  # room for what else lives beside the first
    again = fxmem.optimize(model, budget_gb, example_inputs=batch, compiler="eager", passes=SLICING, plan=path)
    assert again.plan.batch_slices == 8
    assert again.plan.saved_nodes == sliced.plan.saved_nodes


def test_gpt_blocks_are_sliced_after_swap_sdpa():
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64)
    torch.manual_seed(0)
    model, batch = GPT(cfg), gpt_batch(cfg, 4, 64)
    _, ref = _eager_grads(model, batch)
    sliced = _floor(model, batch, compiler="eager", passes=SLICING)
    assert sliced.plan.batch_slices == 4 and sliced.plan.rewrites["microbatch_blocks"] == cfg.n_layer
    m = fxmem.optimize(model, sliced.floor_bytes * 1.05 / 2**30, example_inputs=batch, compiler="eager", passes=SLICING)
    assert m.plan.batch_slices > 1
    step(m, *batch)
    assert max_rel_err(grads_of(model), ref) < 1e-5


def test_a_budget_below_hf_llamas_floor_is_met_by_slicing_its_layers():
    """Through the default passes, whose `detach_caches` puts each layer's cache detach by the
    output: the layers are still sliced, and the measured peak holds the budget. The floor
    unsliced is the same passes' (named, the projections stay fused)."""
    pytest.importorskip("transformers")
    from test_hf_models import MODELS

    torch.manual_seed(0)
    model = MODELS["llama"](2)
    ids = torch.randint(0, 512, (4, 128))
    batch = {"input_ids": ids, "labels": ids}
    _, ref = _eager_grads(model, (), **batch)
    whole = _floor(model, batch, compiler="eager", passes=default_passes())
    sliced = _floor(model, batch, compiler="eager", passes=SLICING)
    assert sliced.plan.rewrites["microbatch_blocks"] == 2
    assert sliced.floor_bytes < 0.9 * whole.floor_bytes, (sliced.floor_bytes, whole.floor_bytes)
    budget = (sliced.floor_bytes + whole.floor_bytes) / 2
    m = fxmem.optimize(model, budget / 2**30, example_inputs=batch, compiler="eager", passes=SLICING)
    assert m.plan.batch_slices > 1
    step(m, **batch)
    assert max_rel_err(grads_of(model), ref) < 1e-5
    zero_grads(model)
    measured = fxmem.measure(step, m, **batch).peak_bytes
    assert measured <= m.plan.budget_bytes, (measured, m.plan.budget_bytes)


def test_the_slice_count_comes_from_the_floors_found():
    from fxmem.backend import _next_slices

    mib = 2**20
    floors = {1: 100 * mib, 2: 80 * mib, 8: 44 * mib}  # a + b/n through 2 and 8: a = 32, b = 96 MiB
    assert _next_slices(floors, 2, 60 * mib, 8) == 4  # 32 + 96/4 = 56 <= 60 < 32 + 96/3
    assert _next_slices(floors, 2, 79 * mib, 8) == 3  # at least one more than the count that failed
    assert _next_slices(floors, 2, 30 * mib, 8) == 8  # below a: the most there are
    assert _next_slices({1: 100 * mib, 2: 80 * mib}, 2, 60 * mib, 3) == 3  # no floor at the most yet
    assert _next_slices({2: 80 * mib, 8: 80 * mib}, 2, 60 * mib, 8) is None  # slicing does not lower it
    assert _next_slices(floors, 8, 60 * mib, 8) is None

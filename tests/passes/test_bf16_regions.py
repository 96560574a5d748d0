"""bf16_regions: opt-in autocast bf16 over the step; fp32 master weights; documented tolerance.

Measured (small GPT, AdamW lr 1e-3, 6 steps, eager compiler, CPU): the largest difference of
the bf16 loss from the fp32 loss was 6e-5 on a loss of ~6.2; the test bounds it at 1e-2.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from _graphs import capture, run_graph
from conftest import small_gpt, step
from fxmem.passes.bf16_regions import bf16_regions

import fxmem
from fxmem.pipeline import run_passes

LOSS_TOLERANCE = 1e-2


def _train(m, model, batch, steps=6):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        losses.append(step(m, *batch).item())
        opt.step()
        opt.zero_grad()
    return losses


def test_off_by_default_and_on_with_precision_bf16():
    model, batch = small_gpt()
    fp32 = fxmem.optimize(copy.deepcopy(model), budget_gb=1.0, compiler="eager", example_inputs=batch)
    assert "bf16_regions" not in fp32.plan.rewrites
    bf16 = fxmem.optimize(model, budget_gb=1.0, compiler="eager", precision="bf16", example_inputs=batch)
    # 4 blocks x (qkv, proj, fc, proj linear + attention); the LM head, inside
    # chunked_lm_loss's call by then, runs in the region too but is not one op of the graph.
    assert bf16.plan.rewrites["bf16_regions"] == 4 * 5
    assert bf16.plan.predicted_peak_bytes < fp32.plan.predicted_peak_bytes


def test_loss_within_tolerance_over_a_short_run_and_master_weights_stay_fp32():
    model, batch = small_gpt()
    reference = copy.deepcopy(model)
    bf16 = fxmem.optimize(model, budget_gb=1.0, compiler="eager", precision="bf16")
    fp32 = fxmem.optimize(reference, budget_gb=1.0, compiler="eager")
    a, b = _train(bf16, model, batch), _train(fp32, reference, batch)
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < LOSS_TOLERANCE
    assert a[-1] < a[0]  # it trains
    assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())


def test_outputs_keep_their_dtype():
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x)

    x = torch.randn(4, 8)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch.compile(Head(), backend=capture, fullgraph=True)(x)
    gm, example_inputs = graphs[0]
    gm, fired = bf16_regions(gm, example_inputs)
    assert fired == 1
    gm.graph.lint()
    out = gm(*example_inputs)[0]
    assert out.dtype == torch.float32
    m = fxmem.optimize(Head(), budget_gb=1.0, compiler="eager", precision="bf16")
    assert m(x).dtype == torch.float32


def test_refuses_a_model_that_enters_autocast_itself():
    class Own(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.proj(x).float().sum()

    graphs: list[fx.GraphModule] = []
    torch.compile(Own(), backend=lambda gm, ex: graphs.append(gm) or gm.forward, fullgraph=True)(torch.randn(2, 8))
    before = graphs[0].code
    gm, fired = run_passes(graphs[0], [], ["bf16_regions"])
    assert fired == {"bf16_regions": 0}
    assert gm.code == before


class _PaddedAttention(torch.nn.Module):
    """Attention masked with fills taken from the scores' dtype, as HF writes them."""

    def __init__(self, form: str, c: int = 16, heads: int = 2):
        super().__init__()
        self.qkv, self.form, self.heads = torch.nn.Linear(c, 3 * c), form, heads

    def forward(self, x, keep):
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in self.qkv(x).chunk(3, -1))
        att = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        fill = torch.finfo(att.dtype).min
        if self.form == "masked_fill":
            att = att.masked_fill(~keep, fill)
        else:
            att = torch.where(keep, att, torch.full([], fill, dtype=att.dtype))
        return (torch.softmax(att, -1) @ v).sum()


@pytest.mark.parametrize("form", ["masked_fill", "where"])
def test_a_fill_taken_from_the_scores_dtype_is_bf16s_in_the_region(form):
    """Traced in fp32, `finfo(scores.dtype).min` is fp32's; the region makes it bf16's, as a
    model run under autocast takes it: rows the left padding drops whole stay finite."""
    torch.manual_seed(0)
    model, x = _PaddedAttention(form), torch.randn(2, 8, 16)
    keep = torch.ones(8, 8, dtype=torch.bool).tril().expand(2, 1, 8, 8).clone()
    keep[1, ..., :3] = False  # left padding: sample 1's first rows drop every key
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x, keep)
    gm, ex = capture(model, x, keep)
    gm, fired = bf16_regions(gm, ex)
    got = run_graph(gm, ex)
    assert fired == 3 and torch.isfinite(got) and torch.equal(got, want.float())


class _Combine(torch.nn.Module):
    """A mixture-of-experts combine: rows summed into a tensor made in the rows' traced dtype."""

    def __init__(self, c: int = 16):
        super().__init__()
        self.lin = torch.nn.Linear(c, c)

    def forward(self, x, idx):
        h = self.lin(x)
        out = torch.zeros(4, h.shape[1], dtype=h.dtype).index_add_(0, idx, h)
        spread = torch.zeros(4, h.shape[1], dtype=h.dtype).scatter_add(0, idx[:, None].expand_as(h), h)
        return (out * spread).sum()


def test_a_source_the_region_makes_bf16_is_written_into_a_tensor_of_the_traced_dtype():
    """`index_add_` and `scatter_add` raise for a bf16 source and an fp32 destination; the region
    casts the source to the destination's dtype, as close to autocast as its rounding."""
    torch.manual_seed(0)
    model, x, idx = _Combine(), torch.randn(6, 16), torch.tensor([0, 1, 2, 3, 0, 1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x, idx).float()
    gm, ex = capture(model, x, idx)
    gm, fired = bf16_regions(gm, ex)
    got = run_graph(gm, ex)
    assert fired == 1 and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=0.0)


def _on_two_devices(other, x, w, matmul_there):
    """A matmul on the CPU beside a tensor on another device (meta), read first: the graph's
    first input."""
    there = (other @ other.T if matmul_there else other * 2).sum()
    return (x @ w).sum(), there


def test_the_autocast_entered_is_that_of_the_device_the_matmuls_run_on():
    other, x, w = torch.randn(3, 2, device="meta"), torch.randn(2, 8), torch.randn(8, 8, requires_grad=True)
    gm, ex = capture(lambda *a: _on_two_devices(*a, matmul_there=False), other, x, w)
    assert ex[0].device.type == "meta"
    gm, fired = bf16_regions(gm, ex)
    (enter,) = [n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "_enter_autocast"]
    assert fired == 1 and enter.args[0] == "cpu"
    gm, ex = capture(lambda *a: _on_two_devices(*a, matmul_there=True), other, x, w)
    before = gm.code
    gm, fired = bf16_regions(gm, ex)
    assert fired == 0 and gm.code == before

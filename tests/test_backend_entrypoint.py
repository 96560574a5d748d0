"""`torch.compile(model, backend="fxmem", options=...)` with only `import torch`.

Dynamo finds the backend through the `torch_dynamo_backends` entry point; fxmem is imported
when `torch.compile` looks the name up, never before. The step runs in a fresh interpreter so
that nothing this test process imported can make the lookup succeed.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import grads_of, max_rel_err, step, zero_grads

import fxmem
from fxmem.pipeline import default_passes

# One definition, exec'd here and in the child: a small causal self-attention stack whose
# (B, H, T, T) score tensors dominate the step, as in conftest's GPT.
MODEL_SRC = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.h = h
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (C // self.h) ** -0.5
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, C)
            x = x + self.proj(y)
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class TinyLM(nn.Module):
        def __init__(self, vocab=256, d=64, h=4, n_layer=3, t=256):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(t, d)
            self.blocks = nn.ModuleList(Block(d, h) for _ in range(n_layer))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for b in self.blocks:
                x = b(x)
            logits = self.head(self.ln(x))
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    def build():
        torch.manual_seed(0)
        model = TinyLM()
        g = torch.Generator().manual_seed(1)
        idx = torch.randint(0, 256, (4, 256), generator=g)
        return model, (idx, idx.roll(-1, dims=1))
    """
)

# The child: fxmem must not be loaded until torch.compile resolves backend="fxmem".
CHILD_SRC = textwrap.dedent(
    """
    import copy, json, sys
    import torch

    exec(MODEL_SRC)
    model, batch = build()
    eager = copy.deepcopy(model)

    def step(m, *args):
        loss = m(*args)
        loss.backward()
        return loss.detach()

    loss_ref = step(eager, *batch)
    ref = {n: p.grad.detach().clone() for n, p in eager.named_parameters()}
    del eager  # only its gradients stay, as in test_api (the parent's budget never saw it)

    loaded_before = "fxmem" in sys.modules
    compiled = torch.compile(model, backend="fxmem", options={"budget_gb": BUDGET_GB, "compiler": "eager"})
    loaded_by_compile = "fxmem" in sys.modules
    step(compiled, *batch)  # plans and compiles
    for p in model.parameters():
        p.grad = None

    import fxmem  # allowed now: the entry point has imported it already

    got = fxmem.measure(step, compiled, *batch)
    plans = fxmem.recent_plans()
    errs = [((p.grad - ref[n]).norm() / ref[n].norm().clamp_min(1e-12)).item() for n, p in model.named_parameters()]
    print(json.dumps({
        "loaded_before": loaded_before,
        "loaded_by_compile": loaded_by_compile,
        "peak_bytes": got.peak_bytes,
        "predicted_peak_bytes": plans[-1].predicted_peak_bytes,
        "n_plans": len(plans),
        "n_recomputed": len(plans[-1].recomputed),
        "max_rel_err": max(errs),
        "loss_err": abs(got.result.item() - loss_ref.item()),
    }))
    """
)


def _build():
    scope: dict = {}
    exec(MODEL_SRC, scope)
    return scope["build"]()


def _eager_peak_bytes() -> int:
    model, batch = _build()
    step(model, *batch)  # warm-up, as test_api's _eager_reference
    zero_grads(model)
    return fxmem.measure(step, model, *batch).peak_bytes


def _run_child(budget_gb: float, cwd) -> dict:
    script = f"MODEL_SRC = {MODEL_SRC!r}\nBUDGET_GB = {budget_gb!r}\n" + CHILD_SRC
    # Run away from the checkout, so fxmem is found as the installed distribution.
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_entry_point_backend_holds_budget_in_fresh_interpreter(tmp_path):
    eager_peak = _eager_peak_bytes()
    budget_bytes = 0.45 * eager_peak  # the default passes alone bring the step to about 60%
    res = _run_child(budget_bytes / 2**30, tmp_path)
    assert not res["loaded_before"], "fxmem was imported before torch.compile looked it up"
    assert res["loaded_by_compile"], "torch.compile did not load fxmem through its entry point"
    assert res["n_plans"] == 1
    assert res["n_recomputed"] > 0, "a budget this tight needs recomputation"
    assert res["peak_bytes"] <= budget_bytes, (
        f"measured {res['peak_bytes'] / 2**20:.2f} MiB > budget {budget_bytes / 2**20:.2f} MiB "
        f"(eager {eager_peak / 2**20:.2f} MiB)"
    )
    assert abs(res["predicted_peak_bytes"] - res["peak_bytes"]) <= 0.15 * res["peak_bytes"]
    assert res["max_rel_err"] < 1e-4
    assert res["loss_err"] <= 1e-5


def _step_at_length(t, compiled, model, eager, idx, targets, budget):
    """A step on the first `t` tokens (planned when the length is new): gradients as eager's,
    and the measured peak within the budget."""
    batch = idx[:, :t].contiguous(), targets[:, :t].contiguous()
    zero_grads(eager)
    step(eager, *batch)
    zero_grads(model)
    step(compiled, *batch)
    assert max_rel_err(grads_of(model), grads_of(eager)) < 1e-4, t
    zero_grads(model)
    assert fxmem.measure(step, compiled, *batch).peak_bytes <= budget, t


@pytest.mark.parametrize("dynamic", [None, True])
def test_each_input_shape_is_planned_and_holds_the_budget(dynamic):
    # Dynamo makes sizes symbolic from the second shape on (dynamic=None) or from the first
    # (True); fxmem plans each shape as it comes, the budget holding at each.
    model, (idx, targets) = _build()
    eager, _ = _build()
    budget = 0.45 * _eager_peak_bytes()
    plans = []
    options = {"budget_gb": budget / 2**30, "compiler": "eager", "on_plan": plans.append}
    compiled = torch.compile(model, backend="fxmem", dynamic=dynamic, options=options)
    for n, t in enumerate((256, 128, 192, 256)):
        _step_at_length(t, compiled, model, eager, idx, targets, budget)
        assert len(plans) == min(n + 1, 3), t  # 256 again reuses its plan
        # the passes see the sizes fixed: the same rewrites at every shape
        assert plans[-1].rewrites["swap_sdpa"] == 3 and plans[-1].rewrites["chunked_lm_loss"] == 1, t
        assert plans[-1].budget_bytes == int(budget)


@pytest.mark.parametrize("dynamic", [None, True])
def test_blocks_are_sliced_at_a_later_input_shape(dynamic):
    # A budget under the unsliced floor at 256 tokens: microbatch_blocks slices the blocks when
    # 256 comes second, its sizes symbolic to Dynamo, as when it comes first.
    model, (idx, targets) = _build()
    eager, _ = _build()
    with pytest.raises(fxmem.BudgetError) as info:
        fxmem.optimize(_build()[0], 1e-6, compiler="eager", example_inputs=(idx, targets))
    budget = 0.9 * info.value.floor_bytes
    plans = []
    options = {
        "budget_gb": budget / 2**30,
        "compiler": "eager",
        "passes": [*default_passes(), "microbatch_blocks"],
        "on_plan": plans.append,
    }
    compiled = torch.compile(model, backend="fxmem", dynamic=dynamic, options=options)
    for t in (128, 256):
        _step_at_length(t, compiled, model, eager, idx, targets, budget)
    assert plans[-1].batch_slices >= 2 and plans[-1].rewrites["microbatch_blocks"] == 3


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_module_float_dynamo_passes_as_a_tensor_is_planned_as_a_number(compiler):
    """Under dynamic=True Dynamo hands a dropout's p to the graph as a tensor: `swap_sdpa` failed
    on it (`float()` of a Proxy). Fixed to its value, with a guard: a new p plans again."""
    from fxmem.testing import GPT, GPTConfig, gpt_batch

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, block_size=128, n_layer=1, n_head=4, n_embd=64, dropout=0.1)
    model = GPT(cfg)
    batch, plans = gpt_batch(cfg, 4, 64), []
    options = {"budget_gb": 0.5, "compiler": compiler, "on_plan": plans.append}
    compiled = torch.compile(model, backend="fxmem", dynamic=True, options=options)
    compiled(*batch).backward()
    assert len(plans) == 1 and plans[0].rewrites["swap_sdpa"] == 1
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    zero_grads(model)
    loss = compiled(*batch)
    loss.backward()
    assert len(plans) == 2
    got = grads_of(model)
    zero_grads(model)
    assert torch.allclose(loss, model(*batch), rtol=1e-5)
    model(*batch).backward()
    assert max_rel_err(got, grads_of(model)) < 1e-4


class _Masked(torch.nn.Module):
    """A loss over the rows a mask keeps: how many is the data's to say."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        return h[h.sum(-1) > 0].square().sum()


def test_sizes_the_data_decides_are_refused():
    torch.manual_seed(0)
    model, x = _Masked(), torch.randn(64, 16)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="whose size depends on the data") as info:
            torch.compile(model, backend="fxmem", options={"compiler": "eager"})(x)
        assert isinstance(info.value.inner_exception, fxmem.DataDependentShapeError)
        torch._dynamo.reset()
        with pytest.raises(fxmem.DataDependentShapeError, match="capture_dynamic_output_shape_ops"):
            fxmem.optimize(model, 1.0, compiler="eager")(x)
    assert all(p.grad is None for p in model.parameters())
    # As Dynamo captures by default, the graph breaks at the indexing; each side is planned.
    model(x).backward()
    want = grads_of(model)
    zero_grads(model)
    plans = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxmem", options={"compiler": "eager", "on_plan": plans.append})
    compiled(x).backward()
    assert plans and max_rel_err(grads_of(model), want) < 1e-5


def _compile_and_call(options):
    """Options reach the backend only when Dynamo first compiles, so that call fails."""
    model, batch = _build()
    compiled = torch.compile(model, backend="fxmem", options=options)
    return compiled(*batch)


def _inner(info) -> BaseException:
    inner = getattr(info.value, "inner_exception", None)
    assert isinstance(inner, ValueError), repr(inner)
    return inner


def test_negative_budget_refused():
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="budget_gb") as info:
        _compile_and_call({"budget_gb": -1, "compiler": "eager"})
    assert "budget_gb" in str(_inner(info)) and "-1" in str(_inner(info))


def test_unknown_option_refused():
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="unknown fxmem option") as info:
        _compile_and_call({"budget_gb": 1.0, "compiler": "eager", "budget_gib": 1.0})
    msg = str(_inner(info))
    assert "budget_gib" in msg and "budget_gb" in msg  # names the bad key and the known ones


def test_graph_break_regions_reserve_what_earlier_regions_saved_and_nothing_else():
    import fxmem
    from fxmem.backend import recent_plans

    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(3)])
            self.b = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(3)])

        def forward(self, x):
            h = torch.tanh(self.a(x))
            torch._dynamo.graph_break()
            return torch.tanh(self.b(h)).square().mean()

    torch.manual_seed(0)
    model = Broken()
    x = torch.randn(2048, 256)
    model(x).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    eager_peak = fxmem.measure(lambda: model(x).backward()).peak_bytes
    for p in model.parameters():
        p.grad = None
    # The first region is planned before the second is seen, so it may use the budget freely;
    # the second then has to fit beside what the first saved (or be refused).
    budget = 1.0 * eager_peak
    compiled = torch.compile(model, backend="fxmem", options={"budget_gb": budget / 2**30, "compiler": "eager"})
    compiled(x).backward()
    first, second = recent_plans()[-2:]
    assert "earlier regions' activations" not in first.breakdown
    assert second.breakdown["earlier regions' activations"] == first.saved_bytes > 0
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref[n], rtol=1e-4, atol=1e-6), n
        p.grad = None
    assert fxmem.measure(lambda: compiled(x).backward()).peak_bytes <= budget
    # Only what is saved and pending is reserved: not the second region's activations when
    # the first is planned again (after a reset, at a new shape), nor another model's that
    # shares the options.
    options = {"budget_gb": budget / 2**30, "compiler": "eager"}
    for call in ("reset", "new shape", "other model"):
        if call == "reset":
            torch._dynamo.reset()
        other = copy.deepcopy(model) if call == "other model" else model
        rows = 1024 if call == "new shape" else 2048
        torch.compile(other, backend="fxmem", options=options)(x[:rows]).backward()
        first, second = recent_plans()[-2:]
        assert "earlier regions' activations" not in first.breakdown, call
        assert second.breakdown["earlier regions' activations"] == first.saved_bytes > 0, call


def test_small_matmuls_run_on_real_tensors_inside_a_backend_and_under_fake_mode():
    # On CUDA the backend runs them while Dynamo compiles, so that cuBLAS's workspaces exist
    # before the allocator's bytes outside tensors are counted; here, the same calls on CPU.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxmem.step_start import static_bytes
    from fxmem.workspaces import OUTSIDE_TENSORS, run_small_matmuls

    ran = []

    def backend(gm, example_inputs):
        ran.append(run_small_matmuls(torch.device("cpu")))
        ran.append(static_bytes(example_inputs, torch.device("cpu")))
        return gm.forward

    x = torch.randn(4, 4)
    assert torch.equal(torch.compile(lambda t: (t @ t).relu(), backend=backend)(x), (x @ x).relu())
    assert ran[0] is True and OUTSIDE_TENSORS not in ran[1]  # counted on CUDA only
    with FakeTensorMode():
        assert run_small_matmuls(torch.device("cpu")) is True


def test_small_matmuls_leave_the_callers_autograd_state_alone():
    from fxmem.workspaces import run_small_matmuls

    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        assert run_small_matmuls(torch.device("cpu")) is True
    assert packed == []  # an offloading or checkpointing hook sees nothing of them
    with torch.inference_mode():
        assert run_small_matmuls(torch.device("cpu")) is False  # no backward there, no error
    with torch.no_grad():
        assert run_small_matmuls(torch.device("cpu")) is True
    assert torch.is_grad_enabled()


def test_an_optimizer_the_backend_did_not_plan_for_warns_once():
    """Without options={"optimizer": ...}, AdamW's state (two copies of the parameters) is
    outside the plan from the second step on: the first step of such an optimizer warns."""
    import warnings

    nn = torch.nn
    torch.manual_seed(0)
    x = torch.randn(64, 256)

    def trained(options):
        model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))
        opt = torch.optim.AdamW(model.parameters())
        torch.compile(model, backend="fxmem", options={"budget_gb": 1.0, "compiler": "eager", **options(opt)})(
            x
        ).sum().backward()
        return model, opt

    _, opt = trained(lambda opt: {})
    with pytest.warns(fxmem.OptimizerNotPlannedWarning, match="options=") as warned:
        opt.step()
        opt.step()
    assert len(warned) == 1 and warned[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxmem.OptimizerNotPlannedWarning)
        _, planned = trained(lambda opt: {"optimizer": opt})
        planned.step()  # the optimizer the plan counts
        torch.optim.SGD(nn.Linear(2, 2).parameters()).step()  # other parameters: nothing to say
    model = nn.Sequential(nn.Linear(256, 1))
    m = fxmem.optimize(model, 1.0, compiler="eager")  # held: a module nobody holds has no plans to warn of
    m(x).sum().backward()
    opt = torch.optim.SGD(model.parameters())
    with pytest.warns(fxmem.OptimizerNotPlannedWarning) as warned:
        opt.step()
    assert len(warned) == 1 and "optimizer=" in str(warned[0].message)  # fxmem.optimize's own, alone

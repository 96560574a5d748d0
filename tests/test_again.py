"""Backward copies of forward values (fxmem/again.py): a copy of a cheap value for its late
readers, and saved residuals computed a second time below the floor of recomputing once."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import floor_plan, grads_of, max_rel_err, small_gpt, spy_on_partition, step, zero_grads

import fxmem
from fxmem import partition
from fxmem.again import COPY_OF, plan_second_recomputation
from fxmem.graph import BWD, FWD
from fxmem.testing import GPT, GPTConfig, gpt_batch

# Six blocks at T=256: residuals large enough beside the attention's working set that
# rebuilding every other one from the one before lowers the floor (on three, the kicks reach
# the same floor recomputing once).
DEEP_GPT = GPTConfig(vocab_size=2048, block_size=256, n_layer=6, n_head=2, n_embd=64)


def _deep_gpt():
    torch.manual_seed(0)
    return GPT(DEEP_GPT), gpt_batch(DEEP_GPT, 2, 256)


def test_late_readers_read_a_backward_copy(monkeypatch):
    """Each LayerNorm output is read by its Linear (forward) and by the weight's gradient (late
    in the backward): the gradient reads a copy the backward makes, the forward value none."""
    seen = spy_on_partition(monkeypatch)
    model, batch = small_gpt()
    step(model, *batch)
    ref = grads_of(model)
    zero_grads(model)
    step(fxmem.optimize(model, 1.0, example_inputs=batch), *batch)
    assert max_rel_err(grads_of(model), ref) < 1e-4
    jg, _ = seen[-1]
    copies = [i for i, n in enumerate(jg.nodes) if COPY_OF in n.meta]
    assert copies and all(jg.kind[i] == BWD for i in copies)
    originals = {jg.nodes[i].meta[COPY_OF] for i in copies}
    assert len(originals) >= 2 * 4, originals  # both LayerNorms of each of the 4 blocks, at least
    copied = {i for i, n in enumerate(jg.nodes) if n.name in originals}
    readers = [u for i in copied for u in jg.users[i] if jg.kind[u] == BWD and COPY_OF not in jg.nodes[u].meta]
    assert not readers, [jg.nodes[u].name for u in readers]


def test_without_a_fusing_compiler_no_copy_is_made(monkeypatch):
    """With the eager compiler a copy is an op of its own, no cheaper than saving the value."""
    seen = spy_on_partition(monkeypatch)
    model, batch = small_gpt()
    step(fxmem.optimize(model, 1.0, compiler="eager", example_inputs=batch), *batch)
    jg, _ = seen[-1]
    assert not any(COPY_OF in n.meta for n in jg.nodes)


@pytest.mark.slow
def test_a_second_recomputation_lowers_the_floor_and_holds_it(monkeypatch, one_thread):
    """With two threads the attention's workspace sets this model's floor, which a second
    recomputation does not lower: the test plans on one."""
    model, batch = _deep_gpt()
    step(model, *batch)
    ref = grads_of(model)
    zero_grads(model)
    floor, plan = floor_plan(model, batch)
    with monkeypatch.context() as patch:
        patch.setattr(partition, "_second_recomputation", lambda *a, **k: None)
        once, once_plan = floor_plan(model, batch)
    assert floor < once
    assert plan.second_recomputation["dropped"] and not once_plan.second_recomputation

    m = fxmem.optimize(model, floor / 2**30, example_inputs=batch)
    step(m, *batch)
    assert max_rel_err(grads_of(model), ref) < 1e-4
    zero_grads(model)
    measured = fxmem.measure(step, m, *batch).peak_bytes
    assert measured <= m.plan.budget_bytes
    assert abs(m.plan.predicted_peak_bytes - measured) <= 0.10 * measured
    dropped = m.plan.second_recomputation["dropped"]
    decisions = {d.name: d for d in m.plan.decisions}
    assert all(decisions[name].action == "recompute" and decisions[name].cost_s > 0 for name in dropped)
    assert "computed twice" in m.plan.summary()

    # A budget that recomputing once fits does not run anything a second time.
    zero_grads(model)
    loose = fxmem.optimize(model, once * 1.05 / 2**30).plan_for(batch, compile=False)
    assert loose.second_recomputation == {}


def test_a_value_computed_a_second_time_is_made_from_values_still_saved(monkeypatch):
    """Each dropped value is rebuilt from saved values none of which is dropped too, nor a view
    of one: with a block's attention output dropped, the residual after that block reads it
    through a saved view, and dropping that residual as well would rebuild it from the other's
    copy, two of one block's values held from the first rebuild on (on the torch 2.15 graph the
    floor stayed at that of recomputing once). Checked for the saved values of every state the
    planner walked through."""
    seen = spy_on_partition(monkeypatch, "_second_recomputation")
    model, batch = _deep_gpt()
    floor_plan(model, batch)
    jg, trajectory = seen[-1]
    min_bytes = trajectory.peak(trajectory.smallest) // partition._SECOND_MIN_SHARE
    index = {node.name: i for i, node in enumerate(jg.nodes)}
    planned = [plan_second_recomputation(jg, state.saved, min_bytes) for state in trajectory.states]
    for state, second in zip(trajectory.states, planned, strict=True):
        if second is None:
            continue
        dropped = [index[name] for name in second.dropped]
        gone = {jg.storage[x] for x in dropped}
        rebuilt = {index[name] for name in second.chain} | {
            j for j, s in enumerate(jg.storage) if s in gone and jg.kind[j] == FWD
        }
        for c in rebuilt:
            for j in jg.inputs[c]:
                if jg.kind[j] != FWD or jg.is_sym[j] or jg.nodes[j].op != "call_function":
                    continue
                if jg.storage[j] in gone:  # only a dropped value's own views read it
                    assert jg.storage[c] == jg.storage[j], (jg.nodes[c].name, jg.nodes[j].name)
                else:
                    assert j in rebuilt or state.saved[j], (jg.nodes[c].name, jg.nodes[j].name)
    assert sum(second is not None and len(second.dropped) >= 2 for second in planned) >= 2


@pytest.mark.slow
def test_a_saved_plan_with_a_second_recomputation_is_applied(tmp_path, one_thread):
    model, batch = _deep_gpt()
    step(model, *batch)
    ref = grads_of(model)
    zero_grads(model)
    floor, plan = floor_plan(model, batch)  # the plan at the floor: it computes values twice
    assert plan.second_recomputation["dropped"]
    plan.save(tmp_path, files=False)
    # (more budget: the gradients kept to compare with are live tensors now)
    reused = fxmem.optimize(model, 1.5 * floor / 2**30, example_inputs=batch, plan=tmp_path)
    step(reused, *batch)
    assert reused.plan.second_recomputation == plan.second_recomputation
    assert reused.plan.saved_nodes == plan.saved_nodes
    assert reused.plan.timeline["events"] == plan.timeline["events"]
    assert max_rel_err(grads_of(model), ref) < 1e-4


def test_a_bias_gradient_is_summed_before_the_matmuls_that_read_its_input(monkeypatch):
    """A bias's gradient sums the rows of its output's gradient. Summed after the matmuls,
    inductor fused the sum into the next kernel, holding that gradient past the weight
    gradient's matmul (a (B*T, 3C) buffer over the embedding's gradient at the floor)."""
    seen = spy_on_partition(monkeypatch)
    model, batch = small_gpt()
    step(fxmem.optimize(model, 1.0, example_inputs=batch), *batch)
    jg, choice = seen[-1]
    pos = {i: t for t, i in enumerate(choice.timeline.order)}
    sums = [i for i in jg.early_gradients if jg.storage[i] >= 0 and "sum" in str(jg.nodes[i].target)]
    assert sums
    for i in sums:
        views, (grad,) = jg._views_read(i)
        matmuls = [u for u in jg.users[grad] if not jg.fusible[u]]
        matmuls += [u for v in jg.users[grad] if jg.storage[v] == jg.storage[grad] for u in jg.users[v]]
        matmuls = [u for u in matmuls if not jg.fusible[u]]
        assert matmuls and all(pos[i] < pos[u] for u in matmuls), jg.nodes[i].name


def test_a_graph_with_a_higher_order_op_is_planned():
    """Copies run only plain ops: a value made through a subgraph (torch.cond) is not copied."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(32)
            self.fc = torch.nn.Linear(32, 32)
            self.out = torch.nn.Linear(32, 32)

        def forward(self, x):
            h = torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (self.fc(self.ln(x)),))
            return self.out(self.ln(h) + x).pow(2).mean()

    torch.manual_seed(0)
    model, x = Block(), torch.randn(64, 32)
    step(model, x)
    ref = grads_of(model)
    zero_grads(model)
    step(fxmem.optimize(model, 1.0, example_inputs=(x,)), x)
    assert max_rel_err(grads_of(model), ref) < 1e-5


@pytest.mark.slow
def test_below_the_floor_with_backward_copies_the_graph_without_them_is_planned(tmp_path):
    """Residual conv-BN-SiLU blocks under inductor: the backward's copies of the residual
    stream, each rebuilt from the saved convolution outputs, are all alive from its first
    kernel on, so with them no plan goes below saving just the convolutions. Budgets below that
    are planned on the graph without the copies (the stream saved, convolutions recomputed):
    the floor is about half, the budget holds, the gradients are eager's, and a plan saved so
    is applied again as it was. Batch-norm gradients are ill-conditioned in fp32: they are held
    to fp64's within ten times eager's own error."""
    from benchmarks.cnn_floor import MODELS

    torch.manual_seed(0)
    model, batch = MODELS["silu-stack"]()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    wide = copy.deepcopy(model).double()
    step(wide, *(t.double() if t.is_floating_point() else t for t in batch))
    ref64 = {k: g.float() for k, g in grads_of(wide).items()}
    step(model, *batch)
    eager_err = max_rel_err(grads_of(model), ref64)
    zero_grads(model)
    model.load_state_dict(state)
    loose = fxmem.optimize(model, 1.0, example_inputs=batch)
    step(loose, *batch)
    assert loose.plan.backward_copies
    with_copies = loose.plan.unconstrained_peak_bytes  # its floor too: nothing lowers it
    zero_grads(model)
    model.load_state_dict(state)
    budget = floor_plan(model, batch)[0]
    assert budget < 0.6 * with_copies, (budget, with_copies)
    m = fxmem.optimize(model, budget / 2**30, example_inputs=batch)
    step(m, *batch)
    assert not m.plan.backward_copies and "backward copies: none" in m.plan.summary()
    assert max_rel_err(grads_of(model), ref64) <= 10 * eager_err + 1e-6
    zero_grads(model)
    model.load_state_dict(state)
    assert fxmem.measure(step, m, *batch).peak_bytes <= budget

    m.plan.save(tmp_path, files=False)
    torch._dynamo.reset()
    zero_grads(model)
    reused = fxmem.optimize(model, 1.5 * budget / 2**30, example_inputs=batch, plan=tmp_path)
    step(reused, *batch)
    assert not reused.plan.backward_copies
    assert reused.plan.saved_nodes == m.plan.saved_nodes
    assert reused.plan.timeline["events"] == m.plan.timeline["events"]


@torch.library.custom_op("fxmem_test::product", mutates_args=())
def _product(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * y


@_product.register_fake
def _(x, y):
    return torch.empty_like(x)


def test_a_custom_ops_value_rebuilt_in_the_backward_is_stored_and_compiles():
    """A value computed a second time is read through `fxmem::stored`. When a custom op made it
    (Mixtral's grouped expert matmul, `transformers::grouped_mm_fallback`), the inputs that op
    was traced with are its node's alone: inductor matches them against the schema of the op it
    lowers, and `stored` carrying them failed to compile."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxmem.again import _store

    x, y = torch.randn(4, 8), torch.randn(4, 8)
    gm = make_fx(lambda x, y: (torch.ops.fxmem_test.product(x.sin(), y).cos(),), tracing_mode="fake")(x, y)
    (made,) = gm.graph.find_nodes(op="call_function", target=torch.ops.fxmem_test.product.default)
    # as dynamo records a custom op's call: its fake inputs
    made.meta["eager_input_vals"] = (tuple(a.meta["val"] for a in made.args), {})
    stored = _store(gm.graph, made)
    assert "eager_input_vals" not in stored.meta
    assert stored.meta["val"].shape == (4, 8)
    gm.recompile()
    (out,) = compile_fx_inner(gm, [x, y])([x, y])  # lowers this very graph, its nodes' meta too
    assert torch.allclose(out, (x.sin() * y).cos())

"""The memory simulation: storages not nodes, and the schedule the emitted graphs really run."""

from __future__ import annotations

import copy
import functools
import gc
import math
import operator
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_same_step, dropout_blocks_runs, floor_plan, grads_of, max_rel_err, small_gpt, step
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import fxmem
from fxmem import _torch_private as tp
from fxmem import cost, partition, planner, walks
from fxmem.buffers import materialized_storages, store_reused, stored_on_reuse
from fxmem.graph import BWD, JointGraph
from fxmem.in_place import reads_in_place
from fxmem.kernels import dense_numel, is_inlinable, is_view_op, kernel_ops, op_name
from fxmem.kernels import layout as value_layout
from fxmem.nodes import aliased_input, is_impure, is_random
from fxmem.pipeline import default_passes
from fxmem.planner import plan_trajectory
from fxmem.probe import _probe_arguments, workspace_bytes
from fxmem.schedule import as_realized, backward_order, kernel_ends, outputs_made_at
from fxmem.simulate import simulate, simulate_modules
from fxmem.testing import GPT, GPTConfig, ViT, ViTBlock, ViTConfig, gpt_batch, vit_batch


def _capture_emits(monkeypatch):
    seen = []
    original = partition.emit_graphs

    def emit(jg, choice, *rest):
        fw, bw = original(jg, choice, *rest)
        seen.append((jg, choice, fw, bw))
        return fw, bw

    monkeypatch.setattr(partition, "emit_graphs", emit)
    return seen


def _floor_gb(model, batch):
    return floor_plan(model, batch, compiler="eager")[0] / 2**30


@pytest.mark.parametrize("budget_gb", [1.0, "floor"])
def test_planned_schedule_matches_emitted_graphs(monkeypatch, budget_gb):
    seen = _capture_emits(monkeypatch)
    model, batch = small_gpt()
    if budget_gb == "floor":
        budget_gb = _floor_gb(model, batch)
    step(fxmem.optimize(model, budget_gb, compiler="eager", example_inputs=batch), *batch)
    (jg, choice, fw, bw) = seen[-1]
    tl = choice.timeline
    planned = [jg.nodes[i].name for i in tl.order[tl.boundary :] if jg.nodes[i].op == "call_function"]
    calls = [n for n in bw.graph.nodes if n.op == "call_function"]
    # besides: views of saved values, taken again (the forward returns what they view)
    assert all(is_view_op(n) for n in calls if n.name not in planned)
    assert planned == [n.name for n in calls if n.name in planned]
    peak, _ = simulate_modules(fw, bw, jg_remap(jg))
    assert peak == tl.peak_bytes
    if budget_gb < 1:
        assert tl.recomputed


def test_a_simulation_asked_for_a_peak_no_higher_ends_where_it_is_passed(monkeypatch):
    """The planner's trials only ask whether the peak stays at or under the current one:
    `above` ends the simulation as soon as the bytes in use pass it, and changes nothing else."""
    seen = _capture_emits(monkeypatch)
    model, batch = small_gpt()
    step(fxmem.optimize(model, 1.0, compiler="eager", example_inputs=batch), *batch)
    jg = seen[-1][0]
    states = plan_trajectory(jg).states
    assert len({c.timeline.peak_bytes for c in states}) > 2
    for c in states:
        peak = c.timeline.peak_bytes
        assert simulate(jg, c.saved, above=peak) == c.timeline == simulate(jg, c.saved)
        assert simulate(jg, c.saved, above=peak - 1) is None


def jg_remap(jg):
    # storages merged by the clone cleanup are already merged in jg; read them back from it
    remap = {}
    for i, n in enumerate(jg.nodes):
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and jg.storage[i] >= 0:
            owner = next(j for j in range(len(jg.nodes)) if jg.storage[j] == jg.storage[i])
            k, ko = val.untyped_storage()._cdata, jg.nodes[owner].meta["val"].untyped_storage()._cdata
            if k != ko:
                remap[k] = ko
    return remap


def test_a_value_saved_for_no_reader_in_the_backward_costs_nothing(monkeypatch):
    """The forward returns only what the backward (or a value it computes again) reads: a value
    marked saved that nothing there reads is freed where the forward is done with it, as the
    emitted graphs do. (Counted as held to the backward, a Llama's saved projection output,
    read only by the residual add after it, put the plan 3% over the measured peak.)"""
    seen = _capture_emits(monkeypatch)
    model, batch = small_gpt()
    step(fxmem.optimize(model, 1.0, compiler="eager", example_inputs=batch), *batch)
    jg, choice, _, _ = seen[-1]
    read_back = {j for i, k in enumerate(jg.kind) if k == BWD for j in jg.inputs[i]}
    shared = {jg.storage[j] for j in read_back} | {jg.storage[i] for i in jg.forward_nodes if choice.saved[i]}
    unread = [
        i
        for i in jg.forward_nodes
        if jg.storage[i] >= 0 and jg.storage[i] not in shared and not jg.there_before_backward[i]
    ]
    assert unread
    marked = list(choice.saved)
    for i in unread:
        marked[i] = True
    tl = simulate(jg, marked)
    assert tl.peak_bytes == simulate(jg, choice.saved).peak_bytes
    assert not {jg.storage[i] for i in unread} & tl.saved_interval.keys()


def test_views_share_storage_and_a_saved_view_keeps_its_base(monkeypatch):
    class SliceSave(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 4096)

        def forward(self, x):
            big = self.lin(x)  # (64, 4096): 1 MiB
            part = big[:, :8]  # a view: saving it keeps all of `big` alive
            return (part.sin() * 2).sum()

    seen = _capture_emits(monkeypatch)
    m = fxmem.optimize(SliceSave(), 1.0, compiler="eager")
    step(m, torch.randn(64, 64))
    jg, choice, _, _ = seen[-1]
    by_name = {n.name: i for i, n in enumerate(jg.nodes)}
    addmm = by_name["addmm"]
    views = [i for i, n in enumerate(jg.nodes) if jg.storage[i] == jg.storage[addmm] and i != addmm]
    assert views, "the slice must alias the matmul output"
    # whatever is saved for sin's backward, the step holds the whole 1 MiB matmul output or a copy
    tl = simulate(jg, choice.saved)
    assert tl.peak_bytes >= 64 * 4096 * 4


def test_tangents_of_unused_outputs_are_counted(monkeypatch):
    class TwoOutputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(256, 256)

        def forward(self, x):
            logits = self.lin(x)
            return logits.square().mean(), logits

    seen = _capture_emits(monkeypatch)
    model = TwoOutputs()
    x = torch.randn(1024, 256)
    m = fxmem.optimize(model, 1.0, compiler="eager")
    m(x)[0].backward()
    for p in model.parameters():
        p.grad = None

    def run():
        loss, logits = m(x)  # the caller holds both outputs through the backward
        loss.backward()
        return logits

    measured = fxmem.measure(run)
    # the zero gradient autograd makes for `logits` (1 MiB) is in the prediction
    assert abs(m.plan.predicted_peak_bytes - measured.peak_bytes) <= 0.05 * measured.peak_bytes
    assert seen


def _measured_step(model, batch, budget_gb, compiler):
    m = fxmem.optimize(model, budget_gb, compiler=compiler, passes=[])
    step(m, *batch)  # plans and compiles
    for p in model.parameters():
        p.grad = None
    got = fxmem.measure(step, m, *batch)
    for p in model.parameters():
        p.grad = None
    return m.plan, got.peak_bytes


@pytest.mark.slow
def test_inductor_prediction_matches_measured_peak(monkeypatch):
    """Calibration: with inductor, unconstrained and tight, the prediction is within 10%."""
    seen = _capture_emits(monkeypatch)
    model, batch = small_gpt()
    step(model, *batch)  # warm-up
    for p in model.parameters():
        p.grad = None
    eager_peak = fxmem.measure(step, model, *batch).peak_bytes
    for p in model.parameters():
        p.grad = None
    for fraction in (None, 0.6):
        torch._dynamo.reset()
        budget_gb = 1.0 if fraction is None else fraction * eager_peak / 2**30
        plan, measured = _measured_step(model, batch, budget_gb, "inductor")
        error = (plan.predicted_peak_bytes - measured) / measured
        assert -0.10 <= error <= 0.10, f"budget {fraction}: predicted {plan.predicted_peak_bytes}, measured {measured}"
        if fraction is not None:
            assert plan.recomputed and measured <= budget_gb * 2**30
    # inductor's joint-graph passes rebuild some views with fake values of their own storage;
    # the planner still sees every view in its base's storage (else a saved softmax counts twice)
    jg = seen[-1][0]
    for i, node in enumerate(jg.nodes):
        base = aliased_input(node) if node.op == "call_function" else None
        if base is not None and jg.storage[i] >= 0 and jg.storage[jg.index[base]] >= 0:
            assert jg.storage[i] == jg.storage[jg.index[base]], node.name


def _cheapest_state_polished(trajectory, limit):
    """What a budget took before `walks.fit`: the walks' cheapest state within it, polished."""
    fitting = [c for c in trajectory.states if trajectory.peak(c) <= limit]
    return trajectory._polish(min(fitting, key=lambda c: c.timeline.recompute_s), limit)


def test_a_budget_between_the_walks_states_takes_a_walk_from_the_state_above_it(monkeypatch):
    """The walks step down by batches of moves, so the cheapest state within a limit can lie
    well under it; a short walk from a state above the limit often fits it recomputing less,
    and the choice is never costlier than that state polished."""
    seen = _capture_emits(monkeypatch)
    model, batch = small_gpt()
    step(fxmem.optimize(model, 1.0, compiler="eager", example_inputs=batch), *batch)
    jg = seen[-1][0]
    trajectory = plan_trajectory(jg)
    lo, hi = trajectory.peak(trajectory.smallest), trajectory.peak(trajectory.unconstrained)
    cheaper = 0
    for k in range(1, 20):
        limit = lo + (hi - lo) * k // 20
        chosen = trajectory.choose(limit)
        assert chosen.timeline.peak_bytes <= limit
        assert simulate(jg, chosen.saved) == chosen.timeline
        before = _cheapest_state_polished(trajectory, limit).timeline.recompute_s
        assert chosen.timeline.recompute_s <= before
        cheaper += chosen.timeline.recompute_s < before
    assert cheaper >= 2


def test_a_plan_walked_to_its_budget_trains_as_eager_does(monkeypatch):
    """A plan walked from a state above its budget, cheaper than the states within it
    polished, trains as eager does: the first such of nineteen budgets between the floor and
    the unconstrained peak (of nine a tenth apart, none was under torch 2.15's graph)."""
    chose_walked = []
    choose = planner.Trajectory.choose

    def spy(self, limit):
        chosen = choose(self, limit)
        if chosen is not None and any(self.peak(c) <= limit for c in self.states):
            before = _cheapest_state_polished(self, limit).timeline.recompute_s
            chose_walked.append(chosen.timeline.recompute_s < before)
        return chosen

    monkeypatch.setattr(planner.Trajectory, "choose", spy)
    model, batch = small_gpt()
    reference = copy.deepcopy(model)
    step(reference, *batch)
    trained = copy.deepcopy(model)
    lo = _floor_gb(trained, batch) * 2**30
    hi = fxmem.optimize(trained, 64.0, compiler="eager", example_inputs=batch).plan.predicted_peak_bytes
    for k in range(1, 20):
        chose_walked.clear()
        trained.zero_grad(set_to_none=True)
        stepped = fxmem.optimize(trained, (lo + (hi - lo) * k / 20) / 2**30, compiler="eager")
        step(stepped, *batch)
        plan = stepped.plan
        del stepped
        if any(chose_walked):
            break
    assert any(chose_walked), "no budget took a walked plan"
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert max_rel_err(grads_of(trained), grads_of(reference)) < 1e-4


def test_plans_are_deterministic_across_processes(monkeypatch, tmp_path):
    """A plan is a function of the graph and the budget: a new process (here: the per-process
    rate cache cleared) plans with the same cost rates and makes the same decisions."""
    monkeypatch.setenv("FXMEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cost, "_kept", {})  # the rates timed here are not the later tests'
    seen = _capture_emits(monkeypatch)
    model, batch = small_gpt()
    fxmem.optimize(model, 1.0, compiler="eager", passes=[], example_inputs=batch)
    joint = seen[-1][0]
    decisions, rates = [], []
    for _ in range(2):
        cost._kept.clear()  # as in a new process
        rates.append(cost.measure_rates("cpu"))
        jg = JointGraph.build(joint.gm, joint.num_fwd_outputs, cost.CostModel(rates[-1]), fusing=True)
        trajectory = plan_trajectory(jg)
        limit = (trajectory.peak(trajectory.smallest) + trajectory.peak(trajectory.unconstrained)) // 2
        choice = trajectory.choose(limit)
        decisions.append((choice.saved, choice.timeline.recomputed))
    assert (tmp_path / "device_rates.json").exists()
    assert rates[0] == rates[1]
    assert decisions[0][1], "a budget half-way down must recompute something"
    assert decisions[0] == decisions[1]


def test_first_step_on_a_new_machine_holds_a_budget_below_the_rate_timing(monkeypatch, tmp_path):
    """The rates are timed the first time a device is planned for, inside the first step: on
    tensors that fit the room the budget leaves (not the 66 MiB a full timing allocates on a
    CPU), and then not kept; a budget below what is alive, refused before anything runs, times
    them in full and writes them down."""
    monkeypatch.setenv("FXMEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cost, "_kept", {})  # a new process: no rates read or timed yet
    model, batch = small_gpt()
    reference = copy.deepcopy(model)
    step(reference, *batch)
    budget_gb = (cost._timing_bytes(torch.device("cpu")) // 2) / 2**30
    module = fxmem.optimize(model, budget_gb, compiler="eager")  # planned in its first step
    first = fxmem.measure(step, module, *batch)
    assert first.peak_bytes <= budget_gb * 2**30, f"first step {first.peak_bytes / 2**20:.1f} MiB"
    assert max_rel_err(grads_of(model), grads_of(reference)) < 1e-4
    assert not (tmp_path / "device_rates.json").exists()
    assert module.plan.predicted_peak_bytes <= module.plan.budget_bytes
    torch._dynamo.reset()
    with pytest.raises(fxmem.BudgetError):
        fxmem.optimize(model, 1e-6, compiler="eager", example_inputs=batch)
    assert (tmp_path / "device_rates.json").exists()


def test_cost_rates_are_timed_on_real_tensors():
    """Partition functions run under fake-tensor tracing, where timing a matmul times nothing."""
    with FakeTensorMode():
        assert isinstance(torch.randn(2), FakeTensor)
        with tp.real_tensors():
            x = torch.randn(2)
            assert not isinstance(x, FakeTensor) and x.data_ptr() != 0


def test_dropout_model_at_its_floor_holds_the_budget():
    """At the floor the peak sits on dropout's backward, which allocates a mask-sized buffer
    inside itself: the simulation counts it, so the budget holds as measured."""
    cfg = GPTConfig(vocab_size=512, block_size=256, n_layer=2, n_head=4, n_embd=64, dropout=0.1)
    torch.manual_seed(0)
    model = GPT(cfg)
    batch = gpt_batch(cfg, 4, 256)
    try:
        fxmem.optimize(model, 1e-6, compiler="eager", example_inputs=batch)
    except fxmem.BudgetError as e:
        floor = e.floor_bytes
    m = fxmem.optimize(model, (floor + 1) / 2**30, compiler="eager")
    step(m, *batch)  # plans
    model.zero_grad(set_to_none=True)  # as the plan was made: gradients come with the backward
    measured = fxmem.measure(step, m, *batch)
    assert measured.peak_bytes <= m.plan.budget_bytes, (measured.peak_bytes, m.plan.predicted_peak_bytes)
    assert abs(measured.peak_bytes - m.plan.predicted_peak_bytes) <= 0.05 * measured.peak_bytes


def _aten_graph(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    index = {n: i for i, n in enumerate(nodes)}
    users = [[index[u] for u in n.users if u in index] for n in nodes]
    return nodes, users


def test_a_matmul_sum_accumulated_over_a_loop_holds_two_sums():
    """Inductor folds `acc + a @ b` into one addmm (a library call): the running sum and the
    next one are both in memory while the product never is on its own. The chunked loss
    accumulates its weight gradient so; counting the adds as fused (free) under-predicted."""

    def accumulate(a, b):
        acc = a[0].t() @ b[0]
        for k in range(1, 4):
            acc = acc + a[k].t() @ b[k]
        return acc * 2.0

    nodes, users = _aten_graph(accumulate, torch.randn(4, 8, 16), torch.randn(4, 8, 32))
    mat = materialized_storages(nodes, users, list(range(len(nodes))), len(nodes), *kernel_ops(nodes, users))
    adds = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.add.Tensor]
    mms = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default]
    assert len(adds) == 3 and len(mms) == 4
    assert all(mat[i] for i in adds), "each running sum is an addmm's output"
    assert mat[mms[0]], "the first product is the first addmm's input"
    assert not any(mat[i] for i in mms[1:]), "the other products are written straight into the sums"
    fusible, folded = kernel_ops(nodes, users)
    assert folded == set(mms[1:])
    assert not any(fusible[i] for i in adds), "an addmm is a library call: it never overwrites the sum it reads"


@pytest.mark.slow
def test_a_matmul_folded_into_a_later_add_holds_its_inputs_until_then():
    """A tied LM head's weight gradient, `logits_grad.T @ h`, is added to the embedding's
    gradient, which the backward makes last: inductor folds the two into one addmm there, so
    the logits' gradient lives through the whole backward. Planned as if the matmul ran where
    the graph has it, the prediction was 4.5% under the measured peak (HF GPT-2 at vocab 1024
    and four layers, 2%)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=4096, block_size=128, n_layer=2, n_head=2, n_embd=64)
    model, batch = GPT(cfg), gpt_batch(cfg, 4, 128)
    model.lm_head.weight = model.wte.weight
    plan, measured = _measured_step(model, batch, 1.0, "inductor")
    assert abs(plan.predicted_peak_bytes - measured) <= 0.02 * measured, (plan.predicted_peak_bytes, measured)


def test_a_fused_kernel_holds_what_it_reads_until_it_ends():
    # steps 0-1 and 3-4 are runs of fusible ops (one kernel each); 2 is a library call
    assert kernel_ends([True, True, False, True, True]) == [1, 1, 2, 4, 4]
    assert kernel_ends([False, True, False]) == [0, 1, 2]


def test_index_arithmetic_several_kernels_read_is_computed_in_each(monkeypatch):
    """T5's relative position buckets: index arithmetic on positions alone (a log among it),
    which the backward computes again and several kernels read, the embedding that looks the
    bias up among them. Reading no buffer, it is computed inside each reader (inductor
    inlines a buffer that loads nothing into whatever loads it), on the whole graph as where a
    plan computes it again; the embedding, read by two kernels, then holds a heavy op and is
    stored. The plan had counted the buckets stored and the bias computed inline: 1.8 MiB
    under T5's measured peak."""

    class RelativeBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 4)

        def forward(self, x):
            n = x.shape[0]
            pos = torch.arange(n)[None, :] - torch.arange(n)[:, None]  # as T5 buckets them
            bucket = (pos > 0).long() * 16
            pos = pos.abs()
            large = 8 + (torch.log(pos.float() / 8) / math.log(128 / 8) * 8).long()
            bucket = bucket + torch.where(pos < 8, pos, torch.min(large, torch.full_like(large, 15)))
            bias = self.emb(bucket)
            return ((x + bias).sin() * (x * bias).cos()).sum()

    seen = _capture_emits(monkeypatch)
    model = RelativeBias()
    x = torch.randn(64, 64, 4, requires_grad=True)
    fxmem.optimize(model, 1.0, compiler="inductor", passes=[], example_inputs=(x,))(x).backward()
    jg = seen[-1][0]
    ops = {jg.nodes[i].target: i for i in jg.forward_nodes}
    bias = ops[torch.ops.aten.embedding.default]
    (bucket,) = jg.nodes[bias].args[1:]
    bucket = jg.nodes.index(bucket)
    assert len(jg.users[bucket]) > 2  # read by the embedding's gradient too: not copied (too long)
    whole = stored_on_reuse(
        jg.nodes, jg.inputs, jg.users, jg.storage, list(jg.materialized), jg.inlinable, [k == BWD for k in jg.kind]
    )
    # A log is a heavy op for inductor since torch 2.13; before, the bias is computed in each
    # reader too.
    heavy = "log" in tp.HEAVY_ON_CPU
    assert not whole[bucket] and whole[bias] == heavy  # on the whole graph too
    tl = simulate(jg, [False] * len(jg.nodes))  # all computed again in the backward
    assert {bucket, bias} <= set(tl.recomputed)
    assert (jg.storage[bias] in tl.recomputed_interval) == heavy
    assert jg.storage[bucket] not in tl.recomputed_interval


def _measured_above_floor(model, batch: tuple):
    """`model` (inductor, no passes) 3% above its floor: the gradients are eager's and the
    measured step holds the budget. The measured peak and the plan's predicted one."""
    model(*batch).backward()
    ref = grads_of(model)
    model.zero_grad(set_to_none=True)
    floor, _ = floor_plan(model, batch, passes=[])
    m = fxmem.optimize(model, floor * 1.03 / 2**30, passes=[])
    m(*batch).backward()
    assert max_rel_err(grads_of(model), ref) < 1e-5
    model.zero_grad(set_to_none=True)
    got = fxmem.measure(lambda: m(*batch).backward()).peak_bytes
    assert got <= m.plan.budget_bytes, (got / 2**20, m.plan.budget_bytes / 2**20)
    return got, m.plan.predicted_peak_bytes


def test_a_costly_value_kernels_on_both_sides_of_a_matmul_read_is_stored_in_the_forward(monkeypatch):
    """A forward value no gradient needs, whose code applies a heavy op, read by two kernels
    with matmuls between them (T5's decoder position bias, read by every chunk of both layers'
    self-attention): inductor stores it in the forward. Counted as computed inside each
    reader, the prediction at the floor was 2 MiB (the value) under the measured peak, which
    falls while the value lives (`x @ x.T`)."""

    class SharedBias(nn.Module):
        def __init__(self, n: int = 2048, d: int = 256):
            super().__init__()
            self.register_buffer("pos", torch.linspace(0, 1, n * d).view(n, d))
            self.w1 = nn.Linear(d, d, bias=False)
            self.w2 = nn.Linear(d, d, bias=False)

        def forward(self, x):
            b = torch.exp(-self.pos) * 0.5
            h = self.w1(x + b)
            g = (x @ x.T).amax(-1, keepdim=True)
            return self.w2(torch.relu(h) * b + g).square().mean()

    seen = _capture_emits(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(2048, 256)
    got, predicted = _measured_above_floor(SharedBias(), (x,))
    assert abs(got - predicted) <= 0.005 * predicted, (got / 2**20, predicted / 2**20)
    jg = seen[-1][0]
    assert [jg.storage_bytes[s] for s in jg.stored_in_forward] == [x.nbytes]  # b alone


def test_a_gradient_summed_layer_by_layer_is_written_as_each_term_arrives(monkeypatch):
    """A parameter every layer reads (T5's attention bias) gets its gradient as a chain of
    adds, one term a layer. Inductor computes the chain in the kernel that reads the sum,
    every term alive until then; made opaque adds (`cleanup.realize_running_sums`), the sum is
    written as each term arrives: the floor falls by all but three terms (2 MiB each), the
    prediction is the measured peak and the gradients are eager's."""

    class SharedBias(nn.Module):
        def __init__(self, layers: int = 6, n: int = 1024, d: int = 512):
            super().__init__()
            self.bias = nn.Parameter(torch.randn(n, d) * 0.1)
            self.ws = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(layers))

        def forward(self, x):
            h = x
            for w in self.ws:
                h = w(torch.tanh(h) + self.bias)
            return h.square().mean()

    torch.manual_seed(0)
    model, x = SharedBias(), torch.randn(1024, 512)
    term = model.bias.nbytes
    seen = _capture_emits(monkeypatch)
    got, predicted = _measured_above_floor(model, (x,))
    assert abs(got - predicted) <= 0.005 * predicted, (got / 2**20, predicted / 2**20)
    bw = seen[-1][3]
    assert len(bw.graph.find_nodes(op="call_function", target=torch.ops.fxmem.add.default)) == 5
    floor = floor_plan(model, (x,), passes=[])[0]
    monkeypatch.setattr(partition, "realize_running_sums", lambda gm, num_fwd_outputs: 0)
    assert floor_plan(model, (x,), passes=[])[0] >= floor + 3 * term


def test_an_attention_masks_copy_is_written_with_the_keys_and_values_before_it():
    """An attention mask inductor copies for the call (element-wise code of one buffer) is
    written by the kernel right before the call, which copies the keys and values out of their
    fused projection (T5's cross-attention): the mask is alive with that projection, which the
    kernel frees only when it ends. Counted as made at the call, after the projection's free,
    the prediction at the floor was 0.7 MiB under the measured peak, which falls there (a
    forward-only product lives across the attention)."""
    b, t, d, h = 8, 512, 64, 4

    class Cross(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(d, d, bias=False)
            self.kv = nn.Linear(d, 2 * d, bias=False)
            self.o = nn.Linear(d, d, bias=False)
            self.register_buffer("bias", torch.randn(1, h, t, t))
            self.register_buffer("wide", torch.randn(d, 4 * t))

        def forward(self, x, enc):
            wide = enc @ self.wide  # no gradient needs it; read after the attention
            q = self.q(x).view(b, t, h, d // h).transpose(1, 2)
            k, v = (y.view(b, t, h, d // h).transpose(1, 2).contiguous() for y in self.kv(enc).split(d, -1))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias * 0.5)
            return self.o(a.transpose(1, 2).reshape(b, t, d)).square().mean() + wide.amax()

    torch.manual_seed(0)
    got, predicted = _measured_above_floor(Cross(), (torch.randn(b, t, d), torch.randn(b, t, d)))
    assert abs(got - predicted) <= 0.005 * predicted, (got / 2**20, predicted / 2**20)


def test_one_key_head_repeated_over_the_query_heads_is_copied_for_each_attention_call():
    """Multi-query attention whose one key and value head is repeated over the query heads by
    a view (expand, then a reshape that merges a dimension of size 1: stride 0 along the heads,
    as HF's `repeat_kv` with one key/value head), read by SDPA with a boolean mask. Inductor
    copies the view densely for each attention call on CPU, the forward's and the backward's;
    counted as the one-head keys, the prediction at the floor was 23% under the measured peak
    here (2.55 MiB against 3.30), 12% under for HF Falcon (transformers 5.25)."""
    b, t, d, h = 4, 256, 64, 4
    hd = d // h

    class MultiQuery(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.ModuleList(nn.Linear(d, d + 2 * hd, bias=False) for _ in range(2))
            self.register_buffer("causal", torch.ones(t, t, dtype=torch.bool).tril())

        def forward(self, x):
            for lin in self.qkv:
                q, k, v = lin(x).view(b, t, h + 2, hd).split([h, 1, 1], dim=2)
                q, k, v = (y.transpose(1, 2) for y in (q, k, v))
                k, v = (y[:, :, None].expand(b, 1, h, t, hd).reshape(b, h, t, hd) for y in (k, v))
                assert k.stride(1) == 0  # a view
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=self.causal)
                x = x + a.transpose(1, 2).reshape(b, t, d)
            return x.square().mean()

    torch.manual_seed(0)
    got, predicted = _measured_above_floor(MultiQuery(), (torch.randn(b, t, d),))
    assert abs(got - predicted) <= 0.005 * predicted, (got / 2**20, predicted / 2**20)


def test_a_heavy_mask_two_attention_calls_read_is_stored_once(monkeypatch):
    """An attention mask whose code applies a heavy op (the sigmoid of a table), read by two
    layers' attention: inductor stores it once, as it stores any value several ops read whose
    code is costly, and both calls and their backward read that buffer. Planned as copied for
    each call, nothing stored, the step 3% above its floor measured 22.75 MiB against a budget
    of 21.05."""
    b, t, d, h = 8, 512, 64, 4

    class TwoLayers(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.ModuleList(nn.Linear(d, 3 * d, bias=False) for _ in range(2))
            self.register_buffer("table", torch.randn(1, h, t, t))

        def forward(self, x):
            mask = self.table.sigmoid()
            for lin in self.qkv:
                q, k, v = (y.view(b, t, h, d // h).transpose(1, 2) for y in lin(x).split(d, -1))
                x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, d)
            return x.square().mean()

    seen = _capture_emits(monkeypatch)
    torch.manual_seed(0)
    model, x = TwoLayers(), torch.randn(b, t, d)
    _measured_above_floor(model, (x,))  # holds the budget
    assert all("sigmoid" not in seen[-1][0].nodes[i].name for i in seen[-1][0].copied_per_reader)

    # Unconstrained, the backward's first attention reads the gradient of the squared residual
    # stream, a copy in its layout; the stream itself (saved) lives on to the next layer's
    # gradient, which computes that gradient again. Counted as stored once (the loss's
    # gradient, one element, taken for a load, and the saved stream for code computed inline),
    # the prediction was 4.4% under.
    m = fxmem.optimize(model, 1.0, passes=[])
    m(x).backward()
    model.zero_grad(set_to_none=True)
    got, predicted = fxmem.measure(lambda: m(x).backward()).peak_bytes, m.plan.predicted_peak_bytes
    assert abs(got - predicted) <= 0.005 * predicted, (got / 2**20, predicted / 2**20)


def test_a_recomputed_relu_a_matmul_reads_through_a_view_is_stored_as_planned(monkeypatch):
    """Feed-forward layers whose ReLU the floor computes again in the backward (T5's): its
    output is read through one view by the next matmul and by that matmul's weight gradient.
    Inductor copies such a view (read by several ops, a matmul among them) of a value it has
    not stored into a buffer of its own, and the ReLU's gradient computed the ReLU again from
    the matmul output before it, which so stayed alive through the peak: 8.5% over the
    prediction. With a view of its own for each reader (`emit._view_per_reader`) the ReLU's
    output is stored, as the plan counts it. Rates fixed: with the machine's own the plan
    might save the ReLU instead."""
    b, t, d, f = 8, 256, 64, 256
    monkeypatch.setattr(partition, "measure_rates", lambda device, room_bytes=None: cost.DeviceRates(1e11, 2**32))

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.ModuleList(nn.Linear(d, f, bias=False) for _ in range(2))
            self.down = nn.ModuleList(nn.Linear(f, d, bias=False) for _ in range(2))

        def forward(self, x):
            for k in range(2):
                x = x + self.down[k](torch.relu(self.up[k](x)))
            return x.square().mean()

    seen = _capture_emits(monkeypatch)
    torch.manual_seed(0)
    got, predicted = _measured_above_floor(FeedForward(), (torch.randn(b, t, d),))
    jg, choice = seen[-1][:2]
    relus = [i for i in jg.forward_nodes if jg.nodes[i].target == torch.ops.aten.relu.default]
    assert not all(choice.saved[i] for i in relus)  # the weight gradient reads it: computed again
    assert abs(got - predicted) <= 0.005 * predicted, (got / 2**20, predicted / 2**20)


def test_a_value_placed_into_a_larger_one_is_computed_in_its_reader():
    """Inductor makes slice_scatter and select_scatter element-wise code that loads from
    either input: neither they nor the zeros they place a value into are written out when
    fused loops alone read them (GPT-NeoX's partial rotary embedding's gradient: counted as
    buffers, they put its floor 6% higher)."""

    def f(x):
        a = torch.full((8, 16), 0.0).slice_scatter(x.sin(), dim=1, start=0, end=8) * 2.0  # zeros, as traced
        b = torch.full((4, 8, 8), 0.0).select_scatter(x.cos(), 0, 1) * 3.0
        return a, b

    nodes, users = _aten_graph(f, torch.randn(8, 8))
    mat = materialized_storages(nodes, users, list(range(len(nodes))), len(nodes), *kernel_ops(nodes, users))
    placed = [
        i for i, n in enumerate(nodes) if str(n.target) in ("aten.slice_scatter.default", "aten.select_scatter.default")
    ]
    assert len(placed) == 2
    assert not any(mat[i] for i in placed), [nodes[i].name for i in placed if mat[i]]
    assert not any(mat[j] for i in placed for j in range(len(nodes)) if nodes[j] in nodes[i].all_input_nodes)


def test_a_concatenation_and_a_library_calls_outputs_are_written_out():
    """A concatenation is a buffer its inputs are copied into, even when only fused loops
    read it; the outputs of a multi-output library call (topk here, attention's backward in
    a model) are in memory, whatever reads them."""

    def f(x):
        both = torch.cat([x.sin(), x.cos()]) * 2.0
        top = torch.topk(x, 2).values * 3.0
        return both, top

    nodes, users = _aten_graph(f, torch.randn(8, 8))
    mat = materialized_storages(nodes, users, list(range(len(nodes))), len(nodes), *kernel_ops(nodes, users))
    named = {n.name: i for i, n in enumerate(nodes)}
    assert mat[named["cat"]]
    assert not mat[named["sin"]] and not mat[named["cos"]], "computed inside the copies into the cat"
    getitems = [i for i, n in enumerate(nodes) if n.target is operator.getitem]
    assert getitems and all(mat[i] for i in getitems)


def test_a_value_stored_for_its_readers_is_one_read_for_theirs():
    """Inductor stores a value several kernels read when computing it again in each would read
    more than four buffers (a batch norm's output, read by the ReLU6 mask's two comparisons);
    its readers then read that one buffer, so the masked gradient after it, with two reads, is
    computed inside its own readers rather than stored (MobileNetV2's backward)."""

    def f(x, mean, rstd, weight, bias, grad):
        y = (x - mean) * rstd * weight + bias
        masked = torch.where((y <= 0) | (y >= 6), 0.0, grad)
        return masked.sum(0), masked * 2.0

    nodes, users = _aten_graph(f, *(torch.randn(8, 8) for _ in range(6)))
    inputs = [[nodes.index(a) for a in n.all_input_nodes] for n in nodes]
    storage = list(range(len(nodes)))
    mat = materialized_storages(nodes, users, storage, len(nodes), *kernel_ops(nodes, users))
    inlinable, forward_only = [is_inlinable(n) for n in nodes], [False] * len(nodes)
    stored = stored_on_reuse(nodes, inputs, users, storage, mat, inlinable, forward_only)
    named = {n.name: i for i, n in enumerate(nodes)}
    (y,) = [named[n.name] for n in nodes if n.target is torch.ops.aten.add.Tensor]
    (masked,) = [named[n.name] for n in nodes if n.target is torch.ops.aten.where.self]
    assert len(users[y]) == 2 and stored[y]
    assert len(users[masked]) == 2 and not stored[masked]


def test_the_outputs_of_a_reduction_are_stored_not_computed_again():
    """var_mean's outputs, like layer norm's mean and rstd, are written by the reduction's
    kernel: a reader cannot compute them element by element."""

    def f(x):
        var, mean = torch.var_mean(x, dim=1, keepdim=True)
        return (x - mean) * var

    nodes, _ = _aten_graph(f, torch.randn(8, 8))
    getitems = [n for n in nodes if n.target is operator.getitem]
    assert len(getitems) == 2 and not any(is_inlinable(n) for n in getitems)
    assert all(is_inlinable(n) for n in nodes if n.target is torch.ops.aten.sub.Tensor)


def test_an_embedding_is_computed_in_its_readers_and_its_gradient_scattered_in_a_kernel():
    """Inductor loads an embedding's rows inside the kernels that read them (nothing written
    out for a lookup only fusible ops read) and scatters its gradient into zeros in a kernel of
    its own: counted as library calls, the lookup kept its table rows alive and the scatter
    was charged twice (the zeros and the sum)."""

    def f(w, idx, g):
        rows = F.embedding(idx, w)  # (B, T, C)
        # embedding_dense_backward as inductor decomposes it
        grad = torch.ops.aten.index_put(torch.zeros_like(w), [idx.reshape(-1)], g.reshape(-1, w.shape[1]), True)
        return (rows * 2).sum(), grad

    nodes, users = _aten_graph(f, torch.randn(64, 8), torch.randint(0, 64, (4, 16)), torch.randn(4, 16, 8))
    fusible, folded = kernel_ops(nodes, users)
    (lookup,) = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.embedding.default]
    assert fusible[lookup] and is_inlinable(nodes[lookup])
    scatters = [i for i, n in enumerate(nodes) if "index_put" in str(n.target)]
    assert scatters and all(fusible[i] and not is_inlinable(nodes[i]) for i in scatters)
    # under deterministic algorithms inductor calls aten's index_put instead
    torch.use_deterministic_algorithms(True)
    try:
        assert not any(kernel_ops(nodes, users)[0][i] for i in scatters)
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_scatter_and_what_an_as_strided_view_reads_are_written_out():
    """A scatter fills a buffer by mutating it, whatever reads it after (the upsampling's
    gradient, read only by the group norm's backward kernels: 4.5 MiB the UNet's plan had not
    counted); inductor writes out a value it takes an as_strided view of (a group norm's
    per-channel scale and shift), so readers of that view read one buffer."""

    def f(w, idx, g, scale):
        grad = torch.ops.aten.index_put(torch.zeros_like(w), [idx], g, True)
        per_channel = torch.as_strided(scale * 2.0, (4, 8), (8, 1))
        return grad * 3.0, per_channel + 1.0

    nodes, users = _aten_graph(f, torch.randn(64, 8), torch.randint(0, 64, (16,)), torch.randn(16, 8), torch.randn(32))
    mat = materialized_storages(nodes, users, list(range(len(nodes))), len(nodes), *kernel_ops(nodes, users))
    (scatter,) = [i for i, n in enumerate(nodes) if "index_put" in str(n.target)]
    (strided,) = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.as_strided.default]
    (scaled,) = [i for i, n in enumerate(nodes) if nodes[strided].args[0] is n]
    assert mat[scatter] and mat[scaled]
    assert not mat[strided], "the view itself is no buffer of its own"


def test_a_heavy_op_behind_a_value_computed_inline_makes_it_stored_when_reused():
    """On CPU inductor stores a value several kernels read when the chain computed inline
    behind it applies a heavy op (an exp), even where the value itself is a cheap multiply."""

    def f(x):
        y = x.exp() * 2.0
        return y + 1.0, y.sum(0)

    nodes, users = _aten_graph(f, torch.randn(8, 8))
    inputs = [[nodes.index(a) for a in n.all_input_nodes] for n in nodes]
    storage = list(range(len(nodes)))
    mat = materialized_storages(nodes, users, storage, len(nodes), *kernel_ops(nodes, users))
    inlinable = [is_inlinable(n) for n in nodes]
    stored = stored_on_reuse(nodes, inputs, users, storage, mat, inlinable, [True] * len(nodes))
    (y,) = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mul.Tensor]
    (e,) = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.exp.default]
    assert not mat[e] and len(users[y]) == 2
    assert stored[y]


def test_a_value_read_twice_by_one_written_value_is_computed_in_its_loop():
    """A SiLU's sigmoid, read twice by its gradient: inductor stores it (an exp on CPU, read by
    two ops), then computes it in the loop writing the gradient, its only reader, and drops the
    buffer (UNet's backward, before its group norm's). Read by a reduction too, the sigmoid is
    read by two loops and stays (a batch norm's backward)."""

    def f(x, grad, keep):
        sig = torch.sigmoid(x)
        dx = grad * sig * (1 + x * (1 - sig))
        out = (dx * 2.0, dx.sum(0)) if keep else (dx * 2.0,)
        return out

    for keep in (False, True):
        nodes, mat, sig = _written_out_after_reuse(
            functools.partial(f, keep=keep), torch.randn(8, 8), torch.randn(8, 8), of_input=False
        )
        assert mat[sig] is keep, keep


def test_a_value_read_twice_by_a_concatenated_value_is_computed_in_its_loop():
    """The SiLU gradient of Llama's fused gate and up projections is concatenated with the up
    projection's gradient: the loop writing it into the concatenation's buffer computes the
    sigmoid too, whose buffer is dropped (counted, it put a Llama floor 3.7% above the
    measured peak)."""

    def f(x, grad, up_grad):
        sig = torch.sigmoid(x)
        dx = grad * sig * (1 + x * (1 - sig))
        return torch.cat([dx, up_grad], dim=1) * 1.0

    nodes, mat, sig = _written_out_after_reuse(f, *(torch.randn(8, 8) for _ in range(3)), of_input=False)
    assert not mat[sig]
    (cat,) = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.cat.default]
    assert mat[cat]


def test_a_value_a_library_call_parts_from_its_concatenated_reader_is_stored():
    """A gate projection fused with q/k/v (all five read one input): its SiLU gradient is
    written into the concatenation of the five gradients, after the attention's backward.
    Inductor stores the sigmoid where the graph has it, and fxmem keeps it from fusing that
    loop across the attention's backward into the concatenation's: the sigmoid's buffer lives
    until then (one such block unconstrained under inductor measured 25.20 MiB, 2 MiB over
    its plan, which now predicts 25.21). With no library call between, the loop writing the
    gradient computes the sigmoid."""

    def f(x, grad, a, b, call_between):
        if not call_between:
            other = a @ b
        sig = torch.sigmoid(x)
        if call_between:
            other = a @ b
        dx = grad * sig * (1 + x * (1 - sig))
        return torch.cat([dx, other], dim=1) * 1.0

    for call_between in (False, True):
        nodes, mat, sig = _written_out_after_reuse(
            functools.partial(f, call_between=call_between), *(torch.randn(8, 8) for _ in range(4)), of_input=False
        )
        assert mat[sig] is call_between, call_between


def test_a_reduction_over_a_few_elements_is_computed_in_its_readers():
    """Inductor writes a sum over fewer than eight elements per output as element-wise loops
    (Falcon's key gradients, summed over the four heads that share them); a longer one, or
    one into a single value on CPU, is a reduction kernel that stores its result."""

    def f(x):
        return x.sum(1) * 2.0, x.sum(0) * 2.0, x[:1, :4].sum() * 2.0

    nodes, _ = _aten_graph(f, torch.randn(64, 4))
    sums = [n for n in nodes if n.target is torch.ops.aten.sum.dim_IntList or n.target is torch.ops.aten.sum.default]
    assert [is_inlinable(n) for n in sums] == [True, False, False]


def _written_out_after_reuse(f, *args, of_input: bool) -> tuple[list, list[bool], int]:
    """The graph `f` traces to (taken as a backward's), which storages a fusing compiler writes
    out once the values several ops read are judged (`stored_on_reuse`, `store_reused`), and
    the node so judged: the first sigmoid, or with `of_input` what it reads. That node must
    be one such value: stored, and read by two ops."""
    nodes, users = _aten_graph(f, *args)
    inputs = [[nodes.index(a) for a in n.all_input_nodes] for n in nodes]
    storage = list(range(len(nodes)))
    fusible, folded = kernel_ops(nodes, users)
    mat = materialized_storages(nodes, users, storage, len(nodes), fusible, folded)
    inlinable, backward = [is_inlinable(n) for n in nodes], [True] * len(nodes)
    stored = stored_on_reuse(nodes, inputs, users, storage, mat, inlinable, backward)
    (value,) = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.sigmoid.default]
    if of_input:
        (value,) = inputs[value]
    assert stored[value] and len(users[value]) == 2
    store_reused((nodes, inputs, users, storage), backward, mat, fusible, inlinable, stored)
    return nodes, mat, value


def test_a_value_read_by_a_loop_over_other_sizes_is_written_out():
    """A batch norm's output, read twice by a SiLU's gradient that also adds a mean pooling's
    gradient (one value per image and channel): channels-last, the output's loop runs over
    N*H*W and C, the gradient's over N, H*W and C, so inductor writes the output to a buffer
    the gradient's loop reads (a residual CNN's peak held 8 MiB more than its plan). Laid out
    (N, C, H, W), both loops run over N, C and H*W, and the output is computed in the
    gradient's loop, its buffer dropped."""

    def f(x, w, b, pooled, other):
        var, mean = torch.var_mean(x, (0, 2, 3), keepdim=True)
        y = (x - mean) * (var + 1e-5).rsqrt() * w[:, None, None] + b[:, None, None]
        sig = torch.sigmoid(y)
        return ((pooled[:, :, None, None] / 16.0 + other) * sig * (1 + y * (1 - sig)) * 2.0,)

    for layout, stored in ((torch.contiguous_format, False), (torch.channels_last, True)):
        x, other = (torch.randn(2, 8, 4, 4).contiguous(memory_format=layout) for _ in range(2))
        nodes, mat, y = _written_out_after_reuse(
            f, x, torch.randn(8), torch.randn(8), torch.randn(2, 8), other, of_input=True
        )
        assert nodes[y].target is torch.ops.aten.add.Tensor and mat[y] is stored, layout


def _in_place_case(f, *args):
    nodes, _ = _aten_graph(f, *args)
    named = {n.name: i for i, n in enumerate(nodes)}
    storage = list(range(len(nodes)))
    for n in nodes:  # a view shares its base's storage
        if n.target in (torch.ops.aten.t.default, torch.ops.aten.view.default):
            storage[named[n.name]] = storage[named[n.args[0].name]]
    fusible, _ = kernel_ops(nodes, [[named[u.name] for u in n.users if u.name in named] for n in nodes])
    jg = SimpleNamespace(
        nodes=nodes,
        inputs=[[named[a.name] for a in n.all_input_nodes] for n in nodes],
        users=[[named[u.name] for u in n.users if u.name in named] for n in nodes],
        storage=storage,
        storage_nodes=[[i for i, s in enumerate(storage) if s == r] for r in range(len(nodes))],
        fusible=fusible,
        inlinable=[is_inlinable(n) for n in nodes],
        layouts=[value_layout(n) for n in nodes],
        dense_numel=[dense_numel(n) for n in nodes],
        in_place_answers={},
    )
    return jg, named, [1] * len(nodes)


def test_a_kernel_writes_over_an_input_only_where_it_reads_it_at_the_same_index():
    """Inductor writes a kernel's output over a buffer that dies in it only when the output
    reads that buffer element for element where it writes: not through a transpose. A reshape
    keeps every element where it was (GELU's backward overwrites the (B*T, 4C) matmul output
    it reads as (B, T, 4C)), unless a reduction reads the buffer too (a softmax over a bmm's
    (B*H, T, T) scores read as (B, H, T, T) is written elsewhere)."""

    def f(x):
        e = x.exp()
        return e * 2.0, e.t().contiguous(), e.view(4, 16) * 3.0

    jg, named, cost = _in_place_case(f, torch.randn(8, 8))
    exp = named["exp"]
    assert reads_in_place(jg, named["mul"], exp, cost)
    assert not reads_in_place(jg, named["clone"], exp, cost)
    assert reads_in_place(jg, named["mul_1"], exp, cost)

    def g(x):
        e = x.exp()
        return e.view(4, 16) * 3.0, e.amax(dim=1)

    jg, named, cost = _in_place_case(g, torch.randn(8, 8))
    assert not reads_in_place(jg, named["mul"], named["exp"], cost)


def test_a_kept_in_place_answer_holds_only_where_the_same_values_are_stored():
    """Whether a kernel reads a buffer at the index it writes depends on which values between
    them are stored: `reads_in_place` answers again when the plan stores another set of them,
    and reuses its answer when the set it asked about is stored alike."""

    def f(x):
        e = x.exp()
        return e.neg() * 2.0

    jg, named, cost = _in_place_case(f, torch.randn(8, 8))
    mul, exp, neg = named["mul"], named["exp"], named["neg"]
    inline = [0 if i == neg else c for i, c in enumerate(cost)]  # neg computed in mul's kernel
    assert reads_in_place(jg, mul, exp, inline)
    assert not reads_in_place(jg, mul, exp, cost)  # neg stored: mul reads neg's buffer, not exp's
    assert reads_in_place(jg, mul, exp, inline)
    assert len(jg.in_place_answers[(mul, exp)]) == 2


def test_no_kernel_writes_over_a_buffer_a_scatter_filled():
    """A scatter's output (a max pooling's gradient, scattered into zeros) is a buffer inductor
    mutates: the kernel that reads it last writes its own output elsewhere, even element for
    element where it reads."""

    def f(x, index):
        return torch.zeros(8, 8).scatter_add(0, index, x) * 2.0

    jg, named, cost = _in_place_case(f, torch.randn(8, 8), torch.randint(0, 8, (8, 8)))
    assert not reads_in_place(jg, named["mul"], named["scatter_add"], cost)

    def g(x):
        return (x * 3.0) * 2.0

    jg, named, cost = _in_place_case(g, torch.randn(8, 8))
    assert reads_in_place(jg, named["mul_1"], named["mul"], cost)


def test_no_kernel_writes_over_a_concatenation():
    """A concatenation's buffer is written by its inputs' kernels, none of its own (inductor's
    no-op kernel): no later kernel writes over it, even element for element where it reads
    (T5's per-chunk attention-bias gradients, summed into a buffer of their own)."""

    def f(a, b):
        return torch.cat([a @ b, a @ b.t()]) * 2.0

    jg, named, cost = _in_place_case(f, torch.randn(8, 8), torch.randn(8, 8))
    assert not reads_in_place(jg, named["mul"], named["cat"], cost)


def test_a_sum_reading_too_many_buffers_is_written_out_for_a_scatter():
    """Inductor stores an element-wise value once what it computes inline behind it reads more
    buffers than its limit (12 on CPU since torch 2.13, 8 before); its readers read that one
    buffer after it. Read by a scatter, the buffer is allocated (T5's attention-bias gradient);
    read by element-wise loops alone, the kernel computing it is theirs and it is never
    allocated (BEiT's layer-norm gradients). A sum of fourteen: with a limit of 12, the partial
    sum that reads the thirteenth is stored."""
    n = 14

    def f(idx, *xs, scatter):
        total = xs[0]
        for x in xs[1:]:
            total = total + x
        if scatter:
            return torch.ops.aten.index_put(torch.zeros(16, 8), [idx], total, True)
        return total * 2.0

    for scatter in (True, False):
        args = [torch.randint(0, 16, (8,)), *[torch.randn(8, 8) for _ in range(n)]]
        nodes, users = _aten_graph(functools.partial(f, scatter=scatter), *args)
        adds = [i for i, node in enumerate(nodes) if node.target is torch.ops.aten.add.Tensor]
        limit = tp.inductor_max_accumulated_reads("cpu")
        assert limit == (12 if tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 13) else 8)
        # x0 + ... + x12 with a limit of 12: thirteen buffers
        assert _realized(nodes, users) == ([adds[limit - 1]] if scatter else [])
        with torch._inductor.config.patch(realize_acc_reads_threshold=4):
            assert _realized(nodes, users) == ([adds[3], adds[7], adds[11]] if scatter else [])


def _realized(nodes, users):
    """The nodes whose storages `stored_on_reuse` marks written out beyond what
    `materialized_storages` does (each node its own storage)."""
    inputs = [[nodes.index(a) for a in node.all_input_nodes] for node in nodes]
    storage = list(range(len(nodes)))
    mat = materialized_storages(nodes, users, storage, len(nodes), *kernel_ops(nodes, users))
    before = list(mat)
    inlinable = [is_inlinable(node) for node in nodes]
    stored_on_reuse(nodes, inputs, users, storage, mat, inlinable, [True] * len(nodes))
    return [i for i in range(len(nodes)) if mat[i] and not before[i]]


def test_a_library_call_writes_all_its_outputs_while_its_inputs_live():
    """Attention's backward returns three gradients: all three are allocated while q, k, v
    and the incoming gradient are still alive, though the graph takes them out one by one."""

    def f(q, k, v):
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v)
        return out[0] * 2.0, out[1] * 3.0

    nodes, users = _aten_graph(f, *(torch.randn(1, 2, 8, 4) for _ in range(3)))
    order = list(range(len(nodes)))
    named = {n.name: i for i, n in enumerate(nodes)}
    getitems = [i for i, n in enumerate(nodes) if n.target is operator.getitem]
    jg = SimpleNamespace(
        nodes=nodes,
        inputs=[[named[a.name] for a in n.all_input_nodes] for n in nodes],
        users=users,
        storage=[-1 if n.target is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default else i
                 for i, n in enumerate(nodes)],
        fusible=[],
        tuple_parts=frozenset(getitems),
    )  # fmt: skip
    jg.call_outputs = JointGraph.call_outputs.func(jg)  # what a JointGraph keeps of its calls
    call = next(i for i, n in enumerate(nodes) if "flash" in str(n.target))
    made = outputs_made_at(jg, order)
    assert len(getitems) == 2 and sorted(made[call]) == getitems


def test_attention_without_dropout_may_be_recomputed():
    """Attention ops carry torch's "seeded" tag for their dropout; with dropout_p=0 they are
    pure functions of q, k, v and the planner may run them again."""

    def f(q, k, v, p):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, dropout_p=p)[0]

    qkv = [torch.randn(1, 2, 8, 4) for _ in range(3)]
    for p, random in ((0.0, False), (0.1, True)):
        nodes, _ = _aten_graph(functools.partial(f, p=p), *qkv)
        (attn,) = [n for n in nodes if "scaled_dot_product" in str(n.target)]
        assert is_random(attn) is random and not is_impure(attn), (p, attn.target)


def test_attention_workspace_is_measured():
    """The CPU flash kernels allocate per-thread blocks of scores inside themselves: a step's
    peak includes them, so the simulation charges them at the call."""
    nodes, _ = _aten_graph(F.scaled_dot_product_attention, *(torch.randn(2, 2, 512, 32) for _ in range(3)))
    (attn,) = [n for n in nodes if "scaled_dot_product" in str(n.target)]
    assert workspace_bytes(attn) > 0
    mm = _aten_graph(torch.mm, torch.randn(8, 8), torch.randn(8, 8))[0][-1]
    assert workspace_bytes(mm) == 0


def test_an_attention_backward_with_dropout_is_probed_with_dropout_off_and_host_seeds():
    """The CUDA attention backwards read dropout's seed and offset on the host (outside graph
    capture), while the fake values place them on the device: a probe run as the fake values
    say crashed the process. It runs with dropout off (the scratch space does not depend on it)
    and the random state on the host; an op without such state keeps its arguments."""

    def backward(g, q, k, v, out, lse, seed, offset):
        return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            g, q, k, v, None, out, lse, seed, offset, 0.1, [True, True, True, False]
        )

    qkv = [torch.randn(1, 2, 8, 4) for _ in range(5)]
    seeds = [torch.zeros((), dtype=torch.int64) for _ in range(2)]
    gm = make_fx(backward, tracing_mode="fake")(*qkv, torch.randn(1, 2, 8), *seeds)
    (bwd,) = [n for n in gm.graph.nodes if "efficient_attention_backward" in str(n.target)]
    assert bwd.args[9] == 0.1
    args, _ = _probe_arguments(bwd, [])
    assert args[9] == 0.0
    assert all(a.device.type == "cpu" and a.dtype == torch.int64 and a.dim() == 0 for a in args[7:9])
    assert [tuple(a.shape) for a in args[:4]] == [(1, 2, 8, 4)] * 4

    def forward(q, k, v):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, dropout_p=0.1)[0]

    nodes, _ = _aten_graph(forward, *qkv[:3])
    (attn,) = [n for n in nodes if "scaled_dot_product" in str(n.target)]
    args, kwargs = _probe_arguments(attn, [])
    assert (args[3:], kwargs) == (tuple(attn.args[3:]), dict(attn.kwargs))


def test_convolution_and_batch_norm_workspaces_are_measured_when_run_op_by_op():
    """Run one by one on CPU, a contiguous convolution reorders its input into a buffer as
    large as its output (its backward, more), and batch norm's backward makes a second buffer
    of its input's size: a CNN's measured peak held 12 MiB more than its plan without them.
    A fusing compiler decomposes the norms; its convolutions are probed only channels-last
    (see the next test)."""

    def conv_bn(x, w, g, b):
        y = F.conv2d(x, w, padding=1)
        return F.batch_norm(y, None, None, g, b, training=True)

    x, w = torch.randn(8, 16, 32, 32, requires_grad=True), torch.randn(16, 16, 3, 3, requires_grad=True)
    g, b = torch.ones(16, requires_grad=True), torch.zeros(16, requires_grad=True)
    gm = make_fx(lambda *a: torch.autograd.grad(conv_bn(*a).square().sum(), a), tracing_mode="fake")(x, w, g, b)
    out_bytes = 8 * 16 * 32 * 32 * 4
    found = {}
    for n in gm.graph.nodes:
        for op in ("convolution.default", "convolution_backward", "native_batch_norm_backward"):
            if op in str(n.target):
                found[op] = (workspace_bytes(n), workspace_bytes(n, fusing=True))
    assert found.keys() == {"convolution.default", "convolution_backward", "native_batch_norm_backward"}
    for op, (unfused, fused) in found.items():
        assert unfused >= out_bytes // 2, (op, unfused)
        assert fused == 0, op


def test_a_depthwise_convolutions_backward_is_probed_channels_last_under_inductor():
    """Channels-last, as inductor runs it on CPU, a 3x3 convolution's backward takes scratch
    space of a seventh of its input, a 7x7 depthwise one's one and a half times its input with
    AVX-512 (ConvNeXt's: 3.1 MiB at its last stage, uncounted, put its measured peak 2.2% above
    the plan), 0.39 times with AVX2 (oneDNN's kernels differ). Probed in the traced, contiguous
    layout instead, the 3x3 one's is twice its input, which over-counted RegNet's and
    PoolFormer's floors by 8–14%."""

    def convs(x, w3, w7):
        return F.conv2d(F.conv2d(x, w3, padding=1), w7, padding=3, groups=64)

    x = torch.randn(32, 64, 16, 16, requires_grad=True)
    w3, w7 = torch.randn(64, 64, 3, 3, requires_grad=True), torch.randn(64, 1, 7, 7, requires_grad=True)
    gm = make_fx(lambda *a: torch.autograd.grad(convs(*a).square().sum(), a), tracing_mode="fake")(x, w3, w7)
    backwards = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.convolution_backward.default)
    by_groups = {n.args[-2]: n for n in backwards}  # (..., groups, output_mask)
    assert by_groups.keys() == {1, 64}
    input_bytes = 32 * 64 * 16 * 16 * 4
    depthwise, dense = by_groups[64], by_groups[1]
    assert workspace_bytes(depthwise, fusing=True, channels_last=True) >= input_bytes // 4
    assert workspace_bytes(dense, fusing=True, channels_last=True) < input_bytes // 4
    assert workspace_bytes(dense) >= input_bytes  # contiguous, run op by op
    assert workspace_bytes(depthwise, fusing=True) == 0  # not probed where inductor lays them out itself


def test_a_workspace_probe_under_a_running_profiler_is_asked_again():
    """A first call inside fxmem.measure plans under its profiler, where no probe can run: that
    plan counts nothing, and the next one measures the workspace instead of keeping the 0."""
    nodes, _ = _aten_graph(F.scaled_dot_product_attention, *(torch.randn(2, 2, 384, 32) for _ in range(3)))
    (attn,) = [n for n in nodes if "scaled_dot_product" in str(n.target)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True):
        assert workspace_bytes(attn) == 0
    assert workspace_bytes(attn) > 0


def _vit_small():
    cfg = ViTConfig(image_size=32, patch_size=4, n_layer=2, n_head=2, n_embd=64, classes=10)
    return ViT(cfg), vit_batch(cfg, 16)


class _RowChunkedBlock(ViTBlock):
    """A ViT block whose MLP runs over four chunks of rows: its bias gradients are sums of
    per-chunk sums, which inductor would fuse into one kernel holding every chunk's gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(self.norm1(x)).view(B, N, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(*qkv.unbind(0)).transpose(1, 2).reshape(B, N, C)
        x = x + self.proj(y)
        h = self.norm2(x)
        return x + torch.cat([self.fc2(F.gelu(self.fc1(c))) for c in h.chunk(4)])


def _vit_row_chunked_mlp():
    cfg = ViTConfig(image_size=32, patch_size=4, n_layer=2, n_head=2, n_embd=64, classes=10)
    model = ViT(cfg)
    model.blocks = nn.ModuleList(_RowChunkedBlock(cfg) for _ in range(cfg.n_layer))
    return model, vit_batch(cfg, 16)


class _RelativeBiasBlock(ViTBlock):
    """A ViT block whose attention adds a learned bias per head and pair of tokens (BEiT's
    relative position bias). Split into groups by chunked_attention, the bias gradient is a
    concatenation of per-group sums of the softmax's gradient over the batch."""

    def __init__(self, cfg: ViTConfig, tokens: int):
        super().__init__(cfg)
        self.bias = nn.Parameter(0.02 * torch.randn(1, cfg.n_head, tokens, tokens))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(self.norm1(x)).view(B, N, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(*qkv.unbind(0), attn_mask=self.bias).transpose(1, 2).reshape(B, N, C)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def _vit_relative_bias():
    cfg = ViTConfig(image_size=32, patch_size=4, n_layer=1, n_head=4, n_embd=64, classes=10)  # 65 tokens
    model = ViT(cfg)
    model.blocks = nn.ModuleList(_RelativeBiasBlock(cfg, 65) for _ in range(cfg.n_layer))
    return model, vit_batch(cfg, 16)


@pytest.mark.slow
@pytest.mark.parametrize(
    "make, within",
    [(_vit_small, 0.10), (_vit_row_chunked_mlp, 0.10), (_vit_relative_bias, 0.03)],
    ids=["vit", "row-chunked-mlp", "relative-bias"],
)
def test_inductor_floor_holds_the_budget(make, within):
    """At the floor with inductor (recomputed chains fused into their readers, sums a
    concatenation alone reads, which inductor computes when it makes the concatenation), the
    measured peak is within the budget and the prediction within `within` of it. (A GPT with
    dropout at its floor under inductor: the test of its dropouts drawn again below.) The relative bias's sums, left
    dead before the concatenation computes them, were predicted 7% under the measured peak of
    one block over 257 tokens (two blocks broke the budget). The plans made since keep those
    sums off the peak there, so the block runs over 65 tokens: five groups of heads to compile
    where 257 tokens made seventeen (23 s of the suite's time where that took 86)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, batch = make()
    try:
        fxmem.optimize(model, 1e-6, example_inputs=batch)
    except fxmem.BudgetError as e:
        floor = e.floor_bytes
    m = fxmem.optimize(model, floor / 2**30)
    step(m, *batch)  # plans and compiles
    for p in model.parameters():
        p.grad = None
    measured = fxmem.measure(step, m, *batch).peak_bytes
    assert m.plan.recomputed
    assert measured <= m.plan.budget_bytes, (measured, m.plan.budget_bytes, m.plan.predicted_peak_bytes)
    assert abs(m.plan.predicted_peak_bytes - measured) <= within * measured


@pytest.mark.slow
def test_recomputed_chunks_wait_until_the_backward_asks_for_them():
    """Attention with dropout split into groups of heads (chunked_attention), recomputed: each
    group's weights are made when its gradient is formed, not every group's once the
    attention's inputs are back (inductor). The floor with the groups is 0.62x the floor
    without them here; made all at once, 0.70x."""
    cfg = GPTConfig(vocab_size=2048, block_size=256, n_layer=2, n_head=4, n_embd=128, dropout=0.1)
    floors = {}
    for name, passes in (("whole", [p for p in default_passes() if p != "chunked_attention"]), ("groups", None)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        with pytest.raises(fxmem.BudgetError) as e:
            fxmem.optimize(GPT(cfg), 1e-6, example_inputs=gpt_batch(cfg, 4, 256), passes=passes)
        floors[name] = e.value.floor_bytes
    assert floors["groups"] < 0.66 * floors["whole"], floors


def test_inductor_does_not_fuse_unrelated_kernels_across_a_library_call(monkeypatch):
    """Two kernels with no dependency between them are not fused when a library call runs
    between them: the earlier one's inputs would stay alive across the call. Without a call
    between them inductor's own heuristics decide."""
    from torch._inductor.choices import InductorChoices

    monkeypatch.setattr(InductorChoices, "can_fuse_horizontal", staticmethod(lambda *args: "inductor decides"))
    choices = tp._fusion_choices()

    def node(order, extern=False):
        return SimpleNamespace(min_order=order, max_order=order, is_extern=lambda: extern)

    early, call, late, next_to_early = node(3), node(5, extern=True), node(9), node(4)
    scheduler = SimpleNamespace(nodes=[early, next_to_early, call, late])
    assert not choices.can_fuse_horizontal(scheduler, early, late, 2**20)
    assert not choices.can_fuse_horizontal(scheduler, late, early, 2**20)
    assert choices.can_fuse_horizontal(scheduler, early, next_to_early, 2**20) == "inductor decides"


def test_inductor_choices_pickle_by_name():
    """Inductor pickles its config, this class included, into its cache key: a class it cannot
    pickle by name makes torch 2.11 bypass the cache on every compile."""
    import pickle

    choices = tp._fusion_choices()
    assert pickle.loads(pickle.dumps(choices)) is choices


def test_inductor_does_not_fuse_a_kernel_with_a_reader_after_a_library_call(monkeypatch):
    """A kernel fused with a reader that runs after a library call moves work across the call:
    a reduction's input, or what a pointwise reader writes, would be alive across it. Readers
    before any call are inductor's to decide."""
    from torch._inductor.choices import InductorChoices

    monkeypatch.setattr(InductorChoices, "can_fuse_vertical", staticmethod(lambda *args: "inductor decides"))
    choices = tp._fusion_choices()

    def node(order, extern=False, reduction=False):
        return SimpleNamespace(
            min_order=order, max_order=order, is_extern=lambda: extern, is_reduction=lambda: reduction
        )

    total, call, consumer, near = node(3, reduction=True), node(5, extern=True), node(9), node(4)
    pointwise = node(2)
    scheduler = SimpleNamespace(nodes=[pointwise, total, near, call, consumer])
    assert not choices.can_fuse_vertical(scheduler, total, consumer, 2**20)
    assert not choices.can_fuse_vertical(scheduler, pointwise, consumer, 2**20)
    assert choices.can_fuse_vertical(scheduler, total, near, 2**20) == "inductor decides"
    assert choices.can_fuse_vertical(scheduler, pointwise, near, 2**20) == "inductor decides"


def test_identical_dropouts_share_one_kernel_and_draw_the_same_numbers(monkeypatch):
    """Inductor writes each random op's seed index into its kernel; read from a buffer of its
    own, the seed leaves two identical dropouts one kernel, and the numbers drawn unchanged."""
    from_buffers, by_index = dropout_blocks_runs(monkeypatch)
    assert from_buffers[2].count("normalized_rand_cpu") == 1  # one kernel draws, called twice
    assert by_index[2].count("normalized_rand_cpu") == 2  # one per dropout, told apart by index
    assert_same_step(from_buffers, by_index)


def test_dropouts_recomputed_in_the_backward_read_seeds_from_buffers_and_plan_exactly(monkeypatch):
    """At the floor under inductor the backward draws each attention group's dropout mask
    again. Read by index, the seed leaves the draw in the kernel of the softmax before it,
    which then holds the scores, the random numbers, the softmax and the dropped-out weights
    at once (measured 1.9% above the prediction on this model); read from a buffer, as the
    forward reads it, the kernel splits where the simulation has it, and the groups' draws
    share one kernel. The numbers drawn are the same: so are the gradients."""
    from torch._inductor.utils import run_and_get_code

    cfg = GPTConfig(vocab_size=512, block_size=128, n_layer=1, n_head=4, n_embd=64, dropout=0.1)
    torch.manual_seed(0)
    model = GPT(cfg)
    batch = gpt_batch(cfg, 4, 128)
    with pytest.raises(fxmem.BudgetError) as err:
        fxmem.optimize(model, 1e-6, example_inputs=batch)
    floor = err.value.floor_bytes
    del err  # what it holds would be counted against the budget
    m = fxmem.optimize(model, floor * 1.03 / 2**30)
    _, codes = run_and_get_code(step, m, *batch)  # plans and compiles
    assert m.plan.rewrites["chunked_attention"] == 1
    backward = codes[-1]
    draws, kernels = backward.count("torch.ops.fxmem.rows.default("), backward.count("normalized_rand_cpu(")
    assert 0 < kernels < draws  # a kernel per shape of mask, called once a draw
    model.zero_grad(set_to_none=True)
    measured = fxmem.measure(step, m, *batch)
    assert measured.peak_bytes <= m.plan.budget_bytes
    assert abs(measured.peak_bytes - m.plan.predicted_peak_bytes) <= 0.005 * m.plan.predicted_peak_bytes

    def grads_drawn(module):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        step(module, *batch)
        return grads_of(model)

    # held as arrays, and the gradients let go: no tensor of this step counts in the next plan
    from_buffers = {name: g.numpy().copy() for name, g in grads_drawn(m).items()}
    model.zero_grad(set_to_none=True)
    real = partition.seeds_from_buffers

    def forward_only(gm):  # the backward's graph takes the gradients of the outputs
        backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes)
        return 0 if backward else real(gm)

    monkeypatch.setattr(partition, "seeds_from_buffers", forward_only)
    torch._dynamo.reset()
    by_index, codes = run_and_get_code(grads_drawn, fxmem.optimize(model, floor * 1.03 / 2**30))
    assert "normalized_rand_cpu(" in codes[-1] and "fxmem.rows" not in codes[-1]  # drawn again, by index
    assert max_rel_err({name: torch.from_numpy(g) for name, g in from_buffers.items()}, by_index) < 1e-5


def test_a_recomputed_attention_is_named_and_costed_in_the_plan():
    """Attention returns its output with its log-sum-exp; the plan's decision for the output
    names the attention and carries its cost (once), not the zero of a tuple lookup."""
    torch.manual_seed(0)
    model, batch = _vit_small()
    with pytest.raises(fxmem.BudgetError) as err:
        fxmem.optimize(model, 1e-6, example_inputs=batch, compiler="eager")
    plan = err.value.plan  # the floor's plan, where the attentions run again
    attention = [d for d in plan.decisions if d.action == "recompute" and "scaled_dot_product" in d.op]
    assert attention, [(d.name, d.op) for d in plan.decisions if d.action == "recompute"]
    # two layers: each attention's output and log-sum-exp, the attention's cost on one of them
    assert len(attention) == 4 and all(d.name.startswith("getitem") for d in attention)
    assert len([d for d in attention if d.cost_s > 0]) == 2


def test_an_attention_computed_again_for_one_output_writes_the_other_again(monkeypatch):
    """Attention returns its output and its log-sum-exp in new buffers each time it runs: run
    again in the backward for the log-sum-exp alone, it writes a second copy of the saved output
    too, alive while the call runs, which the simulation charges at that step."""
    seen = _capture_emits(monkeypatch)
    torch.manual_seed(0)
    model, batch = _vit_small()
    step(fxmem.optimize(model, 1.0, compiler="eager", example_inputs=batch), *batch)
    jg = seen[-1][0]
    call, parts = next((i, p) for i, p in jg.call_outputs.items() if "scaled_dot_product" in str(jg.nodes[i].target))
    (out, out_sid), (lse, _) = parts
    saved = [False] * len(jg.nodes)
    for i in jg.boundary():
        saved[i] = True
    saved[out], saved[lse] = True, False
    tl = simulate(jg, saved, record_events=True)
    assert call in tl.recomputed and out not in tl.recomputed
    t = tl.order.index(call, tl.boundary)
    inside = [b for when, key, b in tl.events if when == t and key == -2 - call and b > 0]
    assert inside == [jg.transient[call] + jg.storage_bytes[out_sid]], (inside, jg.transient[call])


def _trials(monkeypatch, jg):
    """The walks' trials on `jg`, each as (saved set, the peak it was to stay under, whether it
    did)."""
    seen = []
    original = walks.timeline_within

    def trial(graph, saved, above):
        tl = original(graph, saved, above)
        if graph is jg:
            seen.append((bytes(saved), above, tl is not None))
        return tl

    monkeypatch.setattr(walks, "timeline_within", trial)
    return seen


@pytest.mark.parametrize("make", [small_gpt, _vit_small])
def test_a_walk_does_not_simulate_again_a_saved_set_refused_at_a_peak_no_higher(monkeypatch, make):
    """After a refused batch and one move of it taken, the next batch is often the refused
    saved set again: the walk knows it passes the peak without simulating it."""
    seen = _capture_emits(monkeypatch)
    model, batch = make()
    step(fxmem.optimize(model, 1.0, compiler="eager", example_inputs=batch), *batch)
    jg = seen[-1][0]
    trials = _trials(monkeypatch, jg)
    trajectory = plan_trajectory(jg)
    refused: dict[bytes, int] = {}
    for key, above, kept in trials:
        assert refused.get(key, -1) < above, "a saved set refused at a peak no higher was simulated again"
        if not kept:
            refused[key] = above
    assert refused, "no trial was refused: nothing to check"
    assert len(trajectory.states) > 2


def test_planning_pauses_the_collector_and_restores_it(monkeypatch):
    """The cyclic garbage collector is off while planning runs (each full collection would
    scan every object alive), and on again when it ends, refused or not; a process that turned
    it off itself finds it off."""
    during = []
    original = partition.plan_trajectory

    def spy(jg, floor_bytes=0):
        during.append(gc.isenabled())
        return original(jg, floor_bytes)

    monkeypatch.setattr(partition, "plan_trajectory", spy)
    assert gc.isenabled()
    model, batch = small_gpt()
    step(fxmem.optimize(model, 1.0, compiler="eager", example_inputs=batch), *batch)
    assert during and not any(during)
    assert gc.isenabled()
    with pytest.raises(fxmem.BudgetError):
        fxmem.optimize(small_gpt()[0], 1e-6, compiler="eager", example_inputs=batch)
    assert gc.isenabled()
    gc.disable()
    try:
        step(fxmem.optimize(small_gpt()[0], 1.0, compiler="eager", example_inputs=batch), *batch)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_unread_outputs_of_an_op_are_its_temporaries_unless_they_are_views():
    """Run one by one, `log_sigmoid_forward` makes a buffer as large as its input that nothing
    reads (binary cross-entropy with logits: 4 MiB the plan missed); `split`'s unread chunks are
    views of its input, made of nothing."""
    from fxmem.nodes import transient_bytes

    def f(x):
        out, _buffer = torch.ops.aten.log_sigmoid_forward(x)
        first = torch.ops.aten.split.Tensor(x, 32)[0]
        return out.sum() + first.sum()

    gm = make_fx(f, tracing_mode="fake")(torch.randn(64, 16))
    gm.graph.eliminate_dead_code()  # as in a joint graph: no getitem of what nothing reads
    by_op = {str(n.target): transient_bytes(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert by_op["aten.log_sigmoid_forward.default"] == 64 * 16 * 4
    assert by_op["aten.split.Tensor"] == 0


def test_the_parts_of_a_split_share_its_inputs_storage_whatever_their_fake_values_say():
    """A pass that makes a split's fake value again can leave its parts' with a storage of
    their own (T5's keys after the backward copies): read so, a chunk of the keys was a value
    apart, and the keys died before the chunk's last reader."""
    from fxmem.storages import node_storages

    nodes, _ = _aten_graph(lambda x: [c * 2 for c in (x @ x.T).split(2)], torch.randn(4, 4))
    by_name = {n.name: n for n in nodes}
    part = next(n for n in nodes if n.target is operator.getitem)
    with FakeTensorMode():
        part.meta["val"] = torch.empty(part.meta["val"].shape)  # a storage of its own
    storage, _ = node_storages(nodes)
    index = {n: i for i, n in enumerate(nodes)}
    assert storage[index[part]] == storage[index[by_name["mm"]]]


def test_a_chunk_two_matmuls_read_is_computed_right_before_the_first(monkeypatch):
    """Scaled chunks of recomputed queries and keys, each read by the scores' matmul and again
    by a gradient's (T5's attention, split by chunked_attention): inductor computes each right
    before the first matmul that reads it, the projection alive until the last chunk. The plan
    had them all computed where the backward recomputes the projection, which so died early:
    1.75 MiB under T5's measured peak. Now the prediction is the measured peak."""
    b, t, d, chunks = 8, 512, 64, 8

    class Chunked(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)

        def forward(self, x):
            out = 0
            for qc, kc in zip(self.q(x).chunk(chunks), self.k(x).chunk(chunks), strict=True):
                scores = (qc * 0.5) @ (kc * 0.5).transpose(-1, -2)
                out = out + (scores.softmax(-1) @ kc).square().mean()
            return out

    seen = _capture_emits(monkeypatch)
    torch.manual_seed(0)
    got, predicted = _measured_above_floor(Chunked(), (torch.randn(b, t, d),))
    assert abs(got - predicted) <= 0.005 * predicted, (got / 2**20, predicted / 2**20)
    jg, choice = seen[-1][:2]
    bwd, _ = backward_order(jg, choice.saved)
    order = as_realized(jg, jg.forward_nodes + jg.tangent_nodes + bwd, len(jg.forward_nodes))
    step_of = {i: t for t, i in enumerate(order) if t >= len(jg.forward_nodes)}
    moved, late = 0, set(jg.written_by_readers)
    for i in set(jg.forward_nodes) & late:  # the chunks' scaling, recomputed
        if i not in step_of or jg.nodes[i].target not in (torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar):
            continue
        s = jg.storage[i]
        calls = [u for j in jg.storage_nodes[s] for u in jg.users[j] if jg.storage[u] != s and u in step_of]
        between = order[step_of[i] + 1 : min(step_of[u] for u in calls)]
        # nothing runs in between but views and the call's other such inputs
        assert all(j in late or is_view_op(jg.nodes[j]) for j in between), [jg.nodes[j].name for j in between]
        moved += len(calls) > 1
    assert moved


def _backward_with_first(jg: JointGraph, saved: list[bool], name: str) -> tuple[list[int], int]:
    """The whole graph's order with the backward step `name` right after what it needs and
    everything that does not need it before what does; and that step's position."""
    bwd, _ = backward_order(jg, saved)
    i = next(k for k, n in enumerate(jg.nodes) if n.name == name)
    needs, needed, stack = {i}, set(), [i]
    for k in bwd:
        if any(j in needs for j in jg.inputs[k]):
            needs.add(k)
    while stack:
        for j in jg.inputs[stack.pop()]:
            if j in bwd and j not in needed:
                needed.add(j)
                stack.append(j)
    rest = [k for k in bwd if k not in needed and k not in needs]
    steps = [k for k in bwd if k in needed] + [i] + rest + [k for k in bwd if k in needs and k != i]
    head = jg.forward_nodes + jg.tangent_nodes
    between = [k for k in rest if not is_view_op(jg.nodes[k])]
    assert between, "nothing to run between the step and its readers: the check could not fail"
    return head + steps, len(head) + len(needed)


def _bmm_graph(monkeypatch, model, batch, unsaved=()):
    """`model`'s joint graph, and which of its forward values are saved: all but `unsaved`."""
    seen = _capture_emits(monkeypatch)
    fxmem.optimize(model, 1.0, passes=[])(*batch).backward()
    jg = seen[-1][0]
    saved = [k in jg.forward_nodes and jg.nodes[k].name not in unsaved for k in range(len(jg.nodes))]
    return jg, saved


def test_a_gradient_library_calls_read_is_written_where_it_stands(monkeypatch):
    """A gradient the backward returns and batched matmuls read (the gradients of `w` and of
    `x`'s branch read the bias's): inductor writes a value the graph returns where it stands.
    Counted as computed right before the first matmul, it moved past what ran in between."""

    class Biased(nn.Module):
        def __init__(self, b: int = 4, t: int = 16, d: int = 8):
            super().__init__()
            self.bias = nn.Parameter(torch.randn(b, t, d))
            self.w = nn.Parameter(torch.randn(b, d, d))

        def forward(self, x):
            z = torch.bmm(torch.tanh(x), self.w) + self.bias
            return z.sum() + z.mean()

    jg, saved = _bmm_graph(monkeypatch, Biased(), (torch.randn(4, 16, 8, requires_grad=True),))
    grad = next(i for i in jg.bwd_outputs if jg.nodes[i].target is torch.ops.aten.add.Tensor)
    assert jg.fusible[grad] and jg.inlinable[grad] and jg.materialized[jg.storage[grad]]
    assert grad not in jg.written_by_readers
    assert {op_name(jg.nodes[u]) for u in jg.users[grad]} == {"bmm"}
    order, t = _backward_with_first(jg, saved, jg.nodes[grad].name)
    assert as_realized(jg, order, len(jg.forward_nodes))[t] == grad


def test_a_value_loading_two_views_of_one_buffer_is_written_where_it_stands(monkeypatch):
    """A gated value, the product of a matmul's two halves, recomputed in the backward and
    read there by two batched matmuls: its code loads the one buffer at two places, two
    loads, so inductor writes it where it stands (`realize_hint`). Counted by buffer, one
    load, it moved to right before the first matmul."""
    b, t, d = 4, 16, 8

    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(b, d, 2 * d))
            self.a, self.c = nn.Parameter(torch.randn(b, d, d)), nn.Parameter(torch.randn(b, d, d))

        def forward(self, x):
            h1, h2 = torch.bmm(x, self.w).chunk(2, -1)
            u = h1 * h2
            return (torch.bmm(u, self.a) * torch.bmm(u, self.c)).mean()

    jg, saved = _bmm_graph(monkeypatch, Gated(), (torch.randn(b, t, d),), unsaved=("mul", "bmm_1", "bmm_2"))
    (u,) = [i for i, n in enumerate(jg.nodes) if n.name == "mul"]
    assert u in jg.written_by_readers
    assert len(jg.inputs[u]) == 2 and len({jg.storage[j] for j in jg.inputs[u]}) == 1  # the halves
    order, t = _backward_with_first(jg, saved, "mul")
    assert as_realized(jg, order, len(jg.forward_nodes))[t] == u


def _wrapper_code(simdlen: int | None) -> tuple[list[str], int, bool]:
    """Inductor's wrapper code (what runs the kernels: allocations, calls, frees) of a dropout
    GPT's step at its floor, its C++ kernels compiled at that vector width; the plan's predicted
    peak; whether any kernel is vectorized."""
    from torch._inductor.utils import run_and_get_code

    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=32, dropout=0.1)
    torch.manual_seed(0)
    model, batch = GPT(cfg), gpt_batch(cfg, 4, 64)
    floor, _ = floor_plan(model, batch)
    with torch._inductor.config.patch({"cpp.simdlen": simdlen}):
        m = fxmem.optimize(model, floor / 2**30)
        _, codes = run_and_get_code(step, m, *batch)
    vector_code = "at::vec::Vectorized" in "".join(codes)
    return [code[code.index("def call(") :] for code in codes], m.plan.predicted_peak_bytes, vector_code


def test_scalar_kernels_run_the_step_vectorized_ones_run():
    """The suite compiles inductor's CPU kernels scalar (conftest.py), on the premise that only
    the code inside the kernels changes: the buffers allocated, the kernels called on them and
    the frees are those of the vectorized kernels a user's step runs."""
    vectorized = _wrapper_code(None)
    torch._dynamo.reset()
    scalar = _wrapper_code(1)
    assert len(vectorized[0]) == 2  # forward and backward
    assert vectorized[2] and not scalar[2]
    assert scalar[:2] == vectorized[:2]

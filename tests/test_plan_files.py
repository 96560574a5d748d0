"""Every file `Plan.save` writes is parsed back; plans are reused, refused, dumped and logged."""

from __future__ import annotations

import json
import logging
import os
import pickle

import matplotlib.image
import networkx as nx
import pytest
import torch
from _factories import convnet, tiny_gpt
from conftest import SMALL_GPT, small_gpt, step

import fxmem
from fxmem.plan_files import TIMELINE_PX, measure_plan
from fxmem.plan_record import alive_at_peak, category_curves, total_curve
from fxmem.testing import gpt_batch

MiB = 2**20


def _plan(budget_gb: float, factory=tiny_gpt, **kwargs) -> tuple[fxmem.Plan, object, tuple]:
    model, batch = factory()
    wrapped = fxmem.optimize(model, budget_gb, compiler="eager", example_inputs=batch, **kwargs)
    return wrapped.plan, wrapped, batch


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny GPT planned tight enough that some activations are recomputed, saved with a
    measured step attached."""
    torch._dynamo.reset()
    free, _, _ = _plan(1.0, small_gpt)
    plan, wrapped, batch = _plan((free.predicted_peak_bytes - 0.3 * free.saved_bytes) / 2**30, small_gpt)
    assert plan.recomputed, "the budget should force recomputation"
    step(wrapped, *batch)
    measure_plan(plan, lambda: step(wrapped, *batch))
    directory = tmp_path_factory.mktemp("plan")
    plan.save(directory)
    torch._dynamo.reset()
    return plan, directory


def test_plan_json_schema(saved):
    plan, directory = saved
    data = json.loads((directory / "plan.json").read_text())
    assert data["schema_version"] == 6
    for key in (
        "budget_bytes",
        "floor_bytes",
        "predicted_peak_bytes",
        "breakdown",
        "decisions",
        "rewrites",
        "backward_copies",
        "keep_outputs",
    ):
        assert key in data
    assert set(data["breakdown"]) >= {"parameters", "saved activations", "temporaries"}
    decision_keys = {"name", "nbytes", "op", "module", "source", "action", "reason", "cost_s"}
    assert all(decision_keys <= d.keys() for d in data["decisions"])
    recomputed = [d for d in data["decisions"] if d["action"] == "recompute"]
    assert recomputed and all(d["cost_s"] >= 0 and d["reason"] for d in recomputed)
    assert sum(d["cost_s"] for d in recomputed) > 0
    assert any(d["module"].startswith("h.") and "testing.py:" in d["source"] for d in data["decisions"])
    assert data["fingerprint"]["nodes"] == data["graph_nodes"] == len(data["graph"]["nodes"])
    assert len(data["fingerprint"]["sha256"]) == 64
    tl = data["timeline"]
    assert {phase for _, phase in tl["steps"]} >= {"fwd", "bwd", "recompute"}
    assert all(len(row) == 7 for row in data["graph"]["nodes"])
    assert data["measured"]["peak_bytes"] > 0 and len(data["measured"]["curve"]) > 10
    loaded = fxmem.Plan.load(directory / "plan.json")
    assert loaded == plan


def test_timeline_adds_up_to_the_predicted_peak(saved):
    plan, _ = saved
    total = total_curve(plan.timeline)
    assert max(total) == plan.predicted_peak_bytes
    curves = category_curves(plan.timeline)
    assert all(min(c) >= 0 for c in curves.values())
    assert curves["saved activations"][-1] == 0  # all consumed by the end of the backward
    assert curves["recomputed"][-1] == 0
    assert max(curves["recomputed"]) > 0


def test_timeline_adds_up_to_the_predicted_peak_under_inductor():
    """Under a fusing compiler a kernel writes its output over a buffer that dies in it; the
    timeline frees that buffer before the step, as the prediction does."""
    torch._dynamo.reset()
    model, batch = small_gpt()
    plan = fxmem.optimize(model, 1.0, compiler="inductor", example_inputs=batch).plan
    torch._dynamo.reset()
    assert max(total_curve(plan.timeline)) == plan.predicted_peak_bytes


def test_timeline_png_opens_with_its_size(saved):
    _, directory = saved
    image = matplotlib.image.imread(directory / "timeline.png")
    assert image.shape[:2] == (TIMELINE_PX[1], TIMELINE_PX[0])
    assert image[..., :3].std() > 0.05  # something was drawn


def test_graph_dot_parses_and_is_coloured_by_decision(saved):
    plan, directory = saved
    g = nx.nx_pydot.read_dot(directory / "graph.dot")
    names = {row[0] for row in plan.graph["nodes"]}
    assert names <= set(g.nodes)
    fill = {n: g.nodes[n].get("fillcolor", "").strip('"') for n in names}
    assert {fill[d.name] for d in plan.recomputed} == {"#f9cb9c"}
    assert {fill[d.name] for d in plan.saved} == {"#b6d7a8"}
    edges = sum(len(row[4]) for row in plan.graph["nodes"])
    assert sum(1 for u, v in g.edges() if u in names and v in names) == edges


def test_memory_snapshot_replays_to_the_predicted_timeline(saved):
    plan, directory = saved
    with open(directory / "memory_snapshot.pickle", "rb") as f:
        snap = pickle.load(f)  # noqa: S301 - the file under test; fxmem never reads pickles
    trace = snap["device_traces"][0]
    total = total_curve(plan.timeline)
    running, at_step, live = 0, {}, {}
    for event in trace:
        if event["action"] == "alloc":
            assert event["addr"] not in live
            live[event["addr"]] = event["size"]
            running += event["size"]
            at_step[event["time_us"]] = max(at_step.get(event["time_us"], 0), running)
        elif event["action"] == "free_completed":
            running -= live.pop(event["addr"])
    # Allocations of a step come before its frees, so the running total after a step's last
    # allocation is the predicted memory at that step.
    assert all(at_step[t] == total[t] for t in at_step if t > 0)
    assert max(at_step.values()) == plan.predicted_peak_bytes
    segment = snap["segments"][0]
    active = [b for b in segment["blocks"] if b["state"] == "active_allocated"]
    assert sum(b["requested_size"] for b in active) == running == sum(live.values())
    assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]
    from torch.cuda import _memory_viz

    assert "TOTAL MEM" in _memory_viz.trace(snap)  # torch's own reader of this layout
    assert "snapshot.pickle" in _memory_viz.trace_plot(snap)


def test_summary_names_the_backward_copies_in_the_estimate():
    """The added time includes the backward's copies of cheap values (made for a fusing
    compiler), which no decision lists: the summary says how much of it they are."""
    model, batch = tiny_gpt()
    plan = fxmem.optimize(model, 1.0, example_inputs=batch).plan
    assert 0 < plan.copies_time_s <= plan.added_time_s
    recomputing = sum(d.cost_s for d in plan.decisions if d.action == "recompute")
    assert recomputing <= plan.added_time_s - plan.copies_time_s + 1e-9
    assert f"{plan.copies_time_s * 1e3:.1f} ms of it for backward copies" in plan.summary()


def test_schema_version_1_still_loads(saved, tmp_path):
    plan, _ = saved
    data = plan.to_dict()
    for key in (
        "timeline", "graph", "fingerprint", "saved_nodes", "measured", "second_recomputation", "copies_time_s",
        "backward_copies", "keep_outputs",
    ):  # fmt: skip
        del data[key]
    data["schema_version"] = 1
    (tmp_path / "plan.json").write_text(json.dumps(data))
    old = fxmem.Plan.load(tmp_path / "plan.json")
    assert old.predicted_peak_bytes == plan.predicted_peak_bytes and old.timeline == {}
    assert old.backward_copies, "plans before version 5 were all made on the graph with the copies"
    assert old.keep_outputs, "plans before version 6 all counted the outputs through the backward"
    old.save(tmp_path / "again")  # no timeline: plan.json only, no error
    assert os.listdir(tmp_path / "again") == ["plan.json"]
    data["schema_version"] = 99
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="schema version 99"):
        fxmem.Plan.load(tmp_path / "plan.json")


def test_saved_plan_is_applied_and_a_different_graph_refused(saved):
    plan, directory = saved
    model, batch = small_gpt()
    reused = fxmem.optimize(model, 1.0, compiler="eager", example_inputs=batch, plan=directory)
    assert reused.plan.saved_nodes == plan.saved_nodes
    assert [d.name for d in reused.plan.recomputed] == [d.name for d in plan.recomputed]
    assert reused.plan.predicted_peak_bytes - plan.predicted_peak_bytes == (
        sum(reused.plan.timeline["static"].values()) - sum(plan.timeline["static"].values())
    )
    torch._dynamo.reset()
    other = gpt_batch(SMALL_GPT, 3, 256)
    with pytest.raises(fxmem.PlanMismatchError, match=r"first difference at node \d+: .*\[4, 256\].*\[3, 256\]"):
        fxmem.optimize(model, 1.0, compiler="eager", example_inputs=other, plan=directory / "plan.json")
    torch._dynamo.reset()
    with pytest.raises(fxmem.PlanMismatchError, match="it has \\d+ joint nodes, this graph has \\d+"):
        fxmem.optimize(*convnet()[:1], 1.0, compiler="eager", example_inputs=convnet()[1], plan=directory)


def test_a_saved_plan_refused_names_its_own_need_and_holds_there(saved):
    """A saved plan is one state: below its own peak it is refused with the budget it fits
    (not the floor planning reached beside it), and at that budget it applies and holds."""
    plan, directory = saved
    model, batch = small_gpt()
    with pytest.raises(fxmem.BudgetError, match=r"the saved plan's \(plan=\) own need") as err:
        fxmem.optimize(model, plan.floor_bytes / 2**30, compiler="eager", example_inputs=batch, plan=directory)
    need = err.value.floor_bytes
    assert need > plan.floor_bytes and need >= err.value.plan.predicted_peak_bytes
    del err
    torch._dynamo.reset()
    reused = fxmem.optimize(model, need / 2**30, compiler="eager", example_inputs=batch, plan=directory)
    assert reused.plan.saved_nodes == plan.saved_nodes
    got = fxmem.measure(step, reused, *batch)
    assert got.peak_bytes <= need


def test_a_saved_plan_applied_with_another_compiler_names_both(saved):
    _, directory = saved
    model, batch = small_gpt()
    with pytest.raises(fxmem.PlanMismatchError, match="compiler='eager'.*compiler='inductor'"):
        fxmem.optimize(model, 1.0, compiler="inductor", example_inputs=batch, plan=directory)


def test_fxmem_dump_and_backend_option(tmp_path, monkeypatch):
    model, batch = tiny_gpt()
    monkeypatch.setenv("FXMEM_DUMP", str(tmp_path / "env"))
    compiled = torch.compile(model, backend="fxmem", options={"compiler": "eager", "budget_gb": 1.0})
    compiled(*batch).backward()
    (dumped,) = os.listdir(tmp_path / "env")
    assert {"plan.json", "timeline.png", "graph.dot", "memory_snapshot.pickle"} <= set(
        os.listdir(tmp_path / "env" / dumped)
    )
    torch._dynamo.reset()
    monkeypatch.delenv("FXMEM_DUMP")
    compiled = torch.compile(model, backend="fxmem", options={"compiler": "eager", "dump": str(tmp_path / "opt")})
    compiled(*batch).backward()
    assert len(os.listdir(tmp_path / "opt")) == 1


def test_torch_logs_name_and_tlparse_artifact():
    from torch._logging import _internal

    assert _internal.log_registry.is_log("fxmem")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    _internal.trace_log.addHandler(handler)
    try:
        _plan(1.0)
    finally:
        _internal.trace_log.removeHandler(handler)
    artifacts = [r for r in records if "fxmem_plan" in str(getattr(r, "metadata", r.msg))]
    assert artifacts, [str(r.msg)[:80] for r in records][:5]
    payload = json.loads(artifacts[-1].payload)
    assert payload["schema_version"] == 6 and payload["predicted_peak_bytes"] > 0


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager")
    ids = torch.randint(0, 256, (4, 128))
    return model, {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("factory", [tiny_gpt, convnet, _hf_llama], ids=["gpt", "convnet", "hf-llama"])
def test_predicted_peak_within_15_percent_of_measured(factory, tmp_path):
    model, example = factory()
    # No rule passes: this checks the plan's prediction, whatever graph it is made for.
    wrapped = fxmem.optimize(model, 1.0, compiler="eager", example_inputs=example, passes=[])
    args, kwargs = ((), example) if isinstance(example, dict) else (example, {})

    def one_step():
        out = wrapped(*args, **kwargs)
        (out if isinstance(out, torch.Tensor) else out.loss).backward()

    one_step()  # gradients exist from here on, in both the plan's view and the measured one
    torch._dynamo.reset()
    wrapped = fxmem.optimize(model, 1.0, compiler="eager", example_inputs=example, passes=[])
    measured = fxmem.measure(one_step)
    predicted = json.loads(open(wrapped.plan.save(tmp_path, files=False)).read())["predicted_peak_bytes"]
    assert abs(predicted / measured.peak_bytes - 1) <= 0.15, (predicted / MiB, measured.peak_bytes / MiB)


def test_what_is_alive_at_the_peak_adds_up_to_the_predicted_peak():
    """The allocations alive at the timeline's peak, plus its static bytes, are the plan's
    predicted peak, at the step where the predicted memory is highest; `fxmem explain` lists
    them."""
    from fxmem.cli import explain_text

    model, batch = small_gpt()
    plan = fxmem.optimize(model, 0.5, compiler="eager", example_inputs=batch).plan
    at, peak, rows = alive_at_peak(plan.timeline)
    curve = total_curve(plan.timeline)
    assert at == curve.index(max(curve))
    assert peak == sum(nbytes for _, _, nbytes in rows)
    assert peak + sum(plan.timeline["static"].values()) == plan.predicted_peak_bytes
    assert [nbytes for _, _, nbytes in rows] == sorted((nbytes for _, _, nbytes in rows), reverse=True)
    assert {category for _, category, _ in rows} <= {
        "gradients",
        "saved activations",
        "outputs",
        "recomputed",
        "temporaries",
    }
    table = explain_text(plan, top=3).splitlines()
    first = table.index(next(line for line in table if line.startswith("alive at the predicted peak")))
    assert f"step {at + 1} of {len(plan.timeline['steps'])}" in table[first]
    for (name, category, _), line in zip(rows[:3], table[first + 3 : first + 6], strict=True):
        assert line.split()[0] == category.split()[0] and name in line.split()
    assert alive_at_peak({}) == (-1, 0, [])

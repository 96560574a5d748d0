"""The benchmark scripts run end to end at their smallest size, and report what they measured.

Timings are printed, never asserted; what is asserted is the contract the reports state: each
fxmem point within its budget as measured, gradients equal to eager's, a run cut short by its
time limit saying what it did not run, and claiming nothing it did not measure.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import budget_check  # noqa: E402
from benchmarks._models import MODELS, _gpt  # noqa: E402
from benchmarks._records import Config, Result  # noqa: E402
from benchmarks._report import render_model, summary_table  # noqa: E402
from fxmem.testing import GPTConfig  # noqa: E402


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), ROOT) if p)}
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_budget_check_holds_each_point_and_writes_its_report(tmp_path):
    out = _run(
        "budget_check.py", "--size", "quick", "--points", "remat:0.9,default:floor", "--steps", "1",
        "--out-dir", str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "budget_check.json").read_text())["rows"]
    assert [r["config"] for r in rows] == [
        "eager",
        "fxmem remat only (passes=()), 90% of eager's peak",
        "fxmem, at its floor",
    ]
    eager, *points = rows
    for r in points:
        assert r["error"] is None, r
        assert r["measured_peak_mib"] <= r["budget_mib"] and r["within_budget"] is True, r
        assert r["grad_rel_err"] < 1e-4, r
    assert points[0]["budget_mib"] == int(eager["measured_peak_mib"] * 2**20 * 0.9) / 2**20
    report = (tmp_path / "budget_check.md").read_text()
    assert "| fxmem, at its floor |" in report and "Status: finished." in report
    assert json.loads((tmp_path / "budget_check.json").read_text())["finished"] is True


@pytest.mark.parametrize("points", ["remat:1.5", "fast:0.5", "remat:half", "remat", "remat:0"])
def test_budget_check_refuses_malformed_points(points, capsys):
    with pytest.raises(SystemExit) as e:
        budget_check._parse(["--points", points])
    assert e.value.code == 2 and "--points" in capsys.readouterr().err


def test_budget_check_points_parse_with_spaces():
    args = budget_check._parse(["--points", "remat:0.8, default:floor"])
    assert args.points == [("remat", 0.8), ("default", None)]


def _point(**kw):
    row = {"error": None, "measured_peak_mib": 10.0, "budget_mib": 12.0, "within_budget": True, "grad_rel_err": 1e-6}
    return {**row, **kw}


def test_budget_check_exit_status_tells_broken_from_unfinished():
    ok = _point()
    assert budget_check.exit_status([ok]) == 0
    assert budget_check.exit_status([ok, _point(within_budget=False, measured_peak_mib=13.0)]) == 1
    assert budget_check.exit_status([ok, _point(grad_rel_err=math.nan)]) == 1
    assert budget_check.exit_status([ok, _point(grad_rel_err=None)]) == 1
    assert budget_check.exit_status([ok, _point(error="RuntimeError: boom", measured_peak_mib=None)]) == 1
    assert budget_check.exit_status([ok, _point(error=budget_check.NOT_RUN, measured_peak_mib=None)]) == 3
    assert budget_check.exit_status([ok, _point(error=budget_check.UNFINISHED, measured_peak_mib=None)]) == 3


@pytest.mark.slow
def test_a_budget_check_past_its_time_limit_says_what_it_did_not_run(tmp_path):
    out = _run(
        "budget_check.py", "--size", "quick", "--points", "remat:0.9", "--steps", "1", "--time-limit", "0.001",
        "--out-dir", str(tmp_path),
    )  # fmt: skip
    rows = json.loads((tmp_path / "budget_check.json").read_text())["rows"]
    assert rows[-1]["error"] == "not run: time limit", rows
    assert out.returncode == 3  # nothing broke the contract, but not everything was measured


def test_a_benchmark_past_its_time_limit_writes_what_it_did_not_run(tmp_path):
    out = _run("run.py", "--quick", "--models", "gpt,vit", "--time-limit", "0.001", "--out-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    report = (tmp_path / "RESULTS.md").read_text()
    # gpt started at once and ran none of its configurations; vit never started
    assert "**Cut short by the time limit.** Not run: eager," in report
    assert "Past the time limit (0 s): vit." in report and "for the whole run" in report


@pytest.mark.slow
def test_timed_rounds_past_the_time_limit_end_after_two_and_say_so(monkeypatch):
    """The limit passes during the first timed round: the next round is the last, measures
    each configuration's peak again, and the report says the medians are of two steps."""
    from benchmarks import _harness
    from benchmarks._records import Options

    late = []
    monkeypatch.setattr(Options, "out_of_time", lambda self: bool(late))

    def log(msg: str) -> None:
        if "round 1/" in msg:
            late.append(msg)

    opts = Options(steps=5, amb_values=(), fxmem_points=1, eager_fractions=(), remat_only=False, sliced=False)
    tiny = GPTConfig(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=32)  # the rounds, not the model
    result = _harness.bench_model(
        dataclasses.replace(MODELS["gpt"], sizes={"quick": _gpt(tiny, 2, 32)}), "quick", opts, log
    )
    assert (result.rounds, result.rounds_wanted) == (2, 5)
    ran = [c for c in result.configs if c.ok]
    assert {c.kind for c in ran} >= {"eager", "compile", "fxmem"}
    for c in ran:
        assert len(c.times) == 2 and len(c.peaks) >= 2, c  # the warm-up's peak, the last round's
    section = render_model(result, None)
    assert "**Timed rounds ended by the time limit:** 2 of 5; each median is of 2 steps." in section
    assert f"| {result.spec.name} (cut short) |" in summary_table([result])


def _measured(name, kind, peak, step, budget=None):
    c = Config(name, kind, budget_bytes=budget)
    c.peaks, c.times, c.profiled_times, c.first_s = [peak], [step], [step], step
    return c


def test_a_model_cut_short_claims_no_floor():
    mib = 2**20
    configs = [
        _measured("eager", "eager", 100 * mib, 1.0),
        _measured("torch.compile", "compile", 80 * mib, 0.8),
        _measured("fxmem, unconstrained", "fxmem", 60 * mib, 0.8),
    ]
    cut = Result(MODELS["gpt"], "quick", configs, fxmem_floor_bytes=20 * mib, cut_short=["fxmem, at its floor"])
    section = render_model(cut, None)
    assert "Cut short by the time limit" in section and "fxmem, at its floor" in section
    assert "floor: not measured" in section and "not met" not in section
    assert "not measured (time limit)" in summary_table([cut])
    whole = Result(MODELS["gpt"], "quick", configs, fxmem_floor_bytes=20 * mib)
    assert "**not met**" in render_model(whole, None)  # 60 MiB against half of 80: the check still runs


def test_cuda_peak_replays_an_allocator_trace_to_its_peak():
    from benchmarks.cuda_peak import alive_at_measured_peak

    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 4096},
        {"action": "alloc", "addr": 10, "size": 100},
        {"action": "alloc", "addr": 20, "size": 300},
        {"action": "free_requested", "addr": 1, "size": 64},  # alive before the trace
        {"action": "free_completed", "addr": 1, "size": 64},
        {"action": "free_requested", "addr": 2, "size": 32},  # never counted: ignored
        {"action": "free_requested", "addr": 10, "size": 100},
        {"action": "free_completed", "addr": 10, "size": 100},
        {"action": "alloc", "addr": 30, "size": 50},
        {"action": "alloc", "addr": 10, "size": 120},
        {"action": "free_requested", "addr": 20, "size": 300},
    ]
    peak, blocks = alive_at_measured_peak(trace, {1: 64})
    assert peak == 100 + 300 - 64 - 100 + 50 + 120  # the earlier block's free counts, once
    assert sorted((b["addr"], b["size"]) for b in blocks) == [(10, 120), (20, 300), (30, 50)]
    assert alive_at_measured_peak(trace[:3], {})[0] == 400


def test_cuda_peak_pairs_the_measured_blocks_with_the_plans_allocations():
    """What is left unpaired is the difference: a measured block the plan lacks, a planned
    allocation nothing measured matches; sizes pair within the slack."""
    from benchmarks.cuda_peak import unmatched

    mib = 2**20
    measured = [(96 * mib, "buf1"), (24 * mib, "buf2"), (24 * mib, "buf3"), (72 * mib, "buf4"), (100, "buf5")]
    predicted = [(96 * mib, "saved h"), (24 * mib, "saved x"), (72 * mib - 256, "temp g"), (6 * mib, "saved mask")]
    missed, extra = unmatched(measured, predicted)
    assert missed == [(24 * mib, "buf3"), (100, "buf5")]
    assert extra == [(6 * mib, "saved mask")]
    assert unmatched(measured, [(72 * mib - 1024, "g")])[1] == [(72 * mib - 1024, "g")]  # beyond the slack


def test_cuda_peak_names_the_models_it_can_build(capsys):
    """An unknown --model is refused with the names it takes: the small GPT of the CUDA tests
    and the benchmark models that have a CUDA size."""
    import argparse

    from benchmarks._models import MODELS
    from benchmarks.cuda_peak import _build

    with pytest.raises(SystemExit):
        _build("resnet-9000", argparse.ArgumentParser(prog="cuda_peak.py"))
    err = capsys.readouterr().err
    assert "--model 'resnet-9000'" in err and "test-gpt" in err
    assert all(name in err for name, spec in MODELS.items() if "cuda" in spec.sizes)


def test_planning_time_plans_benchmark_models_at_a_size():
    out = _run("planning_time.py", "--models", "gpt", "--size", "quick")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("[gpt] quick size")]
    assert len(lines) == 2 and all("joint nodes, planned in" in line for line in lines), out.stdout
    assert "passes fired: swap_sdpa" in lines[0] and "passes fired: none" in lines[1]


def test_planning_time_plans_a_model_at_budgets_between_its_floor_and_unconstrained():
    out = _run("planning_time.py", "--models", "gpt", "--size", "quick", "--budgets", "3")
    assert out.returncode == 0, out.stderr[-2000:]
    found = re.findall(r"budget ([0-9.]+) MiB: predicted ([0-9.]+) MiB, estimated added time ([0-9.]+) ms", out.stdout)
    assert len(found) == 2, out.stdout
    (b1, p1, t1), (b2, p2, t2) = ((float(x) for x in row) for row in found)
    assert b1 < b2 and p1 <= b1 and p2 <= b2, out.stdout
    assert t1 >= t2, out.stdout  # the tighter budget recomputes more here
    refused = _run("planning_time.py", "--models", "gpt", "--budgets", "1")
    assert refused.returncode == 2 and "N >= 2" in refused.stderr, refused.stderr[-2000:]


def test_planning_time_plans_hf_architectures_for_their_floor():
    pytest.importorskip("transformers")
    out = _run("planning_time.py", "--zoo", "bloom,bloom")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("[bloom] eager:")]
    assert len(lines) == 2 and all("joint nodes, planned in" in line for line in lines), out.stdout
    floors = [float(re.search(r"floor ([0-9.]+) MiB", line).group(1)) for line in lines]
    # The second is planned with nothing of the first alive: the same floor.
    assert 0 < floors[0] < 1000 and floors[1] == floors[0], lines


def test_cnn_floor_reports_each_model_and_compiler(capsys):
    from benchmarks import cnn_floor

    assert cnn_floor.main(["--models", "convnet", "--compilers", "eager"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| convnet | eager |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    floor, measured = float(cells[3]), float(cells[4])
    assert measured <= floor and cells[6] == "yes"
    with pytest.raises(SystemExit):
        cnn_floor.main(["--models", "resnet9000"])


def test_hf_zoo_left_padded_with_eager_attention_takes_swap_sdpa_and_holds(capsys):
    """HF Llama's eager attention with an attention mask that pads half the batch on the left:
    swap_sdpa fires in both layers (the rows with nothing to attend to computed apart), every
    token's loss reaches the gradients, and they are eager's; the floor holds as predicted."""
    pytest.importorskip("transformers")
    from benchmarks import hf_zoo

    args = ["--models", "llama", "--padded", "--attention", "eager", "--budget", "floor", "--keep-outputs", "false"]
    assert hf_zoo.main(args) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| llama |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    budget, measured, predicted = float(cells[2]), float(cells[3]), float(cells[4])
    assert measured <= budget and abs(measured - predicted) <= 0.01 * measured, cells
    assert float(cells[6]) < 1e-5 and "swap_sdpa x2" in cells[8], cells


def test_hf_zoo_holds_a_model_at_its_floor(capsys):
    pytest.importorskip("transformers")
    from benchmarks import hf_zoo

    floors = {}
    for keep in ("true", "false"):
        hold = ["--hold-outputs"] if keep == "true" else []  # the step each plan is made for
        assert hf_zoo.main(["--models", "llama", "--budget", "floor", "--keep-outputs", keep, *hold]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| llama |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        budget, measured, predicted = float(cells[2]), float(cells[3]), float(cells[4])
        assert measured <= budget and cells[5] == "yes" and float(cells[6]) < 1e-4
        floors[keep] = budget, measured, predicted
    # The step keeps only the loss: planned for that, the floor is lower (by more than half the
    # 8 MiB of logits) and the step measures what the plan predicts.
    assert floors["false"][0] < floors["true"][0] - 4, floors
    assert abs(floors["false"][1] - floors["false"][2]) <= 0.01 * floors["false"][1], floors
    assert floors["true"][1] <= floors["true"][2] * 1.005, floors  # outputs held: no more than predicted
    bad_args = (
        ["--budget", "2"],
        ["--models", "llama9000"],
        ["--keep-outputs", "maybe"],
        ["--hold-outputs", "--keep-outputs", "false"],
    )
    for bad in bad_args:
        with pytest.raises(SystemExit):
            hf_zoo.main(bad)

"""The benchmark scripts run end to end at their smallest size, and report what they measured.

Timings are printed, never asserted; what is asserted is the contract the reports state: each
fxmem point within its budget as measured, gradients equal to eager's, a run cut short by its
time limit saying what it did not run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


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
    assert "| fxmem, at its floor |" in (tmp_path / "budget_check.md").read_text()


def test_budget_check_refuses_malformed_points(tmp_path):
    for points in ("remat:1.5", "fast:0.5", "remat:half", "remat"):
        out = _run("budget_check.py", "--size", "quick", "--points", points, "--out-dir", str(tmp_path))
        assert out.returncode == 2 and "--points" in out.stderr, (points, out.stderr[-500:])


def test_a_budget_check_past_its_time_limit_says_what_it_did_not_run(tmp_path):
    out = _run(
        "budget_check.py", "--size", "quick", "--points", "remat:0.9", "--steps", "1", "--time-limit", "0.001",
        "--out-dir", str(tmp_path),
    )  # fmt: skip
    rows = json.loads((tmp_path / "budget_check.json").read_text())["rows"]
    assert rows[-1]["error"] == "not run: time limit", rows
    assert out.returncode == 1  # a point not measured is not a pass

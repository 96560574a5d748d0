"""The `fxmem` command: plan, explain, estimate, and its errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fxmem.cli import CliError, main, parse_size
from fxmem.estimate import estimate
from fxmem.plan_record import category_curves

HERE = os.path.dirname(__file__)
FACTORIES = os.path.join(HERE, "_factories.py")


@pytest.mark.parametrize(
    "text, nbytes",
    [("8GB", 8 * 2**30), ("8GiB", 8 * 2**30), ("0.5", 2**29), ("512MB", 512 * 2**20), ("512 mib", 512 * 2**20),
     ("64KB", 65536), ("100B", 100), ("1e3", 1000 * 2**30), ("1TB", 2**40)],
)  # fmt: skip
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "eight GB", "8 GBs", "-1GB", "0", "8XB", "GB", "1e-12", "0.5b", "1e400"])
def test_parse_size_refuses(text):
    with pytest.raises(CliError):
        parse_size(text)


@pytest.mark.parametrize(
    "budget, message", [("1e-12", "at least 1 byte"), ("0.5b", "at least 1 byte"), ("1e400", "a finite number")]
)
def test_budget_under_a_byte_or_infinite_is_a_clear_error(budget, message, capsys):
    assert main(["-q", "plan", f"{FACTORIES}:tiny_gpt", "--budget", budget]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", f"{FACTORIES}:tiny_gpt", "--budget", "lots"], "is not a size"),
        (["plan", "no/such/file.py:build", "--budget", "1GB"], "no such file"),
        (["plan", "no_such_module_xyz:build", "--budget", "1GB"], "cannot import 'no_such_module_xyz'"),
        (["plan", f"{FACTORIES}:missing", "--budget", "1GB"], "has no attribute 'missing'"),
        (["plan", f"{FACTORIES}:NOT_CALLABLE", "--budget", "1GB"], "is a int, not a callable"),
        (["plan", f"{FACTORIES}", "--budget", "1GB"], "expected MODULE:FACTORY"),
        (["plan", f"{FACTORIES}:not_a_pair", "--budget", "1GB"], "must return (model, example_inputs)"),
        (["plan", f"{FACTORIES}:raises", "--budget", "1GB"], "raised RuntimeError: the dataset is missing"),
        (["estimate", f"{FACTORIES}:tiny_gpt", "--device-memory", "24 gigs"], "is not a size"),
        (["explain", "no/such/plan.json"], "no such plan file"),
    ],
)
def test_clear_errors(argv, message, capsys):
    assert main(["-q", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("command", ["plan", "estimate"])
def test_model_without_a_backward_is_a_clear_error(command, tmp_path, capsys):
    budget = ["--budget", "1GB", "--out", str(tmp_path / "plan")] if command == "plan" else []
    assert main(["-q", command, f"{FACTORIES}:frozen_linear", "--compiler", "eager", *budget]) == 2
    err = capsys.readouterr().err
    assert "no backward to plan" in err and "requires_grad=True" in err and err.count("\n") == 1, err
    assert not (tmp_path / "plan").exists()


@pytest.mark.parametrize("command", ["plan", "estimate"])
def test_graph_break_is_a_clear_error(command, tmp_path, capsys):
    budget = ["--budget", "1GB", "--out", str(tmp_path / "plan")] if command == "plan" else []
    assert main(["-q", command, f"{FACTORIES}:graph_break", "--compiler", "eager", *budget]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "USDT" not in line]
    assert len(err) == 1, err
    assert err[0].startswith(f"fxmem {command}: error: fxmem plans one graph per step and this model does not")
    assert "`print`" in err[0] and "_factories.py" in err[0]


def test_closed_stdout_ends_quietly(tmp_path):
    """`fxmem explain plan | head`: the reader closes the pipe first; no traceback, and not
    exit status 1, which says the budget is too small."""
    from fxmem.plan import Plan

    Plan(2**30, 2**20, 2**20, 2**20, {"parameters": 2**20}, []).save(tmp_path, files=False)
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fxmem.cli", "explain", str(tmp_path)], stdout=subprocess.PIPE, stderr=stderr
        )
        proc.stdout.close()  # before the command writes: it starts by importing torch
        assert proc.wait(timeout=120) == 141
    err = [line for line in (tmp_path / "stderr").read_text().splitlines() if "USDT" not in line]
    assert err == []


def test_estimate_of_an_hf_model_with_its_cache_names_use_cache(capsys):
    """HF's key/value caches cannot be traced on meta tensors: the error says what to pass,
    and with it the estimate runs."""
    pytest.importorskip("transformers")
    assert main(["-q", "estimate", f"{FACTORIES}:hf_gpt2_cached", "--compiler", "eager"]) == 2
    err = capsys.readouterr().err
    assert "use_cache=False" in err and err.count("\n") == 1, err
    assert main(["-q", "estimate", f"{FACTORIES}:hf_gpt2_uncached", "--compiler", "eager"]) == 0


def test_plan_then_explain(tmp_path, capsys, monkeypatch):
    """`fxmem plan` plans with inductor's memory model and writes the files without compiling
    (compiling is for --measure's step)."""
    from torch._inductor import compile_fx

    compiled = []
    monkeypatch.setattr(compile_fx, "compile_fx_inner", lambda *a, **k: compiled.append(1))
    out = tmp_path / "plan"
    assert main(["-q", "plan", f"{FACTORIES}:tiny_gpt_kwargs", "--budget", "64MB", "--out", str(out)]) == 0
    assert not compiled
    assert {"plan.json", "timeline.png", "graph.dot", "memory_snapshot.pickle"} <= set(os.listdir(out))
    printed = capsys.readouterr().out
    assert "predicted peak" in printed and "wrote" in printed
    data = json.loads((out / "plan.json").read_text())
    assert data["budget_bytes"] == 64 * 2**20 and data["compiler"] == "inductor"
    assert main(["explain", str(out / "plan.json"), "--top", "5"]) == 0
    table = capsys.readouterr().out
    assert "top 5 of" in table and "decision" in table and "rules" in table
    assert "alive at the predicted peak" in table
    biggest = max(data["decisions"], key=lambda d: d["nbytes"])
    assert biggest["op"][:30] in table


def test_plan_over_budget_exits_1_and_keeps_the_smallest_plan(tmp_path, capsys):
    out = tmp_path / "plan"
    assert (
        main(["-q", "plan", f"{FACTORIES}:tiny_gpt", "--budget", "100KB", "--out", str(out), "--compiler", "eager"])
        == 1
    )
    assert "below the smallest budget" in capsys.readouterr().err
    assert (out / "plan.json").exists()
    assert main(["explain", str(out), "--top", "0"]) == 0
    budget_line = capsys.readouterr().out.splitlines()[1]
    assert budget_line.startswith("  budget           100.0 KiB, below the floor (")
    assert budget_line.endswith("): refused; this plan, the smallest found, does not fit it")


def test_estimate_matches_planning_on_real_tensors(capsys, monkeypatch):
    """The meta-tensor estimate sees the same step as planning the real model does, but for
    the kernels' workspaces, which planning measures on the device and meta tensors have not."""
    from _factories import convnet

    import fxmem
    from fxmem import probe

    monkeypatch.setattr(probe, "_PROBED_UNFUSED", ())  # the convolutions' and batch norm's
    est = estimate(convnet, "none", compiler="eager", passes=[])
    model, example = convnet()
    real = fxmem.optimize(model, 1.0, compiler="eager", example_inputs=example, passes=[]).plan
    assert est.plan.fingerprint == real.fingerprint
    assert category_curves(est.plan.timeline) == category_curves(real.timeline)
    assert est.parameter_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert est.peak_bytes == est.parameter_bytes + est.input_bytes + max(
        sum(c) for c in zip(*category_curves(est.plan.timeline).values(), strict=False)
    )


@pytest.mark.parametrize("optimizer, slots", [("adamw", 2), ("sgd-momentum", 1), ("sgd", 0)])
def test_estimate_counts_optimizer_state(optimizer, slots):
    from _factories import tiny_gpt

    est = estimate(tiny_gpt, optimizer, compiler="eager", passes=[])
    assert est.optimizer_state_bytes == slots * est.gradient_bytes
    assert est.gradient_bytes == est.parameter_bytes  # every parameter trains, fp32


def test_estimate_8bit_adam_is_about_a_quarter_of_adamw():
    from _factories import tiny_gpt

    full = estimate(tiny_gpt, "adamw", compiler="eager", passes=[]).optimizer_state_bytes
    small = estimate(tiny_gpt, "adam8bit", compiler="eager", passes=[]).optimizer_state_bytes
    assert full / 4 < small < full / 2  # small tensors keep 32-bit states


def test_estimate_cli_verdict_and_exit_status(capsys):
    assert main(["-q", "estimate", f"{FACTORIES}:tiny_gpt", "--device-memory", "1GB", "--compiler", "eager"]) == 0
    table = capsys.readouterr().out
    for row in ("parameters", "gradients", "optimizer state (adamw)", "activations", "floor"):
        assert row in table
    assert "fits in 1.00 GiB" in table
    assert main(["-q", "estimate", f"{FACTORIES}:tiny_gpt", "--device-memory", "64KB", "--compiler", "eager"]) == 1
    assert "does NOT fit" in capsys.readouterr().out


def test_estimate_table_counts_parameters_and_names_the_head_room():
    from fxmem.estimate import Estimate

    mib = 2**20
    est = Estimate("GPT", 173_568, 694_272, 0, 694_272, "adamw", 0, 0, 0, 5 * mib, 6 * mib, plan=None)
    rows = {line[2:32].strip(): line[32:] for line in est.table().splitlines()[1:]}
    assert rows["parameters"] == "   678.0 KiB  173,568 parameters"
    assert rows["peak, nothing recomputed"] == "     5.0 MiB  no head-room"
    assert rows["floor with fxmem recomputation"] == (
        "     6.0 MiB  the smallest budget: the lowest peak plus head-room (2.0 MiB + 3% of the budget)"
    )
    big = Estimate("Llama", 1_235_814_400, 0, 0, 0, "adamw", 0, 0, 0, 0, 0, plan=None)
    assert "1,235,814,400 parameters (1.24 billion)" in big.table()


def test_console_script_runs_as_a_module(tmp_path):
    # `python -m fxmem.cli` is what the `fxmem` console script calls (pyproject [project.scripts]).
    proc = subprocess.run(
        [sys.executable, "-m", "fxmem.cli", "explain", str(tmp_path / "none.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "no such plan file" in proc.stderr

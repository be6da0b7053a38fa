"""`monet solve` and `monet apply` end to end on a small user model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from monet_cli.cli.app import app
from monet_cli.core.schedule import load_schedule

runner = CliRunner()
MODEL = ["tests.models_for_tests:skip_cnn", "-i", "3,64,64", "-b", "16", "--steps", "1"]


def monet(*args: str):
    return runner.invoke(app, list(args))


def last_error(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr + result.stdout
    return lines[-1]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    result = monet("profile", *MODEL, "-o", str(root / "configs" / "skip.profile.yaml"), "--json")
    assert result.exit_code == 0, result.stderr
    return root


def solve(workdir: Path, budget: str, name: str, *extra: str):
    return monet(
        "solve",
        str(workdir / "configs" / "skip.profile.yaml"),
        "--budget",
        budget,
        "-o",
        str(workdir / "schedules" / name),
        "--workers",
        "1",
        "--time-limit",
        "20",
        "--json",
        *extra,
    )


def test_solve_writes_a_complete_schedule(workdir: Path):
    result = solve(workdir, "90%", "s90.yaml")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["predicted_peak_bytes"] <= summary["budget_bytes"]
    assert summary["status"] in ("OPTIMAL", "FEASIBLE")
    assert "budget: 90% = " in result.stderr and "bytes)" in result.stderr
    data = yaml.safe_load((workdir / "schedules" / "s90.yaml").read_text())
    for key in (
        "schema_version",
        "kind",
        "budget_bytes",
        "budget_spec",
        "model",
        "fingerprint",
        "profile_sha256",
        "predicted",
        "solver",
        "env",
    ):
        assert key in data, key
    assert data["kind"] == "monet.schedule" and data["schema_version"] == 2 and data["budget_spec"] == "90%"
    assert set(data["predicted"]) >= {"peak_bytes", "step_ms", "overhead"}
    assert set(data["solver"]) >= {"status", "objective", "bound", "gap", "time_s", "workers", "seed", "ortools"}


def test_apply_holds_budget_and_gradients(workdir: Path):
    assert solve(workdir, "92%", "s92.yaml").exit_code == 0
    path = workdir / "schedules" / "s92.yaml"
    result = monet("apply", str(path), "--steps", "1", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert list(report) == [
        "budget_bytes",
        "predicted_peak_bytes",
        "measured_peak_bytes",
        "baseline_peak_bytes",
        "step_ms",
        "baseline_step_ms",
        "overhead",
        "overhead_range",
        "predicted_overhead",
        "predicted_overhead_here",
        "profiled_baseline_step_ms",
        "grads_match",
        "within_budget",
        "check",
    ]
    assert report["grads_match"] is None and report["check"] is None and report["within_budget"] is True
    assert report["predicted_overhead"] == load_schedule(path).predicted.overhead
    assert report["profiled_baseline_step_ms"] == load_schedule(path).predicted.baseline_step_ms
    assert report["overhead_range"] == [report["overhead"], report["overhead"]]  # one pair
    # Its profile is not in this directory's configs/: nothing to price it again from.
    assert report["predicted_overhead_here"] is None
    assert "not in configs/ (or --profile): no prediction at this run's speed" in " ".join(result.stderr.split())
    assert report["measured_peak_bytes"] <= report["budget_bytes"]
    assert abs(report["predicted_peak_bytes"] - report["measured_peak_bytes"]) <= 0.02 * report["measured_peak_bytes"]
    other = monet("apply", str(path), "--profile", "configs/gpt.profile.yaml")  # refused before any step runs
    assert other.exit_code == 2 and "--profile: that profile was made for another model" in last_error(other)
    profile = str(workdir / "configs" / "skip.profile.yaml")
    checked = json.loads(monet("apply", str(path), "--steps", "1", "--check", "--profile", profile, "--json").stdout)
    assert checked["predicted_overhead_here"] > 0  # priced again from the step timed after the pair
    assert checked["grads_match"] is True
    assert checked["baseline_peak_bytes"] == report["baseline_peak_bytes"]  # both after a first step
    assert checked["check"]["mode"] == "exact" and checked["check"]["max_grad_diff"] == 0.0


def test_infeasible_budget_exits_3_with_the_minimum(workdir: Path):
    result = solve(workdir, "1MiB", "tiny.yaml")
    assert result.exit_code == 3
    line = last_error(result)
    assert "below the smallest peak monet can reach" in line and "bytes)" in line
    assert not (workdir / "schedules" / "tiny.yaml").exists()


@pytest.mark.parametrize("budget", ["0", "-1G", "abc", "0%", "8XB"])
def test_bad_budget_exits_2(workdir: Path, budget: str):
    result = solve(workdir, budget, "bad.yaml")
    assert result.exit_code == 2, result.stderr
    assert budget in last_error(result)


USER_MODEL = """
import torch
from torch import nn


def net():
    layers = [nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()]
    layers += EXTRA
    return nn.Sequential(nn.Sequential(*layers), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
"""


def test_changed_model_exits_5(tmp_path: Path):
    """The user's model code changed after solving: apply must refuse, not run silently."""
    import os
    import subprocess
    import sys

    source = tmp_path / "usermodel.py"
    source.write_text(USER_MODEL.replace("EXTRA", "[]"))
    monet_bin = [sys.executable, "-m", "monet_cli"]
    env = dict(os.environ, PYTHONPATH=str(Path.cwd()))
    common = dict(cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    run = subprocess.run(
        [*monet_bin, "profile", "usermodel:net", "-i", "3,32,32", "-b", "8", "--steps", "1", "-o", "p.yaml"], **common
    )
    assert run.returncode == 0, run.stderr
    run = subprocess.run(
        [*monet_bin, "solve", "p.yaml", "--budget", "100%", "-o", "s.yaml", "--workers", "1"], **common
    )
    assert run.returncode == 0, run.stderr
    source.write_text(USER_MODEL.replace("EXTRA", "[nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()]"))
    run = subprocess.run([*monet_bin, "apply", "s.yaml", "--steps", "1"], **common)
    assert run.returncode == 5, run.stderr
    assert "schedule does not match this model" in run.stderr and "Traceback" not in run.stderr


def test_hand_edited_schedule_exits_6(workdir: Path):
    assert solve(workdir, "90%", "edit.yaml").exit_code == 0
    path = workdir / "schedules" / "edit.yaml"
    data = yaml.safe_load(path.read_text())
    data["fingerprint"]["shapes"] = "0000000000000000"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = monet("apply", str(path), "--steps", "1")
    assert result.exit_code == 6
    assert "content_sha256" in last_error(result)


def test_wrong_kind_of_file_exits_6(workdir: Path):
    assert solve(workdir, "90%", "kind.yaml").exit_code == 0
    result = monet("solve", str(workdir / "schedules" / "kind.yaml"), "--budget", "90%")
    assert result.exit_code == 6
    assert "this is a monet.schedule file, expected monet.profile" in last_error(result)
    result = monet("apply", str(workdir / "configs" / "skip.profile.yaml"))
    assert result.exit_code == 6


def test_defaults_pick_newest_files(workdir: Path, monkeypatch):
    monkeypatch.chdir(workdir)
    result = monet("solve", "--budget", "95%", "--workers", "1", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["schedule"] == "schedules/skip-95pct.yaml"
    result = monet("apply", "--steps", "1", "--json")
    assert result.exit_code == 0, result.stderr


def test_one_worker_is_deterministic(workdir: Path):
    assert solve(workdir, "93%", "d1.yaml").exit_code == 0
    assert solve(workdir, "93%", "d2.yaml").exit_code == 0
    a = load_schedule(workdir / "schedules" / "d1.yaml")
    b = load_schedule(workdir / "schedules" / "d2.yaml")
    assert a.segments == b.segments and a.predicted == b.predicted


def test_the_gap_at_which_the_solve_stops_is_checked_and_recorded(workdir: Path):
    result = solve(workdir, "90%", "g.yaml", "--gap", "1")
    assert result.exit_code == 2 and "--gap" in last_error(result)
    result = solve(workdir, "90%", "g.yaml", "--gap", "0.2")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["gap_limit"] == 0.2 and summary["gap"] <= 0.2
    assert summary["status"] == ("OPTIMAL" if summary["gap"] == 0 else "FEASIBLE")
    assert load_schedule(workdir / "schedules" / "g.yaml").solver.gap_limit == 0.2

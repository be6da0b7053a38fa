"""inspect, estimate, validate, env, sweeps, exit codes, interrupts and determinism."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from monet_cli.cli.app import app
from monet_cli.core.profile import save_profile
from monet_cli.errors import EXIT_CODE_TABLE

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent


def monet(*args: str):
    return runner.invoke(app, list(args))


@pytest.fixture(scope="module")
def solved(tmp_path_factory, skip_cnn_profile):
    """A profile in configs/ and a schedule solved from it, in a scratch working directory."""
    root = tmp_path_factory.mktemp("tools")
    (root / "configs").mkdir()
    save_profile(skip_cnn_profile, root / "configs" / "skip.profile.yaml")
    old = Path.cwd()
    os.chdir(root)
    try:
        result = monet("solve", "--budget", "100%", "--workers", "1", "--json")
        assert result.exit_code == 0, result.stderr
    finally:
        os.chdir(old)
    return root, root / json.loads(result.stdout)["schedule"]


def test_env_json():
    result = monet("env", "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert {"monet", "torch", "torchvision", "ortools", "python", "device", "device_memory_bytes"} <= set(data)


def test_cuda_is_refused_where_the_allocator_caches_nothing(monkeypatch):
    """Under PYTORCH_NO_CUDA_MEMORY_CACHING PyTorch's memory statistics stay at 0: every plan
    would "fit". A profile on CUDA stops at once with exit 2 and one line; 0 turns it off."""
    import torch

    from monet_cli.errors import UsageError
    from monet_cli.workload.step import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    result = monet("profile", "resnet18", "-i", "3,32,32", "-b", "2", "--device", "cuda")
    assert result.exit_code == 2, result.output
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING is set" in result.stderr and "Traceback" not in result.output
    assert resolve_device("cpu").type == "cpu"  # nothing to measure on the GPU: no refusal
    with pytest.raises(UsageError, match="PYTORCH_NO_CUDA_MEMORY_CACHING"):
        resolve_device("auto")  # picks the GPU, so refused the same way
    monkeypatch.setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", "0")
    assert resolve_device("cuda").type == "cuda"


def test_validate_ok_mismatch_and_corrupt(solved, tmp_path):
    root, schedule = solved
    assert monet("validate", str(schedule)).exit_code == 0
    result = monet("validate", str(schedule), "--model", "resnet18", "--json")
    assert result.exit_code == 5
    assert json.loads(result.stdout)["ok"] is False
    broken = tmp_path / "broken.yaml"
    broken.write_text(schedule.read_text()[:200])
    assert monet("validate", str(broken)).exit_code == 6


def _as_if_made_on_cuda(schedule_path: Path, out: Path, **fingerprint_changes) -> Path:
    """The schedule as a GPU would have written it: its fingerprint taken on fake CUDA tensors
    (what a GPU without fused-kernel choices runs), then ``fingerprint_changes``."""
    from dataclasses import replace

    import torch

    from monet_cli.core.schedule import load_schedule, save_schedule, with_content_hash
    from monet_cli.runtime.fingerprint import fake_cuda_fingerprint
    from monet_cli.workload.step import build_workload

    schedule = load_schedule(schedule_path)
    workload = build_workload(schedule.model, torch.device("cpu"))
    args, kwargs = workload.call_args()
    fake = fake_cuda_fingerprint(workload.model, args, kwargs, "32")
    made_here = {"modules": schedule.fingerprint.modules, "hooks": schedule.fingerprint.hooks}
    fingerprint = replace(fake, **{**made_here, **fingerprint_changes})
    save_schedule(with_content_hash(replace(schedule, fingerprint=fingerprint)), out)
    return out


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a CPU-only runner")
def test_validate_checks_a_cuda_schedule_without_a_gpu_and_says_what_it_did_not(solved, tmp_path):
    root, schedule = solved
    cuda = _as_if_made_on_cuda(schedule, tmp_path / "cuda.yaml")
    result = monet("validate", str(cuda))
    assert result.exit_code == 0, result.stderr
    assert "passed ops and shapes: same op sequence and shapes (fake CUDA tensors, no GPU)" in " ".join(
        result.stderr.split()
    )
    assert "not checked memory, time and gradients" in " ".join(result.stderr.split())
    checks = {c["name"]: c["status"] for c in json.loads(monet("validate", str(cuda), "--json").stdout)["checks"]}
    assert checks == {
        "file": "passed",
        "module tree": "passed",
        "forward hooks": "passed",
        "segment modules": "passed",
        "ops and shapes": "passed",
        "memory, time and gradients": "not checked",
    }
    # A GPU that picked other kernels: the op sequence cannot be judged here, and is not failed.
    other_kernels = _as_if_made_on_cuda(schedule, tmp_path / "kernels.yaml", structure="0" * 16, torch="2.99.0")
    data = json.loads(monet("validate", str(other_kernels), "--json").stdout)
    assert data["ok"] and {c["name"]: c["status"] for c in data["checks"]}["ops and shapes"] == "not checked"
    assert any(c["name"] == "torch version" and "must run 2.99.0" in c["detail"] for c in data["checks"])
    # Same ops, other shapes: a real mismatch, found without the GPU.
    shapes = _as_if_made_on_cuda(schedule, tmp_path / "shapes.yaml", shapes="0" * 16)
    assert monet("validate", str(shapes)).exit_code == 5
    other_model = json.loads(monet("validate", str(cuda), "--model", "resnet18", "--json").stdout)
    assert not other_model["ok"] and other_model["problem"].startswith("module tree")
    old = _as_if_made_on_cuda(schedule, tmp_path / "old.yaml", modules="")  # made before the module hash
    assert {c["name"]: c["status"] for c in json.loads(monet("validate", str(old), "--json").stdout)["checks"]}[
        "module tree"
    ] == "not checked"


def test_fake_cuda_tensors_dispatch_as_cuda():
    """The fake forward takes CUDA's paths: cuDNN BatchNorm in fp32 (the CPU runs another op),
    and autocast's CUDA casts under bf16-mixed, with the autocast state restored after."""
    import torch

    from monet_cli.core.profile import InputSpec
    from monet_cli.runtime.fingerprint import ModuleStack, OpSequence, fake_cuda_fingerprint
    from monet_cli.workload.resolve import Overrides, resolve_model_spec
    from monet_cli.workload.step import build_workload

    fakes = {}
    for precision in ("32", "bf16-mixed"):
        spec = resolve_model_spec(
            "tests.models_for_tests:skip_cnn",
            Overrides(batch_size=2, inputs=(InputSpec(shape=(3, 8, 8)),), precision=precision),
        )
        workload = build_workload(spec, torch.device("cpu"))
        args, kwargs = workload.call_args()
        fakes[precision] = fake_cuda_fingerprint(workload.model, args, kwargs, precision)
        assert fakes[precision].device_type == "cuda" and fakes[precision].precision == precision
        assert fake_cuda_fingerprint(workload.model, args, kwargs, precision) == fakes[precision]
    with ModuleStack(workload.model) as stack, OpSequence(stack) as sequence:
        workload.model(*args, **kwargs)  # fp32 on the CPU
    assert fakes["32"].structure != sequence.fingerprint("cpu", "32").structure
    assert fakes["bf16-mixed"].structure != fakes["32"].structure
    assert not torch.is_autocast_enabled("cuda")


def test_estimate_verdicts(solved):
    root, _ = solved
    profile = str(root / "configs" / "skip.profile.yaml")
    data = json.loads(monet("estimate", profile, "--json").stdout)
    base, low = data["baseline_peak_bytes"], data["min_peak_bytes"]
    assert low <= base and data["verdict"] is None
    assert json.loads(monet("estimate", profile, "--fits", str(base), "--json").stdout)["verdict"] == "fits"
    if low < base:
        between = monet("estimate", profile, "--fits", str(low), "--json")
        assert between.exit_code == 0 and json.loads(between.stdout)["verdict"] == "fits-with-schedule"
        assert "only with a schedule" in between.stderr
    too_small = monet("estimate", profile, "--fits", str(low - 1))
    assert too_small.exit_code == 7 and "does not fit" in too_small.stderr


def test_estimate_says_when_it_cannot_tell():
    """Where the search for the smallest peak runs out of time above the capacity but its lower
    bound lies below it, neither verdict holds: exit 4, not 7. (On the H200 resnet50 profile a
    60 s search finds a 958 MiB schedule, so "does not fit in 1 GiB" would have been wrong.)"""
    profile = str(Path(__file__).parent / "data" / "h200-resnet50-bf16.profile.yaml")
    short = monet("estimate", profile, "--fits", "1G", "--time-limit", "1", "--workers", "1", "--json")
    assert short.exit_code == 4 and "cannot tell whether it fits in 1.00 GiB" in short.stderr
    data = json.loads(short.stdout)
    assert data["verdict"] == "undetermined"
    assert data["min_peak_lower_bound_bytes"] <= 2**30 < data["min_peak_bytes"]
    none = monet("estimate", profile, "--workers", "0")
    assert none.exit_code == 2 and "--workers must be at least 1, got 0" in none.stderr


def test_inspect_profile_and_schedule(solved, tmp_path):
    root, schedule = solved
    data = json.loads(monet("inspect", str(root / "configs" / "skip.profile.yaml"), "--json").stdout)
    assert data["kind"] == "monet.profile" and data["top_memory_at_peak"]
    assert sum(r["bytes"] for r in data["top_memory_at_peak"]) <= data["baseline"]["peak_bytes"]
    assert data["not_checkpointable"] == [
        {"module": "<model>", "reason": "the model itself: its inputs are the step's data"}
    ]
    assert data["chains"] == []  # each Sequential's run of calls is all of its forward: the Sequential is that segment
    human = monet("inspect", str(root / "configs" / "skip.profile.yaml"))  # the tables, not JSON
    assert human.exit_code == 0, human.output
    assert "top memory holders at the peak" in human.stdout and "module calls monet will not checkpoint" in human.stdout
    out = tmp_path / "t.html"
    result = monet(
        "inspect",
        str(schedule),
        "--profile",
        str(root / "configs" / "skip.profile.yaml"),
        "--timeline",
        str(out),
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["kind"] == "monet.schedule"
    assert "<svg" in out.read_text() and "budget" in out.read_text()
    assert monet("inspect", str(schedule), "--timeline", str(tmp_path / "t.txt")).exit_code == 2


def test_sweep_writes_one_schedule_per_feasible_budget(solved, monkeypatch):
    root, _ = solved
    monkeypatch.chdir(root)
    result = monet("solve", "--sweep", "100%:90%:5%", "--workers", "1", "--json")
    assert result.exit_code == 0, result.stderr
    points = json.loads(result.stdout)["points"]
    assert [p["budget_spec"] for p in points][:1] == ["100%"]
    for p in points:
        if p.get("schedule"):
            assert Path(p["schedule"]).exists() and p["predicted_peak_bytes"] <= p["budget_bytes"]
    assert monet("solve", "--sweep", "40%:90%:10%").exit_code == 2
    assert monet("solve", "--budget", "90%", "--sweep", "90%:80%:10%").exit_code == 2


def test_non_monotonic_points_are_flagged():
    from monet_cli.cli.solve_cmd import flag_non_monotonic

    rows = [
        {"schedule": "a", "overhead": 0.05},
        {"schedule": "b", "overhead": 0.03},
        {"schedule": "c", "overhead": 0.1},
    ]
    flag_non_monotonic(rows)
    assert [r.get("non_monotonic", False) for r in rows] == [False, True, False]


def test_no_solution_in_time_is_exit_4(solved, monkeypatch, no_lowering):
    from monet_cli.core.solver import search
    from monet_cli.core.solver.cpsat import CpResult

    root, _ = solved
    monkeypatch.setattr(
        search,
        "solve_model",
        lambda *a, **k: CpResult(status="UNKNOWN", plan=None, objective=None, bound=None, wall_s=0.0),
    )
    monkeypatch.setattr(search, "best_heuristic", lambda linear, budget: ("none", {}, False))
    result = monet(
        "solve",
        str(root / "configs" / "skip.profile.yaml"),
        "--budget",
        "99%",
        "--workers",
        "1",
        "-o",
        str(root / "none.yaml"),
    )
    assert result.exit_code == 4, result.stderr
    assert "no schedule within" in result.stderr and not (root / "none.yaml").exists()


def test_a_heuristic_plan_cp_sat_did_not_confirm_is_written_and_shown(solved, monkeypatch):
    """It has an objective (its simulated time) but no bound: the table says so instead of failing."""
    from monet_cli.core.solver import search
    from monet_cli.core.solver.cpsat import CpResult

    root, _ = solved
    monkeypatch.setattr(
        search,
        "solve_model",
        lambda *a, **k: CpResult(status="UNKNOWN", plan=None, objective=None, bound=None, wall_s=0.0),
    )
    result = monet(
        "solve",
        str(root / "configs" / "skip.profile.yaml"),
        "--budget",
        "95%",
        "--workers",
        "1",
        "-o",
        str(root / "heuristic.yaml"),
    )
    assert result.exit_code == 0, result.stderr
    assert "heuristic" in result.stdout and " / - ms recompute" in result.stdout
    assert yaml.safe_load((root / "heuristic.yaml").read_text())["solver"]["bound"] is None


def test_exit_code_table_is_documented():
    help_text = monet("--help").stdout
    readme = (ROOT / "README.md").read_text()
    for code, _ in EXIT_CODE_TABLE:
        assert f"{code} " in help_text
        assert f"| {code} |" in readme


def test_same_inputs_give_the_same_schedule_file(solved, tmp_path):
    root, _ = solved
    profile = str(root / "configs" / "skip.profile.yaml")
    texts = []
    for name in ("a.yaml", "b.yaml"):
        assert (
            monet(
                "solve", profile, "--budget", "97%", "--workers", "1", "--seed", "3", "-o", str(tmp_path / name)
            ).exit_code
            == 0
        )
        data = yaml.safe_load((tmp_path / name).read_text())
        texts.append((tmp_path / name).read_text())
        data.pop("created_at")
        data["solver"].pop("time_s")
    a, b = (yaml.safe_load(t) for t in texts)
    assert a["content_sha256"] == b["content_sha256"]
    strip = lambda t: [line for line in t.splitlines() if not line.startswith("created_at:") and "time_s:" not in line]  # noqa: E731
    assert strip(texts[0]) == strip(texts[1])


def _ctrl_c_delivered() -> None:
    """In the child: SIGINT back to its default, so Python turns it into KeyboardInterrupt. A
    suite started in the background by a shell without job control inherits SIGINT ignored,
    and Python then leaves it ignored: the interrupt would be lost before monet saw it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_leaves_old_file_and_exits_130(tmp_path):
    out = tmp_path / "p.yaml"
    out.write_text("old contents\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "monet_cli",
            "profile",
            "resnet50",
            "-i",
            "3,128,128",
            "-b",
            "8",
            "--steps",
            "60",
            "--device",
            "cpu",
            "-o",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ctrl_c_delivered,
    )
    time.sleep(10)  # past start-up, well inside the ~40 s of timed steps
    assert proc.poll() is None, "profiling ended before the interrupt"
    proc.send_signal(signal.SIGINT)
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()  # a lost interrupt must not leave 60 steps of resnet50 running beside the suite
    assert proc.returncode == 130, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == "monet: interrupted"
    assert out.read_text() == "old contents\n"
    assert [p.name for p in tmp_path.iterdir()] == ["p.yaml"]


def test_ctrl_c_during_a_solve_sweep_leaves_only_complete_files(tmp_path):
    """Interrupting a long sweep: exit 130, no temp files, every schedule written so far loads."""
    import shutil

    from monet_cli.core.schedule import load_schedule

    (tmp_path / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "resnet50.profile.yaml", tmp_path / "configs" / "resnet50.profile.yaml")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "monet_cli", "solve", "--sweep", "99%:55%:1%", "--workers", "1"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ctrl_c_delivered,
    )
    time.sleep(8)
    assert proc.poll() is None, "the sweep ended before the interrupt"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    written = sorted((tmp_path / "schedules").glob("*")) if (tmp_path / "schedules").exists() else []
    assert all(p.suffix == ".yaml" and not p.name.startswith(".") for p in written), written
    for path in written:
        load_schedule(path)


def test_ctrl_c_inside_a_storage_finalizer_is_not_lost():
    """Python ignores exceptions raised in finalizers; the meter delivers the Ctrl-C at the next op."""
    import pytest
    import torch

    from monet_cli.runtime.meter import LiveStorageMeter

    class Interrupted(LiveStorageMeter):
        def on_free(self, key: int) -> None:
            raise KeyboardInterrupt  # as if Ctrl-C arrived while the finalizer ran

    meter = Interrupted()
    with pytest.raises(KeyboardInterrupt), meter:
        x = torch.ones(4) + 1
        del x  # the finalizer runs here and swallows nothing
        torch.ones(4) * 2  # the next op raises


def test_the_command_line_shows_monet_s_warnings_as_one_line(capsys):
    """monet's own warnings reach a terminal as ``monet: warning: ...``, one line without the
    Python source line that raised them (as its errors show no traceback); another library's
    warning shows as Python shows it, where it came from included."""
    from monet_cli.cli.errors import show_warning

    show_warning(UserWarning("monet: the machine was busy"), UserWarning, "/x/run.py", 148)
    show_warning(UserWarning("TypedStorage is deprecated"), UserWarning, "/x/torch.py", 7, line="storage()")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "monet: warning: the machine was busy"
    assert lines[1] == "/x/torch.py:7: UserWarning: TypedStorage is deprecated"

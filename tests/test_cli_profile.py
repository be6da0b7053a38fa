"""`monet profile` from the command line: outputs, JSON, and every user error's line and code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from monet_cli.cli.app import app
from monet_cli.core.profile import load_profile

runner = CliRunner()


def monet(*args: str):
    return runner.invoke(app, list(args))


def one_line_error(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("monet: error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    return lines[-1]


def test_version_and_help():
    result = monet("--version")
    assert result.exit_code == 0 and result.stdout.startswith("monet ")
    help_text = monet("profile", "--help").stdout
    assert "3,128,128" in help_text and "Exit codes" in help_text
    assert "8GiB" in monet("--help").stdout


def test_profile_import_path_writes_profile_and_json(tmp_path: Path):
    out = tmp_path / "skip.profile.yaml"
    result = monet(
        "profile",
        "tests.models_for_tests:skip_cnn",
        "--input-shape",
        "3,16,16",
        "-b",
        "2",
        "--steps",
        "1",
        "--device",
        "cpu",
        "-o",
        str(out),
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["profile"] == str(out) and summary["batch_size"] == 2
    profile = load_profile(out)
    assert summary["baseline_peak_bytes"] == profile.baseline.peak_bytes > 0
    # On CPU the simulator's unscheduled peak is the measured one, to the byte.
    assert summary["simulated_baseline_peak_bytes"] == profile.baseline.peak_bytes
    assert summary["op_ms_sum"] == round(profile.op_ms_sum, 3) > 0
    assert profile.model.target == "tests.models_for_tests:skip_cnn"
    assert "profile" in result.stderr  # the progress bar goes to stderr


def test_profile_token_inputs_and_model_args(tmp_path: Path):
    out = tmp_path / "gpt.yaml"
    result = monet(
        "profile",
        "monet_cli.examples.models:tiny_gpt",
        "--input-shape",
        "16",
        "--input-dtype",
        "int64",
        "--input-range",
        "0:64",
        "--model-arg",
        "vocab_size=64",
        "--model-arg",
        "n_layers=1",
        "--loss",
        "token_cross_entropy",
        "--optimizer",
        "adamw",
        "-b",
        "2",
        "--steps",
        "1",
        "-o",
        str(out),
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    profile = load_profile(out)
    assert profile.model.inputs[0].dtype == "int64" and profile.model.inputs[0].high == 64
    assert profile.model.kwargs == {"vocab_size": 64, "n_layers": 1}
    # AdamW keeps two moments per parameter plus a 4-byte step counter per tensor.
    n_tensors = sum(1 for s in profile.storages if s.kind == "param")
    assert profile.memory.optimizer_state_bytes == 2 * profile.memory.param_bytes + 4 * n_tensors


def test_run_config_with_overrides(tmp_path: Path):
    config = tmp_path / "tiny.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "kind": "monet.run",
                "model": "tests.models_for_tests:skip_cnn",
                "batch_size": 4,
                "inputs": [{"shape": [3, 8, 8]}],
                "optimizer": "none",
            }
        )
    )
    out = tmp_path / "o.yaml"
    result = monet("profile", str(config), "-b", "2", "--steps", "1", "-o", str(out), "--json")
    assert result.exit_code == 0, result.stderr
    profile = load_profile(out)
    assert profile.model.batch_size == 2 and profile.model.optimizer.name == "none"
    assert profile.model.name == "tiny" and profile.memory.optimizer_state_bytes == 0


def test_shipped_run_configs_parse():
    from monet_cli.core.runconfig import load_run_config

    names = {p.stem for p in Path("configs").glob("*.yaml") if not p.name.endswith(".profile.yaml")}
    assert {"resnet50", "vgg16", "mobilenet_v2", "vit_b_16", "gpt"} <= names
    for name in names:
        load_run_config(Path("configs") / f"{name}.yaml")


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["resnet5O"], 2, "did you mean resnet50"),
        (["no_such_pkg.models:net", "-i", "3,8,8"], 2, "cannot import 'no_such_pkg.models'"),
        (["tests.models_for_tests:missing", "-i", "3,8,8"], 2, "has no attribute 'missing'"),
        (["tests.models_for_tests:not_a_module", "-i", "3,8,8"], 2, "returned str, expected a torch.nn.Module"),
        (["tests.models_for_tests:skip_cnn"], 2, "--input-shape"),
        (["tests.models_for_tests:skip_cnn", "-i", "3,x,8"], 2, "input shape '3,x,8'"),
        (["tests.models_for_tests:skip_cnn", "-i", "3,0,8"], 2, "positive"),
        (["tests.models_for_tests:skip_cnn", "-i", "3,8,8", "--optimizer", "lion"], 2, "--optimizer 'lion'"),
        (["tests.models_for_tests:skip_cnn", "-i", "3,8,8", "--steps", "0"], 2, "--steps"),
        (["tests.models_for_tests:broken_model", "-i", "3,8,8"], 8, "ValueError: expected 4 channels, got 3"),
        (  # a model that checkpoints itself: its profile could not measure it (a schedule measured 3.5% over)
            ["tests.models_for_tests:self_saving_net", "-i", "16", "--model-arg", "how=reentrant"],
            5,
            "but the model calls a reentrant torch.utils.checkpoint, which its profile cannot measure",
        ),
        (
            ["tests.models_for_tests:self_saving_net", "-i", "16", "--model-arg", "how=non-reentrant"],
            5,
            "but the model saves tensors through hooks of its own in '0.a' (a non-reentrant torch.utils.checkpoint",
        ),
        (["tests.models_for_tests:self_saving_net", "-i", "16", "--model-arg", "how=save_on_cpu"], 5, "'0.a'"),
        (["tests.models_for_tests:routed_net", "-i", "16"], 5, "the model runs ops on other shapes on another batch"),
        (["tests.models_for_tests:skip_cnn", "-i", "3,8,8", "--device", "tpu"], 2, "--device 'tpu'"),
    ],
)
def test_user_errors_are_one_line_with_exit_code(args, code, needle, tmp_path: Path):
    result = monet(
        "profile", *args, "--steps" if "--steps" not in args else "--seed", "1", "-o", str(tmp_path / "x.yaml")
    )
    assert result.exit_code == code, (result.stdout, result.stderr)
    assert needle in one_line_error(result)
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_gpu():
    result = monet("profile", "tests.models_for_tests:skip_cnn", "-i", "3,8,8", "--device", "cuda")
    assert result.exit_code == 9
    assert "no CUDA GPU" in one_line_error(result)


def test_unwritable_output(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = monet("profile", "tests.models_for_tests:skip_cnn", "-i", "3,8,8", "-o", str(blocker / "p.yaml"))
    assert result.exit_code == 10
    assert "cannot write" in one_line_error(result)


def test_corrupt_profile_is_exit_6_with_file_and_key(tmp_path: Path):
    import typer

    from monet_cli.cli.errors import user_errors

    bad = tmp_path / "bad.yaml"
    bad.write_text("schema_version: 99\nkind: monet.profile\n")
    with pytest.raises(typer.Exit) as info:
        with user_errors():
            load_profile(bad)
    assert info.value.exit_code == 6
    bad.write_text("kind: monet.profile\nschema_version: [1\n")
    with pytest.raises(Exception, match="not valid YAML"):
        load_profile(bad)

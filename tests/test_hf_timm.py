"""hf:NAME and timm:NAME: models from a config alone, their inputs, losses and user errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from monet_cli.cli.app import app
from monet_cli.core.profile import InputSpec
from monet_cli.errors import UsageError
from monet_cli.workload.resolve import Overrides, resolve_model_spec
from monet_cli.workload.step import LossFunction, build_workload

ROOT = Path(__file__).resolve().parent.parent
HF_CONFIGS = sorted((ROOT / "configs" / "hf").glob("*.json"))
TINY_LLAMA = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 100,
    "max_position_embeddings": 32,
}


def _spec(model: str, shape: tuple[int, ...] | None = None, **kwargs):
    inputs = None if shape is None else (InputSpec(shape=shape),)
    return resolve_model_spec(model, Overrides(batch_size=2, inputs=inputs, model_kwargs=kwargs or None))


def test_model_type_gets_its_language_model_head_and_training_inputs():
    spec = _spec("hf:llama", (16,), **TINY_LLAMA)
    assert (spec.source, spec.target, spec.name) == ("hf", "LlamaForCausalLM", "llama")
    assert spec.kwargs["model_type"] == "llama" and spec.kwargs["hidden_size"] == 32
    assert [(i.name, i.shape, i.dtype, i.low, i.high) for i in spec.inputs] == [
        ("input_ids", (16,), "int64", 0, 100),
        ("attention_mask", (16,), "int64", 1, 2),
        ("labels", (16,), "int64", 0, 100),
    ]
    assert _spec("hf:t5", (8,), vocab_size=64).target == "T5ForConditionalGeneration"
    assert _spec("hf:bert", (8,), vocab_size=64).target == "BertForMaskedLM"


def test_a_class_name_picks_the_head_and_its_labels():
    spec = _spec("hf:BertForSequenceClassification", (8,), vocab_size=64, num_labels=3)
    labels = spec.inputs[-1]
    assert (labels.name, labels.shape, labels.high) == ("labels", (), 3)


def test_config_json_is_read_into_the_spec(tmp_path: Path):
    path = tmp_path / "my-llama.json"
    path.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "transformers_version": "4.40",
                "torch_dtype": "float32",
                **TINY_LLAMA,
            }
        )
    )
    spec = _spec(f"hf:{path}", num_hidden_layers=2)
    assert spec.name == "my-llama" and spec.target == "LlamaForCausalLM"
    assert spec.kwargs["num_hidden_layers"] == 2 and "transformers_version" not in spec.kwargs  # --model-arg wins
    assert spec.inputs[0].shape == (32,)  # no --input-shape: 128 tokens, capped by the model's positions


@pytest.mark.parametrize("path", HF_CONFIGS, ids=lambda p: p.stem)
def test_shipped_hf_configs_train_one_step(path: Path):
    """Each README example builds and runs a step with the model's own loss."""
    spec = resolve_model_spec(f"hf:{path}", Overrides(batch_size=2, inputs=None))
    workload = build_workload(spec, torch.device("cpu"))
    assert workload.step() > 0


def test_model_output_loss_and_logits():
    from transformers.modeling_outputs import CausalLMOutput

    logits = torch.randn(2, 5, 7)
    output = CausalLMOutput(loss=torch.tensor(1.5), logits=logits)
    assert float(LossFunction("auto", 0)(output)) == 1.5
    token_loss = LossFunction("token_cross_entropy", 0)(output)
    assert torch.isclose(token_loss, LossFunction("token_cross_entropy", 0)(logits))
    assert LossFunction("auto", 0)(CausalLMOutput(logits=logits)).shape == ()  # no labels: mean square of logits


@pytest.mark.parametrize(
    ("model", "kwargs", "message"),
    [
        ("hf:lama", {}, "did you mean llama"),
        ("hf:NotAModelClass", {}, "no model class"),
        ("hf:", {}, "name a model"),
        ("hf:llama", {"hiden_size": 64}, "LlamaConfig has no field 'hiden_size' \\(did you mean hidden_size\\?\\)"),
        ("hf:llama", {"hidden_size": 30, "num_attention_heads": 4}, "bad config: .*hidden size \\(30\\)"),
        ("timm:convnext_atoo", {}, "did you mean convnext_atto"),
    ],
)
def test_user_errors_are_one_line(model: str, kwargs: dict, message: str):
    with pytest.raises(UsageError, match=message):
        _spec(model, (8,) if model.startswith("hf") else None, **kwargs)


def test_hf_inputs_are_built_not_given():
    with pytest.raises(UsageError, match="sequence length"):
        resolve_model_spec(
            "hf:llama",
            Overrides(inputs=(InputSpec(shape=(16,), dtype="int64", low=0, high=9),), model_kwargs=TINY_LLAMA),
        )
    with pytest.raises(UsageError, match="above the model's 32 positions"):
        _spec("hf:llama", (64,), **TINY_LLAMA)
    with pytest.raises(UsageError, match="no image size: give --input-shape"):
        _spec("hf:ResNetForImageClassification", depths=[1, 1, 1, 1])
    assert _spec("hf:ResNetForImageClassification", (3, 32, 32), depths=[1, 1, 1, 1]).inputs[0].name == "pixel_values"


def test_timm_vit_follows_the_input_size():
    spec = _spec("timm:vit_small_patch16_224", (3, 64, 64), depth=1)
    assert spec.kwargs == {"depth": 1, "img_size": 64}
    assert _spec("timm:convnext_atto", (3, 64, 64)).kwargs == {}


def test_cli_hf_loop_with_precision(tmp_path: Path, monkeypatch):
    """profile -> solve -> apply --check on hf: from the command line, in bf16-mixed."""
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    args = [f"--model-arg={k}={v}" for k, v in TINY_LLAMA.items()]
    result = runner.invoke(
        app,
        [
            "profile",
            "hf:llama",
            *args,
            "-i",
            "16",
            "-b",
            "2",
            "--steps",
            "1",
            "--precision",
            "bf16-mixed",
            "--device",
            "cpu",
            "-o",
            "p.yaml",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["model"] == "llama"
    result = runner.invoke(app, ["solve", "p.yaml", "--budget", "95%", "-o", "s.yaml", "--workers", "1"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["apply", "s.yaml", "--check", "--steps", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["within_budget"] and report["grads_match"]
    bad = runner.invoke(app, ["profile", "hf:llama", "--precision", "fp8", "-o", "q.yaml"])
    assert bad.exit_code == 2 and "--precision 'fp8'" in bad.output


def test_transformers_output_capturing_hooks_are_not_taken_for_a_user_s():
    """transformers installs hooks in the first forward that asks for hidden states; they keep
    nothing in a training forward that does not ask, nor in a recompute, so a model that ran
    such a forward before training is not refused as one with hooks its profile did not see."""
    from monet_cli.profiler.run import profile_model
    from monet_cli.runtime.executor import apply_schedule
    from monet_cli.runtime.fingerprint import model_hooks
    from tests.schedules_for_tests import plan_schedule

    spec = _spec("hf:llama", (16,), **TINY_LLAMA)
    profile = profile_model(spec, torch.device("cpu"), steps=1)
    layer = next(c.index for c in profile.calls if c.fqn == "model.layers.0")
    workload = build_workload(spec, torch.device("cpu"))
    args, kwargs = workload.call_args()
    with torch.no_grad():
        workload.model(*args, **kwargs, output_hidden_states=True)
    assert any(m._forward_hooks for m in workload.model.modules())
    assert model_hooks(workload.model) == profile.fingerprint.hooks == ()
    apply_schedule(workload.model, plan_schedule(profile, {layer: frozenset()}))
    workload.timed_step(seed=0)  # the first training forward checks the hooks


def test_a_padded_batch_is_refused_with_the_reason():
    """monet profiles a language model on a batch without padding. A padded batch runs other ops
    (transformers builds an attention mask only then), so every training forward refuses one,
    the first or a later one, and says that padding is why; eval forwards may pad."""
    from monet_cli.errors import FingerprintError
    from monet_cli.profiler.run import profile_model
    from monet_cli.runtime.executor import apply_schedule
    from tests.schedules_for_tests import plan_schedule

    spec = _spec("hf:llama", (16,), **TINY_LLAMA)
    profile = profile_model(spec, torch.device("cpu"), steps=1)
    layer = next(c.index for c in profile.calls if c.fqn == "model.layers.0")
    workload = build_workload(spec, torch.device("cpu"))
    apply_schedule(workload.model, plan_schedule(profile, {layer: frozenset()}))
    mask = workload.inputs[[i.name for i in spec.inputs].index("attention_mask")]
    mask[0, -4:] = 0
    padded = r"schedule does not match this batch: it pads \(its attention_mask has zeros\)"
    with pytest.raises(FingerprintError, match=padded):
        workload.timed_step(seed=0)
    mask.fill_(1)
    workload.timed_step(seed=0)  # the same model, unpadded: checked and run
    mask[1, -1] = 0
    with pytest.raises(FingerprintError, match=padded):
        workload.timed_step(seed=0)
    workload.model.eval()
    with torch.no_grad():
        workload.run_model()

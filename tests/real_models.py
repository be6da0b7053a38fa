"""The real-model matrix: third-party models as users bring them, run through the whole loop.

Each case is a tiny configuration (random weights, CPU, seconds): profile, find the
smallest reachable peak, solve at 60% of the baseline (or the nearest feasible budget) and
just above the smallest peak, then apply each schedule beside the unmodified model.
``tests/test_real_models.py`` holds every case to monet's promises; ``bench/real_models.py``
prints the same figures for larger configurations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from monet_cli.core.plan import build_schedule
from monet_cli.core.profile import InputSpec, ModelSpec, Profile
from monet_cli.core.schedule import Schedule
from monet_cli.core.segments import SegmentModel
from monet_cli.core.solver.search import Planner, solver_info
from monet_cli.profiler.run import profile_model
from monet_cli.runtime.compare import ApplyReport, run_apply
from monet_cli.workload.resolve import Overrides, resolve_model_spec

CPU = torch.device("cpu")
TOKENS = 32
"""Sequence length of the language models."""

_DECODER = {"vocab_size": 256, "max_position_embeddings": 64}
_LLAMA_LIKE = {**_DECODER, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2}

# name -> (MODEL as a user types it, config fields, batch size, per-sample input shape or None)
CASES: dict[str, tuple[str, dict, int, tuple[int, ...] | None]] = {
    "gpt2": ("hf:gpt2", {"vocab_size": 256, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4}, 4, (TOKENS,)),
    "llama": ("hf:llama", _LLAMA_LIKE, 4, (TOKENS,)),
    "qwen2": ("hf:qwen2", _LLAMA_LIKE, 4, (TOKENS,)),
    "gpt_neox": ("hf:gpt_neox", {**_DECODER, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "rotary_pct": 0.25}, 4, (TOKENS,)),
    "opt": ("hf:opt", {**_DECODER, "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "word_embed_proj_dim": 64}, 4, (TOKENS,)),
    "bloom": ("hf:bloom", {"vocab_size": 256, "hidden_size": 64, "n_layer": 2, "n_head": 4}, 4, (TOKENS,)),
    "bert": ("hf:BertForSequenceClassification", {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
                                                  "num_attention_heads": 4, "intermediate_size": 128,
                                                  "max_position_embeddings": 64}, 4, (TOKENS,)),
    "t5": ("hf:t5", {"vocab_size": 256, "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2,
                     "num_decoder_layers": 2, "num_heads": 4}, 4, (TOKENS,)),
    "bart": ("hf:bart", {"vocab_size": 256, "d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
                         "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 128,
                         "decoder_ffn_dim": 128, "max_position_embeddings": 64}, 4, (TOKENS,)),
    "convnext_atto": ("timm:convnext_atto", {"num_classes": 10}, 8, (3, 64, 64)),
    "efficientnet_b0": ("timm:efficientnet_b0", {"num_classes": 10}, 8, (3, 64, 64)),
    "mobilenetv3": ("timm:mobilenetv3_small_050", {"num_classes": 10}, 8, (3, 64, 64)),
    "vit_small": ("timm:vit_small_patch16_224", {"num_classes": 10, "depth": 2, "embed_dim": 96, "num_heads": 3,
                                                "patch_size": 8}, 8, (3, 64, 64)),
    "resnet18": ("resnet18", {"num_classes": 10}, 8, (3, 64, 64)),
    "mobilenet_v2": ("mobilenet_v2", {"num_classes": 10, "width_mult": 0.5}, 8, (3, 64, 64)),
}


def case_spec(name: str, *, precision: str = "32", scale: int = 1) -> ModelSpec:
    """The case's spec; ``scale`` multiplies the batch (the benchmark's larger runs)."""
    model, fields, batch, shape = CASES[name]
    inputs = None if shape is None else (InputSpec(shape=shape),)
    overrides = Overrides(batch_size=batch * scale, inputs=inputs, model_kwargs=fields, precision=precision)
    return resolve_model_spec(model, overrides)


@dataclass(frozen=True, kw_only=True)
class CaseRun:
    label: str
    schedule: Schedule
    report: ApplyReport


@dataclass(frozen=True, kw_only=True)
class CaseResult:
    name: str
    profile: Profile
    floor_bytes: int
    """The smallest peak any schedule reaches (simulated)."""
    runs: tuple[CaseRun, ...]

    @property
    def reach(self) -> float:
        return self.floor_bytes / self.profile.baseline.peak_bytes


def case_budgets(baseline: int, floor: int) -> dict[str, int]:
    """60% of the baseline, or halfway down to the smallest peak when 60% cannot be reached,
    and just above the smallest peak (2% of the way from it to the baseline)."""
    near_floor = floor + max(1, (baseline - floor) // 50)
    if baseline * 0.6 >= near_floor:
        return {"60%": int(baseline * 0.6), "floor+2%": near_floor}
    return {"halfway": (baseline + floor) // 2, "floor+2%": near_floor}


def run_case(spec: ModelSpec, *, time_limit_s: float = 10.0) -> CaseResult:
    profile = profile_model(spec, CPU, steps=1)
    model = SegmentModel(profile)
    planner = Planner(model)
    floor = planner.minimum_peak(time_limit_s=time_limit_s, workers=1, seed=0).peak_bytes
    runs = []
    for label, budget in case_budgets(profile.baseline.peak_bytes, floor).items():
        outcome = planner.solve(budget, time_limit_s=time_limit_s, workers=1, seed=0)
        if outcome.plan is None:
            raise AssertionError(f"{spec.name}: no schedule at {label} ({budget} B, floor {floor} B)")
        schedule = build_schedule(
            profile, outcome.plan, budget_bytes=budget, budget_spec=label, profile_sha256="", model=model,
            solver=solver_info(outcome, workers=1, seed=0, time_limit_s=time_limit_s),
        )
        runs.append(CaseRun(label=label, schedule=schedule, report=run_apply(schedule, CPU, steps=1, check=True)))
    return CaseResult(name=spec.name, profile=profile, floor_bytes=floor, runs=tuple(runs))

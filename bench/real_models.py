"""The real-model matrix: third-party models as users bring them, run through the whole loop.

Each case is a tiny configuration (random weights, CPU, seconds): profile, find the
smallest reachable peak, solve at 60% of the baseline (or halfway there when 60% cannot be
reached) and just above the smallest peak, then apply each schedule beside the unmodified
model. ``tests/test_real_models.py`` holds every case to monet's promises; run as a script
this writes the figures to bench/results/real-models-cpu.json and docs/real-models.md:

    python bench/real_models.py                    # every case, 32 and bf16-mixed
    python bench/real_models.py --cases llama,t5 --precisions 32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from monet_cli.core.plan import solve_schedule
from monet_cli.core.profile import InputSpec, ModelSpec, Profile
from monet_cli.core.schedule import Schedule
from monet_cli.core.segments import SegmentModel
from monet_cli.core.solver.search import Planner
from monet_cli.profiler.run import profile_model
from monet_cli.runtime.compare import ApplyReport, run_apply
from monet_cli.workload.resolve import Overrides, resolve_model_spec

CPU = torch.device("cpu")
TOKENS = 32
"""Sequence length of the language models."""

_DECODER = {"vocab_size": 256, "max_position_embeddings": 64}
_LLAMA_LIKE = {
    **_DECODER,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}

# name -> (MODEL as a user types it, config fields, batch size, per-sample input shape or None)
CASES: dict[str, tuple[str, dict, int, tuple[int, ...] | None]] = {
    "gpt2": ("hf:gpt2", {"vocab_size": 256, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4}, 4, (TOKENS,)),
    "llama": ("hf:llama", _LLAMA_LIKE, 4, (TOKENS,)),
    "qwen2": ("hf:qwen2", _LLAMA_LIKE, 4, (TOKENS,)),
    "gpt_neox": (
        "hf:gpt_neox",
        {**_DECODER, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
        4,
        (TOKENS,),
    ),
    "opt": (
        "hf:opt",
        {
            **_DECODER,
            "hidden_size": 64,
            "ffn_dim": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "word_embed_proj_dim": 64,
        },
        4,
        (TOKENS,),
    ),
    "bloom": ("hf:bloom", {"vocab_size": 256, "hidden_size": 64, "n_layer": 2, "n_head": 4}, 4, (TOKENS,)),
    "bert": (
        "hf:BertForSequenceClassification",
        {
            "vocab_size": 256,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "max_position_embeddings": 64,
        },
        4,
        (TOKENS,),
    ),
    "t5": (
        "hf:t5",
        {
            "vocab_size": 256,
            "d_model": 64,
            "d_kv": 16,
            "d_ff": 128,
            "num_layers": 2,
            "num_decoder_layers": 2,
            "num_heads": 4,
        },
        4,
        (TOKENS,),
    ),
    "bart": (
        "hf:bart",
        {
            "vocab_size": 256,
            "d_model": 64,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 128,
            "decoder_ffn_dim": 128,
            "max_position_embeddings": 64,
        },
        4,
        (TOKENS,),
    ),
    "hf_vit": (
        "hf:ViTForImageClassification",
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "image_size": 32,
            "patch_size": 4,
            "num_labels": 10,
        },
        4,
        None,
    ),
    "convnext_atto": ("timm:convnext_atto", {"num_classes": 10}, 8, (3, 64, 64)),
    "efficientnet_b0": ("timm:efficientnet_b0", {"num_classes": 10}, 8, (3, 64, 64)),
    "mobilenetv3": ("timm:mobilenetv3_small_050", {"num_classes": 10}, 8, (3, 64, 64)),
    "vit_small": (
        "timm:vit_small_patch16_224",
        {"num_classes": 10, "depth": 2, "embed_dim": 96, "num_heads": 3, "patch_size": 8},
        8,
        (3, 64, 64),
    ),
    "mobilenet_v2": ("mobilenet_v2", {"num_classes": 10, "width_mult": 0.5}, 8, (3, 64, 64)),
}


# Families the tests never see: the script runs them too, to check that the fixes hold for
# classes of models rather than for the matrix (MoE routing, shared layers, windowed attention).
HELD_OUT: dict[str, tuple[str, dict, int, tuple[int, ...] | None]] = {
    "mistral": ("hf:mistral", {**_LLAMA_LIKE}, 4, (TOKENS,)),
    "gemma": ("hf:gemma", {**_LLAMA_LIKE, "head_dim": 16}, 4, (TOKENS,)),
    "phi": (
        "hf:phi",
        {**_DECODER, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
        4,
        (TOKENS,),
    ),
    "falcon": (
        "hf:falcon",
        {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
        4,
        (TOKENS,),
    ),
    "gptj": (
        "hf:gptj",
        {"vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64, "rotary_dim": 8},
        4,
        (TOKENS,),
    ),
    "mixtral": ("hf:mixtral", {**_LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2}, 4, (TOKENS,)),
    "distilbert": (
        "hf:DistilBertForSequenceClassification",
        {"vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 128, "max_position_embeddings": 64},
        4,
        (TOKENS,),
    ),
    "roberta": (
        "hf:roberta",
        {
            **_DECODER,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 80,
        },
        4,
        (TOKENS,),
    ),
    "albert": (
        "hf:albert",
        {
            "vocab_size": 256,
            "embedding_size": 32,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 128,
        },
        4,
        (TOKENS,),
    ),
    "electra": (
        "hf:electra",
        {
            **_DECODER,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "embedding_size": 32,
        },
        4,
        (TOKENS,),
    ),
    "mbart": (
        "hf:mbart",
        {
            "vocab_size": 256,
            "d_model": 64,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 128,
            "decoder_ffn_dim": 128,
            "max_position_embeddings": 64,
        },
        4,
        (TOKENS,),
    ),
    "pegasus": (
        "hf:pegasus",
        {
            "vocab_size": 256,
            "d_model": 64,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 128,
            "decoder_ffn_dim": 128,
            "max_position_embeddings": 64,
        },
        4,
        (TOKENS,),
    ),
    "hf_resnet": (
        "hf:ResNetForImageClassification",
        {"embedding_size": 16, "hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 1, 1], "num_labels": 10},
        4,
        (3, 64, 64),
    ),
    "swin": (
        "timm:swin_tiny_patch4_window7_224",
        {"num_classes": 10, "depths": (1, 1, 1, 1), "embed_dim": 24, "num_heads": (1, 1, 2, 2), "img_size": 112},
        4,
        (3, 112, 112),
    ),
    # Vision families run first on 12-07: dense concatenation, channel shuffle, and random
    # drop paths and dropout that every recompute must replay exactly.
    "densenet121": ("densenet121", {"num_classes": 10}, 4, (3, 64, 64)),
    "shufflenet": ("shufflenet_v2_x0_5", {"num_classes": 10}, 4, (3, 64, 64)),
    "mnasnet": ("mnasnet0_5", {"num_classes": 10}, 4, (3, 64, 64)),
    "efficientnet_sd": ("efficientnet_b0", {"num_classes": 10, "stochastic_depth_prob": 0.3}, 16, (3, 96, 96)),
    "resnet18_droppath": (
        "timm:resnet18",
        {"num_classes": 10, "drop_path_rate": 0.1, "drop_rate": 0.2},
        16,
        (3, 128, 128),
    ),
    "vit_dropout": (
        "timm:vit_tiny_patch16_224",
        {
            "num_classes": 10,
            "depth": 4,
            "img_size": 128,
            "drop_path_rate": 0.1,
            "drop_rate": 0.1,
            "attn_drop_rate": 0.1,
        },
        8,
        (3, 128, 128),
    ),
    "convnext_droppath": ("timm:convnext_atto", {"num_classes": 10, "drop_path_rate": 0.2}, 8, (3, 64, 64)),
    "regnet": ("timm:regnetx_002", {"num_classes": 10}, 4, (3, 64, 64)),
}


def case_spec(name: str, *, precision: str = "32") -> ModelSpec:
    model, fields, batch, shape = {**CASES, **HELD_OUT}[name]
    inputs = None if shape is None else (InputSpec(shape=shape),)
    overrides = Overrides(batch_size=batch, inputs=inputs, model_kwargs=fields, precision=precision)
    return resolve_model_spec(model, overrides)


@dataclass(frozen=True, kw_only=True)
class CaseRun:
    label: str
    schedule: Schedule
    report: ApplyReport


@dataclass(frozen=True, kw_only=True)
class CaseResult:
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
    lowest = planner.minimum_peak(time_limit_s=time_limit_s, workers=1, seed=0)
    floor = lowest.peak_bytes
    runs = []
    for label, budget in case_budgets(profile.baseline.peak_bytes, floor).items():
        # The smallest peak's plan fits every budget: a schedule exists however slow the machine.
        schedule, _ = solve_schedule(
            planner, budget, label, time_limit_s=time_limit_s, workers=1, seed=0, hint=(lowest.plan, lowest.variants)
        )
        if schedule is None:
            raise AssertionError(f"{spec.name}: no schedule at {label} ({budget} B, floor {floor} B)")
        runs.append(CaseRun(label=label, schedule=schedule, report=run_apply(schedule, CPU, steps=1, check=True)))
    return CaseResult(profile=profile, floor_bytes=floor, runs=tuple(runs))


# -- the report ------------------------------------------------------------------------


def _row(name: str, result: CaseResult, precision: str, seconds: float) -> dict:
    runs = []
    for run in result.runs:
        r = run.report
        runs.append(
            {
                "budget": run.label,
                "budget_bytes": r.budget_bytes,
                "predicted_peak_bytes": r.predicted_peak_bytes,
                "measured_peak_bytes": r.measured_peak_bytes,
                "within_budget": r.within_budget,
                "error": round(r.prediction_error, 6),
                "grads_equal": bool(r.check and r.check.ok),
                "segments": len(run.schedule.segments),
                "chains": len(run.schedule.chains),
                "kept_ops": len(run.schedule.keeps),
            }
        )
    spec = result.profile.model
    return {
        "case": name,
        "held_out": name in HELD_OUT,
        "model": spec.spec,
        "target": spec.target,
        "precision": precision,
        "batch_size": spec.batch_size,
        "baseline_peak_bytes": result.profile.baseline.peak_bytes,
        "floor_bytes": result.floor_bytes,
        "reach": round(result.reach, 4),
        "seconds": round(seconds, 1),
        "not_checkpointable": sum(1 for c in result.profile.calls if c.reason.startswith("re-running")),
        "runs": runs,
    }


_HEADER = [
    "| case | MODEL | precision | baseline | reach | budget | segments (chains) | predicted | measured | error | within "
    "| grads equal |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def _markdown(rows: list[dict]) -> str:
    lines = [
        "# Real models on this CPU",
        "",
        "Written by `python bench/real_models.py` (the cases of `tests/test_real_models.py`: tiny configurations,",
        "random weights). Reach = smallest reachable peak / baseline peak. At each budget: predicted and measured",
        "peak (live tensor storages), prediction error, and whether gradients, parameters after the optimizer step",
        "and buffers equal the unmodified model's.",
        "",
        *_HEADER,
        *_table_rows([row for row in rows if not row["held_out"]]),
    ]
    held_out = [row for row in rows if row["held_out"]]
    if held_out:
        lines += [
            "",
            "## Held out: families the tests do not contain",
            "",
            "The same loop on `HELD_OUT` in `bench/real_models.py`, run by this script only: MoE routing",
            "(Mixtral), shared layers (ALBERT), windowed attention (Swin), more decoders and encoders, and",
            "vision families: dense concatenation (DenseNet), channel shuffle (ShuffleNet), random drop paths",
            "and dropout (EfficientNet's stochastic depth, timm's ResNet, ViT and ConvNeXt).",
            "",
            *_HEADER,
            *_table_rows(held_out),
        ]
    return "\n".join(lines) + "\n"


def _table_rows(rows: list[dict]) -> list[str]:
    kib = 1024
    return [
        f"| {row['case']} | `{row['model']}` | {row['precision']} | {row['baseline_peak_bytes'] / kib:,.0f} KiB "
        f"| {row['reach']:.2f} | {run['budget']} | {run['segments']} ({run['chains']}) "
        f"| {run['predicted_peak_bytes'] / kib:,.0f} KiB "
        f"| {run['measured_peak_bytes'] / kib:,.0f} KiB | {100 * run['error']:+.2f}% "
        f"| {'yes' if run['within_budget'] else 'NO'} | {'yes' if run['grads_equal'] else 'NO'} |"
        for row in rows
        for run in row["runs"]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--cases", help="Names from CASES or HELD_OUT. Default: CASES in every precision, then HELD_OUT in 32."
    )
    parser.add_argument("--precisions", default="32,bf16-mixed")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "real-models-cpu.json")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "real-models.md")
    args = parser.parse_args()
    precisions = args.precisions.split(",")
    if args.cases:
        runs = [(name, precision) for precision in precisions for name in args.cases.split(",")]
    else:
        runs = [(name, precision) for precision in precisions for name in CASES] + [(name, "32") for name in HELD_OUT]
    rows = []
    for name, precision in runs:
        start = time.perf_counter()
        result = run_case(case_spec(name, precision=precision))
        rows.append(_row(name, result, precision, time.perf_counter() - start))
        print(f"{name} {precision}: reach {result.reach:.2f}", file=sys.stderr, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"torch": torch.__version__, "cases": rows}, indent=1) + "\n")
    args.doc.write_text(_markdown(rows))
    print(f"wrote {args.out} and {args.doc}", file=sys.stderr)


if __name__ == "__main__":
    main()

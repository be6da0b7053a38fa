"""How profile and solve times grow with depth: decoders of 4 to 96 layers.

Hugging Face LLaMA- and GPT-2-style decoders, hidden size 128, batch 4 x 64 tokens,
random weights, CPU. Per depth: forward ops, candidate segments, profile wall time, and the
end-to-end solve at 60% of the baseline peak on 2 workers (planner construction, CP-SAT,
simulator checks) with its status and gap. The solve stops at `monet solve`'s default gap
(1%, the issue's target: OPTIMAL or within 1%) unless --gap says otherwise. Results go to
bench/results/scale-cpu.json.

    python bench/scale.py                          # llama and gpt2, depths 4..96
    python bench/scale.py --families llama --depths 4,8,16 --time-limit 60
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.run import write_rows  # noqa: E402
from monet_cli.core.profile import InputSpec  # noqa: E402
from monet_cli.core.segments import SegmentModel  # noqa: E402
from monet_cli.core.solver.search import Planner  # noqa: E402
from monet_cli.profiler.run import profile_model  # noqa: E402
from monet_cli.workload.resolve import Overrides, resolve_model_spec  # noqa: E402

FAMILIES = {
    "llama": (
        "hf:llama",
        lambda depth: {
            "hidden_size": 128,
            "intermediate_size": 344,
            "num_hidden_layers": depth,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 1000,
            "max_position_embeddings": 128,
        },
    ),
    "gpt2": (
        "hf:gpt2",
        lambda depth: {"n_embd": 128, "n_layer": depth, "n_head": 4, "vocab_size": 1000, "n_positions": 128},
    ),
}


def measure(family: str, depth: int, time_limit_s: float, workers: int, relative_gap: float) -> dict:
    model, fields = FAMILIES[family]
    spec = resolve_model_spec(
        model, Overrides(batch_size=4, inputs=(InputSpec(shape=(64,)),), model_kwargs=fields(depth))
    )
    start = time.perf_counter()
    profile = profile_model(spec, torch.device("cpu"), steps=1)
    profile_s = time.perf_counter() - start
    start = time.perf_counter()
    segments = SegmentModel(profile)
    planner = Planner(segments)
    setup_s = time.perf_counter() - start
    budget = int(0.6 * profile.baseline.peak_bytes)
    outcome = planner.solve(budget, time_limit_s=time_limit_s, workers=workers, seed=0, relative_gap=relative_gap)
    return {
        "family": family,
        "depth": depth,
        "forward_ops": len(profile.ops),
        "segments": len(segments.segments),
        "keep_candidates": sum(len(s.candidates) for s in segments.segments.values()),
        "nest_pairs": len(segments.nest_pairs),
        "profile_s": round(profile_s, 2),
        "planner_setup_s": round(setup_s, 2),
        "solve_s": round(outcome.time_s, 2),
        "solve_total_s": round(setup_s + outcome.time_s, 2),
        "status": outcome.status,
        "method": outcome.method,
        "gap": outcome.gap,
        "gap_limit": relative_gap,
        "rounds": outcome.rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="llama,gpt2")
    parser.add_argument("--depths", default="4,8,16,32,48,64,96")
    parser.add_argument("--time-limit", type=float, default=120.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gap", type=float, default=0.01, help="relative gap at which the solve stops")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "scale-cpu.json")
    args = parser.parse_args()
    rows = []
    for family in args.families.split(","):
        for depth in (int(d) for d in args.depths.split(",")):
            row = measure(family, depth, args.time_limit, args.workers, args.gap)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()

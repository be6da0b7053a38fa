"""The benchmark harness keeps working: one tiny workload, one budget (the full run is by hand)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.report import render
from bench.run import main
from monet_cli.core.units import format_bytes


def test_bench_smoke(tmp_path: Path):
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "smoke-cpu.json").read_text())
    kinds = {p["kind"] for p in result["points"]}
    assert {"baseline", "pytorch", "monet"} <= kinds
    monet = [p for p in result["points"] if p["kind"] == "monet"]
    assert monet and all(p["within_budget"] and abs(p["prediction_error"]) <= 0.02 for p in monet)
    # The hand-written checkpointing is simulated too: its peak as predicted, and its overhead.
    by_hand = [p for p in result["points"] if p["kind"] == "pytorch"]
    assert by_hand and all(abs(p["prediction_error"]) <= 0.02 and p["predicted_overhead"] > 0 for p in by_hand)
    text = render([result], None, None, None, tmp_path / "img")
    assert "| monet 90% |" in text and "Targets:" in text


def test_reach_bench_measures_each_family_floor(tmp_path: Path):
    from bench.reach import measure

    row = measure("gpt", time_limit_s=10, workers=1)
    floors = [f["peak_bytes"] for f in row["floors"]]
    assert floors[-1] <= floors[0] < row["baseline_peak_bytes"]
    assert row["within_budget"] and row["check_ok"] and abs(row["error"]) <= 0.02
    text = render([], None, None, {"rows": [row]}, tmp_path / "img")
    assert "## Reach" in text and "| gpt |" in text and "- gpt: " in text
    assert any(f"({format_bytes(floors[-1])})" in point for point in row["floor_binding_points"])
    missed = render([], None, None, {"rows": [{**row, "below_blocks": 1.0}]}, tmp_path / "img")
    assert "- gpt: 1.000x" in missed and "  - why: " in missed

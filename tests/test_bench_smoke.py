"""The benchmark harness keeps working: one tiny workload, one budget (the full run is by hand)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.report import render
from bench.run import main


def test_bench_smoke(tmp_path: Path):
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "smoke-cpu.json").read_text())
    kinds = {p["kind"] for p in result["points"]}
    assert {"baseline", "pytorch", "monet"} <= kinds
    monet = [p for p in result["points"] if p["kind"] == "monet"]
    assert monet and all(p["within_budget"] and abs(p["prediction_error"]) <= 0.02 for p in monet)
    text = render([result], None, None, tmp_path / "img")
    assert "| monet 90% |" in text and "Targets:" in text

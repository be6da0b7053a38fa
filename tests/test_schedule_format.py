"""Schedule files: schema 2 is a flat list of decisions; schema 1 files are migrated on read."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from monet_cli.core.schedule import (
    KeepDecision,
    SegmentDecision,
    load_schedule,
    save_schedule,
    schedule_from_data,
    with_content_hash,
)
from monet_cli.errors import FileFormatError

V1 = Path(__file__).parent / "data" / "unet-70pct-schema1.yaml"  # as monet wrote it before schema 2


def test_a_schema_1_file_is_migrated_to_the_same_decisions(tmp_path: Path):
    old = yaml.safe_load(V1.read_text())
    assert old["schema_version"] == 1
    schedule = load_schedule(V1)
    assert schedule.schema_version == 2
    assert [(s.module, s.call, s.first_op, s.end_op, s.recompute_ms) for s in schedule.segments] == [
        (s["module"], s["call"], s["first_op"], s["end_op"], s["recompute_ms"]) for s in old["segments"]
    ]
    kept = [
        (s["module"], d["index"], d["op"], d["occurrence"])
        for s in old["segments"]
        for d in s["decisions"]
        if d["action"] == "keep"
    ]
    assert kept and [(k.segment, k.index, k.op, k.occurrence) for k in schedule.keeps] == kept
    assert schedule.predicted.peak_bytes == old["predicted"]["peak_bytes"]
    save_schedule(schedule, tmp_path / "v2.yaml")
    written = yaml.safe_load((tmp_path / "v2.yaml").read_text())
    assert written["schema_version"] == 2 and "segments" not in written
    assert {d["kind"] for d in written["decisions"]} == {"segment", "keep"}
    assert load_schedule(tmp_path / "v2.yaml") == schedule


def test_a_schema_1_file_edited_by_hand_is_refused():
    data = yaml.safe_load(V1.read_text())
    data["segments"][0]["decisions"][0]["action"] = "keep"
    with pytest.raises(FileFormatError, match="content_sha256"):
        schedule_from_data(data, source="old.yaml")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d["decisions"].append({"kind": "swap", "op": 3}),
            "unknown kind .swap. .known: segment, keep, variant, offload",
        ),
        (lambda d: d["decisions"][0].update(kind=[]), r"decisions\[0\].kind: unknown kind \[\]"),  # found by fuzzing
        (lambda d: d.update(schema_version=3), "written by a newer monet"),
    ],
)
def test_unknown_decisions_and_versions_are_refused(tmp_path: Path, edit, message):
    save_schedule(load_schedule(V1), tmp_path / "v2.yaml")
    data = yaml.safe_load((tmp_path / "v2.yaml").read_text())
    edit(data)
    with pytest.raises(FileFormatError, match=message):
        schedule_from_data(data, source="v2.yaml")


def test_keeps_must_sit_inside_a_segment_of_the_schedule():
    from monet_cli.core.schedule import consistency_problem

    schedule = load_schedule(V1)
    segment = schedule.segments[0]
    stray = KeepDecision(segment="no.such.module", index=segment.first_op, op="aten.mm.default", occurrence=0)
    outside = KeepDecision(segment=segment.module, index=segment.end_op, op="aten.mm.default", occurrence=0)
    twice = replace(segment)
    for decision, words in ((stray, "which is no segment"), (outside, "outside segment"), (twice, "segment twice")):
        edited = with_content_hash(replace(schedule, decisions=(*schedule.decisions, decision)))
        assert words in consistency_problem(edited)
    assert isinstance(schedule.decisions[0], SegmentDecision)

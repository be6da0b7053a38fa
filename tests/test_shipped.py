"""The shipped schedules load, come from the shipped profiles, and still predict what they say."""

from __future__ import annotations

from pathlib import Path

import pytest

from monet_cli.core.plan import plan_of, variants_of
from monet_cli.core.profile import load_profile
from monet_cli.core.schedule import file_sha256, load_schedule
from monet_cli.core.segments import SegmentModel
from monet_cli.core.simulate import simulate

ROOT = Path(__file__).resolve().parent.parent
SCHEDULES = sorted((ROOT / "schedules").glob("*.yaml"))


def test_schedules_are_shipped():
    names = {p.stem.rsplit("-", 1)[0] for p in SCHEDULES}
    runs = {p.stem for p in (ROOT / "configs").glob("*.yaml") if not p.name.endswith(".profile.yaml")}
    assert names == runs


@pytest.mark.parametrize("path", SCHEDULES, ids=lambda p: p.name)
def test_shipped_schedule_matches_its_profile(path: Path):
    schedule = load_schedule(path)
    profiles = {file_sha256(p): p for p in (ROOT / "configs").glob("*.profile.yaml")}
    assert schedule.profile_sha256 in profiles, "solved from a profile that is not shipped"
    profile = load_profile(profiles[schedule.profile_sha256])
    assert profile.fingerprint == schedule.fingerprint
    model = SegmentModel(profile)
    result = simulate(profile, plan_of(schedule, model), model=model, variants=variants_of(schedule, profile))
    assert result.peak_bytes == schedule.predicted.peak_bytes <= schedule.budget_bytes
    assert schedule.fingerprint.device_type == "cpu"

"""The chaos nemesis's schedule (`bench.chaos.schedule`, issue 40): one seed, one schedule, saved and replayed as is.

A seed fixes the schedule (what, when, on what, for how long); `--replay FILE` runs a saved one again. The
schedule keeps the fleet testable: at most half the instances (at least one) killed or paused at once, one
fault at a time on each link, spared instances never killed, and every fault over before the quiet tail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench.chaos.schedule import ALL, KINDS, PROCESS_KINDS, Schedule, make_schedule

FLEET = ["mcp-1", "mcp-2", "mcp-3", "sc-1", "sc-2"]
HOUR = 3600.0


def _hour(seed: int = 1) -> Schedule:
    return make_schedule(seed, HOUR, FLEET, rate=5.0, killable=["mcp-2", "mcp-3", "sc-2"])


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    assert _hour(7).to_json() == _hour(7).to_json()
    assert _hour(7).faults != _hour(8).faults


def test_a_saved_schedule_replays_exactly(tmp_path: Path) -> None:
    schedule = _hour(3)
    again = Schedule.load(schedule.save(tmp_path / "schedule.json"))
    assert again == schedule


def test_an_hour_draws_every_kind_of_the_menu_about_rate_times_a_minute() -> None:
    schedule = _hour(1)
    assert set(schedule.counts()) == set(KINDS)
    assert 240 <= len(schedule.faults) <= 360  # 5 a minute; the ones that found no free target are not drawn


@pytest.mark.parametrize("seed", range(1, 6))
def test_the_fleet_stays_testable_under_every_seed(seed: int) -> None:
    schedule = _hour(seed)
    faults = schedule.faults
    assert all(f.end <= HOUR - 10 for f in faults), "every fault ends before the quiet tail"
    assert all(f.target != "mcp-1" and f.target != "sc-1" for f in faults if f.kind == "kill"), "spared"
    assert all(f.duration <= 30.0 for f in faults)
    downs = [f for f in faults if f.kind in PROCESS_KINDS]
    for f in downs:
        at_once = [g for g in downs if g.at <= f.at < g.end]
        assert len(at_once) <= len(FLEET) // 2, f"{len(at_once)} instances down at {f.at}"
        assert len({g.target for g in at_once}) == len(at_once), f"one instance twice at {f.at}"
    links = [f for f in faults if f.dependency]
    for f in links:
        same = [g for g in links if g is not f and g.dependency == f.dependency and g.at < f.end and f.at < g.end]
        assert not [g for g in same if ALL in (g.target, f.target) or g.target == f.target], f.label()


def test_a_file_that_is_not_a_schedule_is_refused_in_one_message() -> None:
    with pytest.raises(ValueError, match="not a chaos schedule"):
        Schedule.from_json('{"seed": 1}')
    with pytest.raises(ValueError, match="unknown fault kinds"):
        make_schedule(1, 60, FLEET, menu=["kill", "meteor"])

"""The plan check: per-call peaks measured in the worker process, compared with the plan's phase figures."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from easytrain.config import compose, with_default_preset
from easytrain.main import resolve
from easytrain.memory import peaks
from easytrain.memory.plan_check import MISS_FRACTION, PlanCheck, phase_of
from easytrain.memory.planner import plan

MB = 2**20


def touch(size: int) -> bytearray:
    """``size`` bytes that are resident (every page written)."""
    block = bytearray(size)
    block[::4096] = b"\x01" * len(block[::4096])
    return block


def test_a_call_peak_covers_its_whole_span_and_nested_calls_keep_their_own() -> None:
    if not peaks.CLEAR_REFS.exists():
        pytest.skip("no /proc/self/clear_refs: peaks are lifetime peaks here")
    peaks.drain()
    before = peaks.host_high_water()
    peaks.enter()  # outer call
    block = touch(300 * MB)
    del block  # freed before the inner call: only the fold at the inner call's start keeps it in the outer peak
    peaks.enter()
    small = touch(8 * MB)
    peaks.leave("inner")
    del small
    peaks.leave("outer")
    got = peaks.drain()
    # the outer call held at least the 300 MB block (a measured peak, so no upper bound is asserted)
    assert got["outer"]["host_bytes"] >= 300 * MB
    # the inner call started after the block was freed: its peak is what was resident then plus 8 MB, far below
    assert got["inner"]["host_bytes"] < got["outer"]["host_bytes"] - 200 * MB
    assert got["inner"]["start"] >= got["outer"]["start"] and got["inner"]["end"] <= got["outer"]["end"]
    assert peaks.drain() == {}  # drained
    assert peaks.lifetime_peak() >= max(before, got["outer"]["host_bytes"])


def test_a_calls_reading_says_what_its_resident_set_was_made_of() -> None:
    """Object-store pages are shared memory: a call that ends holding 64 MiB of touched shared pages reads them
    as ``rss_shmem_bytes``, and 64 MiB more of private pages as ``rss_anon_bytes``, against the kinds before it."""
    import mmap

    if not peaks.resident_kinds():
        pytest.skip("no RssAnon/RssShmem in /proc/self/status here")
    peaks.drain()
    before = peaks.resident_kinds()
    peaks.enter()
    shared = mmap.mmap(-1, 64 * MB)  # anonymous and shared, as the object store's pages are to a worker
    shared.write(b"\x01" * (64 * MB))
    # a private anonymous mapping: fresh pages whatever the allocator holds. A malloc'd 64 MiB block read no growth
    # at all in one CI run (RssAnon equal to the byte): its pages were resident already, by whatever path
    private = mmap.mmap(-1, 64 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    private.write(b"\x02" * (64 * MB))
    peaks.leave("holds")
    got = peaks.drain()["holds"]
    assert got["rss_shmem_bytes"] - before["rss_shmem_bytes"] >= 64 * MB
    assert got["rss_anon_bytes"] - before["rss_anon_bytes"] >= 60 * MB  # less whatever the process freed meanwhile
    private.close()
    shared.close()


def reading(host: int, method: str = "update", rank: int = 0) -> dict[str, Any]:
    return {"role": "worker", "rank": rank, "node_ip": "10.0.0.1", "pid": 100 + rank,
            "peaks": {method: {"host_bytes": host, "device_bytes": 0, "start": 1.0, "end": 2.0},
                      "memory": {"host_bytes": 10 * host, "device_bytes": 0, "start": 2.0, "end": 2.1}}}


def test_a_phase_above_its_plan_by_more_than_ten_percent_is_a_plan_miss(caplog: pytest.LogCaptureFixture) -> None:
    config = resolve(compose(with_default_preset(["+exp=tiny"])))
    p = plan(config)
    planned = p.row("update").process_host
    records: list[dict[str, Any]] = []
    check = PlanCheck(p, records.append)
    with caplog.at_level(logging.WARNING, logger="easytrain.memory.plan_check"):
        misses = check.record(3, "step", [reading(int(planned * (1 + MISS_FRACTION) * 0.99)),
                                          reading(int(planned * 1.5), rank=1)])
    # rank 0 is within 10% of its plan, rank 1 half again above it: one miss, with both numbers
    assert [(m["rank"], m["phase"], m["what"]) for m in misses] == [(1, "update", "host")]
    assert misses[0]["measured_bytes"] == int(planned * 1.5) and misses[0]["planned_bytes"] == planned
    peaks_written = [r for r in records if r["kind"] == "phase_peak"]
    # readings and set-up calls (memory) are not phases: only the update calls are written, with the plan beside
    assert [(r["rank"], r["phase"]) for r in peaks_written] == [(0, "update"), (1, "update")]
    assert all(r["planned_process_host_bytes"] == planned and r["step"] == 3 for r in peaks_written)
    events = [r for r in records if r["kind"] == "event"]
    assert [(e["level"], e["rank"], e["measured_bytes"]) for e in events] == [("plan_miss", 1, int(planned * 1.5))]
    assert "plan miss: worker host rank 1 in update" in caplog.text and "+50%" in caplog.text


def test_generation_inside_a_validation_is_the_validation_phase() -> None:
    assert phase_of("generate", "step") == "generation" and phase_of("generate", "validation") == "validation"
    assert phase_of("save_checkpoint", "step") == "checkpoint_save" and phase_of("memory", "step") is None


def phase_peaks(run_dir: Path) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in (run_dir / "memory.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "phase_peak"]


@pytest.mark.slow
def test_the_default_run_records_every_phase_against_its_plan(default_run: Path) -> None:
    """Every phase the run goes through is measured on both workers with its plan beside it (no plan miss is
    flagged: test_watchdog_run checks the run has no events)."""
    records = phase_peaks(default_run)
    phases = {r["phase"] for r in records}
    assert {"load", "generation", "update", "weight_sync", "checkpoint_save", "validation"} <= phases, phases
    for phase in phases:
        ranks = {r["rank"] for r in records if r["phase"] == phase}
        assert ranks == {0, 1}, (phase, ranks)
    for r in records:
        assert r["host_bytes"] > 100 * MB and r["planned_process_host_bytes"] > 100 * MB
        assert r["end"] >= r["start"]
        # what the resident set held at the call's end: heap, mapped files (torch's libraries), store pages
        assert r["rss_anon_bytes"] > 0 and r["rss_file_bytes"] > 10 * MB and r["rss_shmem_bytes"] >= 0


def test_the_margins_are_the_worst_calibration_under_predictions(tmp_path) -> None:
    """The worst under-prediction of the calibration runs becomes the plan's margin (host from the CPU runs,
    device from the GPU results); held-out misses are quoted, never fitted on, so they leave it alone; without a
    GPU result the plan says none was measured."""
    import json

    from easytrain.memory.capacity import accuracy_margin

    host = tmp_path / "planner_accuracy.json"
    host.write_text(json.dumps({"accuracy": {"calibration": {"worst_under_prediction": -0.042},
                                             "held_out": {"worst_under_prediction": -0.30}}, "date": "d"}))
    assert accuracy_margin(host, (tmp_path / "none.json",)) == (
        0.042, 0.0, "margin 4.2% host: the worst under-prediction of the calibration runs in "
                    "bench/results/planner_accuracy.json (d); device: none measured on a GPU")
    smoke, check = tmp_path / "gpu_smoke.json", tmp_path / "gpu_check.json"
    smoke.write_text(json.dumps({"accuracy": {"calibration": {"device_torch": {"worst_under_prediction": -0.054}}},
                                 "device": {"name": "NVIDIA H200"}, "date": "m"}))
    check.write_text(json.dumps({"parts": {"machine": {"device": {"name": "NVIDIA H100"}},
                                           "memory": {"accuracy": {"held_out": {"device_torch": {
                                               "worst_under_prediction": -0.08}}}}}, "date": "n"}))
    host_margin, device_margin, source = accuracy_margin(host, (smoke, check))
    assert (host_margin, device_margin) == (0.042, 0.054)
    assert "5.4% device" in source and "gpu_smoke.json (NVIDIA H200, m)" in source and "gpu_check" not in source

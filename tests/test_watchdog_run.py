"""The default run, with the watchdog on as it ships: memory.jsonl covers every process of the
run on its node, memory.png is drawn, and nothing is flagged on a healthy run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import DEFAULT_RUN_STEPS as STEPS

pytestmark = pytest.mark.slow


def test_default_run_writes_a_memory_timeline_covering_every_worker(default_run: Path) -> None:
    run_dir = default_run
    png = run_dir / "memory.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    records = [json.loads(line) for line in (run_dir / "memory.jsonl").read_text().splitlines()]
    kinds = {r["kind"] for r in records}
    assert {"thresholds", "node", "process", "phase", "worker"} <= kinds

    # every process of the run: 2 fused workers (actor, reference and rollout of a device), the reward workers,
    # the driver
    seen = {(r["role"], r["rank"]) for r in records if r["kind"] == "process"}
    assert seen == {("worker", 0), ("worker", 1), ("reward", 0), ("reward", 1), ("driver", 0)}, seen
    pids = {r["pid"] for r in records if r["kind"] == "process"}
    assert len(pids) == len(seen)  # one process each
    # every step's phases, and samples taken during the run's steps (not only at their boundaries): the sampler
    # runs beside the steps. A step spans its phases (a step is ~0.3 s here and the sampling period 1 s, so
    # counting inside the update phase alone would depend on how fast the update has become)
    phases = [r for r in records if r["kind"] == "phase"]
    assert sorted({r["step"] for r in phases if r["name"] == "update"}) == list(range(1, STEPS + 1))
    spans = {step: (min(r["start"] for r in phases if r["step"] == step),
                    max(r["end"] for r in phases if r["step"] == step)) for step in range(1, STEPS + 1)}
    inside = [r for r in records if r["kind"] == "node" and any(a < r["t"] < b for a, b in spans.values())]
    print(f"node samples inside steps: {len(inside)} over {sum(b - a for a, b in spans.values()):.2f} s of steps")
    assert len(inside) >= 2
    workers = {(r["role"], r["rank"]) for r in records if r["kind"] == "worker"}
    assert workers == {("worker", 0), ("worker", 1)}
    assert all(r["rss_bytes"] > 100 * 2**20 for r in records if r["kind"] == "process")

    events = [r for r in records if r["kind"] == "event"]
    assert events == [], events  # a healthy run: no pressure, no imbalance, no leak


def test_the_run_folder_holds_the_data_profile_and_each_steps_largest_micro_batches(default_run: Path) -> None:
    """Issue 50: the profile read before launch (the same counts as data_report.json: the default data is read
    whole), and per step the update's and the log-prob passes' largest micro batch with its longest row."""
    profile = json.loads((default_run / "data_profile.json").read_text())
    report = json.loads((default_run / "data_report.json").read_text())
    by_split = {p["split"]: p for p in profile["profiles"]}
    assert set(by_split) == {"train", "val"} and profile["note"] == ""
    for split, p in by_split.items():
        assert (p["sampled"], p["kept"], p["skipped"]) == (report[split]["rows"], report[split]["kept"],
                                                           report[split]["skipped"])
    longest_prompt = max(p["stats"]["prompt_tokens"]["max"] for p in by_split.values())
    records = [json.loads(line) for line in (default_run / "memory.jsonl").read_text().splitlines()]
    micro = [r for r in records if r["kind"] == "micro_batches"]
    assert [r["step"] for r in micro] == list(range(1, STEPS + 1))
    train_file = {c["row"].rsplit("#", 1)[0] for c in by_split["train"]["costliest"]}
    for record in micro:
        for phase in ("log_probs", "update"):
            m = record[phase]
            assert m["longest_row"].rsplit("#", 1)[0] in train_file
            assert longest_prompt < m["longest_tokens"] <= longest_prompt + 1  # max_response_length: 1
            assert m["samples"] * longest_prompt < m["tokens"] <= m["samples"] * m["longest_tokens"]
            assert m["images"] == m["samples"]  # one image a sample

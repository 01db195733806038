"""Pressure inside a step (issue 24, item 6): the sampler's flag, the hard threshold that fast growth lowers,
and the HF engine's generation that stops at the hard level and shrinks at the soft one.

The flag is the real file a sampler writes; the generation reads it at every token, so writing it from a
forward hook changes it in the middle of a generation."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from easytrain.memory.flag import REACTION_S, MemoryStop, PressureFlag, hard_threshold
from easytrain.workers.rollout.engine import SamplingParams

from test_decode import engine, setup

GB, MB = 2**30, 2**20


def test_the_hard_threshold_leaves_room_for_a_period_and_the_reaction_at_the_growth_seen() -> None:
    assert hard_threshold(0.92, 0.85, 0.95, 0.0, 1.0) == 0.92  # no growth: the configured threshold
    assert hard_threshold(0.92, 0.85, 0.95, -0.2, 1.0) == 0.92  # memory falling: the same
    assert hard_threshold(0.92, 0.85, 0.95, 0.01, 0.5) == 0.92  # 1%/s: 1.5 s of it fits under 0.95 from 0.92
    rate, period = 0.04, 0.5  # 4% of the limit per second: 6% more before it stops
    assert hard_threshold(0.92, 0.85, 0.95, rate, period) == pytest.approx(0.95 - rate * (period + REACTION_S))
    assert hard_threshold(0.92, 0.85, 0.95, 1.0, period) == 0.85  # never below soft


def test_a_sampler_flags_its_nodes_level_and_lowers_hard_while_memory_grows(ray_local: None) -> None:
    import ray

    from easytrain.memory.watchdog import NodeSampler

    grow = "import sys, time; b = [bytearray(256 * 2**20)]; sys.stdin.readline(); b.append(bytearray(768 * 2**20)); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", grow], stdin=subprocess.PIPE)
    limit = 4 * GB  # the run's share (scope=run: its processes' summed RSS); ceiling 1.0
    sampler = NodeSampler(ray.get_runtime_context().get_node_id(), period_s=60.0, limit_bytes=limit, scope="run",
                          thresholds=(0.10, 0.15, 0.25))
    flag = PressureFlag.of_this_job()
    assert flag is not None and sampler.flag is not None and sampler.flag.path == flag.path
    try:
        wait_rss(child.pid, 256 * MB)
        sampler.register([(child.pid, "reward", 0)])
        first = sampler.sample()[0]
        assert first["ram_fraction"] == pytest.approx(psutil.Process(child.pid).memory_info().rss / limit, abs=0.01)
        assert 0.0625 < first["ram_fraction"] < 0.10 and first["ram_hard"] == 0.25 and flag.read() == ("ok", "")
        child.stdin.write(b"\n")
        child.stdin.flush()
        wait_rss(child.pid, 1024 * MB)
        second = sampler.sample()[0]  # ~0.25 + a little: at the configured hard threshold or just under it
        rate = (second["ram_fraction"] - first["ram_fraction"]) / (second["t"] - first["t"])
        assert second["ram_growth_per_s"] == pytest.approx(rate)
        assert second["ram_hard"] == pytest.approx(hard_threshold(0.25, 0.15, 1.0, rate, 60.0))
        assert second["ram_hard"] < 0.25  # 19% of the limit in the time between two samples: fast
        level, line = flag.read()
        assert level == "hard" and line.startswith("node ") and "lowered to" in line, line
    finally:
        sampler.stop()
        child.kill()
        child.wait()
    assert not flag.path.exists()  # a stopped sampler leaves no flag behind


def wait_rss(pid: int, size: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while psutil.Process(pid).memory_info().rss < size:
        assert time.monotonic() < deadline, f"process {pid} did not reach {size // MB} MB"
        time.sleep(0.05)


@pytest.fixture
def generation(tmp_path: Path):
    model, prompts, tokenizer, stops = setup(tmp_path, "qwen2_5_vl")
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, seed=11)
    flag = PressureFlag(tmp_path / "flag")
    return model, prompts, tokenizer.pad_token_id, stops, params, flag


def write_after(model: torch.nn.Module, flag: PressureFlag, calls: int, level: str) -> object:
    """A forward hook that writes ``level`` to the flag at the model's ``calls``-th forward (a decode step)."""
    seen = [0]

    def hook(*_: object) -> None:
        seen[0] += 1
        if seen[0] == calls:
            flag.write(level, f"node test RAM at 99.0% ({level} threshold)")

    return model.register_forward_hook(hook)


def test_hard_pressure_stops_a_generation_at_the_next_token(generation) -> None:
    model, prompts, pad, stops, params, flag = generation
    hf = engine(model, stops, pad)
    hf.pressure = flag
    calls: list[int] = []
    counter = model.register_forward_hook(lambda *_: calls.append(1))
    hook = write_after(model, flag, 3, "hard")  # the prefill and two decode steps, then the flag turns hard
    try:
        with pytest.raises(MemoryStop, match=r"node test RAM at 99.0% \(hard threshold\) \(during generation\)"):
            hf.generate(prompts, params)
    finally:
        hook.remove()
        counter.remove()
    assert len(calls) == 3  # stopped before the next forward: no more tokens were computed


def test_soft_pressure_begins_the_generation_again_in_pieces_half_the_size(generation) -> None:
    model, prompts, pad, stops, params, flag = generation
    assert len(prompts) == 4
    quiet = engine(model, stops, pad)
    whole = quiet.generate(prompts, params)
    quiet.piece = 2  # what the engine should fall back to: the same draws as a generation in pieces of two
    halves = quiet.generate(prompts, params)
    assert not torch.equal(whole["responses"], halves["responses"])  # pieces are seeded by their first prompt

    hf = engine(model, stops, pad)
    hf.pressure = flag
    hook = write_after(model, flag, 4, "soft")  # in the middle of the whole batch's decode
    try:
        shrunk = hf.generate(prompts, params)
    finally:
        hook.remove()
    assert hf.piece == 2
    for key in ("responses", "response_mask", "rollout_log_probs"):
        assert torch.equal(shrunk[key], halves[key]), key
    again = hf.generate(prompts, params)  # the same spell of soft pressure: halved once, no further
    assert hf.piece == 2 and torch.equal(again["responses"], halves["responses"])
    flag.write("ok")
    assert torch.equal(hf.generate(prompts, params)["responses"], halves["responses"])  # the smaller piece stays
    hook = write_after(model, flag, 2, "soft")  # a new spell: halved again
    try:
        hf.generate(prompts, params)
    finally:
        hook.remove()
    assert hf.piece == 1


def test_a_flag_left_by_another_run_or_never_written_is_read_as_ok(tmp_path: Path) -> None:
    flag = PressureFlag(tmp_path / "never")
    assert flag.read() == ("ok", "")
    flag.write("soft", "x")
    assert flag.read() == ("soft", "x")
    os.utime(flag.path, ns=(1, 1))  # an older file: read again only when it changes
    flag.write("warn", "y")
    assert flag.read() == ("warn", "y")
    flag.remove()
    assert flag.read() == ("ok", "")


def test_two_threads_writing_the_flag_never_rename_each_others_file(tmp_path: Path) -> None:
    """A sampler writes from its loop and from the driver's reading at once (two threads of one process): one
    shared temporary name let one rename the other's file away (FileNotFoundError, the sampler lost: seen in CI)."""
    import threading

    flag = PressureFlag(tmp_path / "flag")
    errors: list[BaseException] = []

    def writer(level: str) -> None:
        try:
            for _ in range(300):
                flag.write(level, f"{level} line")
        except BaseException as err:  # noqa: BLE001 - collected for the assertion
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(lv,)) for lv in ("soft", "hard", "warn", "ok")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:1]
    assert PressureFlag(tmp_path / "flag").read()[0] in ("soft", "hard", "warn", "ok")
    assert [p.name for p in tmp_path.iterdir()] == ["flag"]  # no temporary file left behind

"""The memory timeline: a hand-built ``memory.jsonl`` of a two-node run (actor, rollout, reward and driver
processes, a GPU on the head node, three phases per step, a soft event) is drawn as a PNG with a row per
node plus one for the head's GPUs; ``easytrain memory RUN_DIR`` does the same from the command line."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from easytrain.memory.timeline import GB, plot_timeline, read_records, timeline_figure

T0 = 1_700_000_000.0
HEAD, WORKER = ("a1b2c3d4e5f6a7b8c9d0", "10.0.0.1"), ("f0e1d2c3b4a5968778695", "10.0.0.2")
RAM_LIMIT = 64 * GB
GPU_TOTAL = 80 * GB
ACTOR_RSS = 6 * GB
PERIOD_S = 1.0
STEPS = 4
STEP_S = 15.0
SOFT_AT = T0 + 41.5
PROCESSES = {HEAD: [("driver", 0, 100), ("actor", 0, 101), ("actor", 1, 102), ("rollout", 0, 103)],
             WORKER: [("actor", 2, 201), ("actor", 3, 202), ("reward", 0, 203)]}


def rss(role: str, rank: int, t: float) -> int:
    """Each role's RSS, the actors growing by 0.5 GB a step (the kind of growth the plot should show)."""
    base = {"driver": 2 * GB, "actor": ACTOR_RSS, "rollout": 10 * GB, "reward": GB}[role]
    return int(base + (rank * GB // 4) + (0.5 * GB * (t - T0) / STEP_S if role == "actor" else 0))


def build_records() -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = [
        {"kind": "thresholds", "t": T0 - 0.5, "ram_warn": 0.8, "ram_soft": 0.85, "ram_hard": 0.92,
         "vram_warn": 0.9, "vram_soft": 0.94, "vram_hard": 0.97, "ray_kill": 0.95}]
    for i in range(int(STEPS * STEP_S / PERIOD_S)):
        t = T0 + i * PERIOD_S
        for (node_id, node_ip), procs in PROCESSES.items():
            where = {"t": t, "node_id": node_id, "node_ip": node_ip}
            used = sum(rss(role, rank, t) for role, rank, _ in procs) + 8 * GB  # the OS, Ray and the page cache
            records.append({"kind": "node", **where, "ram_used_bytes": used, "ram_total_bytes": 2 * RAM_LIMIT,
                            "ram_limit_bytes": RAM_LIMIT, "ram_fraction": used / RAM_LIMIT, "source": "cgroup"})
            records += [{"kind": "process", **where, "role": role, "rank": rank, "pid": pid,
                         "rss_bytes": rss(role, rank, t)} for role, rank, pid in procs]
            if node_id == HEAD[0]:
                gpu_used = int((20 + 50 * ((i % 15) < 6)) * GB)  # high while vLLM generates
                records.append({"kind": "gpu", **where, "index": 0, "used_bytes": gpu_used,
                                "total_bytes": GPU_TOTAL, "fraction": gpu_used / GPU_TOTAL})
        if i % 5 == 0:
            records.append({"kind": "worker", "t": t, "step": i // 15 + 1, "role": "actor", "rank": 0,
                            "node_ip": HEAD[1], "rss_bytes": rss("actor", 0, t), "gpu_allocated_bytes": 3 * GB})
    for step in range(STEPS):
        start = T0 + step * STEP_S
        for name, begin, end in (("generate", 0.0, 6.0), ("ref", 6.0, 8.0), ("update", 8.0, 14.5)):
            records.append({"kind": "phase", "step": step + 1, "name": name, "start": start + begin,
                            "end": start + end})
    records.append({"kind": "event", "t": SOFT_AT, "step": 3, "level": "soft",
                    "message": "node 10.0.0.1 RAM 86% of 64.0 GB (soft)"})
    records.append({"kind": "relief", "t": SOFT_AT + 0.1, "action": "release"})  # a kind the plot does not know
    return records


def write_run(tmp_path: Path, records: list[dict[str, Any]], torn: bool = True) -> Path:
    run_dir = tmp_path / "grpo_run"
    run_dir.mkdir()
    text = "".join(json.dumps(r) + "\n" for r in records)
    if torn:  # a run killed mid-write leaves half a line
        text += '{"kind": "node", "t": 1700000099.0, "node_id": "a1b2'
    (run_dir / "memory.jsonl").write_text(text)
    return run_dir


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_read_records_skips_torn_and_foreign_lines(tmp_path: Path) -> None:
    path = tmp_path / "memory.jsonl"
    path.write_text('{"kind": "thresholds", "ram_warn": 0.8}\n\n[1, 2]\n{"no_kind": 1}\n'
                    '{"kind": "node", "t": 1.0}\n{"kind": "proc')
    assert read_records(path) == [{"kind": "thresholds", "ram_warn": 0.8}, {"kind": "node", "t": 1.0}]


def test_figure_rows_lines_thresholds_phases_and_events() -> None:
    fig = timeline_figure(build_records(), "grpo_run")
    axes = fig.axes
    titles = [ax.get_title(loc="left") for ax in axes]
    assert titles == ["10.0.0.1 (a1b2c3d4) RAM", "10.0.0.2 (f0e1d2c3) RAM", "10.0.0.1 (a1b2c3d4) GPUs"]
    assert fig._suptitle.get_text() == "memory: grpo_run"

    head_ram, worker_ram, gpu = axes
    lines = {line.get_label(): line for line in head_ram.get_lines()}
    assert {"node used (cgroup)", "driver RSS", "actor RSS", "rollout RSS", "warn 80%", "soft 85%", "hard 92%",
            "Ray kills 95%"} <= set(lines)
    assert "reward RSS" not in lines and "reward RSS" in {line.get_label() for line in worker_ram.get_lines()}
    # Ranks 0 and 1 of the actor summed per sample; x counts from the first sample.
    x, y = lines["actor RSS"].get_data()
    assert x[0] == pytest.approx(0.0) and x[-1] == pytest.approx((STEPS * STEP_S / PERIOD_S - 1) * PERIOD_S)
    assert y[0] == pytest.approx((rss("actor", 0, T0) + rss("actor", 1, T0)) / GB)
    assert y[-1] > y[0] + 1.5  # the growth is visible
    assert lines["hard 92%"].get_ydata()[0] == pytest.approx(0.92 * RAM_LIMIT / GB)
    assert lines["Ray kills 95%"].get_ydata()[0] == pytest.approx(0.95 * RAM_LIMIT / GB)

    gpu_lines = {line.get_label(): line for line in gpu.get_lines()}
    assert gpu_lines["GPU 0 used"].get_ydata().max() == pytest.approx(70.0)
    assert gpu_lines["hard 97%"].get_ydata()[0] == pytest.approx(0.97 * GPU_TOTAL / GB)
    assert "Ray kills 95%" not in gpu_lines  # Ray watches host RAM only

    for ax in axes:  # every row: a shaded span per phase and step, the soft event at its time
        assert len(ax.patches) == 3 * STEPS
        events = [line for line in ax.get_lines() if line.get_xdata()[0] == pytest.approx(SOFT_AT - T0)
                  and line.get_color() == "gold"]
        assert len(events) == 1
    legend_labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend_labels == ["phase generate", "phase ref", "phase update", "event soft"]


def test_plot_writes_png_with_a_row_per_node_and_gpu_node(tmp_path: Path) -> None:
    records = build_records()
    run_dir = write_run(tmp_path, records)
    out = plot_timeline(run_dir)
    assert out == run_dir / "memory.png"
    width, height = png_size(out)
    assert 1100 <= width <= 1400  # ~12 in at 100 dpi, plus the legends outside the axes
    assert out.stat().st_size > 30_000

    no_gpu = tmp_path / "no_gpu"
    no_gpu.mkdir()
    (no_gpu / "memory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records if r["kind"] != "gpu"))
    _, two_rows = png_size(plot_timeline(no_gpu, no_gpu / "plots" / "two_rows.png"))
    assert height - two_rows == pytest.approx(280, abs=40)  # one more row of ~2.8 in


def test_missing_or_empty_timeline_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"memory\.jsonl"):
        plot_timeline(tmp_path)
    (tmp_path / "memory.jsonl").write_text(json.dumps(build_records()[0]) + "\n")  # thresholds, then the crash
    with pytest.raises(FileNotFoundError, match=r"memory\.jsonl has no samples"):
        plot_timeline(tmp_path)
    assert not (tmp_path / "memory.png").exists()


def test_cli_memory(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path, build_records())
    out = tmp_path / "timeline.png"
    done = subprocess.run([sys.executable, "-m", "easytrain.cli", "memory", str(run_dir), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    assert png_size(out)[0] > 1000

    missing = subprocess.run([sys.executable, "-m", "easytrain.cli", "memory", str(tmp_path / "nowhere")],
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2
    assert missing.stdout == ""
    assert missing.stderr.count("\n") == 1
    assert missing.stderr.startswith("easytrain memory: ") and "nowhere/memory.jsonl" in missing.stderr

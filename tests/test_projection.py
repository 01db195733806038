"""bench/projection.py: the paper projection of Qwen2.5-VL-7B GRPO on 8/16/32 GPUs runs, scales sensibly, and
follows its inputs (nothing in it is a stored result)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "projection.py"


@pytest.fixture(scope="module")
def projection() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_projection", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def result(projection: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("projection") / "projection.json"
    returned = projection.main(["--out", str(out)])
    written = json.loads(out.read_text())
    assert written["rows"] == json.loads(json.dumps(returned["rows"]))
    return written


def test_table_has_8_16_32_gpus_with_phases_and_memory(result: dict[str, Any], capsys: Any) -> None:
    rows = result["rows"]
    assert [r["gpus"] for r in rows] == [8, 16, 32]
    for r in rows:
        assert set(r["phases_s"]) == {"generate", "ref", "old_log_probs", "update", "sync", "overhead"}
        assert all(v >= 0 for v in r["phases_s"].values())
        assert r["step_s"] == pytest.approx(sum(r["phases_s"].values()))
        memory = r["memory"]
        assert {"generation", "update", "weight_sync"} <= set(memory["phases_gb"])
        assert memory["peak_gb"] == pytest.approx(max(memory["phases_gb"].values()))
        assert isinstance(memory["fits"], bool)
    assert result["command"].startswith("python bench/projection.py")


def test_step_time_falls_as_gpus_grow_at_fixed_batch(result: dict[str, Any]) -> None:
    rows = result["rows"]
    assert len({r["shape"]["sequences"] for r in rows}) == 1  # fixed global batch
    steps = [r["step_s"] for r in rows]
    assert steps[0] > steps[1] > steps[2]
    per_gpu = [r["tokens_per_s_per_gpu"] for r in rows]
    assert max(per_gpu) / min(per_gpu) < 2.0  # per-GPU throughput stays within a sane band
    assert rows[1]["phases_s"]["update"] < rows[0]["phases_s"]["update"]


def test_assumptions_and_comparison_are_in_the_json(result: dict[str, Any]) -> None:
    text = " ".join(result["assumptions"])
    for needle in ("TFLOP/s", "MFU", "HBM", "NVLink", "mean response", "old log-probs", "orchestration"):
        assert needle in text
    hw = result["hardware_and_workload"]
    assert hw["hbm_tbs"] > 0 and hw["mfu"] > 0 and 0 < hw["mean_response"] <= 1
    c = result["comparison"]
    assert c["step_ratio"] == pytest.approx(result["rows"][0]["step_s"] / result["easyr1"]["sec_per_step"])
    assert "no projection parameter" in c["not_tuned"]


def test_decode_follows_hbm_bandwidth(projection: ModuleType, result: dict[str, Any]) -> None:
    base = result["rows"][0]
    driver = result["driver_cost_per_call_s"]
    half = str(result["hardware_and_workload"]["hbm_tbs"] / 2)
    halved = projection.project(1, projection.parse(["--hbm-tbs", half]), driver)
    assert halved["detail"]["decode_s"] > 1.5 * base["detail"]["decode_s"]  # memory-bound: ~2x slower
    assert halved["phases_s"]["update"] == pytest.approx(base["phases_s"]["update"])  # compute-bound phases keep
    faster = projection.project(1, projection.parse(["--peak-tflops", "1978"]), driver)
    assert faster["phases_s"]["update"] < 0.75 * base["phases_s"]["update"]


def test_separate_pools_one_step_off_hides_the_shorter_side(result: dict[str, Any]) -> None:
    """8 rollout + 8 actor GPUs: one step off, a step is the longer of generation and the actor's passes (plus the
    sync and overhead), never more than the sync mode's sum of both."""
    pools, eight = result["separate_pools_16_gpus"], result["rows"][0]["phases_s"]
    tail = eight["sync"] + eight["overhead"]
    assert pools["actor_passes_s"] == pytest.approx(eight["ref"] + eight["old_log_probs"] + eight["update"])
    assert pools["step_s"]["sync"] == pytest.approx(pools["generate_s"] + pools["actor_passes_s"] + tail)
    assert pools["step_s"]["one_step_off"] == pytest.approx(max(pools["generate_s"], pools["actor_passes_s"]) + tail)
    assert pools["step_s"]["one_step_off"] < pools["step_s"]["sync"]

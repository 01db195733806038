"""Checkpoint folders: atomic publishing, ``latest``, ``save_limit``, resolving, compatibility, and a process
killed while it writes one (a real DCP save in a subprocess)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from easytrain.config import load
from easytrain.distributed.checkpoint import rng_state, set_rng_state
from easytrain.trainer.checkpoint import (LATEST, STATE_FILE, CheckpointError, CheckpointWriter, check_compatible,
                                          check_resume, latest, model_signature, checkpoint_folder, resume_from)
from easytrain.trainer.metrics import truncate_jsonl


def publish(writer: CheckpointWriter, step: int) -> Path:
    tmp = writer.begin(step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "payload").write_text(str(step))
    return writer.commit(tmp, step, {"step": step}, "trainer: {}\n")


def test_commit_renames_into_place_and_points_latest_at_it(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path / "checkpoints")
    first = publish(writer, 2)
    assert first.name == "global_step_2" and (first / STATE_FILE).is_file()
    assert (tmp_path / "checkpoints" / LATEST).read_text().strip() == "2"
    tmp = writer.begin(4)  # a save in flight is invisible to readers
    assert tmp.name.startswith(".tmp_") and latest(writer.root) == first
    writer.commit(tmp, 4, {"step": 4}, "")
    assert latest(writer.root).name == "global_step_4"
    assert not list(writer.root.glob(".tmp_*"))


def test_save_limit_keeps_the_newest(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path / "checkpoints", save_limit=2)
    for step in (1, 2, 3, 4):
        publish(writer, step)
    assert sorted(p.name for p in writer.root.glob("global_step_*")) == ["global_step_3", "global_step_4"]


def test_latest_ignores_partial_folders_and_survives_a_lost_pointer(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path / "checkpoints")
    publish(writer, 1)
    publish(writer, 2)
    (writer.root / "global_step_3").mkdir()  # no trainer_state.json: never complete
    (writer.root / ".tmp_global_step_4").mkdir()
    assert latest(writer.root).name == "global_step_2"
    (writer.root / LATEST).write_text("3\n")  # pointing at something incomplete
    assert latest(writer.root).name == "global_step_2"
    (writer.root / LATEST).unlink()
    assert latest(writer.root).name == "global_step_2"
    assert checkpoint_folder(tmp_path) == writer.root / "global_step_2"  # a run folder means its latest
    assert checkpoint_folder(writer.root / "global_step_1") == writer.root / "global_step_1"
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        checkpoint_folder(writer.root / "global_step_3")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        checkpoint_folder(tmp_path / "elsewhere")


def test_resume_modes(tmp_path: Path) -> None:
    config = load([f"trainer.output_dir={tmp_path}"])
    assert resume_from(config) is None  # auto with nothing saved: a fresh start
    publish(CheckpointWriter(tmp_path / "checkpoints"), 5)
    assert resume_from(config).name == "global_step_5"
    assert resume_from(load([f"trainer.output_dir={tmp_path}", "trainer.resume=off"])) is None


def test_resume_off_refuses_a_folder_that_holds_a_run(tmp_path: Path) -> None:
    """Issue 24, item 3: a fresh run in a folder with checkpoints would overwrite its metrics and colliding
    checkpoints and prune across both runs; refused in one line naming a fresh folder. An empty one is fine."""
    off = load([f"trainer.output_dir={tmp_path}", "trainer.resume=off"])
    assert check_resume(off) is None
    publish(CheckpointWriter(tmp_path / "checkpoints"), 4)
    with pytest.raises(CheckpointError, match=r"trainer.resume=off: .* already holds a run's checkpoints \(up to "
                                              r"global_step_4\); start the new run in a fresh folder \(hydra.run.dir"):
        check_resume(off)
    assert (tmp_path / "checkpoints" / "global_step_4").is_dir()  # nothing touched


def test_a_checkpoint_of_another_model_is_refused_naming_the_key(tmp_path: Path) -> None:
    saved = load([f"trainer.output_dir={tmp_path}"])
    writer = CheckpointWriter(tmp_path / "checkpoints")
    tmp = writer.begin(1)
    folder = writer.commit(tmp, 1, {"step": 1, "model_signature": model_signature(saved)}, "")
    assert check_compatible(folder, saved)["step"] == 1
    with pytest.raises(CheckpointError, match=r"text_config.hidden_size is \d+ there and \d+ in this config"):
        check_compatible(folder, load([f"trainer.output_dir={tmp_path}", "model.tiny_size=small"]))
    with pytest.raises(CheckpointError, match="model.lora.rank is 0 there and 8"):
        check_compatible(folder, load([f"trainer.output_dir={tmp_path}", "model.lora.rank=8"]))


def test_rng_state_round_trips_through_json() -> None:
    state = json.loads(json.dumps(rng_state()))
    expected = torch.rand(3)
    torch.rand(5)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), expected)


def test_truncate_jsonl_drops_records_after_the_step_and_torn_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 3, "val/x": 1}\n{"step": 4')
    assert truncate_jsonl(path, 2) == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


SAVER = r"""
import os, sys, torch, torch.distributed as dist
from pathlib import Path
from easytrain.distributed.checkpoint import save_training_state
from easytrain.trainer.checkpoint import CheckpointWriter

dist.init_process_group("gloo", init_method=sys.argv[2], rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(12)])  # 50M parameters
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
writer = CheckpointWriter(Path(sys.argv[1]))
for step in (1, 2):
    tmp = writer.begin(step)
    print(f"writing {step}", flush=True)
    save_training_state(tmp / "actor", model, optimizer, scheduler, 0)
    writer.commit(tmp, step, {"step": step}, "")
    print(f"saved {step}", flush=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
"""


@pytest.mark.slow
def test_killing_the_writer_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    from easytrain.distributed.checkpoint import load_model_weights
    from rendezvous import rendezvous

    root = tmp_path / "checkpoints"
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    proc = subprocess.Popen([sys.executable, str(script), str(root), rendezvous(tmp_path)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    lines = []
    while not lines or lines[-1] != "writing 2":
        line = proc.stdout.readline().strip()
        assert line or proc.poll() is None, f"saver exited early: {lines}"
        lines.append(line)
    partial = root / ".tmp_global_step_2" / "actor"
    deadline = time.monotonic() + 60
    while not any(p.stat().st_size > 0 for p in partial.glob("*.distcp")):  # shards are being written
        assert time.monotonic() < deadline and proc.poll() is None, "the second save never started writing"
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert lines == ["writing 1", "saved 1", "writing 2"]
    assert not (root / "global_step_2").exists(), "the kill landed after the save completed; nothing was tested"
    assert (root / ".tmp_global_step_2").exists()
    assert (root / LATEST).read_text().strip() == "1" and latest(root) == root / "global_step_1"

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(12)])
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_model_weights(root / "global_step_1" / "actor", model)
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    CheckpointWriter(root).begin(3)  # the next save clears the half-written folder
    assert not (root / ".tmp_global_step_2").exists()

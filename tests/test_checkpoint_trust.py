"""A checkpoint from elsewhere runs no code of its own when easytrain loads it (issue 25, item 13).

DCP's index (``.metadata``) is a pickle that torch reads with ``pickle.load``; DeepSpeed reads its files with
``torch.load(weights_only=False)``; export took ``trust_remote_code`` from the checkpoint's own config. Each test
plants a payload that would create a marker file when unpickled, shows that a plain unpickling does run it, and
asserts easytrain refuses the checkpoint in one line without running it.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from easytrain.distributed.checkpoint import (METADATA_GLOBALS, SafeReader, UnsafeCheckpoint, load_model_weights,
                                              save_training_state)


class Payload:
    """Unpickled, it runs ``touch MARKER`` (os.system): what a hostile checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {self.marker}",)


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))


def saved(folder: Path) -> nn.Module:
    """A real training-state folder (one process, no group) of :func:`tiny` after one AdamW step."""
    model = tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    save_training_state(folder, model, optimizer, scheduler, 0, buffer_bytes=2**20)
    return model


def test_a_real_checkpoint_index_needs_only_the_allowed_classes(tmp_path: Path) -> None:
    trained = saved(tmp_path / "ckpt")
    seen: set[tuple[str, str]] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.add((module, name))
            return super().find_class(module, name)

    with open(tmp_path / "ckpt" / ".metadata", "rb") as f:
        Recorder(f).load()
    assert {g for g in seen if not (g[0] == "torch" and isinstance(getattr(torch, g[1]), torch.dtype))} \
        <= METADATA_GLOBALS
    fresh = tiny()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    load_model_weights(tmp_path / "ckpt", fresh)  # through SafeReader
    for key, value in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_a_malicious_dcp_index_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    saved(folder)
    control = tmp_path / "control"
    with open(tmp_path / "evil.pkl", "wb") as f:
        pickle.dump(Payload(control), f)
    with open(tmp_path / "evil.pkl", "rb") as f:
        pickle.load(f)  # what torch's own reader (pickle.load) would do with the same bytes
    assert control.exists()

    marker = tmp_path / "marker"
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UnsafeCheckpoint, match=r"\.metadata: refused to load: the DCP index names posix\.system"):
        load_model_weights(folder, tiny())
    assert not marker.exists()
    # nested inside a real index, next to the classes it may build
    saved(tmp_path / "real")
    real = pickle.loads((tmp_path / "real" / ".metadata").read_bytes())
    real.planner_data = Payload(marker)
    (folder / ".metadata").write_bytes(pickle.dumps(real))
    with pytest.raises(UnsafeCheckpoint, match="posix.system"):
        SafeReader(folder).read_metadata()
    assert not marker.exists()


def test_a_shard_outside_the_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    saved(folder)
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../../etc/passwd"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpoint, match=r"names the shard file '../../etc/passwd'"):
        load_model_weights(folder, tiny())


def test_a_pickled_entry_where_a_tensor_belongs_is_refused(tmp_path: Path) -> None:
    """DCP stores a non-tensor as bytes that its planner reads with ``torch.load(weights_only=False)``; a 0-dim
    tensor (an optimizer's ``step``) has the same empty shape, so only the entry's kind tells them apart."""
    import torch.distributed.checkpoint as dcp

    from easytrain.distributed.checkpoint import check_tensors

    marker = tmp_path / "marker"
    folder = tmp_path / "ckpt"
    dcp.save({"optim": {"step": Payload(marker)}}, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpoint, match=r"'optim.step' is stored as a pickled object"):
        check_tensors(folder, {"optim": {"step": torch.tensor(0.0)}})
    from torch.distributed.checkpoint.api import CheckpointException

    from easytrain.distributed.checkpoint import TensorsOnlyPlanner

    with pytest.raises(CheckpointException) as err:  # the planner refuses it too, had the check been skipped
        dcp.load({"optim": {"step": torch.tensor(0.0)}}, storage_reader=SafeReader(folder),
                 planner=TensorsOnlyPlanner(), no_dist=True)
    (failure, _), = err.value.failures.values()
    assert isinstance(failure, UnsafeCheckpoint) and "stored as a pickled object" in str(failure)
    assert not marker.exists()


def test_deepspeed_state_is_loaded_weights_only(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    from easytrain.distributed.deepspeed import CHECKPOINT_TAG, META_FILE, deepspeed_state_dict

    marker = tmp_path / "marker"
    folder = tmp_path / "ckpt"
    (folder / CHECKPOINT_TAG).mkdir(parents=True)
    (folder / META_FILE).write_text('{"world_size": 1, "zero_stage": 2}')
    (folder / "latest").write_text(CHECKPOINT_TAG)
    for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        torch.save({"module": Payload(marker)}, folder / CHECKPOINT_TAG / name)
    torch.load(folder / CHECKPOINT_TAG / name, weights_only=False)  # DeepSpeed's own call: runs the payload
    assert marker.exists()
    marker.unlink()
    with pytest.raises(UnsafeCheckpoint, match=r"refused to load DeepSpeed state that holds more than tensors"):
        deepspeed_state_dict(folder)
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # set for the load only

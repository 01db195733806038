"""A Batch in transit (pickled: every Ray call argument and result) carries each prompt's images once.

A rollout batch repeats every prompt's images for its n samples; pickling
sends the first copy only and unpickling restores the rest, so what arrives
equals what was sent while the bytes on the wire shrink by about (n-1)/n of
the image share.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import ray.cloudpickle
import torch

from easytrain.distributed.batch import Batch
from easytrain.trainer.data import RLData

from rl_batches import rl_config, rollout_batch


def assert_same(a: Batch, b: Batch) -> None:
    assert a.tensors.keys() == b.tensors.keys() and a.meta == b.meta
    for key in a.tensors:
        assert torch.equal(a[key], b[key]), key
    assert torch.equal(a.image_counts, b.image_counts)  # type: ignore[arg-type]


def test_repeated_images_travel_once(tmp_path: Path) -> None:
    config = rl_config(tmp_path, "worker.rollout.n=4")
    batch = rollout_batch(config)
    pixels = batch["pixel_values"]
    image_bytes = pixels.numel() * pixels.element_size()
    plain = len(pickle.dumps(dict(batch.__dict__)))  # the same content without the compaction
    for dumps, loads in ((pickle.dumps, pickle.loads), (ray.cloudpickle.dumps, ray.cloudpickle.loads)):
        wire = dumps(batch)
        assert_same(loads(wire), batch)
        assert plain - len(wire) > 0.7 * image_bytes  # 3 of every 4 copies stayed home
    # what arrives behaves like the original: a worker's share with its images
    arrived = pickle.loads(pickle.dumps(batch))
    for part, original in zip(arrived.split(3), batch.split(3)):
        assert_same(part, original)


def test_different_images_are_all_sent(tmp_path: Path) -> None:
    """Samples whose images differ in one pixel, or that are not neighbours, keep their own copies."""
    config = rl_config(tmp_path, "worker.rollout.n=2")
    batch = rollout_batch(config)
    pixels = batch["pixel_values"].clone()
    counts = batch.image_counts
    first_of_second_sample = int(batch["image_grid_thw"][: int(counts[0])].prod(-1).sum())  # type: ignore[index]
    pixels[first_of_second_sample, 0] += 1e-3  # sample 1 (a copy of sample 0's image) now differs slightly
    changed = Batch({**batch.tensors, "pixel_values": pixels}, batch.meta, counts)
    arrived = pickle.loads(pickle.dumps(changed))
    assert_same(arrived, changed)
    assert changed._repeated_image_owners()[:2] == [0, 1]  # type: ignore[index]

    prompts = next(RLData(config).train_batches())  # one row per prompt: distinct images, nothing to share
    assert prompts._repeated_image_owners() is None
    assert_same(pickle.loads(pickle.dumps(prompts)), prompts)
    interleaved = prompts.select([0, 1, 0, 1])  # equal images that are not neighbours are sent twice
    assert interleaved._repeated_image_owners() is None


def test_text_only_batches_are_untouched(tmp_path: Path) -> None:
    config = rl_config(tmp_path, "model.path=tiny:qwen2", "data.image_key=null")
    batch = rollout_batch(config)
    assert batch.image_counts is None and batch._repeated_image_owners() is None
    arrived = pickle.loads(pickle.dumps(batch))
    assert arrived.__dict__.keys() == batch.__dict__.keys() and arrived.image_counts is None
    for key in batch.tensors:
        assert torch.equal(arrived[key], batch[key])


def test_out_of_band_read_only_buffers_and_bfloat16() -> None:
    """As Ray moves it: numpy buffers out of band and read-only on arrival; tensors come back writable, with
    their dtype (bfloat16 travels as int16), values and shapes, strided ones included."""
    source = torch.randn(64, 64)
    batch = Batch({"values": source.to(torch.bfloat16), "ids": torch.arange(64 * 64).view(64, 64),
                   "columns": source.t().contiguous().t(), "mask": torch.ones(64, 64, dtype=torch.bool)},
                  {"uids": [str(i) for i in range(64)]})
    buffers: list[pickle.PickleBuffer] = []
    wire = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    data = sum(t.numel() * t.element_size() for t in batch.tensors.values())
    assert len(buffers) == 4 and len(wire) < 2000 < data  # the data went out of band, not into the stream
    arrived = pickle.loads(wire, buffers=[memoryview(b).toreadonly() for b in buffers])
    for key, tensor in batch.tensors.items():
        assert arrived[key].dtype == tensor.dtype and torch.equal(arrived[key], tensor), key
    arrived["ids"].add_(1)  # writable: a copy, not the read-only transfer buffer
    assert torch.equal(arrived["ids"], batch["ids"] + 1)
    assert arrived.meta == batch.meta


def test_select_carries_each_samples_visuals_and_patch_rows() -> None:
    """``select`` against the per-sample reference: samples with zero, one or two visuals of different patch counts,
    in any order, repeated, or none at all."""
    g = torch.Generator().manual_seed(0)
    counts = [2, 0, 1, 3, 0, 1]
    grids = torch.tensor([[1, 2, 2], [1, 1, 3], [1, 2, 1], [2, 1, 2], [1, 1, 1], [1, 3, 1], [1, 2, 3]])
    rows = grids.prod(-1)
    pixels = torch.randn(int(rows.sum()), 5, generator=g)
    seconds = torch.arange(len(grids), dtype=torch.float32)
    batch = Batch({"input_ids": torch.arange(len(counts) * 3).reshape(len(counts), 3), "pixel_values": pixels,
                   "image_grid_thw": grids, "visual_seconds": seconds}, {"uid": list("abcdef")},
                  image_counts=torch.tensor(counts))
    visual_at = [sum(counts[:i]) for i in range(len(counts) + 1)]
    row_at = [int(rows[:j].sum()) for j in range(len(grids) + 1)]

    def reference(i: int) -> tuple[list[int], torch.Tensor]:
        visuals = list(range(visual_at[i], visual_at[i + 1]))
        return visuals, torch.cat([pixels[row_at[j]:row_at[j + 1]] for j in visuals] or [pixels[:0]])

    for indices in ([3, 0, 5], [1, 4], [], [2, 2, 0], list(range(len(counts)))[::-1]):
        out = batch.select(indices)
        visuals = [j for i in indices for j in reference(i)[0]]
        assert out.meta["uid"] == [batch.meta["uid"][i] for i in indices]
        assert torch.equal(out["input_ids"], batch["input_ids"][indices])
        assert out.image_counts.tolist() == [counts[i] for i in indices]
        assert torch.equal(out["image_grid_thw"], grids[visuals]) and torch.equal(out["visual_seconds"], seconds[visuals])
        assert torch.equal(out["pixel_values"], torch.cat([reference(i)[1] for i in indices] or [pixels[:0]]))

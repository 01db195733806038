"""A Batch holds, and in transit (pickled: every Ray call argument and result) carries, each prompt's images once.

A rollout batch repeats every prompt for its n samples; its patch rows are
stored once per distinct image with an index per image, so repeating,
selecting, splitting and joining samples share or keep stored rows instead of
copying them, and pickling sends what is held. Expanded (``batch["pixel_values"]``),
every operation gives what the per-sample layout (every sample's images back
to back) gives.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import ray.cloudpickle
import torch

from safetensors.torch import save_file

from easytrain.distributed.batch import Batch
from easytrain.trainer.ahead import FILE, Generated, load_generated, save_generated
from easytrain.trainer.data import RLData
from easytrain.trainer.rl import with_prompt_visuals
from easytrain.workers.sequences import assemble

from rl_batches import rl_config, rollout_batch


def assert_same(a: Batch, b: Batch) -> None:
    assert a.tensors.keys() == b.tensors.keys() and a.meta == b.meta and ("pixel_values" in a) == ("pixel_values" in b)
    for key in [*a.tensors, *(["pixel_values"] if "pixel_values" in a else [])]:
        assert torch.equal(a[key], b[key]), key
    assert torch.equal(a.image_counts, b.image_counts)  # type: ignore[arg-type]


def stored_bytes(batch: Batch) -> int:
    """Bytes of the storage behind the batch's patch rows (a view counts its whole storage)."""
    assert batch.pixels is not None
    return batch.pixels.blocks.untyped_storage().nbytes()


COUNTS = [2, 0, 1, 3]
GRIDS = torch.tensor([[1, 2, 2], [1, 1, 3], [1, 2, 1], [2, 1, 2], [1, 1, 1], [1, 3, 1]])


class PerSample:
    """Prompts with zero to three visuals of different patch counts, and the per-sample reference: each sample's
    grids, seconds and patch rows on their own, from which every expected batch is built."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        rows = GRIDS.prod(-1).tolist()
        visual_at = [sum(COUNTS[:i]) for i in range(len(COUNTS) + 1)]
        self.grids = [GRIDS[visual_at[i]:visual_at[i + 1]] for i in range(len(COUNTS))]
        self.seconds = [torch.arange(visual_at[i], visual_at[i + 1], dtype=torch.float32) for i in range(len(COUNTS))]
        self.rows = [torch.randn(sum(rows[visual_at[i]:visual_at[i + 1]]), 256, generator=g)
                     for i in range(len(COUNTS))]
        self.ids = torch.arange(len(COUNTS) * 3).reshape(len(COUNTS), 3)

    def batch(self, samples: list[int]) -> Batch:
        """The samples ``samples`` (by prompt) in today's per-sample layout: every sample's rows of its own."""
        def joined(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat([parts[i] for i in samples] + [parts[0][:0]])

        return Batch({"input_ids": self.ids[samples], "pixel_values": joined(self.rows),
                      "image_grid_thw": joined(self.grids), "visual_seconds": joined(self.seconds)},
                     {"uids": [f"p{i}" for i in samples]}, torch.tensor([COUNTS[i] for i in samples], dtype=torch.long))


@pytest.fixture
def prompts() -> PerSample:
    return PerSample()


def repeated(prompts: PerSample, n: int) -> tuple[Batch, list[int]]:
    """The prompts' batch repeated n times (as a rollout batch holds them) and the prompt of each sample."""
    samples = [i for i in range(len(COUNTS)) for _ in range(n)]
    return prompts.batch(list(range(len(COUNTS)))).repeat_interleave(n), samples


def test_a_prompt_repeated_n_times_holds_its_pixels_once(prompts: PerSample) -> None:
    once = prompts.batch(list(range(len(COUNTS))))
    batch, samples = once.repeat_interleave(16), [i for i in range(len(COUNTS)) for _ in range(16)]
    assert stored_bytes(batch) == stored_bytes(once) == sum(r.numel() * r.element_size() for r in prompts.rows)
    assert batch.pixels.blocks is once.pixels.blocks  # type: ignore[union-attr]  # shared, not copied
    assert_same(batch, prompts.batch(samples))


def test_a_rollout_batch_holds_each_prompts_pixels_once(tmp_path: Path) -> None:
    data = RLData(rl_config(tmp_path))
    prompts = next(data.train_batches())
    generated = Batch({"responses": torch.ones(8 * len(prompts), 3, dtype=torch.long),
                       "response_mask": torch.ones(8 * len(prompts), 3, dtype=torch.long)})
    batch = assemble(prompts, generated, 8, data.family)
    pixels = prompts["pixel_values"]
    assert stored_bytes(batch) == pixels.numel() * pixels.element_size()
    grids = prompts["image_grid_thw"].prod(-1).tolist()
    starts = [sum(grids[:j]) for j in range(len(grids) + 1)]
    visual_at = [0] + torch.cumsum(prompts.image_counts, 0).tolist()  # type: ignore[arg-type]
    per_prompt = [pixels[starts[visual_at[i]]:starts[visual_at[i + 1]]] for i in range(len(prompts))]
    assert torch.equal(batch["pixel_values"], torch.cat([per_prompt[i] for i in range(len(prompts)) for _ in range(8)]))
    assert_same(pickle.loads(pickle.dumps(batch)), batch)


def test_a_generated_batch_comes_back_without_pixels_and_the_driver_puts_its_prompts_back(tmp_path: Path) -> None:
    """The rollout worker returns the responses without the prompts' visuals; the driver's re-joined batch equals
    the assembled one and shares the prompts' stored rows (no second copy)."""
    data = RLData(rl_config(tmp_path))
    prompts = next(data.train_batches())
    generated = Batch({"responses": torch.ones(3 * len(prompts), 2, dtype=torch.long),
                       "response_mask": torch.ones(3 * len(prompts), 2, dtype=torch.long)})
    full = assemble(prompts, generated, 3, data.family)
    sent = pickle.loads(pickle.dumps(full.without_visuals()))
    assert sent.pixels is None and sent.image_counts is None and "image_grid_thw" not in sent
    joined = with_prompt_visuals(sent, prompts, 3)
    assert_same(joined, full)
    assert joined.pixels.blocks is prompts.pixels.blocks  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="visuals of 4 samples cannot join a batch of 12"):
        sent.with_visuals_of(prompts)
    assert with_prompt_visuals(full, prompts, 3) is full  # a multi-turn batch brings its own visuals


@pytest.mark.parametrize("indices", [[3, 0, 5], [1, 4], [], [2, 2, 0, 2], [5, 4, 3, 2, 1, 0], [7, 6, 7, 0]])
def test_select_equals_the_per_sample_layout(prompts: PerSample, indices: list[int]) -> None:
    batch, samples = repeated(prompts, 2)
    assert_same(batch.select(indices), prompts.batch([samples[i] for i in indices]))


def test_split_and_concat_equal_the_per_sample_layout(prompts: PerSample) -> None:
    batch, samples = repeated(prompts, 4)
    parts = batch.split(3)
    bounds = [len(samples) * p // 3 for p in range(4)]
    for p, part in enumerate(parts):
        assert_same(part, prompts.batch(samples[bounds[p]:bounds[p + 1]]))
    assert_same(Batch.concat(parts), prompts.batch(samples))
    other = prompts.batch([1, 3, 3])
    assert_same(Batch.concat([parts[2], other, parts[0]]),
                prompts.batch(samples[bounds[2]:] + [1, 3, 3] + samples[:bounds[1]]))


def test_a_ranks_share_carries_only_its_samples_images(prompts: PerSample) -> None:
    batch, samples = repeated(prompts, 4)
    for p, part in enumerate(batch.split(len(COUNTS))):  # one prompt's samples per rank
        own = prompts.rows[p].numel() * prompts.rows[p].element_size()
        arrived = pickle.loads(pickle.dumps(part))
        assert stored_bytes(arrived) == own
        assert_same(arrived, prompts.batch(samples[4 * p:4 * p + 4]))
    mixed = batch.select([12, 0, 13])  # prompts 3 and 0, not neighbours: a copy of their rows only
    assert stored_bytes(mixed) == sum(prompts.rows[i].numel() * prompts.rows[i].element_size() for i in (0, 3))
    assert_same(mixed, prompts.batch([3, 0, 3]))


def test_pickling_sends_what_is_held_and_compares_nothing(prompts: PerSample,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    batch, samples = repeated(prompts, 16)
    equal_calls = []
    real_equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda *a: equal_calls.append(1) or real_equal(*a))
    arrivals = []
    for dumps, loads in ((pickle.dumps, pickle.loads), (ray.cloudpickle.dumps, ray.cloudpickle.loads)):
        wire = dumps(batch)
        assert len(wire) < stored_bytes(batch) + 8000  # one copy of the rows, not sixteen
        arrivals.append(loads(wire))
    buffers: list[pickle.PickleBuffer] = []
    wire = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    arrivals.append(pickle.loads(wire, buffers=[memoryview(b).toreadonly() for b in buffers]))
    assert not equal_calls
    monkeypatch.undo()
    for arrived in arrivals:
        assert stored_bytes(arrived) == stored_bytes(batch)  # still compact on arrival
        assert_same(arrived, prompts.batch(samples))
        assert_same(arrived.split(3)[1], batch.split(3)[1])


def test_equal_pixels_in_different_blocks_compare_equal(prompts: PerSample) -> None:
    """What prompt grouping asks: samples that share blocks are equal at once; blocks stored apart are compared."""
    one = prompts.batch([0, 2])
    joined = Batch.concat([one, one, prompts.batch([2])])  # equal rows, stored apart
    assert joined.same_pixels(0, 2) and joined.same_pixels(1, 3) and joined.same_pixels(1, 4)
    assert not joined.same_pixels(0, 1)
    changed = prompts.batch([0])
    changed.pixels.blocks[0, 0] += 1e-3  # type: ignore[union-attr]
    assert not Batch.concat([one, changed]).same_pixels(0, 2)


def test_pixel_keys_differ_exactly_where_the_pixels_do(prompts: PerSample) -> None:
    """Prompt grouping compares pixels only between samples whose keys agree: equal rows (shared or stored apart,
    -0.0 beside 0.0) must give equal keys, and here every pair of unequal rows gives unequal ones."""
    one = prompts.batch([0, 2, 3])
    negative = prompts.batch([2])
    negative.pixels.blocks[0, 0] = -0.0  # type: ignore[union-attr]
    positive = prompts.batch([2])
    positive.pixels.blocks[0, 0] = 0.0  # type: ignore[union-attr]
    changed = prompts.batch([0])
    changed.pixels.blocks[0, 0] += 1e-3  # type: ignore[union-attr]
    joined = Batch.concat([one, one.repeat_interleave(2), prompts.batch([1]), negative, positive, changed])
    keys = joined.pixel_keys()
    assert len(keys) == len(joined)
    for a in range(len(joined)):
        for b in range(len(joined)):
            assert (keys[a] == keys[b]) == joined.same_pixels(a, b), (a, b)


def test_equal_rows_on_a_transposed_grid_are_not_one_prompt() -> None:
    """Two images of one colour, 28x56 and 56x28 px: the same tokens and patch rows, other rotary positions, so
    they are two prompts (a shared row would give the second the first's grid); on equal grids, one."""
    from easytrain.workers.shared_prompt import prompt_groups

    def batch(grids: list[list[int]]) -> Batch:
        rows = torch.ones(8, 12)
        return Batch({"input_ids": torch.tensor([[5, 6, 7, 9]] * 2),
                      "attention_mask": torch.ones(2, 4, dtype=torch.long),
                      "responses": torch.tensor([[9], [9]]), "pixel_values": torch.cat([rows, rows]),
                      "image_grid_thw": torch.tensor(grids)}, image_counts=torch.tensor([1, 1]))

    transposed = batch([[1, 2, 4], [1, 4, 2]])
    assert transposed.same_pixels(0, 1)  # the rows alone cannot tell them apart
    assert prompt_groups(transposed) == [[0], [1]]
    assert prompt_groups(batch([[1, 2, 4], [1, 2, 4]])) == [[0, 1]]


def test_a_batch_built_from_anothers_tensors_without_its_pixels_is_refused(prompts: PerSample) -> None:
    batch = prompts.batch([0, 3])
    assert "pixel_values" in batch and "pixel_values" not in batch.tensors
    with pytest.raises(ValueError, match="pixels=batch.pixels"):
        Batch({**batch.tensors, "targets": batch["input_ids"]}, batch.meta, batch.image_counts)
    kept = batch.union(Batch({"targets": batch["input_ids"]}))
    assert torch.equal(kept["pixel_values"], batch["pixel_values"])
    assert torch.equal(batch.expanded_tensors()["pixel_values"], torch.cat([prompts.rows[0], prompts.rows[3]]))


def test_a_saved_generated_batch_loads_as_it_was_held(prompts: PerSample, tmp_path: Path) -> None:
    """trainer/ahead.py's save for an exact resume keeps the stored rows once (a rank's view of them too); a save
    from before (every sample's rows) loads as well."""
    batch, samples = repeated(prompts, 4)
    part = batch.split(2)[1]  # a view into the stored rows
    scores = {"overall": torch.arange(len(part), dtype=torch.float32)}
    state = save_generated(Generated(part, scores, 3), tmp_path)
    loaded = load_generated(json.loads(json.dumps(state)), tmp_path)
    assert stored_bytes(loaded.batch) == stored_bytes(pickle.loads(pickle.dumps(part)))  # its own rows, once
    assert_same(loaded.batch, prompts.batch(samples[8:]))
    assert loaded.version == 3 and torch.equal(loaded.scores["overall"], scores["overall"])
    old = {f"batch/{k}": v for k, v in part.expanded_tensors().items()}
    old.update({"image_counts": part.image_counts, "scores/overall": scores["overall"]})  # type: ignore[dict-item]
    save_file(old, str(tmp_path / FILE))
    assert_same(load_generated(state, tmp_path).batch, part)


def test_text_only_batches_are_untouched(tmp_path: Path) -> None:
    config = rl_config(tmp_path, "model.path=tiny:qwen2", "data.image_key=null")
    batch = rollout_batch(config)
    assert batch.image_counts is None and batch.pixels is None and "pixel_values" not in batch
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


@pytest.mark.parametrize("packed", [False, True])
def test_a_members_micro_batches_carry_each_prompts_pixels_once_and_read_as_planned(prompts: PerSample,
                                                                                    packed: bool) -> None:
    from easytrain.trainer.micro_batches import Forward, micro_batch, micro_batches

    batch, samples = repeated(prompts, 4)
    forward = Forward(packed=packed, budget=0, update_size=1, share_prompt=False)
    plan = [[[0], [1], [2], [3], [12, 13]], [[15, 14, 4], [5, 16]]]  # micro batches of one sample and reordered
    sent = micro_batches(batch, plan, forward)
    for member, cut in zip(plan, sent):
        prompts_used = sorted({samples[i % len(samples)] for micro in member for i in micro})
        own = sum(prompts.rows[p].numel() * prompts.rows[p].element_size() for p in prompts_used)
        wire = pickle.dumps(cut)
        assert len(wire) < own + 8000  # each prompt's rows once, not once per micro batch showing it
        arrived = pickle.loads(wire)
        assert len(arrived) == len(member)
        for micro, got in zip(member, arrived):
            want = micro_batch(batch, micro, forward)
            assert got.packed == want.packed == packed and got.prompt_groups == want.prompt_groups
            assert_same(got.batch, want.batch)
            assert_same(got.batch, prompts.batch([samples[i % len(samples)] for i in micro]))
    with pytest.raises(IndexError):
        sent[1][2]

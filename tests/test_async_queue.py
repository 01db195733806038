"""``trainer.rollout_mode=async``, the driver's side: groups of different widths join in the assembled layout,
the queue counts its host bytes as they are stored (each prompt's pixels once), and a bound small enough to
bind pauses generation instead of letting the queue grow past it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from easytrain.config import ConfigError, load
from easytrain.distributed.batch import Batch
from easytrain.trainer.asynchronous import ID, AsyncRollouts, SampleQueue, group_bound, host_bytes
from easytrain.trainer.metrics import PhaseTimer
from easytrain.workers.sequences import assemble, join_assembled

N = 2
"""Responses per prompt."""
PATCH = 12
"""Values per patch row of the made-up images."""


def prompts(widths: list[int], first_uid: int = 0, images: bool = True) -> Batch:
    """Left-padded prompts of ``widths`` tokens (token k of prompt p is 100 * (p + 1) + k), padded to the widest;
    with ``images`` each prompt shows one image of 4 * (p + 1) patch rows."""
    width = max(widths)
    ids = torch.zeros(len(widths), width, dtype=torch.long)
    mask = torch.zeros(len(widths), width, dtype=torch.long)
    for p, w in enumerate(widths):
        ids[p, width - w:] = 100 * (p + 1) + torch.arange(w)
        mask[p, width - w:] = 1
    meta = {"uids": [f"u{first_uid + p}" for p in range(len(widths))], "answers": ["a"] * len(widths)}
    if not images:
        return Batch({"input_ids": ids, "attention_mask": mask}, meta)
    grids = torch.tensor([[1, 2, 2 * (p + 1)] for p in range(len(widths))])
    pixels = torch.randn(int(grids.prod(-1).sum()), PATCH)
    return Batch({"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "image_grid_thw": grids}, meta,
                 torch.ones(len(widths), dtype=torch.long))


def responses(lengths: list[int], version: int, turns: bool = False) -> Batch:
    """Right-padded responses of ``lengths`` tokens (token k of row r is 1000 * (r + 1) + k); ``turns``: with a
    multi-turn rollout's tensors too (the attention mask over tool turns, tool calls and errors per row)."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width)
    versions = torch.full((len(lengths), width), -1, dtype=torch.long)
    for r, k in enumerate(lengths):
        ids[r, :k] = 1000 * (r + 1) + torch.arange(k)
        mask[r, :k] = 1
        versions[r, :k] = version
    tensors = {"responses": ids, "response_mask": mask, "rollout_log_probs": -mask, "token_versions": versions}
    if turns:
        tensors.update(response_attention_mask=mask.clone(), tool_calls=torch.ones(len(lengths)),
                       tool_errors=torch.zeros(len(lengths)))
    return Batch(tensors)


def test_groups_of_different_widths_join_with_prompts_left_and_responses_right() -> None:
    a = assemble(prompts([3, 5]).select([0]), responses([2, 4], 0), N)  # prompt width 5, responses 4
    b = assemble(prompts([7]), responses([6, 1], 1), N)  # prompt width 7, responses 6
    joined = join_assembled([a, b])
    assert joined["input_ids"].shape == (4, 7 + 6) and joined["responses"].shape == (4, 6)
    for row, (source, r) in enumerate([(a, 0), (a, 1), (b, 0), (b, 1)]):
        p = source["input_ids"].shape[1] - source["responses"].shape[1]
        present = source["attention_mask"][r].bool()
        prompt_tokens = source["input_ids"][r, :p][present[:p]]
        response_tokens = source["responses"][r][source["response_mask"][r].bool()]
        # the prompt ends where every response starts (column 7); the response goes on from there
        assert joined["input_ids"][row, 7 - len(prompt_tokens):7].tolist() == prompt_tokens.tolist()
        assert joined["input_ids"][row, 7:7 + len(response_tokens)].tolist() == response_tokens.tolist()
        assert joined["attention_mask"][row].sum() == len(prompt_tokens) + len(response_tokens)
        assert int(joined["prompt_length"][row]) == 7
    versions = joined["token_versions"]
    assert versions[joined["response_mask"].bool()].tolist() == [0] * 6 + [1] * 7
    assert (versions[~joined["response_mask"].bool()] == -1).all()
    assert joined.image_counts.tolist() == [1, 1, 1, 1]  # type: ignore[union-attr]


@pytest.mark.parametrize("turns", [False, True])
def test_the_queue_counts_each_prompts_pixels_once_and_a_group_stays_within_its_bound(turns: bool) -> None:
    batch = prompts([4, 6, 5])
    queue = SampleQueue(bound=10**9)
    expected = 0
    for p in range(len(batch)):
        row = batch.select([p])
        group = assemble(row, responses([3, 8], 0, turns), N)
        scores = {"overall": torch.tensor([1.0, 0.0]), "accuracy": torch.tensor([1.0, 0.0])}
        queue.put(group, scores)
        patch_rows = 4 * (p + 1)
        own = (sum(v.nbytes for v in group.tensors.values()) + group.image_counts.nbytes  # type: ignore[union-attr]
               + patch_rows * PATCH * 4 + 3 * 8 + 8 * 2)  # one image's rows (float32), its size, index per sample
        assert queue.groups[-1].bytes == own + 2 * 2 * 4
        assert queue.groups[-1].bytes <= group_bound(row, N, max_response=8)
        expected += own + 2 * 2 * 4
    assert queue.bytes == expected == queue.peak
    taken = queue.take(2)
    assert queue.bytes == expected - sum(q.bytes for q in taken)


def test_host_bytes_counts_a_shared_storage_once() -> None:
    x = torch.zeros(1000)
    assert host_bytes(Batch({"a": x[:10], "b": x[500:]})) == 4000  # two views of one storage: the storage, once


class FakeRollout:
    """A rollout pool of one engine whose every prompt takes two calls: a call finishes the prompts the call
    before it started (responses of ``length``) and starts its own."""

    members = 1

    def __init__(self, length: int) -> None:
        self.length, self.waiting = length, Batch()

    def submit(self, method: str, shares: list[Batch], step: int, call: int, tokens: int, version: int,
               finish_before: int) -> Any:
        finishing, self.waiting = self.waiting, shares[0]
        groups = [assemble(finishing.select([p]), responses([self.length] * N, version), N).without_visuals()
                  for p in range(len(finishing))]
        return [{"groups": groups, "finished_at": time.time()}]

    def collect(self, pending: Any) -> Any:
        return pending


def loader(batch_size: int) -> Any:
    k = 0
    while True:
        yield prompts([5] * batch_size, first_uid=k)
        k += batch_size


def test_a_bound_that_binds_pauses_generation_and_the_queue_stays_under_it() -> None:
    target, length = 2, 6
    one_group = group_bound(prompts([5]), N, length)
    bound = 3 * one_group  # a step's batch (2 groups) and one more: a batch waits while another runs
    rollout = FakeRollout(length)
    pipeline = AsyncRollouts(rollout, N, target, length, call_tokens=length, max_staleness=3,  # type: ignore[arg-type]
                             bound_bytes=bound)  # two step batches may be ahead: the bound binds first
    batches = loader(target)
    score = lambda b: {"overall": torch.ones(len(b))}  # noqa: E731
    seen, uids = [], []
    for step in range(1, 6):
        batch, scores, metrics = pipeline.next_batch(batches, step, step - 1, score, PhaseTimer())
        assert len(batch) == target * N and len(scores["overall"]) == target * N
        seen += batch.meta[ID][::N]
        uids += batch.meta["uids"][::N]
        assert pipeline.queue.peak <= bound
        assert pipeline.reserved() <= bound
    assert seen == list(range(len(seen)))  # every prompt trains once, in the order it started
    assert pipeline.pauses > 0  # calls started no new prompts: generation paused at the bound
    assert uids == [f"u{k}" for k in range(len(uids))]  # a batch that had to wait for room was not skipped


@pytest.mark.parametrize("overrides,key", [
    (["trainer.rollout_mode=async"], "trainer.rollout_mode"),  # colocated roles share the devices
    (["trainer.rollout_mode=async", "trainer.colocate=false", "algorithm.max_staleness=0"],
     "algorithm.max_staleness"),
    (["trainer.rollout_mode=async", "trainer.colocate=false", "trainer.async_queue_gb=0"],
     "trainer.async_queue_gb"),
    (["trainer.rollout_mode=async", "trainer.colocate=false", "worker.rollout.multi_turn.enable=true",
      "worker.rollout.engine=vllm", "model.dtype=float32", "data.image_key=null"], "trainer.rollout_mode"),
    (["trainer.rollout_mode=async", "trainer.colocate=false", "worker.rollout.engine=vllm", "model.dtype=float32"],
     "trainer.rollout_mode"),
])
def test_async_combinations_it_cannot_run_are_config_errors(tmp_path: Path, overrides: list[str],
                                                            key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load([f"trainer.output_dir={tmp_path}", *overrides])
    assert str(err.value).startswith(key)


def test_the_watchdogs_soft_level_lowers_the_queues_bound_first() -> None:
    """MemoryGuard.relieve on a guard holding the queue (and no other actions): host RAM pressure halves the
    bound and records it in memory.jsonl's events; GPU memory pressure leaves it."""
    from types import SimpleNamespace

    from easytrain.trainer.relief import MemoryGuard

    events: list[dict[str, Any]] = []
    guard = SimpleNamespace(queue=SampleQueue(bound=1000), config=SimpleNamespace(watchdog=SimpleNamespace(actions=[])),
                            watchdog=SimpleNamespace(event=lambda step, kind, message, **extra: events.append(extra)))
    MemoryGuard.relieve(guard, 1, {"vram"})  # type: ignore[arg-type]
    assert guard.queue.bound == 1000 and not events
    MemoryGuard.relieve(guard, 2, {"ram"})  # type: ignore[arg-type]
    assert guard.queue.bound == 500
    assert [e["action"] for e in events] == ["shrink_async_queue"] and events[0]["planned_bytes"] == 500
    floored = SampleQueue(bound=1000, floor=800)  # two step batches: the run could not go on below
    floored.shrink()
    assert floored.bound == 800


def test_the_plan_counts_a_set_queue_bound_in_every_phase_and_states_the_default_room(tmp_path: Path) -> None:
    from easytrain.memory.planner import plan

    base = [f"trainer.output_dir={tmp_path}", "trainer.rollout_mode=async", "trainer.colocate=false"]
    room, bound = plan(load(base)), plan(load([*base, "trainer.async_queue_gb=2"]))
    assert [b.host - r.host for b, r in zip(bound.rows, room.rows)] == [2 * 10**9] * len(room.rows)
    assert any(n.startswith("async queue: up to 2.00 GB") for n in bound.notes)
    assert any(n.startswith(f"async queue: up to {room.host_room / 1e9:.2f} GB") for n in room.notes)
    c = room.capacity
    assert room.host_room == int(c.host_limit - room.host_peak * (1 + c.host_margin)) > 0


def test_a_bound_below_a_steps_batch_is_a_config_error_naming_the_size() -> None:
    length = 6
    first = prompts([5, 5])  # the loader's first batch
    batch = sum(group_bound(first.select([i]), N, length) for i in range(len(first)))
    pipeline = AsyncRollouts(FakeRollout(length), N, 2, length, call_tokens=length, max_staleness=2,  # type: ignore[arg-type]
                             bound_bytes=batch - 1)
    with pytest.raises(ConfigError) as err:
        pipeline.next_batch(loader(2), 1, 0, lambda b: {"overall": torch.ones(len(b))}, PhaseTimer())
    assert str(err.value).startswith("trainer.async_queue_gb=") and f"{2 * batch / 1e9:.3g}" in str(err.value)


def test_groups_with_and_without_visuals_join() -> None:
    """Text prompts whose multi-turn tools returned images in one group and none in another: joined in either
    order, each sample keeps its own visuals (none: a count of 0), where Batch.concat once took the first group's
    layout (a KeyError, or the other group's images dropped)."""
    with_images = assemble(prompts([3]), responses([2, 4], 0), N)
    without = assemble(prompts([5], images=False), responses([3, 1], 0), N)
    for order in ([with_images, without], [without, with_images]):
        joined = join_assembled(order)
        assert joined.image_counts is not None and joined.pixels is not None
        for k, part in enumerate(order):
            rows = joined.select(range(k * N, (k + 1) * N))
            own = part.image_counts if part.image_counts is not None else torch.zeros(N, dtype=torch.long)
            assert rows.image_counts.tolist() == own.tolist()  # type: ignore[union-attr]
            if part.pixels is not None:
                assert torch.equal(rows["pixel_values"], part["pixel_values"])
                assert torch.equal(rows["image_grid_thw"], part["image_grid_thw"])
            else:
                assert rows["image_grid_thw"].shape == (0, 3) and rows["pixel_values"].shape[0] == 0

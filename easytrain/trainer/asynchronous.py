"""``trainer.rollout_mode=async``: partial rollouts and a queue of finished samples bounded by host memory.

The rollout pool generates in calls of ``trainer.async_call_tokens`` tokens per response
(:meth:`RolloutWorker.advance <easytrain.workers.rollout.worker.RolloutWorker.advance>`); a call runs while
the actor trains, and the weight sync that ends the step waits for it (a Ray actor runs one call at a time),
so responses unfinished then go on under the new weights in the next call, each token keeping the version
and the log-prob of the weights that sampled it (:mod:`easytrain.workers.rollout.partial`). A call returns
the groups (a prompt's ``n`` responses) it finished; they are scored and wait in a :class:`SampleQueue`
until a step takes ``data.rollout_batch_size`` of them, oldest first.

The queue is bounded by host bytes (``trainer.async_queue_gb``): its groups' tensors and each prompt's
pixels once, as they are stored. A call starts new prompts only when the queue, the groups still running
(each counted at its largest possible size, :func:`group_bound`) and the new ones fit under the bound; when
they do not and nothing is running, the engine has no call: generation pauses (``rollout/queue_full_s``)
instead of the queue growing. The watchdog's soft level halves the bound (:meth:`SampleQueue.shrink`).

Staleness: a step that trains with the actor at version ``v`` (the updates applied) trains tokens sampled at
versions ``v - 1`` and older (the last step's call ran under the weights of the sync before it).
``rollout/staleness`` is ``v`` minus a token's version, mean and max over the step's tokens. A batch whose
first tokens would be more than ``algorithm.max_staleness`` versions old when trained is generated to its end
in one call instead of in parts (a multi-turn episode through its tool turns); a group that waited in the queue past it is dropped
(``rollout/stale_dropped``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch

from easytrain.config.errors import ConfigError
from easytrain.config.schema import Config
from safetensors.torch import load_file, save_file

from easytrain.distributed.batch import Batch, Pixels
from easytrain.distributed.group import Pending, WorkerGroup
from easytrain.trainer.ahead import pack, unpack
from easytrain.workers.sequences import join_assembled

logger = logging.getLogger(__name__)

GB = 1e9
RESPONSE_BYTES_PER_TOKEN = 8 + 4 + 4 + 4 + 8
"""A response column of an assembled sample: its token id (int64), mask, multi-turn attention mask and sampling
log-prob (float32) and weight version (int64)."""
SPANNING_BYTES_PER_TOKEN = 8 + 8 + 8 + 3 * 8
"""A column that spans prompt and response: token id, attention mask, token type (int64 each) and up to three
rows of position ids (multimodal rotary; int64)."""
FILE = "rollout_async.safetensors"
"""The queue, the started batches and the unread one in a checkpoint folder (their lists are in the trainer
state)."""
ID = "async_ids"
"""The meta list numbering the prompts in the order they started."""
CALLS_AHEAD = 2
"""Calls a step starts to run while it trains: the second goes on with the responses the first left unfinished
(and starts new prompts where :attr:`AsyncRollouts.ahead` allows); the weight sync waits for both. At 37c6d23
and 035f190 every call could start a batch while two were queued and running: the queue stayed a batch ahead and
bench/results/async_rollout.json's async runs trained every token two versions old, at no gain in step time."""
SCORE_BYTES = 64 + 8
"""The reward table of a sample (a few float32 columns) and its scalars, at most, and a multi-turn sample's tool
calls and errors (float32)."""


def host_bytes(*batches: Batch) -> int:
    """Host bytes ``batches`` hold, counted by storage: a storage two tensors share (a prompt's pixels shown by
    its n samples, a view into a larger batch) counts once and whole."""
    seen: dict[int, int] = {}
    for batch in batches:
        tensors = list(batch.tensors.values())
        if batch.image_counts is not None:
            tensors.append(batch.image_counts)
        if batch.pixels is not None:
            tensors += list(vars(batch.pixels).values())
        for t in tensors:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def group_bound(prompt: Batch, n: int, max_response: int, tool_bytes: int = 0) -> int:
    """The most host bytes the assembled group of one prompt row can hold: ``n`` samples of its prompt width
    plus ``max_response`` tokens, its scores, its images' (or videos') patch rows once (counted from their
    sizes, so the figure does not depend on which batch's storage the row still shares) with each sample's
    copy of their grids and seconds, and ``tool_bytes`` per sample for the images multi-turn tools may return
    (:func:`tool_image_bytes`)."""
    width = prompt["input_ids"].shape[1]
    per_sample = (width + max_response) * SPANNING_BYTES_PER_TOKEN + max_response * RESPONSE_BYTES_PER_TOKEN
    visuals = 0
    if prompt.pixels is not None:
        p = prompt.pixels
        shown = torch.unique(p.index)
        row_bytes = p.blocks[:1].nbytes if len(p.blocks) else 0
        visuals = int(p.sizes[shown].sum()) * row_bytes + (len(shown) + n * len(p.index)) * 8 * 2  # sizes, index
        per_visual = sum(prompt.tensors[k].nbytes for k in ("image_grid_thw", "visual_seconds") if k in prompt)
        visuals += n * (per_visual + 8)  # each sample's grids, seconds and count
    return n * (per_sample + SCORE_BYTES + tool_bytes) + 8 + visuals


def tool_image_bytes(config: Config) -> int:
    """The most host bytes the images multi-turn tools return take in one sample: their vision tokens are
    response tokens, so at most data.max_response_length of them (and at most multi_turn.max_tool_images
    images at data.max_pixels), each behind its patches' fp32 values (:class:`VisionGeometry
    <easytrain.memory.vision.VisionGeometry>`), and each image's grid, seconds, size and index entries."""
    from easytrain.memory.vision import vision_geometry
    from easytrain.models.shapes import hf_config_for

    turns, d = config.worker.rollout.multi_turn, config.data
    if not (turns.enable and turns.max_tool_images):
        return 0
    hf_config = hf_config_for(config.model)
    geometry = vision_geometry(hf_config) if hf_config is not None else None
    if geometry is None:
        return 0  # a text model: a tool's image becomes an error turn
    tokens = min(d.max_response_length, turns.max_tool_images * geometry.image_tokens(d.max_pixels))
    return tokens * geometry.values_per_token * 4 + turns.max_tool_images * (3 * 8 + 4 + 2 * 8)


def owned(group: Batch) -> Batch:
    """``group`` with its own copy of the pixel blocks it shows (not a view into its loader batch's), so the
    queue holds exactly what it counts and the loader batch can go."""
    if group.pixels is None:
        return group
    p = group.pixels
    return Batch(group.tensors, group.meta, group.image_counts, Pixels(p.blocks.clone(), p.sizes, p.index))


@dataclass
class Queued:
    group: Batch
    scores: dict[str, torch.Tensor]
    bytes: int


@dataclass
class SampleQueue:
    """Finished, scored groups waiting to train, oldest first, their host bytes counted against a bound."""

    bound: int
    floor: int = 0
    """The least bound the queue can run with: two step batches at their largest (:meth:`AsyncRollouts.start`)."""
    groups: deque[Queued] = field(default_factory=deque)
    bytes: int = 0
    peak: int = 0

    def put(self, group: Batch, scores: dict[str, torch.Tensor]) -> None:
        group = owned(group)
        size = host_bytes(group) + sum(v.nbytes for v in scores.values())
        self.groups.append(Queued(group, scores, size))
        self.bytes += size
        self.peak = max(self.peak, self.bytes)

    def take(self, count: int) -> list[Queued]:
        out = [self.groups.popleft() for _ in range(min(count, len(self.groups)))]
        self.bytes -= sum(q.bytes for q in out)
        return out

    def shrink(self, factor: float = 0.5) -> None:
        """Lower the bound (the watchdog's soft level): new prompts wait until the queue drains below it. Never
        below :attr:`floor`, two step batches, which a run needs to go on."""
        self.bound = max(self.floor, int(self.bound * factor))
        logger.warning("memory pressure: the async queue's bound is now %.3f GB", self.bound / GB)


def oldest(group: Batch) -> int:
    """The weight version of a group's oldest token."""
    versions = group["token_versions"]
    return int(versions[versions >= 0].min())


class AsyncRollouts:
    """The driver's side of partial rollouts: which prompts are running, the calls in flight, the queue."""

    def __init__(self, rollout: WorkerGroup, n: int, target: int, max_response: int, call_tokens: int,
                 max_staleness: int, bound_bytes: int, tool_bytes: int = 0) -> None:
        self.rollout, self.n, self.target, self.tool_bytes = rollout, n, target, tool_bytes
        self.max_response, self.call_tokens, self.max_staleness = max_response, call_tokens, max_staleness
        self.ahead = max(1, max_staleness - 1)
        """Step batches that may be queued and running as a step trains: a batch started then trains after those
        before it, one more version old each (a batch started as step t trains trains at t + 1, 1 version old)."""
        self.queue = SampleQueue(bound_bytes)
        self.running: dict[Any, tuple[Batch, int]] = {}
        """Prompts started and not finished, by :data:`ID`: the prompt row and its group's bound in bytes."""
        self.unread: Optional[Batch] = None
        """A loader batch read but not started (it did not fit): the next call that has room starts it."""
        self.pending: list[Pending] = []
        self.paused = False
        """The last call started no new prompts for want of room: the engine idles from its end to the next."""
        self.idle_from = 0.0
        """When the engine's last collected call ended (time.time(), the workers' clock)."""
        self.paused_s = 0.0
        self.pauses = 0
        """Calls that started no new prompts for want of room."""
        self.pauses_logged = 0
        self.calls = 0
        self.in_step: list[Queued] = []
        """The groups the running step took: back to the queue's front if the step is abandoned (:meth:`save`)."""
        self.started = 0
        """Prompts started so far: each gets the next number (:data:`ID`; a uid repeats from epoch to epoch)."""

    def bound_of(self, prompt: Batch) -> int:
        """The most host bytes the group of ``prompt`` (one row) can take in the queue (:func:`group_bound`)."""
        return group_bound(prompt, self.n, self.max_response, self.tool_bytes)

    def reserved(self) -> int:
        """The queue's bytes and the running groups' bounds."""
        return self.queue.bytes + sum(b for _, b in self.running.values())

    def start(self, prompts: Iterator[Batch]) -> Batch:
        """The prompts the next call starts: the next loader batch when its groups fit under the bound beside the
        queue and the running ones, and fewer than :attr:`ahead` step batches are queued and running (more
        would train older than algorithm.max_staleness allows). A step cannot train on less than a batch: a bound that cannot hold the batch a step
        still needs is a :class:`ConfigError` naming the size it takes."""
        if len(self.queue.groups) + len(self.running) >= self.ahead * self.target:
            self.held_back()
            return Batch()
        candidate = self.unread if self.unread is not None else next(prompts)
        bounds = [self.bound_of(candidate.select([i])) for i in range(len(candidate))]
        short = len(self.queue.groups) + len(self.running) < self.target
        if self.reserved() + sum(bounds) > self.queue.bound and not short:
            self.unread = candidate
            self.held_back()
            return Batch()
        if self.reserved() + sum(bounds) > self.queue.bound:  # a step could never fill its batch
            raise ConfigError("trainer.async_queue_gb", round(self.queue.bound / GB, 6),
                              f"the queue cannot hold a step's batch beside what it holds: this batch's groups "
                              f"may take {sum(bounds) / GB:.3g} GB (each prompt's images once and n responses of "
                              f"data.max_response_length tokens), and {self.reserved() / GB:.3g} GB are queued "
                              "or running", f"set it to at least {2 * sum(bounds) / GB:.3g} (two batches: one "
                              "trains while the next fills), or -1 for the plan's room")
        self.queue.floor = max(self.queue.floor, min(self.queue.bound, 2 * sum(bounds)))
        self.unread = None
        candidate.meta[ID] = [self.started + i for i in range(len(candidate))]
        self.started += len(candidate)
        for i, key in enumerate(candidate.meta[ID]):
            self.running[key] = (candidate.select([i]), bounds[i])
        return candidate

    def held_back(self) -> None:
        """No new prompts start: the queue is full (its bound, or two step batches queued and running). The engine
        runs the responses it has, then idles until a call starts: ``rollout/queue_full_s``."""
        self.paused = True
        self.pauses += 1

    def submit(self, prompts: Iterator[Batch], step: int, version: int, admit: bool = True) -> bool:
        """Start a call with the engine's weights at ``version``, with new prompts when ``admit`` and there is
        room; False when there is nothing to run (none new and none running)."""
        if self.paused and not self.pending:  # the engine idled from its last call's end: the queue was full
            self.paused_s += max(0.0, time.time() - self.idle_from)
        self.paused = False
        new = self.start(prompts) if admit else Batch()
        if not len(new) and not self.running:
            return False
        members = self.rollout.members
        shares = new.split(members) if len(new) else [new] * members
        finish_before = version - self.max_staleness + 2  # unfinished now, they would train past max_staleness
        self.pending.append(self.rollout.submit("advance", shares, step, self.calls, self.call_tokens, version,
                                                finish_before))
        self.calls += 1
        return True

    def collect(self, score: Callable[[Batch], dict[str, torch.Tensor]],
                wait: Callable[[str], ContextManager[None]] = lambda _: nullcontext()) -> int:
        """Wait for the calls in flight; its finished groups, their prompts' visuals put back, are scored
        together (``score`` takes the joined batch) and join the queue. How many groups finished."""
        groups = []
        for pending in self.pending:
            with wait("generate_wait"):  # what the update did not hide
                shares = self.rollout.collect(pending)
            groups += [g for share in shares for g in share["groups"]]
            self.idle_from = max(share["finished_at"] for share in shares)
        self.pending = []
        if not groups:
            return 0
        joined = join_assembled(groups)
        scores = score(joined)  # and the texts it scored, in joined's meta
        for k, group in enumerate(groups):
            prompt, _ = self.running.pop(group.meta[ID][0])
            if prompt.image_counts is not None and group.image_counts is None:  # multi-turn groups bring theirs
                group = group.with_visuals_of(prompt.repeat_interleave(self.n))
            rows = slice(k * self.n, (k + 1) * self.n)
            if "texts" in joined.meta:
                group.meta["texts"] = joined.meta["texts"][rows]
            self.queue.put(group, {key: v[rows].clone() for key, v in scores.items()})
        return len(groups)

    def next_batch(self, prompts: Iterator[Batch], step: int, version: int,
                   score: Callable[[Batch], dict[str, torch.Tensor]],
                   timer: Callable[[str], ContextManager[None]]) -> tuple[Batch, dict[str, torch.Tensor],
                                                                           dict[str, float]]:
        """The batch step ``step`` trains with the actor at ``version`` (updates applied): the oldest queued groups
        after the call in flight and as many more calls as the queue needs; then the next call starts, to run
        while the step trains. Its metrics: staleness, drops, the queue's bytes and pauses."""
        self.collect(score, timer)
        dropped = 0
        while True:
            dropped += self.drop_stale(version)
            if len(self.queue.groups) >= self.target:
                break
            short = len(self.queue.groups) + len(self.running) < self.target
            self.submit(prompts, step, version, admit=short)  # new prompts only where those running cannot fill it
            self.collect(score, timer)
        queued = self.queue.bytes
        taken = self.in_step = self.queue.take(self.target)
        batch = join_assembled([q.group for q in taken])
        scores = {k: torch.cat([q.scores[k] for q in taken]) for k in taken[0].scores}
        for _ in range(CALLS_AHEAD):  # while this step trains
            if not self.submit(prompts, step, version):
                break
        mask = batch["response_mask"].bool()
        held, self.pauses_logged = self.pauses - self.pauses_logged, self.pauses
        staleness = (version - batch["token_versions"])[mask].float()
        metrics = {"rollout/staleness": float(staleness.mean()) if len(staleness) else 0.0,
                   "rollout/staleness_max": float(staleness.max()) if len(staleness) else 0.0,
                   "rollout/stale_dropped": float(dropped), "rollout/queue_full_s": self.paused_seconds(),
                   "rollout/queue_held": float(held),
                   "rollout/queue_gb": queued / GB, "rollout/queue_peak_gb": self.queue.peak / GB,
                   "rollout/queue_bound_gb": self.queue.bound / GB}
        return batch, scores, metrics

    def commit(self) -> None:
        """The step's update ran: its batch is trained."""
        self.in_step = []

    def drop_stale(self, version: int) -> int:
        """Drop the queued groups whose oldest token is more than max_staleness versions before ``version``."""
        kept = [q for q in self.queue.groups if version - oldest(q.group) <= self.max_staleness]
        dropped = len(self.queue.groups) - len(kept)
        if dropped:
            self.queue.groups = deque(kept)
            self.queue.bytes = sum(q.bytes for q in kept)
        return dropped

    def paused_seconds(self) -> float:
        """Seconds the engine idled for want of room since the last call of this (a pause still on counts up to
        now, and on from now at the next call)."""
        if self.paused and not self.pending:
            now = time.time()
            self.paused_s += max(0.0, now - self.idle_from)
            self.idle_from = now
        total, self.paused_s = self.paused_s, 0.0
        return total

    # ------------------------------------------------------------------ checkpoint

    def save(self, folder: Path, score: Callable[[Batch], dict[str, torch.Tensor]]) -> dict[str, Any]:
        """Write the queue, the batches the engines have started and the loader batch read but not started to
        ``folder``/:data:`FILE` (the calls in flight first join the queue: the step's sync waited for them); the
        JSON-able rest for the trainer state. A resume continues exactly where this run stood."""
        self.collect(score)
        for q in reversed(self.in_step):  # a step abandoned before its update: its batch trains again
            self.queue.groups.appendleft(q)
            self.queue.bytes += q.bytes
        self.in_step = []
        tensors: dict[str, torch.Tensor] = {}
        queue = []
        for i, q in enumerate(self.queue.groups):
            packed, meta = pack(q.group, f"queue/{i}/")
            tensors.update(packed)
            tensors.update({f"queue/{i}/scores/{k}": v.contiguous() for k, v in q.scores.items()})
            queue.append({"meta": meta, "bytes": q.bytes})
        engines = self.rollout.call("partial_state")[::self.rollout.block_size]
        for m, pools in enumerate(engines):
            for j, pool in enumerate(pools):
                packed, pool["meta"] = pack(pool.pop("prompts"), f"running/{m}/{j}/")
                tensors.update(packed)
                tensors.update({f"running/{m}/{j}/tools/{k}": t.contiguous() for k, t in pool.pop("tensors").items()})
        unread = None
        if self.unread is not None:
            packed, unread = pack(self.unread, "unread/")
            tensors.update(packed)
        save_file(tensors, str(folder / FILE))
        return {"queue": queue, "engines": engines, "unread": unread, "calls": self.calls, "started": self.started,
                "bound": self.queue.bound, "floor": self.queue.floor, "peak": self.queue.peak}

    def load(self, state: dict[str, Any], folder: Path) -> None:
        """Bring back what :meth:`save` wrote: the queue, each engine's started batches, the unread batch."""
        tensors = load_file(str(folder / FILE))
        self.queue = SampleQueue(int(state["bound"]), int(state["floor"]), peak=int(state["peak"]))
        for i, q in enumerate(state["queue"]):
            prefix = f"queue/{i}/scores/"
            scores = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            self.queue.groups.append(Queued(unpack(tensors, q["meta"], f"queue/{i}/"), scores, int(q["bytes"])))
            self.queue.bytes += int(q["bytes"])
        self.running = {}
        engines = state["engines"]
        for m, pools in enumerate(engines):
            for j, pool in enumerate(pools):
                pool["prompts"] = prompts = unpack(tensors, pool.pop("meta"), f"running/{m}/{j}/")
                tools = f"running/{m}/{j}/tools/"
                pool["tensors"] = {k[len(tools):]: v for k, v in tensors.items() if k.startswith(tools)}
                for p, key in enumerate(prompts.meta[ID]):
                    if p not in pool["taken"]:
                        row = prompts.select([p])
                        self.running[key] = (row, self.bound_of(row))
        self.rollout.call("load_partial_state", engines)
        self.unread = unpack(tensors, state["unread"], "unread/") if state["unread"] is not None else None
        self.calls, self.started = int(state["calls"]), int(state["started"])
        self.pending, self.paused = [], False

def async_rollouts(config: Config, rollout: WorkerGroup, data: Any = None) -> AsyncRollouts:
    """The async pipeline of ``config``: its call size, staleness and queue bound (``trainer.async_queue_gb``;
    -1: the room its plan leaves, :attr:`Plan.host_room`, priced on ``data`` when given)."""
    t, d = config.trainer, config.data
    tokens = t.async_call_tokens or max(1, d.max_response_length // 2)
    if t.async_queue_gb == -1:
        from easytrain.memory.planner import plan

        bound = plan(config, data=data).host_room
        source = "the plan's room beside the step's peak"
    else:
        bound, source = int(t.async_queue_gb * GB), "trainer.async_queue_gb"
    logger.info("async rollouts: calls of %d tokens, max_staleness %d, the queue bounded at %.3f GB (%s)",
                tokens, config.algorithm.max_staleness, bound / GB, source)
    return AsyncRollouts(rollout, config.worker.rollout.n, d.rollout_batch_size, d.max_response_length, tokens,
                         config.algorithm.max_staleness, bound, tool_image_bytes(config))

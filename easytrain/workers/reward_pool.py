"""A small pool of Ray actors that score responses off the driver.

``pool.submit(responses, truths)`` returns at once with a handle; the driver
runs the reference pass meanwhile and calls ``pool.collect(handle)`` when it
needs the scores. Each actor loads ``reward.function`` itself (so a user's
module is imported where it runs) and scores a contiguous chunk.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import ray

from easytrain.config.schema import RewardConfig
from easytrain.distributed.group import WorkerDied, is_dead
from easytrain.memory.readings import process_info, release_process_memory
from easytrain.rewards.registry import Reward, load_function

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0)  # light Python work; must not wait behind placement groups holding every core
class RewardWorker:
    def __init__(self, function: str, format_weight: float) -> None:
        self.reward = Reward(load_function(function), format_weight)

    def score(self, responses: Sequence[str], truths: Sequence[str]) -> tuple[list[dict[str, float]], int]:
        return self.reward(responses, truths)

    def ready(self) -> bool:
        return True

    def process_info(self, index: int) -> dict[str, Any]:
        return process_info("reward", index)

    def release_memory(self, index: int) -> dict[str, Any]:
        return {"role": "reward", "rank": index, **release_process_memory()}


@dataclass
class PendingScores:
    refs: list[Any]
    sizes: list[int]
    """Responses each worker scores (a worker killed at the timeout scores them 0)."""
    started: float = field(default_factory=time.monotonic)


class RewardPool:
    def __init__(self, cfg: RewardConfig) -> None:
        load_function(cfg.function)  # fail here, in the driver, with a clear message
        self.cfg = cfg
        self.workers = self._started(cfg.num_workers)

    def _started(self, count: int) -> list[Any]:
        """``count`` new workers, once each has loaded the function: reward.timeout_s then times the scoring,
        not a process starting (seconds on a loaded node, which would time out the worker that replaced one)."""
        workers = [RewardWorker.remote(self.cfg.function, self.cfg.format_weight) for _ in range(count)]
        try:
            ray.get([w.ready.remote() for w in workers])
        except ray.exceptions.RayActorError as err:
            raise WorkerDied("reward", -1, "?", f"a reward worker did not start: {str(err).splitlines()[0]}") from err
        return workers

    def submit(self, responses: Sequence[str], truths: Sequence[str]) -> PendingScores:
        n = len(responses)
        size = -(-n // len(self.workers)) if n else 0
        starts = list(range(0, n, size or 1))
        refs = [worker.score.remote(list(responses[i:i + size]), list(truths[i:i + size]))
                for worker, i in zip(self.workers, starts)]
        return PendingScores(refs, [len(responses[i:i + size]) for i in starts])

    def collect(self, pending: PendingScores, watch: Optional[Callable[[], None]] = None,
                every_s: float = 1.0) -> tuple[list[dict[str, float]], int]:
        """The scores, in order, and how many responses failed (scored 0). ``watch`` is called every ``every_s``
        while some are still scoring; when it raises, the workers still scoring are killed (what their code
        holds goes with them; a new worker takes each place) and its exception propagates. A worker still
        scoring after ``reward.timeout_s`` is killed and replaced the same way, its responses scored 0."""
        deadline = pending.started + self.cfg.timeout_s
        waiting = list(pending.refs)
        while waiting:
            _, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=min(every_s, self.cfg.timeout_s))
            if not waiting:
                break
            late = [pending.refs.index(ref) for ref in waiting]
            try:
                if watch is not None:
                    watch()
            except BaseException:
                self.replace(late)
                raise
            if time.monotonic() >= deadline:
                self.replace(late)
                logger.warning("reward: %s took longer than reward.timeout_s=%g s on %d response(s); they score 0",
                               self.cfg.function, self.cfg.timeout_s, sum(pending.sizes[i] for i in late))
                break
        scores: list[dict[str, float]] = []
        errors = 0
        timed_out = set(waiting)
        try:
            chunks = [([{"overall": 0.0}] * size, size) if ref in timed_out else ray.get(ref)
                      for ref, size in zip(pending.refs, pending.sizes)]
        except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as err:  # its node lost, Ray's
            # memory monitor killed it: recoverable like any worker
            raise WorkerDied("reward", -1, "?", f"a reward worker died: {str(err).splitlines()[0]}") from err
        for chunk, chunk_errors in chunks:
            scores.extend(chunk)
            errors += chunk_errors
        return scores, errors

    def replace(self, indices: list[int]) -> None:
        """Kill the workers at ``indices`` now and start new ones in their places."""
        for i in indices:
            ray.kill(self.workers[i])
        for i, worker in zip(indices, self._started(len(indices))):
            self.workers[i] = worker
        logger.warning("killed %d reward worker(s) while they scored; new ones took their places", len(indices))

    def process_info(self) -> list[dict[str, Any]]:
        return self._each("process_info")

    def release_memory(self) -> list[dict[str, Any]]:
        return self._each("release_memory")

    def _each(self, method: str) -> list[Any]:
        """``method`` on every reward worker; a dead one is a worker death (recoverable like any other)."""
        try:
            return ray.get([getattr(w, method).remote(i) for i, w in enumerate(self.workers)])
        except ray.exceptions.RayActorError as err:
            raise WorkerDied("reward", -1, "?", f"a reward worker died: {str(err).splitlines()[0]}") from err

    def dead(self) -> list[str]:
        """The reward workers Ray reports dead."""
        return [f"reward worker {i}" for i, worker in enumerate(self.workers) if is_dead(worker)]

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []

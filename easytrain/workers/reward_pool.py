"""A small pool of Ray actors that score responses off the driver.

``pool.submit(responses, truths)`` returns at once with a handle; the driver
runs the reference pass meanwhile and calls ``pool.collect(handle)`` when it
needs the scores. Each actor loads ``reward.function`` itself (so a user's
module is imported where it runs) and scores a contiguous chunk.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

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

    def process_info(self, index: int) -> dict[str, Any]:
        return process_info("reward", index)

    def release_memory(self, index: int) -> dict[str, Any]:
        return {"role": "reward", "rank": index, **release_process_memory()}


@dataclass
class PendingScores:
    refs: list[Any]


class RewardPool:
    def __init__(self, cfg: RewardConfig) -> None:
        load_function(cfg.function)  # fail here, in the driver, with a clear message
        self.workers = [RewardWorker.remote(cfg.function, cfg.format_weight) for _ in range(cfg.num_workers)]

    def submit(self, responses: Sequence[str], truths: Sequence[str]) -> PendingScores:
        n = len(responses)
        size = -(-n // len(self.workers)) if n else 0
        refs = [worker.score.remote(list(responses[i:i + size]), list(truths[i:i + size]))
                for worker, i in zip(self.workers, range(0, n, size or 1))]
        return PendingScores(refs)

    def collect(self, pending: PendingScores) -> tuple[list[dict[str, float]], int]:
        scores: list[dict[str, float]] = []
        errors = 0
        try:
            chunks = ray.get(pending.refs)
        except ray.exceptions.RayActorError as err:  # e.g. its node was lost: recoverable like any worker
            raise WorkerDied("reward", -1, "?", f"a reward worker died: {str(err).splitlines()[0]}") from err
        for chunk, chunk_errors in chunks:
            scores.extend(chunk)
            errors += chunk_errors
        return scores, errors

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

"""Batches of prompts in a resumable order.

:class:`PromptSampler` orders a dataset by a permutation fixed by
``(seed, epoch)`` and remembers the next batch to hand out, so a resumed run
continues exactly where it stopped: no prompt repeated or skipped.
:class:`PromptLoader` serves those batches through a torch DataLoader (worker
processes prepare images beside the driver) and advances the position only
when a batch is consumed, so prefetching never moves it.
"""

from __future__ import annotations

import logging
import signal
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import DataLoader

from easytrain.data.collate import PromptCollator
from easytrain.data.dataset import PromptDataset

logger = logging.getLogger(__name__)


class PromptSampler:
    """Batches of indices; the state is (epoch, next batch), the order a function of (seed, epoch)."""

    def __init__(self, size: int, batch_size: int, shuffle: bool = True, seed: int = 0) -> None:
        if batch_size > size:
            raise ValueError(f"a batch of {batch_size} prompts needs at least that many usable rows; "
                             f"the data has {size}")
        self.size, self.batch_size, self.shuffle, self.seed = size, batch_size, shuffle, seed
        self.epoch, self.batch = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return self.size // self.batch_size  # the remainder is dropped: every step sees a full batch

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def remaining(self) -> list[list[int]]:
        """The batches left in the current epoch, from the current position."""
        order = self.order(self.epoch)
        return [order[b * self.batch_size:(b + 1) * self.batch_size]
                for b in range(self.batch, self.batches_per_epoch)]

    def advance(self) -> None:
        self.batch += 1
        if self.batch >= self.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed, "size": self.size,
                "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (state["size"], state["batch_size"]) != (self.size, self.batch_size):
            logger.warning("data changed since the checkpoint (%d rows in batches of %d, now %d in %d): "
                           "resuming at the same epoch and batch number", state["size"], state["batch_size"],
                           self.size, self.batch_size)
        self.seed, self.epoch, self.batch = state["seed"], state["epoch"], state["batch"]



def ignore_sigterm(worker_id: int) -> None:
    """A loader worker lets a stop's SIGTERM pass: ``easytrain stop`` and Kubernetes signal the driver's whole
    process tree, and a loader worker dying on it would make torch raise in the driver before it could save. The
    driver ends its workers itself when the run stops."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

class PromptLoader:
    """Iterate one epoch of collated batches from the sampler's position; ``len`` = batches left."""

    def __init__(self, dataset: PromptDataset, batch_size: int, collator: PromptCollator, shuffle: bool = True,
                 seed: int = 0, num_workers: int = 0) -> None:
        self.dataset, self.collator, self.num_workers = dataset, collator, num_workers
        self.sampler = PromptSampler(len(dataset), batch_size, shuffle, seed)

    def __len__(self) -> int:
        return len(self.sampler.remaining())

    def __iter__(self) -> Iterator[dict[str, Any]]:
        batches = self.sampler.remaining()
        if not batches:
            return
        loader = DataLoader(self.dataset, batch_sampler=batches, collate_fn=self.collator,
                            num_workers=self.num_workers, worker_init_fn=ignore_sigterm if self.num_workers else None,
                            multiprocessing_context="spawn" if self.num_workers else None,
                            prefetch_factor=2 if self.num_workers else None)
        for batch in loader:
            self.sampler.advance()
            yield batch

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: Optional[dict[str, int]]) -> None:
        if state:
            self.sampler.load_state_dict(state)

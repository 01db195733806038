"""DAPO-style dynamic sampling: keep prompt groups whose responses disagree, refill the batch.

A group whose n responses all scored the same has zero advantage everywhere
and only dilutes the update. Rounds of generation are merged, informative
groups first; if the retries run out, groups without signal fill the rest so
the batch keeps its configured size (they then contribute nothing).
"""

from __future__ import annotations

import torch

from easytrain.algorithms.advantages import informative_groups
from easytrain.distributed.batch import Batch

Scores = dict[str, torch.Tensor]


def _split(batch: Batch, scores: Scores, n: int) -> tuple[list[int], list[int]]:
    keep = informative_groups(scores["overall"], torch.arange(len(batch)) // n)
    return torch.nonzero(keep).flatten().tolist(), torch.nonzero(~keep).flatten().tolist()


def informative_count(rounds: list[tuple[Batch, Scores]], n: int) -> int:
    """Prompt groups with signal across all rounds so far."""
    return sum(len(_split(batch, scores, n)[0]) for batch, scores in rounds) // n


def keep_informative(rounds: list[tuple[Batch, Scores]], n: int, target: int) -> tuple[Batch, Scores]:
    """``target`` prompt groups: informative ones from every round first, then the others."""
    parts: list[tuple[Batch, Scores]] = []
    for informative in (True, False):
        for batch, scores in rounds:
            rows = _split(batch, scores, n)[0 if informative else 1]
            parts.append((batch.select(rows), {k: v[rows] for k, v in scores.items()}))
    merged = Batch.concat([b for b, _ in parts])
    merged_scores = {k: torch.cat([s[k] for _, s in parts]) for k in rounds[0][1]}
    rows = list(range(min(target * n, len(merged))))
    return merged.select(rows), {k: v[rows] for k, v in merged_scores.items()}

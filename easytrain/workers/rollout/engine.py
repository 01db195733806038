"""The rollout engine interface and its registry.

An engine turns a batch of prompts into ``n`` sampled responses per prompt
with the per-token log-probs of the sampling distribution (logits divided by
the temperature), and takes new weights in place. Engines: ``hf``
(transformers ``generate``, any device) here; ``vllm`` joins behind the same
interface.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from easytrain.distributed.batch import Batch


@dataclass(frozen=True)
class SamplingParams:
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    seed: int = 0


class RolloutEngine(abc.ABC):
    @abc.abstractmethod
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Rows grouped by prompt (prompt i's n responses are rows i*n..i*n+n-1) with tensors
        ``responses`` (B*n, R) right-padded, ``response_mask`` (1 up to and including EOS) and
        ``rollout_log_probs`` (B*n, R)."""

    @abc.abstractmethod
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load named tensors (HF names) in place; returns how many were loaded."""


ENGINES: dict[str, str] = {"hf": "easytrain.workers.rollout.hf_engine:HFEngine"}
"""Engine name -> ``module:class``, imported on use (vLLM is heavy and optional)."""


def engine_class(name: str) -> Callable[..., RolloutEngine]:
    import importlib

    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; available: {', '.join(ENGINES)}")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def response_mask(responses: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """1 for generated tokens up to and including the first EOS, 0 after it."""
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device))
    ended_before = (is_eos.cumsum(-1) - is_eos.long()) > 0
    return (~ended_before).to(torch.float32)

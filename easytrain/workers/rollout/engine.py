"""The rollout engine interface and its registry.

An engine turns a batch of prompts into ``n`` sampled responses per prompt
with the per-token log-probs of the sampling distribution (logits divided by
the temperature, never-generated tokens excluded: the actor's convention in
:func:`easytrain.algorithms.losses.sampling_logits`), and takes new weights
in place, streamed in buckets:

    begin_weight_update() -> load_weights(bucket) ... -> finish_weight_update()

Engines: ``hf`` (transformers ``generate``, any device) and ``vllm``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

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


@dataclass(frozen=True)
class EngineSpec:
    """What every engine is built from: the model folder and the token ids that end a response."""

    folder: Path
    stop_ids: list[int]
    """EOS, <|endoftext|> and worker.rollout.stop_tokens: a response ends with (and includes) one of them."""
    pad_id: int
    device: torch.device
    member: int = 0
    """Which data-parallel engine this is (engines seed differently)."""
    fused: bool = False
    """The engine shares its process (and torch.distributed world) with the actor: a fused worker."""


class RolloutEngine(abc.ABC):
    device: torch.device = torch.device("cpu")
    """Where the engine computes (weights are gathered there for the in-process sync)."""
    asleep: frozenset[str] | set[str] = frozenset()
    """What :meth:`sleep` released and no :meth:`wake` has brought back yet (``weights``, ``kv_cache``)."""
    stale: bool = False
    """A sleep discarded the weights and no sync has refilled them (generation must wait for one)."""
    synced: bool = False
    """A sync has filled the engine's weights since it was built."""
    pressure: Any = None
    """The node's pressure flag (:class:`easytrain.memory.flag.PressureFlag`), set under a watchdog; an engine
    that reads it while generating stops early at the hard level (the HF engine, at every token)."""

    @classmethod
    @abc.abstractmethod
    def build(cls, config: Any, spec: EngineSpec) -> "RolloutEngine":
        """An engine from the composed config (easytrain.config.Config)."""

    @abc.abstractmethod
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Rows grouped by prompt (prompt i's n responses are rows i*n..i*n+n-1) with tensors
        ``responses`` (B*n, R) right-padded, ``response_mask`` (1 up to and including the stop token)
        and ``rollout_log_probs`` (B*n, R)."""

    @property
    def holds_frozen(self) -> bool:
        """Whether the engine holds the actor's frozen weights (a frozen vision tower): a sync filled its weights
        and no sleep discarded them since, so a sync may leave the frozen ones out
        (:func:`easytrain.workers.weight_sync.weights_to_send`)."""
        return self.synced and not self.stale

    def begin_weight_update(self, partial: bool = False) -> None:
        """Prepare to receive the weights in buckets: every weight, or (``partial``) the ones that train."""

    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket of named tensors (HF names) in place; returns how many were loaded."""

    def in_place_targets(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The engine's own tensors that a sync may write ``names``' full values into directly (contiguous, the
        engine's dtype and shape), by name; the others go through :meth:`load_weights`. None by default."""
        return {}

    def finish_weight_update(self) -> None:
        """Every bucket has arrived: finish processing (vLLM repacks layers that are still partial)."""

    @property
    def can_sleep(self) -> bool:
        """Whether :meth:`sleep` can free anything here (vLLM on GPU with colocated roles)."""
        return False

    def sleep(self) -> int:
        """Free the engine's device memory between rollouts; returns the bytes freed (0 where it cannot, or
        when it already sleeps)."""
        return 0

    def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Re-allocate what :meth:`sleep` freed (``weights`` before a sync, ``kv_cache`` before generating)."""


def describe_sleep(engine: RolloutEngine) -> str:
    """What an engine that cannot serve a call now lacks, and what the driver must do first."""
    if "weights" in engine.asleep:
        return "its weights sleep (wake them, then sync weights: Roles.wake_engine)"
    if engine.stale:
        return "its weights were dropped by a level-2 sleep (sync weights first)"
    return f"its {', '.join(sorted(engine.asleep))} sleeps (wake it first: Roles.wake_engine)"


ENGINES: dict[str, str] = {
    "hf": "easytrain.workers.rollout.hf_engine:HFEngine",
    "vllm": "easytrain.workers.rollout.vllm_engine:VLLMEngine",
}
"""Engine name -> ``module:class``, imported on use (vLLM is heavy and optional)."""


def engine_class(name: str) -> Callable[..., RolloutEngine]:
    import importlib

    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; available: {', '.join(ENGINES)}")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def response_mask(responses: torch.Tensor, stop_ids: list[int]) -> torch.Tensor:
    """1 for generated tokens up to and including the first stop token, 0 after it."""
    is_stop = torch.isin(responses, torch.tensor(stop_ids, device=responses.device))
    ended_before = (is_stop.cumsum(-1) - is_stop.long()) > 0
    return (~ended_before).to(torch.float32)


def pad_responses(rows: list[list[int]], log_probs: list[list[float]], pad_id: int,
                  stop_ids: list[int]) -> Batch:
    """Ragged token lists (and their log-probs) as the engine output Batch."""
    width = max(1, max(len(r) for r in rows))
    responses = torch.full((len(rows), width), pad_id, dtype=torch.long)
    lp = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (tokens, values) in enumerate(zip(rows, log_probs)):
        responses[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        lp[i, :len(values)] = torch.tensor(values, dtype=torch.float32)
    mask = response_mask(responses, stop_ids)
    for i, tokens in enumerate(rows):
        mask[i, len(tokens):] = 0.0
    return Batch({"responses": responses, "response_mask": mask, "rollout_log_probs": lp * mask})

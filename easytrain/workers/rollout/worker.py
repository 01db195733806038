"""The rollout worker: hosts one engine, generates for its share of prompts, takes new weights.

Weights arrive in buckets, each in parts pushed by the actor ranks (see
:mod:`easytrain.workers.weight_sync`), through the plain methods
``begin_weight_update`` / ``receive_part`` / ``finish_weight_update``.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch

from easytrain.config.schema import Config
from easytrain.data.vision import VISUAL_KEYS
from easytrain.distributed.batch import Batch
from easytrain.distributed.group import Dispatch, dispatch
from easytrain.memory.flag import PressureFlag
from easytrain.models.families import family_of
from easytrain.models.hf import load_tokenizer
from easytrain.workers.base import DTYPES, WorkerBase
from easytrain.workers.rollout.engine import EngineSpec, RolloutEngine, SamplingParams, engine_class
from easytrain.workers.rollout.partial import PartialRollouts
from easytrain.workers.sequences import assemble
from easytrain.workers.debug import RolloutDebug, debug_bases
from easytrain.workers.weight_sync import AliveBytes, Wire, from_wire, join_parts, to_hf_names


def stable_seed(*parts: Any) -> int:
    """A 31-bit seed mixing ``parts``: nearby (step, engine, call) never give overlapping seed ranges."""
    import hashlib

    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 2**20)  # room for seed + i * n + j


def stop_token_ids(tokenizer: Any, stop_tokens: list[str]) -> list[int]:
    """EOS, the pad token (which ends a response where the tokenizer's end-of-text pads, as ChatML's
    ``<|endoftext|>`` does) and worker.rollout.stop_tokens, as ids."""
    ids = [tokenizer.eos_token_id]
    if tokenizer.pad_token_id is not None:
        ids.append(tokenizer.pad_token_id)
    for token in stop_tokens:
        pieces = tokenizer(token, add_special_tokens=False)["input_ids"]
        if len(pieces) != 1:
            raise ValueError(f"worker.rollout.stop_tokens: {token!r} is {len(pieces)} tokens for this tokenizer; "
                             "each stop token must be exactly one token (e.g. a special token of the vocabulary)")
        ids.append(pieces[0])
    return list(dict.fromkeys(ids))


class RolloutWorker(*debug_bases(RolloutDebug), WorkerBase):  # type: ignore[misc]
    def __init__(self, config: Config, *, role: str, rank: int, world_size: int, hosted: bool = False) -> None:
        super().__init__(config, role=role, rank=rank, world_size=world_size, hosted=hosted)
        self.engine: Optional[RolloutEngine] = None
        self.sync_meter = AliveBytes()
        self._parts: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
        self._lora_scale, self._loaded = 1.0, 0
        self.freed_bytes = 0
        self.fused = False
        """Hosted by a fused worker (set by it): the engine shares the process and its torch world."""
        self.multi_turn: Optional[Any] = None
        """worker.rollout.multi_turn: the loop of model and tool turns (:mod:`.multi_turn`)."""
        self.partial: list[PartialRollouts] = []
        """trainer.rollout_mode=async: the prompt batches this engine has started and not finished."""

    @property
    def member(self) -> int:
        """Which data-parallel engine this rank serves (a tensor-parallel engine spans consecutive ranks)."""
        return self.rank // self.config.worker.rollout.tensor_parallel_size

    def set_block_env(self, address: str, port: int, block_rank: int, block_size: int) -> None:
        """torch.distributed environment of this rank's tensor-parallel block (vLLM's external launcher).
        Ray shows each worker only its own GPU, so the local device is always cuda:0."""
        import os

        os.environ.update({"RANK": str(block_rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(block_size),
                           "MASTER_ADDR": address, "MASTER_PORT": str(port)})

    @property
    def engine_dtype(self) -> torch.dtype:
        """The dtype the engine computes in (model.dtype): weights are gathered in it."""
        return DTYPES[self.config.model.dtype]

    @dispatch(Dispatch.BROADCAST)
    def setup(self) -> dict[str, Any]:
        from transformers import AutoConfig

        tokenizer = load_tokenizer(self.config.model, self.folder)
        r = self.config.worker.rollout
        spec = EngineSpec(self.folder, stop_token_ids(tokenizer, r.stop_tokens), tokenizer.pad_token_id,
                          self.device, self.member, self.fused)
        self.engine = engine_class(r.engine).build(self.config, spec)
        self.spec = spec
        if self.config.watchdog.enabled:
            self.engine.pressure = PressureFlag.of_this_job()
        self.family = family_of(AutoConfig.from_pretrained(self.folder))
        """The model's family adapter: response positions follow its rules, as the collator's prompt positions did."""
        if r.multi_turn.enable:
            self.multi_turn = self._multi_turn(tokenizer)
        return {"engine": r.engine, "stop_ids": spec.stop_ids, "can_sleep": self.engine.can_sleep}

    def _multi_turn(self, tokenizer: Any) -> Any:
        """The multi-turn loop; with a vision model, tool images go through the prompts' image processor."""
        from easytrain.models.families.base import Bound
        from easytrain.models.hf import load_image_processor
        from easytrain.workers.rollout.multi_turn import MultiTurn, ToolImages

        d = self.config.data
        processor = load_image_processor(self.config.model, str(self.folder))
        images = None
        if processor is not None:
            self.family.bound_processor(processor, d.min_pixels, d.max_pixels)  # as the prompts'
            images = ToolImages(Bound.of(self.family, processor, tokenizer), d.min_pixels, d.max_pixels)
        return MultiTurn(self.config.worker.rollout.multi_turn, tokenizer, d.max_response_length, images=images)

    def sampling(self, validate: bool, step: int, call: int = 0) -> SamplingParams:
        """Seeds are a function of (seed, step, engine, call within the step, validation), never of the
        process's history, so a resumed run draws exactly what the uninterrupted one would have."""
        r, length = self.config.worker.rollout, self.config.data.max_response_length
        seed = stable_seed(self.config.trainer.seed, step, self.member, call, validate)
        s = r.val_override if validate else r
        return SamplingParams(s.n, s.temperature, s.top_p, s.top_k, length, seed)

    @dispatch(Dispatch.SCATTER)
    def generate(self, prompts: Batch, step: int, validate: bool = False, call: int = 0) -> Batch:
        """``call`` numbers the generations within one step (sampling rounds, validation batches)."""
        assert self.engine is not None, "setup() first"
        params = self.sampling(validate, step, call)
        if self.multi_turn is not None:
            generated = self.multi_turn.generate(self.engine, prompts, params)
        else:
            generated = self.engine.generate(prompts, params)
        if validate:  # the driver only scores these: their tokens go back, not the prompts' pixels and positions
            tokens = {k: v for k, v in generated.tensors.items() if k not in VISUAL_KEYS}
            return Batch(tokens, prompts.repeat_interleave(params.n).meta)
        batch = assemble(prompts, generated, params.n, self.family)
        if self.multi_turn is not None:  # tool turns may have added images: every row's visuals go back
            return batch
        return batch.without_visuals()  # the driver holds the prompts' visuals and puts them back (with_visuals_of)

    @dispatch(Dispatch.EACH)
    def advance(self, prompts: Batch, step: int, call: int, tokens: int, version: int,
                finish_before: int) -> dict[str, Any]:
        """trainer.rollout_mode=async: start ``prompts`` (this engine's share, maybe none) and add up to ``tokens``
        to every unfinished response with the weights of ``version``; a batch whose first tokens are of a version
        before ``finish_before`` is generated to its end now (algorithm.max_staleness). Returns the groups (a
        prompt's n responses) finished, each assembled at its own widths, as ``groups``: without the prompts'
        visuals (the driver holds them), but multi-turn groups with every visual (tool turns may have added
        some); and when the call ended (``finished_at``, time.time()). ``call`` numbers the calls of the run (the
        seeds' part, as :meth:`generate`'s)."""
        assert self.engine is not None, "setup() first"
        if len(prompts):
            params = self.sampling(False, step, call)
            self.partial.append(PartialRollouts(prompts, params, self.spec.pad_id, self.spec.stop_ids,
                                                self.multi_turn))
        groups: list[Batch] = []
        for rollouts in self.partial:
            first = version if rollouts.first_version is None else rollouts.first_version
            if first < finish_before:
                rollouts.finish(self.engine, version)
            else:
                rollouts.advance(self.engine, tokens, version)
            finished = rollouts.finished_groups(self.family)
            groups += finished if self.multi_turn is not None else [g.without_visuals() for g in finished]
        self.partial = [r for r in self.partial if r.running]
        return {"groups": groups, "finished_at": time.time()}

    @dispatch(Dispatch.BROADCAST)
    def partial_state(self) -> list[dict[str, Any]]:
        """trainer.rollout_mode=async: the batches this engine has started and not finished, for a checkpoint."""
        return [rollouts.state() for rollouts in self.partial]

    @dispatch(Dispatch.EACH)
    def load_partial_state(self, pools: list[dict[str, Any]]) -> None:
        """Continue the batches :meth:`partial_state` returned (this engine's), as they were."""
        self.partial = [PartialRollouts.restored(pool, self.multi_turn) for pool in pools]

    @dispatch(Dispatch.BROADCAST)
    def sleep(self) -> int:
        """Free the engine's device memory until it is woken (colocated roles); bytes freed."""
        assert self.engine is not None, "setup() first"
        self.freed_bytes = self.engine.sleep()
        return self.freed_bytes

    @dispatch(Dispatch.BROADCAST)
    def wake(self, tags: Sequence[str]) -> None:
        """The engine takes back ``weights`` (before a sync) or its ``kv_cache`` (before generating)."""
        assert self.engine is not None, "setup() first"
        self.engine.wake(tags)

    # ------------------------------------------------------------------ weights (called by the actor ranks)

    def begin_weight_update(self, lora_scale: float = 1.0, partial: bool = False) -> None:
        assert self.engine is not None, "setup() first"
        if partial and not self.engine.holds_frozen:
            raise RuntimeError("a weight sync without the frozen weights reached an engine that does not hold them "
                               "(a sleep discarded them, or the engine was rebuilt)")
        self.sync_meter.reset()
        self._parts: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
        self._lora_scale, self._loaded = lora_scale, 0
        self.engine.begin_weight_update(partial)

    def receive_part(self, index: int, part: int, parts: int, wire: dict[str, Wire]) -> None:
        """One actor rank's part of bucket ``index``; the part that completes the bucket loads it."""
        assert self.engine is not None, "setup() first"
        arrived = self._parts.setdefault(index, {})
        arrived[part] = from_wire(wire)
        if len(arrived) < parts:
            return
        del self._parts[index], wire
        bucket = join_parts([arrived.pop(p) for p in range(parts)])
        if parts > 1:
            self.sync_meter.track(bucket.values())  # the joined copies (a single part is read in place)
        self._loaded += self.engine.load_weights(to_hf_names(bucket, self._lora_scale).items())

    def finish_weight_update(self) -> dict[str, float]:
        assert self.engine is not None, "setup() first"
        if self._parts:
            raise RuntimeError(f"weight update finished with buckets {sorted(self._parts)} incomplete")
        self.engine.finish_weight_update()
        return {"loaded": float(self._loaded), "assembled_peak_mb": self.sync_meter.peak / 2**20}

    @dispatch(Dispatch.BROADCAST)
    def memory(self) -> dict[str, float]:
        reading = super().memory()
        reading["sleep_freed_gb"] = self.freed_bytes / 2**30
        return reading

"""The SFT driver: global batches of conversations, planned into each rank's micro batches, one remote call
per step.

    next batch -> plan micro batches per rank (fixed count, or token-budget packs balanced by tokens)
    -> forward/backward on every rank -> optimizer step

The loss is the mean over every trained (assistant) token of the global batch,
whatever the ranks and micro batches, so gradient accumulation and the number
of ranks change rounding only. Validation reports the loss on the validation
conversations and the accuracy of greedy answers to their prompts (scored by
``reward.function``), with a few written to ``samples.jsonl``. Checkpoints,
resume, recovery and the memory watchdog are the shared trainer's
(:mod:`easytrain.trainer.base`).
"""

from __future__ import annotations

import logging
import time
from typing import Iterator, Optional

import torch

from easytrain.config.schema import Config
from easytrain.config.derived import world_size
from easytrain.data.packing import plan_micro_batches
from easytrain.data.sft import IGNORE
from easytrain.distributed.batch import Batch, MicroBatch
from easytrain.rewards.registry import Reward, load_function
from easytrain.trainer.base import StepResult, Trainer
from easytrain.trainer.checkpoint import check_resume
from easytrain.trainer.data import SFTData
from easytrain.trainer.metrics import PhaseTimer
from easytrain.trainer.micro_batches import Forward, padded_indices
from easytrain.trainer.roles import Roles, build_sft_roles
from easytrain.trainer.stats import reward_metrics
from easytrain.workers.rollout.worker import stop_token_ids

logger = logging.getLogger(__name__)


def gradient_accumulation(config: Config) -> int:
    """Micro batches per rank per optimizer step with a fixed micro batch (validation made it divide)."""
    a = config.worker.actor
    return a.global_batch_size // (world_size(config) // a.ulysses_size * a.micro_batch_size_per_device_for_update)


class SFTTrainer(Trainer):
    name, headline = "SFT", "train/loss"

    def __init__(self, config: Config, data: Optional[SFTData] = None) -> None:
        resume = check_resume(config)
        self.data = data or SFTData(config)
        super().__init__(config, self.data.loader)
        self.total_steps = self.data.total_steps()
        self.reward = Reward(load_function(config.reward.function), config.reward.format_weight)
        self.stop_ids = stop_token_ids(self.data.tokenizer, config.worker.rollout.stop_tokens)
        self.announce()
        self.start(resume)

    def announce(self) -> None:
        a = self.config.worker.actor
        ranks = world_size(self.config) // a.ulysses_size
        if a.padding_free:
            layout = (f"padding-free micro batches of up to {a.max_token_len_per_device} tokens per device, "
                      "balanced over ranks by tokens")
        else:
            layout = (f"{a.micro_batch_size_per_device_for_update} per device x {ranks} devices x "
                      f"{gradient_accumulation(self.config)} gradient accumulation steps")
        logger.info("SFT: effective global batch %d samples (%s); %d optimizer steps. The learning rate is not "
                    "rescaled when the global batch changes: with AdamW, scale worker.actor.optim.lr by about "
                    "sqrt(new/old batch) yourself.", a.global_batch_size, layout, self.total_steps)

    def build_roles(self) -> Roles:
        self.forward = Forward.of(self.config, {})  # padding-free or fixed micro batches; no prompt sharing in SFT
        return build_sft_roles(self.config, self.total_steps)

    def new_batches(self) -> Iterator[Batch]:
        return self.data.train_batches()

    def micro_batches(self, batch: Batch, evaluate: bool = False) -> list[list[MicroBatch]]:
        """Each rank's micro batches: fixed-size ones, or token-budget packs (padding_free; validation keeps
        fixed counts, each still run as one flattened sequence). Every rank gets the
        same number (the sharded model's collectives need it): a validation batch that does not split evenly is
        topped up with copies that train nothing, and in a vision run a micro batch without images gets an
        untrained blank-image sample, so every rank runs the vision tower."""
        forward, ranks = self.forward, self.roles.actor.members
        if evaluate and len(batch) % ranks:
            batch = Batch.concat([batch, untrained(batch.select(range((-len(batch)) % ranks)))])
        if forward.packed and not evaluate:
            lengths = batch["attention_mask"].sum(-1).tolist()
            layout = plan_micro_batches(lengths, ranks, forward.budget)
        else:
            layout = padded_indices(len(batch), ranks, forward.update_size)  # len(batch) splits evenly here
        shares = [[batch.select(micro) for micro in rank] for rank in layout]
        if self.data.blank is not None and "pixel_values" in batch:
            shares = [[m if int(m.image_counts.sum()) else Batch.concat([m, self.data.blank])  # type: ignore[union-attr]
                       for m in rank] for rank in shares]
        return [[MicroBatch(m, packed=forward.packed) for m in rank] for rank in shares]

    def train_step(self) -> StepResult:
        timer, start = PhaseTimer(), time.perf_counter()
        with timer("data"):
            batch = next(self.batches)
            shares = self.micro_batches(batch)
        self.metrics.log_order(self.step, list(batch.meta["uids"]))
        tokens = int((batch["targets"] != IGNORE).sum())
        results = self.roles.actor.call("sft_update", shares, tokens)
        spans = [(phase, min(r[phase][0] for r in results), max(r[phase][1] for r in results))
                 for phase in ("forward_backward", "optimizer")]
        processed = sum(int(m.batch["attention_mask"].sum()) if m.packed
                        else len(m) * int(m.batch["attention_mask"].sum(-1).max()) for share in shares for m in share)
        metrics = {"train/loss": sum(r["loss_sum"] for r in results) / max(1, tokens),
                   "train/trained_tokens": float(tokens), "actor/grad_norm": results[0]["grad_norm"],
                   "actor/lr": results[0]["lr"], "train/micro_batches_per_rank": float(len(shares[0])),
                   "train/padding_waste": 1.0 - float(batch["attention_mask"].sum()) / max(1, processed),
                   **timer.times, **{f"time/{name}": end - begin for name, begin, end in spans}}
        metrics["time/step"] = time.perf_counter() - start
        metrics["perf/train_tokens_per_s"] = float(batch["attention_mask"].sum()) / metrics["time/step"]
        memory, readings = self.memory()
        metrics.update(memory)
        return StepResult(metrics, timer.spans + spans, readings)

    def validate(self) -> dict[str, float]:
        if self.data.val is None:
            return {}
        timer = PhaseTimer()
        with timer("validate"):
            loss_sum, tokens = 0.0, 0
            for batch in self.data.val_sft_batches():
                results = self.roles.actor.call("sft_eval", self.micro_batches(batch, evaluate=True))
                loss_sum += sum(r["loss_sum"] for r in results)
                tokens += int(sum(r["tokens"] for r in results))
            metrics = {"val/loss": loss_sum / max(1, tokens)}
            metrics.update(self.generation_samples())
        metrics["val/time"] = timer.times["time/validate"]
        self.metrics.log(self.step, metrics)
        return metrics

    def generation_samples(self) -> dict[str, float]:
        """Greedy answers to the validation prompts, scored against the last assistant turn."""
        tokenizer, samples = self.data.tokenizer, []
        all_scores: list[dict[str, float]] = []
        for prompts in self.data.val_batches():
            out = self.roles.actor.call("generate", prompts, self.config.data.max_response_length, self.stop_ids,
                                        tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(out["responses"], skip_special_tokens=True)
            answers = prompts.meta["answers"]
            scores, _ = self.reward(texts, answers)
            all_scores += scores
            for uid, text, answer, score in zip(prompts.meta["uids"], texts, answers, scores):
                if len(samples) < self.config.trainer.log_samples:
                    samples.append({"uid": uid, "response": text, "answer": answer, "score": score["overall"]})
        if samples:
            self.metrics.write_samples(self.step, samples)
        table = {key: torch.tensor([s.get(key, 0.0) for s in all_scores]) for key in all_scores[0]}
        return {f"val/{k}": v for k, v in reward_metrics(table).items()}



def untrained(batch: Batch) -> Batch:
    """``batch`` with nothing to train (every target ignored): fills a rank's share without changing the loss."""
    return batch.union(Batch({"targets": torch.full_like(batch["targets"], IGNORE)}))

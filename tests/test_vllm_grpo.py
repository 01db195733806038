"""GRPO with the vLLM engine (+exp=tiny_vllm): every weight sync takes effect, and a skipped one is caught.

At each step the engine's sampling log-probs are compared with the actor's recomputed old log-probs
(``rollout/log_prob_diff_max``); the greedy answers to a fixed probe batch change after each update; the
rollout workers' RSS is read every step."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch

from easytrain.config import load
from easytrain.distributed.batch import Batch
from easytrain.trainer.rl import RLTrainer
from easytrain.workers.weight_sync import WeightTransport

if importlib.util.find_spec("vllm") is None:  # imported where used: collecting without it is ~3 s faster
    pytest.skip("vllm is not installed", allow_module_level=True)
pytestmark = pytest.mark.slow
logger = logging.getLogger(__name__)

REWARD = '''
def reward(responses, truths):
    """Spread: longer responses score more, so every group has an advantage signal."""
    return [{"overall": min(len(r), 12) / 12.0, "accuracy": 0.0} for r in responses]
'''

STEPS = 6
SYNCED = 1e-4  # fp32 on CPU: vLLM's and the actor's log-probs of the same weights agree to ~1e-6


class SkippedSync(WeightTransport):
    def sync(self, actor: object, rollout: object) -> dict[str, float]:
        return {}


def _greedy(trainer: RLTrainer, probe: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens for the probe prompts and the engine's log-probs of them."""
    out = trainer.roles.rollout.call("generate", probe, 0, True)
    return out["responses"] * out["response_mask"].long(), out["rollout_log_probs"]


def test_grpo_with_vllm_syncs_every_step(ray_local: None, tmp_path: Path) -> None:
    reward_file = tmp_path / "spread.py"
    reward_file.write_text(REWARD)
    config = load([f"trainer.output_dir={tmp_path}", "+exp=tiny_vllm", f"reward.function={reward_file}:reward",
                   "data.synthetic_size=64", "data.max_response_length=6", "data.rollout_batch_size=8",
                   "worker.rollout.n=4", "worker.actor.global_batch_size=8",
                   "worker.actor.micro_batch_size_per_device_for_update=16", "worker.actor.optim.lr=1e-2",
                   "trainer.loggers=[jsonl]"])
    trainer = RLTrainer(config)
    try:
        prompts = trainer.data.train_batches()
        probe = next(trainer.data.train_batches())
        tokens, log_probs = first = _greedy(trainer, probe)
        records = []
        for step in range(1, STEPS + 1):
            trainer.step = step
            metrics = trainer.train_step(prompts).metrics
            records.append(metrics)
            assert metrics["actor/grad_norm"] > 0  # the update did something
            assert metrics["rollout/log_prob_diff_max"] < SYNCED, (step, metrics["rollout/log_prob_diff_max"])
            now_tokens, now_log_probs = _greedy(trainer, probe)
            changed = not torch.equal(now_tokens, tokens) or (now_log_probs - log_probs).abs().max() > 1e-5
            assert changed, f"the engine's greedy output is unchanged after update {step}"
            logger.info("step %d: greedy tokens changed: %s", step, not torch.equal(now_tokens, tokens))
            tokens, log_probs = now_tokens, now_log_probs
        assert not torch.equal(tokens, first[0])  # and over the run the greedy answers themselves changed
        rss = [m["memory/worker_rss_gb_max"] for m in records]  # the fused process: actor and vLLM engine
        logger.info("worker RSS per step (GB): %s", ", ".join(f"{r:.3f}" for r in rss))
        assert rss[-1] - rss[1] < 0.05, rss  # no growth across steps beyond noise (50 MB)

        trainer.roles.transport = SkippedSync()  # this step's weights never reach the engine...
        trainer.step += 1
        trainer.train_step(prompts)
        trainer.step += 1
        stale = trainer.train_step(prompts).metrics  # ...so the next rollout samples from the old weights
        assert stale["rollout/log_prob_diff_max"] > 100 * SYNCED, stale["rollout/log_prob_diff_max"]
    finally:
        trainer.close()

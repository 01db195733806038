"""The actor's update gradient, each ``worker.actor.loss_agg_mode`` with and without the KL loss, against the
published objective written out here, on the tiny Qwen2 in this process (one rank, no Ray).

The gradient is read where the real optimizer steps (a step pre-hook on the strategy's AdamW, clipping off),
after the actor's own loop over 4 micro batches of skewed response lengths. The expected gradient is that of
the whole mini batch's loss, computed here from the model's logits:

- PPO with clip-higher (DAPO): per token max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), r = pi / pi_old;
  dual clip for A < 0: min(that, -A c);
- the KL loss (use_kl_loss): kl_coef x k3 = exp(ref - logp) - (ref - logp) - 1, aggregated like the PPO term;
- token-mean: the sum over every response token / the token count; seq-mean-token-mean: each response's token
  mean, averaged over responses.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from easytrain.config import Config, with_overrides
from easytrain.config.schema import CHOICES, ActorConfig
from easytrain.distributed.batch import Batch
from easytrain.trainer.micro_batches import Forward, update_shares
from easytrain.workers.actor import ActorWorker
from easytrain.workers.forward import suppressed_tokens

from reference import aggregate, kl_estimate, ppo_token_loss
from rl_batches import grads, rl_config, rollout_batch

MODES = ("token-mean", "seq-mean-token-mean")
KL_COEF = 0.3
TEMPERATURE = 0.7
def log_probs_by_hand(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """log softmax(logits / T) of each response token, from the model's logits over the whole sequence."""
    attention = batch["attention_mask"]
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch["input_ids"], attention_mask=attention, position_ids=positions).logits
    responses = batch["responses"]
    width = responses.shape[1]
    scaled = logits[:, -width - 1:-1].float() / TEMPERATURE  # the logits at t predict token t + 1
    return torch.log_softmax(scaled, -1).gather(-1, responses[..., None]).squeeze(-1)


def expected_loss(model: torch.nn.Module, batch: Batch, config: Config) -> torch.Tensor:
    mask = batch["response_mask"].float()
    log_probs = log_probs_by_hand(model, batch)
    a, mode = config.worker.actor, config.worker.actor.loss_agg_mode
    token_loss = ppo_token_loss(log_probs, batch["old_log_probs"], batch["advantages"], a.clip_ratio_low,
                                a.clip_ratio_high, a.clip_ratio_dual)
    loss = aggregate(token_loss, mask, mode)
    if config.algorithm.use_kl_loss:
        loss = loss + KL_COEF * aggregate(kl_estimate(log_probs, batch["ref_log_probs"], "low_var_kl"), mask, mode)
    return loss


RATIOS = (0.7, 0.78, 0.82, 0.9, 1.1, 1.24, 1.31, 2.0, 2.9, 3.2)
"""pi / pi_old along each response (token t takes RATIOS[t % 10]): either side of 1 - eps_low = 0.8,
1 + eps_high = 1.28 and the dual clip c = 3, so moving any bound changes the gradient."""


def training_batch(model: torch.nn.Module, config: Config) -> Batch:
    """A rollout batch whose old log-probs put the ratios at RATIOS and whose reference is the current policy
    moved by noise; every ratio meets both advantage signs."""
    batch = rollout_batch(config, seed=1)
    mask = batch["response_mask"].float()
    with torch.no_grad():
        current = log_probs_by_hand(model, batch)
    width = current.shape[1]
    ratio = torch.tensor(RATIOS)[torch.arange(width) % len(RATIOS)].expand_as(current)
    old = current - ratio.log()
    ref = current + 0.5 * torch.randn(current.shape, generator=torch.Generator().manual_seed(5))
    signs = batch["advantages"].sign()
    for value in RATIOS:
        at = (ratio == value) & mask.bool()
        assert (signs[at] > 0).any() and (signs[at] < 0).any(), value
    return batch.union(Batch({"old_log_probs": old * mask, "ref_log_probs": ref * mask}))


def with_mode(config: Config, mode: str) -> Config:
    actor = dataclasses.replace(config.worker.actor, loss_agg_mode=mode)
    return dataclasses.replace(config, worker=dataclasses.replace(config.worker, actor=actor))


def update_gradients(worker: ActorWorker, batch: Batch) -> dict[str, torch.Tensor]:
    """The gradients the actor's optimizer steps with, from its real ``update`` (one optimizer step) over the
    micro batches the driver plans."""
    forward = Forward.of(worker.config, worker.setup_answer)  # type: ignore[attr-defined]
    steps, _ = update_shares(batch, len(batch), 1, forward)
    seen: list[dict[str, torch.Tensor]] = []
    model = worker.model
    optimizer = worker.strategy.optimizer  # type: ignore[union-attr]
    handle = optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append({n: p.grad.clone() for n, p in model.named_parameters()
                                               if p.grad is not None}))
    try:
        worker.update(steps[0], KL_COEF)
    finally:
        handle.remove()
    assert len(seen) == 1
    return seen[0]


def test_every_schema_mode_is_tested() -> None:
    field = {f.name: f for f in dataclasses.fields(ActorConfig)}["loss_agg_mode"]
    assert set(field.metadata[CHOICES]) == set(MODES)


@pytest.fixture(scope="module")
def actor(tmp_path_factory: pytest.TempPathFactory) -> ActorWorker:
    """One actor rank in this process (its weights move with every test's update; each test reads them first)."""
    config = rl_config(tmp_path_factory.mktemp("loss-modes"), "model.path=tiny:qwen2", "data.image_key=null",
                       "worker.rollout.n=2", "algorithm.kl_penalty=low_var_kl", "worker.actor.optim.max_grad_norm=0",
                       f"worker.rollout.temperature={TEMPERATURE}")
    worker = ActorWorker(config, role="actor", rank=0, world_size=1)
    worker.setup_answer = worker.setup(10)  # type: ignore[attr-defined]
    return worker


@pytest.mark.parametrize("use_kl_loss", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_update_gradient_is_the_gradient_of_the_published_loss(actor: ActorWorker, mode: str, use_kl_loss: bool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    config = with_overrides(actor.config, {"worker.actor.loss_agg_mode": mode,  # the worker reads them at each update
                                           "algorithm.use_kl_loss": use_kl_loss})
    monkeypatch.setattr(actor, "config", config)
    monkeypatch.setattr(actor, "cfg", config.worker.actor)
    model = actor.model
    assert suppressed_tokens(model.config) == []  # a text model: the plain softmax is the sampling distribution
    batch = training_batch(model, config)
    assert len(batch) == 8 and config.worker.actor.micro_batch_size_per_device_for_update == 2  # 4 micro batches

    model.train()
    expected_loss(model, batch, config).backward()
    expected = grads(model)
    other_mode = next(m for m in MODES if m != mode)
    expected_loss(model, batch, with_mode(config, other_mode)).backward()
    other = grads(model)
    got = update_gradients(actor, batch)

    assert got.keys() == expected.keys() and expected
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-7, msg=name)
    # the other mode's gradient differs on this batch, so the agreement above tells the modes apart
    assert any(not torch.allclose(other[n], g, rtol=1e-2, atol=1e-6) for n, g in expected.items())

"""Padding-free dynamic micro batches for the RL actor and reference, in one process.

A rollout batch with a skewed mix of response lengths (prompts with images
from the synthetic task) goes through the padded path and the padding-free
one: same log-probs, entropy and gradients, and the language model's
attention sees one flattened sequence of exactly the summed lengths. The
actor's update over token-budget micro batches planned by the driver gives
the same weights and metrics as fixed micro batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from easytrain.config import Config
from easytrain.memory.rl_shape import shares_prompts
from easytrain.trainer.micro_batches import Forward, token_lengths, update_shares
from easytrain.workers.actor import ActorWorker
from easytrain.workers.forward import response_log_probs, suppressed_tokens
from easytrain.workers.packed import packed_response_log_probs

from conftest import tiny_families
from rl_batches import assert_same_pass, grads, rl_config, rollout_batch


def actor(config: Config) -> ActorWorker:
    worker = ActorWorker(config, role="actor", rank=0, world_size=1)
    worker.setup_answer = worker.setup(10)  # type: ignore[attr-defined]
    return worker


@pytest.mark.parametrize("family", tiny_families("padding_free"))
def test_packed_log_probs_and_gradients_equal_padded(family: str, tmp_path: Path,
                                                     recorded_attention: list[dict[str, Any]]) -> None:
    extra = [f"model.path=tiny:{family}"] + (["data.image_key=null"] if family == "qwen2" else [])
    config = rl_config(tmp_path, *extra)
    batch = rollout_batch(config)
    model = actor(config).model
    mask = batch["response_mask"].bool()
    if family != "qwen2":
        assert batch["pixel_values"].shape[0] > 0 and "mm_token_type_ids" in batch

    padded_lp, padded_entropy = response_log_probs(model, batch, 1.0, torch.device("cpu"), with_entropy=True)
    padded_lp[mask].sum().backward()
    padded_grads = grads(model)
    recorded_attention.clear()
    packed_lp, packed_entropy = packed_response_log_probs(model, batch, 1.0, torch.device("cpu"),
                                                          suppressed_tokens(model.config), with_entropy=True)
    packed_lp[mask].sum().backward()
    packed_grads = grads(model)

    assert_same_pass((packed_lp, packed_entropy, packed_grads), (padded_lp, padded_entropy, padded_grads), mask)

    lengths = token_lengths(batch)
    total = sum(lengths)
    assert total < batch["attention_mask"].numel()  # the padded batch really holds padding
    text = model.config.text_config if hasattr(model.config, "text_config") else model.config
    assert len(recorded_attention) == text.num_hidden_layers
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    expected = (sample[:, None] == sample[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    for call in recorded_attention:  # batch 1, the summed lengths, samples kept apart causally
        assert call["query"][0] == 1 and call["query"][2] == total
        assert torch.equal(call["mask"].reshape(total, total).bool(), expected)


@pytest.mark.parametrize("by_prompt", [False, True])
def test_dynamic_update_equals_fixed_micro_batches(by_prompt: bool, tmp_path: Path) -> None:
    """Token-budget micro batches (by_prompt: whole prompts run prompt-once, worker.actor.share_prompt) update
    the weights as fixed micro batches of the plain forward do."""
    fixed_cfg = rl_config(tmp_path, "algorithm.use_kl_loss=false", "worker.actor.share_prompt=false")
    budget = 220
    dynamic_cfg = rl_config(tmp_path, "algorithm.use_kl_loss=false", "worker.actor.padding_free=true",
                            f"worker.actor.max_token_len_per_device={budget}", "data.max_prompt_length=100",
                            f"worker.actor.share_prompt={str(by_prompt).lower()}")
    assert shares_prompts(dynamic_cfg) == by_prompt
    batch = rollout_batch(fixed_cfg)
    lengths = token_lengths(batch)
    per_step = fixed_cfg.worker.actor.global_batch_size * fixed_cfg.worker.rollout.n
    fixed, dynamic = actor(fixed_cfg), actor(dynamic_cfg)
    forward = Forward.of(dynamic_cfg, dynamic.setup_answer)
    assert forward.packed and forward.share_prompt == by_prompt
    steps, plans = update_shares(batch, per_step, 1, forward)
    fixed_steps, _ = update_shares(batch, per_step, 1, Forward.of(fixed_cfg, fixed.setup_answer))
    assert [len(m) for m in fixed_steps[0][0]] == [2] * 4  # the padded plan: micro batches of 2 samples
    micro_sizes = sorted(len(m) for m in plans[0][0])
    assert micro_sizes != [2] * 4, micro_sizes  # token-budget micro batches, not the fixed count of 2
    if by_prompt:  # whole prompts, each prompt's tokens counted once
        uids = batch.meta["uids"]
        for micro in plans[0][0]:
            assert sorted(micro) == [i for i in range(len(batch)) if uids[i] in {uids[j] for j in micro}]
        prompt_width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
        prompt_tokens = batch["attention_mask"][:, :prompt_width].sum(-1)
        for micro in plans[0][0]:
            rows = {uids[i]: [j for j in micro if uids[j] == uids[i]] for i in micro}
            once = sum(lengths[i] for i in micro) - sum(int(prompt_tokens[r[0]]) * (len(r) - 1)
                                                        for r in rows.values())
            assert once <= budget
        assert max(sum(lengths[i] for i in m) for m in plans[0][0]) > budget  # counted once, more fit
    else:
        assert all(sum(lengths[i] for i in m) <= budget for m in plans[0][0])

    a = fixed.update(fixed_steps[0], 0.0)
    b = dynamic.update(steps[0], 0.0)
    for key in ("actor/pg_loss_sum", "actor/entropy_sum", "actor/tokens", "actor/grad_norm_sum",
                "actor/clipfrac_sum"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    moved = 0.0
    initial = actor(fixed_cfg).model.state_dict()
    for (name, p), (_, q) in zip(fixed.model.named_parameters(), dynamic.model.named_parameters()):
        if name.endswith("k_proj.bias"):  # its gradient is 0 in exact arithmetic (softmax ignores a per-query
            continue                      # constant): Adam turns the rounding noise into +-lr steps
        # Adam's first step is ~lr x sign(gradient): an element whose gradient is rounding noise can move by
        # a few 1e-6 either way, so nearly all elements must agree tightly and every one within 1e-5
        close = (q.detach() - p.detach()).abs() <= 2e-6 + 1e-4 * p.detach().abs()
        assert float(close.float().mean()) >= 0.999, name
        torch.testing.assert_close(q.detach(), p.detach(), rtol=0, atol=1e-5, msg=name)
        moved = max(moved, float((p.detach() - initial[name]).abs().max()))
    assert moved > 1e-4  # the update did something, so the agreement means something


def test_prompt_plan_falls_back_to_samples_when_whole_prompts_cannot_fill_every_member() -> None:
    """3 prompts x 2 samples over 2 members: whole prompts (70 tokens each, a budget of 110) would leave one member
    a micro batch short; the plan takes samples instead of failing."""
    from easytrain.distributed.batch import Batch
    from easytrain.trainer.micro_batches import packed_indices

    mask = torch.ones(6, 60, dtype=torch.long)
    batch = Batch({"attention_mask": mask, "responses": torch.zeros(6, 10, dtype=torch.long)},
                  {"uids": ["a", "a", "b", "b", "c", "c"]})
    result = packed_indices(batch, 2, 110, by_prompt=True)
    assert sorted(i for member in result for micro in member for i in micro) == list(range(6))
    assert len({len(member) for member in result}) == 1  # the same number of micro batches on both members
    assert all(60 * len(micro) <= 110 for member in result for micro in member)

"""Prompt-shared forward passes (``worker.actor.share_prompt``) against the plain ones, in one process.

A GRPO micro batch holds each prompt n times; the shared pass lays each
prompt out once with its responses after it. Log-probs, entropy and
gradients must equal the plain padded pass's, the language model must see
each prompt once (fewer tokens, one image per prompt through the vision
tower), and a response must not see another response of its prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from easytrain.distributed.batch import Batch
from easytrain.workers.actor import ActorWorker
from easytrain.workers.forward import log_probs_of, response_log_probs
from easytrain.models.families import family_of
from easytrain.workers.shared_prompt import (prompt_and_response_tokens, prompt_groups, rows_pay_off, shared_inputs,
                                             text_config)

from conftest import tiny_families
from rl_batches import assert_same_pass, grads, planned, rl_config, rollout_batch

CPU = torch.device("cpu")


def family_config(tmp_path: Path, family: str, *extra: str) -> Any:
    overrides = [f"model.path=tiny:{family}", "worker.rollout.n=4"] + (["data.image_key=null"] if family == "qwen2" else [])
    return rl_config(tmp_path, *overrides, *extra)


def actor_model(config: Any) -> torch.nn.Module:
    worker = ActorWorker(config, role="actor", rank=0, world_size=1)
    worker.setup(10)
    return worker.model


def vision_patches(model: torch.nn.Module) -> list[int]:
    """Rows of ``pixel_values`` (patch rows, or tiles) the vision tower is given per call, before image dedup's
    hook picks the distinct ones (records into the returned list)."""
    seen: list[int] = []
    tower = family_of(model).vision_tower(model)

    def record(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        pixels = args[0] if args else kwargs.get("pixel_values", kwargs.get("hidden_states"))
        seen.append(int(pixels.shape[0]))

    if tower is not None:
        tower.register_forward_pre_hook(record, with_kwargs=True, prepend=True)
    return seen


@pytest.mark.parametrize("family", tiny_families("shared_prompt"))
@pytest.mark.parametrize("packed", [False, True])
def test_shared_prompt_equals_plain(family: str, packed: bool, tmp_path: Path,
                                    recorded_attention: list[dict[str, Any]]) -> None:
    config = family_config(tmp_path, family)
    batch = rollout_batch(config)
    # shuffle: a prompt's samples need not be next to each other
    order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(3)).tolist()
    batch = batch.select(order)
    model = actor_model(config)
    mask = batch["response_mask"].bool()
    groups = prompt_groups(batch)
    assert sorted(len(g) for g in groups) == [4] * (len(batch) // 4)
    patches = vision_patches(model)

    plain_lp, plain_entropy = response_log_probs(model, batch, 1.0, CPU, with_entropy=True)
    (plain_lp[mask] * torch.linspace(-1, 1, int(mask.sum()))).sum().backward()  # uneven weights: a real gradient
    plain_grads = grads(model)
    recorded_attention.clear()
    patches.clear()
    shared_lp, shared_entropy = log_probs_of(model, planned(batch, model, packed, True), 1.0, CPU,
                                             with_entropy=True)
    (shared_lp[mask] * torch.linspace(-1, 1, int(mask.sum()))).sum().backward()
    shared_grads = grads(model)

    assert_same_pass((shared_lp, shared_entropy, shared_grads), (plain_lp, plain_entropy, plain_grads), mask)

    # each prompt once: padding-free, one row of exactly each prompt once and every response; padded, a row per
    # prompt holding its prompt and its responses' tokens, nothing more
    prompt_tokens, response_tokens = prompt_and_response_tokens(batch)
    units = [int(prompt_tokens[g[0]] + response_tokens[g].sum()) for g in groups]
    rows, length = (1, sum(units)) if packed else (len(groups), max(units))
    assert sum(units) < int(batch["attention_mask"].sum())
    if not packed:
        assert rows_pay_off(batch, groups, text_config(model).hidden_size)  # the case this test is about
    assert len(recorded_attention) == text_config(model).num_hidden_layers
    for call in recorded_attention:
        assert call["query"][0] == rows and call["query"][2] == length
    if family != "qwen2":  # the vision tower was given each prompt's image once, not n copies
        leads = batch.select([g[0] for g in groups])
        assert patches == [leads["pixel_values"].shape[0]]
        assert leads["pixel_values"].shape[0] * 4 == batch["pixel_values"].shape[0]


def test_responses_of_one_prompt_do_not_see_each_other(tmp_path: Path) -> None:
    """Changing one response changes no other response's log-probs (and the mask says why)."""
    config = family_config(tmp_path, "qwen2_5_vl")
    batch = rollout_batch(config)
    model = actor_model(config).eval()
    with torch.no_grad():
        before, _ = log_probs_of(model, planned(batch, model, False, True), 1.0, CPU)
        responses = batch["responses"].clone()
        responses[0, :3] = (responses[0, :3] + 7) % 200 + 20
        ids = batch["input_ids"].clone()
        ids[0, -responses.shape[1]:] = responses[0] * batch["response_mask"][0]
        changed = batch.union(Batch({"responses": responses, "input_ids": ids}))
        after, _ = log_probs_of(model, planned(changed, model, False, True), 1.0, CPU)
    mask = batch["response_mask"].bool()
    assert not torch.equal(before[0][mask[0]], after[0][mask[0]])  # the changed response itself moved
    torch.testing.assert_close(after[1:][mask[1:]], before[1:][mask[1:]], rtol=0, atol=0)

    inputs, _, _ = shared_inputs(batch, prompt_groups(batch), family_of({"model_type": "qwen2_5_vl"}), torch.float32, eager=False)
    allowed = inputs["attention_mask"][0, 0]
    prompt_len = int(batch["attention_mask"][0, :batch["input_ids"].shape[1] - batch["responses"].shape[1]].sum())
    first = int(batch["attention_mask"][0, -batch["responses"].shape[1]:].sum())
    assert allowed[prompt_len + first, :prompt_len].all()  # the second response sees the whole prompt
    assert not allowed[prompt_len + first, prompt_len:prompt_len + first].any()  # and none of the first response


def test_eager_attention_and_switch_off(tmp_path: Path) -> None:
    """eager attention takes the additive form of the mask; share_prompt=false keeps the plain pass."""
    config = family_config(tmp_path, "qwen2_5_vl", "model.attn_implementation=eager")
    batch = rollout_batch(config)
    model = actor_model(config).eval()
    assert model.config._attn_implementation == "eager"
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        plain, _ = response_log_probs(model, batch, 1.0, CPU)
        shared, _ = log_probs_of(model, planned(batch, model, False, True), 1.0, CPU)
        calls: list[int] = []
        handle = model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape[0]),
                                                 with_kwargs=True)
        off, _ = log_probs_of(model, planned(batch, model, False, False), 1.0, CPU)
        handle.remove()
    torch.testing.assert_close(shared[mask], plain[mask], rtol=1e-5, atol=1e-5)
    assert torch.equal(off, plain) and calls == [len(batch)]


def test_no_repeats_runs_the_plain_pass(tmp_path: Path) -> None:
    """Every prompt once: nothing to share; the plain pass runs, bit for bit."""
    config = family_config(tmp_path, "qwen2_5_vl")
    full = rollout_batch(config)
    batch = full.select(range(0, len(full), 4))  # one sample of each prompt
    assert all(len(g) == 1 for g in prompt_groups(batch))
    model = actor_model(config).eval()
    with torch.no_grad():
        plain, _ = response_log_probs(model, batch, 1.0, CPU)
        shared, _ = log_probs_of(model, planned(batch, model, False, True), 1.0, CPU)
    assert torch.equal(plain, shared)


def test_shared_prompt_under_gradient_checkpointing(tmp_path: Path) -> None:
    """Recomputed layers see the same prepared mask: gradients still equal the plain pass's."""
    config = family_config(tmp_path, "qwen2_5_vl", "model.gradient_checkpointing=true")
    batch = rollout_batch(config)
    model = actor_model(config).train()
    mask = batch["response_mask"].bool()
    weights = torch.linspace(-1, 1, int(mask.sum()))
    passes = []
    for share in (False, True):
        lp, entropy = log_probs_of(model, planned(batch, model, False, share), 1.0, CPU, with_entropy=True)
        (lp[mask] * weights).sum().backward()
        passes.append((lp.detach(), entropy.detach(), grads(model)))  # type: ignore[union-attr]
    assert_same_pass(passes[1], passes[0], mask)


def synthetic(prompt: int, response: int, n: int) -> Batch:
    """n samples of one prompt: only the shapes the cost check reads."""
    mask = torch.ones(n, prompt + response, dtype=torch.long)
    return Batch({"attention_mask": mask, "responses": torch.zeros(n, response, dtype=torch.long)})


def test_rows_pay_off_only_when_cheaper() -> None:
    """A row per prompt replaces n plain rows: worth it for long prompts, not for long responses (a row of n long
    responses costs attention in the square of its length)."""
    group = [list(range(8))]
    assert rows_pay_off(synthetic(500, 10, 8), group, hidden=64)
    assert rows_pay_off(synthetic(62, 32, 4), [list(range(4))], hidden=256)  # the bench's shape
    assert not rows_pay_off(synthetic(10, 500, 8), group, hidden=64)
    assert not rows_pay_off(synthetic(10, 4000, 8), group, hidden=4096)

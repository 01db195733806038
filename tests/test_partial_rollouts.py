"""Partial rollouts (issue 51): a response left unfinished by one engine call is continued by the next, under the
weights a sync brought in between; every token records the version that sampled it and the log-prob the PPO
ratio will use, which must be the sampling weights' own, as a teacher-forced forward computes it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from easytrain.distributed.batch import Batch
from easytrain.models.families import family_of
from easytrain.workers.forward import response_log_probs
from easytrain.workers.rollout.engine import SamplingParams
from easytrain.workers.rollout.hf_engine import HFEngine
from easytrain.workers.rollout.partial import PartialRollouts
from easytrain.workers.sequences import assemble

from test_decode import CPU, setup

FIRST = 4
"""Tokens of the first call, under version 0; the rest come under version 1."""


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2"])
def test_a_response_continued_across_a_weight_sync_keeps_each_tokens_version_and_log_prob(family: str,
                                                                                       tmp_path: Path) -> None:
    model, prompts, tokenizer, stops = setup(tmp_path, family)
    before = copy.deepcopy(model)  # the weights of version 0, for the independent forward
    engine = HFEngine(model, stops, tokenizer.pad_token_id, CPU)
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=10, seed=3)
    rollouts = PartialRollouts(prompts, params, tokenizer.pad_token_id, stops)
    rollouts.advance(engine, FIRST, version=0)
    unfinished = rollouts.running
    assert unfinished  # some responses wait for the next call

    generator = torch.Generator().manual_seed(1)  # the sync: other weights, streamed in as a sync streams them
    new = {name: p + 0.5 * p.std() * torch.randn(p.shape, generator=generator) if p.dim() == 2 else p.clone()
           for name, p in model.state_dict().items()}
    engine.begin_weight_update()
    engine.load_weights(new.items())
    engine.finish_weight_update()
    while rollouts.running:
        rollouts.advance(engine, 3, version=1)

    out = rollouts.output(range(len(rollouts.samples)))
    mask = out["response_mask"].bool()
    lengths = mask.sum(-1)
    versions = out["token_versions"]
    for row, length in enumerate(lengths.tolist()):
        expected = [0] * min(FIRST, length) + [1] * max(0, length - FIRST)
        assert versions[row, :length].tolist() == expected
        assert (versions[row, length:] == -1).all()
    assert (versions[mask] == 1).any() and (versions[mask] == 0).any()

    batch = assemble(prompts, out, params.n, family_of(model))
    old, _ = response_log_probs(before.eval(), batch, params.temperature, CPU)
    now, _ = response_log_probs(model.eval(), batch, params.temperature, CPU)
    expected = torch.where(versions == 0, old, now)
    torch.testing.assert_close(out["rollout_log_probs"][mask], expected[mask], rtol=1e-4, atol=1e-4)
    later = mask & (versions == 1)
    assert (old[later] - now[later]).abs().max() > 1e-2  # the sync changed what the continued tokens are worth


def prompt_side(batch: Batch, row: int) -> dict[str, torch.Tensor]:
    """What sample ``row`` of an assembled batch gives the model besides its response: its prompt tokens, their
    token types and position ids (the columns its attention mask keeps before the responses), its images' grids
    and patch rows."""
    width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    keep = batch["attention_mask"][row, :width].bool()
    positions = batch["position_ids"]
    one = batch.select([row])
    return {"ids": batch["input_ids"][row, :width][keep], "types": batch["mm_token_type_ids"][row, :width][keep],
            "positions": (positions[:, row] if positions.dim() == 3 else positions[row])[..., :width][..., keep],
            "grids": one["image_grid_thw"], "pixels": one["pixel_values"]}


def wider(prompts: Batch, columns: int) -> Batch:
    """``prompts`` with ``columns`` more columns of left padding (a batch whose longest prompt was longer)."""
    tensors = dict(prompts.tensors)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        tensors[key] = torch.nn.functional.pad(tensors[key], (columns, 0))
    return Batch(tensors, prompts.meta, prompts.image_counts, prompts.pixels)


def test_a_sample_trains_on_the_same_images_and_prompt_in_both_modes(tmp_path: Path) -> None:
    """trainer.rollout_mode=async assembles each finished group on its own and joins groups of other widths; a
    sample must still carry what a sync rollout of the same prompt carries: its image's patch rows and grid, its
    prompt's tokens, types and multimodal positions."""
    from easytrain.workers.sequences import join_assembled

    model, prompts, tokenizer, stops = setup(tmp_path, "qwen2_5_vl")
    engine = HFEngine(model, stops, tokenizer.pad_token_id, CPU)
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=10, seed=3)
    family = family_of(model)
    sync = assemble(prompts, engine.generate(prompts, params), params.n, family)
    half = len(prompts) // 2
    batches = [prompts.select(range(half)), wider(prompts.select(range(half, len(prompts))), 3)]
    groups = []
    for batch in batches:  # two loader batches, of other prompt widths
        rollouts = PartialRollouts(batch, params, tokenizer.pad_token_id, stops)
        for version in range(5):
            rollouts.advance(engine, 3, version)
            groups += rollouts.finished_groups(family)
        assert not rollouts.running
    partial = join_assembled(groups[::-1])  # finished in another order than the prompts'
    assert partial.image_counts is not None and int(partial.image_counts.sum()) == int(sync.image_counts.sum())
    for row, uid in enumerate(partial.meta["uids"]):
        twin = sync.meta["uids"].index(uid)
        mine, theirs = prompt_side(partial, row), prompt_side(sync, twin)
        assert len(mine["pixels"]) > 0
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), (uid, key)

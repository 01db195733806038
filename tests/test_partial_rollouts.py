"""Partial rollouts (issue 51): a response left unfinished by one engine call is continued by the next, under the
weights a sync brought in between; every token records the version that sampled it and the log-prob the PPO
ratio will use, which must be the sampling weights' own, as a teacher-forced forward computes it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

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

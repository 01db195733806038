"""Each distinct image through the vision tower once per forward (``model.dedupe_images``): the same log-probs,
gradients and greedy rollouts as running every copy, with 1/n of the images computed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from easytrain.models.families import family_of
from easytrain.models.hf import load_model, model_folder
from easytrain.models.image_dedup import distinct_images
from easytrain.workers.forward import response_log_probs

from conftest import tiny_families
from rl_batches import rl_config, rollout_batch


def test_distinct_images_needs_equal_pixels_not_just_equal_sums() -> None:
    grid = torch.tensor([[1, 2, 2], [1, 2, 2], [1, 2, 2], [1, 4, 2]])
    a = torch.arange(12.0).reshape(4, 3)
    swapped = a.flip(0)  # same sums, other pixels
    pixels = torch.cat([a, swapped, a, torch.ones(8, 3)])
    firsts, owner = distinct_images(pixels, grid)
    assert firsts == [0, 1, 3] and owner == [0, 1, 0, 2]


@pytest.mark.parametrize("family", tiny_families("image_dedup", images=True))
def test_deduped_tower_gives_the_same_log_probs_and_gradients(family: str, tmp_path: Path) -> None:
    config = rl_config(tmp_path, f"model.path=tiny:{family}", "worker.rollout.n=4")
    batch = rollout_batch(config)
    images = int(batch.image_counts.sum())  # type: ignore[union-attr]
    assert images == len(batch) and batch["image_grid_thw"].shape[0] == images  # every row carries its copy
    folder = model_folder(config.model)
    plain, deduped = load_model(config.model, folder), load_model(config.model, folder)
    stats = family_of(deduped).dedupe_images(deduped)
    assert stats is not None
    mask = batch["response_mask"].bool()
    results = []
    for model in (plain, deduped):
        log_probs, _ = response_log_probs(model, batch, 1.0, torch.device("cpu"))
        log_probs[mask].sum().backward()
        results.append((log_probs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                             if p.grad is not None}))
    if family in ("internvl", "gemma3"):  # a batch of tiles or images: 4 copies of each; tiles may be equal too
        tiles = batch["pixel_values"].shape[0]
        assert len(stats.calls) == 1 and stats.calls[0][0] == tiles and stats.calls[0][1] <= tiles // 4
    else:
        assert stats.calls == [(images, images // 4)]  # n=4 copies of each prompt's image: a quarter computed
    torch.testing.assert_close(results[1][0][mask], results[0][0][mask], rtol=1e-5, atol=1e-5)
    assert results[0][1].keys() == results[1][1].keys()
    tower = family_of(plain).vision_tower(plain)
    assert tower is not None
    tower_names = {id(p) for p in tower.parameters()}
    visual = [n for n, p in plain.named_parameters() if id(p) in tower_names and n in results[0][1]]
    assert visual  # the tower trains, so its gradients (summed over the copies) are compared too
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_greedy_rollout_is_unchanged_and_prefills_each_image_once(tmp_path: Path) -> None:
    from easytrain.trainer.data import RLData
    from easytrain.workers.rollout.engine import SamplingParams
    from easytrain.workers.rollout.hf_engine import HFEngine

    config = rl_config(tmp_path)
    prompts = next(RLData(config).train_batches())
    folder = model_folder(config.model)
    params = SamplingParams(n=3, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=6)
    outputs = []
    for dedupe in (False, True):
        model = load_model(config.model, folder)
        stats = family_of(model).dedupe_images(model) if dedupe else None
        engine = HFEngine(model, [0], 1, torch.device("cpu"))
        outputs.append(engine.transformers_generate(prompts, params))  # a prefill per row: n of each image
        if stats is not None:
            assert stats.calls[0] == (3 * len(prompts), len(prompts))  # the prefill: each image once
    assert torch.equal(outputs[0]["responses"], outputs[1]["responses"])
    torch.testing.assert_close(outputs[1]["rollout_log_probs"], outputs[0]["rollout_log_probs"], rtol=1e-5,
                               atol=1e-5)

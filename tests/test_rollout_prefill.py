"""The hf rollout engine prefills each prompt once for its n samples (``worker.rollout.share_prefill``): the
same responses and log-probs as n prefills, greedy and sampled, for a VL model with images and a text model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from easytrain.models.hf import load_model, model_folder
from easytrain.trainer.data import RLData
from easytrain.workers.rollout.engine import SamplingParams
from easytrain.workers.rollout.hf_engine import HFEngine

from rl_batches import rl_config


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("drop_finished", [False, True])  # transformers generate, or easytrain's decode loop
def test_shared_prefill_gives_the_same_rollout(family: str, temperature: float, drop_finished: bool,
                                               tmp_path: Path) -> None:
    extra = [f"model.path=tiny:{family}"] + (["data.image_key=null"] if family == "qwen2" else [])
    config = rl_config(tmp_path, *extra)
    data = RLData(config)
    prompts = next(data.train_batches())
    assert int(prompts["attention_mask"].sum(-1).min()) < prompts["attention_mask"].shape[1]  # left padding
    model = load_model(config.model, model_folder(config.model))
    stop = [data.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    params = SamplingParams(n=3, temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=8, seed=7)
    calls: list[int] = []
    hook = model.register_forward_pre_hook(lambda m, a, k: calls.append(int(k["input_ids"].shape[0])),
                                           with_kwargs=True)
    outputs = {}
    for shared in (False, True):
        calls.clear()
        outputs[shared] = HFEngine(model, stop, data.tokenizer.pad_token_id, torch.device("cpu"),
                                   share_prefill=shared, drop_finished=drop_finished).generate(prompts, params)
        rows = len(prompts) * params.n
        assert calls[0] == (len(prompts) if shared else rows)  # the prefill: once per prompt, or per row
        assert all(c == rows for c in calls[1:])
    hook.remove()
    assert torch.equal(outputs[True]["responses"], outputs[False]["responses"])
    assert torch.equal(outputs[True]["response_mask"], outputs[False]["response_mask"])
    torch.testing.assert_close(outputs[True]["rollout_log_probs"], outputs[False]["rollout_log_probs"],
                               rtol=1e-5, atol=1e-5)
    if temperature > 0:  # sampled rows of one prompt differ: the shared cache did not make them copies
        responses = outputs[True]["responses"]
        assert any(not torch.equal(responses[0], responses[j]) for j in (1, 2)) or \
            any(not torch.equal(responses[3], responses[j]) for j in (4, 5))

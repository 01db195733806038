"""The HF engine's own decoding loop (each prompt prefilled once for its n samples, finished rows leaving the
batch) against transformers ``generate`` (:meth:`HFEngine.transformers_generate`, each row prefilled).

Greedy decoding must give generate's tokens, also when rows stop early and
leave the batch; sampling must give generate's draws while no row has
stopped; and with rows stopping, every recorded log-prob must be the one a
teacher-forced forward of the finished sequences gives (the cache, positions
and masks of the rows still running stayed right after others left).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from easytrain.distributed.batch import Batch
from easytrain.models.families import family_of
from easytrain.models.hf import load_model, model_folder
from easytrain.trainer.data import RLData
from easytrain.workers.forward import response_log_probs
from easytrain.workers.rollout.engine import SamplingParams
from easytrain.workers.rollout.hf_engine import HFEngine
from easytrain.workers.sequences import assemble

from rl_batches import rl_config

CPU = torch.device("cpu")


def setup(tmp_path: Path, family: str) -> tuple[Any, Batch, Any, list[int]]:
    text_only = family in ("qwen2", "qwen2_5_vl_text")  # the last: a VL model given text-only prompts
    extra = [f"model.path=tiny:{family.removesuffix('_text')}"] + (["data.image_key=null"] if text_only else [])
    config = rl_config(tmp_path, *extra)
    data = RLData(config)
    prompts = next(data.train_batches())
    model = load_model(config.model, model_folder(config.model))
    # the random tiny model's greedy choice is one token whatever the context; larger weights make it vary
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 2.0 / param.shape[1] ** 0.5, generator=generator)
    return model, prompts, data.tokenizer, [data.tokenizer.convert_tokens_to_ids("<|im_end|>")]


def engine(model: Any, stops: list[int], pad: int) -> HFEngine:
    return HFEngine(model, stops, pad, CPU)


def forward_rows(model: Any) -> tuple[list[int], Any]:
    rows: list[int] = []
    handle = model.register_forward_pre_hook(lambda m, a, k: rows.append(int(k["input_ids"].shape[0])),
                                             with_kwargs=True)
    return rows, handle


def early_stop_tokens(model: Any, prompts: Batch, stops: list[int], pad: int, params: SamplingParams) -> list[int]:
    """Stop ids that end some rows early and leave others running: of the tokens a first run produced, the one
    that would give the rows the most distinct lengths (some ending, some running to the end)."""
    first = engine(model, stops, pad).transformers_generate(prompts, params)["responses"]
    steps = first.shape[1]

    def lengths(token: int) -> torch.Tensor:
        hit = first == token
        return torch.where(hit.any(-1), hit.float().argmax(-1) + 1, torch.tensor(steps))

    candidates = [int(t) for t in first.unique() if int(t) not in stops and int(t) != pad]
    best = max(candidates, key=lambda t: (len(lengths(t).unique()), int((lengths(t) == steps).sum() > 0)))
    assert len(lengths(best).unique()) > 1, "no token of the first run gives rows of different lengths"
    return stops + [best]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2", "qwen2_5_vl_text"])
def test_greedy_equals_generate_with_rows_leaving(family: str, tmp_path: Path) -> None:
    model, prompts, tokenizer, stops = setup(tmp_path, family)
    pad = tokenizer.pad_token_id
    params = SamplingParams(n=3, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=10, seed=5)
    stops = early_stop_tokens(model, prompts, stops, pad, params)
    rows, handle = forward_rows(model)
    ours = engine(model, stops, pad).generate(prompts, params)
    handle.remove()
    theirs = engine(model, stops, pad).transformers_generate(prompts, params)
    assert torch.equal(ours["responses"], theirs["responses"])
    assert torch.equal(ours["response_mask"], theirs["response_mask"])
    torch.testing.assert_close(ours["rollout_log_probs"], theirs["rollout_log_probs"], rtol=1e-5, atol=1e-5)
    lengths = ours["response_mask"].sum(-1)
    assert lengths.min() < lengths.max()  # some rows stopped early, others went on
    decode_rows = rows[1:]
    assert rows[0] == len(prompts)  # the prefill: once per prompt, its cache copied to its n rows
    assert decode_rows == sorted(decode_rows, reverse=True) and decode_rows[-1] < len(prompts) * params.n
    # each decode forward ran exactly the rows whose response was still going
    expected = [int((lengths > step).sum()) for step in range(1, int(lengths.max()))]
    assert decode_rows == expected


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2"])
def test_sampling_equals_generate_until_a_row_stops(family: str, tmp_path: Path) -> None:
    model, prompts, tokenizer, _ = setup(tmp_path, family)
    never = [int(model.config.image_token_id)] if family != "qwen2" else [tokenizer.pad_token_id + 10**6]
    params = SamplingParams(n=4, temperature=0.9, top_p=0.95, top_k=50, max_new_tokens=12, seed=11)
    ours = engine(model, never, tokenizer.pad_token_id).generate(prompts, params)
    theirs = engine(model, never, tokenizer.pad_token_id).transformers_generate(prompts, params)
    assert torch.equal(ours["responses"], theirs["responses"])  # the same draws from the same seed
    torch.testing.assert_close(ours["rollout_log_probs"], theirs["rollout_log_probs"], rtol=1e-5, atol=1e-5)
    assert len(set(map(tuple, ours["responses"].tolist()))) > len(prompts)  # really sampled: the shared cache
    # did not make a prompt's rows copies


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2"])
def test_sampled_log_probs_match_a_forward_after_rows_leave(family: str, tmp_path: Path) -> None:
    model, prompts, tokenizer, stops = setup(tmp_path, family)
    pad = tokenizer.pad_token_id
    params = SamplingParams(n=4, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12, seed=3)
    stops = early_stop_tokens(model, prompts, stops, pad, params)
    rows, handle = forward_rows(model)
    out = engine(model, stops, pad).generate(prompts, params)
    handle.remove()
    lengths = out["response_mask"].sum(-1)
    assert lengths.min() < lengths.max() and min(rows[1:]) < len(prompts) * params.n  # rows left the batch
    batch = assemble(prompts, out, params.n, family_of(model))
    forward, _ = response_log_probs(model.eval(), batch, params.temperature, CPU)
    mask = out["response_mask"].bool()
    torch.testing.assert_close(out["rollout_log_probs"][mask], forward[mask], rtol=1e-4, atol=1e-4)
    for row, length in enumerate(lengths.long().tolist()):  # a response ends at its first stop token, pad after
        tokens = out["responses"][row]
        assert all(int(t) not in stops for t in tokens[:length - 1])
        assert length == tokens.shape[0] or int(tokens[length - 1]) in stops
        assert (tokens[length:] == pad).all()


def test_vllm_ban_of_the_vision_placeholders_is_a_few_logit_biases() -> None:
    """Issue 23: vLLM's GPU runner takes at most 1024 allowed token ids and 1024 logit biases; Qwen2.5-VL's
    vocabulary has 152,064 ids, so its four vision placeholders are banned by bias, at vLLM's floor."""
    from easytrain.config import load
    from easytrain.memory.params import hf_config_object
    from easytrain.models.shapes import hf_config_for
    from easytrain.workers.forward import suppressed_tokens
    from easytrain.workers.rollout.vllm_engine import BAN_BIAS, ban

    hf = hf_config_object(hf_config_for(load(["+exp=qwen25vl_7b"]).model))
    placeholders = suppressed_tokens(hf)
    bias = ban(placeholders, hf.text_config.vocab_size)
    assert hf.text_config.vocab_size == 152_064 and len(placeholders) == 4
    assert bias == {t: -100.0 for t in placeholders} and BAN_BIAS == -100.0
    assert ban([], 10) is None and ban([3, 12], 10) == {3: BAN_BIAS}  # ids beyond the vocabulary are dropped

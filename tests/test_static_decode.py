"""The HF engine's static-cache decode loop (``worker.rollout.static_cache``) against ``generate`` and the dynamic
loop, run eagerly on CPU (on CUDA the same step is compiled into CUDA graphs: tests/gpu/test_static_decode_gpu.py).

Greedy decoding must give generate's tokens and the dynamic loop's, for a text model and a VL model (with images,
and given text only), one and several samples per prompt (the prefill shared by a prompt's rows), with rows stopping at
different steps (finished rows stay in the batch: every decode forward has all rows); sampling must give the
dynamic loop's draws while no row has stopped; and with rows stopping, every sampled log-prob must be the one a
teacher-forced forward of the finished sequences gives. The prompts are left-padded and the cache is longer than
what is written, so a wrong padding mask, a wrong slot or a wrong position changes tokens or log-probs.

Log-prob tolerance: both loops compute in float32 and differ only in how attention sums (over the written slots,
or over the whole static cache with the unwritten ones masked to zero weight), a few ulps (1.2e-7 relative) on
logits of order 1-10; 1e-5 absolute/relative is ~100 ulps of slack, while one token attended wrongly moves a
log-prob of this model by more than 1e-2.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import test_decode as dynamic_tests
from easytrain.config import load
from easytrain.distributed.batch import Batch
from easytrain.models.families import family_of
from easytrain.workers.forward import response_log_probs, suppressed_tokens
from easytrain.workers.rollout.decode import decode
from easytrain.workers.rollout.engine import SamplingParams
from easytrain.workers.rollout.hf_engine import GENERATE_INPUTS, HFEngine
from easytrain.workers.rollout.static_decode import (CACHE_BUCKET, CUDA_COMPILE, StaticDecoder, cache_length,
                                                      unsupported, wants_static)
from easytrain.workers.sequences import assemble

CPU = torch.device("cpu")
TOL = dict(rtol=1e-5, atol=1e-5)


def engine(model: Any, stops: list[int], pad: int, path: str) -> HFEngine:
    """``static``: the static-cache loop; ``dynamic``: rows leave the batch (``transformers_generate``: the
    reference)."""
    return HFEngine(model, stops, pad, CPU, static_cache="on" if path == "static" else "off")


def static_engine_rows(model: Any, stops: list[int], pad: int, prompts: Batch,
                       params: SamplingParams) -> tuple[Batch, list[int], HFEngine]:
    rows, handle = dynamic_tests.forward_rows(model)
    try:
        ours = engine(model, stops, pad, "static")
        out = ours.generate(prompts, params)
    finally:
        handle.remove()
    return out, rows, ours


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5_vl", "qwen2_5_vl_text"])  # the last: a VL model, text only
@pytest.mark.parametrize("n", [1, 3])
def test_greedy_static_equals_generate_and_dynamic(family: str, n: int, tmp_path: Path) -> None:
    model, prompts, tokenizer, stops = dynamic_tests.setup(tmp_path, family)
    pad = tokenizer.pad_token_id
    assert (prompts["attention_mask"] == 0).any()  # left padding: the static mask must hide it
    assert ("image_grid_thw" in prompts) == (family == "qwen2_5_vl")  # images: rope offsets enter the positions
    params = SamplingParams(n=n, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=10, seed=5)
    stops = dynamic_tests.early_stop_tokens(model, prompts, stops, pad, params)
    ours, rows, static = static_engine_rows(model, stops, pad, prompts, params)
    generated = engine(model, stops, pad, "dynamic").transformers_generate(prompts, params)
    dynamic = engine(model, stops, pad, "dynamic").generate(prompts, params)
    assert torch.equal(ours["responses"], generated["responses"])
    assert torch.equal(ours["response_mask"], generated["response_mask"])
    assert torch.equal(ours["responses"], dynamic["responses"])
    torch.testing.assert_close(ours["rollout_log_probs"], dynamic["rollout_log_probs"], **TOL)
    torch.testing.assert_close(ours["rollout_log_probs"], generated["rollout_log_probs"], **TOL)
    lengths = ours["response_mask"].sum(-1)
    assert lengths.min() < lengths.max()  # some rows stopped early, others went on
    total = len(prompts) * n
    assert rows[0] == len(prompts)  # the prefill: once per prompt
    assert rows[1:] == [total] * (int(lengths.max()) - 1)  # finished rows stayed: every step had every row
    # the cache spans more than was written: slots past the written ones were attended under the mask
    assert static.static is not None and static.static._shape is not None
    assert static.static._shape[1] == cache_length(prompts["input_ids"].shape[1], params.max_new_tokens)
    assert static.static._shape[1] > prompts["input_ids"].shape[1] + int(lengths.max())


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2"])
def test_sampling_static_equals_dynamic_until_a_row_stops(family: str, tmp_path: Path) -> None:
    model, prompts, tokenizer, _ = dynamic_tests.setup(tmp_path, family)
    never = [int(model.config.image_token_id)] if family != "qwen2" else [tokenizer.pad_token_id + 10**6]
    params = SamplingParams(n=4, temperature=0.9, top_p=0.95, top_k=50, max_new_tokens=12, seed=11)
    ours = engine(model, never, tokenizer.pad_token_id, "static").generate(prompts, params)
    dynamic = engine(model, never, tokenizer.pad_token_id, "dynamic").generate(prompts, params)
    generated = engine(model, never, tokenizer.pad_token_id, "dynamic").transformers_generate(prompts, params)
    assert torch.equal(ours["responses"], dynamic["responses"])  # the same draws from the same seed
    assert torch.equal(ours["responses"], generated["responses"])
    torch.testing.assert_close(ours["rollout_log_probs"], dynamic["rollout_log_probs"], **TOL)
    assert len(set(map(tuple, ours["responses"].tolist()))) > len(prompts)  # really sampled


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2"])
def test_static_sampled_log_probs_match_a_forward_after_rows_stop(family: str, tmp_path: Path) -> None:
    model, prompts, tokenizer, stops = dynamic_tests.setup(tmp_path, family)
    pad = tokenizer.pad_token_id
    params = SamplingParams(n=4, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12, seed=3)
    stops = dynamic_tests.early_stop_tokens(model, prompts, stops, pad, params)
    out, rows, _ = static_engine_rows(model, stops, pad, prompts, params)
    lengths = out["response_mask"].sum(-1)
    assert lengths.min() < lengths.max()  # rows finished while others went on decoding beside them
    assert set(rows[1:]) == {len(prompts) * params.n}
    batch = assemble(prompts, out, params.n, family_of(model))
    forward, _ = response_log_probs(model.eval(), batch, params.temperature, CPU)
    mask = out["response_mask"].bool()
    torch.testing.assert_close(out["rollout_log_probs"][mask], forward[mask], rtol=1e-4, atol=1e-4)
    assert (out["rollout_log_probs"][~mask] == 0).all()
    for row, length in enumerate(lengths.long().tolist()):  # a response ends at its first stop token, pad after
        tokens = out["responses"][row]
        assert all(int(t) not in stops for t in tokens[:length - 1])
        assert length == tokens.shape[0] or int(tokens[length - 1]) in stops
        assert (tokens[length:] == pad).all()


def greedy_case(tmp_path: Path) -> tuple[Any, dict[str, torch.Tensor], tuple[Any, ...]]:
    """A tiny Qwen2.5-VL, its prompt tensors and decode's other arguments: 3 greedy samples per prompt, 10 tokens,
    stop tokens chosen so that rows stop at different steps."""
    model, prompts, tokenizer, stops = dynamic_tests.setup(tmp_path, "qwen2_5_vl")
    pad = tokenizer.pad_token_id
    params = SamplingParams(n=3, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=10, seed=5)
    stops = dynamic_tests.early_stop_tokens(model, prompts, stops, pad, params)
    once = {k: prompts[k] for k in GENERATE_INPUTS if k in prompts}
    return model, once, (3, params, stops, pad, suppressed_tokens(model.config))


def test_raw_outputs_are_the_dynamic_loops(tmp_path: Path) -> None:
    """The loops' own outputs, before the engine masks them: pad after each row's stop token and log-prob 0
    there, in both."""
    model, once, args = greedy_case(tmp_path)
    _, _, stops, pad, _ = args
    tokens, log_probs = StaticDecoder(model).decode(once, *args)
    want_tokens, want_log_probs = decode(model, once, *args)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(log_probs, want_log_probs, **TOL)
    after = torch.isin(tokens, torch.tensor(stops)).long().cumsum(-1).roll(1, -1)
    after[:, 0] = 0
    assert (after > 0).any() and (tokens[after > 0] == pad).all() and (log_probs[after > 0] == 0).all()


def test_the_cache_is_kept_reset_between_generations_and_released_by_sleep(tmp_path: Path) -> None:
    model, prompts, tokenizer, stops = dynamic_tests.setup(tmp_path, "qwen2_5_vl")
    pad = tokenizer.pad_token_id
    params = SamplingParams(n=2, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=8, seed=0)
    ours = HFEngine(model, stops, pad, CPU, static_cache="on", sleep_level=2)
    assert ours.static is not None
    first = ours.generate(prompts, params)
    cache = ours.static.cache
    keys = cache.layers[0].keys
    again = ours.generate(prompts, params)  # same shape: the same cache, zeroed and its counters back to 0
    assert ours.static.cache is cache and cache.layers[0].keys is keys
    assert torch.equal(first["responses"], again["responses"])
    torch.testing.assert_close(first["rollout_log_probs"], again["rollout_log_probs"], rtol=0, atol=0)
    shorter = ours.generate(prompts.select(range(1)), params)  # another shape: a new cache
    assert ours.static.cache is not cache and ours.static._shape[0] == params.n
    assert torch.equal(shorter["responses"], first["responses"][:params.n, :shorter["responses"].shape[1]])
    ours.sleep()
    assert ours.static.cache is None  # the engine's sleep frees the static cache with the weights


def test_the_compiled_step_traces_once_and_gives_the_same_tokens(tmp_path: Path) -> None:
    """The step as torch.compile sees it (dynamo's graph capture, run by the eager backend: no C++ compiler or
    GPU needed): one graph without breaks, the same tokens as the eager step, and a second generation of the same
    shape, with its cache allocated again, reuses the traced graph instead of compiling anew."""
    from torch._dynamo.testing import CompileCounter

    model, prompts, tokenizer, stops = dynamic_tests.setup(tmp_path, "qwen2_5_vl")
    pad = tokenizer.pad_token_id
    params = SamplingParams(n=2, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=6, seed=0)
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = StaticDecoder(model, dict(backend=counter, dynamic=False, fullgraph=True))  # no graph break
    eager = StaticDecoder(model)
    once = {k: prompts[k] for k in GENERATE_INPUTS if k in prompts}
    args = (2, params, stops, pad, [])
    want = eager.decode(once, *args)
    got = compiled.decode(once, *args)
    assert counter.frame_count == 1  # one graph for the whole step (on CUDA: one captured graph per step)
    compiled.release()
    again = compiled.decode(once, *args)
    assert counter.frame_count == 1  # no recompilation for a new cache of the same shape
    for out in (got, again):
        assert torch.equal(out[0], want[0])
        torch.testing.assert_close(out[1], want[1], **TOL)
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                    reason="inductor needs a C++ compiler on CPU")
def test_inductor_compiles_the_step_with_the_cuda_options(tmp_path: Path) -> None:
    """The step compiled by inductor with the options CUDA uses (on CPU, without the CUDA graphs): one graph, the
    cache mutated in place by generated code, the dynamic loop's greedy tokens. Log-probs within 1e-4: inductor
    fuses and reorders the float32 sums (observed ~1e-5 on this model)."""
    from torch._dynamo.utils import counters

    model, once, args = greedy_case(tmp_path)
    want_tokens, want_log_probs = decode(model, once, *args)
    torch._dynamo.reset()
    counters.clear()
    compiled = StaticDecoder(model, dict(CUDA_COMPILE))
    try:
        for _ in range(2):  # compiled, then run again on the kept cache
            tokens, log_probs = compiled.decode(once, *args)
            assert torch.equal(tokens, want_tokens)
            torch.testing.assert_close(log_probs, want_log_probs, rtol=1e-4, atol=1e-4)
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    finally:
        torch._dynamo.reset()


def test_the_setting_picks_the_path(tmp_path: Path) -> None:
    assert load([]).worker.rollout.static_cache == "auto"
    assert wants_static("auto", torch.device("cuda")) and not wants_static("auto", CPU)
    assert wants_static("on", CPU) and not wants_static("off", torch.device("cuda"))
    with pytest.raises(ValueError, match="static_cache"):
        wants_static("yes", CPU)
    model, _, tokenizer, stops = dynamic_tests.setup(tmp_path, "qwen2")
    pad = tokenizer.pad_token_id
    assert HFEngine(model, stops, pad, CPU).static is None  # auto on CPU: the dynamic loop
    assert HFEngine(model, stops, pad, CPU, static_cache="off").static is None
    static = HFEngine(model, stops, pad, CPU, static_cache="on").static
    assert static is not None and not static.compiled  # on CPU: eager
    assert cache_length(1, 1) == CACHE_BUCKET and cache_length(CACHE_BUCKET, 1) == 2 * CACHE_BUCKET
    model.config.get_text_config(decoder=True).layer_types = ["sliding_attention", "full_attention"]
    assert unsupported(model) is not None
    assert HFEngine(model, stops, pad, torch.device("cpu"), static_cache="auto").static is None
    with pytest.raises(ValueError, match="static_cache=off"):
        HFEngine(model, stops, pad, CPU, static_cache="on")


def test_an_asleep_engine_refuses_to_generate_until_woken_and_synced(tmp_path: Path) -> None:
    """The device changes hands only where the driver says so: an engine asked to generate while asleep raises
    instead of waking itself; woken, it still refuses weights its level-2 sleep dropped until a sync refills
    them, and then generates what it did before the sleep."""
    model, prompts, tokenizer, stops = dynamic_tests.setup(tmp_path, "qwen2")
    params = SamplingParams(n=2, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=4, seed=0)
    engine = HFEngine(model, stops, tokenizer.pad_token_id, CPU, sleep_level=2)
    weights = {name: t.detach().clone() for name, t in model.state_dict().items()}
    before = engine.generate(prompts, params)
    assert engine.sleep() > 0
    with pytest.raises(RuntimeError, match="its weights sleep"):
        engine.generate(prompts, params)
    with pytest.raises(RuntimeError, match="its weights sleep"):
        engine.begin_weight_update()  # nor takes weights into room it has not woken
    engine.wake(("weights", "kv_cache"))
    with pytest.raises(RuntimeError, match="dropped by a level-2 sleep"):
        engine.generate(prompts, params)
    engine.begin_weight_update()
    engine.load_weights(weights.items())
    engine.finish_weight_update()  # every dropped weight refilled: no longer stale
    assert torch.equal(engine.generate(prompts, params)["responses"], before["responses"])


@pytest.mark.parametrize("asleep, stale, message", [({"weights", "kv_cache"}, False, "its weights sleep"),
                                                    (set(), True, "dropped by a level-2 sleep")])
def test_an_asleep_vllm_engine_refuses_with_the_same_words(asleep: set[str], stale: bool, message: str) -> None:
    """vLLM's engine says what it lacks as the HF engine does (the vLLM build here sleeps only on a GPU, so its
    state is set as a sleep leaves it); it never reaches vLLM."""
    from easytrain.workers.rollout.engine import EngineSpec
    from easytrain.workers.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(None, EngineSpec(Path("unused"), [0], 0, CPU), [], 8, sleep_level=2)
    engine.asleep, engine.stale = asleep, stale
    params = SamplingParams(n=1, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=1, seed=0)
    with pytest.raises(RuntimeError, match=message):
        engine.generate({}, params)  # type: ignore[arg-type]
    if asleep:
        with pytest.raises(RuntimeError, match=message):
            engine.begin_weight_update()

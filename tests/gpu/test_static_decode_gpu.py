"""The static-cache decode loop as it runs on CUDA: the step compiled with ``torch.compile(mode="reduce-overhead")``
and replayed as CUDA graphs, against plain ``generate`` on the same device.

Greedy tokens must equal generate's for a text and a VL model with images, rows stopping at different steps,
over several generations: the first (compiled, graphs recorded), a second of the same shape (the cache reset in
place, graphs replayed) and a third after the cache was released (graphs recorded again for the new cache); and
no part of the step may have been left out of CUDA graphs (inductor's ``cudagraph_skips`` counter stays 0).
``bench.decode_rate.decode_rate`` runs on the device and reports the same agreement (and runs in bf16).

Marked ``gpu``: skipped without a CUDA device, never run in CI. On a GPU machine:
``python -m pytest tests/gpu/test_static_decode_gpu.py -m gpu``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import test_decode as dynamic_tests
from easytrain.distributed.batch import Batch
from easytrain.workers.rollout.engine import SamplingParams
from easytrain.workers.rollout.hf_engine import HFEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.decode_rate import decode_rate  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

LOG_PROB_TOL = 1e-3
"""fp32 on CUDA, TF32 off (torch's default): inductor's fused kernels and eager's differ in summation order only,
~1e-6 relative on logits of order 10; 1e-3 leaves room for the log-sum-exp over the vocabulary."""


def _on_cuda(tmp_path: Path, family: str) -> tuple[Any, Batch, Any, list[int]]:
    model, prompts, tokenizer, stops = dynamic_tests.setup(tmp_path, family)
    return model.to("cuda"), prompts, tokenizer, stops


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5_vl"])
def test_compiled_static_greedy_equals_generate(family: str, tmp_path: Path) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cuda = torch.device("cuda")
    model, prompts, tokenizer, stops = _on_cuda(tmp_path, family)
    pad = tokenizer.pad_token_id
    params = SamplingParams(n=3, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=16, seed=0)

    def reference(stop_ids: list[int]) -> Batch:
        return HFEngine(model, stop_ids, pad, cuda, static_cache="off").transformers_generate(prompts, params)

    first = reference(stops)["responses"]
    candidates = [int(t) for t in first.unique() if int(t) not in stops and int(t) != pad]
    hits = {t: int((first == t).any(-1).sum()) for t in candidates}
    early = [t for t, k in hits.items() if 0 < k < first.shape[0]]  # a token some rows produce, others never
    stops = stops + early[:1]
    want = reference(stops)
    ours = HFEngine(model, stops, pad, cuda)  # static_cache=auto: on CUDA, compiled
    assert ours.static is not None and ours.static.compiled
    runs = [ours.generate(prompts, params), ours.generate(prompts, params)]
    cache = ours.static.cache
    ours.static.release()
    runs.append(ours.generate(prompts, params))
    assert ours.static.cache is not cache
    for got in runs:
        assert torch.equal(got["responses"], want["responses"])
        assert torch.equal(got["response_mask"], want["response_mask"])
        torch.testing.assert_close(got["rollout_log_probs"], want["rollout_log_probs"], rtol=LOG_PROB_TOL,
                                   atol=LOG_PROB_TOL)
    lengths = want["response_mask"].sum(-1)
    assert early and lengths.min() < lengths.max()  # rows stopped at different steps
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_decode_rate_reports_every_path(tmp_path: Path) -> None:
    model, prompts, tokenizer, stops = _on_cuda(tmp_path, "qwen2_5_vl")
    result = decode_rate(model, prompts, n=2, max_new_tokens=16, stop_ids=stops, pad_id=tokenizer.pad_token_id,
                         repeats=2)
    assert result["device"] != "cpu" and result["static"]["compiled"]
    for path in ("dynamic", "static", "static_fresh_cache"):
        assert result[path]["tokens_per_s"] > 0
        assert result["greedy_vs_generate"][path]["equal"], result["greedy_vs_generate"]
    half = decode_rate(model.to(torch.bfloat16), prompts, n=2, max_new_tokens=16, stop_ids=stops,
                       pad_id=tokenizer.pad_token_id, repeats=1, warmup=1)  # bf16 compiles and runs (exactness: fp32)
    assert half["dtype"] == "bfloat16" and half["static"]["compiled"] and half["static"]["tokens"] > 0

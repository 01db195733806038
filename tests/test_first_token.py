"""bench/first_token.py on CPU: every (decode path, attention) pair it can run agrees between the engine and the
actor to float32 rounding, and the pairs CPU lacks are recorded with their error instead of raising.

Tolerance, from the operation: the engine and the actor apply the same float32 weights to the same tokens and
differ only in the order of their sums (padded or not, cached or not, kernel by kernel): ~1e-5 relative error on
a logit at worst (observed: ~2e-7 absolute). The logits here are at most :data:`LOGIT_SCALE` in size (the run
records their largest and the test checks it), so a logit moves by at most ``RELATIVE * LOGIT_SCALE`` = 2e-5;
a log-prob ``z_t - logsumexp(z)`` by at most twice that, plus the rounding of the log-prob itself (~-7 for a
vocabulary of 1024, where an ulp is 4.8e-7). A real gap is far above this: the actor attending a prompt's 5
tokens of left padding moves the first token's log-prob by 1.8e-2, and the finding on an H200 was 0.6.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.first_token import ATTENTIONS, LAYOUTS, PATHS, measure  # noqa: E402

RELATIVE = 1e-5
LOGIT_SCALE = 2.0
LOGIT_TOL = RELATIVE * LOGIT_SCALE
LOG_PROB_TOL = 2 * LOGIT_TOL + 4 * 4.8e-7
RUN_ON_CPU = ("sdpa", "sdpa:math", "eager")
"""Attentions CPU always has (its sdpa: math, and a flash kernel of its own); cuDNN it never has."""


@pytest.fixture(scope="module")
def record() -> dict[str, Any]:
    return measure(torch.device("cpu"))


def ran(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: run for name, run in record["runs"].items() if "error" not in run}


def test_every_pair_is_recorded_and_what_cpu_lacks_is_an_error(record: dict[str, Any]) -> None:
    assert set(record["runs"]) == {f"{path}|{kind}" for path in PATHS for kind in ATTENTIONS}
    assert set(record["prefill"]) == set(ATTENTIONS)
    for name, run in record["runs"].items():
        if "error" in run:
            assert isinstance(run["error"], str) and run["error"] and "\n" not in run["error"], name
    for path in PATHS:
        assert "No viable backend" in record["runs"][f"{path}|sdpa:cudnn"]["error"]
        for kind in RUN_ON_CPU:
            run = record["runs"][f"{path}|{kind}"]
            assert "error" not in run, (path, kind, run)
            assert set(run["layouts"]) == set(LAYOUTS)
            assert not [r for r in run["layouts"].values() if "error" in r], (path, kind, run["layouts"])
            assert run["compiled"] is False  # the static step is compiled on CUDA only


def test_the_engine_and_the_actor_agree_to_float32_rounding(record: dict[str, Any]) -> None:
    for kind, prefill in record["prefill"].items():
        if "error" in prefill:
            continue
        assert prefill["logit_scale"] <= LOGIT_SCALE, "the tolerance's derivation assumes logits of this size"
        assert prefill["logits_gap"] < LOGIT_TOL and prefill["argmax_equal"], (kind, prefill)
    runs = ran(record)
    assert len(runs) >= len(PATHS) * len(RUN_ON_CPU)
    for name, run in runs.items():
        assert run["engine_first_vs_alone"] < LOG_PROB_TOL, (name, run)
        for layout, gaps in run["layouts"].items():
            if "error" in gaps:
                continue
            assert max(gaps["first"], gaps["all"], gaps["actor_first_vs_alone"]) < LOG_PROB_TOL, (name, layout, gaps)


def test_greedy_tokens_are_the_same_on_every_path_and_kernel(record: dict[str, Any]) -> None:
    runs = ran(record)
    assert record["reference"] in runs
    for name, run in runs.items():
        assert run["tokens_equal"] is True, name
        assert min(run["response_lengths"]) >= 1, name

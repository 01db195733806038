"""Rule rewards: what counts as the final answer, robustness to failing functions, the Ray pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from easytrain.config.schema import RewardConfig
from easytrain.rewards import Reward, RewardLoadError, load_function
from easytrain.rewards.answers import answer_reward, final_answer, format_reward, math_reward


@pytest.mark.parametrize("response,truth,score", [
    ("<think>count them</think> The answer is \\boxed{3}.", "3", 1.0),
    ("\\boxed{3}", "3", 1.0),
    ("\\boxed{ 3 }", "3", 1.0),
    ("\\boxed{3.0}", "3", 1.0),
    ("$\\boxed{3}$", "3", 1.0),
    ("\\boxed{\\text{Circle}}", "circle", 1.0),
    ("Answer: circle.", "circle", 1.0),
    ("so the answer is 3", "3", 1.0),
    ("\\boxed{3} ... double-checked: \\boxed{3}", "3", 1.0),  # the same answer restated
    ("\\boxed{2} or \\boxed{3}", "3", 0.0),  # several candidates
    ("\\boxed{2, 3}", "3", 0.0),  # candidates listed in one box
    ("\\boxed{1}\\boxed{2}\\boxed{3}\\boxed{4}", "3", 0.0),
    ("<think>it is \\boxed{3}</think> I am not sure.", "3", 0.0),  # answer only inside the reasoning
    ("<think>the answer is 3", "3", 0.0),  # reasoning never closed
    ("I think it is three", "3", 0.0),
    ("circle", "circle", 1.0),  # a bare response is its own answer
    (" Circle.\n", "circle", 1.0),
    ("circle square triangle", "circle", 0.0),
    ("it is a circle", "circle", 0.0),
    ("", "3", 0.0),
    ("\\boxed{3", "3", 0.0),  # unbalanced box
    # numbers compare exactly (issue 25 item 10): as floats, these two integers are one number
    ("\\boxed{12345678901234567891}", "12345678901234567890", 0.0),
    ("\\boxed{12345678901234567890}", "12345678901234567890", 1.0),
    ("\\boxed{0.1000000000000000001}", "0.1", 0.0),
    ("\\boxed{1,000}", "1000", 1.0),  # thousands grouped
    ("\\boxed{2,3}", "23", 0.0),  # not a grouping: two numbers listed
    ("\\boxed{.50}", "0.5", 1.0),
    ("\\boxed{-0}", "0", 1.0),
])
def test_answer_reward(response: str, truth: str, score: float) -> None:
    assert answer_reward([response], [truth])[0]["overall"] == score


@pytest.mark.parametrize("response,truth,score", [
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac12", 1.0),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0),
    ("\\boxed{\\{1, 2\\}}", "2", 0.0),
    ("\\boxed{1} or \\boxed{2}", "2", 0.0),
    ("<think>\\boxed{2}</think>", "2", 0.0),
    ("\\boxed{12345678901234567891}", "12345678901234567890", 0.0),  # math-verify and float both call these equal
    ("\\boxed{0.1000000001}", "0.1", 0.0),  # math-verify rounds plain decimals
    ("\\boxed{1.50}", "\\boxed{1.5}", 1.0),
])
def test_math_reward(response: str, truth: str, score: float) -> None:
    assert math_reward([response], [truth])[0]["overall"] == score


@pytest.mark.parametrize("response,score", [
    ("<think>two red, one blue</think> \\boxed{3}", 1.0),
    ("<think>a</think><think>b</think> \\boxed{3}", 0.0),
    ("\\boxed{3}", 0.0),
    ("<think>reasoning</think>", 0.0),
    ("<think>r</think> \\boxed{1} \\boxed{2}", 0.0),
])
def test_format_reward(response: str, score: float) -> None:
    assert format_reward([response], ["3"])[0]["format"] == score


def test_final_answer_extraction() -> None:
    assert final_answer("<think>x</think>The final answer is: 12") == "12"
    assert final_answer("\\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert final_answer("no answer here") == "no answer here"
    assert final_answer("   ") is None


def test_format_weight_mixes_into_overall() -> None:
    reward = Reward(load_function("answer"), format_weight=0.25)
    scores, errors = reward(["<think>r</think> \\boxed{3}", "\\boxed{3}", "\\boxed{4}"], ["3"] * 3)
    assert errors == 0
    assert [s["overall"] for s in scores] == [1.0, 0.75, 0.0]
    assert [s["format"] for s in scores] == [1.0, 0.0, 0.0]


USER_REWARDS = '''
def length_bonus(responses, truths):
    return [{"overall": min(len(r), 10) / 10, "length": float(len(r))} for r in responses]

def flaky(responses, truths):
    if any("boom" in r for r in responses):
        raise RuntimeError("user bug")
    return [{"overall": 1.0} for r in responses]

def malformed(responses, truths):
    return [1.0 for r in responses]

def not_a_number(responses, truths):
    return [{"overall": float("nan") if "nan" in r else float("inf") if "inf" in r else 1.0} for r in responses]

def hangs(responses, truths):
    import time
    if any("hang" in r for r in responses):
        time.sleep(3600)
    return [{"overall": 1.0} for r in responses]
'''


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return path


def test_user_function_from_a_file(user_file: Path) -> None:
    fn = load_function(f"{user_file}:length_bonus")
    assert fn(["abcde"], ["x"]) == [{"overall": 0.5, "length": 5.0}]


def test_user_function_from_a_module() -> None:
    assert load_function("easytrain.rewards.answers:answer_reward") is answer_reward


def test_a_raising_reward_scores_that_sample_zero(user_file: Path) -> None:
    reward = Reward(load_function(f"{user_file}:flaky"))
    scores, errors = reward(["fine", "boom", "fine too"], ["a", "b", "c"])
    assert [s["overall"] for s in scores] == [1.0, 0.0, 1.0] and errors == 1


def test_a_malformed_reward_result_is_an_error_per_sample(user_file: Path) -> None:
    scores, errors = Reward(load_function(f"{user_file}:malformed"))(["a", "b"], ["a", "b"])
    assert scores == [{"overall": 0.0}, {"overall": 0.0}] and errors == 2


def test_a_reward_that_is_not_a_finite_number_is_an_error_per_sample(user_file: Path) -> None:
    scores, errors = Reward(load_function(f"{user_file}:not_a_number"))(["a", "nan", "b", "inf"], ["t"] * 4)
    assert [s["overall"] for s in scores] == [1.0, 0.0, 1.0, 0.0] and errors == 2


def test_a_reward_worker_that_hangs_is_replaced_at_the_timeout(ray_local: None, user_file: Path) -> None:
    import time

    from easytrain.workers.reward_pool import RewardPool

    pool = RewardPool(RewardConfig(function=f"{user_file}:hangs", num_workers=2, timeout_s=3.0))
    try:
        first = pool.workers[1]
        start = time.monotonic()
        scores, errors = pool.collect(pool.submit(["a", "b", "hang", "c"], ["t"] * 4), every_s=0.2)
        took = time.monotonic() - start
        assert [s["overall"] for s in scores] == [1.0, 1.0, 0.0, 0.0] and errors == 2  # the second worker's half
        assert 3.0 <= took < 30.0
        assert pool.workers[1] is not first
        scores, errors = pool.collect(pool.submit(["a", "b", "c", "d"], ["t"] * 4))  # the new worker scores
        assert [s["overall"] for s in scores] == [1.0] * 4 and errors == 0
    finally:
        pool.shutdown()


@pytest.mark.parametrize("spec,match", [
    ("no_such_reward", "not a registered reward"),
    ("/nowhere/file.py:fn", "no such file"),
    ("easytrain.nope:fn", "cannot import"),
    ("easytrain.rewards.answers:nope", "has no function 'nope'"),
])
def test_bad_reward_specs(spec: str, match: str) -> None:
    with pytest.raises(RewardLoadError, match=match):
        load_function(spec)


def test_reward_pool_scores_off_the_driver(ray_local: None, user_file: Path) -> None:
    from easytrain.workers.reward_pool import RewardPool

    pool = RewardPool(RewardConfig(function=f"{user_file}:flaky", num_workers=2))
    try:
        responses = ["ok"] * 5 + ["boom"] + ["ok"] * 3
        pending = pool.submit(responses, ["t"] * len(responses))
        scores, errors = pool.collect(pending)
    finally:
        pool.shutdown()
    assert [s["overall"] for s in scores] == [1.0] * 5 + [0.0] + [1.0] * 3 and errors == 1


def test_synthetic_answers_score_one_and_constants_score_one_over_k() -> None:
    from collections import Counter

    from easytrain.data.synthetic import QUESTION_TYPES, _classes, generate

    rows = generate(240, seed=0)
    truths = [r["answer"] for r in rows]
    assert all(s["overall"] == 1.0 for s in answer_reward([f"\\boxed{{{t}}}" for t in truths], truths))
    for kind in QUESTION_TYPES:
        answers = Counter(r["answer"] for r in rows if r["question_type"] == kind)
        classes = _classes(kind)
        assert set(answers) == set(classes) and max(answers.values()) - min(answers.values()) <= 1
        best_constant = max(answers.values()) / sum(answers.values())
        assert best_constant == pytest.approx(1 / len(classes), abs=0.02)

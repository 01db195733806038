"""Scores known from the ground truth, for the dynamic-sampling tests.

A count question (its answer a digit) scores 1.0 for every response: a group without signal. Any other
question scores its responses 0, 1, 0, 1, ... in the order given: with ``reward.num_workers=1`` the
scorer gets the whole batch, each prompt's ``worker.rollout.n=2`` responses side by side, so one of
them scores 0 and the other 1 (a group with signal).
"""


def by_answer(responses: list[str], ground_truths: list[str]) -> list[dict[str, float]]:
    return [{"overall": 1.0 if truth.strip().isdigit() else float(i % 2)} for i, truth in enumerate(ground_truths)]

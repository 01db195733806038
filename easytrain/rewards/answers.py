"""Built-in rule rewards: final-answer match, math equivalence, think-then-answer format.

What counts as the final answer (all built-ins agree, so none can be gamed
by listing candidates):

1. Reasoning is ignored: text inside ``<think>...</think>`` (or before the
   last ``</think>``) never counts as an answer.
2. The answer is the content of ``\\boxed{...}`` in the rest of the
   response; without a box, the text after the last "answer is" / "Answer:";
   without either, the whole remaining response (a bare "circle" answers
   "circle"; a sentence around it does not).
3. Exactly one distinct final answer must be stated. Two different boxes
   ("\\boxed{2} or \\boxed{3}") score 0, as does a box listing several
   candidates ("\\boxed{2, 3}" against "3"), since it does not equal the truth.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

THINK_END = "</think>"
_ANSWER_IS = re.compile(r"(?:final answer|answer)\s*(?:is\s*:?|:)\s*(.+)", re.IGNORECASE)
_FORMAT = re.compile(r"^\s*<think>(?P<think>.+?)</think>\s*(?P<answer>.*\S.*)$", re.DOTALL)
_TEXT_WRAP = re.compile(r"\\(?:text|mathrm|textbf|mathbf)\{([^{}]*)\}")


def strip_reasoning(response: str) -> str:
    """The part of a response after the reasoning (after the last ``</think>``)."""
    if THINK_END in response:
        return response.rsplit(THINK_END, 1)[1]
    if "<think>" in response:  # reasoning never closed: no answer was given outside it
        return ""
    return response


def boxed_contents(text: str) -> list[str]:
    """Contents of every ``\\boxed{...}`` (balanced braces), in order."""
    found = []
    start = 0
    while True:
        at = text.find("\\boxed{", start)
        if at < 0:
            return found
        depth, i = 1, at + len("\\boxed{")
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth:
            return found  # unbalanced: the box never closed
        found.append(text[at + len("\\boxed{"):i - 1])
        start = i


def normalize(answer: str) -> str:
    """Comparable form: no TeX text wrappers, $, surrounding space, case or a trailing period."""
    text = _TEXT_WRAP.sub(r"\1", answer)
    text = text.replace("$", "").replace("\\!", "").replace("\\,", "").strip().rstrip(".").strip()
    text = re.sub(r"\s+", " ", text).lower()
    try:
        number = float(text.replace(",", "")) if re.fullmatch(r"-?[\d,]*\.?\d+", text) else None
    except ValueError:
        number = None
    if number is not None and number.is_integer():
        return str(int(number))
    return text


def final_answer(response: str) -> Optional[str]:
    """The single final answer stated in a response, or None (no answer, or several different ones)."""
    tail = strip_reasoning(response)
    candidates = boxed_contents(tail)
    if not candidates:
        lines = [m.group(1) for m in _ANSWER_IS.finditer(tail)]
        candidates = lines[-1:] if lines else [tail]  # "the answer is X" may be restated; the last one counts
    distinct = {normalize(c) for c in candidates if c.strip()}
    if len(distinct) != 1:
        return None
    return next(iter(distinct))


def answer_reward(responses: Sequence[str], ground_truths: Sequence[str]) -> list[dict[str, float]]:
    """1 if the single final answer equals the ground truth after normalisation, else 0."""
    scores = []
    for response, truth in zip(responses, ground_truths):
        stated = final_answer(response)
        truth_norm = normalize(boxed_contents(truth)[0] if boxed_contents(truth) else truth)
        accuracy = float(stated is not None and stated == truth_norm)
        scores.append({"overall": accuracy, "accuracy": accuracy})
    return scores


def math_reward(responses: Sequence[str], ground_truths: Sequence[str]) -> list[dict[str, float]]:
    """1 if the single final answer is mathematically equivalent to the truth (math-verify), else 0."""
    from math_verify import parse, verify

    scores = []
    for response, truth in zip(responses, ground_truths):
        stated = final_answer(response)
        accuracy = 0.0
        if stated is not None:
            gold = parse(f"${truth}$") or parse(truth)
            guess = parse(f"${stated}$") or parse(stated)
            accuracy = float(bool(gold) and bool(guess) and verify(gold, guess)) or float(
                stated == normalize(truth))
        scores.append({"overall": accuracy, "accuracy": accuracy})
    return scores


def format_reward(responses: Sequence[str], ground_truths: Sequence[str]) -> list[dict[str, float]]:
    """1 for ``<think>reasoning</think>`` followed by exactly one final answer, else 0."""
    scores = []
    for response in responses:
        match = _FORMAT.match(response)
        ok = bool(match) and response.count("<think>") == 1 and final_answer(response) is not None
        scores.append({"overall": float(ok), "format": float(ok)})
    return scores

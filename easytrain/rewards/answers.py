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
from decimal import Decimal, InvalidOperation
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


_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d*)(?:\.\d+)?")
"""A plain decimal number: digits with an optional fraction, thousands optionally grouped by commas."""


def exact_number(text: str) -> Optional[Decimal]:
    """``text`` as an exact decimal (``1,234.50`` -> 1234.50), or None when it is not a plain number. Never a
    float: 12345678901234567891 and 12345678901234567890 stay different numbers."""
    text = text.strip()
    if not text or not _NUMBER.fullmatch(text) or not any(ch.isdigit() for ch in text):
        return None
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None


def normalize(answer: str) -> str:
    """Comparable form: no TeX text wrappers, $, surrounding space, case or a trailing period; a number in its
    exact canonical decimal form (``3.0`` -> ``3``, ``1,000`` -> ``1000``, ``-0`` -> ``0``)."""
    text = _TEXT_WRAP.sub(r"\1", answer)
    text = text.replace("$", "").replace("\\!", "").replace("\\,", "").strip().rstrip(".").strip()
    text = re.sub(r"\s+", " ", text).lower()
    number = exact_number(text)
    if number is None:
        return text
    canonical = format(number, "f")  # exact at any length (Decimal.normalize would round to 28 digits)
    if "." in canonical:
        canonical = canonical.rstrip("0").rstrip(".")
    return "0" if canonical == "-0" else canonical


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
        plain = normalize(boxed_contents(truth)[0] if boxed_contents(truth) else truth)
        if stated is not None and exact_number(stated) is not None and exact_number(plain) is not None:
            accuracy = float(stated == plain)  # two plain numbers: exactly equal (math-verify rounds them)
        elif stated is not None:
            gold = parse(f"${truth}$") or parse(truth)
            guess = parse(f"${stated}$") or parse(stated)
            accuracy = float(bool(gold) and bool(guess) and verify(gold, guess)) or float(stated == plain)
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

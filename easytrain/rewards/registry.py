"""The reward function interface, its registry, and loading user functions.

A reward function takes a batch and returns one dict per sample::

    def my_reward(responses: list[str], ground_truths: list[str]) -> list[dict[str, float]]:
        return [{"overall": 1.0, "accuracy": 1.0} for _ in responses]

``overall`` is what the algorithm optimises; other keys are logged as
``reward/<key>``. ``reward.function`` names a registered function
(``answer``, ``math``, ``format``) or a user function as
``path/to/file.py:name`` or ``package.module:name``; it is imported, never
evaluated from config text. If a batch call raises, each sample is scored
alone; a sample whose call raises scores 0 and is counted, never fatal.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

from easytrain.rewards.answers import answer_reward, format_reward, math_reward

logger = logging.getLogger(__name__)

RewardFn = Callable[[Sequence[str], Sequence[str]], list[dict[str, float]]]
REGISTRY: dict[str, RewardFn] = {"answer": answer_reward, "math": math_reward, "format": format_reward}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a reward function to the registry under ``name``."""
    def add(fn: RewardFn) -> RewardFn:
        REGISTRY[name] = fn
        return fn
    return add


class RewardLoadError(ValueError):
    """``reward.function`` (or another key naming a function) names nothing loadable."""


USER_MODULE_PREFIX = "easytrain_user_"
"""Module names given to files loaded by path (``path/to/file.py:name``), which have no importable name."""


def load_function(spec: str) -> RewardFn:
    """A registered name, ``file.py:name`` or ``module:name``."""
    if spec in REGISTRY:
        return REGISTRY[spec]
    if ":" not in spec:
        raise RewardLoadError(f"reward.function={spec!r}: not a registered reward ({', '.join(REGISTRY)}) "
                              "and not of the form path/to/file.py:name or package.module:name")
    return import_callable(spec, "reward.function")


def import_callable(spec: str, key: str, files: Optional[dict[str, ModuleType]] = None) -> Callable[..., Any]:
    """The callable ``file.py:name`` or ``module:name`` names; errors name the config ``key`` and ``spec``.
    ``files`` (absolute path -> module), when given, lets several functions of one file run it once."""
    if ":" not in spec:
        raise RewardLoadError(f"{key}={spec!r}: not of the form path/to/file.py:name or package.module:name")
    target, name = spec.rsplit(":", 1)
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise RewardLoadError(f"{key}={spec!r}: no such file {target!r}")
        path = os.path.abspath(target)
        module = files.get(path) if files is not None else None
        if module is None:
            module = _exec_file(target)
            if files is not None:
                files[path] = module
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise RewardLoadError(f"{key}={spec!r}: cannot import {target!r} ({err})") from err
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardLoadError(f"{key}={spec!r}: {target} has no function {name!r}")
    return fn


def _exec_file(target: str) -> ModuleType:
    """A new module run from the file ``target``."""
    module_spec = importlib.util.spec_from_file_location(f"{USER_MODULE_PREFIX}{abs(hash(target))}", target)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@dataclass
class Reward:
    """A reward function, optionally mixed with the format reward, scored robustly."""

    fn: RewardFn
    format_weight: float = 0.0

    def __call__(self, responses: Sequence[str], ground_truths: Sequence[str]) -> tuple[list[dict[str, float]], int]:
        """Scores per sample and how many samples failed (scored 0)."""
        scores, errors = _robust(self.fn, responses, ground_truths)
        if self.format_weight > 0:
            formats, _ = _robust(format_reward, responses, ground_truths)
            w = self.format_weight
            for score, fmt in zip(scores, formats):
                score["format"] = fmt["format"]
                score["overall"] = (1 - w) * score["overall"] + w * fmt["format"]
        return scores, errors


def _valid(scores: object, n: int) -> bool:
    """A list of ``n`` dicts, each with a finite number under "overall" (a NaN would reach every advantage of
    its group and, through the loss, every weight)."""
    return (isinstance(scores, list) and len(scores) == n
            and all(isinstance(s, dict) and isinstance(s.get("overall"), (int, float)) and math.isfinite(s["overall"])
                    for s in scores))


def _robust(fn: RewardFn, responses: Sequence[str], truths: Sequence[str]) -> tuple[list[dict[str, float]], int]:
    try:
        scores = fn(list(responses), list(truths))
        if _valid(scores, len(responses)):
            return [{k: float(v) for k, v in s.items()} for s in scores], 0
        logger.warning("reward: %s returned a malformed result; scoring samples one by one", fn.__name__)
    except Exception as err:  # a user's function may raise anything
        logger.warning("reward: %s raised %s: %s; scoring samples one by one", fn.__name__, type(err).__name__, err)
    out, errors = [], 0
    for response, truth in zip(responses, truths):
        try:
            single = fn([response], [truth])
            if not _valid(single, 1):
                raise TypeError("expected a list with one dict holding a finite number under 'overall'")
            out.append({k: float(v) for k, v in single[0].items()})
        except Exception as err:
            errors += 1
            logger.warning("reward: sample scored 0 after %s: %s", type(err).__name__, err)
            out.append({"overall": 0.0})
    return out, errors

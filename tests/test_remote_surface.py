"""The workers' remote surface holds what a run calls: every public method of a Ray actor class of easytrain
has a caller in the package (a method-name string the driver sends, an attribute a caller reads, an actor
handle's ``.remote``) other than its own definition. What only the tests call lives in
:mod:`easytrain.workers.debug`, mixed in where the tests enable it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from easytrain.workers.actor import ActorWorker
from easytrain.workers.debug import ActorDebug, FusedDebug, RolloutDebug, WorkerDebug
from easytrain.workers.fused import FusedWorker
from easytrain.workers.reference import ReferenceWorker
from easytrain.workers.reward_pool import RewardWorker
from easytrain.workers.rollout.worker import RolloutWorker
from easytrain.workers.sft import SFTWorker

PACKAGE = Path(__file__).resolve().parents[1] / "easytrain"
ACTORS = (ActorWorker, RolloutWorker, ReferenceWorker, FusedWorker, SFTWorker,
          RewardWorker.__ray_metadata__.modified_class)  # (declared with @ray.remote)
DEBUG = (WorkerDebug, ActorDebug, RolloutDebug, FusedDebug)


def uses() -> dict[str, int]:
    """How often each name is read as an attribute or written as a string constant, over the package outside
    the debug module, definitions not counted."""
    counts: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "debug.py" and path.parent.name == "workers":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = (node.attr if isinstance(node, ast.Attribute) else
                    node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None)
            if name is not None and name.isidentifier():
                counts[name] = counts.get(name, 0) + 1
    return counts


def remote_methods(cls: type) -> set[str]:
    """Public methods a Ray handle of ``cls`` exposes that easytrain defines (the debug mixins' left out)."""
    out = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("easytrain.") and klass not in DEBUG:
            out |= {name for name, value in vars(klass).items()
                    if not name.startswith("_") and inspect.isfunction(value)}
    return out


@pytest.mark.parametrize("cls", ACTORS, ids=lambda c: c.__name__)
def test_every_remote_method_has_a_caller_in_the_package(cls: type) -> None:
    counts = uses()
    uncalled = sorted(name for name in remote_methods(cls) if not counts.get(name))
    assert not uncalled, f"{cls.__name__}: no caller in easytrain/ for {uncalled} (a test-only method goes in " \
                         "easytrain/workers/debug.py; a dead one goes)"


def test_the_debug_methods_are_mixed_in_only_where_the_tests_enable_them() -> None:
    import os
    import subprocess
    import sys

    assert os.environ.get("EASYTRAIN_DEBUG_METHODS") == "1" and hasattr(ActorWorker, "full_state_dict")
    code = ("from easytrain.workers.fused import FusedWorker; from easytrain.workers.actor import ActorWorker; "
            "print(hasattr(FusedWorker, 'phase_log'), hasattr(ActorWorker, 'full_state_dict'))")
    env = {k: v for k, v in os.environ.items() if k != "EASYTRAIN_DEBUG_METHODS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr[-2000:]

"""Issue 26: imports point down the layer table of ``scripts/check_imports.py`` (cli -> launch -> main -> trainer
-> workers -> distributed -> memory -> models -> data -> config -> tools -> algorithms, rewards).

The script passes on the repository, and on a small synthetic tree it catches what it must: an upward import
(also one inside a function, relative, or under TYPE_CHECKING), a sideways one between the units of a layer,
a unit the table lacks, and any import of a unit in the package's own __init__; a downward import passes.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_imports.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_imports", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "easytrain"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_repository_imports_point_down() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "points down" in done.stdout


def test_the_table_names_every_package_once() -> None:
    script = _script()
    units = [unit for layer in script.LAYERS for unit in layer]
    assert len(units) == len(set(units))
    packages = {p.name for p in (ROOT / "easytrain").iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in (ROOT / "easytrain").glob("*.py")} - {"__init__"}
    assert set(units) == packages | modules


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    script = _script()
    root = _tree(tmp_path, {
        "__init__.py": "from easytrain.config import load\n",
        "config/__init__.py": "",
        "config/ok.py": "from easytrain.rewards.registry import REGISTRY\nimport easytrain\n",
        "rewards/__init__.py": "",
        "rewards/registry.py": "REGISTRY = {}\n",
        "memory/__init__.py": "",
        "memory/params.py": ("from easytrain.config.schema import Config\n\n\n"
                             "def count() -> int:\n    from easytrain.workers.base import build\n    return 0\n"),
        "distributed/__init__.py": "",
        "distributed/cluster.py": "from ..launch import jobs\n",
        "distributed/group.py": ("from typing import TYPE_CHECKING\n"
                                 "if TYPE_CHECKING:\n    from easytrain import trainer\n"),
        "data/__init__.py": "",
        "data/images.py": "from easytrain.models.hf import load\n",
        "algorithms/__init__.py": "",
        "algorithms/kl.py": "from easytrain.rewards.registry import REGISTRY\n",
        "stray.py": "import os\n",
    })
    found = script.check_tree(root)
    where = {(v.path.relative_to(root).as_posix(), v.line, v.imported, v.why) for v in found}
    assert where == {
        ("__init__.py", 1, "config", "the package's __init__ runs before every module of it"),
        ("memory/params.py", 5, "workers", "upward"),  # inside a function
        ("distributed/cluster.py", 1, "launch", "upward"),  # relative
        ("distributed/group.py", 3, "trainer", "upward"),  # under TYPE_CHECKING
        ("data/images.py", 1, "models", "upward"),  # models hold the family adapters, which size the data
        ("algorithms/kl.py", 1, "rewards", "sideways, within one layer"),
        ("stray.py", 1, "stray", "stray is not in the layer table"),
    }, where
    assert "from easytrain.workers.base import build" in str(next(v for v in found if v.imported == "workers"))
    done = subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "memory/params.py:5: from easytrain.workers.base import build" in done.stdout
    assert len(done.stdout.strip().splitlines()) == len(found)


def test_downward_imports_pass(tmp_path: Path) -> None:
    script = _script()
    root = _tree(tmp_path, {
        "cli.py": "from easytrain.main import main\nfrom easytrain.launch import jobs\n",
        "main.py": "from easytrain.trainer.rl import RLTrainer\nfrom easytrain.config import load\n",
        "trainer/rl.py": "from easytrain.workers.actor import ActorWorker\nfrom . import base\n",
        "workers/actor.py": "from easytrain.distributed.group import dispatch\nfrom easytrain.algorithms import kl\n",
        "distributed/group.py": "from easytrain.memory import peaks\n",
        "memory/planner.py": "from easytrain.models.shapes import resolve_shape\n",
        "data/dataset.py": "from easytrain.config.schema import DataConfig\n",
        "config/validate.py": "def check() -> None:\n    from easytrain.rewards.registry import REGISTRY\n",
    })
    assert script.check_tree(root) == []


def test_an_import_cycle_is_caught_even_when_one_side_is_lazy(tmp_path: Path) -> None:
    """Two modules of one unit importing each other (one inside a function, where Python tolerates it) and a
    package whose ``__init__`` imports a module that imports the package back: both cycles, with their lines; a
    module importing its own package's sibling is not one."""
    check = _script()
    root = _tree(tmp_path, {
        "__init__.py": "",
        "models/__init__.py": "",
        "models/a.py": "from easytrain.models.b import f\n",
        "models/b.py": "def f():\n    from easytrain.models import a\n",
        "models/families/__init__.py": "from easytrain.models.families.qwen import Q\n",
        "models/families/qwen.py": "from easytrain.models.families.base import B\n\ndef g():\n"
                                   "    from easytrain.models.dedup import h\n",
        "models/families/base.py": "B = 1\n",
        "models/dedup.py": "def h():\n    from easytrain.models.families import family_of\n",
    })
    graph = check.import_graph(root)
    assert graph["easytrain.models.b"] == {"easytrain.models.a": 2}
    assert check.cycles(graph) == [
        ["easytrain.models.a", "easytrain.models.b"],
        ["easytrain.models.dedup", "easytrain.models.families", "easytrain.models.families.qwen"]]
    done = subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "2 import cycle(s)" in done.stderr
    assert "easytrain.models.a -> easytrain.models.b (line 1)" in done.stdout

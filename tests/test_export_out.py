"""``easytrain export --out``: never a folder whose replacement would lose data (issue 24, item 1).

Before, the export replaced ``--out`` whatever it was: the run folder (deleting the run), a folder of other
models, the parent folder; ``--out .`` raised a traceback. Each of these is now refused in one line, exit 2,
before any model is loaded; a new or empty folder, or an earlier export, is written or replaced."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from easytrain.trainer.export import MARKER, ExportError, check_out


def fake_run(tmp_path: Path) -> Path:
    """A run folder with one complete checkpoint (what ``resolve`` accepts); nothing is loaded from it here."""
    step = tmp_path / "run" / "checkpoints" / "global_step_3"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text('{"step": 3}')
    return step


@pytest.mark.parametrize("where, problem", [
    (lambda run: run.parent.parent, "it holds the checkpoint"),           # the run folder
    (lambda run: run, "it holds the checkpoint"),                         # the checkpoint itself
    (lambda run: run.parent.parent.parent, "it holds the checkpoint"),    # the run's parent
    (lambda run: run / "export", "inside the checkpoint"),
])
def test_a_folder_holding_or_inside_the_checkpoint_is_refused(tmp_path: Path, where, problem: str) -> None:
    step = fake_run(tmp_path)
    with pytest.raises(ExportError, match=problem):
        check_out(where(step), step, force=True)  # --force never deletes the run


def test_other_folders_are_refused_unless_new_empty_an_export_or_forced(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    step = fake_run(tmp_path)
    models = tmp_path / "models"
    (models / "other-model").mkdir(parents=True)
    with pytest.raises(ExportError, match="not empty and no earlier export"):
        check_out(models, step)
    assert check_out(models, step, force=True) == models.resolve()
    assert (models / "other-model").is_dir()  # refusing and checking delete nothing
    assert check_out(tmp_path / "new", step) == (tmp_path / "new").resolve()
    (tmp_path / "empty").mkdir()
    assert check_out(tmp_path / "empty", step) == (tmp_path / "empty").resolve()
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / MARKER).write_text("{}")
    (earlier / "model.safetensors").write_text("x")
    assert check_out(earlier, step) == earlier.resolve()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="a file is there"):
        check_out(tmp_path / "file", step)
    monkeypatch.chdir(models / "other-model")
    with pytest.raises(ExportError, match="holds the current directory"):
        check_out(".", step, force=True)


def test_the_cli_refuses_the_run_folder_in_one_line_and_deletes_nothing(tmp_path: Path) -> None:
    step = fake_run(tmp_path)
    run = step.parent.parent
    done = subprocess.run([sys.executable, "-m", "easytrain.cli", "export", str(run), "--out", str(run)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "it holds the checkpoint" in lines[0] and "Traceback" not in done.stderr
    assert (step / "trainer_state.json").is_file()

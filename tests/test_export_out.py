"""``easytrain export --out``: never a folder whose replacement would lose data (issue 24, item 1).

Before, the export replaced ``--out`` whatever it was: the run folder (deleting the run), a folder of other
models, the parent folder; ``--out .`` raised a traceback. Each of these is now refused in one line, exit 2,
before any model is loaded; a new or empty folder, or an earlier export, is written or replaced."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

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


# ----------------------------------------------------------------------------- issue 25: one line, no remote code


def tiny_checkpoint(tmp_path: Path, *overrides: str) -> Path:
    """A complete-looking checkpoint of the tiny model whose ``config.yaml`` is a real run's (with ``overrides``)
    and whose actor folder holds no DCP shards."""
    from omegaconf import OmegaConf

    from easytrain.config import load

    step = fake_run(tmp_path)
    config = load(["+exp=tiny", f"trainer.output_dir={tmp_path / 'run'}", *overrides])
    (step / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(config)))
    (step / "actor").mkdir()
    return step


def export_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    from easytrain.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        main(["export", *args])
    lines = capsys.readouterr().err.strip().splitlines()
    return int(code.value.code or 0), [line for line in lines if "it/s]" not in line]  # transformers' progress bars


def test_an_incompatible_checkpoint_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, IncompatibleCheckpoint (a RuntimeError) left the CLI as a traceback."""
    step = tiny_checkpoint(tmp_path)
    code, err = export_cli(capsys, str(step), "--out", str(tmp_path / "hf"))
    assert code == 2 and len(err) == 1, err
    assert err[0] == f"easytrain export: {step / 'actor'}: no DCP metadata (.metadata); not a complete checkpoint"
    assert not (tmp_path / "hf").exists()


def test_a_config_this_version_cannot_read_is_one_line_exit_2(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Before, OmegaConf's ValidationError / ConfigKeyError (several lines each) left the CLI as a traceback."""
    step = tiny_checkpoint(tmp_path)
    text = (step / "config.yaml").read_text()
    (step / "config.yaml").write_text(text.replace("trainer:\n", "trainer:\n  no_such_key: 1\n", 1))
    code, err = export_cli(capsys, str(step), "--out", str(tmp_path / "hf"))
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"easytrain export: {step / 'config.yaml'}: does not fit this easytrain's config (")
    assert "no_such_key" in err[0] and err[0].endswith("or fix that key in the file")
    (step / "config.yaml").write_text(text.replace("max_steps:", "max_steps: many #", 1))
    code, err = export_cli(capsys, str(step), "--out", str(tmp_path / "hf"))
    assert code == 2 and len(err) == 1 and "max_steps" in err[0], err
    (step / "config.yaml").unlink()
    code, err = export_cli(capsys, str(step), "--out", str(tmp_path / "hf"))
    assert code == 2 and err == [f"easytrain export: {step / 'config.yaml'}: missing; a checkpoint written by "
                                 "easytrain holds the run's config there, and the export rebuilds the model from it"]


def test_trust_remote_code_comes_from_the_command_never_the_checkpoint(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint's config.yaml saying model.trust_remote_code=true made the export run the base model's own
    Python code (transformers' trust_remote_code); now only --trust-remote-code does."""
    import easytrain.models.hf as hf
    from easytrain.trainer.export import checkpoint_config

    step = tiny_checkpoint(tmp_path, "model.trust_remote_code=true")
    assert "trust_remote_code: true" in (step / "config.yaml").read_text()
    assert checkpoint_config(step).model.trust_remote_code is False
    assert checkpoint_config(step, trust_remote_code=True).model.trust_remote_code is True

    asked: list[bool] = []

    def load_model(model: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(model.trust_remote_code)
        raise ExportError("stopped by the test")

    monkeypatch.setattr(hf, "load_model", load_model)
    assert export_cli(capsys, str(step), "--out", str(tmp_path / "hf"))[0] == 2
    assert export_cli(capsys, str(step), "--out", str(tmp_path / "hf"), "--trust-remote-code")[0] == 2
    assert asked == [False, True]

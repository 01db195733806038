"""Issue 25: every bad value of every config key is one line naming the key, and exit 2.

The cases are generated from the schema, so a key added later is covered the
day it is added: each key gets a value of the wrong type, each key with a
range (bounds, choices, or a sign its meaning needs) a value outside it, and
each key that names a file or folder a path that does not exist. The command
is the real ``easytrain config``, in process (its exit, its stderr).
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Optional

import pytest

from easytrain import cli
from easytrain.config.schema import CHOICES, HIGH, LOW, LOW_OPEN, Config

MISSING = "/nonexistent/easytrain-test"
PATH_KEYS = {
    "model.path": f"{MISSING}/model",
    "model.tokenizer_path": f"{MISSING}/tokenizer",
    "data.train_files": f"{MISSING}/train.parquet",
    "data.val_files": f"{MISSING}/val.jsonl",
    "data.image_dir": f"{MISSING}/images",
    "data.format_prompt": f"{MISSING}/prompt.jinja",
    "reward.function": f"{MISSING}/reward.py:score",
    "trainer.resume": f"{MISSING}/checkpoints/global_step_3",
}
"""Keys naming a file or folder that must exist where the run starts (config/paths.py), and a missing one."""
CREATED = {"model.cache_dir", "trainer.output_dir", "launch.volume_mount_path"}
"""Path keys the run creates (or that live on the cluster), so a missing folder is not an error."""
WRONG_TYPE = {int: "abc", float: "abc", bool: "maybe", str: "[1,2]", list: "{a: 1}", dict: "[1]"}
"""A value of the wrong type for each field type (a str field refuses a list; a list field a mapping)."""
WRONG_ANY = "{a: 1}"
"""train_files/val_files are typed Any (a string or a list); a mapping is neither."""
SIGNED = {"model.tiny_seed", "trainer.seed"}
"""Numeric keys with no range: any integer seeds the run."""
NEEDS_POSITIVE = {"worker.rollout.max_model_len"}
"""Optional numbers without schema bounds whose meaning needs a positive value (null = the default)."""
SPECIAL_RANGE = {"trainer.checkpoint_host_buffer_gb": "-2", "trainer.async_queue_gb": "-2"}
"""Numbers whose range a cross-field rule states (positive, or -1 to size it from the node)."""


def _fields(cls: Any = Config, prefix: str = "") -> list[tuple[str, Any, dataclasses.Field]]:
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            found += _fields(kind, f"{prefix}{f.name}.")
        else:
            found.append((prefix + f.name, kind, f))
    return found


def _base(kind: Any) -> Any:
    """int for Optional[int], list for list[str], Any for Any."""
    origin = typing.get_origin(kind)
    if origin is typing.Union:
        return _base(next(a for a in typing.get_args(kind) if a is not type(None)))
    return origin or kind


def _out_of_range(key: str, kind: Any, f: dataclasses.Field) -> Optional[str]:
    if CHOICES in f.metadata:
        return "not-a-choice"
    base = _base(kind)
    if base not in (int, float) or base is bool:
        return None
    if LOW in f.metadata:
        low, high = f.metadata[LOW], f.metadata[HIGH]
        if high is not None:
            return str(high * 2 + 1)
        if low is not None:
            return str(low if f.metadata[LOW_OPEN] else low - 1)
    if key in NEEDS_POSITIVE:
        return "-1"
    if key in SPECIAL_RANGE:
        return SPECIAL_RANGE[key]
    return None


FIELDS = _fields()
CASES = [(key, WRONG_ANY if _base(kind) is Any else WRONG_TYPE[_base(kind)], "wrong type") for key, kind, _ in FIELDS]
CASES += [(key, value, "out of range") for key, kind, f in FIELDS
          if (value := _out_of_range(key, kind, f)) is not None]
CASES += [(key, value, "missing file") for key, value in PATH_KEYS.items()]


def test_the_cases_cover_every_key() -> None:
    """A key is covered by a wrong type, and by a range or path case unless it is listed as having neither."""
    keys = {key for key, _, _ in FIELDS}
    assert keys == {key for key, _, why in CASES if why == "wrong type"}
    ranged = {key for key, _, why in CASES if why == "out of range"}
    numeric = {key for key, kind, _ in FIELDS if _base(kind) in (int, float)}
    assert numeric - ranged == SIGNED, "a number without a range: bound it in the schema or list it in SIGNED"
    path_like = {key for key, kind, _ in FIELDS if _base(kind) in (str, Any)
                 and key.endswith(("path", "_dir", "_files", "_prompt", "resume"))}
    assert path_like - set(PATH_KEYS) == CREATED


@pytest.mark.parametrize("key,value,why", CASES, ids=[f"{k}={v} ({w})" for k, v, w in CASES])
def test_a_bad_value_is_one_line_naming_the_key_and_exit_2(key: str, value: str, why: str,
                                                           capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["config", f"{key}={value}"])
    err = capsys.readouterr().err.strip()
    assert done.value.code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"easytrain config: config error: {key}"), err


def test_a_missing_model_folder_and_a_folder_that_is_no_model(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "weights.bin").write_bytes(b"")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"architectures": ["Mystery"]}')
    for value, problem in ((tmp_path, "holds no config.json"), (tmp_path / "weights.bin", "is a file"),
                           (tmp_path / "other", "names no model_type"), ("./no-such-model", "no such folder")):
        with pytest.raises(SystemExit) as done:
            cli.main(["config", f"model.path={value}"])
        err = capsys.readouterr().err.strip()
        assert done.value.code == 2 and problem in err and err.count("\n") == 0, err
    # a hub id is not a path: it is checked when it downloads
    with pytest.raises(SystemExit) as done:
        cli.main(["config", "model.path=Qwen/Qwen2.5-VL-7B-Instruct", "trainer.device=cpu"])
    assert "model.path" not in capsys.readouterr().err


def test_data_files_are_checked_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "rows.csv").write_text("a,b\n")
    for value, problem in ((tmp_path / "rows.csv", "unsupported file type '.csv'"),
                           ("[synthetic:shapes,/no/such.jsonl]", "data.train_files[1]='/no/such.jsonl'"),
                           ("synthetic:circles", "data.train_files='synthetic:circles'")):
        with pytest.raises(SystemExit) as done:
            cli.main(["config", f"data.train_files={value}"])
        err = capsys.readouterr().err.strip()
        assert done.value.code == 2 and problem in err and err.count("\n") == 0, err


def test_save_freq_0_means_never_as_documented() -> None:
    from easytrain.config import load

    assert load(["trainer.save_freq=0"]).trainer.save_freq == 0
    with pytest.raises(Exception, match="trainer.export_final=True: exports the final checkpoint"):
        load(["trainer.save_freq=0", "trainer.export_final=true"])


def test_a_batch_larger_than_the_usable_rows_is_one_line_with_both_numbers(tmp_path: Path) -> None:
    import json

    from easytrain.config import load
    from easytrain.data.sources import DataError
    from easytrain.trainer.data import RLData, SFTData

    rows = [{"problem": f"what is {i}+{i}?", "answer": str(2 * i)} for i in range(3)] + [{"answer": "no prompt"}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = [f"data.train_files={data}", "data.val_files=null", "model.path=tiny:qwen2", "data.image_key=null",
              f"trainer.output_dir={tmp_path / 'run'}", "data.num_workers=0",
              "worker.actor.micro_batch_size_per_device_for_update=2"]
    config = load(common + ["data.rollout_batch_size=4", "worker.actor.global_batch_size=4"])
    with pytest.raises(DataError) as failed:
        RLData(config)
    message = str(failed.value)
    assert message.startswith("data.rollout_batch_size=4: larger than the 3 usable row(s) of data.train_files "
                              "(4 read, 1 skipped: {'empty_prompt': 1}"), message
    assert "lower data.rollout_batch_size to at most 3" in message and "\n" not in message
    config = load(common + ["trainer.task=sft", "worker.actor.global_batch_size=4"])
    with pytest.raises(DataError, match=r"^worker.actor.global_batch_size=4: larger than the 3 usable row"):
        SFTData(config)
    assert RLData(load(common + ["data.rollout_batch_size=3", "worker.actor.global_batch_size=3"])).train

"""Checkpoint folders of a run: where they live, how one is published, which one a run resumes from.

    <output_dir>/checkpoints/
        global_step_<N>/
            actor/                 DCP shards of the actor's model and optimizer, scheduler, RNG per rank
            trainer_state.json     driver: step, data position, KL controller, RNG, model signature
            config.yaml            the run's resolved config (export rebuilds the model from it)
        latest                     the newest complete step, as text; written last
        .tmp_global_step_<N>/      a checkpoint being written

A checkpoint is written into ``.tmp_global_step_<N>`` by every rank (a
shared filesystem on a cluster), then renamed to ``global_step_<N>`` in one
``rename`` and only then named in ``latest`` (written to a temporary file and
renamed over it). A crash at any moment leaves the previous checkpoint and
``latest`` untouched; a half-written folder keeps its ``.tmp_`` name and is
removed by the next save.

A background save (``trainer.checkpoint_async``) is a :class:`PendingCheckpoint`
between the step that took it and the commit: the driver's state is taken with
the step, and the commit waits until every rank reports its write finished.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from easytrain.config.schema import Config
from easytrain.distributed.checkpoint import read_json, write_json

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
LATEST = "latest"
PREFIX = "global_step_"
TMP_PREFIX = ".tmp_" + PREFIX
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
ACTOR = "actor"
STEP_DIR = re.compile(rf"^{PREFIX}(\d+)$")


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was asked for, or one that does not fit this run."""


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


def step_of(folder: Path) -> int:
    match = STEP_DIR.match(folder.name)
    if match is None:
        raise CheckpointError(f"{folder}: not a checkpoint folder (expected {PREFIX}<N>)")
    return int(match.group(1))


MANIFEST = "manifest.json"
"""Every file of a published checkpoint with its size, as the ranks wrote them (older checkpoints have none)."""


def missing_files(folder: Path) -> list[str]:
    """Files the checkpoint's manifest names that are absent or of another size (empty without a manifest)."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return []
    try:
        files = read_json(manifest)
    except ValueError:
        return [MANIFEST]
    return [name for name, size in files.items()
            if not (folder / name).is_file() or (folder / name).stat().st_size != size]


def is_complete(folder: Path) -> bool:
    """A published checkpoint whose files are all there, at the sizes written."""
    return STEP_DIR.match(folder.name) is not None and (folder / STATE_FILE).is_file() and not missing_files(folder)


def latest(root: Path) -> Optional[Path]:
    """The checkpoint ``latest`` names; if that file is missing or stale, the newest complete folder."""
    pointer = root / LATEST
    if pointer.is_file():
        text = pointer.read_text().strip()
        folder = root / f"{PREFIX}{text}"
        if text.isdigit() and is_complete(folder):
            return folder
        logger.warning("%s names %r, which is not a complete checkpoint; using the newest complete one", pointer,
                       text)
    complete = sorted((f for f in root.glob(f"{PREFIX}*") if is_complete(f)), key=step_of)
    return complete[-1] if complete else None


def checkpoint_folder(path: str | Path) -> Path:
    """A ``global_step_<N>`` folder as given, or a run folder / ``checkpoints`` folder meaning its latest."""
    p = Path(path).expanduser()
    if is_complete(p):
        return p
    if STEP_DIR.match(p.name):
        missing = missing_files(p) if (p / STATE_FILE).is_file() else []
        what = f"{len(missing)} file(s) missing or cut short, e.g. {missing[0]}" if missing else f"no {STATE_FILE}"
        newest = latest(p.parent) if p.parent.is_dir() else None
        instead = f"the newest complete one is {newest}" if newest is not None else "pick another global_step_<N> folder"
        raise CheckpointError(f"{p}: incomplete checkpoint ({what}); {instead}")
    for root in (p / CHECKPOINTS, p):
        if root.is_dir():
            found = latest(root)
            if found is not None:
                return found
    raise CheckpointError(f"{p}: no complete checkpoint there (looked for {CHECKPOINTS}/{PREFIX}<N>/{STATE_FILE})")


def resume_from(config: Config) -> Optional[Path]:
    """The checkpoint ``trainer.resume`` selects: auto = latest in output_dir (None when there is none)."""
    resume = config.trainer.resume
    if resume == "off":
        return None
    if resume == "auto":
        root = checkpoint_root(config.trainer.output_dir)
        return latest(root) if root.is_dir() else None
    try:
        return checkpoint_folder(resume)
    except CheckpointError as err:
        raise CheckpointError(f"trainer.resume={resume}: {err}") from err


def check_resume(config: Config) -> Optional[Path]:
    """The checkpoint this run resumes from, after refusing an incompatible one (no worker needed). With
    ``trainer.resume=off`` a run folder that already holds checkpoints is refused: a fresh run there would
    overwrite its metrics and colliding checkpoints and prune across the two runs."""
    if config.trainer.resume == "off":
        root = checkpoint_root(config.trainer.output_dir)
        held = sorted((f for f in root.glob(f"{PREFIX}*") if STEP_DIR.match(f.name)), key=step_of) \
            if root.is_dir() else []
        if held:
            raise CheckpointError(f"trainer.resume=off: {config.trainer.output_dir} already holds a run's checkpoints "
                                  f"(up to {held[-1].name}); start the new run in a fresh folder "
                                  "(hydra.run.dir=DIR), or continue this one with trainer.resume=auto")
    folder = resume_from(config)
    if folder is not None:
        check_compatible(folder, config)
    return folder


@dataclass
class PendingCheckpoint:
    """A checkpoint whose shards are (being) written into ``tmp``; what its commit writes was taken with its step."""

    tmp: Path
    step: int
    state: dict[str, Any]
    """The driver's state at ``step`` (trainer_state.json)."""
    config_yaml: str
    started: float
    """``time.perf_counter()`` when the save began."""
    blocked_s: float = 0.0
    """Seconds the step loop waited for this checkpoint so far: the save call, then any wait for its write."""


NO_SPACE = ("No space left on device", "Disk quota exceeded", "[Errno 28]", "[Errno 122]")
"""How a full disk reads in an error, raised here or by a worker (its message carried in a WorkerError)."""


def disk_full(err: BaseException, root: Path) -> bool:
    """Whether ``err`` (or what it was raised from) is a write that found no space, or a failed write while the
    disk of ``root`` has less room than the last checkpoint took (a worker's distributed-checkpoint error names
    only the serializer's complaint, not the full disk behind it)."""
    previous = latest(root)
    needed = max(64 * 2**20, folder_bytes(previous) if previous is not None else 0)
    if shutil.disk_usage(root).free < needed:
        return True
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(err) for text in NO_SPACE):
            return True
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return False


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def save_failed(root: Path, step: int, tmp: Path, err: BaseException) -> str:
    """One line for a checkpoint that a full disk stopped: the half-written folder is removed (it can never be
    loaded, and it holds the space), the last published checkpoint is named, intact, with how much room a
    checkpoint takes and how much is free."""
    shutil.rmtree(tmp, ignore_errors=True)
    previous = latest(root)
    size = folder_bytes(previous) if previous is not None else 0
    free = shutil.disk_usage(root).free
    kept = (f"{previous.name} (the latest) is intact and takes {size / 2**20:.0f} MB" if previous is not None
            else "no earlier checkpoint exists")
    return (f"the checkpoint of step {step} was not saved: no space left on the disk of {root} "
            f"({free / 2**20:.0f} MB free); {kept}. Free space there (or set trainer.save_limit to keep fewer "
            f"checkpoints) and resume")


class CheckpointWriter:
    """Publishes checkpoints under ``root`` atomically and keeps the newest ``save_limit``."""

    def __init__(self, root: Path, save_limit: int = -1) -> None:
        self.root, self.save_limit = root, save_limit

    def begin(self, step: int) -> Path:
        """A fresh temporary folder for ``step`` (left-overs of crashed saves are removed first)."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.root / f"{TMP_PREFIX}{step}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, step: int, state: dict[str, Any], config_yaml: str,
               written: Optional[list[dict[str, Any]]] = None) -> Path:
        """Write the driver's files last, rename the folder into place, then point ``latest`` at it. Every rank's
        shards must be complete (for a background save: every rank's write reported finished). ``written``: what
        each rank sees of ``tmp`` (:meth:`ActorWorker.checkpoint_files`): a file the driver does not see at that
        size is never published, and the manifest of them all lets a resume check the folder is whole."""
        if written is not None:
            manifest = check_written(tmp, step, written)
            write_json(tmp / MANIFEST, manifest)
        (tmp / CONFIG_FILE).write_text(config_yaml)
        write_json(tmp / STATE_FILE, state)
        _fsync_tree(tmp)
        final = self.root / f"{PREFIX}{step}"
        if final.exists():  # written by an earlier attempt that resumed from an older step
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        pointer = self.root / f".{LATEST}.tmp"
        pointer.write_text(f"{step}\n")
        _fsync_file(pointer)
        os.replace(pointer, self.root / LATEST)
        _fsync_dir(self.root)
        self.prune(keep=final)
        return final

    def prune(self, keep: Path) -> None:
        if self.save_limit <= 0:
            return
        folders = sorted((f for f in self.root.glob(f"{PREFIX}*") if STEP_DIR.match(f.name)), key=step_of)
        for old in folders[:-self.save_limit]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)
                logger.info("removed %s (trainer.save_limit=%d)", old.name, self.save_limit)


def check_written(tmp: Path, step: int, written: list[dict[str, Any]]) -> dict[str, int]:
    """Every rank's files as the driver sees them in ``tmp``; a CheckpointError naming the first rank whose files
    it does not see (the run folder is not on storage every node shares)."""
    manifest: dict[str, int] = {}
    for view in sorted(written, key=lambda v: v["rank"]):
        absent = [name for name, size in view["files"].items()
                  if not (tmp / name).is_file() or (tmp / name).stat().st_size != size]
        if absent:
            raise CheckpointError(
                f"the checkpoint of step {step} is not published: {len(absent)} file(s) that actor rank "
                f"{view['rank']} wrote on node {view['node_ip']} are not in {tmp} as the driver sees it (e.g. "
                f"{absent[0]}); the run folder must be on storage every node shares (hydra.run.dir=/shared/...)")
        manifest.update(view["files"])
    return manifest


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some filesystems do not fsync directories
        pass


def _fsync_tree(folder: Path) -> None:
    for dirpath, _, files in os.walk(folder):
        for name in files:
            _fsync_file(Path(dirpath) / name)
        _fsync_dir(Path(dirpath))


# ----------------------------------------------------------------------------- compatibility


SIGNATURE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "vocab_size", "model_type")


def model_signature(config: Config) -> dict[str, Any]:
    """What a checkpoint's tensors depend on: the model's shape and the trainable set."""
    from easytrain.models.shapes import hf_config_for

    hf = hf_config_for(config.model) or {}
    text = {**hf, **(hf.get("text_config") or {})}
    sig: dict[str, Any] = {f"text_config.{k}" if "text_config" in hf and k != "model_type" else k: text.get(k)
                           for k in SIGNATURE_KEYS}
    vision = hf.get("vision_config") or {}
    for key in ("depth", "hidden_size", "embed_dim"):
        if key in vision:
            sig[f"vision_config.{key}"] = vision[key]
    m = config.model
    sig.update({"model.lora.rank": m.lora.rank, "model.lora.target_modules": list(m.lora.target_modules),
                "model.freeze_vision_tower": m.freeze_vision_tower, "model.freeze_aligner": m.freeze_aligner,
                "model.freeze_llm": m.freeze_llm})
    return sig


def check_compatible(folder: Path, config: Config) -> dict[str, Any]:
    """The checkpoint's driver state, after refusing one written for a different model or trainable set."""
    state = read_json(folder / STATE_FILE)
    for key, now_value in (("task", config.trainer.task), ("strategy", config.worker.actor.strategy)):
        saved_value = state.get(key, {"task": "rl", "strategy": "fsdp"}[key])  # older checkpoints: RL on FSDP
        if saved_value != now_value:
            name = "trainer.task" if key == "task" else "worker.actor.strategy"
            raise CheckpointError(f"{folder} was written by a {name}={saved_value} run and this config has "
                                  f"{name}={now_value}; resume with the same setting, or start a new run from its "
                                  f"weights: `easytrain export {folder} --out DIR`, then model.path=DIR")
    saved, now = state.get("model_signature", {}), model_signature(config)
    for key, value in now.items():
        if key in saved and saved[key] != value and value is not None:
            raise CheckpointError(f"{folder} was written for a different model: {key} is {saved[key]!r} there and "
                                  f"{value!r} in this config; resume with the same model settings, or start fresh "
                                  f"in another folder (hydra.run.dir=DIR)")
    return state

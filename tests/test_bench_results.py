"""Every bench/results/*.json was written by its bench script through bench/provenance.py.

Each file must carry the provenance fields (commit, dirty, date, machine, versions, command), name a commit of
this repository, name a script in bench/ whose source refers to the file, and hold no top-level field that script
(or bench/provenance.py) never writes: a hand-edited or stale result fails here. The fix is always the same:
re-run the script named in the message and commit the file it writes.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RESULTS = sorted((BENCH / "results").glob("*.json"))
PROVENANCE = BENCH / "provenance.py"
REQUIRED = ("commit", "dirty", "date", "machine", "versions", "command")
MACHINE_KEYS = ("cpus_usable", "ram_gb", "platform", "python")


def load(path: Path) -> dict[str, Any]:
    record = json.loads(path.read_text())
    assert isinstance(record, dict), f"{path.name}: not a JSON object; re-run the bench script that writes it"
    return record


def script_of(record: dict[str, Any]) -> Optional[Path]:
    """The bench/*.py the record's command runs, if it names one."""
    command = record.get("command")
    if not isinstance(command, str):
        return None
    for word in shlex.split(command):
        if word.endswith(".py") and Path(word).parent == Path("bench"):
            return ROOT / word
    return None


def writers(path: Path) -> list[str]:
    """The bench scripts whose source names the file."""
    return [str(s.relative_to(ROOT)) for s in sorted(BENCH.glob("*.py")) if path.name in s.read_text()]


def rerun(path: Path, record: dict[str, Any]) -> str:
    """What to do about a failing file."""
    script = script_of(record)
    if script is not None and script.is_file():
        how = f"`{record['command'].strip()}`"
    elif writers(path):
        how = " or ".join(writers(path)) + " (its docstring gives the command)"
    else:
        how = "the bench script that writes it (bench/README.md names it)"
    return (f"re-run {how} so that bench/provenance.py writes bench/results/{path.name}, and commit it "
            "(or delete the file and its figures if the bench is gone)")


@lru_cache(maxsize=None)
def string_literals(script: Path) -> frozenset[str]:
    """Every string constant in a script's source (dict keys, arguments, f-string parts, docstrings)."""
    tree = ast.parse(script.read_text())
    return frozenset(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))


@lru_cache(maxsize=None)
def file_patterns(script: Path) -> tuple[re.Pattern[str], ...]:
    """f-strings that build a ``*.json`` name (``f"grpo_step_{size}.json"``) as patterns over file names."""
    patterns = []
    for node in ast.walk(ast.parse(script.read_text())):
        if not isinstance(node, ast.JoinedStr):
            continue
        parts = [re.escape(p.value) if isinstance(p, ast.Constant) else ".+" for p in node.values]
        literal = "".join(p.value for p in node.values if isinstance(p, ast.Constant))
        if literal.endswith(".json") and len(literal.rsplit("/", 1)[-1]) > len(".json") + 2:
            patterns.append(re.compile("(?:.*/)?" + "".join(parts)))
    return tuple(patterns)


@lru_cache(maxsize=1)
def shallow() -> bool:
    done = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() == "true"


def git_ok(*args: str) -> bool:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True).returncode == 0


def test_there_are_results() -> None:
    assert RESULTS, "bench/results/ holds no *.json"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_result_carries_provenance(path: Path) -> None:
    record = load(path)
    missing = [key for key in REQUIRED if key not in record]
    assert not missing, f"bench/results/{path.name} lacks {missing}: not written by bench/provenance.py; " \
                        f"{rerun(path, record)}"
    try:
        datetime.fromisoformat(record["date"])
    except (TypeError, ValueError):
        pytest.fail(f"bench/results/{path.name}: date {record['date']!r} is not ISO 8601; {rerun(path, record)}")
    machine = record["machine"]
    assert isinstance(machine, dict) and all(k in machine for k in MACHINE_KEYS), \
        f"bench/results/{path.name}: machine {machine!r} lacks {MACHINE_KEYS}; {rerun(path, record)}"
    assert isinstance(record["versions"], dict) and record["versions"], \
        f"bench/results/{path.name}: no package versions; {rerun(path, record)}"
    assert isinstance(record["dirty"], bool), f"bench/results/{path.name}: dirty is not true/false"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_result_commit_is_in_this_repository(path: Path) -> None:
    record = load(path)
    commit = record.get("commit")
    assert isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{40}", commit), \
        f"bench/results/{path.name}: commit {commit!r} is not a full commit id; {rerun(path, record)}"
    if shallow():
        pytest.skip("shallow checkout: older commits are not here to look up (fetch with --unshallow to check)")
    assert git_ok("cat-file", "-e", f"{commit}^{{commit}}"), \
        f"bench/results/{path.name}: commit {commit[:12]} is not in this repository; {rerun(path, record)}"
    assert git_ok("merge-base", "--is-ancestor", commit, "HEAD"), \
        f"bench/results/{path.name}: commit {commit[:12]} is not in HEAD's history; {rerun(path, record)}"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_result_command_names_the_script_that_writes_it(path: Path) -> None:
    record = load(path)
    script = script_of(record)
    assert script is not None, f"bench/results/{path.name}: command {record.get('command')!r} names no " \
                               f"bench/*.py; {rerun(path, record)}"
    assert script.is_file(), f"bench/results/{path.name}: {script.relative_to(ROOT)} does not exist; " \
                             "re-measure with the script that replaced it, or delete the file"
    named = path.name in script.read_text() or any(p.fullmatch(path.name) for p in file_patterns(script))
    assert named, f"bench/results/{path.name}: {script.relative_to(ROOT)} never refers to this file name; " \
                  f"{rerun(path, record)}"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_result_holds_only_fields_its_script_writes(path: Path) -> None:
    record = load(path)
    script = script_of(record)
    if script is None or not script.is_file():
        pytest.fail(f"bench/results/{path.name}: no bench script to check its fields against; "
                    f"{rerun(path, record)}")
    known = string_literals(script) | string_literals(PROVENANCE)
    foreign = sorted(key for key in record if key not in known)
    assert not foreign, f"bench/results/{path.name}: top-level {foreign} never written by " \
                        f"{script.relative_to(ROOT)} (added by hand, or the script changed since); " \
                        f"{rerun(path, record)}"


def cpu_machine(record: dict[str, Any]) -> bool:
    """Whether a result's provenance names a machine without a GPU: a CPU build of torch, or no GPU seen."""
    return str(record.get("versions", {}).get("torch", "")).endswith("+cpu") or record.get("machine", {}).get(
        "gpus") == []


def gpu_readings(node: Any) -> bool:
    """Whether a result holds readings of a CUDA device: bench/gpu_smoke.py's ``device()`` (name, total bytes,
    torch's CUDA version), which every GPU bench records beside what it measured there."""
    if isinstance(node, dict):
        if {"torch_cuda", "total_bytes"} <= set(node) and node.get("torch_cuda"):
            return True
        return any(gpu_readings(v) for k, v in node.items() if k != "rescored")
    return isinstance(node, list) and any(gpu_readings(v) for v in node)


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_gpu_readings_keep_the_gpu_machines_provenance(path: Path) -> None:
    """A rescore on another machine keeps the measuring machine's provenance (bench/provenance.py's
    write_rescored): a file of GPU readings whose provenance names a CPU machine lost its origin."""
    record = load(path)
    if gpu_readings(record):
        assert not cpu_machine(record), (
            f"bench/results/{path.name} holds readings from a GPU but its provenance names a CPU machine "
            f"(torch {record.get('versions', {}).get('torch')}, {record.get('machine', {}).get('cpus_usable')} CPUs):"
            " a rescore replaced the measuring machine's; rescore with bench/provenance.py's write_rescored")


ACCURACY_KEY = re.compile(r"(under|over)_prediction$|within_goal$|^worst_error$")
"""Keys that quote the planner's accuracy (planned against measured memory)."""
SPLITS = {"calibration", "held_out"}


def unsplit_accuracy(node: Any, path: tuple[str, ...] = (), tagged: bool = False) -> list[str]:
    """The paths of accuracy figures that say neither calibration nor held-out: under a split key, or in a dict
    tagged with one (``tag`` / ``split``)."""
    found = []
    if isinstance(node, dict):
        tagged = tagged or node.get("tag") in SPLITS or node.get("split") in SPLITS
        for key, value in node.items():
            here = (*path, str(key))
            split = tagged or bool(SPLITS & set(here))
            if ACCURACY_KEY.search(str(key)) and not split:
                found.append("/".join(here))
            found += unsplit_accuracy(value, here, split)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += unsplit_accuracy(value, (*path, str(i)), tagged)
    return found


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_a_quoted_accuracy_says_calibration_or_held_out(path: Path) -> None:
    record = load(path)
    unsplit = unsplit_accuracy({k: v for k, v in record.items() if k != "rescored"})
    assert not unsplit, (f"bench/results/{path.name}: {unsplit[:5]} quote the plan's accuracy without saying "
                         "calibration or held_out (a figure fitted on is not a result): report each split apart")


DOC_QUOTE = re.compile(r"\b\d+ of \d+ phases\b|phases? within \d+%|worst (host |device )?under-prediction", re.I)
DOC_SPLIT = re.compile(r"calibration|held[- ]out|in-sample|fitted on", re.I)


def doc_paragraphs() -> list[tuple[str, str]]:
    pages = [ROOT / "README.md", BENCH / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [(str(page.relative_to(ROOT)), para) for page in pages for para in re.split(r"\n\s*\n", page.read_text())]


def test_the_docs_say_which_split_an_accuracy_comes_from() -> None:
    bare = [f"{page}: {para.strip()[:160]!r}" for page, para in doc_paragraphs()
            if DOC_QUOTE.search(para) and not DOC_SPLIT.search(para)]
    assert not bare, ("these paragraphs quote the plan's accuracy without saying calibration or held-out: "
                      + "; ".join(bare[:5]))


def test_the_split_checks_catch_an_unsplit_figure() -> None:
    """The two checks above can fail: an unsplit figure and a CPU-rescored GPU file are caught."""
    assert unsplit_accuracy({"worst_under_prediction": {"all": -0.04}}) == ["worst_under_prediction"]
    assert unsplit_accuracy({"runs": {"a": {"tag": "held_out", "within_goal": 3}}}) == []
    assert unsplit_accuracy({"accuracy": {"calibration": {"worst_over_prediction": 0.1}}}) == []
    gpu = {"versions": {"torch": "2.13.0+cpu"}, "machine": {}, "device": {"torch_cuda": "13.0", "total_bytes": 1}}
    assert gpu_readings(gpu) and cpu_machine(gpu)
    assert not cpu_machine({"versions": {"torch": "2.11.0"}, "machine": {"gpus": ["NVIDIA H200"]}})

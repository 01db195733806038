"""The generated pages are what the code says now, and the metric catalog they come from is true to the code.

docs/config.md and docs/metrics.md are written by ``scripts/gen_docs.py`` (from the schema and from
``easytrain/trainer/metric_names.py``); a page that differs from what the script writes now fails here. The
catalog is checked against the package's source both ways: every metric name the code logs (a string or
f-string used as a key of a dict or of a subscript store, or a phase of a ``timer(...)``) is in it, every name
the code reads back (plots, the console line) is in it, and each of its entries is still logged somewhere.
The names a real run logs are checked in ``tests/test_report_run.py`` (the default run).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Callable, Optional

import pytest

from easytrain.config import reference, schema_keys
from easytrain.trainer import metric_names
from easytrain.trainer.metric_names import METRICS, PLACEHOLDERS, PREFIXES, is_known

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "easytrain"
FIX = "run `.venv/bin/python scripts/gen_docs.py`"
METRIC = re.compile(r"(?:%s)/[A-Za-z0-9_/]*[A-Za-z0-9_]" % "|".join(map(re.escape, PREFIXES)))
"""A string that is a metric name (its first part one of the catalog's prefixes)."""
BUILT = re.compile(r"(?:%s)/" % "|".join(map(re.escape, PREFIXES)))
"""The start of an f-string that builds metric names."""

SUMMED = re.compile(r"actor/.+_sum")
"""The actor's per-rank sums (workers/actor.py): ``trainer/stats.reduce_update_metrics`` divides them and logs
them without ``_sum``."""
DIVISORS = {"actor/tokens", "actor/optimizer_steps"}
"""Per-rank counts ``reduce_update_metrics`` divides the sums by; never logged."""
UNLOGGED_PHASES = {"validate"}
"""Timer phases whose times are not logged under ``time/``: SFT's validation, logged as ``val/time``."""
READ_BUT_NEVER_LOGGED: set[str] = set()
"""Names trainer/report.py plots but nothing logs (a line the plot never draws). When the code stops reading
one, or starts logging it (then it belongs in the catalog), take it out of this set."""
SENTINEL = "\0"
"""Stands for a free placeholder's value when an entry is matched against the source's f-strings."""


def gen_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- freshness


@pytest.mark.parametrize("page", ["docs/config.md", "docs/metrics.md"])
def test_the_generated_page_is_what_the_generator_writes_now(page: str) -> None:
    render = gen_docs().PAGES[page]
    path = ROOT / page
    assert path.is_file(), f"{page} is missing: {FIX}"
    assert path.read_text() == render(), f"{page} is stale (the schema or the metric catalog changed): {FIX}"


def test_gen_docs_check_names_the_stale_page(tmp_path: Path) -> None:
    module = gen_docs()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "config.md").write_text(reference.markdown())
    (tmp_path / "docs" / "metrics.md").write_text("old\n")
    from easytrain.models.families import table

    gpu = module.gpu_status
    readme = (f"# hand-written\n\n{table.BEGIN}\n| an old table |\n{table.END}\n\nmore by hand\n"
              f"{gpu.BEGIN}\n- an old GPU record\n{gpu.END}\n")
    (tmp_path / "README.md").write_text(readme)
    assert module.stale(tmp_path) == ["docs/metrics.md", "README.md"]
    (tmp_path / "README.md").write_text(table.with_table(readme))  # one block fresh, the other still stale
    assert module.stale(tmp_path) == ["docs/metrics.md", "README.md"]
    (tmp_path / "README.md").write_text(gpu.with_block(table.with_table(readme)))  # the rest is kept
    assert module.stale(tmp_path) == ["docs/metrics.md"]
    assert (tmp_path / "README.md").read_text().startswith("# hand-written") and "| Gemma 3 |" in table.markdown()
    assert module.main(["--check"]) == 0  # the checkout's own pages are fresh


def test_the_config_page_has_every_schema_key_with_its_doc_line() -> None:
    found = reference.keys()
    assert [k.name for k in found] == schema_keys()
    assert not [k.name for k in found if not k.doc], "a key without a docstring under its field in schema.py"
    assert {k.name.split(".")[0] for k in found} == set(reference.SECTIONS)
    page = reference.markdown()
    assert all(f"| `{k.name}` |" in page for k in found)
    rows = {k.name: k for k in found}
    assert rows["worker.rollout.top_p"].range == "(0.0, 1.0]"
    assert rows["trainer.device"].range == "one of cpu, cuda"
    assert rows["ray.num_cpus"].type == "int or null" and rows["ray.num_cpus"].range == ">= 1"
    assert rows["trainer.loggers"].default == "[console, jsonl, tensorboard]"


# ----------------------------------------------------------------------------- the catalog against the source


@dataclasses.dataclass
class Scan:
    logged: dict[str, str] = dataclasses.field(default_factory=dict)
    """Metric names the code writes -> where."""
    shapes: dict[str, str] = dataclasses.field(default_factory=dict)
    """f-strings that build metric names (holes as ``{}``) -> where."""
    read: dict[str, str] = dataclasses.field(default_factory=dict)
    """Metric names the code only reads or lists -> where."""
    constants: set[str] = dataclasses.field(default_factory=set)
    """Every string constant of the package."""


def _shape(node: ast.JoinedStr) -> str:
    return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)


def _written_keys(tree: ast.AST) -> list[ast.expr]:
    """Expressions used as a dict key, a dict comprehension's key, a subscript assigned to, or a timer's phase
    (``timer("generate")`` writes ``time/generate``)."""
    keys: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            keys += [k for k in node.keys if k is not None]
        elif isinstance(node, ast.DictComp):
            keys.append(node.key)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            keys.append(node.slice)
    return keys


def _timer_phases(tree: ast.AST) -> list[str]:
    return [node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "timer"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)]


def logged_name(name: str) -> Optional[str]:
    """The name as it is logged (the actor's sums lose ``_sum``), None for the divisors."""
    if name in DIVISORS:
        return None
    return name[: -len("_sum")] if SUMMED.fullmatch(name) else name


@lru_cache(maxsize=1)
def scan() -> Scan:
    out = Scan()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "metric_names.py":
            continue
        where = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        written = {id(k) for k in _written_keys(tree)}
        pieces = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
        for phase in set(_timer_phases(tree)) - UNLOGGED_PHASES:
            out.logged.setdefault(f"time/{phase}", where)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in pieces:
                out.constants.add(node.value)
                if not METRIC.fullmatch(node.value) or node.value in DIVISORS:
                    continue
                if id(node) in written:
                    name = logged_name(node.value)
                    if name is not None:
                        out.logged.setdefault(name, where)
                else:
                    out.read.setdefault(node.value, where)
            elif isinstance(node, ast.JoinedStr) and id(node) in written and BUILT.match(_shape(node)):
                out.shapes.setdefault(_shape(node), where)
    return out


def fills(text: str, parts: list[str], holes_ok: Callable[[str], bool]) -> bool:
    """Whether ``text`` is the f-string ``parts`` (constant pieces around ``{}`` holes) with every hole's
    value accepted by ``holes_ok``."""
    if not parts:
        return text == ""
    head = parts[0]
    if head != "{}":
        return text.startswith(head) and fills(text[len(head):], parts[1:], holes_ok)
    return any(holes_ok(text[:cut]) and fills(text[cut:], parts[1:], holes_ok) for cut in range(1, len(text) + 1))


def produced(name: str, depth: int = 0) -> bool:
    """Whether the code logs ``name``: as a literal, or through an f-string whose holes are string constants
    of the package, names it logs, or a free placeholder's value."""
    found = scan()
    if name in found.logged:
        return True
    if depth > 3:
        return False

    def hole_ok(value: str) -> bool:
        return SENTINEL in value or value in found.constants or produced(value, depth + 1)

    return any(fills(name, [p for p in re.split(r"(\{\})", shape) if p], hole_ok) for shape in found.shapes)


def expansions(entry: str) -> list[str]:
    """A catalog entry's concrete names: each enumerated placeholder value, the sentinel for free ones."""
    names = [entry]
    for placeholder, (values, _) in PLACEHOLDERS.items():
        options = values.split("|") if re.fullmatch(r"[a-z_|]+", values) else [SENTINEL]
        names = [n.replace(placeholder, o) for n in names for o in options] if placeholder in entry else names
    return names


def test_every_name_the_code_logs_is_in_the_catalog() -> None:
    found = scan()
    assert {"reward/mean", "actor/pg_loss", "time/generate", "sync/seconds"} <= set(found.logged)  # the scan works
    missing = {name: where for name, where in found.logged.items() if not is_known(name)}
    assert not missing, f"logged but not in easytrain/trainer/metric_names.py (add them, then {FIX}): {missing}"
    samples = [n.replace(SENTINEL, "x") for entry in METRICS for n in expansions(entry)]
    uncovered = {shape: where for shape, where in found.shapes.items()
                 if not any(re.fullmatch(".+".join(map(re.escape, shape.split("{}"))), s) for s in samples)}
    assert not uncovered, f"names built at run time that no catalog entry covers: {uncovered}"


def test_every_name_the_code_reads_is_logged() -> None:
    found = scan()
    timers = {f"time/{phase}" for phase in UNLOGGED_PHASES}  # a timer's own reading, not a metric
    unknown = {name: where for name, where in found.read.items() if not is_known(name) and name not in timers}
    assert set(unknown) == READ_BUT_NEVER_LOGGED, (
        f"names the code reads that are not in the catalog: {unknown}; a name nothing logs is a bug of the "
        f"reader (report these), one the code logs belongs in the catalog; READ_BUT_NEVER_LOGGED lists the "
        f"known ones")


@pytest.mark.parametrize("entry", list(METRICS))
def test_each_catalog_entry_is_still_logged(entry: str) -> None:
    dead = [n.replace(SENTINEL, "<any>") for n in expansions(entry) if not produced(n)]
    assert not dead, f"{entry}: nothing in easytrain/ logs {dead}; take it out of metric_names.py and {FIX}"


def test_the_catalog_is_grouped_by_known_prefixes() -> None:
    assert {name.split("/", 1)[0] for name in METRICS} == set(PREFIXES)
    assert all(p in PLACEHOLDERS for name in METRICS for p in re.findall(r"<[^>]+>", name))
    page = metric_names.markdown()
    assert all(f"| `{name}` |" in page for name in METRICS)

"""The README and docs/*.md cite only config keys and metric names that exist.

A backticked span is read word by word. A word is a config key when its first dotted part is a top-level
section (``worker.actor.padding_free``, ``trainer.device=cuda``, ``+trainer.colocate=false``): it must be a key
of the schema or a group of keys (``worker.actor``, ``worker.{actor,ref}``). A word is a metric name when it
is ``prefix/name`` with a prefix the metric catalog knows (``reward/mean``), or a ``word/word`` that is no
path of this repository or of a run folder (so ``loss/policy`` is caught): it must be a name in the catalog
(docs/metrics.md), ``*`` and ``<...>`` matching any part (``memory/worker_*``, ``time/<phase>``). Fenced code
blocks are read for ``key=value`` overrides on command lines. File paths (``bench/results/x.json``,
``easytrain/trainer/rl.py``, ``conf/model``) are never names.
"""

from __future__ import annotations

import re
from functools import lru_cache
from itertools import product
from pathlib import Path

from easytrain.config import schema_keys
from easytrain.config.reference import SECTIONS, keys
from easytrain.trainer.metric_names import METRICS, PLACEHOLDERS, PREFIXES, is_known

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FILE_SUFFIX = re.compile(r"\.(py|json|jsonl|md|yaml|yml|sh|txt|png|html|pt|bin|safetensors|parquet|csv|log|lock|"
                         r"toml|cfg|tar|gz|so|h|cpp|cu)$")
RUN_FOLDER = {"checkpoints", "hf", "tensorboard", "mlruns", "wandb", "outputs", "runs", "cache", "zero", "actor"}
"""First parts of paths inside a run folder (``checkpoints/latest``), not metrics."""
NOT_NAMES = {
    "ray.init", "ray.get", "ray.put", "ray.remote", "ray.util", "ray.util.metrics", "ray.cluster_utils",
    "ray.io",  # Ray's Python API and its node label, not the ray section
    "model.pth",  # docs/bad-input.md: the misspelt key it shows the answer to
    "model.x",  # docs/bad-input.md: a tensor name in an export error
    "trainer.no_such_key",  # docs/bad-input.md: an unknown key in a checkpoint's config.yaml
    "ray/auth_token",  # docs/cluster.md: a Kubernetes Secret and its key
}
"""Words that look like a config key or a metric name and are something else, each with where and why."""
TOKEN = re.compile(r"(?:\{[^{}\s]*\}|[^\s()\[\]\"',;`|])+")
"""A word of a span: no spaces, brackets, quotes or commas except inside ``{a,b}``."""


def expand(word: str) -> list[str]:
    """``worker.{actor,ref}.fsdp`` -> ``worker.actor.fsdp``, ``worker.ref.fsdp``."""
    parts = re.split(r"\{([^{}]*)\}", word)
    options = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(choice) for choice in product(*options)]


@lru_cache(maxsize=1)
def config_names() -> frozenset[str]:
    """Every key and every group of keys (``worker``, ``worker.actor``, ``worker.actor.optim``)."""
    names = set()
    for key in schema_keys():
        parts = key.split(".")
        names |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return frozenset(names)


@lru_cache(maxsize=1)
def metric_samples() -> tuple[str, ...]:
    """Concrete names for the catalog: each entry with every value of an enumerated placeholder, ``x`` for
    a free one."""
    out = []
    for entry in METRICS:
        names = [entry]
        for placeholder, (values, _) in PLACEHOLDERS.items():
            options = values.split("|") if re.fullmatch(r"[a-z_|]+", values) else ["x"]
            names = [n.replace(placeholder, o) for n in names for o in options]
        out += names
    return tuple(out)


def is_config_word(word: str) -> bool:
    return "." in word and word.split(".", 1)[0] in SECTIONS and "/" not in word


@lru_cache(maxsize=1)
def mapping_keys() -> tuple[str, ...]:
    """Keys whose value is a mapping (``launch.secret_env``): any word under them is one of its entries."""
    return tuple(k.name + "." for k in keys() if k.type.startswith("dict"))


def config_ok(word: str) -> bool:
    if word in NOT_NAMES or FILE_SUFFIX.search(word):
        return True
    return all(name in config_names() or name.startswith(mapping_keys()) for name in expand(word))


def repo_path(first: str) -> bool:
    return (ROOT / first).exists() or (ROOT / "easytrain" / first).exists()


def is_metric_word(word: str) -> bool:
    """``prefix/...`` with a catalog prefix; or a lowercase ``a/b`` that is no path (``loss/policy``)."""
    parts = word.split("/")
    if len(parts) < 2 or word in NOT_NAMES or FILE_SUFFIX.search(word) or ":" in word:
        return False
    if any(p.startswith((".", "~", "<")) or not p for p in parts):  # /abs, ./rel, .hidden, <run>/x
        return False
    if parts[0] in PREFIXES:
        return True
    return (len(parts) == 2 and all(re.fullmatch(r"[a-z_][a-z0-9_]*", p) for p in parts)
            and not (repo_path(parts[0]) or parts[0] in RUN_FOLDER))


def metric_ok(word: str) -> bool:
    for name in expand(word):
        if name in METRICS or is_known(name):
            continue
        wild = re.split(r"(\*|<[^>]*>)", name)
        if len(wild) == 1:
            return False
        regex = re.compile("".join(".+" if i % 2 else re.escape(p) for i, p in enumerate(wild)))
        if not any(regex.fullmatch(sample) for sample in metric_samples()):
            return False
    return True


def words(text: str) -> list[str]:
    """The words of ``text``, a leading ``+``/``~`` and a ``=value`` cut off."""
    out = []
    for token in TOKEN.findall(text):
        word = token.lstrip("+~").split("=", 1)[0].rstrip(".:?!")
        if word:
            out.append(word)
    return out


def cited(path: Path) -> list[tuple[int, str, str]]:
    """(line, word, 'config key' or 'metric') for every name ``path`` cites."""
    found = []
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:  # command lines: overrides only
            spans = [w for w in line.split() if "=" in w]
        else:
            spans = re.findall(r"`([^`]+)`", line)
        for span in spans:
            for word in words(span):
                if is_config_word(word):
                    found.append((number, word, "config key"))
                elif is_metric_word(word) and not fenced:
                    found.append((number, word, "metric"))
    return found


def test_the_scanner_tells_names_from_paths() -> None:
    assert words("python -m easytrain.main +trainer.colocate=false worker.rollout.n=2") == [
        "python", "-m", "easytrain.main", "trainer.colocate", "worker.rollout.n"]
    assert is_config_word("worker.actor.padding_free") and not is_config_word("easytrain/trainer/rl.py")
    assert config_ok("worker.{actor,ref}.offload.params") and not config_ok("worker.actor.padding_fre")
    assert not config_ok("worker.{actor,rollout}.offload.params")  # the rollout has no offload keys
    assert config_ok("trainer") and config_ok("worker.actor.optim") and not config_ok("trainer.colocated")
    for path in ("bench/results/x.json", "easytrain/trainer/rl.py", "conf/model", "tests/gpu", "checkpoints/latest",
                 "/dev/shm", "memory/phases.py", ".venv/bin/python", "<run>/tensorboard", "Qwen/Qwen2.5-VL-7B-Instruct",
                 "GB/GPU", "actor/.metadata", "submit/status/logs/stop"):
        assert not is_metric_word(path), path
    assert is_metric_word("loss/policy") and not metric_ok("loss/policy")
    assert is_metric_word("memory/ram_used_gb") and not metric_ok("memory/ram_used_gb")
    for name in ("reward/mean", "memory/worker_*", "time/<phase>", "val/reward/*", "memory/{actor,ref,rollout}_*",
                 "memory/worker_rss_gb_max", "reward/accuracy"):
        assert metric_ok(name), name


def test_the_docs_cite_only_keys_and_metrics_that_exist() -> None:
    bad = []
    for path in DOCS:
        for line, word, kind in cited(path):
            ok = config_ok(word) if kind == "config key" else metric_ok(word)
            if not ok:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {kind} `{word}` does not exist")
    assert not bad, ("the docs cite names the code does not have (config keys: easytrain/config/schema.py, "
                     "docs/config.md; metrics: easytrain/trainer/metric_names.py, docs/metrics.md):\n"
                     + "\n".join(bad))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_docs_links_lead_somewhere() -> None:
    bad = []
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+://|mailto:", target):
                    continue
                file, _, anchor = target.partition("#")
                where = (path.parent / file).resolve() if file else path
                if not where.exists():
                    bad.append(f"{path.relative_to(ROOT)}:{number}: {target}: no such file")
                elif anchor and where.suffix == ".md" and anchor not in {
                        slug(h) for h in re.findall(r"^#+ (.+)$", where.read_text(), re.M)}:
                    bad.append(f"{path.relative_to(ROOT)}:{number}: {target}: no such heading")
    assert not bad, "\n".join(bad)

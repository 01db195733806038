"""The run report: ``metrics.jsonl`` drawn as PNGs beside the memory timeline, and an ``index.html`` that
shows them with the final metrics and the run's config.

Written when a run closes (also after a stop or a failure, for what was logged), and on demand:

    easytrain report outputs/my_run        # then open outputs/my_run/index.html

Plots, each only when the run logged any of its keys (a panel without data is left out):

- ``reward.png``: train ``reward/mean`` (with a +-std band) and ``val/reward/mean``; accuracy and the other
  reward components, train and validation.
- ``loss.png``: ``train/loss`` and ``val/loss`` (SFT).
- ``response_length.png``: mean, max and min response length; the share clipped at the length limit.
- ``kl.png``: ``actor/kl_loss`` and ``actor/ppo_kl``; ``actor/kl_coef``.
- ``time.png``: the step's phases (``time/<phase>``) stacked, with ``time/step`` on top; tokens/s.

Validation points are drawn with markers (they are few); training series as lines. The page is
self-contained (inline style, no script, images by relative path), so the run folder can be copied or
served as it is.
"""

from __future__ import annotations

import html
import logging
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from easytrain.memory.timeline import PHASE_COLOURS, WIDTH_IN, plot_timeline, read_jsonl

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)

Series = dict[str, list[tuple[int, float]]]
"""Metric key -> (step, value) sorted by step, finite values only."""

ROW_HEIGHT_IN = 3.4
DPI = 100
INDEX = "index.html"
MEMORY_PNG = "memory.png"
CONFIG_FILES = ("config.yaml", ".hydra/config.yaml")
"""Where the run's config is, first found wins; then the latest checkpoint's ``config.yaml``."""

HEADLINE = ("reward/mean", "reward/accuracy", "val/reward/mean", "val/reward/accuracy", "train/loss", "val/loss",
            "response_length/mean", "actor/kl_loss", "actor/entropy", "actor/grad_norm",
            "perf/generate_tokens_per_s", "perf/train_tokens_per_s", "time/step", "memory/node_ram_fraction_max")
"""The final-metrics table: each key's last value, in this order."""

REWARD_STATS = ("mean", "std", "max", "min", "error_rate")
"""``reward/<stat>`` keys that are statistics of the overall reward, not components of it."""


@dataclass(frozen=True)
class Panel:
    """One axes of a plot: lines for ``keys`` (those present), or the phases stacked (``stack_prefix``)."""

    title: str
    ylabel: str
    keys: tuple[str, ...] = ()
    band: Optional[tuple[str, str]] = None
    """(key, its std key): a +-std band around the key's line."""
    stack_prefix: Optional[str] = None
    """Stack every key with this prefix except ``keys`` (drawn as lines on top)."""


@dataclass(frozen=True)
class Plot:
    name: str
    title: str
    panels: tuple[Panel, ...]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``; torn or foreign lines (a run killed mid-write) are skipped."""
    return read_jsonl(path, lambda record: isinstance(record.get("step"), (int, float)))


def to_series(records: list[dict[str, Any]]) -> Series:
    """Each numeric key's values by step; a step logged twice (a run rewritten in place) keeps the last."""
    by_key: dict[str, dict[int, float]] = {}
    for record in records:
        step = int(record["step"])
        for key, value in record.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                by_key.setdefault(key, {})[step] = float(value)
    return {key: sorted(values.items()) for key, values in by_key.items()}


def reward_components(series: Series) -> tuple[str, ...]:
    """``reward/<component>`` and ``val/reward/<component>`` keys (accuracy first), train before validation."""
    names = sorted({key.split("/")[-1] for key in series if re.fullmatch(r"(val/)?reward/[^/]+", key)}
                   - set(REWARD_STATS), key=lambda n: (n != "accuracy", n))
    return tuple(key for n in names for key in (f"reward/{n}", f"val/reward/{n}"))


def plots(series: Series) -> list[Plot]:
    """The plots for this run's keys (panels and plots without data are dropped when drawing)."""
    components = reward_components(series)
    accuracy_only = set(components) <= {"reward/accuracy", "val/reward/accuracy"}
    return [
        Plot("reward", "Reward and accuracy", (
            Panel("reward", "reward", ("reward/mean", "val/reward/mean"), band=("reward/mean", "reward/std")),
            Panel("accuracy" if accuracy_only else "reward components", "score", components))),
        Plot("loss", "Loss", (Panel("loss", "loss", ("train/loss", "val/loss")),)),
        Plot("response_length", "Response length", (
            Panel("response length", "tokens",
                  ("response_length/mean", "response_length/max", "response_length/min")),
            Panel("clipped at max_response_length", "share of responses", ("response_length/clip_ratio",)))),
        Plot("kl", "KL", (
            Panel("KL to the reference / old policy", "KL", ("actor/kl_loss", "actor/ppo_kl")),
            Panel("KL coefficient", "coefficient", ("actor/kl_coef",)))),
        Plot("time", "Step time by phase", (
            Panel("phases (stacked)", "seconds", ("time/step",), stack_prefix="time/"),
            Panel("throughput", "tokens / s", ("perf/generate_tokens_per_s", "perf/train_tokens_per_s")))),
    ]


def _stacked(panel: Panel, series: Series) -> list[str]:
    if panel.stack_prefix is None:
        return []
    return [key for key in series if key.startswith(panel.stack_prefix) and key not in panel.keys]


def _has_data(panel: Panel, series: Series) -> bool:
    return any(series.get(key) for key in panel.keys) or bool(_stacked(panel, series))


def _line(ax: Axes, key: str, points: list[tuple[int, float]]) -> None:
    steps, values = [s for s, _ in points], [v for _, v in points]
    sparse = key.startswith("val/") or len(points) < 40
    ax.plot(steps, values, marker="o" if sparse else None, markersize=4 if key.startswith("val/") else 2.5,
            linewidth=1.4 if not key.startswith("val/") else 1.8, linestyle="--" if key.startswith("val/") else "-",
            label=key)


def _draw_stack(ax: Axes, phases: list[str], series: Series) -> None:
    """The phases of each step stacked (a phase a step did not run counts 0), in the order they were logged."""
    steps = sorted({s for key in phases for s, _ in series[key]})
    values = [[dict(series[key]).get(s, 0.0) for s in steps] for key in phases]
    colours = [PHASE_COLOURS[i % len(PHASE_COLOURS)] for i in range(len(phases))]
    ax.stackplot(steps, values, labels=[k.split("/", 1)[1] for k in phases], colors=colours, alpha=0.75)


def _draw_panel(ax: Axes, panel: Panel, series: Series) -> None:
    phases = _stacked(panel, series)
    if phases:
        _draw_stack(ax, phases, series)
    for key in panel.keys:
        points = series.get(key)
        if not points:
            continue
        if phases:  # the total over the stack: a thin black line
            ax.plot([s for s, _ in points], [v for _, v in points], color="black", linewidth=1.2, label=key)
            continue
        _line(ax, key, points)
        if panel.band is not None and panel.band[0] == key and series.get(panel.band[1]):
            std = dict(series[panel.band[1]])
            steps = [s for s, _ in points if s in std]
            mean = dict(points)
            ax.fill_between(steps, [mean[s] - std[s] for s in steps], [mean[s] + std[s] for s in steps],
                            alpha=0.15, linewidth=0, label=f"{key} +- std")
    ax.set_title(panel.title, fontsize=10, loc="left")
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def plot_figure(plot: Plot, series: Series, run_name: str) -> Optional[Figure]:
    """``plot`` as a matplotlib figure (no pyplot: the caller's global state is left alone); None when
    none of its panels has data."""
    from matplotlib.figure import Figure

    panels = [p for p in plot.panels if _has_data(p, series)]
    if not panels:
        return None
    fig = Figure(figsize=(WIDTH_IN, ROW_HEIGHT_IN * len(panels) + 0.9))
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels):
        _draw_panel(ax, panel, series)
    axes[-1].set_xlabel("step")
    fig.suptitle(f"{plot.title}: {run_name}", fontsize=12)
    fig.tight_layout()
    return fig


def find_config(run_dir: Path) -> Optional[Path]:
    """The run's config: ``config.yaml`` (written at the start), Hydra's, else the latest checkpoint's."""
    for name in CONFIG_FILES:
        if (run_dir / name).is_file():
            return run_dir / name
    saved = [(int(m.group(1)), p) for p in run_dir.glob("checkpoints/global_step_*/config.yaml")
             if (m := re.search(r"global_step_(\d+)$", p.parent.name))]
    return max(saved)[1] if saved else None


def _experiment_name(config_text: str) -> Optional[str]:
    try:
        import yaml

        loaded = yaml.safe_load(config_text)
        name = loaded.get("trainer", {}).get("experiment_name") if isinstance(loaded, dict) else None
    except Exception:  # noqa: BLE001 - a config we cannot read still goes on the page as text
        return None
    return str(name) if name else None


def final_metrics(series: Series) -> list[tuple[str, int, float]]:
    """(key, step, value): the last value of each headline key the run logged."""
    return [(key, *series[key][-1]) for key in HEADLINE if series.get(key)]


def _value(value: float) -> str:
    return f"{value:.4g}"


STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; padding: 0 1em; max-width: 1250px; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
.meta { color: #666; margin-top: 0; }
table { border-collapse: collapse; } td, th { padding: 0.25em 0.9em; border-bottom: 1px solid #ddd; }
th { text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #666; font-size: 0.9em; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 0.85em; }
"""


def render_index(run_name: str, run_dir: Path, images: list[tuple[str, str]], table: list[tuple[str, int, float]],
                 config_text: Optional[str], config_source: Optional[str], last_step: Optional[int]) -> str:
    """The page: run name, final metrics, the plots (``(file name, caption)``, relative paths) and the config."""
    esc = html.escape
    rows = "\n".join(f"<tr><td>{esc(key)}</td><td class=\"num\">{esc(_value(value))}</td>"
                     f"<td class=\"num\">{step}</td></tr>" for key, step, value in table)
    metrics = (f"<table>\n<tr><th>metric</th><th>value</th><th>step</th></tr>\n{rows}\n</table>" if table
               else "<p>No metrics logged yet.</p>")
    figures = "\n".join(f"<figure><img src=\"{esc(name)}\" alt=\"{esc(caption)}\">"
                        f"<figcaption>{esc(caption)} ({esc(name)})</figcaption></figure>" for name, caption in images)
    config = (f"<p class=\"meta\">from {esc(config_source or '')}</p>\n<pre>{esc(config_text)}</pre>"
              if config_text is not None else "<p>No config found in the run folder.</p>")
    steps = f"last step {last_step}" if last_step is not None else "no steps"
    written = time.strftime("%Y-%m-%d %H:%M:%S")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>easytrain: {esc(run_name)}</title>
<style>{STYLE}</style>
</head>
<body>
<h1>{esc(run_name)}</h1>
<p class="meta">{esc(str(run_dir))} &middot; {esc(steps)} &middot; report written {esc(written)}</p>
<h2>Final metrics</h2>
{metrics}
<h2>Plots</h2>
{figures or "<p>Nothing to plot yet.</p>"}
<h2>Config</h2>
{config}
</body>
</html>
"""


def write_report(run_dir: Path) -> list[Path]:
    """Draw ``run_dir/metrics.jsonl`` as PNGs in ``run_dir`` and write ``run_dir/index.html`` showing them,
    the memory timeline (``memory.png``, drawn from ``memory.jsonl`` when missing), the final metrics and the
    run's config. Safe to call again (a live or finished run; plots that no longer have data are removed).

    Returns the PNGs the page shows, in page order, then ``index.html``. Raises ``FileNotFoundError`` when
    ``run_dir`` has no ``metrics.jsonl``.
    """
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no run report: {path} does not exist")
    records = read_metrics(path)
    series = to_series(records)
    config_path = find_config(run_dir)
    config_text = config_path.read_text(encoding="utf-8", errors="replace") if config_path else None
    experiment = _experiment_name(config_text) if config_text else None
    folder = run_dir.resolve().name
    run_name = f"{experiment} ({folder})" if experiment and experiment != folder else folder

    written: list[Path] = []
    images: list[tuple[str, str]] = []
    for plot in plots(series):
        out = run_dir / f"{plot.name}.png"
        fig = plot_figure(plot, series, run_name)
        if fig is None:
            out.unlink(missing_ok=True)  # a stale plot of an earlier report
            continue
        fig.savefig(out, dpi=DPI, bbox_inches="tight")
        written.append(out)
        images.append((out.name, plot.title))
    memory = run_dir / MEMORY_PNG
    if not memory.is_file() and (run_dir / "memory.jsonl").is_file():
        try:
            plot_timeline(run_dir)
        except (FileNotFoundError, ValueError) as err:
            logger.info("no memory timeline in the report: %s", err)
    if memory.is_file():
        written.append(memory)
        images.append((memory.name, "Memory timeline (watchdog)"))

    steps = [int(r["step"]) for r in records]
    page = render_index(run_name, run_dir.resolve(), images, final_metrics(series), config_text,
                        str(config_path.relative_to(run_dir)) if config_path else None, max(steps, default=None))
    index = run_dir / INDEX
    tmp = index.with_suffix(".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(index)  # a browser reloading the page never sees half of it
    written.append(index)
    logger.info("run report: %s (%d plot(s))", index, len(images))
    return written

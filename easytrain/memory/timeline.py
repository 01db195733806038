"""The memory timeline: ``memory.jsonl`` drawn as ``memory.png``, one row per node and per node's GPUs.

The watchdog writes the plot when a run closes; to draw it again (or for a run that died before closing):

    easytrain memory outputs/my_run [--out memory.png]

Each node's RAM row shows what the watchdog judged (the node's used RAM against its limit) next to who
used it (the summed RSS of each role's processes), with the warn/soft/hard thresholds and Ray's own kill
line, so a reader sees which role brought the node near a threshold and in which phase. Phases are shaded
on every row and the watchdog's events are vertical lines, so a spike lines up with its step and phase.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)

GB = 2**30
SAMPLE_KINDS = ("node", "process", "gpu")
"""Record kinds that are readings; a file with none of them has nothing to draw."""

LEVEL_COLOURS = {"warn": "tab:orange", "soft": "gold", "hard": "tab:red", "leak": "tab:purple",
                 "imbalance": "tab:purple"}
"""Events and the threshold lines of the same level share a colour, so an event reads as "crossed this line"."""

RAY_KILL_COLOUR = "black"
PHASE_COLOURS = ("tab:blue", "tab:green", "tab:gray", "tab:cyan", "tab:olive", "tab:pink", "tab:brown")
"""Shading only; orange, gold, red and purple stay the levels' so an event never hides in its phase."""

ROLE_COLOURS = {"worker": "tab:purple", "actor": "tab:blue", "rollout": "tab:green", "ref": "tab:brown",
                "reward": "tab:cyan", "driver": "tab:gray"}
"""A role keeps its colour on every node (and stays clear of the level colours)."""
OTHER_ROLE_COLOURS = ("tab:pink", "tab:olive", "darkblue", "darkgreen")
PHASE_ALPHA = 0.12
ROW_HEIGHT_IN = 2.8
WIDTH_IN = 12.0


def read_jsonl(path: Path, keep: Callable[[Any], bool]) -> list[dict[str, Any]]:
    """The JSON objects of a ``.jsonl`` that ``keep`` accepts, in file order.

    Lines that do not parse, or that ``keep`` refuses, are skipped with one warning: the run appends while it
    lives, so a run killed mid-write (the OOM such a file is meant to explain) leaves a torn last line.
    """
    records, skipped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            if isinstance(record, dict) and keep(record):
                records.append(record)
            else:
                skipped += 1
    if skipped:
        logger.warning("%s: skipped %d unreadable line(s)", path, skipped)
    return records


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``memory.jsonl``, in file order (torn lines skipped: :func:`read_jsonl`)."""
    return read_jsonl(path, lambda record: "kind" in record)


def _start_time(records: list[dict[str, Any]]) -> float:
    """The earliest time any record carries; the x axis counts seconds from it."""
    times = [float(r["t"]) for r in records if isinstance(r.get("t"), (int, float))]
    times += [float(r["start"]) for r in records if r["kind"] == "phase" and isinstance(r.get("start"), (int, float))]
    return min(times)


def _has(record: dict[str, Any], *keys: str) -> bool:
    return all(record.get(k) is not None for k in keys)


def _samples(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] in SAMPLE_KINDS and _has(r, "t", "node_id")]


def _node_label(node_ip: str, node_id: str) -> str:
    return f"{node_ip} ({node_id[:8]})"


def _shade_phases(ax: Axes, phases: list[dict[str, Any]], colours: dict[str, str], t0: float) -> None:
    for p in phases:
        ax.axvspan(p["start"] - t0, p["end"] - t0, color=colours[p["name"]], alpha=PHASE_ALPHA, linewidth=0)


def _mark_events(ax: Axes, events: list[dict[str, Any]], t0: float) -> None:
    for e in events:
        ax.axvline(e["t"] - t0, color=LEVEL_COLOURS.get(e.get("level"), "tab:gray"), linewidth=1.2, alpha=0.9,
                   gid="event")


def _threshold_lines(ax: Axes, thresholds: dict[str, Any], prefix: str, capacity_gb: float,
                     ray_kill_of_gb: Optional[float] = None) -> None:
    """Dashed lines at fraction x capacity, labelled with the fraction, so the legend says where each sits;
    Ray's kill line is a fraction of the node's own memory (``ray_kill_of_gb``), whatever the watchdog's limit."""
    for level in ("warn", "soft", "hard"):
        fraction = thresholds.get(f"{prefix}_{level}")
        if fraction is not None:
            ax.axhline(fraction * capacity_gb, color=LEVEL_COLOURS[level], linestyle="--", linewidth=1,
                       label=f"{level} {fraction:.0%}")
    if ray_kill_of_gb is not None and thresholds.get("ray_kill") is not None:
        ax.axhline(thresholds["ray_kill"] * ray_kill_of_gb, color=RAY_KILL_COLOUR, linestyle="--", linewidth=1,
                   label=f"Ray kills {thresholds['ray_kill']:.0%}")


def _headroom(ax: Axes) -> None:
    """From 0 to a little above the highest line, so the top threshold is not lost in the frame."""
    tops = [float(max(line.get_ydata(), default=0.0)) for line in ax.get_lines() if line.get_gid() != "event"]
    ax.set_ylim(0, max(tops, default=1.0) * 1.08 or 1.0)


def _ram_axes(ax: Axes, nodes: list[dict[str, Any]], processes: list[dict[str, Any]],
              thresholds: dict[str, Any], t0: float) -> None:
    nodes = sorted(nodes, key=lambda r: r["t"])
    if nodes:
        ax.plot([r["t"] - t0 for r in nodes], [r["ram_used_bytes"] / GB for r in nodes], color="black",
                linewidth=1.8, label=f"node used ({nodes[-1].get('source', '?')})")
    # A sampler reads all of a node's processes in one sample with one timestamp, so summing per t gives
    # each role's footprint on the node at that instant.
    per_role: dict[str, dict[float, int]] = defaultdict(lambda: defaultdict(int))
    for r in processes:
        per_role[r["role"]][r["t"]] += r["rss_bytes"]
    others = iter(OTHER_ROLE_COLOURS * 4)
    for role in sorted(per_role):
        series = sorted(per_role[role].items())
        ax.plot([t - t0 for t, _ in series], [b / GB for _, b in series], linewidth=1.2, label=f"{role} RSS",
                color=ROLE_COLOURS.get(role) or next(others, None))
    limits = [r for r in nodes if r.get("ram_limit_bytes")]
    if limits:  # the latest limit: a replaced node or a changed config is judged against its current one
        last = limits[-1]  # with watchdog.ram_limit_gb (source "config") Ray still judges the whole node
        node_gb = (last.get("ram_total_bytes", last["ram_limit_bytes"]) if last.get("source") == "config"
                   else last["ram_limit_bytes"]) / GB
        _threshold_lines(ax, thresholds, "ram", last["ram_limit_bytes"] / GB, ray_kill_of_gb=node_gb)
    ax.set_ylabel("RAM (GB)")
    _headroom(ax)


def _gpu_axes(ax: Axes, gpus: list[dict[str, Any]], thresholds: dict[str, Any], t0: float) -> None:
    by_index: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in gpus:
        by_index[int(r["index"])].append(r)
    for index in sorted(by_index):
        series = sorted(by_index[index], key=lambda r: r["t"])
        ax.plot([r["t"] - t0 for r in series], [r["used_bytes"] / GB for r in series], linewidth=1.2,
                label=f"GPU {index} used")
    totals = [r["total_bytes"] for r in gpus if r.get("total_bytes")]
    if totals:  # a node's GPUs are one model in practice; the smallest keeps the lines conservative
        _threshold_lines(ax, thresholds, "vram", min(totals) / GB)
    ax.set_ylabel("GPU memory (GB)")
    _headroom(ax)


def timeline_figure(records: list[dict[str, Any]], title: str) -> Figure:
    """The timeline of ``records`` as a matplotlib figure (no pyplot: the driver's global state is left alone).

    Raises ``ValueError`` when there is no node, process or GPU reading to draw.
    """
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    samples = _samples(records)
    if not samples:
        raise ValueError("no node, process or GPU samples")
    thresholds: dict[str, Any] = {}
    for r in records:
        if r["kind"] == "thresholds":
            thresholds = r  # the last one: a resumed run appends its own
    phases = [r for r in records if r["kind"] == "phase" and _has(r, "start", "end", "name")]
    events = [r for r in records if r["kind"] == "event" and _has(r, "t")]
    t0 = _start_time(samples + phases + events)

    by_node: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    ips: dict[str, str] = {}
    for r in samples:
        by_node[r["node_id"]][r["kind"]].append(r)
        ips.setdefault(r["node_id"], str(r.get("node_ip", "?")))
    node_ids = sorted(by_node, key=lambda n: (ips[n], n))
    rows = [(n, "ram") for n in node_ids] + [(n, "gpu") for n in node_ids if by_node[n]["gpu"]]

    fig = Figure(figsize=(WIDTH_IN, ROW_HEIGHT_IN * len(rows) + 0.8))
    axes = fig.subplots(len(rows), 1, sharex=True, squeeze=False)[:, 0]
    phase_colours = {name: PHASE_COLOURS[i % len(PHASE_COLOURS)]
                     for i, name in enumerate(dict.fromkeys(p["name"] for p in phases))}
    for ax, (node_id, what) in zip(axes, rows):
        _shade_phases(ax, phases, phase_colours, t0)
        _mark_events(ax, events, t0)
        recs = by_node[node_id]
        if what == "ram":
            _ram_axes(ax, [r for r in recs["node"] if _has(r, "ram_used_bytes")],
                      [r for r in recs["process"] if _has(r, "role", "rss_bytes")], thresholds, t0)
        else:
            _gpu_axes(ax, [r for r in recs["gpu"] if _has(r, "index", "used_bytes")], thresholds, t0)
        ax.set_title(f"{_node_label(ips[node_id], node_id)} {'RAM' if what == 'ram' else 'GPUs'}",
                     fontsize=10, loc="left")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    axes[-1].set_xlabel("seconds since start")

    # Phases and events mean the same on every row: one legend for the figure, below the last row.
    shared = [Patch(color=c, alpha=0.25, label=f"phase {name}") for name, c in phase_colours.items()]
    levels = dict.fromkeys(e.get("level") for e in events)
    shared += [Line2D([], [], color=LEVEL_COLOURS.get(lv, "tab:gray"), label=f"event {lv}") for lv in levels]
    if shared:
        fig.legend(handles=shared, loc="lower center", ncol=min(len(shared), 6), fontsize=8, frameon=False)
    fig.suptitle(f"memory: {title}", fontsize=12)
    fig.tight_layout(rect=(0, 0.5 / fig.get_figheight() if shared else 0, 1, 1))
    return fig


def plot_timeline(run_dir: Path, out: Optional[Path] = None) -> Path:
    """Draw ``run_dir/memory.jsonl`` into ``out`` (default ``run_dir/memory.png``) and return its path."""
    # No matplotlib.use("Agg") and no pyplot: a Figure made directly renders a PNG through Agg whatever the
    # backend, so it works headless, and switching the backend would close the figures of anyone using
    # pyplot in the same process (a notebook driving the trainer).
    run_dir = Path(run_dir)
    path = run_dir / "memory.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no memory timeline: {path} does not exist")
    records = read_records(path)
    if not _samples(records):  # a run that died before its first step boundary: thresholds at most
        raise FileNotFoundError(f"no memory timeline: {path} has no samples (no node, process or GPU reading)")
    fig = timeline_figure(records, run_dir.resolve().name)
    out = Path(out) if out is not None else run_dir / "memory.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    return out

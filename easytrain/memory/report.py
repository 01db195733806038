"""The plan as a table for people and as JSON for tools (``easytrain plan``), and the launch-time check."""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from easytrain.config.schema import Config
from easytrain.data.profile import DataProfile, describe, describe_choices, pixel_values
from easytrain.memory.data_shape import DataCosts
from easytrain.memory.params import count_parameters
from easytrain.memory.planner import GB, Plan, Row, plan
from easytrain.config import with_overrides
from easytrain.memory.suggest import Suggestion, fit, override_value, suggestions

logger = logging.getLogger(__name__)


def _gb(value: int) -> str:
    return f"{value / GB:.1f}"


def _largest(parts: dict[str, int], count: int = 4) -> str:
    top = sorted(((v, k) for k, v in parts.items() if v >= GB // 100), reverse=True)[:count]
    return ", ".join(f"{k} {_gb(v)}" for v, k in top)


def render(config: Config, p: Plan, hf_config: dict[str, Any], advice: list[Suggestion],
           fitted: Optional[dict[str, Any]] = None, searched: bool = False) -> str:
    """The plan as text: a row per phase, the capacity, the verdict and what to change."""
    t, c = config.trainer, p.capacity
    counts = count_parameters(hf_config)
    unit = "GB/GPU" if p.on_gpu else "GB/worker"
    where = f"{t.nnodes} node(s) x {t.workers_per_node} {'GPUs' if p.on_gpu else 'CPU workers'}"
    w = max(14, 1 + max(len(r.phase) for r in p.once + p.rows))
    a = config.worker.actor
    strategy = f"deepspeed ZeRO-{a.deepspeed.zero_stage}" if a.strategy == "deepspeed" else "fsdp"
    roles = (f"SFT: the actor only, {strategy}" if t.task == "sft"
             else f"fused workers: one process per {'GPU' if p.on_gpu else 'CPU worker'} hosting actor, reference "
             "and rollout" if t.colocate else "a device pool per role: each role its own processes")
    active = f" ({counts.active / 1e9:.2f}B active per token)" if counts.experts else ""  # mixture of experts
    lines = [f"model {config.model.path}: {counts.total / 1e9:.2f}B parameters{active}; {where}, {roles}",
             f"checked against: {'GPU ' + _gb(c.gpu_bytes) + ' GB, ' if c.gpu_bytes else ''}node RAM {_gb(c.node_ram)} GB"
             f" x Ray memory threshold {c.ray_threshold:.2f} = {_gb(c.host_limit)} GB ({c.source})",
             f"fits means the peaks plus a {c.margin_source or 'margin of 0'}", "",
             f"{'phase':<{w}} {'role':<8} {unit:>10} {'GB/proc':>8} {'GB/node':>9}  "
             f"largest parts ({'device' if p.on_gpu else 'worker'})"]
    for r in p.once + p.rows:
        lines.append(f"{r.phase:<{w}} {r.role:<8} {_gb(r.device):>10} {_gb(r.process_host):>8} {_gb(r.host):>9}  "
                     f"{_largest(r.parts)}")
    device_cap = f" of {_gb(c.gpu_bytes)}" if p.on_gpu and c.gpu_bytes else ""
    lines += [f"{'peak':<{w + 9}} {_gb(p.device_peak):>10} {'':>8} {_gb(p.host_peak):>9}  "
              f"(device{device_cap}; host of {_gb(c.host_limit)}){' while training' if p.once else ''}",
              f"verdict: {p.verdict}"]
    if p.notes:
        lines += ["", *(f"note: {n}" for n in p.notes)]
    if advice:
        lines += ["", "changes, each re-planned (the ones that fit alone first, then cheapest first):"]
        lines += [f"  {i}. {s.describe(p.on_gpu)}" for i, s in enumerate(advice, 1)]
    if searched:
        lines.append("")
        if fitted is None:
            knobs = ("micro batch, ZeRO stage, offload and checkpointing" if t.task == "sft"
                     else "micro batches, offload, checkpointing and gpu_memory_utilization")
            lines.append(f"--fit: no setting of {knobs} fits")
        elif not fitted:
            lines.append("--fit: fits as configured")
        else:
            q = plan(with_overrides(config, fitted), hf_config, p.capacity, p.data)
            lines.append(f"--fit (device peak {_gb(q.device_peak)} GB, host {_gb(q.host_peak)} GB per node): "
                         + " ".join(f"{k}={override_value(v)}" for k, v in fitted.items()))
    return "\n".join(lines)


def _row_json(r: Row) -> dict[str, Any]:
    return {"phase": r.phase, "role": r.role, "device_bytes": r.device, "host_bytes": r.host,
            "process_host_bytes": r.process_host, "device_parts": r.parts, "host_parts": r.host_parts}


def as_json(config: Config, p: Plan, advice: list[Suggestion], fitted: Optional[dict[str, Any]] = None,
            searched: bool = False) -> dict[str, Any]:
    c = p.capacity
    out: dict[str, Any] = {
        "model": config.model.path, "task": config.trainer.task, "verdict": p.verdict, "fits": p.fits,
        "on_gpu": p.on_gpu,
        "capacity": {"gpu_bytes": c.gpu_bytes, "node_ram_bytes": c.node_ram, "ray_threshold": c.ray_threshold,
                     "host_limit_bytes": c.host_limit, "source": c.source, "host_margin": c.host_margin,
                     "device_margin": c.device_margin, "margin_source": c.margin_source},
        "device_peak_bytes": p.device_peak, "host_peak_bytes": p.host_peak,
        "phases": [_row_json(r) for r in p.rows],
        "once": [_row_json(r) for r in p.once],
        "notes": p.notes,
        "suggestions": [{"overrides": s.overrides, "device_delta_bytes": s.device_delta,
                         "host_delta_bytes": s.host_delta, "phase_device_delta_bytes": s.phase_deltas,
                         "fits": s.fits, "why": s.why} for s in advice],
    }
    if searched:
        out["fit"] = fitted
    return out


class PlanDoesNotFit(RuntimeError):
    """The run's memory plan does not fit and ``trainer.memory_check`` resolves to error."""

    def __init__(self, table: str) -> None:
        self.table = table
        super().__init__(f"the memory plan does not fit:\n{table}\n\napply a change above, run `easytrain plan "
                         "--fit [overrides]` for a setting that fits, or set trainer.memory_check=warn to run anyway")


def check_before_launch(config: Config, data: Optional[DataCosts] = None) -> None:
    """``trainer.memory_check``: stop (error) or warn when the plan (priced on ``data``, the data profile's rows,
    where given) does not fit, before any worker starts."""
    from easytrain.models.shapes import hf_config_for

    mode = config.trainer.memory_check
    if mode == "auto":
        mode = "error" if config.trainer.device == "cuda" else "warn"
    if mode == "off":
        return
    hf_config = hf_config_for(config.model)
    if hf_config is None:
        logger.warning("memory check skipped: no config.json for model.path=%s yet", config.model.path)
        return
    p = plan(config, hf_config, data=data)
    advice = suggestions(config, p, hf_config)
    if p.fits and not advice:
        logger.info("memory plan: %s (device peak %s GB, host peak %s GB per node; %s)", p.verdict,
                    _gb(p.device_peak), _gb(p.host_peak), priced_on(config, hf_config, data, plan(config, hf_config)))
        return
    table = render(config, p, hf_config, advice)
    if p.fits or mode == "warn":
        logger.warning("memory plan:\n%s", table)
        return
    raise PlanDoesNotFit(table)


def plan_command(config: Config, output: str, search: bool, profiles: Sequence[DataProfile] = (),
                 profile_note: str = "") -> str:
    """``easytrain plan``: the plan as a table or JSON, with the data's profile (``profiles``; ``profile_note``
    says why there is none)."""
    import json

    from easytrain.models.shapes import hf_config_for

    from easytrain.config import ConfigError

    hf_config = hf_config_for(config.model)
    if hf_config is None:
        raise ConfigError("model.path", config.model.path, "the planner needs the model's config.json",
                          "use a local model folder, a tiny: model or a preset of conf/model/")
    data = DataCosts.of(profiles)
    p = plan(config, hf_config, data=data)
    bound = plan(config, hf_config, p.capacity)
    advice = suggestions(config, p, hf_config)
    fitted = fit(config, hf_config, p.capacity, data) if search else None
    pricing = priced_on(config, hf_config, data, bound, profile_note)
    peaks = pixel_peaks(config, hf_config, p, profiles[0]) if profiles else {}
    if output == "json":
        out = as_json(config, p, advice, fitted, search)
        tables = [d.as_dict() for d in profiles]
        for row in tables[0]["max_pixels"] if tables else []:
            q = peaks.get(row["max_pixels"])
            row.update({"device_peak_bytes": q.device_peak, "host_peak_bytes": q.host_peak, "fits": q.fits} if q
                       else {})
        out["data"] = {"priced_on": pricing, "profiles": tables,
                       "bound_device_peak_bytes": bound.device_peak, "bound_host_peak_bytes": bound.host_peak,
                       "bound_phases": [_row_json(r) for r in bound.rows]}
        return json.dumps(out, indent=2)
    unit = "GB/GPU" if p.on_gpu else "GB/worker"
    text = {k: f"{_gb(q.device_peak)} {unit}, {_gb(q.host_peak)} GB/node{'' if q.fits else ', does not fit'}"
            for k, q in peaks.items()}
    parts = [part for i, d in enumerate(profiles)
             for part in (describe(d), describe_choices(d, text if i == 0 else None))]
    return "\n\n".join([render(config, p, hf_config, advice, fitted, search), pricing, *parts])


def pixel_peaks(config: Config, hf_config: dict[str, Any], p: Plan, profile: DataProfile) -> dict[int, Plan]:
    """The plan at each ``data.max_pixels`` value the profile's table compares (priced on the same data)."""
    if not config.data.image_key:
        return {}
    return {value: plan(with_overrides(config, {"data.max_pixels": value}), hf_config, p.capacity, p.data)
            for value in pixel_values(profile)}


def priced_on(config: Config, hf_config: dict[str, Any], data: Optional[DataCosts], bound: Plan,
              note: str = "") -> str:
    """One line: what the plan's sequences were priced on, and the plan with every row at the limits beside it."""
    limits = (f"every row at the limits: device peak {_gb(bound.device_peak)} GB, host peak {_gb(bound.host_peak)} "
              "GB per node")
    why = data.why_not(config) if data is not None else (note or "no data profile")
    shape = data.shape(config, hf_config, "train") if data is not None and not why else None
    if shape is None:
        return f"priced on the limits ({why or 'no row kept'})"
    return (f"priced on the data: its longest prompt {shape.prompt} tokens, {shape.images} image(s) of up to "
            f"{shape.image_tokens} vision tokens, responses {shape.response}; {limits}")

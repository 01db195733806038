"""The planner on paper against EasyR1's published Qwen2.5-VL-7B memory figures, and the plan's wall time.

    .venv/bin/python bench/planner_easyr1.py       # -> bench/results/planner_easyr1.json

EasyR1 (hiyouga/EasyR1, assets/baselines.md, v0.3.2) reports for Qwen2.5-VL-7B
GRPO on geometry3k, 8 x H100 80GB, vLLM TP 2, micro batches 1 / 2
(update / experience), its other settings its defaults (examples/config.yaml:
2048 + 2048 tokens, max_pixels 4194304, n 5, gpu_memory_utilization 0.6,
gradient checkpointing, actor params and optimizer offloaded between phases,
reference with FSDP CPU offload): peak VRAM 68 GB with AMP (fp32 master
weights, bf16 compute), 58 GB with BF16 (bf16 weights and AdamW states), and
peak CPU memory 120 GB. This script plans easytrain's nearest setting and
prints both side by side. Nothing here is fitted to EasyR1's numbers: the
planner's constants are its own (see easytrain/memory/planner.py) and the
differences are explained, not tuned away.

Each setting is planned twice: on the limits (every prompt at 2048 tokens, its
image at 2048 vision tokens) and on the data (issue 50): a stand-in for
geometry3k's rows built from documented diagram sizes (bench/geometry3k_standin.py;
neither the dataset nor the 7B tokenizer is on this machine).

It also times ``easytrain plan +exp=qwen25vl_7b`` (a fresh process each time,
imports included), which is what a user waits for before a launch.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.geometry3k_standin import TEXT_SENSITIVITY, TEXT_TOKENS, shape_summary, standin_costs  # noqa: E402
from bench.provenance import write_result  # noqa: E402

EASYR1 = {"source": "hiyouga/EasyR1 assets/baselines.md (v0.3.2), Performance Baselines, 7B rows at batch 1 / 2",
          "peak_vram_gb": {"AMP": 68, "BF16": 58}, "peak_cpu_mem_gb": 120}
SETTING = ["+exp=qwen25vl_7b", "worker.actor.micro_batch_size_per_device_for_update=1",
           "worker.actor.micro_batch_size_per_device_for_experience=2", "worker.rollout.tensor_parallel_size=2",
           "worker.rollout.gpu_memory_utilization=0.6", "trainer.gpu_memory_gb=80",
           "trainer.memory_check=off", "hydra.run.dir=/tmp/easytrain-bench-plan"]
VARIANTS = {
    "easytrain preset offload (FSDP CPU offload of actor and ref)": [],
    "actor states on the GPU (no actor offload)": ["worker.actor.offload.params=false",
                                                   "worker.actor.offload.optimizer=false"],
}
ASSUMPTIONS = [
    "worst-case sequence: every prompt at max_prompt_length 2048 (image tokens capped by it) + 2048 response "
    "tokens; EasyR1 runs padding-free on geometry3k, whose real prompts are far shorter",
    "easytrain's log-prob pass materialises (micro batch x response positions x 152064) logits in bf16 plus "
    "fp32 copies; EasyR1 computes log-probs over unpadded tokens with a fused cross-entropy kernel",
    "AMP: fp32 master weights, gradients and AdamW moments = 16 bytes/parameter, sharded over 8 GPUs",
    "EasyR1's offload moves actor states to host between phases (they are on the GPU during the update); "
    "easytrain's offload.params is FSDP CPU offload (states stay on host, the update streams them)",
    "vLLM reserves gpu_memory_utilization x 80 GB while generating; sleep level 2 frees it for ref, old log-probs "
    "and update (the phase order of easytrain/memory/phases.py), and the sync wakes its weights only",
    "fused workers (trainer.colocate=true): one process per GPU hosts actor, reference and vLLM, so one CUDA "
    "context per GPU, 0.5 GB (assumed)",
    "weight sync in-process: one bucket of full bf16 tensors gathered on the GPU (256 MB, or the 1.09 GB "
    "embedding: a module never splits), no host copy",
    "host: each worker process's framework, 0.54 GB, the driver and Ray's own processes as measured on CPU by "
    "bench/planner_accuracy.py (easytrain/memory/host.py; not measured on a GPU node); at load one whole fp32 "
    "checkpoint per node (the load row, not part of the step's peak)",
]


HOST_WITHIN, GPU_WITHIN = 0.25, 0.15
"""Issue 50's targets for the data-priced row: host within 25% of EasyR1's 120 GB, GPU within 15% of its 58-68 GB."""


def plan_variant(overrides: list[str], text_tokens: int = 0) -> dict[str, Any]:
    """The plan of the setting with ``overrides``: on the limits, or with ``text_tokens`` on the geometry3k
    stand-in's rows with that many text tokens a prompt."""
    from easytrain.config import compose, to_config
    from easytrain.memory.planner import GB, plan

    config = to_config(compose(SETTING + overrides))
    p = plan(config, data=standin_costs(config, text_tokens) if text_tokens else None)
    states = next(r for r in p.rows if r.phase == "update").parts
    return {"overrides": SETTING[1:] + overrides, "verdict": p.verdict,
            "device_peak_gb": round(p.device_peak / GB, 1), "host_peak_gb": round(p.host_peak / GB, 1),
            "load": {r.phase: {"device_gb": round(r.device / GB, 1), "host_gb": round(r.host / GB, 1),
                               "host_parts_gb": {k: round(v / GB, 2) for k, v in r.host_parts.items()}}
                     for r in p.once},
            "phases": {r.phase: {"device_gb": round(r.device / GB, 1), "host_gb": round(r.host / GB, 1),
                                 "parts_gb": {k: round(v / GB, 2) for k, v in r.parts.items()}} for r in p.rows},
            "update_parts_gb": {k: round(v / GB, 2) for k, v in states.items()},
            "update_host_parts_gb": {k: round(v / GB, 2) for k, v in
                                     next(r for r in p.rows if r.phase == "update").host_parts.items()}}


def bf16_states_difference() -> float:
    """On paper: AMP vs pure-bf16 model states per GPU (EasyR1's BF16 row); easytrain always keeps fp32
    master weights, so this is computed, not planned."""
    from easytrain.memory.params import count_parameters
    from easytrain.config.presets import known_hf_configs

    params = count_parameters(known_hf_configs()["Qwen/Qwen2.5-VL-7B-Instruct"]).total
    return params * (16 - 8) / 8 / 1e9  # 16 vs 8 bytes/param (bf16 weights, grads, two moments), 8 ranks


def explain(variants: dict[str, Any], on_data: dict[str, Any], bf16_gap: float) -> list[str]:
    """The differences, in words, with the planned numbers."""
    preset, on_gpu = (variants[name] for name in VARIANTS)
    data_preset, data_on_gpu = (on_data[name] for name in VARIANTS)
    return [
        f"VRAM: with easytrain's FSDP CPU offload the planned peak is {preset['device_peak_gb']} GB/GPU (vLLM's "
        f"48 GB reservation while generating); with the actor's states on the GPU it is {on_gpu['device_peak_gb']} "
        f"GB/GPU, against EasyR1's 68 GB (AMP). EasyR1 offloads the actor between phases but holds its states on "
        "the GPU for the update, and its peak also carries what the planner does not model (the caching "
        "allocator's reserved-but-free blocks, vLLM's CUDA graphs, NCCL buffers).",
        f"AMP vs BF16: the planner computes {bf16_gap} GB/GPU less model state for bf16 weights, gradients and "
        "AdamW moments; EasyR1's two rows differ by 10 GB, consistent with a peak in a phase that holds the "
        "actor's states on the GPU. easytrain always keeps fp32 master weights, so BF16 is not planned.",
        f"Host RAM: {preset['host_peak_gb']} GB/node planned for easytrain's preset and {on_gpu['host_peak_gb']} "
        f"GB/node with the actor on the GPU, against EasyR1's 120 GB. Of these, {_batch(preset)} GB are three "
        "copies (driver, object store, workers) of the worst-case step batch: 512 prompts x 5 samples, each "
        "carrying the pixel values of a 2048-token image; geometry3k's real images are far smaller. Without it: "
        f"{round(preset['host_peak_gb'] - _batch(preset), 1)} and {round(on_gpu['host_peak_gb'] - _batch(on_gpu), 1)} "
        "GB/node; the first (actor states incl. fp32 gradients and the reference offloaded for 8 ranks, plus "
        "processes) is EasyR1's arrangement plus the gradients it does not keep on host.",
        "The planner prices the worst-case sequence (every prompt at 2048 tokens, every response 2048), so its "
        "transient terms are upper bounds for geometry3k, whose prompts are short; EasyR1's figures are measured "
        "on the real data.",
        f"On the geometry3k stand-in (bench/geometry3k_standin.py: InterGPS's labelled diagram extents, every image "
        f"raised to EasyR1's min_pixels 262144 as its recipe sets, {TEXT_TOKENS} text tokens a prompt assumed): "
        f"{data_on_gpu['host_peak_gb']} GB/node and {data_on_gpu['device_peak_gb']} GB/GPU with the actor's "
        f"states on the GPU ({data_on_gpu['against_easyr1']['host_error']:+.1%} against EasyR1's 120 GB), "
        f"{data_preset['host_peak_gb']} GB/node and {data_preset['device_peak_gb']} GB/GPU with easytrain's FSDP "
        "CPU offload, whose host holds the actor's fp32 states, gradients and AdamW moments for all 8 ranks "
        f"({data_preset['update_host_parts_gb'].get('actor states (offloaded)', 0)} GB) through the step. The "
        "device peak is generation's (vLLM's gpu_memory_utilization reservation), which the data does not "
        "change; the data changes the update and log-prob phases and the step batch's host copies.",
    ]


def _batch(variant: dict[str, Any]) -> float:
    """GB/node of the step batch in flight at the update: the driver's copy, the object store's pages, the
    workers' deserialized copies (the host parts easytrain/memory/planner.py names so)."""
    parts = variant["update_host_parts_gb"].items()
    return round(sum(v for k, v in parts if k.startswith(("batch (", "object store pages"))), 1)


def time_plan_command(repeats: int = 3) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "easytrain.cli", "plan", "+exp=qwen25vl_7b"], check=True,
                       capture_output=True, cwd=ROOT)
        times.append(round(time.perf_counter() - start, 2))
    return times


def against_easyr1(variant: dict[str, Any]) -> dict[str, Any]:
    """The data-priced plan's peaks against EasyR1's measured ones and issue 50's targets."""
    host = variant["host_peak_gb"] / EASYR1["peak_cpu_mem_gb"] - 1
    gpu = {kind: variant["device_peak_gb"] / gb - 1 for kind, gb in EASYR1["peak_vram_gb"].items()}
    return {"host_error": round(host, 3), "host_within_25_percent": abs(host) <= HOST_WITHIN,
            "gpu_error": {k: round(v, 3) for k, v in gpu.items()},
            "gpu_within_15_percent_of_58_68": any(abs(v) <= GPU_WITHIN for v in gpu.values())}


def data_priced(extra: list[str]) -> dict[str, Any]:
    """The setting planned on the geometry3k stand-in, with the text-token estimate and its sensitivity."""
    row = plan_variant(extra, TEXT_TOKENS)
    row["against_easyr1"] = against_easyr1(row)
    row["text_tokens_sensitivity"] = {
        str(t): {k: v for k, v in plan_variant(extra, t).items() if k in ("device_peak_gb", "host_peak_gb")}
        for t in TEXT_SENSITIVITY}
    return row


def main() -> None:
    from easytrain.config import compose, to_config

    variants = {name: plan_variant(extra) for name, extra in VARIANTS.items()}
    on_data = {name: data_priced(extra) for name, extra in VARIANTS.items()}
    times = time_plan_command()
    result = {
        "easyr1": EASYR1, "easytrain": variants, "easytrain_on_data": on_data,
        "geometry3k_standin": shape_summary(standin_costs(to_config(compose(SETTING)))),
        "bf16_vs_amp_states_per_gpu_gb": round(bf16_states_difference(), 1),
        "assumptions": ASSUMPTIONS,
        "plan_command_seconds": {"runs": times, "median": statistics.median(times),
                                 "command": "easytrain plan +exp=qwen25vl_7b"},
    }
    result["comparison"] = explain(variants, on_data, result["bf16_vs_amp_states_per_gpu_gb"])
    out = ROOT / "bench" / "results" / "planner_easyr1.json"
    write_result(out, result)
    print(f"EasyR1: peak VRAM {EASYR1['peak_vram_gb']} GB, peak CPU memory {EASYR1['peak_cpu_mem_gb']} GB")
    for name, v in variants.items():
        print(f"easytrain, {name}: peak {v['device_peak_gb']} GB/GPU, host {v['host_peak_gb']} GB/node ({v['verdict']})")
        for phase, row in v["phases"].items():
            print(f"    {phase:<14} {row['device_gb']:>6} GB/GPU {row['host_gb']:>7} GB/node")
    for name, v in on_data.items():
        e = v["against_easyr1"]
        print(f"on the geometry3k stand-in, {name}: peak {v['device_peak_gb']} GB/GPU ({e['gpu_error']} against "
              f"58 / 68), host {v['host_peak_gb']} GB/node ({e['host_error']:+.1%} against 120 GB)")
    print(f"AMP - BF16 model states per GPU on paper: {result['bf16_vs_amp_states_per_gpu_gb']} GB "
          f"(EasyR1's rows differ by {EASYR1['peak_vram_gb']['AMP'] - EASYR1['peak_vram_gb']['BF16']} GB)")
    print(f"easytrain plan +exp=qwen25vl_7b: {times} s (median {statistics.median(times)} s) -> {out}")


if __name__ == "__main__":
    main()

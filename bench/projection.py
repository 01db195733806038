"""Qwen2.5-VL-7B GRPO (``+exp=qwen25vl_7b``) on 8, 16 and 32 H100s, projected on paper.

    .venv/bin/python bench/projection.py                    # -> bench/results/projection.json
    .venv/bin/python bench/projection.py --hbm-tbs 2.0 --mean-response 0.3 --out /tmp/p.json

Nothing here is measured on a GPU and nothing is a stored result: every figure is
computed from
- the composed preset (``trainer.nnodes`` = 1, 2, 4 x 8 GPUs, global batch fixed)
  and the model's shape (``conf/model/``; parameters counted per component on
  the meta device by ``easytrain.memory.params``);
- easytrain's memory planner (``easytrain.memory.planner.plan``): device GB per
  GPU per phase and the verdict, the vLLM engine's KV capacity in sequences,
  the sequence shape and the step batch's bytes;
- the driver's per-phase cost measured on this (2-core CPU) machine by
  ``bench/grpo_step.py`` (``bench/results/grpo_step_*.json``), carried as a
  fixed cost per phase call: a CPU measurement, likely an upper bound;
- stated hardware numbers (flags, H100 SXM defaults) and workload assumptions,
  all printed next to the table and written into the JSON.

It is compared with hiyouga/EasyR1's published figure for the same model and
batch on 8 x H100 (assets/baselines.md, v0.3.2, linked from its README): 145 s
per step and 1,600 tokens/s/GPU. The projection is not tuned to it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import command_line, write_result  # noqa: E402

PRESET = ["+exp=qwen25vl_7b", "trainer.memory_check=off"]
NODES = (1, 2, 4)
MEASURED = ["bench/results/grpo_step_small.json", "bench/results/grpo_step_tiny.json"]
EASYR1 = {"source": "hiyouga/EasyR1 assets/baselines.md (EasyR1 v0.3.2; the README's baselines link), Performance "
                    "Baselines, Qwen2.5-VL-7B on geometry3k, 8 x H100 80GB, AMP, micro batch 1 / 2, vLLM TP 2",
          "gpus": 8, "sec_per_step": 145.0, "tokens_per_s_per_gpu": 1600.0, "actor_mfu": 0.16,
          "throughput_definition": "tokens (prompt + response) per second per GPU by one training step"}
GB = 1e9  # decimal GB for bandwidths; memory columns use the planner's GB (2**30)


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--peak-tflops", type=float, default=989.0, help="bf16 dense peak per GPU (H100 SXM: 989)")
    a("--mfu", type=float, default=0.4, help="achieved fraction of peak FLOP/s: training, log-probs, prefill")
    a("--hbm-tbs", type=float, default=3.35, help="HBM bandwidth per GPU, TB/s (H100 SXM HBM3: 3.35)")
    a("--nvlink-gbs", type=float, default=450.0, help="NVLink per GPU per direction, GB/s (NVLink 4: 450)")
    a("--net-gbps", type=float, default=400.0, help="inter-node network per GPU, Gb/s (one 400G NIC per GPU)")
    a("--pcie-gbs", type=float, default=64.0, help="host<->GPU per GPU per direction, GB/s (PCIe 5 x16: 64)")
    a("--host-mem-gbs", type=float, default=614.0, help="host DRAM bandwidth per node, GB/s (2 x 8 ch DDR5-4800)")
    a("--bw-util", type=float, default=0.8, help="achieved fraction of every peak bandwidth above")
    a("--driver-copy-gbs", type=float, default=10.0,
      help="the driver's single-threaded copy rate when it (de)serialises the step batch, GB/s (this machine's "
           "memcpy measured 9.2 in bench/results/rollout.json)")
    a("--mean-prompt", type=float, default=1.0,
      help="mean prompt tokens as a fraction of the planner's sequence shape (max_prompt_length, image tokens at "
           "max_pixels capped by it); 1.0 = every prompt at its limit")
    a("--mean-response", type=float, default=0.5, help="mean response length as a fraction of max_response_length")
    a("--adam-bytes", type=float, default=28.0,
      help="bytes AdamW moves per trainable parameter per step (fp32 param, grad, 2 moments read; 3 written)")
    a("--measured", nargs="+", default=MEASURED, help="grpo_step.py results: per-phase driver cost (max over files)")
    a("--out", default=str(ROOT / "bench/results/projection.json"))
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- FLOPs


def forward_flops(c: Any, dims: Any, hf: dict[str, Any], positions: float, logits: float, images: int,
                  image_tokens: float) -> float:
    """One sequence's forward: 2 x N x T over the decoder blocks (embeddings are a lookup), causal attention
    2 x layers x q_width x T^2 (QK^T and AV, half the square), the LM head at ``logits`` positions, and the
    vision tower per image: 2 x N_vision x patches plus its attention (full in ``fullatt_block_indexes``,
    windows of (window_size / patch_size)^2 patches elsewhere) and the merger on the merged tokens."""
    text = 2 * c.language_model * positions + 2 * dims.layers * dims.q * positions ** 2 + 2 * c.lm_head * logits
    if not images:
        return text
    v = hf["vision_config"]
    patches = image_tokens * dims.merge ** 2
    full = len(v.get("fullatt_block_indexes", [])) or dims.vision_layers
    window = (v.get("window_size", 0) // v.get("patch_size", 14)) ** 2 or patches
    attention = 4 * dims.vision_hidden * patches * (full * patches + (dims.vision_layers - full) * min(window, patches))
    return text + images * (2 * c.vision_tower * patches + attention + 2 * c.projector * image_tokens)


# ----------------------------------------------------------------------------- one world size


def project(nnodes: int, args: argparse.Namespace, driver: dict[str, float]) -> dict[str, Any]:
    from easytrain.config import load
    from easytrain.memory.budget import engine_budget, kv_bytes_per_token, sequence_shape
    from easytrain.memory.activations import model_dims
    from easytrain.memory.params import count_parameters
    from easytrain.memory.planner import GB as PGB, batch_bytes, plan, shape_of
    from easytrain.memory.states import DTYPE_BYTES, FP32
    from easytrain.models.shapes import hf_config_for

    cfg = load([*PRESET, f"trainer.nnodes={nnodes}"])
    hf = hf_config_for(cfg.model)
    assert hf is not None, "conf/model/ has no shape for the preset's model"
    p, s = plan(cfg, hf), shape_of(cfg, hf)
    c, dims, seq = count_parameters(hf), model_dims(hf), sequence_shape(cfg, hf)
    t, a, r, d = cfg.trainer, cfg.worker.actor, cfg.worker.rollout, cfg.data
    world, per_node, tp, bpe = s.world, t.workers_per_node, r.tensor_parallel_size, DTYPE_BYTES[cfg.model.dtype]
    flops = args.peak_tflops * 1e12 * args.mfu
    bw = args.bw_util * GB
    hbm, nvlink, net, pcie, host = (args.hbm_tbs * 1e3 * bw, args.nvlink_gbs * bw, args.net_gbps / 8 * bw,
                                    args.pcie_gbs * bw, args.host_mem_gbs * bw)

    # the workload: prompts at a fraction of the planner's shape, responses at a fraction of their limit
    prompt = args.mean_prompt * seq.prompt
    image_tokens = args.mean_prompt * seq.image_tokens
    mean_resp, max_resp = args.mean_response * seq.response, seq.response
    sequences = d.rollout_batch_size * r.n
    # padded passes run over the batch's width: prompt + the longest response (assumed to reach the limit)
    width, logit_pos = ((prompt + mean_resp, mean_resp) if a.padding_free else (prompt + max_resp, max_resp + 1))
    fwd = forward_flops(c, dims, hf, width, logit_pos, seq.images, image_tokens)
    vision_fwd = fwd - forward_flops(c, dims, hf, width, logit_pos, 0, 0)
    recompute = 1 if cfg.model.gradient_checkpointing else 0
    vision_trains = s.trainable.get("vision_tower", 0) > 0
    train = (3 + recompute) * (fwd - vision_fwd) + (3 + recompute if vision_trains else 1) * vision_fwd

    # FSDP: per micro batch a bf16 all-gather per pass (forward; backward re-gathers with full_shard) and an
    # fp32 reduce-scatter of gradients; with offload.params the fp32 shard crosses PCIe before each gather
    # and the gradient shard back. Overlapped with compute: a micro batch takes the slowest of the three.
    ring = (world - 1) / world
    coll_bw = nvlink if world <= per_node else net

    def micro_batches(per_rank: float, size: int) -> int:
        if a.padding_free:
            return math.ceil(per_rank * (prompt + mean_resp) / a.max_token_len_per_device)
        return math.ceil(per_rank / size)

    def pass_time(seqs: float, size: int, per_seq: float, offload: bool, grad: bool) -> float:
        micro = micro_batches(seqs / world, size)
        gathers = 2 if grad and a.fsdp.full_shard else 1
        coll = (gathers * bpe * s.total_params + (FP32 * sum(s.trainable.values()) if grad else 0)) * ring
        h2d = (gathers * FP32 * s.total_params + (FP32 * sum(s.trainable.values()) if grad else 0)) / world
        per_micro = max(seqs / world * per_seq / flops / micro, coll / coll_bw, h2d / pcie if offload else 0.0)
        return micro * per_micro

    ref = pass_time(sequences, a.micro_batch_size_per_device_for_experience, fwd, cfg.worker.ref.offload.params,
                    False) if s.with_ref else 0.0
    old = pass_time(sequences, a.micro_batch_size_per_device_for_experience, fwd, a.offload.params,
                    False) if s.old_log_probs else 0.0
    opt_steps = a.ppo_epochs * d.rollout_batch_size // a.global_batch_size
    per_opt = a.global_batch_size * r.n
    adam = sum(s.trainable.values()) * args.adam_bytes
    opt_s = adam * per_node / world / host if a.offload.optimizer else adam / world / hbm  # CPU AdamW per node
    update = opt_steps * (pass_time(per_opt, a.micro_batch_size_per_device_for_update, train, a.offload.params,
                                    True) + opt_s)

    # generation: vLLM engines of tp GPUs; prefill once per prompt (prefix caching shares it among the n
    # samples), compute-bound; decode memory-bound: each step reads the engine's weights and the running
    # sequences' KV cache, with concurrency capped by the planner's KV budget and max_num_seqs
    engines = world // tp
    budget = engine_budget(p.capacity.gpu_bytes or 0, r.gpu_memory_utilization, s.total_params, hf,
                           cfg.model.dtype, tp, s.seq_tokens)
    prompts_e, seqs_e = d.rollout_batch_size / engines, sequences / engines
    concurrent = max(1, min(int(seqs_e), budget.max_sequences, r.max_num_seqs))
    prefill = prompts_e * forward_flops(c, dims, hf, prompt, 1, seq.images, image_tokens) / (tp * flops)
    kv_tok = kv_bytes_per_token(hf, cfg.model.dtype, tp)
    allreduce = 2 * dims.layers * dims.hidden * bpe * 2 * (tp - 1) / tp / nvlink if tp > 1 else 0.0

    def decode_step(running: float, context: float) -> float:
        memory = (budget.weights + running * context * kv_tok) / hbm
        compute = 2 * (c.language_model + c.lm_head) / tp * running / flops
        return max(memory, compute) + running * allreduce

    busy_steps = seqs_e * mean_resp / concurrent  # continuous batching keeps `concurrent` slots full
    tail_steps = max(0.0, max_resp - busy_steps)  # then the longest response finishes nearly alone
    decode = (busy_steps * decode_step(concurrent, prompt + mean_resp / 2)
              + tail_steps * decode_step(1, prompt + max_resp))
    generate = prefill + decode

    # weight sync as easytrain does it (easytrain/workers/weight_sync.py): the actor's fp32 state dict in
    # buckets through Ray's object store (host RAM, not NVLink); every rollout rank assembles full tensors
    # and vLLM loads its TP slice over PCIe; stages pipeline over buckets
    weights = FP32 * s.total_params
    stages = {"put into the object store (host RAM)": weights / nnodes / host
                + (0.0 if a.offload.params else weights / world / pcie),
              "between nodes": (nnodes - 1) / nnodes * weights / (per_node * net),
              "assembled by every rollout rank (host RAM)": per_node * weights / host,
              "host -> GPU (TP slice)": weights / tp / pcie}
    buckets = math.ceil(weights / (r.sync_bucket_mb * 2 ** 20))
    sync = max(stages.values()) + (sum(stages.values()) - max(stages.values())) / buckets

    # orchestration: the measured per-call driver cost plus the driver (de)serialising the step batch for
    # each call that carries it (the prompts out = 1/n of it, generate's result, ref, old log-probs, update);
    # the shares of workers on other nodes also cross the network. A Batch holds and carries each prompt's pixel
    # values once (easytrain/distributed/batch.py), as batch_bytes counts them
    carries = 1 + 1 / r.n + 1 + (1 if s.with_ref else 0) + (1 if s.old_log_probs else 0)
    step_batch = batch_bytes(cfg, replace(s, seq_tokens=round(width), image_tokens=round(image_tokens),
                                          batch_vision=cfg.data.rollout_batch_size * s.images * round(image_tokens)))
    wire_batch = step_batch
    transfer = carries * wire_batch * (1 / (args.driver_copy_gbs * GB) + (nnodes - 1) / nnodes / (per_node * net))
    fixed = (driver["generate"] + driver["update"] + driver["sync"] + driver["rest"]
             + (driver["ref"] if s.with_ref else 0.0) + (driver["ref"] if s.old_log_probs else 0.0))
    phases = {"generate": generate, "ref": ref, "old_log_probs": old, "update": update, "sync": sync,
              "overhead": fixed + transfer}
    step = sum(phases.values())
    return {
        "nnodes": nnodes, "gpus": world, "overrides": [*PRESET, f"trainer.nnodes={nnodes}"],
        "step_s": step, "tokens_per_s_per_gpu": sequences * (prompt + mean_resp) / step / world,
        "generated_tokens_per_s_per_gpu": sequences * mean_resp / step / world, "phases_s": phases,
        "detail": {"prefill_s": prefill, "decode_s": decode, "decode_busy_steps": busy_steps,
                   "decode_tail_steps": tail_steps, "concurrent_sequences_per_engine": concurrent,
                   "engines": engines, "optimizer_steps": opt_steps, "optimizer_step_s": opt_s,
                   "sync_stages_s": stages, "sync_buckets": buckets, "overhead_fixed_s": fixed,
                   "overhead_batch_transfer_s": transfer, "step_batch_gb": step_batch / GB,
                   "step_batch_in_transit_gb": wire_batch / GB,
                   "batch_carrying_calls": carries, "collective": "NVLink" if world <= per_node else "network",
                   "flops": {"forward_per_sequence": fwd, "vision_share_of_forward": vision_fwd / fwd,
                             "update_per_sequence": train,
                             "step_total": sequences * ((1 if s.with_ref else 0) + (1 if s.old_log_probs else 0))
                             * fwd + a.ppo_epochs * sequences * train}},
        "memory": {"phases_gb": {row.phase: row.device / PGB for row in p.rows}, "peak_gb": p.device_peak / PGB,
                   "host_peak_gb_per_node": p.host_peak / PGB, "fits": p.fits, "verdict": p.verdict,
                   "notes": p.notes},
        "shape": {"params": c.as_dict(), "total_params": s.total_params, "sequences": sequences,
                  "prompt_tokens": prompt, "image_tokens": image_tokens, "mean_response": mean_resp,
                  "max_response": max_resp, "pass_width": width, "old_log_probs": s.old_log_probs,
                  "with_ref": s.with_ref, "kv_capacity_sequences": budget.max_sequences},
    }


def separate_pools(eight: dict[str, Any]) -> dict[str, Any]:
    """16 GPUs as a pool of 8 for the rollout and 8 for the actor (``trainer.colocate=false``), from the 8-GPU
    row's phase times (each pool runs its phases on 8 GPUs as the colocated row does): ``sync`` runs them one
    after the other; ``one_step_off`` (``trainer.rollout_mode``) generates the next batch beside the actor's
    passes, so a step takes the longer of the two, then the weight sync and the driver's overhead."""
    ph = eight["phases_s"]
    actor = ph["ref"] + ph["old_log_probs"] + ph["update"]
    tail = ph["sync"] + ph["overhead"]
    steps = {"sync": ph["generate"] + actor + tail, "one_step_off": max(ph["generate"], actor) + tail}
    tokens = eight["tokens_per_s_per_gpu"] * eight["step_s"] * eight["gpus"]  # one step's tokens
    return {"gpus": 16, "pools": {"rollout": 8, "actor": 8}, "generate_s": ph["generate"], "actor_passes_s": actor,
            "step_s": steps, "tokens_per_s_per_gpu": {mode: tokens / step / 16 for mode, step in steps.items()},
            "one_step_off_over_sync": steps["one_step_off"] / steps["sync"],
            "colocated_16_gpu_step_s": None}


def driver_costs(files: Sequence[str]) -> dict[str, float]:
    """Per phase call, the median over steps of (phase wall time - the slowest worker's busy time), and the
    rest of the step's orchestration (driver loop, reward wait); the max over the given files."""
    out: dict[str, float] = {}
    for name in files:
        steps = load_measured(name)["steps"]
        # the phases the driver timed (a fused worker's engine sleeps inside its reference call: no call of its own)
        phases = [ph for ph in steps[0]["worker_busy_s"] if ph in steps[0]["phases_s"]]
        cost = {ph: statistics.median(x["phases_s"][ph] - x["worker_busy_s"][ph] for x in steps) for ph in phases}
        cost["rest"] = statistics.median(x["orchestration_s"] - sum(x["phases_s"][ph] - x["worker_busy_s"][ph]
                                                                   for ph in phases) for x in steps)
        for k, v in cost.items():
            out[k] = max(out.get(k, 0.0), v)
    return out


def load_measured(name: str) -> dict[str, Any]:
    """A grpo_step.py results file, by path (relative to the repository unless absolute)."""
    return json.loads((ROOT / name if not Path(name).is_absolute() else Path(name)).read_text())


def input_provenance(files: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Commit and date of each measured input (a re-measured input means this projection is due again)."""
    records = {name: load_measured(name) for name in files}
    return {name: {"commit": r.get("commit"), "date": r.get("date", r.get("measured"))} for name, r in records.items()}


def assumptions(args: argparse.Namespace, rows: list[dict[str, Any]], driver: dict[str, float]) -> list[str]:
    sh = rows[0]["shape"]
    return [
        f"hardware per GPU: {args.peak_tflops:g} TFLOP/s bf16 dense peak at MFU {args.mfu:g} (training, log-probs, "
        f"prefill, decode compute); HBM {args.hbm_tbs:g} TB/s; NVLink {args.nvlink_gbs:g} GB/s per direction; "
        f"network {args.net_gbps:g} Gb/s; PCIe {args.pcie_gbs:g} GB/s; host DRAM {args.host_mem_gbs:g} GB/s per "
        f"node; {args.bw_util:g} of every peak bandwidth achieved",
        f"workload: {sh['sequences']} sequences per step (rollout_batch_size x n); prompts {sh['prompt_tokens']:.0f} "
        f"tokens ({args.mean_prompt:g} x the planner's sequence shape, {sh['image_tokens']:.0f} of them image "
        f"tokens); mean response {sh['mean_response']:.0f} tokens ({args.mean_response:g} x max_response_length); "
        f"the longest response reaches {sh['max_response']} (decode waits for it; padded passes are that wide: "
        f"{sh['pass_width']:.0f} positions)",
        "FLOPs: forward 2 x N x T over the decoder blocks (embeddings excluded), causal attention 2 x layers x "
        "q_width x T^2, LM head only at response positions, vision tower per image (2 x N_vision x patches, "
        "window/full attention as configured); update = 3 x forward (+1 recompute with gradient checkpointing), "
        "the vision tower too when it trains",
        f"old log-probs {'computed' if sh['old_log_probs'] else 'skipped'}: rollout_batch_size / global_batch_size "
        f"optimizer steps per rollout batch ({rows[0]['detail']['optimizer_steps']}), so "
        f"reuse_log_probs_on_policy {'does not apply' if sh['old_log_probs'] else 'skips the pass'}",
        "FSDP per micro batch: bf16 all-gather per pass, fp32 gradient reduce-scatter, offloaded fp32 shards over "
        "PCIe each pass; overlapped with compute (a micro batch takes the slowest); NVLink within a node, the "
        f"network ring when the world spans nodes; CPU AdamW (offload.optimizer) moves {args.adam_bytes:g} "
        "bytes/parameter through host DRAM",
        "generation: prefill once per prompt (prefix caching), compute-bound; decode memory-bound (engine weights "
        "+ running sequences' KV cache per step, at least the compute time), concurrency = min(sequences per "
        "engine, the planner's KV capacity of full-length sequences, max_num_seqs); TP all-reduces over NVLink",
        "weight sync: fp32 state dict through the Ray object store (host RAM), every rollout rank assembling full "
        "tensors, vLLM loading its TP slice over PCIe; stages pipelined over sync_bucket_mb buckets",
        "orchestration: measured driver cost per phase call on this 2-core CPU machine (max of "
        f"{', '.join(args.measured)}: "
        + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in driver.items())
        + "; old log-probs priced as ref), a fixed cost, likely an upper bound; plus the driver (de)serialising the "
        f"planner's step batch at this shape ({rows[0]['detail']['step_batch_gb']:.0f} GB as the driver holds it "
        f"and {rows[0]['detail']['step_batch_in_transit_gb']:.0f} GB in transit, each prompt's pixel values "
        "once) once "
        f"per call that carries it at {args.driver_copy_gbs:g} GB/s, remote shares over the network",
        "tokens/s/GPU = sequences x (prompt + mean response) / step time / GPUs (EasyR1's definition); "
        "phases run one after another (colocated roles); validation, checkpoints and reward scoring not counted",
        "memory: easytrain's planner as is (worst-case sequence shape), checked against trainer.gpu_memory_gb",
    ]


def render(rows: list[dict[str, Any]], notes: list[str], comparison: dict[str, Any]) -> str:
    cols = ["generate", "ref", "old_log_probs", "update", "sync", "overhead"]
    head = f"{'GPUs':>4} {'step s':>7} {'tok/s/GPU':>9}  " + " ".join(f"{c[:8]:>8}" for c in cols)
    out = ["time (seconds per phase)", head]
    for r in rows:
        out.append(f"{r['gpus']:>4} {r['step_s']:>7.1f} {r['tokens_per_s_per_gpu']:>9.0f}  "
                   + " ".join(f"{r['phases_s'][c]:>8.1f}" for c in cols))
    mem_cols = list(rows[0]["memory"]["phases_gb"])
    out += ["", "memory (easytrain plan, GB per GPU per phase; host GB per node)",
            f"{'GPUs':>4} " + " ".join(f"{c[:10]:>10}" for c in mem_cols) + f" {'peak':>6} {'host':>6}  fits?"]
    for r in rows:
        m = r["memory"]
        out.append(f"{r['gpus']:>4} " + " ".join(f"{m['phases_gb'][c]:>10.1f}" for c in mem_cols)
                   + f" {m['peak_gb']:>6.1f} {m['host_peak_gb_per_node']:>6.0f}  {m['verdict']}")
    e = comparison
    out += ["", f"EasyR1 (published, {EASYR1['gpus']} GPUs): {EASYR1['sec_per_step']:.0f} s/step, "
                f"{EASYR1['tokens_per_s_per_gpu']:.0f} tokens/s/GPU  |  projected: {e['projected_step_s']:.1f} s/step, "
                f"{e['projected_tokens_per_s_per_gpu']:.0f} tokens/s/GPU  |  ratio projected/published: step time "
                f"{e['step_ratio']:.2f}, tokens/s/GPU {e['throughput_ratio']:.2f}",
            f"  EasyR1's figures imply {e['published_tokens_per_sequence']:.0f} tokens per sequence on geometry3k; "
            f"the projection assumes {e['projected_tokens_per_sequence']:.0f}.",
            "  The projection was not tuned to EasyR1's figures: they are read after it is computed and used only "
            "in this row.", "", "assumptions:", *(f"- {n}" for n in notes)]
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse(argv)
    driver = driver_costs(args.measured)
    rows = [project(n, args, driver) for n in NODES]
    eight = rows[0]
    pools = separate_pools(eight)
    pools["colocated_16_gpu_step_s"] = rows[1]["step_s"]
    work = eight["shape"]["sequences"]
    comparison = {"projected_step_s": eight["step_s"], "projected_tokens_per_s_per_gpu": eight["tokens_per_s_per_gpu"],
                  "step_ratio": eight["step_s"] / EASYR1["sec_per_step"],
                  "throughput_ratio": eight["tokens_per_s_per_gpu"] / EASYR1["tokens_per_s_per_gpu"],
                  "published_tokens_per_sequence": EASYR1["tokens_per_s_per_gpu"] * EASYR1["gpus"]
                  * EASYR1["sec_per_step"] / work,
                  "projected_tokens_per_sequence": eight["shape"]["prompt_tokens"] + eight["shape"]["mean_response"],
                  "not_tuned": "EasyR1's figures are inputs to this comparison row only; no projection parameter "
                               "was chosen or fitted to them"}
    notes = assumptions(args, rows, driver)
    print(render(rows, notes, comparison))
    print(f"16 GPUs as 8 rollout + 8 actor: sync {pools['step_s']['sync']:.1f} s/step, one step off "
          f"{pools['step_s']['one_step_off']:.1f} s/step (x{pools['one_step_off_over_sync']:.2f}); generation "
          f"{pools['generate_s']:.1f} s against the actor's passes {pools['actor_passes_s']:.1f} s; colocated on 16 "
          f"GPUs: {pools['colocated_16_gpu_step_s']:.1f} s/step")
    result = {"benchmark": "projection",
              "preset": PRESET, "hardware_and_workload": {k: v for k, v in vars(args).items() if k != "out"},
              "assumptions": notes, "driver_cost_per_call_s": driver,
              "driver_cost_measured_at": input_provenance(args.measured), "rows": rows,
              "easyr1": EASYR1, "comparison": comparison, "separate_pools_16_gpus": pools}
    # called with argv (tests), the command is the script with those arguments, not the caller's command line
    write_result(Path(args.out), result, command=command_line([__file__, *argv]) if argv is not None else None)
    return result


if __name__ == "__main__":
    main()

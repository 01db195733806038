"""The planner's arithmetic on hand-computed cases, its phase model, its suggestions and the launch check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from easytrain.config import compose, to_config, with_default_preset
from easytrain.memory.activations import MicroShape, activation_bytes, layer_saved, logits_bytes, model_dims
from easytrain.memory.capacity import GB
from easytrain.memory.host import GPU_WORKER_BYTES, PHASE_WORKING_SET, WORKER_BYTES
from easytrain.memory.capacity import CUDA_WORKSPACE_BYTES
from easytrain.memory.planner import CUDA_CONTEXT_BYTES, plan
from easytrain.memory.suggest import fit, override_value, suggestions
from easytrain.config.presets import known_hf_configs
from easytrain.models.shapes import hf_config_for
from easytrain.memory.phases import STEP

QWEN25_7B = known_hf_configs()["Qwen/Qwen2.5-7B-Instruct"]


def load(overrides: list[str]) -> Any:
    return to_config(compose(with_default_preset([*overrides, "hydra.run.dir=/tmp/easytrain-plan-test"])))


def test_decoder_layer_activations_by_hand() -> None:
    d = model_dims(QWEN25_7B)  # h 3584, q 28x128, kv 4x128, i 18944, 28 layers
    # 4h + 3q + 2kv + 4i = 14336 + 10752 + 1024 + 75776
    assert layer_saved(d) == 101_888
    one = MicroShape(sequences=1, tokens=4096, response=1024, images=0, image_tokens=0)
    # 4096 tokens x (28 layers x 101888 + 4h + 2i for embeddings, final norm, backward grads) x 2 bytes (bf16)
    assert activation_bytes(d, one, 2, grad=True, checkpointing=False, vision_grad=False) == 23_798_480_896
    # checkpointing: 4096 x (28 x h layer inputs + one recomputed layer 101888 + 4h + 2i) x 2
    assert activation_bytes(d, one, 2, grad=True, checkpointing=True, vision_grad=False) == 2_084_569_088
    # Ulysses over 2 ranks halves the per-token terms
    assert activation_bytes(d, one, 2, grad=True, checkpointing=True, vision_grad=False, ulysses=2) == 1_042_284_544


def test_logits_and_loss_peak_by_hand() -> None:
    # update: 4 sequences x 2049 positions x 152064 vocab x (2 bf16 logits + 6 fp32 copies + 1 mask byte)
    assert logits_bytes(4, 2049, 152_064, 2, grad=True) == 33_650_546_688
    # log-probs without grad: bf16 logits + fp32 scaled copy + log-softmax = 10 bytes per element
    assert logits_bytes(16, 2049, 152_064, 2, grad=False) == 49_852_661_760


def test_colocated_device_peak_is_the_largest_phase_not_the_sum() -> None:
    config = load(["+exp=qwen25vl_7b"])  # 80 GB GPUs, actor and ref offloaded, vLLM at 0.6, sleep level 2
    p = plan(config)
    # generation: vLLM's 0.6 x 80 GB plus the fused process's one CUDA context and its cuBLAS workspaces; the
    # offloaded roles hold nothing
    assert p.row("generation").device == int(0.6 * 80 * GB) + CUDA_CONTEXT_BYTES + CUDA_WORKSPACE_BYTES
    assert p.device_peak == max(r.device for r in p.rows) < sum(r.device for r in p.rows)
    assert "vllm reservation" not in p.row("update").parts  # asleep while the actor trains
    awake = plan(load(["+exp=qwen25vl_7b", "worker.rollout.sleep_level=0"]))
    assert awake.row("update").device == p.row("update").device + int(0.6 * 80 * GB)


def test_fused_workers_one_process_and_one_cuda_context_per_gpu() -> None:
    fused, pools = plan(load(["+exp=qwen25vl_7b"])), plan(load(["+exp=qwen25vl_7b", "trainer.colocate=false"]))
    roles = 3  # actor, reference, rollout
    for row in fused.rows + fused.once:
        if row.phase != "export":  # easytrain export: one process of its own, no GPU
            assert row.parts["cuda context"] == CUDA_CONTEXT_BYTES and "cuda contexts" not in row.parts, row.phase
    # host: one worker process per GPU fused, one per role per GPU in pools, each with the framework's bytes
    f, p = fused.row("update"), pools.row("update")
    assert f.host_parts["worker processes (framework)"] == 8 * GPU_WORKER_BYTES  # with the CUDA libraries
    assert p.host_parts["worker processes (framework)"] == 8 * roles * GPU_WORKER_BYTES
    # and the object store's pages of the weight sync in every actor and rollout process (split pools only)
    pages = p.host_parts["object store pages (weight sync)"]
    assert "object store pages (weight sync)" not in f.host_parts
    # every worker process keeps its share of the object store's pages its calls' batches went through: fused, one
    # process receives every role's calls; in pools each role's processes their own, the same pages in all
    assert p.host_parts["object store pages (batches)"] == f.host_parts["object store pages (batches)"] > 0
    assert p.host - f.host == 8 * (roles - 1) * GPU_WORKER_BYTES + pages
    config = load(["+exp=tiny"])
    cpu = plan(config)  # CPU, colocated: one process per CPU worker, it holds every role's tensors in its RSS
    for row in cpu.rows:
        assert row.host_parts["worker processes (framework)"] == config.trainer.workers_per_node * WORKER_BYTES
        pages = row.host_parts["object store pages (batches)"] // config.trainer.workers_per_node  # its batch share
        # and while a log-prob pass or the update runs, the call's batch beyond the micro batch its pass prices
        received = row.host_parts.get("batch (received, deserialized)", 0) // config.trainer.workers_per_node
        assert (received > 0) == (row.phase in ("ref_log_probs", "old_log_probs", "update")), row.phase
        assert row.process_host == WORKER_BYTES + PHASE_WORKING_SET[row.phase] + row.device + pages + received, \
            row.phase


def test_phase_rows_follow_the_step_order_of_phases_step() -> None:
    p = plan(load(["+exp=qwen25vl_7b"]))
    order = [ph.planned for ph in STEP if ph.planned] + ["validation"]
    assert [r.phase for r in p.rows] == order
    assert [r.phase for r in p.once] == ["load", "checkpoint_save", "resume_load", "export"]
    on_policy = plan(load(["+exp=qwen25vl_7b", "data.rollout_batch_size=128"]))  # old log-probs reused
    assert [r.phase for r in on_policy.rows] == [ph for ph in order if ph != "old_log_probs"]
    assert any("generate -> sleep -> ref -> old_log_probs -> update -> wake_weights -> sync -> wake_kv" in n
               for n in p.notes)


def test_engine_holds_what_the_phase_engine_state_and_sleep_level_leave() -> None:
    base = ["+exp=qwen25vl_7b", "worker.actor.offload.params=false", "worker.actor.offload.optimizer=false",
            "worker.ref.offload.params=false"]
    p = plan(load(base))  # sleep level 2
    weights = 8_292_166_656 * 2 // 2  # bf16 engine weights, tensor-parallel share of 2
    reservation = int(0.6 * 80 * GB)
    for phase in ("ref_log_probs", "old_log_probs", "update"):  # engine asleep: nothing of it on the device
        row = p.row(phase)
        assert not any(k.startswith(("vllm", "rollout")) for k in row.parts), phase
        assert not any("asleep" in k for k in row.host_parts), phase
    ref = p.row("ref_log_probs").parts  # the actor's states sit beside the reference's pass
    assert ref["actor params"] == 8_292_166_656 * 4 // 8 and ref["actor optimizer"] == 2 * ref["actor params"]
    # sync: engine weights + one gathered bucket of full tensors in bf16 (the 152064 x 3584 embedding outgrows
    # 256 MB: a module never splits), no KV cache, no host copy
    sync = p.row("weight_sync")
    bucket = max(256 * 2**20, 152_064 * 3584 * 2)
    assert sync.parts["rollout weights (woken)"] == weights
    assert sync.parts["gathered bucket (engine dtype)"] == bucket
    assert "vllm reservation" not in sync.parts and "kv cache" not in sync.parts
    assert not any("sync" in k for k in sync.host_parts)
    assert sync.device == sum(p.row("update").parts[k] for k in ("actor params", "actor optimizer", "ref params")) \
        + weights + bucket + CUDA_CONTEXT_BYTES + CUDA_WORKSPACE_BYTES
    # level 1: asleep the weights wait in host RAM, one share per GPU; woken for the sync they leave it
    one = plan(load(base + ["worker.rollout.sleep_level=1"]))
    for phase in ("ref_log_probs", "old_log_probs", "update"):
        assert one.row(phase).device == p.row(phase).device
        assert one.row(phase).host - p.row(phase).host == 8 * weights
    assert one.row("weight_sync").host == p.row("weight_sync").host
    # level 0: everything stays, in every phase
    zero = plan(load(base + ["worker.rollout.sleep_level=0"]))
    for phase in ("ref_log_probs", "old_log_probs", "update"):
        assert zero.row(phase).device - p.row(phase).device == reservation
    assert zero.row("weight_sync").device - p.row("weight_sync").device == reservation - weights
    # separate pools: the sync crosses the object store (host), the actor's device holds its bucket share only;
    # every actor and rollout process keeps the store's pages of a whole sync mapped, each rollout one bucket
    # being assembled
    pools = plan(load(base + ["trainer.colocate=false"]))
    assert pools.row("weight_sync").host_parts["sync bucket (assembly)"] == 8 * bucket
    pages = pools.row("update").host_parts["object store pages (weight sync)"]
    assert pages == 8 * (2 * weights // 8) + 8 * 2 * weights  # 8 actor ranks' shards; every bucket in 8 rollouts
    assert "vllm reservation" not in pools.row("update").parts


def test_load_reads_one_whole_checkpoint_per_node() -> None:
    config = load(["+exp=qwen25vl_7b"])  # actor and reference offloaded: their fp32 shards wait in host RAM
    load_row = plan(config).row("load")
    total = 8_292_166_656
    assert load_row.host_parts["checkpoint read (whole, fp32, rank 0)"] == total * 4
    assert load_row.host_parts["actor params (offloaded)"] == load_row.host_parts["ref params (offloaded)"]
    assert load_row.host_parts["actor params (offloaded)"] == 8 * (total * 4 // 8)
    on_gpu = plan(load(["+exp=qwen25vl_7b", "worker.actor.offload.params=false", "worker.ref.offload.params=false"]))
    row = on_gpu.row("load")
    assert not any("offloaded" in key for key in row.host_parts)
    assert row.device == 2 * (total * 4 // 8) + int(0.6 * 80 * GB) + CUDA_CONTEXT_BYTES  # no kernel has run yet


def test_one_cpu_rank_holds_the_checkpoint_it_copies_its_parameters_out_of() -> None:
    from easytrain.memory.planner import shape_of

    one = ["+exp=tiny", "trainer.workers_per_node=1"]  # tiny: read from a folder the first call writes
    hf = hf_config_for(load(one).model)
    s = shape_of(load(one), hf)
    mapped = plan(load(one), hf).row("load")  # fp32, not offloaded: the file's pages, read lazily
    assert not any(key.startswith("checkpoint read") for key in mapped.host_parts)
    copied = plan(load(one + ["worker.actor.offload.params=true"]), hf).row("load")  # FSDP's own copy
    whole = copied.host_parts["checkpoint read (whole, fp32, rank 0)"]
    assert whole == s.total_params * 4
    assert copied.process_host == mapped.process_host + whole + copied.host_parts["actor params"]


def test_lora_reference_pass_runs_on_the_actor() -> None:
    p = plan(load(["+exp=qwen25vl_7b", "model.lora.rank=16"]))
    assert p.row("ref_log_probs").role == "actor" and "ref params" not in p.row("ref_log_probs").parts
    assert p.row("ref_log_probs").parts["activations"] == p.row("old_log_probs").parts["activations"]


def test_offload_moves_states_to_host_per_node() -> None:
    base = load(["+exp=qwen25vl_7b", "worker.actor.offload.params=false", "worker.actor.offload.optimizer=false"])
    on_gpu, offloaded = plan(base), plan(load(["+exp=qwen25vl_7b"]))
    # 8,292,166,656 parameters x 16 bytes (fp32 master, grad, 2 AdamW moments) / 8 ranks, per GPU
    per_gpu = 8_292_166_656 * 16 // 8
    assert offloaded.row("update").host - on_gpu.row("update").host == 8 * per_gpu
    moved = on_gpu.row("generation").device - offloaded.row("generation").device
    assert moved == per_gpu - 8_292_166_656 * 4 // 8  # gradients are freed after the update


def test_every_suggestion_reduces_what_it_claims_when_applied_as_overrides() -> None:
    args = ["+exp=qwen25vl_7b", "trainer.gpu_memory_gb=40", "model.gradient_checkpointing=false"]
    config = load(args)
    hf = hf_config_for(config.model)
    p = plan(config, hf)
    assert not p.fits
    advice = suggestions(config, p, hf)
    assert len(advice) >= 4
    for s in advice:
        strings = [f"{k}={override_value(v)}" for k, v in s.overrides.items()]
        q = plan(load(args + strings), hf, p.capacity)  # as a user would apply it
        assert q.device_peak == p.device_peak + s.device_delta and q.host_peak == p.host_peak + s.host_delta, s
        for phase, delta in s.phase_deltas.items():
            assert q.row(phase).device == p.row(phase).device + delta
        assert s.device_delta < 0 or min(s.phase_deltas.values()) < 0, s
    fitted = fit(config, hf, p.capacity)
    assert fitted, "some setting of the knobs fits a 40 GB GPU"
    q = plan(load(args + [f"{k}={override_value(v)}" for k, v in fitted.items()]), hf, p.capacity)
    assert q.fits and q.device_headroom is not None and q.device_headroom >= 0.10


def test_fit_prefers_recomputation_to_smaller_update_micro_batches() -> None:
    args = ["+exp=qwen25vl_7b", "trainer.gpu_memory_gb=80", "model.gradient_checkpointing=false",
            "worker.actor.micro_batch_size_per_device_for_experience=4"]
    config = load(args)
    fitted = fit(config, hf_config_for(config.model))
    assert fitted is not None and "worker.actor.micro_batch_size_per_device_for_update" not in fitted
    assert fitted.get("model.gradient_checkpointing") is True


def test_plan_command_prints_json_for_tools() -> None:
    out = subprocess.run([sys.executable, "-m", "easytrain.cli", "plan", "--format", "json", "+exp=qwen25vl_7b"],
                         capture_output=True, text=True, check=True).stdout
    report = json.loads(out)
    phases = {p["phase"]: p for p in report["phases"]}
    assert set(phases) == {"generation", "ref_log_probs", "old_log_probs", "update", "weight_sync", "validation"}
    assert report["capacity"]["gpu_bytes"] == 80_000_000_000
    assert report["device_peak_bytes"] == max(p["device_bytes"] for p in phases.values())


def test_memory_check_modes(caplog: pytest.LogCaptureFixture) -> None:
    from easytrain.memory.report import PlanDoesNotFit, check_before_launch

    small = ["trainer.node_memory_gb=2"]  # the tiny run's ~6 GB of processes do not fit in 2 GB
    with pytest.raises(PlanDoesNotFit, match="verdict: does not fit"):
        check_before_launch(load(small + ["trainer.memory_check=error"]))
    with caplog.at_level("WARNING"):
        check_before_launch(load(small))  # auto on CPU = warn
    assert "verdict: does not fit" in caplog.text
    caplog.clear()
    check_before_launch(load(small + ["trainer.memory_check=off"]))
    assert caplog.text == ""


def test_a_run_that_does_not_fit_stops_before_ray_starts(tmp_path: Any) -> None:
    done = subprocess.run([sys.executable, "-m", "easytrain.main", f"hydra.run.dir={tmp_path}",
                           "trainer.node_memory_gb=2", "trainer.memory_check=error"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "the memory plan does not fit" in done.stderr and "verdict: does not fit" in done.stderr
    assert "ray" not in done.stderr.lower().replace("ray memory threshold", "")
    assert not (tmp_path / "metrics.jsonl").exists()


def test_optimizer_step_peak_by_hand() -> None:
    from easytrain.memory.params import largest_trainable
    from easytrain.memory.planner import shape_of, update_transient

    config = load(["+exp=qwen25vl_7b", "worker.actor.offload.params=false", "worker.actor.offload.optimizer=false"])
    hf = hf_config_for(config.model)
    assert largest_trainable(hf, config.model) == 544_997_376  # the 152064 x 3584 embedding
    one = MicroShape(sequences=1, tokens=80, response=16, images=0, image_tokens=0)
    grads = 8_292_166_656 * 4 // 8  # every fp32 gradient shard on one of 8 ranks
    update = update_transient(config, shape_of(config, hf), hf, one, False, grads, False)
    # one short sequence: the optimizer step is the peak: the gradients plus AdamW's sqrt and denominator
    # temporaries of the embedding's shard, 2 x 544,997,376 / 8 x 4 bytes
    assert update == {"actor grads": 4_146_083_328, "optimizer temporaries": 544_997_376}


PACKED = ["+exp=qwen25vl_7b", "worker.actor.padding_free=true", "worker.actor.max_token_len_per_device=8192"]
"""The 7B GRPO preset padding-free: full-length samples are 2048 + 2048 tokens with one image of 2048 tokens."""


def test_padding_free_rl_prices_the_token_budget_not_the_micro_batch_sizes() -> None:
    config = load(PACKED)
    hf = hf_config_for(config.model)
    p, d = plan(config, hf), model_dims(hf)
    # one flattened sequence of 8192 tokens: two full-length samples with their two images, logits at their
    # 2 x 2048 response positions only
    packed = MicroShape(sequences=1, tokens=8192, response=4096, images=2, image_tokens=2048)
    update = p.row("update").parts
    assert update["activations"] == activation_bytes(d, packed, 2, grad=True, checkpointing=True, vision_grad=True)
    assert update["logits"] == logits_bytes(1, 4096, d.vocab, 2, grad=True)
    for phase in ("old_log_probs", "ref_log_probs"):
        assert p.row(phase).parts["activations"] == activation_bytes(d, packed, 2, grad=False, checkpointing=True,
                                                                     vision_grad=True)
        assert p.row(phase).parts["logits"] == logits_bytes(1, 4096, d.vocab, 2, grad=False)
    doubled = plan(load(PACKED[:-1] + ["worker.actor.max_token_len_per_device=16384"]))
    for phase in ("update", "old_log_probs", "ref_log_probs"):
        assert doubled.row(phase).parts["activations"] > p.row(phase).parts["activations"], phase
    sizes = plan(load(PACKED + ["worker.actor.micro_batch_size_per_device_for_update=1",
                                "worker.actor.micro_batch_size_per_device_for_experience=2"]))
    for phase in ("update", "old_log_probs", "ref_log_probs"):
        assert sizes.row(phase).parts == p.row(phase).parts, phase
    assert any("one padding-free sequence of 8192 tokens" in n for n in p.notes)


def test_ulysses_halves_the_per_token_activations_of_a_packed_update() -> None:
    from easytrain.memory.activations import PATCH_VALUES
    from easytrain.memory.rl_shape import per_rank, shape_of

    one, two = load(PACKED), load(PACKED + ["worker.actor.ulysses_size=2"])
    assert two.trainer.workers_per_node * two.trainer.nnodes == 8
    u1, u2 = plan(one).row("update").parts, plan(two).row("update").parts
    pixels = 2 * 2048 * 4 * PATCH_VALUES * 4  # fp32 pixel values of the two images, held whole by every rank
    assert abs(2 * (u2["activations"] - pixels) - (u1["activations"] - pixels)) <= 2  # integer rounding
    assert 2 * u2["logits"] == u1["logits"]  # each rank's chunk: half the response positions
    # 4 data-parallel groups of 2 ranks: each group's members update 128 x 5 / 4 sequences per optimizer step
    hf = hf_config_for(two.model)
    assert per_rank(two, shape_of(two, hf), "actor", 128) == 160
    assert per_rank(one, shape_of(one, hf), "actor", 128) == 80


def test_padding_free_suggestions_lower_the_token_budget() -> None:
    args = PACKED[:-1] + ["worker.actor.max_token_len_per_device=16384", "trainer.gpu_memory_gb=40"]
    config = load(args)
    hf = hf_config_for(config.model)
    p = plan(config, hf)
    assert not p.fits
    advice = suggestions(config, p, hf)
    budget = [s for s in advice if "worker.actor.max_token_len_per_device" in s.overrides]
    assert budget and budget[0].overrides == {"worker.actor.max_token_len_per_device": 8192}
    assert budget[0].phase_deltas["update"] < 0
    assert not any(k.startswith("worker.actor.micro_batch_size") for s in advice for k in s.overrides)
    fitted = fit(config, hf, p.capacity)
    assert fitted is not None and not any(k.startswith("worker.actor.micro_batch_size") for k in fitted)


SHARED = ["+exp=qwen25vl_7b", "model.attn_implementation=sdpa", "data.max_response_length=256",
          "worker.actor.micro_batch_size_per_device_for_update=5",
          "worker.actor.micro_batch_size_per_device_for_experience=10"]
"""sdpa attention (a mask the shared layout needs), n=5, 2048-token prompts with a 2048-token image, 256-token
responses: a micro batch of 5 (10) sequences is 1 (2) whole prompt(s)."""


def test_share_prompt_prices_each_prompt_once_with_its_responses(monkeypatch: pytest.MonkeyPatch) -> None:
    from easytrain.memory.rl_shape import shared_pays_off, shared_rows

    config = load(SHARED)
    hf = hf_config_for(config.model)
    d = model_dims(hf)
    p, plain = plan(config, hf), plan(load(SHARED + ["worker.actor.share_prompt=false"]), hf)
    prompt, response, n = 2048, 256, 5
    # update: 80 sequences per rank, micro batches of 5 = one whole prompt: one row of the prompt + 5 responses
    assert shared_rows(5, n, 80) == (1, 5) and shared_rows(10, n, 320) == (2, 5)
    assert shared_rows(4, n, 80) == (2, 4)  # straddles two prompts: a row each, the longest 4 responses
    width = prompt + n * response
    assert shared_pays_off(1, width, 5, prompt + response, d.hidden)
    update = MicroShape(sequences=1, tokens=width, response=n * response, images=1, image_tokens=2048)
    assert p.row("update").parts["activations"] == activation_bytes(d, update, 2, grad=True, checkpointing=True,
                                                                    vision_grad=True)
    assert p.row("update").parts["logits"] == logits_bytes(1, n * response + 1, d.vocab, 2, grad=True)
    logs = MicroShape(sequences=2, tokens=width, response=n * response, images=1, image_tokens=2048)
    for phase in ("old_log_probs", "ref_log_probs"):
        assert p.row(phase).parts["activations"] == activation_bytes(d, logs, 2, grad=False, checkpointing=True,
                                                                     vision_grad=True)
        # the prompt (and its image) once instead of n times: less than the plain rows
        assert p.row(phase).parts["activations"] < plain.row(phase).parts["activations"]
    plain_update = MicroShape(sequences=5, tokens=prompt + response, response=response, images=1, image_tokens=2048)
    assert plain.row("update").parts["activations"] == activation_bytes(d, plain_update, 2, grad=True,
                                                                        checkpointing=True, vision_grad=True)
    # flash attention takes no such mask: plain rows (planned for GPU nodes that have flash-attn; this one has not)
    monkeypatch.setattr(sys.modules["easytrain.config.validate"], "flash_attn_installed", lambda: True)
    flash = plan(load(SHARED + ["model.attn_implementation=flash_attention_2"]), hf)
    assert flash.row("update").parts["activations"] == plain.row("update").parts["activations"]
    assert any("prompt-shared" in note for note in p.notes)


def test_share_prompt_padding_free_packs_whole_prompts_into_the_budget() -> None:
    args = ["+exp=qwen25vl_7b", "model.attn_implementation=sdpa", "worker.actor.padding_free=true",
            "worker.actor.max_token_len_per_device=16384"]
    config = load(args)
    hf = hf_config_for(config.model)
    d = model_dims(hf)
    p = plan(config, hf)
    group = 2048 + 5 * 2048  # a prompt once (its 2048-token image inside) and its 5 responses
    units = 16384 // group
    shared = MicroShape(sequences=1, tokens=16384, response=units * 5 * 2048, images=units, image_tokens=2048)
    assert p.row("update").parts["logits"] == logits_bytes(1, shared.response, d.vocab, 2, grad=True)
    assert p.row("update").parts["activations"] == activation_bytes(d, shared, 2, grad=True, checkpointing=True,
                                                                    vision_grad=True)
    # a prompt's group over the budget: the driver plans samples, priced as full-length ones
    small = plan(load(args[:-1] + ["worker.actor.max_token_len_per_device=8192"]), hf)
    samples = MicroShape(sequences=1, tokens=8192, response=2 * 2048, images=2, image_tokens=2048)
    assert small.row("update").parts["activations"] == activation_bytes(d, samples, 2, grad=True,
                                                                        checkpointing=True, vision_grad=True)
    # sequence parallelism: no shared layout, full-length samples split over the 2 ranks
    ulysses = plan(load(args + ["worker.actor.ulysses_size=2"]), hf)
    split = MicroShape(sequences=1, tokens=16384, response=4 * 2048, images=4, image_tokens=2048)
    assert ulysses.row("update").parts["activations"] == activation_bytes(d, split, 2, grad=True, checkpointing=True,
                                                                          vision_grad=True, ulysses=2)


def test_hf_engine_on_cpu_sleeps_at_level_2_only_in_fused_workers() -> None:
    from easytrain.memory.planner import shape_of

    config = load(["+exp=tiny"])  # HF engine on CPU, sleep level 2
    hf = hf_config_for(config.model)
    s = shape_of(config, hf)
    weights = s.total_params * s.dtype_bytes
    fused, level1 = plan(config, hf), plan(load(["+exp=tiny", "worker.rollout.sleep_level=1"]), hf)
    assert "rollout weights" not in fused.row("update").parts  # dropped while asleep
    assert fused.row("weight_sync").parts["rollout weights (woken)"] == weights
    # 2 CPU ranks all-gather each bucket (one bucket, never more than the model); a CPU worker's heap keeps what
    # the call freed until it returns, so the sync holds the whole model gathered; nothing stays between syncs
    bucket = min(256 * 2**20, weights)
    assert fused.row("weight_sync").parts["gathered bucket (engine dtype)"] == weights
    for row in ("generation", "update", "validation", "checkpoint_save", "resume_load"):
        assert not any("sync" in name or "bucket" in name for name in fused.row(row).parts), row
    lora = plan(load(["+exp=tiny", "model.lora.rank=8"]), hf)
    assert lora.row("weight_sync").parts["gathered bucket (engine dtype)"] == weights
    one = plan(load(["+exp=tiny", "trainer.workers_per_node=1"]), hf)
    # one process copies its weights into the engine's where they lie (weight_sync.unsplit): nothing gathered;
    # LoRA merges them bucket by bucket on the way
    assert "gathered bucket (engine dtype)" not in one.row("weight_sync").parts
    one_lora = plan(load(["+exp=tiny", "trainer.workers_per_node=1", "model.lora.rank=8"]), hf)
    assert one_lora.row("weight_sync").parts["gathered bucket (engine dtype)"] == bucket
    assert level1.row("update").parts["rollout weights"] == weights  # level 1 on CPU: nowhere to offload to
    pools = plan(load(["+exp=tiny", "trainer.colocate=false"]), hf)
    assert pools.row("update").host_parts["rollout weights"] == config.trainer.workers_per_node * weights


def test_a_cpu_sync_keeps_every_gathered_bucket_but_one_process_only_a_bucket_of_merges() -> None:
    """Under glibc's dynamic threshold a CPU rank's heap keeps every bucket a sync gathered until the call returns
    (easytrain.memory.host.heap_keeps_freed): with two ranks and LoRA the whole model. One process gathers nothing:
    only a bucket's LoRA merges are new tensors, freed before the next bucket reuses their heap."""
    from easytrain.memory.layout import sync_bucket
    from easytrain.memory.planner import shape_of

    small = ["+exp=tiny", "model.tiny_size=small", "model.lora.rank=8", "worker.rollout.sync_bucket_mb=2"]
    two, one = load(small), load([*small, "trainer.workers_per_node=1"])
    hf = hf_config_for(two.model)
    s = shape_of(one, hf)
    whole, bucket = s.total_params * s.dtype_bytes, sync_bucket(one, s.largest_module, s.total_params, s.dtype_bytes)
    assert bucket < whole
    assert plan(two, hf).row("weight_sync").parts["gathered bucket (engine dtype)"] == whole
    assert plan(one, hf).row("weight_sync").parts["gathered bucket (engine dtype)"] == bucket


def test_plan_describes_the_fused_layout_and_the_phase_order() -> None:
    """`easytrain plan +exp=qwen25vl_7b` says one process per GPU hosts every role and names the step's phases in
    easytrain.memory.phases' order; with colocate=false, a process per role."""
    from easytrain.memory.phases import ORDER

    commands = [[sys.executable, "-m", "easytrain.cli", "plan", "+exp=qwen25vl_7b", *extra]
                for extra in ([], ["trainer.colocate=false"])]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    (out, _), (pools, _) = done = [p.communicate() for p in procs]  # both at once: each a process of its own
    assert all(p.returncode == 0 for p in procs), [err for _, err in done]
    assert "fused workers, one process per GPU hosting the actor, the reference and the rollout engine" in out
    order = out.split("step order: ")[1].split(";")[0].split(" -> ")
    assert order == [p for p in ORDER if p in order] and {"generate", "sleep", "ref", "update", "sync"} <= set(order)
    assert "a device pool per role" in pools and "fused workers" not in pools


def test_one_step_off_counts_the_generation_beside_the_actors_phases() -> None:
    """trainer.rollout_mode=one_step_off: while the actor's phases run, the rollout pool generates the next batch,
    so a node's host row holds the rollout process generating (its KV cache and working set) where the sync
    mode has it idle; the devices are separate pools, so each device row is unchanged."""
    base = ["+exp=tiny", "trainer.colocate=false", "algorithm.kl_coef=0"]
    config = load(base)
    hf = hf_config_for(config.model)
    sync, off = plan(config, hf), plan(load([*base, "trainer.rollout_mode=one_step_off"]), hf)
    generation = sync.row("generation").host_parts
    for phase in ("update",):
        assert off.row(phase).device == sync.row(phase).device
        idle, busy = sync.row(phase).host_parts, off.row(phase).host_parts
        for part in ("kv cache", "prefill", "generation working set"):  # the generating rollout process's
            assert part not in idle and busy[part] == generation[part], part
        assert off.row(phase).host > sync.row(phase).host
    assert off.row("generation").host == sync.row("generation").host  # the generation itself is the same
    assert off.row("weight_sync").host == sync.row("weight_sync").host  # after the wait: nothing overlaps the sync


def test_validation_batch_is_priced_on_the_validation_files_rows(tmp_path: Path) -> None:
    from easytrain.data.sources import local_rows
    from easytrain.memory.sft import validation_prompts

    rows = [{"problem": f"question {i}", "answer": str(i)} for i in range(24)]
    jsonl = tmp_path / "val.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")  # a blank line is not a row
    parquet = tmp_path / "val.parquet"
    pq.write_table(pa.Table.from_pylist(rows[:5]), parquet)
    assert local_rows([str(jsonl)], 64) == 24
    assert local_rows([str(jsonl), str(parquet), "synthetic:shapes"], 64) == 24 + 5 + 64
    assert local_rows(["someone/dataset@validation"], 64) is None  # counting a hub dataset would download it
    assert validation_prompts(load([f"data.val_files={jsonl}", "data.val_batch_size=-1"]), 4) == 24
    assert validation_prompts(load([f"data.val_files={jsonl}", "data.val_batch_size=16"]), 4) == 16
    assert validation_prompts(load([f"data.val_files={parquet}", "data.val_batch_size=16"]), 4) == 5
    # the driver's validation batch follows the rows: 24 prompts against 5
    whole = plan(load([f"data.val_files={jsonl}", "data.val_batch_size=-1"])).row("validation")
    five = plan(load([f"data.val_files={parquet}", "data.val_batch_size=-1"])).row("validation")
    assert whole.host_parts["batch (driver)"] > five.host_parts["batch (driver)"]

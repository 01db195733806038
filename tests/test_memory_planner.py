"""The planner's arithmetic on hand-computed cases, its phase model, its suggestions and the launch check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from easytrain.config import compose, to_config, with_default_preset
from easytrain.memory.activations import MicroBatch, activation_bytes, layer_saved, logits_bytes, model_dims
from easytrain.memory.planner import CUDA_CONTEXT_BYTES, plan
from easytrain.memory.suggest import fit, override_value, suggestions
from easytrain.models.shapes import hf_config_for, known_hf_configs

QWEN25_7B = known_hf_configs()["Qwen/Qwen2.5-7B-Instruct"]


def load(overrides: list[str]) -> Any:
    return to_config(compose(with_default_preset([*overrides, "hydra.run.dir=/tmp/easytrain-plan-test"])))


def test_decoder_layer_activations_by_hand() -> None:
    d = model_dims(QWEN25_7B)  # h 3584, q 28x128, kv 4x128, i 18944, 28 layers
    # 4h + 3q + 2kv + 4i = 14336 + 10752 + 1024 + 75776
    assert layer_saved(d) == 101_888
    one = MicroBatch(sequences=1, tokens=4096, response=1024, images=0, image_tokens=0)
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
    # generation: vLLM's 0.6 x 80 GB plus three CUDA contexts; the offloaded roles hold nothing on the GPU
    assert p.row("generation").device == 48_000_000_000 + 3 * CUDA_CONTEXT_BYTES
    assert p.device_peak == max(r.device for r in p.rows) < sum(r.device for r in p.rows)
    assert "vllm reservation" not in p.row("update").parts  # asleep while the actor trains
    awake = plan(load(["+exp=qwen25vl_7b", "worker.rollout.sleep_level=0"]))
    assert awake.row("update").device == p.row("update").device + 48_000_000_000


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
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-m", "easytrain.main", f"hydra.run.dir={tmp_path}",
                           "trainer.node_memory_gb=2", "trainer.memory_check=error"],
                          capture_output=True, text=True, env=env, timeout=300)
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
    one = MicroBatch(sequences=1, tokens=80, response=16, images=0, image_tokens=0)
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
    packed = MicroBatch(sequences=1, tokens=8192, response=4096, images=2, image_tokens=2048)
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
    from easytrain.memory.planner import per_rank, shape_of

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

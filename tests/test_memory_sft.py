"""The SFT plan (trainer.task=sft) on hand-computed cases: Qwen2-VL-7B on 8 GPUs, its phases, suggestions that
only name SFT knobs, and ``easytrain plan`` / the launch check for SFT configs."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from easytrain.config import compose, to_config
from easytrain.memory.params import largest_module
from easytrain.memory.planner import plan, worker_bytes, worker_parts
from easytrain.memory.sft import SFT_PHASES, actor_states, pass_bytes, sft_shape
from easytrain.memory.suggest import fit, override_value, suggestions
from easytrain.models.shapes import hf_config_for

QWEN2VL_7B = 8_291_375_616
"""Parameters of Qwen2-VL-7B-Instruct (easytrain.memory.params on its config; the model card's 8.29B)."""
VISION_TOWER = 631_183_360
"""Its vision tower without the merger (the projector, which stays trainable)."""
SFT_7B = ["+exp=qwen2vl_7b_sft"]
"""8 x 80 GB, FSDP over 8 ranks, bf16, vision tower frozen, checkpointing, 2 samples of 2048 + 2048 tokens
with 4 images of 1024 tokens (1,003,520 px / 784 = 1280, capped at 4096 / 4) per micro batch."""
RL_ONLY = ("worker.rollout.", "worker.ref.", "algorithm.", "reward.", "data.rollout_batch_size",
           "worker.actor.micro_batch_size_per_device_for_experience", "worker.actor.reuse_log_probs_on_policy")


def load(overrides: list[str]) -> Any:
    return to_config(compose([*overrides, "hydra.run.dir=/tmp/easytrain-plan-test"]))


def states(overrides: list[str]) -> Any:
    config = load(SFT_7B + overrides)
    return actor_states(config, sft_shape(config, hf_config_for(config.model)))


DS = ["worker.actor.strategy=deepspeed", "worker.actor.offload.optimizer=false"]  # FSDP's key is off under DeepSpeed
FULL = ["model.freeze_vision_tower=false"]


def test_fsdp_full_shard_states_by_hand() -> None:
    s = states(FULL)
    # fp32 master shards: 8,291,375,616 / 8 = 1,036,421,952 each x 4 bytes; fp32 grads the same; 2 AdamW moments
    assert s.kept == {"actor params": 4_145_687_808, "actor optimizer": 8_291_375_616}
    assert s.grads == {"actor grads": 4_145_687_808} and s.host == {}
    # the optimizer step's sqrt and denominator of the largest trainable shard: the 152064 x 3584 embedding / 8
    assert s.step == {"optimizer temporaries": 2 * 544_997_376 // 8 * 4}


def test_freeze_vision_tower_drops_its_grads_and_moments() -> None:
    s = states([])  # the preset freezes the tower: 8,291,375,616 - 631,183,360 = 7,660,192,256 trained
    assert s.kept["actor params"] == 4_145_687_808  # frozen weights are still held (sharded)
    assert s.grads == {"actor grads": 7_660_192_256 // 8 * 4} == {"actor grads": 3_830_096_128}
    assert s.kept["actor optimizer"] == 7_660_192_256 // 8 * 8 == 7_660_192_256


def test_zero2_states_by_hand() -> None:
    s = states(DS + FULL + ["worker.actor.deepspeed.zero_stage=2"])
    # bf16 parameters replicated: 8,291,375,616 x 2; bf16 gradients partitioned: 1,036,421,952 x 2;
    # fp32 master partition (x 4) + two fp32 moments (x 8) = 12 bytes x 1,036,421,952
    assert s.kept == {"actor params": 16_582_751_232, "actor optimizer (fp32 master + moments)": 12_437_063_424}
    assert s.grads == {"actor grads": 2_072_843_904} and not s.sharded
    # the step: the partition's fp32 gradient copy and torch AdamW's two temporaries over the flat partition
    assert s.step == {"fp32 gradient partition": 4_145_687_808, "optimizer temporaries": 8_291_375_616}
    assert s.bucket == 500_000_000 * 2  # DeepSpeed's default reduce bucket, bf16


def test_zero3_states_by_hand() -> None:
    s = states(DS + FULL)  # zero_stage defaults to 3
    assert s.kept == {"actor params": 2_072_843_904, "actor optimizer (fp32 master + moments)": 12_437_063_424}
    assert s.grads == {"actor grads": 2_072_843_904} and s.sharded
    # ZeRO-3 steps one sub-group (1e9 elements) of the 1,036,421,952-element partition at a time
    assert s.step == {"fp32 gradient partition": 4_000_000_000, "optimizer temporaries": 8_000_000_000}


def test_zero3_offload_optimizer_moves_master_moments_and_fp32_grads_to_host() -> None:
    s = states(DS + FULL + ["worker.actor.deepspeed.offload_optimizer=true"])
    assert s.kept == {"actor params": 2_072_843_904}
    assert s.grads == {}  # each reduced bucket goes to the host's fp32 gradient partition
    assert s.host == {"actor optimizer (fp32 master + moments)": 12_437_063_424}
    assert s.host_grads == {"actor fp32 gradients": 4_145_687_808}
    assert s.step == {} and s.step_host == {"optimizer temporaries": 8_000_000_000}
    p = plan(load(SFT_7B + DS + FULL + ["worker.actor.deepspeed.offload_optimizer=true"]))
    # 8 workers per node keep it; in the optimizer phase the CPU step's temporaries too
    optimizer, grads, step = "actor optimizer (fp32 master + moments)", "actor fp32 gradients", "optimizer temporaries"
    for phase, parts in (("forward_backward", {optimizer: 12_437_063_424, grads: 4_145_687_808}),
                         ("optimizer", {optimizer: 12_437_063_424, grads: 4_145_687_808, step: 8_000_000_000}),
                         ("validate", {optimizer: 12_437_063_424})):
        host = p.row(phase).host_parts
        assert {k: host.get(k, 0) for k in (optimizer, grads, step)} == {k: 8 * parts.get(k, 0)
                                                                         for k in (optimizer, grads, step)}, phase


def test_activations_scale_with_the_micro_batch_and_checkpointing() -> None:
    def passes(overrides: list[str]) -> dict[str, int]:
        config = load(SFT_7B + overrides)
        hf = hf_config_for(config.model)
        s = sft_shape(config, hf)
        return pass_bytes(config, s, actor_states(config, s), hf, grad=True)

    one = passes(["worker.actor.micro_batch_size_per_device_for_update=1"])
    # per decoder layer and token: 4h + 3q + 2kv + 4i + 2 head_dim (3-D rope) = 102,144 elements (h 3584, kv 512,
    # i 18944); checkpointing keeps 28 layer inputs + one recomputed layer + 4h + 2i (embeddings, final norm,
    # one layer's backward): 4096 x (28 x 3584 + 102,144 + 52,224) = 1,043,333,120 bf16 elements, plus the
    # fp32 pixel values of 4 x 1024 tokens x 4 patches x 1176 values (the frozen tower keeps nothing)
    assert one["activations"] == 1_043_333_120 * 2 + 16_384 * 1176 * 4 == 2_163_736_576
    # logits at every one of the 4096 positions x 152,064 vocab x 3 fp32 tensors (worst case)
    assert one["logits"] == 4096 * 152_064 * 12 == 7_474_249_728
    two = passes([])  # micro batch 2: twice the activations and logits, same gathered units
    assert two["activations"] == 2 * one["activations"] and two["logits"] == 2 * one["logits"]
    assert two["gathered"] == one["gathered"]
    full = passes(["worker.actor.micro_batch_size_per_device_for_update=1", "model.gradient_checkpointing=false"])
    # without recomputation every layer keeps its 102,144 elements per token: 4096 x (28 x 102,144 + 52,224)
    assert full["activations"] == (4096 * 28 * 102_144 + 4096 * 52_224) * 2 + 16_384 * 1176 * 4 == 23_934_271_488


def test_padding_free_prices_the_token_budget() -> None:
    def micro(overrides: list[str]) -> Any:
        config = load(SFT_7B + overrides)
        return sft_shape(config, hf_config_for(config.model)).micro

    packed = micro(["worker.actor.padding_free=true", "worker.actor.max_token_len_per_device=8192"])
    # one flattened sequence of 8192 tokens, with the images of the 2 full-length samples it can hold
    assert (packed.sequences, packed.tokens, packed.images, packed.image_tokens) == (1, 8192, 8, 1024)
    budget = plan(load(SFT_7B + ["worker.actor.padding_free=true", "worker.actor.max_token_len_per_device=8192"]))
    padded = plan(load(SFT_7B))
    for part in ("activations", "logits", "gathered"):  # the same tokens as 2 padded samples of 4096
        assert budget.row("forward_backward").parts[part] == padded.row("forward_backward").parts[part]
    assert budget.row("forward_backward").parts["logits"] == 8192 * 152_064 * 12
    # a budget beyond the rank's share of the global batch (64 samples / 8 ranks = 8 of 4096 tokens) packs no more
    capped = micro(["worker.actor.padding_free=true", "worker.actor.max_token_len_per_device=131072"])
    assert (capped.sequences, capped.tokens, capped.images) == (1, 8 * 4096, 8 * 4)
    small = micro(["worker.actor.padding_free=true", "worker.actor.global_batch_size=8"])  # 1 sample per rank
    assert small.tokens == 4096


def test_the_7b_sft_preset_plan() -> None:
    p = plan(load(SFT_7B))
    assert [r.phase for r in p.rows] == list(SFT_PHASES) == ["forward_backward", "optimizer", "validate"]
    assert [r.phase for r in p.once] == ["setup", "checkpoint_save", "resume_load", "export"]
    assert {r.role for r in p.rows} | {p.row("setup").role} == {"actor"}
    fb = p.row("forward_backward")
    assert fb.parts == {"actor params": 4_145_687_808, "actor optimizer": 7_660_192_256,
                        "activations": 4_327_473_152, "logits": 14_948_499_456,
                        # root unit (2 x 544,997,376 embedding/head + 44,575,744 merger) and two blocks of
                        # 4h^2 + 3hi = 255,066,112 in bf16, plus one block's fp32 gradient
                        "gathered": (1_134_570_496 + 2 * 255_066_112) * 2 + 255_066_112 * 4,
                        "actor grads": 3_830_096_128,  # 64 / 8 ranks / 2 per micro batch: 4 accumulate
                        "cuda context": 500_000_000, "cuda library workspaces": 64 * 2**20}
    assert p.device_peak == fb.device == 39_721_618_688 + 64 * 2**20
    assert p.verdict == "fits" and suggestions(load(SFT_7B), p, hf_config_for(load(SFT_7B).model)) == []
    assert any("every position" in n for n in p.notes)
    assert not any("offload.optimizer has no effect" in n for n in p.notes)
    offload = plan(load(SFT_7B + ["worker.actor.offload.optimizer=true"]))
    assert any("offload.optimizer has no effect under FSDP2" in n for n in offload.notes)
    # FSDP's generate holds every unit unsharded (bf16): the whole model on each GPU while validating
    assert p.row("validate").parts["gathered"] == QWEN2VL_7B * 2


def test_setup_loads_the_whole_fp32_model_once_per_node_or_partitioned() -> None:
    """FSDP over 8 ranks: rank 0 loads the model whole in fp32 on the CPU, the others build it on the meta device,
    and each moves its shard to the GPU. ZeRO-3 (issue 23) builds each rank's fp32 partition as the model is
    constructed, gathering one module at a time to load it, every worker reading the checkpoint a file (at most
    5 GB) at a time. ZeRO-1/2 load it whole in every worker (8 per node at once) and take it whole onto the
    device."""
    fsdp = plan(load(SFT_7B)).row("setup")
    assert fsdp.host_parts["model loading (whole, fp32)"] == QWEN2VL_7B * 4
    assert fsdp.parts == {"actor params": 4_145_687_808, "cuda context": 500_000_000}
    config = load(SFT_7B + DS)
    zero3 = plan(config).row("setup")
    assert zero3.parts == {"actor params (fp32 partition, loading)": -(-QWEN2VL_7B // 8) * 4,
                           "gathered module (loading)": largest_module(hf_config_for(config.model)) * 4,
                           "cuda context": 500_000_000}
    assert zero3.host_parts["checkpoint file (loading)"] == 8 * 5 * 10**9
    zero2 = SFT_7B + DS + ["worker.actor.deepspeed.zero_stage=2"]
    assert plan(load(zero2)).row("setup").host_parts["model loading (whole, fp32)"] == 8 * QWEN2VL_7B * 4
    args = zero2 + ["trainer.gpu_memory_gb=32", "worker.actor.deepspeed.offload_optimizer=true",
                    "worker.actor.micro_batch_size_per_device_for_update=1"]
    config = load(args)
    p = plan(config)
    assert p.row("setup").parts["whole fp32 model (loading)"] == QWEN2VL_7B * 4 == 33_165_502_464
    assert p.device_headroom is not None and p.device_headroom > 0.05  # every step phase fits with room ...
    assert not p.fits and p.verdict == "does not fit (setup)"  # ... but the model cannot be loaded
    advice = suggestions(config, p, hf_config_for(config.model))
    assert advice[0].fits and advice[0].phase_deltas.get("setup", 0) < 0  # the first advice loads it


def _knob(key: str) -> bool:
    return not key.startswith(RL_ONLY)


@pytest.mark.parametrize("extra", [["trainer.gpu_memory_gb=24"],  # DeepSpeed loads 33 GB whole: a 40 GB GPU
                                   ["trainer.gpu_memory_gb=40", *DS, "worker.actor.deepspeed.zero_stage=2"]])
def test_sft_suggestions_name_only_sft_knobs_and_hold_when_applied(extra: list[str]) -> None:
    args = SFT_7B + ["model.freeze_vision_tower=false", "model.gradient_checkpointing=false", *extra]
    config = load(args)
    hf = hf_config_for(config.model)
    p = plan(config, hf)
    assert not p.fits
    advice = suggestions(config, p, hf)
    assert len(advice) >= 4
    keys = {k for s in advice for k in s.overrides}
    assert all(_knob(k) for k in keys), keys
    assert {"model.gradient_checkpointing", "model.freeze_vision_tower"} <= keys
    for s in advice:  # applied as a user would, each override string passes validation and plans as claimed
        q = plan(load(args + [f"{k}={override_value(v)}" for k, v in s.overrides.items()]), hf, p.capacity)
        assert q.device_peak == p.device_peak + s.device_delta and q.host_peak == p.host_peak + s.host_delta, s
        assert s.device_delta < 0 or min(s.phase_deltas.values()) < 0, s
    fitted = fit(config, hf, p.capacity)
    assert fitted and all(_knob(k) for k in fitted), fitted
    q = plan(load(args + [f"{k}={override_value(v)}" for k, v in fitted.items()]), hf, p.capacity)
    assert q.fits and q.device_headroom is not None and q.device_headroom >= 0.10


def test_zero_stage_is_searched_before_offload() -> None:
    args = SFT_7B + DS + ["trainer.gpu_memory_gb=48", "worker.actor.deepspeed.zero_stage=1"]
    config = load(args)
    fitted = fit(config, hf_config_for(config.model))
    assert fitted == {"worker.actor.deepspeed.zero_stage": 3}


def test_plan_command_for_sft_in_text_and_json() -> None:
    from easytrain.memory.report import plan_command

    from easytrain.memory.capacity import accuracy_margin

    peak = 39_721_618_688 + 64 * 2**20
    gpu_gb = round(peak * (1 + accuracy_margin()[1]) * 1.05 / 1e9, 1)  # the recorded device margin, then 5% left
    config = load(SFT_7B + [f"trainer.gpu_memory_gb={gpu_gb}"])
    text = plan_command(config, "table", search=True)
    assert "SFT: the actor only, fsdp" in text
    for phase in SFT_PHASES:
        assert f"\n{phase} " in text
    assert "verdict: fits, tight (< 10% headroom)" in text and "--fit (device peak" in text
    assert "rollout" not in text and "vllm" not in text.lower()
    report = json.loads(plan_command(config, "json", search=True))
    assert [p["phase"] for p in report["phases"]] == list(SFT_PHASES)
    assert report["device_peak_bytes"] == peak and report["capacity"]["gpu_bytes"] == int(gpu_gb * 1e9)
    assert report["fit"] and all(_knob(k) for s in report["suggestions"] for k in s["overrides"])


def test_easytrain_plan_runs_for_the_sft_preset() -> None:
    out = subprocess.run([sys.executable, "-m", "easytrain.cli", "plan", "+exp=qwen2vl_7b_sft"],
                         capture_output=True, text=True, check=True).stdout
    assert "forward_backward" in out and "verdict: fits" in out


def test_launch_check_and_worker_bytes_for_the_tiny_cpu_sft_run(caplog: pytest.LogCaptureFixture) -> None:
    from easytrain.memory.report import PlanDoesNotFit, check_before_launch

    config = load(["+exp=tiny_sft"])
    check_before_launch(config)  # fits on any machine that runs the tests
    with pytest.raises(PlanDoesNotFit, match="verdict: does not fit"):
        check_before_launch(load(["+exp=tiny_sft", "trainer.node_memory_gb=1", "trainer.memory_check=error"]))
    with caplog.at_level("WARNING"):
        check_before_launch(load(["+exp=tiny_sft", "trainer.node_memory_gb=1"]))  # auto on CPU = warn
    assert "forward_backward" in caplog.text
    # what the watchdog's halve_micro_batch relief prices: "update" is the SFT forward_backward
    assert worker_parts(config, "actor", "update") == worker_parts(config, "actor", "forward_backward")
    for phase in SFT_PHASES:
        assert worker_bytes(config, "actor", phase) > 0
    with pytest.raises(ValueError, match="no phase 'generation'"):
        worker_bytes(config, "actor", "generation")


def test_relief_planner_fixes_path_for_sft() -> None:
    """What easytrain.trainer.relief.MemoryGuard.planner_fixes does: re-plan with the capacity scaled to the
    pressure seen, then ask for changes."""
    from dataclasses import replace

    from easytrain.memory.planner import capacity_of

    config = load(SFT_7B)
    hf = hf_config_for(config.model)
    base = plan(config, hf)
    capacity = replace(capacity_of(config), gpu_bytes=int(base.device_peak / 0.97))
    advice = suggestions(config, plan(config, hf, capacity), hf)
    assert advice and all(_knob(k) for a in advice for k in a.overrides)


def test_one_cpu_process_maps_the_checkpoint_it_loads_as_rl_does() -> None:
    """One CPU rank loading fp32 weights from a folder keeps the file's pages mapped, not resident, until its
    first pass reads them (easytrain.memory.host.maps_checkpoint; the same builder as the RL actor's); two ranks
    read it whole on rank 0 to shard it, and an offloaded rank copies it out."""
    one = plan(load(["+exp=tiny_sft", "trainer.workers_per_node=1"])).row("setup")
    assert "whole fp32 model (loading)" not in one.parts
    assert "whole fp32 model (loading)" in plan(load(["+exp=tiny_sft"])).row("setup").parts
    offloaded = load(["+exp=tiny_sft", "trainer.workers_per_node=1", "worker.actor.offload.params=true"])
    assert "whole fp32 model (loading)" in plan(offloaded).row("setup").parts

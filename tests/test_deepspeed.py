"""DeepSpeed ZeRO behind TrainStrategy, against FSDP2, on 2 CPU ranks (gloo, torch.multiprocessing spawn).

Every strategy trains the same model (same seed) on the same fixed token batches: 2 micro batches of different
sizes and token counts per rank per optimizer step, each micro loss a token-sum cross-entropy scaled by
world_size / global_tokens (what the SFT worker does), clipping at 1.0, AdamW with warm-up and cosine decay.
One spawned 2-rank job runs every scenario (process start-up and DeepSpeed's first initialisation cost more
than the training) and the tests check its results.

Run: ``.venv/bin/python -m pytest -q tests/test_deepspeed.py`` (~1 minute on 2 cores).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from easytrain.config.schema import ActorConfig, LoraConfig, ModelConfig
from easytrain.distributed.checkpoint import IncompatibleCheckpoint
from easytrain.distributed.strategy import TrainStrategy

from rendezvous import rendezvous
from tolerance import assert_updates_agree

WORLD = 2
STEPS = 3
SAVE_AFTER = 2
"""The DeepSpeed runs save after this many steps; a fresh engine loads it and takes the remaining steps."""
VOCAB = 1000
FIRST_TOKEN = 8
"""Ids below are the tiny tokenizer's special tokens (an image pad would need pixel values)."""
RTOL = 1e-4
"""Losses and grad norms of two routes to the same training agree to this (relative)."""
LR = 2e-3

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- process harness


def _entry(rank: int, world: int, init_method: str, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+ is deprecated", category=FutureWarning)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()  # every rank done and rank 0's results written
    except BaseException:
        dist.destroy_process_group()
        raise
    # Leave without the interpreter's teardown: in one CI run (2026-11-26) rank 1 died of SIGABRT after the last
    # scenario had finished (its results complete), while the DeepSpeed engines left for the garbage collector
    # and the gloo group were torn down. What the tests judge is the training, which is over here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable[..., None], *args: Any, world: int = WORLD) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes in one gloo group."""
    mp.spawn(_entry, args=(world, rendezvous(), fn, args), nprocs=world, join=True)


# ----------------------------------------------------------------------------- model, data, loop


def actor_config(strategy: str = "fsdp", stage: int = 3, offload_optimizer: bool = False,
                 offload_params: bool = False) -> ActorConfig:
    cfg = ActorConfig()
    cfg.strategy = strategy
    cfg.deepspeed.zero_stage = stage
    cfg.deepspeed.offload_optimizer = offload_optimizer
    cfg.deepspeed.offload_params = offload_params
    cfg.optim.lr = LR
    cfg.optim.warmup_steps = 1
    cfg.optim.scheduler = "cosine"
    cfg.optim.max_grad_norm = 1.0
    return cfg


def load(folder: str, lora: bool = False) -> nn.Module:
    """The model as the workers build it: fp32, whole, the same weights every time (LoRA: vision frozen too)."""
    from easytrain.models.hf import load_model
    from easytrain.models.parts import apply_lora

    torch.manual_seed(0)
    model = load_model(ModelConfig(), folder, dtype="float32")
    model.config.use_cache = False
    return apply_lora(model, LoraConfig(rank=4, alpha=8.0)) if lora else model


def build(model: nn.Module, cfg: ActorConfig, total_steps: int = 2 * STEPS,
          compute_dtype: str = "float32") -> TrainStrategy:
    if cfg.strategy == "deepspeed":
        from easytrain.distributed.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(model, cfg, total_steps, compute_dtype=compute_dtype)
    from easytrain.distributed.fsdp import apply_fsdp, build_mesh
    from easytrain.distributed.strategy import FSDPStrategy

    apply_fsdp(model, mesh=build_mesh("cpu", dist.get_world_size(), -1), reshard_after_forward=True,
               offload_params=False, param_dtype=None, reduce_dtype=None, device_type="cpu")
    return FSDPStrategy(model, cfg, total_steps)


def micro_batches(rank: int, step: int) -> list[dict[str, torch.Tensor]]:
    """Two micro batches (2 and 3 rows) of one sequence length; a random prompt prefix is not trained, so
    ranks and micro batches hold different numbers of trained tokens."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    length = 10 + 3 * rank + step
    out = []
    for rows in (2, 3):
        ids = torch.randint(FIRST_TOKEN, VOCAB, (rows, length), generator=g)
        labels = ids.clone()
        for row, prompt in enumerate(torch.randint(1, length // 2, (rows,), generator=g).tolist()):
            labels[row, :prompt] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def trained_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def token_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1].float()
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1),
                                       ignore_index=-100, reduction="sum")


def train(strategy: TrainStrategy, steps: range, split: bool = True) -> dict[str, list[float]]:
    """The SFT worker's loop (``split=False``: each rank's micro batches as one); per-step global token-mean
    losses, grad norms and learning rates."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, list[float]] = {"loss": [], "norm": [], "lr": []}
    strategy.model.train()
    for step in steps:
        global_tokens = sum(trained_tokens(b) for r in range(world) for b in micro_batches(r, step))
        batches = micro_batches(rank, step)
        if not split:
            batches = [{k: torch.cat([b[k] for b in batches]) for k in batches[0]}]
        strategy.zero_grad()
        local = torch.zeros(1, dtype=torch.float64)
        for batch in batches:
            loss = token_loss_sum(strategy.model, batch) * world / global_tokens
            strategy.backward(loss)
            local += float(loss.detach())
        dist.all_reduce(local)
        out["loss"].append(float(local) / world)
        out["norm"].append(strategy.step())
        out["lr"].append(strategy.lr)
    return out


def merge(*logs: dict[str, list[float]]) -> dict[str, list[float]]:
    return {key: [v for log in logs for v in log[key]] for key in logs[0]}


# ----------------------------------------------------------------------------- the 2-rank job


def generate(strategy: TrainStrategy, rank: int, world: int) -> list[Any]:
    """Greedy generation through the ZeRO-3 engine, a different number of new tokens per rank (synced_gpus keeps
    the ranks' gathers in step); every rank's prompt and output."""
    prompt = torch.randint(FIRST_TOKEN, VOCAB, (1, 5), generator=torch.Generator().manual_seed(rank))
    strategy.model.eval()
    with torch.no_grad():
        tokens = strategy.model.generate(input_ids=prompt, max_new_tokens=4 + rank, do_sample=False,
                                         synced_gpus=True, use_cache=True, eos_token_id=None)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (prompt, tokens))
    return gathered


def deepspeed_run(folder: str, cfg: ActorConfig, saved: Path, rank: int, lora: bool = False) -> dict[str, Any]:
    """STEPS steps, saving after SAVE_AFTER; then a fresh engine loads the checkpoint and retakes the rest."""
    strategy = build(load(folder, lora), cfg)
    log = train(strategy, range(SAVE_AFTER))
    strategy.save(saved, rank)
    at_save, lr_at_save = strategy.full_state_dict(), strategy.lr
    rng_at_save = torch.rand(4)
    log = merge(log, train(strategy, range(SAVE_AFTER, STEPS)))
    run = {**log, "weights": strategy.full_state_dict(), "at_save": at_save, "strategy": strategy}
    again = build(load(folder, lora), cfg)
    info = again.load(saved, rank)
    run["resume"] = {"info": info, "rng": (rng_at_save, torch.rand(4)), "lr_at_load": (lr_at_save, again.lr),
                     **train(again, range(SAVE_AFTER, STEPS)), "weights": again.full_state_dict()}
    run["nonfinite"] = nonfinite_step(again, rank)
    return run


def nonfinite_step(strategy: TrainStrategy, rank: int) -> dict[str, Any]:
    """A NaN loss: the step is skipped (weights unchanged), the schedule still advances, the next step is normal."""
    before, lr = strategy.full_state_dict(), strategy.lr
    strategy.zero_grad()
    strategy.backward(token_loss_sum(strategy.model, micro_batches(rank, STEPS)[0]) * float("nan"))
    norm = strategy.step()
    after = strategy.full_state_dict()
    unchanged = all(torch.equal(after[k], v) for k, v in before.items())
    return {"norm": norm, "lr": (lr, strategy.lr), "unchanged": unchanged,
            "next_norm": train(strategy, range(STEPS, STEPS + 1))["norm"][0]}


def abandon_an_accumulation(strategy: TrainStrategy, rank: int) -> None:
    """Backward calls with no step after them (a failed attempt), then zero_grad: they must leave no trace."""
    strategy.model.train()
    for batch in micro_batches(rank, 2 * STEPS):
        strategy.backward(token_loss_sum(strategy.model, batch))
    strategy.zero_grad()


def job(rank: int, world: int, qwen2: str, qwen2_vl: str, tmp: str) -> None:
    ckpt = Path(tmp)
    results = {"fsdp": plain_run(qwen2, actor_config("fsdp"))}
    for stage in (3, 2):
        run = deepspeed_run(qwen2, actor_config("deepspeed", stage), ckpt / f"zero{stage}" / "actor", rank)
        strategy = run.pop("strategy")
        if stage == 3:
            results["generated"] = generate(strategy, rank, world)
        results[f"zero{stage}"] = run
        results[f"zero{stage}_whole_batches"] = plain_run(qwen2, actor_config("deepspeed", stage), split=False,
                                                          abandon_first=True)
    results["zero1"] = plain_run(qwen2, actor_config("deepspeed", 1))
    for kind in ("fsdp", "deepspeed"):  # clipping off: the norm is still measured and returned
        cfg = actor_config(kind, 3)
        cfg.optim.max_grad_norm = 0.0
        results[f"{kind}_unclipped"] = plain_run(qwen2, cfg, steps=1)
    results["zero2_offload_optimizer"] = plain_run(qwen2, actor_config("deepspeed", 2, offload_optimizer=True))
    results["zero3_offload_both"] = plain_run(qwen2, actor_config("deepspeed", 3, True, True))
    results["zero3_bf16"] = plain_run(qwen2, actor_config("deepspeed", 3), steps=SAVE_AFTER, compute_dtype="bfloat16",
                                      save=ckpt / "zero3_bf16" / "actor")
    initial = {k: v.clone() for k, v in load(qwen2_vl, lora=True).state_dict().items()}
    lora = deepspeed_run(qwen2_vl, actor_config("deepspeed", 3), ckpt / "vl_lora" / "actor", rank, lora=True)
    lora.pop("strategy")
    results["vl_lora"] = {**lora, "initial": initial}
    if rank == 0:
        torch.save(results, ckpt / "results.pt")


def plain_run(folder: str, cfg: ActorConfig, steps: int = STEPS, split: bool = True, abandon_first: bool = False,
              compute_dtype: str = "float32", save: Optional[Path] = None) -> dict[str, Any]:
    """``steps`` optimizer steps; the losses, norms, learning rates and final weights (saved when asked)."""
    strategy = build(load(folder), cfg, compute_dtype=compute_dtype)
    if abandon_first:
        abandon_an_accumulation(strategy, dist.get_rank())
    run: dict[str, Any] = {**train(strategy, range(steps), split), "weights": strategy.full_state_dict()}
    if cfg.strategy == "deepspeed":
        run["optimizer_state_devices"] = strategy.optimizer_state_devices()  # type: ignore[attr-defined]
    if save is not None:
        strategy.save(save, dist.get_rank())
        run["at_save"] = run["weights"]
    return run


def load_on_one_rank(rank: int, world: int, folder: str, saved: str, out: str) -> None:
    """A 1-rank job loads the 2-rank checkpoint; writes the error it gets."""
    strategy = build(load(folder), actor_config("deepspeed", 3))
    try:
        strategy.load(Path(saved), rank)
        message = "loaded"
    except IncompatibleCheckpoint as err:
        message = str(err)
    Path(out).write_text(message)


# ----------------------------------------------------------------------------- assertions


@pytest.fixture(scope="module")
def ran(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The small Qwen2 (4M parameters: big enough that ZeRO-3 really partitions and gathers, DeepSpeed keeping
    parameters under 1e5 elements whole) and the tiny Qwen2.5-VL through every scenario."""
    tmp = tmp_path_factory.mktemp("deepspeed")
    spawn(job, str(tiny_model("qwen2", "small")), str(tiny_model("qwen2_5_vl")), str(tmp))
    return tmp, torch.load(tmp / "results.pt", weights_only=False)


@pytest.fixture(scope="module")
def initial(tiny_model: Callable[..., Path]) -> dict[str, torch.Tensor]:
    """The small Qwen2's weights before training (what every scenario on it starts from)."""
    return {k: v.detach().clone() for k, v in load(str(tiny_model("qwen2", "small"))).state_dict().items()}


def assert_close_runs(a: dict[str, Any], b: dict[str, Any], initial: dict[str, torch.Tensor],
                      rtol: float = RTOL) -> None:
    """Same losses, grad norms and schedule within ``rtol``; the same update of the weights from ``initial``
    (fp32 on the CPU), within the tolerance tests/tolerance.py derives from the update and AdamW."""
    torch.testing.assert_close(torch.tensor(a["loss"]), torch.tensor(b["loss"]), rtol=rtol, atol=0)
    torch.testing.assert_close(torch.tensor(a["norm"]), torch.tensor(b["norm"]), rtol=rtol, atol=0)
    assert a["lr"] == pytest.approx(b["lr"])
    for value in a["weights"].values():
        assert value.dtype == torch.float32 and value.device.type == "cpu"
    assert_updates_agree(a["weights"], b["weights"], initial, lr=LR, steps=len(a["loss"]))


def gap(a: dict[str, Any], b: dict[str, Any]) -> str:
    loss = max(abs(x - y) / abs(y) for x, y in zip(a["loss"], b["loss"]))
    norm = max(abs(x - y) / abs(y) for x, y in zip(a["norm"], b["norm"]))
    weight = max(float((a["weights"][k] - b["weights"][k]).abs().max()) for k in b["weights"])
    return f"max relative loss gap {loss:.1e}, grad norm gap {norm:.1e}, max weight difference {weight:.1e}"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3, 2, 1])
def test_zero_matches_fsdp2(ran: tuple[Path, dict[str, Any]], initial: dict[str, torch.Tensor], stage: int) -> None:
    _, results = ran
    fsdp, zero = results["fsdp"], results[f"zero{stage}"]
    assert fsdp["norm"][0] > 1.0  # clipping is active
    assert fsdp["weights"]["model.embed_tokens.weight"].shape == (1024, 256)
    assert_close_runs(zero, fsdp, initial)
    logger.info("ZeRO-%d vs FSDP2: %s", stage, gap(zero, fsdp))


@pytest.mark.slow
def test_zero3_matches_fsdp2_without_clipping(ran: tuple[Path, dict[str, Any]],
                                              initial: dict[str, torch.Tensor]) -> None:
    _, results = ran
    fsdp, zero = results["fsdp_unclipped"], results["deepspeed_unclipped"]
    assert fsdp["norm"][0] > 1.0
    assert_close_runs(zero, fsdp, initial)


@pytest.mark.slow
def test_zero3_generate_with_synced_gpus_matches_the_trained_weights(ran: tuple[Path, dict[str, Any]],
                                                                     tiny_model: Callable[..., Path]) -> None:
    _, results = ran
    model = load(str(tiny_model("qwen2", "small")))
    model.load_state_dict(results["zero3"]["weights"])
    model.eval()
    for rank, (prompt, tokens) in enumerate(results["generated"]):
        assert tokens.shape == (1, 5 + 4 + rank)  # the ranks stopped at different lengths
        with torch.no_grad():
            expected = model.generate(input_ids=prompt, max_new_tokens=4 + rank, do_sample=False, use_cache=True,
                                      eos_token_id=None)
        assert torch.equal(tokens, expected)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3, 2])
def test_two_backward_calls_equal_one_on_the_concatenated_batch(ran: tuple[Path, dict[str, Any]],
                                                                initial: dict[str, torch.Tensor], stage: int) -> None:
    """The concatenated run also starts with an abandoned accumulation (backward calls, zero_grad, no step)."""
    _, results = ran
    split, whole = results[f"zero{stage}"], results[f"zero{stage}_whole_batches"]
    assert_close_runs(split, whole, initial, rtol=1e-5)
    logger.info("ZeRO-%d, 2 micro batches vs 1: %s", stage, gap(split, whole))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero3", "zero2", "vl_lora"])
def test_save_then_load_continues_identically(ran: tuple[Path, dict[str, Any]], name: str) -> None:
    from easytrain.distributed.deepspeed import CHECKPOINT_TAG

    tmp, results = ran
    run = results[name]
    resumed = run["resume"]
    assert resumed["info"] == {"saved_ranks": 2, "rng_restored": True}
    assert torch.equal(*resumed["rng"]) and resumed["lr_at_load"][0] == resumed["lr_at_load"][1]
    straight = {key: run[key][SAVE_AFTER:] for key in ("loss", "norm", "lr")}
    assert resumed["loss"] == straight["loss"] and resumed["norm"] == straight["norm"]
    assert resumed["lr"] == pytest.approx(straight["lr"])
    assert resumed["weights"].keys() == run["weights"].keys()
    for key, value in run["weights"].items():  # the same operations in the same order: equal bits
        assert torch.equal(resumed["weights"][key], value), key
    actor = tmp / name / "actor"
    optim = sorted(p.name for p in (actor / CHECKPOINT_TAG).glob("*optim_states.pt"))
    assert len(optim) == 2 and "zero_pp_rank_0_" in optim[0] and "zero_pp_rank_1_" in optim[1]
    assert (actor / "zero_to_fp32.py").is_file() and (actor / "rng_rank1.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3, 2])
def test_a_nonfinite_gradient_skips_the_step(ran: tuple[Path, dict[str, Any]], stage: int) -> None:
    run = ran[1][f"zero{stage}"]["nonfinite"]
    assert not math.isfinite(run["norm"]) and run["unchanged"]
    assert run["lr"][1] < run["lr"][0]  # the cosine schedule moved on, as FSDPStrategy's does
    assert math.isfinite(run["next_norm"]) and run["next_norm"] > 0


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_masters(ran: tuple[Path, dict[str, Any]]) -> None:
    from easytrain.distributed.deepspeed import deepspeed_state_dict

    tmp, results = ran
    bf16, fp32 = results["zero3_bf16"], results["zero3"]
    torch.testing.assert_close(torch.tensor(bf16["loss"]), torch.tensor(fp32["loss"][:SAVE_AFTER]), rtol=1e-3, atol=0)
    torch.testing.assert_close(torch.tensor(bf16["norm"]), torch.tensor(fp32["norm"][:SAVE_AFTER]), rtol=1e-2, atol=0)
    converted = deepspeed_state_dict(tmp / "zero3_bf16" / "actor")
    assert converted.keys() == bf16["weights"].keys()
    for name, value in bf16["weights"].items():
        assert value.dtype == torch.float32 and torch.equal(converted[name], value), name
    logger.info("ZeRO-3 bf16 vs fp32: %s", gap(bf16, {**fp32, "loss": fp32["loss"][:SAVE_AFTER],
                                                       "norm": fp32["norm"][:SAVE_AFTER], "weights": fp32["at_save"]}))


@pytest.mark.slow
def test_loading_on_another_world_size_is_refused(ran: tuple[Path, dict[str, Any]],
                                                  tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    tmp, _ = ran
    spawn(load_on_one_rank, str(tiny_model("qwen2", "small")), str(tmp / "zero3" / "actor"),
          str(tmp_path / "message"), world=1)
    message = (tmp_path / "message").read_text()
    assert "saved by 2 ranks, this run has 1" in message and "same number of actor ranks" in message


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero3", "zero2", "vl_lora"])
def test_deepspeed_state_dict_equals_full_state_dict(ran: tuple[Path, dict[str, Any]], name: str) -> None:
    from easytrain.distributed.deepspeed import deepspeed_state_dict

    tmp, results = ran
    converted = deepspeed_state_dict(tmp / name / "actor")
    expected = results[name]["at_save"]
    assert converted.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(converted[key], value), key


@pytest.mark.slow
def test_lora_trains_the_adapters_and_keeps_frozen_weights(ran: tuple[Path, dict[str, Any]]) -> None:
    _, results = ran
    run = results["vl_lora"]
    initial, final = run["initial"], run["weights"]
    assert final.keys() == initial.keys()
    changed = {k for k in final if not torch.equal(final[k], initial[k])}
    assert changed and all("lora_" in k for k in changed)
    assert any(k.startswith("base_model.model.model.visual.") for k in final)  # frozen, partitioned, gathered


@pytest.mark.slow
def test_export_of_a_deepspeed_checkpoint(ran: tuple[Path, dict[str, Any]], tiny_model: Callable[..., Path],
                                          tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from easytrain.config.schema import Config
    from easytrain.trainer.export import export

    tmp, results = ran
    config = Config()
    config.model.path = str(tiny_model("qwen2", "small"))
    config.worker.actor.strategy = "deepspeed"
    config.trainer.output_dir = str(tmp_path)
    step = tmp_path / "checkpoints" / f"global_step_{SAVE_AFTER}"
    step.mkdir(parents=True)
    (step / "actor").symlink_to(tmp / "zero3" / "actor", target_is_directory=True)
    (step / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(config)))
    (step / "trainer_state.json").write_text(f'{{"step": {SAVE_AFTER}}}')
    out = export(step, tmp_path / "hf")
    exported = load(str(out)).state_dict()
    for name, value in results["zero3"]["at_save"].items():
        assert torch.equal(exported[name], value), name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero2_offload_optimizer", "zero3_offload_both"])
def test_offload_trains_on_cpu_like_no_offload(ran: tuple[Path, dict[str, Any]], initial: dict[str, torch.Tensor],
                                               name: str) -> None:
    _, results = ran
    run, base = results[name], results[name.split("_")[0]]
    assert run["optimizer_state_devices"] == ["cpu"]
    assert_close_runs(run, base, initial, rtol=1e-5)
    logger.info("%s vs no offload: %s", name, gap(run, base))


def test_unsupported_settings_are_refused_before_deepspeed_starts() -> None:
    from easytrain.distributed.deepspeed import DeepSpeedStrategy, deepspeed_config

    with pytest.raises(ValueError, match="offload_params needs zero_stage=3"):
        DeepSpeedStrategy(nn.Linear(2, 2), actor_config("deepspeed", 2, offload_params=True), 1)
    with pytest.raises(ValueError, match="zero_stage=0"):
        deepspeed_config(actor_config("deepspeed", 0), "float32", on_gpu=False)
    with pytest.raises(ValueError, match="float16"):
        deepspeed_config(actor_config("deepspeed", 3), "float16", on_gpu=False)
    config = deepspeed_config(actor_config("deepspeed", 3, True, True), "bfloat16", on_gpu=False)
    assert config["zero_optimization"] == {"stage": 3, "compute_grad_norm": True,
                                           "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                           "offload_param": {"device": "cpu", "pin_memory": False}}
    assert config["bf16"]["enabled"] and not config["managed_gradient_accumulation"]
    assert config["gradient_accumulation_steps"] == 1 and config["gradient_clipping"] == 1.0

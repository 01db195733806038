"""The switches of the GRPO step, through the real trainer on Ray (one module-scoped RLTrainer on the tiny model)
and, where a part is a pure function, directly; every expected value is computed here from its definition.

- KL in the reward (``use_kl_loss=false``): reward - kl_coef x the response's summed KL estimate (k1 or k3) of
  the actor's log-probs (old ones when recomputed, else the sampling ones) against the reference's; then group
  advantages with and without the std (``norm_adv_by_std``); the adaptive coefficient over real steps follows
  proportional control (Ziegler et al. 2019) on the KL the rollout had.
- DAPO dynamic sampling: with a reward whose uniform groups are known from the answers
  (``tests/assets/answer_split_reward.py``), the batch keeps groups with signal first, refills from further
  rounds, and stops at ``max_sampling_retries + 1`` rounds.
- The watchdog: each relief action on the live workers, the RAM thresholds on live readings at the step
  boundary (warn, soft: relief, hard: the stop), and the documented default thresholds at their boundaries.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from easytrain.algorithms.kl import KLController, kl_in_reward
from easytrain.config import load, with_overrides
from easytrain.data.vision import VISUAL_KEYS
from easytrain.distributed.batch import Batch
from easytrain.memory.detect import level
from easytrain.memory.readings import node_ram
from easytrain.trainer.data import to_batch
from easytrain.trainer.metrics import PhaseTimer
from easytrain.trainer.rl import RLTrainer

from conftest import writable
from grpo_helpers import make_config
from reference import grpo_advantages, kl_estimate

REWARD = Path(__file__).parent / "assets" / "answer_split_reward.py"
N = 2
TARGET_GROUPS = 4
RETRIES = 2
KL_COEF = 0.05
KL_TARGET = 1e-6
"""Far below any KL once the policy has moved: the controller's error is then clipped at +20%."""
KL_HORIZON = 16
ACTIONS = ["free_caches", "sleep_rollout", "offload_ref", "halve_micro_batch"]
EPS = 1e-6
"""GRPO's std guard (advantages.EPS)."""


# ----------------------------------------------------------------------------- the formulas


def adaptive_step(coef: float, kl: float, n_samples: int, target: float = KL_TARGET,
                  horizon: int = KL_HORIZON) -> float:
    """beta <- beta (1 + clip(KL / target - 1, -0.2, 0.2) n / horizon)."""
    return coef * (1 + max(-0.2, min(0.2, kl / target - 1)) * n_samples / horizon)


# ----------------------------------------------------------------------------- pure parts (no Ray)


@pytest.mark.parametrize("kind", ["kl", "low_var_kl"])
def test_kl_in_reward_subtracts_the_coefficient_times_the_masked_kl_sum(kind: str) -> None:
    g = torch.Generator().manual_seed(0)
    log_probs, ref = -torch.rand(4, 5, generator=g) * 3, -torch.rand(4, 5, generator=g) * 3
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0])
    shaped, mean_kl = kl_in_reward(rewards, log_probs, ref, mask, 0.3, kind)
    per_token = kl_estimate(log_probs, ref, kind)
    sums = torch.stack([per_token[i, :int(mask[i].sum())].sum() for i in range(4)])
    torch.testing.assert_close(shaped, rewards - 0.3 * sums)
    assert mean_kl == pytest.approx(float(sums.sum()) / 11)


def test_adaptive_coefficient_follows_proportional_control_and_fixed_stays() -> None:
    kls = [0.5, 0.021, 0.0, 0.019, 0.1]  # clipped up, +5%, clipped down, -5%, clipped up
    adaptive, fixed = KLController(0.05, True, 0.02, 100), KLController(0.05, False, 0.02, 100)
    expected = 0.05
    for kl in kls:
        adaptive.update(kl, 8)
        fixed.update(kl, 8)
        expected = adaptive_step(expected, kl, 8, target=0.02, horizon=100)
        assert adaptive.coef == pytest.approx(expected, rel=1e-12)
    assert fixed.coef == 0.05
    assert adaptive.coef == pytest.approx(0.05 * 1.016 * 1.004 * 0.984 * 0.996 * 1.016, rel=1e-12)


DOCUMENTED_THRESHOLDS = {"ram": (0.80, 0.85, 0.92), "vram": (0.85, 0.90, 0.97)}
"""README, "Memory watchdog": warn, soft, hard."""


def test_default_thresholds_are_the_documented_ones_and_each_boundary_holds(tmp_path: Path) -> None:
    watchdog = load([f"trainer.output_dir={tmp_path}"]).watchdog
    for resource, documented in DOCUMENTED_THRESHOLDS.items():
        thresholds = tuple(getattr(watchdog, f"{resource}_{lv}") for lv in ("warn", "soft", "hard"))
        assert thresholds == documented, resource
        for below, at, value in zip(("ok", "warn", "soft"), ("warn", "soft", "hard"), thresholds):
            assert level(value - 1e-9, *thresholds) == below, (resource, value)
            assert level(value, *thresholds) == at, (resource, value)


# ----------------------------------------------------------------------------- the trainer


@pytest.fixture(scope="module")
def trainer(ray_clusters: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RLTrainer]:
    ray_clusters.local()
    config = make_config(
        str(tmp_path_factory.mktemp("switches")), f"reward.function={REWARD}:by_answer", "reward.num_workers=1",
        "trainer.workers_per_node=1", "algorithm.use_kl_loss=false", f"algorithm.kl_coef={KL_COEF}",
        "algorithm.kl_type=adaptive", f"algorithm.kl_target={KL_TARGET}", f"algorithm.kl_horizon={KL_HORIZON}",
        "algorithm.kl_penalty=low_var_kl", "algorithm.dynamic_sampling=true",
        f"algorithm.max_sampling_retries={RETRIES}", f"watchdog.actions=[{','.join(ACTIONS)}]",
        "watchdog.sample_period_s=600", "watchdog.plot=false", "trainer.loggers=[jsonl]", "trainer.max_steps=4",
        "data.synthetic_size=64")  # ~21 count questions: the flat prompts the sampling tests draw
    assert config.worker.rollout.n == N and config.data.rollout_batch_size == TARGET_GROUPS
    trainer = RLTrainer(config)
    yield trainer
    trainer.close()


class Prompts:
    """Prompt batches of the trainer's own data, each prompt flat (a count question: every response scores 1)
    or with signal (responses score 0 and 1), in the order a pattern such as "SFFS" asks; each prompt once."""

    def __init__(self, trainer: RLTrainer) -> None:
        self.data = trainer.data
        answers = [self.data.train[i].answer for i in range(len(self.data.train))]
        self.rows = {"F": [i for i, a in enumerate(answers) if a.strip().isdigit()],
                     "S": [i for i, a in enumerate(answers) if not a.strip().isdigit()]}

    def batch(self, pattern: str) -> Batch:
        rows = [self.rows[kind].pop(0) for kind in pattern]
        return to_batch(self.data.collator([self.data.train[i] for i in rows]), False)


class Counted:
    """An iterator of prompt batches that counts how many were taken."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches, self.taken = batches, 0

    def __iter__(self) -> "Counted":
        return self

    def __next__(self) -> Batch:
        self.taken += 1
        return self.batches[self.taken - 1]


@pytest.fixture
def prompts(trainer: RLTrainer) -> Prompts:
    return Prompts(trainer)


def rollout_with_ref(trainer: RLTrainer, prompts: Batch) -> tuple[Batch, dict[str, torch.Tensor]]:
    """A real rollout, scored, with the reference group's log-probs (taken after the engine sleeps)."""
    batch, scores = trainer.generate_and_score(prompts, PhaseTimer())
    batch = trainer.with_reference(batch, PhaseTimer())
    assert "ref_log_probs" in batch and "old_log_probs" not in batch
    return batch, scores


# ----------------------------------------------------------------------------- KL in the reward, advantages



def switch(monkeypatch: pytest.MonkeyPatch, trainer: RLTrainer, overrides: dict[str, Any]) -> None:
    """The driver's algorithm switches for one test: the shared trainer reads a changed copy of its config (a
    run's own config never changes)."""
    monkeypatch.setattr(trainer, "config", with_overrides(trainer.config, overrides))

@pytest.mark.slow
@pytest.mark.parametrize("recomputed", [False, True])
@pytest.mark.parametrize("by_std", [True, False])
@pytest.mark.parametrize("kind", ["kl", "low_var_kl"])
def test_advantages_of_rewards_minus_the_kl_of_the_actors_log_probs(
        trainer: RLTrainer, prompts: Prompts, kind: str, by_std: bool, recomputed: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    switch(monkeypatch, trainer, {"algorithm.kl_penalty": kind, "algorithm.norm_adv_by_std": by_std})
    monkeypatch.setattr(trainer.kl, "coef", 0.37)  # the controller's current coefficient, not the configured one
    batch, scores = rollout_with_ref(trainer, prompts.batch("SFSS"))
    mask = batch["response_mask"].float()
    g = torch.Generator().manual_seed(1)
    # a reference apart from the policy, so the KL term is large and its sign shows (off the mask too)
    ref = batch["ref_log_probs"] + 0.5 * torch.randn(mask.shape, generator=g)
    batch = batch.union(Batch({"ref_log_probs": ref}))
    policy = batch["rollout_log_probs"]
    if recomputed:  # the actor's recomputed old log-probs are the policy's, not the engine's
        policy = policy + 0.3 * torch.randn(mask.shape, generator=g)
        batch = batch.union(Batch({"old_log_probs": policy}))

    out, metrics = trainer.add_advantages(batch, scores)

    kl = kl_estimate(policy, ref, kind) * mask
    rewards = scores["overall"] - 0.37 * kl.sum(-1)
    expected = grpo_advantages(rewards, N, by_std)[:, None] * mask
    torch.testing.assert_close(out["advantages"], expected, rtol=1e-5, atol=1e-6)
    assert metrics["actor/reward_kl"] == pytest.approx(float(kl.sum() / mask.sum()), rel=1e-5)
    assert float(kl.sum()) != pytest.approx(0.0, abs=1e-3)


@pytest.mark.slow
def test_validation_generations_come_back_without_the_prompts_pixels(trainer: RLTrainer, prompts: Prompts) -> None:
    batch = prompts.batch("SF")
    assert "pixel_values" in batch and "image_grid_thw" in batch  # the default task's prompts carry images
    train = trainer.generate(batch, PhaseTimer())
    val = trainer.generate(batch, PhaseTimer(), validate=True)
    assert "pixel_values" in train and "image_grid_thw" in train  # the update needs them
    assert not any(key in val for key in VISUAL_KEYS)  # the driver only scores a validation's responses
    assert len(val) == len(batch) * trainer.config.worker.rollout.val_override.n
    assert val["responses"].shape[1] == train["responses"].shape[1]  # the responses themselves come back


@pytest.mark.slow
def test_with_the_kl_in_the_loss_the_reward_is_left_alone(trainer: RLTrainer, prompts: Prompts,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    switch(monkeypatch, trainer, {"algorithm.use_kl_loss": True})
    batch, scores = rollout_with_ref(trainer, prompts.batch("SSFS"))
    batch = batch.union(Batch({"ref_log_probs": batch["ref_log_probs"] - 1.0}))
    out, metrics = trainer.add_advantages(batch, scores)
    expected = grpo_advantages(scores["overall"], N)[:, None] * batch["response_mask"]
    torch.testing.assert_close(out["advantages"], expected, rtol=1e-5, atol=1e-6)
    assert metrics == {}


@pytest.mark.slow
def test_adaptive_kl_coefficient_follows_the_rollouts_kl_over_real_steps(trainer: RLTrainer,
                                                                         prompts: Prompts) -> None:
    """Three trainer steps: each logged coefficient is the previous one moved by proportional control on the KL
    in the reward of that step (logged as actor/reward_kl). The first rollout's policy is the reference (KL ~0:
    down 10%); once the update moved it, the KL is far above the tiny target (up 10%)."""
    coef = trainer.kl.coef
    logged = []
    for _ in range(3):
        trainer.step += 1
        metrics = trainer.train_step(Counted([prompts.batch("SSSS")])).metrics
        assert metrics["sampling/rounds"] == 1.0
        coef = adaptive_step(coef, metrics["actor/reward_kl"], N * TARGET_GROUPS)
        assert metrics["actor/kl_coef"] == pytest.approx(coef, rel=1e-9)
        assert trainer.kl.coef == metrics["actor/kl_coef"]
        logged.append(metrics)
    assert logged[-1]["actor/reward_kl"] > 10 * KL_TARGET
    assert logged[-1]["actor/kl_coef"] > logged[-2]["actor/kl_coef"]  # the KL in the reward, not 0, was fed


# ----------------------------------------------------------------------------- DAPO dynamic sampling


def expected_groups(patterns: list[str], target: int, retries: int) -> tuple[int, list[tuple[int, int]]]:
    """Rounds generated and the (round, position) of each kept group: the first rounds until ``target`` groups
    with signal or ``retries + 1`` rounds, groups with signal first in round order, then flat ones."""
    rounds, found = 0, 0
    while rounds < len(patterns) and (rounds == 0 or (found < target and rounds <= retries)):
        found += patterns[rounds].count("S")
        rounds += 1
    seen = [(r, i, kind) for r in range(rounds) for i, kind in enumerate(patterns[r])]
    ordered = [(r, i) for r, i, kind in seen if kind == "S"] + [(r, i) for r, i, kind in seen if kind == "F"]
    return rounds, ordered[:target]


def run_rollout(trainer: RLTrainer, prompts: Prompts, patterns: list[str]) -> None:
    batches = [prompts.batch(p) for p in patterns]
    source = Counted(batches)
    batch, scoring, metrics = trainer.rollout(source, PhaseTimer())
    scores = scoring(PhaseTimer())
    rounds, kept = expected_groups(patterns, TARGET_GROUPS, RETRIES)
    assert source.taken == rounds
    uids = [batches[r].meta["uids"][i] for r, i in kept]
    assert batch.meta["uids"] == [u for u in uids for _ in range(N)]
    flat = [patterns[r][i] == "F" for r, i in kept]
    assert scores["overall"].tolist() == [s for f in flat for s in ((1.0, 1.0) if f else (0.0, 1.0))]
    assert len(batch) == len(scores["overall"]) == N * TARGET_GROUPS
    assert metrics == {"sampling/rounds": float(rounds),
                       "sampling/informative_groups": float(min(TARGET_GROUPS,
                                                                sum(p.count("S") for p in patterns[:rounds])))}


@pytest.mark.slow
def test_dynamic_sampling_keeps_groups_with_signal_and_refills_from_the_next_round(trainer: RLTrainer,
                                                                                   prompts: Prompts) -> None:
    run_rollout(trainer, prompts, ["SFFS", "FSSF", "SSSS"])  # 2 + 2 groups with signal: 2 rounds, not 3


@pytest.mark.slow
def test_dynamic_sampling_stops_after_the_retries_and_fills_with_flat_groups(trainer: RLTrainer,
                                                                             prompts: Prompts) -> None:
    run_rollout(trainer, prompts, ["FSFF", "FFFF", "FFSF", "SSSS"])  # 2 groups with signal in 3 rounds


@pytest.mark.slow
def test_without_dynamic_sampling_the_first_round_is_the_batch(trainer: RLTrainer, prompts: Prompts,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    switch(monkeypatch, trainer, {"algorithm.dynamic_sampling": False})
    first = prompts.batch("FFSF")
    source = Counted([first, prompts.batch("SSSS")])
    batch, scoring, metrics = trainer.rollout(source, PhaseTimer())
    scores = scoring(PhaseTimer())
    assert source.taken == 1 and metrics == {}
    assert batch.meta["uids"] == [u for u in first.meta["uids"] for _ in range(N)]
    assert scores["overall"].tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]


# ----------------------------------------------------------------------------- the watchdog on live workers


def planned_update_micro_batches(trainer: RLTrainer) -> list[int]:
    """The sizes of the micro batches the driver now plans for one update over a rollout batch's samples (padded
    micro batches: their sizes do not depend on whether prompts are shared, which needs real token ids)."""
    from dataclasses import replace

    from easytrain.trainer.micro_batches import update_shares

    c = trainer.config
    per_step = c.worker.actor.global_batch_size * c.worker.rollout.n
    rows = c.data.rollout_batch_size * c.worker.rollout.n
    batch = Batch({"attention_mask": torch.ones(rows, 4, dtype=torch.long)})
    assert not trainer.forward.packed
    steps, _ = update_shares(batch, per_step, trainer.roles.actor.members, replace(trainer.forward, share_prompt=False))
    return sorted({len(micro) for member in steps for step in member for micro in step})


@pytest.fixture
def restore_micro_batch(trainer: RLTrainer) -> Iterator[None]:
    size = trainer.forward.update_size
    yield
    trainer.forward.update_size = size


@pytest.mark.slow
def test_halve_micro_batch_halves_the_actors_setting_down_to_one(trainer: RLTrainer,
                                                                 restore_micro_batch: None) -> None:
    guard = trainer.guard
    assert guard is not None and planned_update_micro_batches(trainer) == [2]
    assert trainer.plan_check is not None
    planned = trainer.plan_check.planned["update"].process_host
    relief = guard.halve_micro_batch({"ram"})
    assert relief.applied and relief.freed == 0 and relief.planned > 0
    assert planned_update_micro_batches(trainer) == [1]
    assert trainer.forward.update_size == 1 and trainer.forward.update_micro == 1  # what the step's metrics read
    assert trainer.config.worker.actor.micro_batch_size_per_device_for_update == 2  # the run's config never changes
    assert trainer.plan_check.follow(trainer.config, trainer.forward.overrides())  # as the next step's readings do
    assert trainer.plan_check.planned["update"].process_host < planned  # the plan check prices the halved batch
    again = guard.halve_micro_batch({"ram"})
    assert not again.applied and "already 1" in again.detail
    assert planned_update_micro_batches(trainer) == [1]


@pytest.mark.slow
def test_free_caches_releases_in_every_process_of_the_run(trainer: RLTrainer) -> None:
    assert trainer.guard is not None
    relief = trainer.guard.free_caches({"ram"})
    processes = {(p["role"], p["rank"]) for p in relief.processes}
    assert processes == {("driver", 0), ("reward", 0), ("worker", 0)}  # one fused process per device
    assert relief.freed == sum(p["ram_freed_bytes"] + p["gpu_freed_bytes"] for p in relief.processes)
    assert all(p["ram_freed_bytes"] >= 0 for p in relief.processes)


@pytest.mark.slow
def test_sleep_rollout_frees_the_engines_host_copy_and_offload_ref_claims_nothing(trainer: RLTrainer) -> None:
    """On CPU a fused worker's HF engine sleeps at level 2: under RAM pressure the relief drops its weights
    (measured bytes) and the next step refills them from the actor. GPU pressure finds nothing to free on CPU, and
    the reference already sits in host memory."""
    guard = trainer.guard
    assert guard is not None and trainer.roles.rollout_sleeps and trainer.config.worker.rollout.sleep_level == 2
    on_gpu_pressure = guard.sleep_rollout({"vram"})
    assert not on_gpu_pressure.applied and on_gpu_pressure.freed == 0 and "frees host RAM" in on_gpu_pressure.detail
    trainer.train_step()  # the engine is awake again after the step's sync
    held = sum(t.numel() * t.element_size() for t in trainer.roles.rollout.call("engine_weights")[0].values())
    relief = guard.sleep_rollout({"ram"})
    assert relief.applied and 0 < relief.freed <= held and "refills" in relief.detail
    assert trainer.train_step().metrics["actor/grad_norm"] > 0  # generation refilled the weights first
    for pressure in ({"vram"}, {"ram"}):
        relief = guard.offload_ref(pressure)
        assert not relief.applied and relief.freed == 0


def band(fraction: float, wanted: str) -> dict[str, float]:
    """RAM thresholds that put ``fraction`` (a live reading) at level ``wanted``, the nearest half of it away."""
    low, mid, high = 0.5 * fraction, 1.5 * fraction, 1.75 * fraction
    return {"ok": dict(ram_warn=mid, ram_soft=high, ram_hard=2 * fraction),
            "warn": dict(ram_warn=low, ram_soft=mid, ram_hard=high),
            "soft": dict(ram_warn=0.25 * fraction, ram_soft=low, ram_hard=mid),
            "hard": dict(ram_warn=0.1 * fraction, ram_soft=0.25 * fraction, ram_hard=low)}[wanted]


def events(trainer: RLTrainer, step: int) -> list[dict[str, Any]]:
    path = Path(trainer.config.trainer.output_dir) / "memory.jsonl"
    trainer.guard.watchdog.file.flush()  # type: ignore[union-attr]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if r["kind"] == "event" and r["step"] == step]


@pytest.mark.slow
@pytest.mark.parametrize("wanted", ["ok", "warn", "soft", "hard"])
def test_ram_thresholds_judge_live_readings_at_the_step_boundary(trainer: RLTrainer, wanted: str,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  restore_micro_batch: None) -> None:
    """The node's RAM is read by its sampler when the step ends; thresholds set around that reading give each
    level, and the guard does what the level asks: nothing, a warning, every relief action in order, the stop.
    GPU thresholds sit out of reach (no GPU here): the RAM reading must be judged by the RAM ones."""
    guard = trainer.guard
    assert guard is not None
    cfg = writable(guard.watchdog.cfg)  # the driver's thresholds, moved around this test's reading
    monkeypatch.setattr(guard.watchdog, "cfg", cfg)
    monkeypatch.setattr(cfg, "vram_warn", 0.995)
    monkeypatch.setattr(cfg, "vram_soft", 0.997)
    monkeypatch.setattr(cfg, "vram_hard", 0.999)
    # The fixture's 600 s sample period keeps periodic samples out of the way, but the driver lowers ram_hard by
    # the growth its sampler saw times (period + reaction): any drift of the node's RAM between two readings,
    # times 601 s, would pull the hard line down to ram_soft. The growth lowering has its own tests; here the
    # driver judges with a 1 s period, so only a rise faster than ~10% of RAM per second can move a level.
    monkeypatch.setattr(cfg, "sample_period_s", 1.0)
    fraction = node_ram(int(cfg.ram_limit_gb * 2**30) if cfg.ram_limit_gb else None)["ram_fraction"]
    for key, value in band(fraction, wanted).items():
        monkeypatch.setattr(cfg, key, value)
    step = 1000 + ["ok", "warn", "soft", "hard"].index(wanted)
    guard.watchdog.skip_pending()
    metrics, stop = guard.after_step(step, [], [])

    logged = events(trainer, step)
    assert metrics["memory/node_ram_fraction_max"] == pytest.approx(fraction, rel=0.3)
    levels = [e["level"] for e in logged if e["level"] in ("warn", "soft", "hard")]
    assert levels == ([] if wanted == "ok" else [wanted]), logged
    reliefs = [e["action"] for e in logged if e["level"] == "relief"]
    assert reliefs == (ACTIONS if wanted == "soft" else [])
    assert ("memory/relief_freed_gb" in metrics) == (wanted == "soft")
    if wanted == "soft":
        assert planned_update_micro_batches(trainer) == [1]  # halve_micro_batch: the driver plans halved ones
    assert (stop is not None) == (wanted == "hard")
    if stop is not None:
        assert "RAM at" in stop and "hard threshold" in stop and "RSS since start" in stop

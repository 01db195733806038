"""Config composition and validation: presets compose, bad combinations fail in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from easytrain.config import CONF_DIR, ConfigError, compose, load, schema_keys
from easytrain.main import resolve

FIXED_OUT = ["trainer.output_dir=/tmp/easytrain-test-out"]


def _resolve(overrides: list[str]):
    return resolve(compose(FIXED_OUT + overrides))


@pytest.mark.parametrize("preset,model", [
    ("tiny", "tiny:qwen2_5_vl"),
    ("qwen25vl_7b", "Qwen/Qwen2.5-VL-7B-Instruct"),
    ("qwen25vl_3b", "Qwen/Qwen2.5-VL-3B-Instruct"),
    ("qwen2vl_7b_sft", "Qwen/Qwen2-VL-7B-Instruct"),
])
def test_presets_compose_and_validate(preset: str, model: str) -> None:
    assert _resolve([f"+exp={preset}"]).model.path == model


def test_no_preset_means_the_tiny_preset() -> None:
    from easytrain.config import with_default_preset

    assert with_default_preset([]) == ["+exp=tiny"]
    assert with_default_preset(["trainer.seed=3"]) == ["+exp=tiny", "trainer.seed=3"]
    assert with_default_preset(["+exp=qwen25vl_7b"]) == ["+exp=qwen25vl_7b"]
    assert _resolve(with_default_preset([])) == _resolve(["+exp=tiny"])


def test_gpu_preset_values() -> None:
    config = _resolve(["+exp=qwen25vl_7b"])
    assert config.trainer.device == "cuda" and config.trainer.workers_per_node == 8
    assert config.worker.rollout.engine == "vllm" and config.worker.rollout.tensor_parallel_size == 2
    sft = _resolve(["+exp=qwen2vl_7b_sft"])
    assert sft.trainer.task == "sft" and sft.model.freeze_vision_tower


def test_attention_auto_is_sdpa_without_flash_attn_and_flash_needs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU presets ask for ``auto``: flash-attn is not installed here, so they run sdpa; naming
    flash_attention_2 is a config error saying what to install, and on CPU what to use instead."""
    assert _resolve(["+exp=qwen25vl_7b"]).model.attn_implementation == "sdpa"
    with pytest.raises(ConfigError, match="model.attn_implementation='flash_attention_2': flash-attn is not installed"):
        _resolve(["+exp=qwen25vl_7b", "model.attn_implementation=flash_attention_2"])
    with pytest.raises(ConfigError, match="flash-attention runs on CUDA GPUs only"):
        _resolve(["model.attn_implementation=flash_attention_2"])
    monkeypatch.setattr(sys.modules["easytrain.config.validate"], "flash_attn_installed", lambda: True)  # a GPU node that has it
    assert _resolve(["+exp=qwen25vl_7b"]).model.attn_implementation == "flash_attention_2"
    assert _resolve(["model.attn_implementation=auto"]).model.attn_implementation == "sdpa"  # CPU run


def test_the_validated_config_is_read_only_and_changed_copies_leave_it_alone() -> None:
    """A loaded config has its ``auto`` values resolved and cannot change afterwards, at any depth, in this process
    or in a copy Ray ships to a worker; a what-if (the planner's) is a changed read-only copy."""
    import pickle

    from easytrain.config import with_overrides

    config = _resolve(["+exp=qwen25vl_7b"])
    assert config.model.attn_implementation == "sdpa"  # auto, resolved at load
    for section, key in ((config, "seed"), (config.trainer, "seed"), (config.worker.actor.optim, "lr"),
                         (config.worker.rollout.multi_turn, "enable"), (config.watchdog, "enabled")):
        with pytest.raises(AttributeError, match="read-only once validated"):
            setattr(section, key, 1)
    shipped = pickle.loads(pickle.dumps(config))
    with pytest.raises(AttributeError, match="read-only"):
        shipped.worker.actor.micro_batch_size_per_device_for_update = 1
    changed = with_overrides(config, {"worker.actor.optim.lr": 0.5, "trainer.seed": 9})
    assert (changed.worker.actor.optim.lr, changed.trainer.seed) == (0.5, 9)
    assert (config.worker.actor.optim.lr, config.trainer.seed) != (0.5, 9) and config == _resolve(["+exp=qwen25vl_7b"])
    with pytest.raises(AttributeError, match="read-only"):
        changed.trainer.seed = 1


def test_primary_yaml_holds_no_defaults() -> None:
    """Every default lives in the schema: config.yaml only lists the schema and Hydra settings."""
    primary = yaml.safe_load((CONF_DIR / "config.yaml").read_text())
    assert set(primary) <= {"defaults", "hydra"}


def test_output_dir_defaults_to_hydra_run_dir(tmp_path: Path) -> None:
    assert load([f"hydra.run.dir={tmp_path}"]).trainer.output_dir == str(tmp_path)


@pytest.mark.parametrize("value,expected", [
    ("x.parquet", "x.parquet"),
    ("[a.parquet,b.jsonl]", ["a.parquet", "b.jsonl"]),
])
def test_train_files_string_or_list(value: str, expected) -> None:
    # (load: the form is parsed without checking the files exist, which tests/test_bad_input.py covers)
    assert load(FIXED_OUT + [f"data.train_files={value}"]).data.train_files == expected


def test_text_model_without_images_is_valid() -> None:
    config = _resolve(["model.path=tiny:qwen2", "data.image_key=null"])
    assert config.data.image_key is None


def test_ulysses_with_replicated_kv_heads_is_valid() -> None:
    # Qwen2.5-VL-7B: 28 query heads, 4 KV heads; ulysses 4 divides both.
    config = _resolve(["+exp=qwen25vl_7b", "worker.actor.ulysses_size=4", "worker.ref.ulysses_size=4",
                       "worker.actor.padding_free=true", "worker.actor.max_token_len_per_device=8192"])
    assert config.worker.actor.ulysses_size == 4


def _local_model(tmp_path: Path, heads: int, kv: int) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "num_attention_heads": heads, "num_key_value_heads": kv,
        "hidden_size": 64 * heads, "num_hidden_layers": 2, "vocab_size": 1000,
        "max_position_embeddings": 8192}))
    return folder


BAD = [
    (["+exp=tiny", "worker.actor.micro_batch_size_per_device_for_update=3"],
     "worker.actor.micro_batch_size_per_device_for_update=3"),
    (["+exp=tiny", "data.max_pixels=10", "data.min_pixels=1000"], "data.max_pixels=10"),
    (["model.pth=x"], "model.pth: unknown config key; did you mean model.path?"),
    (["worker.rollout.n=abc"], "worker.rollout.n"),
    (["worker.rollout.n=1"], "worker.rollout.n=1"),
    (["algorithm.adv_estimator=rloo", "worker.rollout.n=1"], "worker.rollout.n=1"),
    (["model.dtype=fp8"], "model.dtype='fp8'"),
    (["trainer.device=tpu"], "trainer.device='tpu'"),
    (["data.rollout_batch_size=12"], "worker.actor.global_batch_size=8"),
    (["trainer.workers_per_node=3"], "worker.actor.global_batch_size=8"),
    (["worker.actor.ulysses_size=3"], "worker.actor.ulysses_size=3"),
    (["worker.rollout.tensor_parallel_size=2"], "worker.rollout.tensor_parallel_size=2"),
    (["worker.rollout.engine=vllm", "worker.rollout.tensor_parallel_size=4"],
     "worker.rollout.tensor_parallel_size=4"),
    (["+exp=qwen25vl_7b", "worker.actor.ulysses_size=8", "worker.actor.padding_free=true",
      "worker.actor.max_token_len_per_device=8192"], "worker.actor.ulysses_size=8: must divide the model's 28"),
    (["worker.actor.ulysses_size=2"], "worker.actor.ulysses_size=2: Ulysses sequence parallelism splits padding-free"),
    (["worker.ref.ulysses_size=2", "algorithm.kl_coef=0.1"],
     "worker.ref.ulysses_size=2"),
    (["+exp=tiny_sft", "worker.actor.ulysses_size=2", "worker.actor.strategy=deepspeed"],
     "worker.actor.ulysses_size=2: sequence parallelism is built and tested with FSDP2"),
    (["data.limit_images=0"], "data.limit_images=0"),
    (["model.path=tiny:qwen2"], "data.image_key='images'"),
    (["worker.ref.offload.optimizer=true"], "worker.ref.offload.optimizer"),
    (["watchdog.ram_soft=0.95"], "watchdog.ram_soft=0.95"),
    (["worker.rollout.top_p=0"], "worker.rollout.top_p=0"),
    (["trainer.loggers=[console,foo]"], "trainer.loggers[1]='foo'"),
    (["trainer.val_only=true", "data.val_files=null"], "data.val_files"),
    (["worker.actor.fsdp.shard_size=3"], "worker.actor.fsdp.shard_size=3"),
    (["+exp=nope"], "exp='nope'"),
    (["trainer.resume=/nonexistent/ckpt"], "trainer.resume"),
    (["worker.rollout.engine=vllm", "model.dtype=bfloat16"], "model.dtype='bfloat16'"),
    (["data.train_files=[]"], "data.train_files"),
    (["model.lora.rank=-1"], "model.lora.rank=-1"),
    (["data.max_response_length=5000"], "data.max_response_length=5000"),
    (["trainer.save_freq=0", "trainer.export_final=true"], "trainer.export_final=True"),
    (["model.freeze_llm=true", "model.freeze_vision_tower=true", "model.freeze_aligner=true"],
     "model.freeze_llm"),
    (["worker.actor.optim.betas=[0.9]"], "worker.actor.optim.betas"),
    (["reward.function=acuracy"], "reward.function='acuracy': not a registered reward"),
    (["reward.function=/no/such/file.py:fn"], "reward.function='/no/such/file.py:fn': no such file"),
    (["reward.format_weight=1.5"], "reward.format_weight=1.5"),
    (["worker.actor.strategy=deepspeed"], "worker.actor.strategy='deepspeed'"),
    (["+exp=tiny_sft", "worker.actor.strategy=deepspeed", "worker.actor.deepspeed.zero_stage=2",
      "worker.actor.deepspeed.offload_params=true"], "worker.actor.deepspeed.offload_params=True"),
    (["+exp=tiny_sft", "worker.actor.deepspeed.zero_stage=0"], "worker.actor.deepspeed.zero_stage=0"),
    (["+exp=tiny_sft", "worker.actor.strategy=deepspeed", "model.dtype=float16"], "model.dtype='float16'"),
    (["+exp=tiny_sft", "worker.actor.strategy=deepspeed", "worker.actor.offload.params=true"],
     "worker.actor.offload.params=True"),
    (["worker.actor.padding_free=true", "worker.actor.max_token_len_per_device=100"],
     "worker.actor.max_token_len_per_device=100"),
    (["+exp=tiny_sft", "worker.actor.max_token_len_per_device=100"], "worker.actor.max_token_len_per_device=100"),
    (["+exp=tiny_sft", "worker.actor.padding_free=false", "worker.actor.micro_batch_size_per_device_for_update=3"],
     "worker.actor.micro_batch_size_per_device_for_update=3"),
]


@pytest.mark.parametrize("overrides,expected", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_config_is_one_line_naming_the_key(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        _resolve(overrides)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(expected) or expected in message, message


def test_an_unknown_tiny_family_is_one_line_naming_the_key_and_the_families() -> None:
    """The families with a tiny model are the adapters' (models/families), so the check runs where the shape is
    resolved (main and plan, before anything launches)."""
    from easytrain.models.shapes import resolve_shape

    with pytest.raises(ConfigError) as info:
        resolve_shape(_resolve(["model.path=tiny:llama"]).model)
    message = str(info.value)
    assert "\n" not in message and message.startswith("model.path='tiny:llama'")
    assert "tiny:qwen3_vl" in message and "tiny:internvl" in message


def test_kv_heads_that_cannot_be_split(tmp_path: Path) -> None:
    folder = _local_model(tmp_path, heads=12, kv=2)
    with pytest.raises(ConfigError, match=r"worker.actor.ulysses_size=3: the model's 2 key/value heads"):
        _resolve([f"model.path={folder}", "data.image_key=null", "trainer.workers_per_node=6",
                  "data.rollout_batch_size=6", "worker.actor.global_batch_size=6",
                  "worker.actor.micro_batch_size_per_device_for_update=1", "worker.actor.ulysses_size=3",
                  "worker.actor.padding_free=true"])


def test_suggestions_cover_every_schema_key() -> None:
    keys = schema_keys()
    for required in ("model.lora.rank", "worker.actor.optim.lr", "worker.rollout.gpu_memory_utilization",
                     "watchdog.imbalance_factor", "trainer.output_dir", "data.limit_images"):
        assert required in keys


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def test_cli_config_prints_validated_yaml() -> None:
    out = _cli("-m", "easytrain.cli", "config", "+exp=qwen25vl_7b")
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    assert printed["worker"]["rollout"]["tensor_parallel_size"] == 2
    assert printed["model"]["path"] == "Qwen/Qwen2.5-VL-7B-Instruct"


@pytest.mark.parametrize("entry", [["-m", "easytrain.cli", "config"], ["-m", "easytrain.main"]])
@pytest.mark.parametrize("overrides,key", [
    (["+exp=tiny", "worker.actor.micro_batch_size_per_device_for_update=3"],
     "worker.actor.micro_batch_size_per_device_for_update"),
    (["+exp=tiny", "data.max_pixels=10", "data.min_pixels=1000"], "data.max_pixels"),
    (["+exp=qwen25vl_7b", "model.attn_implementation=flash_attention_2"], "pip install flash-attn"),
])
def test_cli_bad_config_exits_2_with_one_line(entry: list[str], overrides: list[str], key: str) -> None:
    out = _cli(*entry, *overrides)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and "Traceback" not in out.stderr, out.stderr

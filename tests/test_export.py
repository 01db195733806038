"""Resharding and export: a checkpoint saved by 2 FSDP ranks resumes on 1 with the same weights; the exported
Hugging Face folder gives the trained actor's logits; a LoRA export, merged or as an adapter, gives the
adapter-applied outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from easytrain.distributed.checkpoint import IncompatibleCheckpoint, load_model_weights
from easytrain.memory import peaks
from easytrain.models.hf import load_model, load_tokenizer, model_folder
from easytrain.trainer.checkpoint import CheckpointError, check_resume, checkpoint_folder
from easytrain.trainer.export import MARKER
from easytrain.trainer.rl import RLTrainer

from grpo_helpers import make_config, trained_weights

pytestmark = pytest.mark.slow

REWARD = Path(__file__).parent / "assets" / "spread_reward.py"


def config(tmp: Path, *extra: str) -> Any:
    return make_config(str(tmp), f"reward.function={REWARD}:spread", "algorithm.kl_coef=0", "trainer.max_steps=2",
                       "trainer.save_freq=1", *extra)


def logits(model: Any, tokenizer: Any) -> torch.Tensor:
    ids = tokenizer(["what colour is the square", "red green blue"], return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**ids).logits


def test_save_on_two_ranks_resume_on_one_and_export(ray_local: None, tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText

    run = tmp_path / "run"
    on_two = trained_weights(config(run, "trainer.workers_per_node=2"))
    assert sorted(p.name for p in (run / "checkpoints" / "global_step_2" / "actor").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own shards
    resumed = RLTrainer(config(run, "trainer.workers_per_node=1"))  # resume=auto: the step-2 checkpoint
    try:
        assert resumed.step == 2 and resumed.roles.actor.world_size == 1
        on_one = resumed.roles.actor.call("full_state_dict")
    finally:
        resumed.close()
    assert on_one.keys() == on_two.keys()
    for key, value in on_two.items():
        assert torch.equal(on_one[key], value), key

    out = tmp_path / "hf"
    # this process holds 1 GiB more while the export runs: a child's ru_maxrss would start from that high-water mark
    # (the kernel carries it across exec), its own VmHWM does not
    held = bytearray(2**30)
    held[::4096] = b"\x01" * len(held[::4096])
    done = subprocess.run([sys.executable, "-m", "easytrain.cli", "export", str(run), "--out", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    peak = json.loads((out / MARKER).read_text())["peak_host_bytes"]
    if peaks.host_high_water():  # /proc says
        fp32 = 4 * sum(value.numel() for value in on_two.values())
        assert fp32 < peak < peaks.host_high_water()  # it held the fp32 model; it is not this process's mark
    del held
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))
    for name in ("config.json", "tokenizer.json", "preprocessor_config.json", "chat_template.jinja"):
        assert (out / name).is_file(), name
    cfg = config(run)
    tokenizer = load_tokenizer(cfg.model)
    trained = load_model(cfg.model, dtype="float32")
    initial = logits(trained, tokenizer)
    trained.load_state_dict(on_two)
    exported = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    assert torch.equal(logits(exported, tokenizer), logits(trained, tokenizer))
    assert not torch.allclose(initial, logits(trained, tokenizer))  # the run really trained

    with pytest.raises(CheckpointError, match="hidden_size"):  # a checkpoint of another model shape
        check_resume(config(run, "model.tiny_size=small"))


def test_lora_export_as_adapter_and_merged(ray_local: None, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from easytrain.trainer.export import export

    run = tmp_path / "run"
    cfg = config(run, "model.lora.rank=4", "model.lora.alpha=8", "worker.actor.optim.lr=5e-2")
    trained_weights(cfg)
    adapter = export(run, tmp_path / "adapter")
    merged = export(run, tmp_path / "merged", merge=True)
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "adapter_config.json").is_file()
    assert not (merged / "adapter_config.json").exists()

    tokenizer = load_tokenizer(cfg.model)
    base = AutoModelForImageTextToText.from_pretrained(model_folder(cfg.model), dtype=torch.float32)
    base_logits = logits(base, tokenizer)
    with_adapter = PeftModel.from_pretrained(base, adapter)
    adapter_logits = logits(with_adapter, tokenizer)
    merged_logits = logits(AutoModelForImageTextToText.from_pretrained(merged, dtype=torch.float32), tokenizer)
    assert not torch.allclose(adapter_logits, base_logits, atol=1e-4)  # the adapter learned something
    torch.testing.assert_close(merged_logits, adapter_logits, atol=1e-5, rtol=1e-5)

    plain = load_model(cfg.model, dtype="float32")  # the LoRA checkpoint does not fit a model without LoRA
    with pytest.raises(IncompatibleCheckpoint, match="no tensor"):
        load_model_weights(checkpoint_folder(run) / "actor", plain)

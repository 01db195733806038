"""trainer.malloc_mmap_threshold_kb: glibc's dynamic mmap threshold keeps freed tensors resident; a fixed one
hands them back. Each case runs in a fresh interpreter, so its heap starts clean."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from easytrain.config.loader import load
from easytrain.memory.host import malloc_threshold_bytes

MB = 2**20

PROGRAM = """
import json, sys
import torch
from easytrain.memory import peaks

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

fixed = sys.argv[1] == "fixed"
if fixed:
    assert peaks.fix_mmap_threshold(128 * 1024)
big = torch.ones(4 * 2**20)  # 16 MiB: mmapped either way; freeing it raises glibc's dynamic threshold to 16 MiB
del big
before = rss()
blocks = [torch.ones(256 * 1024) for _ in range(256)]  # 256 tensors of 1 MiB, pages touched
keep = torch.ones(256 * 1024)  # allocated last: above the freed blocks in the heap
held = rss()
del blocks
print(json.dumps({"held": held - before, "after_free": rss() - before}))
"""


def run(mode: str) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_a_fixed_threshold_hands_freed_tensors_back_and_the_dynamic_one_keeps_them() -> None:
    dynamic, fixed = run("dynamic"), run("fixed")
    for reading in (dynamic, fixed):
        assert reading["held"] > 250 * MB  # the 256 MiB were resident while alive
    assert dynamic["after_free"] > 200 * MB  # heap blocks under one still alive: glibc keeps them
    assert fixed["after_free"] < 16 * MB  # each had its own mapping: unmapped when freed


def test_the_threshold_defaults_to_glibcs_dynamic_one_and_a_set_value_fixes_it() -> None:
    assert malloc_threshold_bytes(load([])) == 0
    assert malloc_threshold_bytes(load(["trainer.malloc_mmap_threshold_kb=128"])) == 128 * 1024
    assert malloc_threshold_bytes(load(["trainer.device=cuda"])) == 0
    assert malloc_threshold_bytes(load(["trainer.malloc_mmap_threshold_kb=0"])) == 0
    assert malloc_threshold_bytes(load(["trainer.device=cuda", "trainer.malloc_mmap_threshold_kb=512"])) == 512 * 1024


def _lora_kept(overrides: list[str], adapters: bool = True, grad: bool = True) -> int:
    from easytrain.memory.activations import MicroShape, model_dims
    from easytrain.memory.host import pass_activations

    config = load(overrides)
    dims = model_dims({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 3,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000})
    micro = MicroShape(2, 100, 20, 0, 0)
    parts = pass_activations(config, "activations", dims, micro, 4, config.trainer.device == "cuda", adapters,
                             grad=grad, checkpointing=False, vision_grad=False)
    return parts.get("LoRA temporaries (freed, kept by the heap)", 0)


def test_the_heap_keeps_lora_branch_temporaries_only_where_glibc_keeps_freed_blocks_and_adapters_run() -> None:
    """Per token and layer, LORA_HEAP_KEPT sets of the adapted linears' outputs: q 64, k and v 32 each, o 64,
    gate and up 256 each, down 64 (768 elements); none without LoRA, under a fixed threshold, on a GPU, or in a
    pass with the adapters off."""
    from easytrain.memory.host import LORA_HEAP_KEPT

    tokens_layers = 2 * 100 * 3
    assert _lora_kept(["model.lora.rank=8"]) == int(LORA_HEAP_KEPT[True] * tokens_layers * 768 * 4)
    assert _lora_kept(["model.lora.rank=8"], grad=False) == int(LORA_HEAP_KEPT[False] * tokens_layers * 768 * 4)
    assert _lora_kept(["model.lora.rank=8", "model.lora.target_modules=[q_proj,v_proj]"]) == int(
        LORA_HEAP_KEPT[True] * tokens_layers * (64 + 32) * 4)
    for overrides in ([], ["model.lora.rank=8", "trainer.malloc_mmap_threshold_kb=128"],
                      ["model.lora.rank=8", "trainer.device=cuda"]):
        assert _lora_kept(overrides) == 0, overrides
    assert _lora_kept(["model.lora.rank=8"], adapters=False) == 0


CALLS = """
import json
import torch
from easytrain.distributed.group import Dispatch, dispatch
from easytrain.memory import peaks

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

class Worker:
    @dispatch(Dispatch.BROADCAST)
    def call(self, blocks):
        return [torch.ones(256 * 1024) for _ in range(blocks)]  # a result of 1 MiB heap blocks

worker = Worker()
big = torch.ones(4 * 2**20)  # mmapped; freeing it raises glibc's dynamic threshold to 16 MiB
del big
result = worker.call(256)  # 256 MiB returned: alive past the call's own trim, as Ray holds a call's result
keep = torch.ones(256 * 1024)  # above them in the heap
del result  # freed after the call, as Ray drops a call's arguments and result: glibc keeps the pages
freed = rss()
peaks.drain()  # the first call's peak
worker.call(0)
print(json.dumps({"freed_resident": freed, "next_call_peak": peaks.drain()["call"]["host_bytes"]}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_a_call_starts_after_the_last_calls_freed_arguments_and_result_went_back() -> None:
    from easytrain.memory import peaks

    if not peaks.CLEAR_REFS.exists():
        pytest.skip("no /proc/self/clear_refs: peaks are lifetime peaks here")
    out = subprocess.run([sys.executable, "-c", CALLS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # the 256 MiB freed after the last call were resident when the next one was called, and not during it
    assert got["next_call_peak"] < got["freed_resident"] - 200 * MB

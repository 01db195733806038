"""The variable-length attention kernels on one CUDA device (issue 32 item 4): PyTorch's ``varlen_attn`` (and
flash-attn's ``flash_attn_varlen_func`` where installed) given easytrain's layouts compute what one SDPA call per
block does, packed samples and shared prompts alike, and a tiny Qwen2.5-VL in bf16 trains padding-free through
them (gradient checkpointing included) as well as its padded forward does.

bf16 tolerance. Every path here rounds its inputs to bf16 identically and accumulates in fp32; they differ in
where they round in between (flash kernels round the softmax weights to bf16 before the weighted sum, 2^-9
relative each, and the output once more) and in summation order. So no path is exact: each is compared with an
fp32 computation of the same maths, and the varlen path must be within twice the error of today's path (per-block
SDPA, or the padded model) plus a floor of 2^-8 of the values' scale (one bf16 rounding of the output and of the
weights against the largest value). The bound is relative to what the existing path does on the same card.

Marked ``gpu``: skipped without a CUDA device, never run in CI. On a GPU machine:
``python -m pytest tests/gpu/test_varlen_gpu.py -m gpu``."""

from __future__ import annotations

import copy
from pathlib import Path
import pytest
import torch

from easytrain.models import segments as seg
from easytrain.models.segments import Block, apply_segment_attention, attend, checkpoint_contexts, packed_blocks
from easytrain.models.varlen import (FLASH_ATTN, SDPA_BLOCKS, TORCH_VARLEN, device_capability, flash_attn_function,
                                     kernel_for, torch_varlen_function)
from easytrain.workers.forward import log_probs_of

from rl_batches import grads, planned, rl_config, rollout_batch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

CUDA = torch.device("cuda")
BF16_FLOOR = 2.0 ** -8


def need(kernel: str) -> None:
    capability = device_capability(CUDA)
    if capability is None or capability < (8, 0):
        pytest.skip(f"flash kernels need sm80+, this GPU is {capability}")
    if kernel == TORCH_VARLEN and torch_varlen_function() is None:
        pytest.skip(f"torch {torch.__version__} has no usable torch.nn.attention.varlen.varlen_attn")
    if kernel == FLASH_ATTN and flash_attn_function() is None:
        pytest.skip("flash_attn is not installed (or does not import)")


def layouts() -> dict[str, list[list[Block]]]:
    lengths = [1, 17, 300, 64, 5, 129, 2, 250]  # 768 tokens, skewed
    packed = packed_blocks(torch.cat([torch.arange(n) for n in lengths]))
    shared = [[Block((0, 200), ((200, 201), (201, 264), (264, 400), (400, 410))), Block((410, 700), ((700, 768),))],
              [Block((0, 64), ((64, 100), (100, 500))), Block((500, 768))]]
    return {"packed": packed, "shared": shared}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("kernel", [TORCH_VARLEN, FLASH_ATTN])
@pytest.mark.parametrize("name", ["packed", "shared"])
def test_the_varlen_kernel_equals_per_block_sdpa(kernel: str, name: str) -> None:
    need(kernel)
    layout = layouts()[name]
    generator = torch.Generator(device=CUDA).manual_seed(0)
    rows, heads, kv_heads, dim = len(layout), 8, 2, 128  # grouped-query, Qwen2.5-VL's head size
    shape = (rows, 768)
    q = torch.randn(shape[0], heads, shape[1], dim, device=CUDA, generator=generator)
    k = torch.randn(shape[0], kv_heads, shape[1], dim, device=CUDA, generator=generator)
    v = torch.randn(shape[0], kv_heads, shape[1], dim, device=CUDA, generator=generator)
    weight = torch.randn(rows, heads, shape[1], dim, device=CUDA, generator=generator)
    scale = dim ** -0.5

    def run(dtype: torch.dtype, path: str) -> tuple[torch.Tensor, ...]:
        leaves = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves, layout, scale, kernel=path)
        return (out.detach(), *torch.autograd.grad((out.float() * weight).sum(), leaves))

    want = run(torch.float32, SDPA_BLOCKS)
    blocks = run(torch.bfloat16, SDPA_BLOCKS)
    got = run(torch.bfloat16, kernel)
    assert got[0].dtype == torch.bfloat16 and got[0].shape == want[0].shape
    floor = BF16_FLOOR * float(v.abs().max())
    assert float((got[0].float() - want[0]).abs().max()) <= 2 * float((blocks[0].float() - want[0]).abs().max()) + floor
    for name_, g, b, w in zip(("dq", "dk", "dv"), got[1:], blocks[1:], want[1:]):
        assert rel(g, w) <= 2 * rel(b, w) + BF16_FLOOR, name_


def test_the_dispatcher_picks_torch_varlen_for_bf16_on_this_gpu() -> None:
    need(TORCH_VARLEN)
    q = torch.zeros(1, 2, 8, 128, device=CUDA, dtype=torch.bfloat16)
    assert kernel_for(q) == TORCH_VARLEN
    assert kernel_for(q.float()) == SDPA_BLOCKS
    assert kernel_for(q, "sdpa_blocks") == SDPA_BLOCKS


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_padding_free_tiny_qwen25vl_trains_on_varlen_as_the_padded_one(share: bool, checkpointing: bool,
                                                                         tmp_path: Path) -> None:
    """Loss and gradients of the padding-free (and prompt-shared) pass through varlen_attn, bf16 weights as FSDP's
    mixed precision computes, against the padded bf16 pass; both measured against the padded pass in fp32."""
    need(TORCH_VARLEN)
    from test_shared_prompt import actor_model

    config = rl_config(tmp_path, "worker.rollout.n=4")
    batch = rollout_batch(config)
    reference = actor_model(config).to(CUDA)
    model = copy.deepcopy(reference).to(torch.bfloat16)
    apply_segment_attention(model)  # the GPU workers' switch (sdpa on CUDA); its padded pass stays plain sdpa
    mask = batch["response_mask"].bool()
    weights = torch.linspace(-1, 1, int(mask.sum()), device=CUDA)

    def run(net: torch.nn.Module, packed: bool) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
        net.train()
        if checkpointing:
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                             "context_fn": checkpoint_contexts})
        lp, _ = log_probs_of(net, planned(batch, net, packed, share and packed), 1.0, CUDA)
        loss = (lp[mask.to(CUDA)].float() * weights).sum()
        loss.backward()
        return lp[mask.to(CUDA)].float(), float(loss), {n: g.float() for n, g in grads(net).items()}

    want = run(reference, packed=False)
    padded = run(model, packed=False)
    seg._used.pop(TORCH_VARLEN, None)
    got = run(model, packed=True)
    assert TORCH_VARLEN in seg.used_kernels()  # the packed pass really went through varlen_attn

    def err(result: tuple[torch.Tensor, float, dict[str, torch.Tensor]]) -> tuple[float, float, float]:
        names = sorted(want[2])
        flat = torch.cat([result[2][n].reshape(-1) for n in names])
        ref = torch.cat([want[2][n].reshape(-1) for n in names])
        return float((result[0] - want[0]).abs().max()), abs(result[1] - want[1]), rel(flat, ref)

    assert got[2].keys() == want[2].keys()
    got_err, padded_err = err(got), err(padded)
    scale = (float(want[0].abs().max()), abs(want[1]), 1.0)
    for what, g, p, s in zip(("log-probs", "loss", "gradients"), got_err, padded_err, scale):
        assert g <= 2 * p + BF16_FLOOR * s, (what, g, p)

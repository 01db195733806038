"""Model FLOPs utilisation (MFU) of an update: the FLOPs its maths needs per second, over the GPU's peak.

``update_mfu(num_params, tokens, seconds, peak_flops)`` is ``6 * num_params * tokens / seconds / peak_flops``:
a token's forward costs 2 FLOPs per parameter it passes (one multiply, one add) and its backward twice that
(gradients of activations and of weights). Attention's own matmuls (scores and weighted values) are not in
``6 N T``; pass them as ``attention_flops`` (:func:`attention_flops` of the pairs a layout attends,
:func:`attended_pairs`) to count them. These are *model* FLOPs: what gradient checkpointing recomputes is not
counted, so an update that recomputes does more work on the GPU than its MFU says. Parameters that take no
part in a token's maths (a frozen vision tower, which sees image patches and computes no weight gradients)
make ``6 N T`` an over-count: pass the parameters the tokens go through.

Peaks (:data:`PEAK_BF16_DENSE_TFLOPS`) are NVIDIA's published dense (no 2:4 sparsity) BF16 tensor-core figures,
half the "with sparsity" numbers of the datasheets: H100 SXM 1,979 -> 989.4, H100 PCIe 1,513 -> 756, H200 SXM
the same silicon and clocks as H100 SXM -> 989.4, A100 (SXM and PCIe) 312. Boards with lower clocks under the same
name (H100 NVL, H200 NVL) are left unknown rather than guessed: pass their peak explicitly.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch

PEAK_BF16_DENSE_TFLOPS: tuple[tuple[str, Optional[float]], ...] = (
    ("H100 NVL", None),
    ("H200 NVL", None),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),  # SXM5: torch names it "NVIDIA H100 80GB HBM3"
    ("H200", 989.4),
    ("A100", 312.0),
)
"""(substring of ``torch.cuda.get_device_name``, dense BF16 TFLOPS or None when unknown), first match wins."""


def peak_bf16_flops(device_name: str) -> Optional[float]:
    """Dense BF16 peak FLOP/s of a GPU by its name (case-insensitive substring match); None when unknown."""
    name = device_name.lower()
    for part, tflops in PEAK_BF16_DENSE_TFLOPS:
        if part.lower() in name:
            return None if tflops is None else tflops * 1e12
    return None




def update_mfu(num_params: int, tokens: int, seconds: float, peak_flops: float,
               attention_flops: float = 0.0) -> float:
    """Model FLOPs utilisation of an update of ``tokens`` tokens through ``num_params`` parameters in ``seconds``
    on a device of ``peak_flops`` FLOP/s: ``(6 N T + attention_flops) / seconds / peak_flops``."""
    if seconds <= 0 or peak_flops <= 0:
        raise ValueError(f"update_mfu needs positive seconds and peak_flops (got {seconds}, {peak_flops})")
    return (6.0 * num_params * tokens + attention_flops) / seconds / peak_flops


def causal_pairs(lengths: Iterable[int]) -> int:
    """(query, key) pairs causal attention computes over packed sequences of ``lengths``: L (L + 1) / 2 each."""
    return sum(n * (n + 1) // 2 for n in lengths)


def attended_pairs(layout: Sequence[Sequence[Any]]) -> int:
    """(query, key) pairs of a layout of blocks (:mod:`easytrain.models.segments`): each prefix causally, each part
    its whole prefix plus itself causally."""
    total = 0
    for blocks in layout:
        for block in blocks:
            a, e = block.prefix
            total += causal_pairs([e - a])
            for c, d in block.parts:
                total += (d - c) * (e - a) + causal_pairs([d - c])
    return total


def attention_flops(pairs: int, layers: int, heads: int, head_dim: int) -> float:
    """Training FLOPs of attention's matmuls over ``pairs`` (query, key) pairs: per pair and head, 2 D for the
    score and 2 D for the weighted value forward, twice that backward: ``12 * pairs * heads * head_dim * layers``."""
    return 12.0 * pairs * heads * head_dim * layers

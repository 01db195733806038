"""Attention of packed sequences through kernels that take sequence boundaries (``cu_seqlens``), not masks.

A layout of blocks (:mod:`easytrain.models.segments`) is a set of causal attention problems: each prefix (a
packed sample, a prompt) attends causally to itself, and each part (a response sharing a prompt) attends to its
prefix and causally to itself. Flattened to ``(rows * S, heads, head_dim)``, every block and every part is one
variable-length sequence: its queries are its own columns, and its keys are the same columns (a prefix) or the
prefix's columns followed by its own (a part). :func:`plan_layout` turns a layout into the arguments of a
variable-length kernel: cumulative query and key offsets, the longest query and key, and (only when some
prompt is shared) an index that gathers each part's keys. Causal masking in these kernels is aligned to the
bottom-right corner of a sequence whose keys outnumber its queries, so a part's last query sees every key and its
first query sees the prefix and itself: exactly the prompt-shared pattern, so shared prompts need no fallback.

Kernels (:func:`choose_kernel`):

- ``flash_attn``: flash-attn's ``flash_attn_varlen_func``, when the package imports and the run asked for it;
- ``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn`` (PyTorch's own flash kernel), when this torch has
  it with a causal option (its signature has changed between releases: :func:`torch_varlen_function`);
- ``sdpa_blocks``: one ``scaled_dot_product_attention`` per block and part (segments' own loop), the fallback
  for every other case: CPU, float32, heads the flash kernels do not take, GPUs before sm80;
- ``reference``: per-sequence SDPA over exactly the flattened inputs and plan the kernels get, only when asked
  for; the CPU tests run it to check the plan, and a model's whole varlen path, against masked attention.

Both flash kernels need CUDA, fp16/bf16, a head dimension that is a multiple of 8 up to 256 and an sm80+ GPU.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Collection, Optional, Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Block:
    prefix: tuple[int, int]
    """[start, end) of a sample or prompt: causal attention within it."""
    parts: tuple[tuple[int, int], ...] = ()
    """[start, end) of each response sharing the prefix: it sees the prefix and its own earlier tokens."""


Layout = list[list[Block]]
"""Per row of the batch, its blocks; together they cover every column of the row in order
(:mod:`easytrain.models.segments` builds them)."""

FLASH_ATTN = "flash_attn"
TORCH_VARLEN = "torch_varlen"
SDPA_BLOCKS = "sdpa_blocks"
REFERENCE = "reference"
KERNELS = (FLASH_ATTN, TORCH_VARLEN, SDPA_BLOCKS, REFERENCE)
PREFERENCES = ("auto", FLASH_ATTN, TORCH_VARLEN, SDPA_BLOCKS, REFERENCE)
"""What a run may ask for: ``auto`` (torch's varlen kernel where it fits, else blocks), ``flash_attn`` (flash-attn
where installed and it fits, else as auto), ``torch_varlen`` (as auto), ``sdpa_blocks`` (always blocks),
``reference`` (always the per-sequence reference: tests on CPU)."""
HALF = (torch.float16, torch.bfloat16)
MIN_CAPABILITY = (8, 0)
"""Both flash kernels (flash-attn 2 and the one PyTorch ships) run on Ampere and later."""
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class VarlenPlan:
    """A layout's sequences as variable-length kernel arguments, over ``rows`` rows of ``length`` columns."""

    cu_seq_q: torch.Tensor
    """(N + 1,) int32: where each sequence's queries start in the flattened rows (they tile them in order)."""
    cu_seq_k: torch.Tensor
    """(N + 1,) int32: where each sequence's keys start in the (gathered) keys."""
    max_q: int
    max_k: int
    key_index: Optional[torch.Tensor]
    """(T_k,) int64 flattened columns of every sequence's keys; None when each sequence's keys are its queries
    (no shared prompt), so the keys need no gather."""
    rows: int
    length: int

    @property
    def sequences(self) -> int:
        return self.cu_seq_q.shape[0] - 1

    def to(self, device: torch.device) -> "VarlenPlan":
        index = None if self.key_index is None else self.key_index.to(device, non_blocking=True)
        return VarlenPlan(self.cu_seq_q.to(device, non_blocking=True), self.cu_seq_k.to(device, non_blocking=True),
                          self.max_q, self.max_k, index, self.rows, self.length)


def cu_seqlens(lengths: Sequence[int]) -> torch.Tensor:
    """(N + 1,) int32 cumulative offsets of sequences of ``lengths``: 0, l0, l0 + l1, ..."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        out[1:] = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0).to(torch.int32)
    return out


def plan_layout(layout: Layout, length: int) -> VarlenPlan:
    """The variable-length arguments of ``layout`` (rows of :class:`Block`) over rows of
    ``length`` columns, flattened row after row. Raises ``ValueError`` if a row's blocks and parts do not cover its
    columns exactly once (the same rule as the block-by-block path)."""
    sequences: list[tuple[int, int, list[tuple[int, int]]]] = []  # (query start, end, key ranges) in flat columns
    for row, blocks in enumerate(layout):
        base = row * length
        pieces: list[tuple[int, int, list[tuple[int, int]]]] = []
        for block in blocks:
            a, e = block.prefix
            pieces.append((a, e, [(base + a, base + e)]))
            for c, d in block.parts:
                pieces.append((c, d, [(base + a, base + e), (base + c, base + d)]))
        pieces = [p for p in pieces if p[1] > p[0]]
        pieces.sort(key=lambda piece: piece[0])
        covered = sum(end - start for start, end, _ in pieces)
        tiled = [start for start, _, _ in pieces] == [0] + [end for _, end, _ in pieces[:-1]] if pieces else True
        if covered != length or not tiled:
            raise ValueError(f"the attention layout covers {covered} of the row's {length} positions"
                             + ("" if covered != length else ", not each exactly once"))
        sequences += [(base + start, base + end, keys) for start, end, keys in pieces]
    q_lengths = [end - start for start, end, _ in sequences]
    k_lengths = [sum(e - a for a, e in keys) for _, _, keys in sequences]
    index = None
    if any(len(keys) > 1 for _, _, keys in sequences):  # some prompt is shared: gather each part's keys
        index = torch.cat([torch.arange(a, e) for _, _, keys in sequences for a, e in keys])
    return VarlenPlan(cu_seqlens(q_lengths), cu_seqlens(k_lengths), max(q_lengths, default=0),
                      max(k_lengths, default=0), index, len(layout), length)


# --- what this machine has --------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def torch_varlen_function() -> Optional[Callable[..., torch.Tensor]]:
    """``torch.nn.attention.varlen.varlen_attn`` when this torch has it with a causal option, else None. Its
    keywords changed between releases (``is_causal`` early on; ``window_size=(-1, 0)`` and ``enable_gqa`` later):
    :func:`varlen_call` reads the signature rather than the version."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    function = getattr(varlen, "varlen_attn", None)
    if function is None:
        return None
    params = inspect.signature(function).parameters
    if "window_size" not in params and "is_causal" not in params:
        logger.warning("torch.nn.attention.varlen.varlen_attn takes neither window_size nor is_causal here "
                       "(torch %s): packed sequences are attended block by block", torch.__version__)
        return None
    return function


@lru_cache(maxsize=1)
def flash_attn_function() -> Optional[Callable[..., torch.Tensor]]:
    """flash-attn's ``flash_attn_varlen_func`` when the package is installed and imports, else None."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception as error:  # noqa: BLE001 - a wheel built for another torch/CUDA fails in many ways
        logger.warning("flash_attn is installed but does not import (%s): not used for packed sequences", error)
        return None
    return flash_attn_varlen_func


@lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> Optional[tuple[int, int]]:
    """The CUDA compute capability of ``device``; None off CUDA."""
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


# --- which kernel -----------------------------------------------------------------------------------------------


def choose_kernel(prefer: str, device_type: str, dtype: torch.dtype, head_dim: int,
                  capability: Optional[tuple[int, int]], *, flash_attn_installed: bool,
                  torch_varlen_present: bool) -> str:
    """The kernel for one attention call (pure: availability is passed in). A flash kernel needs CUDA on sm80+,
    fp16/bf16 and a head dimension that is a multiple of 8 up to 256; flash-attn is used only when asked for
    (``prefer="flash_attn"``: the run chose flash_attention_2) and installed; else torch's varlen kernel when this
    torch has it; else block-by-block SDPA."""
    if prefer not in PREFERENCES:
        raise ValueError(f"varlen attention kernel {prefer!r}: choose one of {', '.join(PREFERENCES)}")
    if prefer == REFERENCE:
        return REFERENCE
    fits = (device_type == "cuda" and dtype in HALF and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM
            and capability is not None and tuple(capability) >= MIN_CAPABILITY)
    if prefer == SDPA_BLOCKS or not fits:
        return SDPA_BLOCKS
    if prefer == FLASH_ATTN and flash_attn_installed:
        return FLASH_ATTN
    if torch_varlen_present:
        return TORCH_VARLEN
    return SDPA_BLOCKS


def kernel_for(query: torch.Tensor, prefer: str = "auto") -> str:
    """:func:`choose_kernel` for ``query`` (B, H, S, D) with what this process has."""
    return choose_kernel(prefer, query.device.type, query.dtype, query.shape[-1], device_capability(query.device),
                         flash_attn_installed=prefer == FLASH_ATTN and flash_attn_function() is not None,
                         torch_varlen_present=torch_varlen_function() is not None)


# --- running it ---------------------------------------------------------------------------------------------------


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: VarlenPlan,
                     scale: Optional[float], kernel: str) -> torch.Tensor:
    """Causal attention (T, H, D) of flattened rows: ``query`` (T, H, D), ``key``/``value`` (T, H_kv, D) with
    ``T = plan.rows * plan.length``; each plan sequence's queries see its keys, bottom-right aligned."""
    if query.shape[0] != plan.rows * plan.length:
        raise ValueError(f"{query.shape[0]} flattened queries for a plan of {plan.rows} x {plan.length}")
    if plan.key_index is not None:
        key, value = key.index_select(0, plan.key_index), value.index_select(0, plan.key_index)
    if kernel == FLASH_ATTN:
        function = flash_attn_function()
        if function is None:
            raise RuntimeError("flash_attn does not import here")
        return function(query, key, value, plan.cu_seq_q, plan.cu_seq_k, plan.max_q, plan.max_k, dropout_p=0.0,
                        softmax_scale=scale, causal=True)
    if kernel == TORCH_VARLEN:
        return _torch_varlen(query, key, value, plan, scale)
    if kernel == REFERENCE:
        return reference_varlen(query, key, value, plan.cu_seq_q, plan.cu_seq_k, scale)
    raise ValueError(f"{kernel!r} is not a variable-length kernel ({FLASH_ATTN}, {TORCH_VARLEN}, {REFERENCE})")


@dataclass(frozen=True)
class VarlenCall:
    """How to call a given ``varlen_attn`` signature for causal attention."""

    kwargs: dict[str, Any]
    query_factor: float = 1.0
    """Multiply the queries by this first (a release without ``scale``: its own scale is 1 / sqrt(D))."""
    repeat_kv: int = 1
    """Repeat each key/value head this many times first (a release without ``enable_gqa``)."""


def varlen_call(params: Collection[str], scale: Optional[float], head_dim: int, heads: int,
                kv_heads: int) -> VarlenCall:
    """The keywords for a ``varlen_attn`` taking ``params``: causal as ``window_size=(-1, 0)`` (bottom-right
    aligned) or ``is_causal=True`` in releases before the window; the scale passed, or folded into the queries;
    grouped-query heads by ``enable_gqa``, or repeated."""
    kwargs: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    factor, repeat = 1.0, 1
    if "scale" in params:
        kwargs["scale"] = scale
    elif scale is not None:
        factor = scale * head_dim ** 0.5
    if kv_heads != heads:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            repeat = heads // kv_heads
    return VarlenCall(kwargs, factor, repeat)


def _torch_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: VarlenPlan,
                  scale: Optional[float]) -> torch.Tensor:
    function = torch_varlen_function()
    if function is None:
        raise RuntimeError(f"torch {torch.__version__} has no usable torch.nn.attention.varlen.varlen_attn")
    call = varlen_call(inspect.signature(function).parameters, scale, query.shape[-1], query.shape[1], key.shape[1])
    if call.query_factor != 1.0:
        query = query * call.query_factor
    if call.repeat_kv > 1:
        key, value = key.repeat_interleave(call.repeat_kv, dim=1), value.repeat_interleave(call.repeat_kv, dim=1)
    return function(query, key, value, plan.cu_seq_q, plan.cu_seq_k, plan.max_q, plan.max_k, **call.kwargs)


def reference_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                     cu_seq_k: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    """What a causal variable-length kernel computes, one SDPA call per sequence: queries (T_q, H, D), keys and
    values (T_k, H_kv, D) already gathered; a sequence with more keys than queries is causal from the bottom
    right (its last query sees every key). Any device and dtype; slow, for tests."""
    from torch.nn.attention.bias import causal_lower_right

    q_offsets, k_offsets = cu_seq_q.tolist(), cu_seq_k.tolist()
    gqa = key.shape[1] != query.shape[1]
    out = []
    for (qa, qe), (ka, ke) in zip(zip(q_offsets, q_offsets[1:]), zip(k_offsets, k_offsets[1:])):
        if qe == qa:
            continue
        q = query[qa:qe].transpose(0, 1)[None]
        k, v = key[ka:ke].transpose(0, 1)[None], value[ka:ke].transpose(0, 1)[None]
        if qe - qa == ke - ka:
            piece = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            bias = causal_lower_right(qe - qa, ke - ka)
            piece = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=gqa)
        out.append(piece[0].transpose(0, 1))
    return torch.cat(out, dim=0) if out else query.new_zeros(query.shape)

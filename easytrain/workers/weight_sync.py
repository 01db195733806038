"""Moving the actor's weights into the rollout engine, in place, without disk.

The transport is an interface of its own so the layout decides it:
:class:`ObjectStoreTransport` (actor rank 0 gathers the full weights; the
rollout ranks read them from Ray's object store, the driver only passes the
reference) is the cross-process path used here. The HF-name mapping (PEFT
prefixes stripped, LoRA merged into the base weights) lives in
:func:`to_hf_names`, the one place names are translated.
"""

from __future__ import annotations

import abc
import logging
import re
from typing import Any

import ray
import torch

from easytrain.distributed.group import WorkerGroup

logger = logging.getLogger(__name__)

_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.default\.weight$")


def to_hf_names(state: dict[str, torch.Tensor], lora_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """HF names for a plain or PEFT-wrapped model's weights, with LoRA merged: W + scale * B @ A."""
    if not any(k.startswith("base_model.model.") for k in state):
        return state
    out: dict[str, torch.Tensor] = {}
    lora: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        name = name[len("base_model.model."):] if name.startswith("base_model.model.") else name
        match = _LORA.match(name)
        if match:
            lora.setdefault(match["module"], {})[match["ab"]] = tensor
            continue
        out[name.replace(".base_layer.", ".")] = tensor
    for module, pair in lora.items():
        weight = f"{module}.weight"
        out[weight] = out[weight] + lora_scale * (pair["B"].float() @ pair["A"].float()).to(out[weight].dtype)
    return out


class WeightTransport(abc.ABC):
    @abc.abstractmethod
    def sync(self, actor: WorkerGroup, rollout: WorkerGroup) -> int:
        """Push the actor's current weights to every rollout rank; returns tensors loaded per rank."""


class ObjectStoreTransport(WeightTransport):
    def sync(self, actor: WorkerGroup, rollout: WorkerGroup) -> int:
        pending = actor.submit("full_state_dict")
        weights: Any = pending.refs[0]  # an ObjectRef: each rollout worker resolves it, the driver never does
        loaded = rollout.call("update_weights", weights)
        ray.get(pending.refs[1:])  # the other ranks only took part in the gather
        return int(loaded[0])

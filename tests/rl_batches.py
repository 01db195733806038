"""RL rollout batches for in-process tests: the synthetic task's prompts with random responses."""

from __future__ import annotations

from pathlib import Path

import torch

from easytrain.config import Config, load
from easytrain.distributed.batch import Batch, MicroBatch
from easytrain.models.tiny import SPECIAL_TOKENS, VOCAB_SIZE
from easytrain.trainer.data import RLData
from easytrain.trainer.micro_batches import Forward, micro_batch
from easytrain.workers.sequences import assemble
from easytrain.workers.shared_prompt import supports_shared_prompt, text_config

RESPONSE_LENGTHS = [1, 12, 2, 12, 3, 9, 1, 12]  # skewed: a few long responses among short ones


def rl_config(tmp: Path, *extra: str) -> Config:
    return load([f"trainer.output_dir={tmp}", "data.num_workers=0", "data.synthetic_size=16",
                 "data.synthetic_val_size=4", "trainer.workers_per_node=1", "worker.rollout.n=2",
                 "data.rollout_batch_size=4", "worker.actor.global_batch_size=4", "data.max_response_length=12",
                 "worker.actor.micro_batch_size_per_device_for_update=2", "worker.actor.optim.lr=1e-3", *extra])


def rollout_batch(config: Config, seed: int = 0) -> Batch:
    """Prompts of the synthetic image task (text-only for a text model) with random responses of skewed lengths."""
    data = RLData(config)
    prompts = next(data.train_batches())
    n, width = config.worker.rollout.n, config.data.max_response_length
    generator = torch.Generator().manual_seed(seed)
    rows = len(prompts) * n
    responses = torch.randint(len(SPECIAL_TOKENS) + 10, VOCAB_SIZE, (rows, width), generator=generator)
    mask = (torch.arange(width)[None] < torch.tensor([RESPONSE_LENGTHS[i % len(RESPONSE_LENGTHS)] for i in range(rows)])[:, None]).long()
    batch = assemble(prompts, Batch({"responses": responses * mask, "response_mask": mask}), n, data.family)
    advantages = torch.randn(rows, generator=generator)[:, None] * mask
    return batch.union(Batch({"advantages": advantages}))


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's gradients (cloned), then cleared."""
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def assert_same_pass(got: tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]],
                     expected: tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], mask: torch.Tensor) -> None:
    """Two forward/backward paths agree: (log-probs, entropy, gradients) at the response tokens ``mask``; 0 off it."""
    (lp, entropy, g), (want_lp, want_entropy, want_g) = got, expected
    torch.testing.assert_close(lp[mask], want_lp[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[mask], want_entropy[mask], rtol=1e-5, atol=1e-5)
    assert (lp[~mask] == 0).all()
    assert g.keys() == want_g.keys()
    for name, value in want_g.items():
        # two paths sum a gradient's terms in different orders: fp32 rounding errors scale with the terms summed,
        # not with the element they land in (an element that cancels to ~0 keeps an absolute error of the
        # tensor's scale), so the bound is relative to the tensor's largest element
        scale = float(value.abs().max())
        torch.testing.assert_close(g[name], value, rtol=0, atol=1e-4 * scale + 1e-9, msg=lambda m: f"{name}: {m}")


def planned(batch: Batch, model: torch.nn.Module, packed: bool = False, share_prompt: bool = False) -> MicroBatch:
    """``batch`` as one micro batch laid out the way the driver's plan would (prompts shared where the model
    allows it and it pays off: :func:`easytrain.trainer.micro_batches.micro_batch`)."""
    forward = Forward(packed=packed, budget=0, update_size=len(batch),
                      share_prompt=share_prompt and supports_shared_prompt(model),
                      hidden_size=text_config(model).hidden_size)
    return micro_batch(batch, list(range(len(batch))), forward)

"""Ulysses sequence parallelism, first part: the text decoder on 2 gloo ranks equals the unsplit model.

One spawned 2-rank job runs every case (``CASES``; starting the ranks costs more than a case), checking each in
the ranks; a case that passed leaves a mark, and each test is its case's mark, or the job's error."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from easytrain.data.sft import IGNORE
from easytrain.distributed.ulysses import SequenceParallel, apply_ulysses, gather_sequence
from easytrain.models.segments import packed_blocks, segments
from easytrain.models.tiny import build_tiny

from conftest import tiny_families

LENGTHS = (7, 10, 5, 10)  # uneven packed samples; 32 tokens in 2 chunks of 16: the cut falls inside sample 2


def packed_inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, vocab, (1, sum(LENGTHS)), generator=generator)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    targets = torch.full_like(ids, IGNORE)
    start = 0
    for n in LENGTHS:  # next-token targets inside each sample
        targets[0, start:start + n - 1] = ids[0, start + 1:start + n]
        start += n
    return ids, positions, targets


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]


def run_rank(rank: int, folder: str, checkpointed: bool = False) -> None:
    """``checkpointed``: the Ulysses model under the actor's activation checkpointing, in training mode: its layers
    recompute in backward, after the layout's context has closed, and must recompute on their chunk."""
    from transformers import AutoModelForCausalLM

    from easytrain.distributed.fsdp import apply_activation_checkpointing

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    if checkpointed:
        apply_activation_checkpointing(model)
        model.train()  # transformers checkpoints only in training mode (the tiny configs have no dropout)
    ids, positions, targets = packed_inputs(model.config.vocab_size)
    trained = targets != IGNORE

    ref_lp = token_log_probs(reference(input_ids=ids, position_ids=positions, use_cache=False).logits, targets)
    (ref_lp * trained).sum().backward()

    sp = SequenceParallel(group=dist.group.WORLD, size=2, rank=rank, recording=True)
    apply_ulysses(model, sp)
    part = sp.chunk(ids.shape[1])
    with segments(packed_blocks(positions)):  # the packed samples' layout: Ulysses splits and attends by it
        local_logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    assert local_logits.shape[1] == ids.shape[1] // 2  # the head ran on this rank's chunk only
    local_lp = token_log_probs(local_logits, targets[:, part])
    (local_lp * trained[:, part]).sum().backward()
    full_lp = gather_sequence(local_lp.detach(), sp)
    torch.testing.assert_close(full_lp * trained, ref_lp.detach() * trained, rtol=1e-5, atol=1e-5)

    heads, layers = model.config.num_attention_heads, model.config.num_hidden_layers
    head_dim = model.config.hidden_size // heads
    assert len(sp.record) == layers * (2 if checkpointed else 1)  # recomputed attention goes through Ulysses too
    for call in sp.record:  # before: this chunk with every head; inside attention: every position, half the heads
        assert call["local_query"] == (1, heads, 16, head_dim)
        assert call["attention_query"] == (1, heads // 2, 32, head_dim)
        assert call["attention_key"][2] == 32 and call["collectives"] == ["all_to_all"] * 4

    for (name, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)  # the group's gradients summed are the unsplit model's
        # Ulysses attends sample by sample, the reference in one masked call: the same sums in another order,
        # a few float32 ulps of the largest term apart (4.8e-6 of 8.6 seen in the embedding's gradient)
        atol = 16 * torch.finfo(torch.float32).eps * float(ref.grad.abs().max())
        torch.testing.assert_close(grad, ref.grad, rtol=1e-4, atol=atol, msg=name)


def multi_image_chats(folder: Path) -> Path:
    """Three conversations with 1, 2 and 3 images of different sizes and uneven text: uneven lengths."""
    from PIL import Image

    sizes = [(56, 56), (84, 56), (56, 112)]
    for i, size in enumerate(sizes):
        Image.new("RGB", size, (40 * i, 200, 90)).save(folder / f"{i}.png")
    rows = []
    for count in (1, 2, 3):
        question = " ".join(["<image>"] * count) + " Which colour is the first one?" + " Look closely." * count
        rows.append({"messages": [{"role": "user", "content": question},
                                  {"role": "assistant", "content": "green" if count % 2 else "a green square"}],
                     "images": [str(folder / f"{i}.png") for i in range(count)]})
    path = folder / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_vl_rank(rank: int, run_dir: str, family: str) -> None:
    """Qwen2.5-VL, packed samples with 1, 2 and 3 images: the vision tower and the 3-D rope positions run on the
    whole sequence, the decoder on chunks."""
    from easytrain.config import load
    from easytrain.data.sft import SFTDataset
    from easytrain.models.hf import model_folder
    from easytrain.trainer.data import SFTData, sft_batch
    from easytrain.workers.base import build_sharded_model
    from easytrain.workers.packed import flatten, pad_sequence, sample_positions

    config = load(["+exp=tiny_sft", f"trainer.output_dir={run_dir}", "data.synthetic_size=16",
                   "data.synthetic_val_size=8", "trainer.workers_per_node=1", "data.limit_images=3",
                   f"model.path=tiny:{family}", f"data.image_dir={run_dir}"])
    data = SFTData(config)
    if rank == 0:  # one writer: the other rank would read a half-written image
        multi_image_chats(Path(run_dir))
    dist.barrier()
    chats = SFTDataset([str(Path(run_dir) / "chats.jsonl")], config.data, data.tokenizer, "train", vision=True,
                       progress=False, layout=data.layout)
    samples = [chats[i] for i in range(len(chats))]
    assert [len(s.images) for s in samples] == [1, 2, 3] and len({len(s.ids) for s in samples}) == 3
    inputs = pad_sequence(flatten(sft_batch(data.loader.collator(samples)), data.family), 2)
    targets = inputs.pop("targets")
    trained = targets != IGNORE
    rows = 4 if data.family.rope_rows else 1  # rope rows plus the text row, or plain positions
    images = inputs["image_grid_thw"].shape[0] if "image_grid_thw" in inputs else None  # InternVL: tiles only
    assert inputs["position_ids"].shape[0] == rows and images in (6, None) and inputs["pixel_values"].shape[0] >= 6

    folder = model_folder(config.model)

    def build() -> torch.nn.Module:
        return build_sharded_model(config, config.worker.actor, folder, torch.device("cpu"), 1, trainable=True,
                                   shard=False)

    reference, model = build(), build()
    ref_lp = token_log_probs(reference(**inputs, use_cache=False).logits, targets)
    (ref_lp * trained).sum().backward()

    sp = SequenceParallel(group=dist.group.WORLD, size=2, rank=rank, recording=True)
    apply_ulysses(model, sp)
    part = sp.chunk(inputs["input_ids"].shape[1])
    with segments(packed_blocks(sample_positions(inputs))):
        local_lp = token_log_probs(model(**inputs, use_cache=False).logits, targets[:, part])
    (local_lp * trained[:, part]).sum().backward()
    torch.testing.assert_close(gather_sequence(local_lp.detach(), sp) * trained, ref_lp.detach() * trained,
                               rtol=1e-5, atol=1e-5)
    assert len(sp.record) == model.config.text_config.num_hidden_layers  # every decoder layer went through Ulysses
    length, heads = inputs["input_ids"].shape[1], model.config.text_config.num_attention_heads
    for call in sp.record:  # half the sequence with every head before the all-to-all, all of it with half after
        assert call["local_query"][1:3] == (heads, length // 2)
        assert call["attention_query"][1:3] == (heads // 2, length)
        assert call["collectives"] == ["all_to_all"] * 4
    for (name, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        if ref.grad is None:
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad)
        # Ulysses attends sample by sample, the reference in one masked call: the same sums in another order,
        # a few float32 ulps of the largest term apart (4.8e-6 of 8.6 seen in the embedding's gradient)
        atol = 16 * torch.finfo(torch.float32).eps * float(ref.grad.abs().max())
        torch.testing.assert_close(grad, ref.grad, rtol=1e-4, atol=atol, msg=name)


VL_CASES = tuple(tiny_families("ulysses", images=True))
CASES = ("qwen2-tiny", "qwen2-small", "qwen2-checkpointed") + VL_CASES
"""qwen2 tiny: 2 heads over 1 KV head (repeated); small: 4 over 2; checkpointed: small under activation
checkpointing; the VL families Ulysses serves, with images."""


def run_cases(rank: int, init_method: str, folders: dict[str, str], out: str) -> None:
    """Every case in turn on this rank; after a case both ranks passed, rank 0 marks it done in ``out``."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        for case in CASES:
            if case == "qwen2-checkpointed":
                run_rank(rank, folders["qwen2-small"], checkpointed=True)
            elif case.startswith("qwen2-"):
                run_rank(rank, folders[case])
            else:
                run_dir = Path(out) / case
                run_dir.mkdir(exist_ok=True)
                run_vl_rank(rank, str(run_dir), case)
            dist.barrier()
            if rank == 0:
                (Path(out) / f"{case}.done").touch()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def job(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Optional[Any]]:
    """The job's folder (a mark per case that passed) and its error, if it raised."""
    from rendezvous import rendezvous

    out = tmp_path_factory.mktemp("ulysses")
    folders = {f"qwen2-{size}": str(tiny_model("qwen2", size)) for size in ("tiny", "small")}
    try:
        mp.spawn(run_cases, args=(rendezvous(out), folders, str(out)), nprocs=2, join=True)
    except Exception as err:  # noqa: BLE001 - re-raised by the test of the case that failed, and those after it
        return out, err
    return out, None


def passed(job: tuple[Path, Optional[Any]], case: str) -> None:
    out, error = job
    if not (out / f"{case}.done").exists():
        assert error is not None, f"{case}: no mark and no error"
        raise error


@pytest.mark.parametrize("size", ["tiny", "small"])  # tiny: 2 heads over 1 KV head (repeated); small: 4 over 2
def test_ulysses_two_ranks_equal_the_unsplit_qwen2(size: str, job: tuple[Path, Optional[Any]]) -> None:
    passed(job, f"qwen2-{size}")


def test_ulysses_under_activation_checkpointing_recomputes_on_its_chunk(job: tuple[Path, Optional[Any]]) -> None:
    passed(job, "qwen2-checkpointed")


@pytest.mark.parametrize("family", VL_CASES)
def test_ulysses_two_ranks_equal_the_unsplit_vl_model_with_images(family: str, job: tuple[Path, Optional[Any]]) -> None:
    passed(job, family)

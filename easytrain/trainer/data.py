"""The trainers' data: train/validation datasets (prompts for RL, conversations for SFT), their resumable
loaders, and decoding responses."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterator, Optional

from easytrain.config.errors import ConfigError
from easytrain.config.presets import RANDOM_PREFIX
from easytrain.config.schema import Config
from easytrain.config.data_spec import split_files
from easytrain.data.collate import PromptCollator
from easytrain.data.dataset import PromptDataset
from easytrain.data.loader import PromptLoader
from easytrain.data.profile import DataProfile, describe, profile_rows
from easytrain.data.sft import SFTCollator, SFTDataset
from easytrain.data.sources import DataError
from easytrain.data.vision import VISUAL_KEYS
from easytrain.distributed.batch import Batch
from easytrain.memory.data_shape import DataCosts
from easytrain.models.families.base import Bound
from easytrain.models.hf import family, load_image_processor, load_tokenizer, model_folder


logger = logging.getLogger(__name__)
PROFILE_FILE = "data_profile.json"
"""The data profile a run read before it started (in its run folder)."""
PROMPT_TENSORS = ("input_ids", "attention_mask", *VISUAL_KEYS, "mm_token_type_ids")


class RLData:
    dataset_class: type = PromptDataset

    def __init__(self, config: Config, read: bool = True) -> None:
        """``read=False``: the rules only (tokenizer, family, layout), no dataset opened (a data profile)."""
        self.config = config
        d, m = config.data, config.model
        folder = model_folder(m)
        self.tokenizer = load_tokenizer(m, folder)
        self.family = family(folder)
        self.processor = load_image_processor(m, folder)
        self.vision = self.processor is not None and d.image_key is not None
        self.family.bound_processor(self.processor, d.min_pixels, d.max_pixels)
        self.layout = self.family.layout(self.processor, self.tokenizer) if self.vision else None
        if not read:
            return
        self.train = self.dataset("train")
        self.val = self.dataset("val") if d.val_files else None
        for dataset in (self.train, self.val):
            if dataset is not None:
                dataset.write_skip_report(config.trainer.output_dir)
        self.check_enough_rows()
        self.collator = PromptCollator(self.tokenizer.pad_token_id, self.visuals())
        self.loader = PromptLoader(self.train, self.batch_size(), self.train_collator(), d.shuffle,
                                   config.trainer.seed, d.num_workers)

    def dataset(self, split: str, scan: bool = True) -> Any:
        """The ``split``'s dataset by this run's rules (``scan=False``: its sources opened, no row read)."""
        d = self.config.data
        options = self.dataset_options()
        if self.layout is not None:
            options["layout"] = self.layout
        files = split_files(d.train_files if split == "train" else d.val_files)
        return self.dataset_class(files, d, self.tokenizer, split, self.config.trainer.seed, self.vision,
                                  self.config.model.cache_dir, scan=scan, **options)

    def sampled_at_launch(self) -> bool:
        """The check before launch priced a sample of the rows (a split has more than ``data.profile_rows``)."""
        rows = [d.skips.rows for d in (self.train, self.val) if d is not None]
        return 0 < self.config.data.profile_rows < max(rows)

    def visuals(self) -> Optional[Bound]:
        """The collators' vision inputs: the family's adapter with the image processor and placeholder ids."""
        if not self.vision or self.layout is None:
            return None
        return Bound.of(self.family, self.processor, self.tokenizer)

    def batch_size(self) -> int:
        return self.config.data.rollout_batch_size

    @property
    def keep_images(self) -> bool:
        """Prompt batches carry their PIL images: vLLM takes them, and multi-turn tools may ask for them."""
        r = self.config.worker.rollout
        return r.engine == "vllm" or r.multi_turn.enable

    def dataset_options(self) -> dict[str, Any]:
        """Keyword arguments for the dataset class beyond the shared ones: with multi-turn rollouts, the tools'
        schemas, which the prompts show the model."""
        turns = self.config.worker.rollout.multi_turn
        if not turns.enable:
            return {}
        from easytrain.tools.registry import load_tools

        return {"tools": [tool.schema for tool in load_tools(turns.tools).values()]}

    batch_key = "data.rollout_batch_size"
    """The config key that sets :meth:`batch_size` (named when the data cannot fill one batch)."""

    def check_enough_rows(self) -> None:
        """One batch needs ``batch_size()`` usable rows: fewer (after the pre-flight skips) is a one-line error."""
        usable, size, skips = len(self.train), self.batch_size(), self.train.skips
        if usable >= size:
            return
        skipped = skips.rows - skips.kept
        raise DataError(f"{self.batch_key}={size}: larger than the {usable} usable row(s) of data.train_files "
                        f"({skips.rows} read, {skipped} skipped: {dict(skips.reasons) or 'none'}; see "
                        f"data_report.json in the run folder); lower {self.batch_key} to at most {usable} or add data")

    def train_collator(self) -> Any:
        return self.collator

    def total_steps(self) -> int:
        t = self.config.trainer
        per_epoch = self.loader.sampler.batches_per_epoch
        total = per_epoch * t.total_epochs
        return min(total, t.max_steps) if t.max_steps > 0 else total

    def train_batches(self) -> Iterator[Batch]:
        """Prompt batches across epochs, resuming from the loader's position."""
        while True:
            for raw in self.loader:
                yield to_batch(raw, self.keep_images)

    def val_batches(self) -> Iterator[Batch]:
        assert self.val is not None, "no validation data (data.val_files)"
        size = len(self.val) if self.config.data.val_batch_size < 0 else self.config.data.val_batch_size
        for start in range(0, len(self.val), size):
            prompts = [self.val[i] for i in range(start, min(start + size, len(self.val)))]
            yield to_batch(self.collator(prompts), self.keep_images)

    def decode(self, batch: Batch) -> list[str]:
        """The responses' texts, multi-turn ones with their tool turns (what the reward function sees)."""
        present = batch.tensors.get("response_attention_mask", batch["response_mask"])
        responses = batch["responses"] * present.long()
        return self.tokenizer.batch_decode(responses, skip_special_tokens=True)


def to_batch(raw: dict[str, Any], keep_images: bool) -> Batch:
    """A collated prompt batch as a Batch: tensors, per-prompt lists, images per prompt."""
    import torch

    tensors = {k: raw[k] for k in PROMPT_TENSORS if k in raw}
    meta = {"uids": raw["uids"], "answers": raw["answers"]}
    if keep_images:  # vLLM takes the PIL images beside the token ids; multi-turn tools, the images
        meta.update(images=raw["images"])
    counts = torch.tensor(raw["visual_counts"]) if "pixel_values" in raw else None
    return Batch(tensors, meta, counts)


class SFTData(RLData):
    """Conversations for SFT: global batches of padded samples with targets; prompts for generation samples."""

    dataset_class = SFTDataset

    def dataset_options(self) -> dict[str, Any]:
        return {}

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.blank: Optional[Batch] = self.blank_sample() if self.vision else None
        """One untrained sample with a blank image: joins a micro batch that has no image, so every rank runs
        the vision tower (its sharded blocks' collectives need all ranks)."""

    def blank_sample(self) -> Batch:
        from PIL import Image

        from easytrain.data.sft import IGNORE, SFTSample

        d, layout = self.config.data, self.layout
        assert layout is not None
        image = self.train.fit([Image.new("RGB", (56, 56), (255, 255, 255))], d.min_pixels, d.max_pixels)[0]
        tokens = layout.image_tokens(image.height, image.width)
        text = layout.expand(layout.image_pad, [tokens])
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        sample = SFTSample(uid="blank", input_ids=ids, vllm_text="", images=[image], image_tokens=[tokens], answer="",
                           ids=ids, labels=[IGNORE] * len(ids), all_images=[image])
        return sft_batch(self.loader.collator([sample]))

    def batch_size(self) -> int:
        return self.config.worker.actor.global_batch_size

    batch_key = "worker.actor.global_batch_size"

    def train_collator(self) -> Any:
        return SFTCollator(self.tokenizer.pad_token_id, self.visuals())

    def train_batches(self) -> Iterator[Batch]:
        while True:
            for raw in self.loader:
                yield sft_batch(raw)

    def val_sft_batches(self) -> Iterator[Batch]:
        """The validation conversations (for the validation loss), in batches of data.val_batch_size."""
        assert self.val is not None, "no validation data (data.val_files)"
        collate = self.loader.collator
        for indices in self.val_chunks():
            yield sft_batch(collate([self.val[i] for i in indices]))

    def val_chunks(self) -> list[range]:
        assert self.val is not None
        size = len(self.val) if self.config.data.val_batch_size < 0 else self.config.data.val_batch_size
        return [range(start, min(start + size, len(self.val))) for start in range(0, len(self.val), size)]


def sft_batch(raw: dict[str, Any]) -> Batch:
    import torch

    tensors = {k: raw[k] for k in (*PROMPT_TENSORS, "targets", "position_ids") if k in raw}
    counts = torch.tensor(raw["visual_counts"]) if "pixel_values" in raw else None
    return Batch(tensors, {"uids": raw["uids"]}, counts)


def profile_data(config: Config, progress: bool = True) -> list[DataProfile]:
    """The data profile of the run's RL prompts, train and validation (``data.profile_rows`` rows each; none at 0):
    read by the rules the run will read them by."""
    d = config.data
    if d.profile_rows == 0 or config.trainer.task != "rl":
        return []
    data = RLData(config, read=False)
    splits = ["train"] + (["val"] if d.val_files else [])
    return [profile_rows(data.dataset(split, scan=False), split, d.profile_rows, config.trainer.seed, progress)
            for split in splits]


def try_profile(config: Config, progress: bool = True) -> tuple[list[DataProfile], str]:
    """:func:`profile_data`, or none and why not (SFT, ``data.profile_rows=0``, the model's tokenizer or the data
    not on this machine)."""
    if config.trainer.task != "rl":
        return [], "no data profile (it reads RL prompts only)"
    if config.data.profile_rows == 0:
        return [], "no data profile (data.profile_rows=0)"
    remote = not_on_this_machine(config)
    if remote:  # a hub download here would wait on the network before the plan (~50 s offline)
        return [], f"no data profile ({remote} is not on this machine)"
    try:
        return profile_data(config, progress), ""
    except (ConfigError, DataError) as err:
        return [], f"no data profile ({err})"


def launch_profile(config: Config) -> Optional[DataCosts]:
    """The data profile before a run starts: logged, written to ``data_profile.json`` in the run folder, and the
    rows' costs the launch check prices the plan on (None without a profile)."""
    profiles, note = try_profile(config)
    path = Path(config.trainer.output_dir) / PROFILE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"profiles": [p.as_dict() for p in profiles], "note": note}, indent=2) + "\n")
    for profile in profiles:
        logger.info("%s", describe(profile))
    if note:
        logger.info("%s", note)
    return DataCosts.of(profiles)


def not_on_this_machine(config: Config) -> str:
    """The setting whose model or data the profile would have to download ("" when all are local)."""
    m, d = config.model, config.data
    if not m.path.startswith(("tiny:", RANDOM_PREFIX)) and not Path(m.path).is_dir():
        return f"model.path={m.path}"
    for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        for spec in split_files(files) if files else []:
            if not str(spec).startswith("synthetic:") and not Path(str(spec)).exists():
                return f"{key}={spec}"
    return ""

"""CHORD's SFT term in the trainer (the math: grpokit.algorithms.chord).

``load_chord_sft_dataset`` reads ``--chord_sft_dataset`` through the same path as ``--dataset`` (files, builtin
tasks, hub ids, ``--columns``, ms-swift's column aliases, ``--system``, the prompt options), and keeps each row's
reference reply, the SFT target, in ``solution``. ``ChordSFT`` draws ``--chord_sft_per_device_train_batch_size``
rows per micro-step from a seeded order that cycles over epochs (each process its own block, as the prompt stream
does), encodes prompt + reply + end-of-sequence with the trainer's chat template, and mixes the SFT loss of the
reply tokens into the GRPO loss with the scheduled mu. Its ``position`` (rows drawn, all processes) goes into
checkpoints; mu follows the optimizer step, so both come back on resume.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from datasets import Dataset

from grpokit.algorithms import chord_mix, chord_mu, chord_sft_loss
from grpokit.config.args import TrainConfig
from grpokit.data.columns import parse_columns
from grpokit.data.images import row_images
from grpokit.data.loading import RowOptions, concat_datasets, load_rows, resolve_system
from grpokit.errors import ConfigError, DataError
from grpokit.template.encode import ChatTemplate, EncodedSample
from grpokit.template.prompts import PromptOptions, prepare_prompts
from grpokit.trainers.batch import RolloutBatch, collate
from grpokit.trainers.packing import ForwardOptions, completion_logps
from grpokit.trainers.prompts import PromptStream

OPTION = "--chord_sft_dataset"
REPLY_SOURCES = "a final assistant message in messages, or a solution/answer/response/output/completion column"


def load_chord_sft_dataset(cfg: TrainConfig, tokenizer, template: ChatTemplate | None = None) -> Dataset:
    """The expert rows: ``messages`` (the prompt, rendered as ``--dataset`` prompts are) and ``solution`` (the
    reference reply). DataError naming the spec, the row and its columns where a row has no reply. ``template``:
    the run's (the one ``ChordSFT`` encodes with, from the trainer); None: made from the options."""
    if hasattr(tokenizer, "image_processor"):
        raise ConfigError(
            f"{OPTION} with a vision-language model is not implemented (the SFT rows would need the "
            "processor's image inputs); train CHORD on a text model, or drop --chord_sft_dataset"
        )
    d = cfg.data
    options = RowOptions(
        system=resolve_system(d.system),
        columns=parse_columns(d.columns),
        num_proc=d.dataset_num_proc,
        load_from_cache_file=d.load_from_cache_file,
    )
    parts = []
    for spec in cfg.algorithm.chord_sft_dataset:
        ds = load_rows([spec], options, seed=cfg.training.seed, option=OPTION)
        _check_replies(ds, f"{OPTION} {spec!r}")
        parts.append((f"{OPTION} {spec!r}", ds))
    prompts = PromptOptions.from_args(d, cfg.rollout)  # tools, template kwargs, --max_length as for --dataset
    return prepare_prompts(concat_datasets(parts), template or prompts.template(tokenizer), prompts, OPTION)


def _check_replies(ds: Dataset, source: str) -> None:
    columns = ", ".join(ds.column_names)
    replies = ds["solution"] if "solution" in ds.column_names else [None] * len(ds)
    for i, reply in enumerate(replies):
        if not isinstance(reply, str) or not reply.strip():
            raise DataError(
                f"{source}: row {i} has no reference reply to train on (columns after reading: "
                f"{columns}; got {reply!r}); give each row {REPLY_SOURCES}"
            )
    image_columns = [c for c in ("images", "image") if c in ds.column_names]
    if image_columns and any(row_images(row) for row in ds.select_columns(image_columns)):
        raise DataError(f"{source}: rows with images are not implemented for CHORD's SFT term; use text rows")


class ChordSFT:
    """The SFT rows and the mixing of their loss into the GRPO loss; one per trainer."""

    def __init__(
        self,
        dataset: Dataset,
        template: ChatTemplate,
        cfg: TrainConfig,
        *,
        num_processes: int = 1,
        process_index: int = 0,
    ) -> None:
        a = cfg.algorithm
        self.template = template
        self.phi = a.chord_enable_phi_function
        self.schedule = (a.chord_mu_warmup_steps or 0, a.chord_mu_decay_steps or 0, a.chord_mu_peak, a.chord_mu_valley)
        batch = a.chord_sft_per_device_train_batch_size
        self.stream = PromptStream(
            dataset,
            batch * num_processes,
            seed=cfg.training.seed,
            shuffle=cfg.data.dataset_shuffle,
            num_processes=num_processes,
            process_index=process_index,
        )

    @property
    def position(self) -> int:
        """SFT rows drawn so far over all processes (checkpointed)."""
        return self.stream.position

    @position.setter
    def position(self, value: int) -> None:
        self.stream.position = value

    def mu(self, step: int) -> float:
        return chord_mu(step, *self.schedule)

    def next_batch(self) -> RolloutBatch:
        """This process's next SFT rows as a batch: the prompt, then the reply's tokens and end-of-sequence as
        the completion (every completion token trained)."""
        samples = []
        for row in self.stream.next():
            reply = self.template.tokenize(row["solution"]) + [self.template.eos_token_id]
            samples.append(EncodedSample(self.template.encode_prompt(row["messages"]), reply, [1] * len(reply)))
        return collate(samples, self.template.pad_token_id, [False] * len(samples))

    def mix(
        self, grpo_loss: torch.Tensor, step: int, logps_of: Callable[[RolloutBatch], torch.Tensor]
    ) -> tuple[torch.Tensor, dict]:
        """``(1 - mu) * grpo_loss + mu * sft_loss`` at optimizer step ``step``; ``logps_of(batch)`` gives the
        reply tokens' [B, C] logps under the training model. mu = 0 skips the SFT forward (no rows drawn)."""
        mu = self.mu(step)
        sft = torch.zeros((), dtype=torch.float32, device=grpo_loss.device)
        if mu > 0:
            batch = self.next_batch()
            logps = logps_of(batch)
            sft = chord_sft_loss(logps, batch.completion_mask.to(logps.device), self.phi)
        return chord_mix(grpo_loss, sft, mu), {"chord/mu": mu, "chord/sft_loss": sft.detach()}


def sft_logps(
    model, batch: RolloutBatch, *, device, model_kwargs: Callable[[RolloutBatch], dict], chunk_size, padding_free: bool
) -> torch.Tensor:
    """The expert reply tokens' [B, C] logps under ``model``, from plain logits (temperature 1, as an SFT loss takes
    them); ``model_kwargs``: the trainer's ``_prepare_model_inputs``."""
    batch = batch.to(device)
    opts = ForwardOptions(temperature=1.0, chunk_size=chunk_size, padding_free=padding_free, share_prompts=False)
    return completion_logps(model, model_kwargs(batch), batch.logits_to_keep, opts)[0]

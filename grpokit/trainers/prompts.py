"""The prompt stream: dataset rows, window by window, in a seeded per-epoch order, each process its own block."""

from __future__ import annotations

import torch


class PromptStream:
    """Windows of ``prompts_per_window`` prompts from a seeded permutation of the dataset per epoch (or the dataset
    order without shuffling). Process r takes the r-th block of each window, so every process's prompts are whole
    groups. ``position`` counts the prompts drawn so far over all processes; a checkpoint stores it and a resume
    sets it back (a position always maps to the same row)."""

    def __init__(self, dataset, prompts_per_window: int, *, seed: int, shuffle: bool, num_processes: int = 1,
                 process_index: int = 0) -> None:
        self.dataset = dataset
        self.prompts_per_window = prompts_per_window
        self.seed = seed
        self.shuffle = shuffle
        self.num_processes = num_processes
        self.process_index = process_index
        self.position = 0
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, permutation) of the latest epoch read

    def next(self) -> list[dict]:
        """This process's rows of the next window, each with its stream position as ``_prompt_index``."""
        n = len(self.dataset)
        share = self.prompts_per_window // self.num_processes
        first = self.position + self.process_index * share
        self.position += self.prompts_per_window
        positions = range(first, first + share)
        indices = [int(self._epoch_order(epoch)[idx]) for epoch, idx in (divmod(pos, n) for pos in positions)]
        return [{"_prompt_index": pos, **row} for pos, row in zip(positions, self._rows(indices), strict=True)]

    def _rows(self, indices: list[int]) -> list[dict]:
        """Rows by index: one batched read for a ``datasets.Dataset`` (column-wise), one per row for a list."""
        ds = self.dataset
        if not hasattr(ds, "column_names") or not indices:
            return [ds[i] for i in indices]
        columns = ds[indices]
        return [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            n = len(self.dataset)
            if self.shuffle:
                order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))
            else:
                order = torch.arange(n)
            self._order = (epoch, order)
        return self._order[1]

"""The prompt stream: dataset rows, window by window, in a seeded per-epoch order, each process its own block;
with ``--dataloader_num_workers N`` the rows of the next windows are read ahead by N worker processes."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

import torch
from torch.utils.data import DataLoader

from grpokit.errors import ConfigError


class PromptStream:
    """Windows of ``prompts_per_window`` prompts from a seeded permutation of the dataset per epoch (or the dataset
    order without shuffling). Process r takes the r-th block of each window, so every process's prompts are whole
    groups. ``position`` counts the prompts drawn so far over all processes (the frontier); a window is named by
    the position it starts at. A window drawn but never trained (an asynchronous rollout in flight at a checkpoint,
    or one dropped as too stale) is handed back with ``requeue`` and drawn again before any new one, so that a
    resume (``position`` and ``replay`` set back from the checkpoint) trains each prompt exactly once: a position
    always maps to the same row. Drawing is thread-safe (a background rollout and dynamic sampling both draw)."""

    @classmethod
    def for_run(
        cls, dataset, prompts_per_window: int, args, shuffle: bool, accelerator, by_group: bool = False
    ) -> PromptStream:
        """The stream of a training run: seeded by --seed, read by --dataloader_* workers, one block per process;
        ``by_group`` (--stream_groups): one prompt per draw, each group on its own."""
        return cls(
            dataset,
            1 if by_group else prompts_per_window,
            seed=args.seed,
            shuffle=shuffle,
            num_processes=accelerator.num_processes,
            process_index=accelerator.process_index,
            num_workers=args.dataloader_num_workers or 0,
            prefetch_factor=args.dataloader_prefetch_factor,
            multiprocessing_context=args.dataloader_multiprocessing_context,
        )

    def __init__(
        self,
        dataset,
        prompts_per_window: int,
        *,
        seed: int,
        shuffle: bool,
        num_processes: int = 1,
        process_index: int = 0,
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        multiprocessing_context: str | None = None,
    ) -> None:
        self.dataset = dataset
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.multiprocessing_context = multiprocessing_context
        self._loader: DataLoader | None = None
        self._ahead: tuple[int, Iterator[list[dict]]] | None = None  # (position it continues from, iterator)
        self.prompts_per_window = prompts_per_window
        self.seed = seed
        self.shuffle = shuffle
        self.num_processes = num_processes
        self.process_index = process_index
        self.position = 0
        self.replay: list[int] = []  # starts of windows handed back, drawn again (oldest first) before new ones
        self.unsettled: list[int] = []  # starts drawn since the loop last took a window whole (``settle``)
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, permutation) of the latest epoch read
        self._lock = threading.Lock()

    def next(self) -> list[dict]:
        """This process's rows of the next window, each with its stream position as ``_prompt_index``."""
        return self.take()[1]

    def take(self) -> tuple[int, list[dict]]:
        """The next window: its start position and this process's rows (``next``'s)."""
        with self._lock:
            if self.replay:
                start = self.replay.pop(0)
                positions = self._positions(start)
                rows = read_rows(self.dataset, self._indices(positions))
            else:
                start, positions = self.position, self._positions(self.position)
                rows = self._read_ahead() if self.num_workers else read_rows(self.dataset, self._indices(positions))
                self.position += self.prompts_per_window
            self.unsettled.append(start)
        return start, [{"_prompt_index": pos, **row} for pos, row in zip(positions, rows, strict=True)]

    def restore(self, loop: dict) -> int:
        """The frontier and the pending windows from a checkpoint's loop state; returns the frontier. Windows
        saved by a stream that drew more prompts at a time (``prompts_per_draw``) are replayed prompt by prompt
        here; the other way round is refused, since a replayed window always starts a whole one."""
        pending = sorted(loop.get("prompts_pending", []))
        saved = int(loop.get("prompts_per_draw", self.prompts_per_window))
        if saved != self.prompts_per_window and pending:
            if self.prompts_per_window != 1:
                raise ConfigError(
                    f"the checkpoint holds {len(pending)} draw(s) of {saved} prompt(s) not trained yet; this run "
                    f"draws {self.prompts_per_window} at a time (its batch size or --stream_groups differs): resume "
                    "with the checkpoint's settings (--stream_groups true where it drew one at a time)"
                )
            pending = sorted({start + k for start in pending for k in range(saved)})
        with self._lock:
            self.position = loop["prompts_consumed"]
            self.replay = pending
        return self.position

    def first_drawn(self, held: Iterable[int]) -> int | None:
        """The window (a position) drawn first among those not trained: the ones handed back and ``held`` (those
        a buffer has drawn and holds). A buffer trains it before any other, so that windows train in draw order."""
        with self._lock:
            return min([*self.replay, *held], default=None)

    def epoch(self, position: int) -> int:
        """The epoch a stream position belongs to (each epoch is one pass over the dataset)."""
        return position // len(self.dataset)

    def settle(self) -> None:
        """The loop holds the window it drew for (its rollout done, its rows encoded): from here it is trained
        or saved with a checkpoint's window, and no longer at risk of being lost."""
        with self._lock:
            self.unsettled = []

    def requeue(self, starts: list[int]) -> None:
        """Windows drawn and not trained: drawn again, in order, before any new window."""
        with self._lock:
            self.replay = sorted(set(self.replay) | set(starts))

    def _positions(self, window_start: int) -> range:
        share = self.prompts_per_window // self.num_processes
        first = window_start + self.process_index * share
        return range(first, first + share)

    def _indices(self, positions: range) -> list[int]:
        n = len(self.dataset)
        return [int(self._epoch_order(epoch)[idx]) for epoch, idx in (divmod(pos, n) for pos in positions)]

    def close(self) -> None:
        """Stop the read-ahead worker processes (--dataloader_num_workers), if any; a later draw starts new ones."""
        self._ahead = self._loader = None  # their last references: the iterator's finaliser shuts the workers down

    def _window_indices(self, start: int) -> Iterator[list[int]]:
        """The row indices of the windows from stream position ``start`` on, for the workers (endless)."""
        while True:
            yield self._indices(self._positions(start))
            start += self.prompts_per_window

    def _read_ahead(self) -> list[dict]:
        """The next window's rows from the worker processes, which read the following windows meanwhile. The
        loader and its workers live for the whole run; a jump of ``position`` (a resume) restarts the index
        stream from there."""
        if self._loader is None:
            self._loader = DataLoader(
                _RowReader(self.dataset),
                batch_sampler=_Windows(self),
                collate_fn=_as_is,
                num_workers=self.num_workers,
                prefetch_factor=self.prefetch_factor,
                multiprocessing_context=self.multiprocessing_context,
                persistent_workers=True,
            )
        if self._ahead is None or self._ahead[0] != self.position:
            self._loader.batch_sampler.start = self.position
            self._ahead = (self.position, iter(self._loader))
        rows = next(self._ahead[1])
        self._ahead = (self.position + self.prompts_per_window, self._ahead[1])
        return rows

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            n = len(self.dataset)
            if self.shuffle:
                order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))
            else:
                order = torch.arange(n)
            self._order = (epoch, order)
        return self._order[1]


def read_rows(ds, indices: list[int]) -> list[dict]:
    """Rows by index: one batched read for a ``datasets.Dataset`` (column-wise), one per row for a list."""
    if not hasattr(ds, "column_names") or not indices:
        return [ds[i] for i in indices]
    columns = ds[indices]
    return [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]


class _RowReader(torch.utils.data.Dataset):
    """The dataset as the workers see it: one window's rows per fetch, read as ``read_rows`` reads them."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        return read_rows(self.dataset, [index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        return read_rows(self.dataset, list(indices))


class _Windows:
    """Batch sampler: window after window of row indices from the stream's position ``start`` (set before each
    iteration), computed in the training process; the workers only read the rows."""

    def __init__(self, stream: PromptStream) -> None:
        self.stream, self.start = stream, 0

    def __iter__(self) -> Iterator[list[int]]:
        return self.stream._window_indices(self.start)


def _as_is(rows: list[dict]) -> list[dict]:
    return rows

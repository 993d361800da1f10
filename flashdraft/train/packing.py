"""Packed rows for the trainer: whole documents concatenated up to a token budget.

The epoch plan is a pure function of (document lengths, row budget, seed, epoch), so the data
cursor of a run is just a position in the stream of rows: resuming, or resuming on another
world size, needs nothing but that number. Anchors are drawn per row from a generator seeded
by (seed, epoch, row), so they do not depend on which rank builds the row either.

Shape legend: T = row_tokens, A anchors, B block size.
"""

from __future__ import annotations

import bisect
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from flashdraft.train.blocks import block_labels, label_positions, sample_anchors

# Look this many pieces ahead when filling a row (best fit), to keep padding low without
# sorting the whole epoch (which would put all long documents together).
PACK_WINDOW = 256


@dataclass(frozen=True, slots=True)
class Piece:
    sample: int  # index in the dataset
    start: int  # first token of the piece within the sample
    length: int


@dataclass(slots=True)
class EpochPlan:
    rows: list[list[Piece]]
    documents: int = 0
    split: int = 0  # documents longer than a row, split into pieces
    truncated: int = 0
    dropped: int = 0
    tokens: int = 0  # real (non-padding) tokens in the rows


def plan_epoch(
    num_tokens: np.ndarray,
    row_tokens: int,
    seed: int,
    epoch: int,
    overlong: str = "split",
    shuffle: bool = True,
) -> EpochPlan:
    """Rows of one epoch: documents shuffled by (seed, epoch), best-fit within a window."""
    order = (
        np.random.default_rng([seed, epoch]).permutation(len(num_tokens))
        if shuffle
        else np.arange(len(num_tokens))
    )
    plan = EpochPlan(rows=[], documents=len(num_tokens))
    pieces: list[Piece] = []
    for sample in order.tolist():
        length = int(num_tokens[sample])
        if length <= row_tokens:
            pieces.append(Piece(sample, 0, length))
        elif overlong == "drop":
            plan.dropped += 1
        elif overlong == "truncate":
            plan.truncated += 1
            pieces.append(Piece(sample, 0, row_tokens))
        else:
            plan.split += 1
            pieces.extend(
                Piece(sample, s, min(row_tokens, length - s)) for s in range(0, length, row_tokens)
            )
    # The window is kept sorted by (length, -arrival) so the best fit (longest piece that
    # fits, earliest among equals) is one bisect away.
    window: list[tuple[int, int, Piece]] = []
    source = iter(enumerate(pieces))
    row: list[Piece] = []
    free = row_tokens
    while True:
        while len(window) < PACK_WINDOW:
            nxt = next(source, None)
            if nxt is None:
                break
            bisect.insort(window, (nxt[1].length, -nxt[0], nxt[1]))
        if not window:
            break
        best = bisect.bisect_right(window, (free, 1)) - 1
        if best < 0:  # nothing fits: close the row
            plan.rows.append(row)
            row, free = [], row_tokens
            continue
        piece = window.pop(best)[2]
        row.append(piece)
        free -= piece.length
        plan.tokens += piece.length
    if row:
        plan.rows.append(row)
    return plan


@dataclass(slots=True)
class Row:
    """One packed row on the CPU, ready to move to the device (all [T] unless noted)."""

    input_ids: Tensor
    position_ids: Tensor
    doc_ids: Tensor
    loss_mask: Tensor
    anchors: Tensor  # [A]
    anchor_valid: Tensor  # [A]
    label_positions: Tensor  # [A, B-1]
    normaliser_mask: Tensor  # [A, B] trained-slot mask (labels do not change it)
    epoch: int
    index: int  # row index within its epoch
    tokens: int  # real tokens


def row_seed(seed: int, epoch: int, index: int) -> int:
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1)[0])


def build_row(
    pieces: list[Piece],
    sample: Callable[[int], tuple[np.ndarray, np.ndarray]],
    row_tokens: int,
    num_anchors: int,
    block_size: int,
    seed: int,
    epoch: int,
    index: int,
    pad_id: int = 0,
) -> Row:
    ids = np.full(row_tokens, pad_id, dtype=np.int64)
    positions = np.zeros(row_tokens, dtype=np.int64)
    docs = np.full(row_tokens, -1, dtype=np.int64)
    mask = np.zeros(row_tokens, dtype=np.int64)
    at = 0
    for doc, piece in enumerate(pieces):
        tokens, loss_mask = sample(piece.sample)
        end = at + piece.length
        ids[at:end] = tokens[piece.start : piece.start + piece.length]
        mask[at:end] = loss_mask[piece.start : piece.start + piece.length]
        # A piece of a split document keeps its true positions (RoPE as at serving time).
        positions[at:end] = np.arange(piece.start, piece.start + piece.length)
        docs[at:end] = doc
        at = end
    if at < row_tokens:
        positions[at:] = np.arange(row_tokens - at)  # padding: harmless, masked everywhere
    input_ids, doc_ids, loss = torch.from_numpy(ids), torch.from_numpy(docs), torch.from_numpy(mask)
    gen = torch.Generator().manual_seed(row_seed(seed, epoch, index))
    anchors, valid = sample_anchors(loss, doc_ids, num_anchors, gen)
    _, trained = block_labels(
        torch.zeros(1, num_anchors, block_size - 1, dtype=torch.long),
        loss[None],
        doc_ids[None],
        anchors[None],
        valid[None],
        block_size,
    )
    return Row(
        input_ids=input_ids,
        position_ids=torch.from_numpy(positions),
        doc_ids=doc_ids,
        loss_mask=loss,
        anchors=anchors,
        anchor_valid=valid,
        label_positions=label_positions(anchors[None], block_size, row_tokens)[0],
        normaliser_mask=trained[0],
        epoch=epoch,
        index=index,
        tokens=at,
    )


class RowStream:
    """The run's stream of rows over all epochs; position p is the p-th row ever produced.

    Rank r of W takes, for each optimizer step, rows [p, p + W*G) with its own G = grad_accum
    rows at offset r*G. A background thread builds the rows this rank needs next.
    """

    def __init__(
        self,
        num_tokens: np.ndarray,
        sample: Callable[[int], tuple[np.ndarray, np.ndarray]],
        *,
        row_tokens: int,
        num_anchors: int,
        block_size: int,
        seed: int,
        epochs: int,
        overlong: str,
        shuffle: bool,
        pad_id: int = 0,
    ) -> None:
        self.num_tokens, self.sample = num_tokens, sample
        self.row_tokens, self.num_anchors, self.block_size = row_tokens, num_anchors, block_size
        self.seed, self.epochs, self.overlong, self.shuffle = seed, epochs, overlong, shuffle
        self.pad_id = pad_id
        # One epoch's plan is held at a time (it lists every piece of the epoch); the row
        # count of every epoch planned so far is kept, so locating a position never replans.
        # The lock: the prefetch thread and the training loop both ask.
        self._plan: tuple[int, EpochPlan] | None = None
        self._counts: dict[int, int] = {}
        self._lock = threading.Lock()

    def plan(self, epoch: int) -> EpochPlan:
        with self._lock:
            if self._plan is None or self._plan[0] != epoch:
                plan = plan_epoch(
                    self.num_tokens, self.row_tokens, self.seed, epoch, self.overlong, self.shuffle
                )
                self._plan = (epoch, plan)
                self._counts[epoch] = len(plan.rows)
            return self._plan[1]

    def rows_in(self, epoch: int) -> int:
        """Rows of an epoch (the shuffle changes the packing, so counts differ slightly)."""
        if epoch not in self._counts:
            self.plan(epoch)
        return self._counts[epoch]

    def total_rows(self) -> int:
        return sum(self.rows_in(e) for e in range(self.epochs))

    def locate(self, position: int) -> tuple[int, int]:
        """Stream position -> (epoch, row index within the epoch)."""
        for epoch in range(self.epochs):
            count = self.rows_in(epoch)
            if position < count:
                return epoch, position
            position -= count
        raise IndexError("position past the end of the run's data")

    def row(self, position: int) -> Row:
        epoch, index = self.locate(position)
        return build_row(
            self.plan(epoch).rows[index],
            self.sample,
            self.row_tokens,
            self.num_anchors,
            self.block_size,
            self.seed,
            epoch,
            index,
            self.pad_id,
        )

    def iterate(self, positions: Iterator[int], prefetch: int) -> Iterator[Row]:
        """Rows at `positions`, built `prefetch` ahead on a background thread (0: inline)."""
        if prefetch <= 0:
            for p in positions:
                yield self.row(p)
            return
        buffer: queue.Queue[Row | BaseException | None] = queue.Queue(maxsize=prefetch)
        stop = threading.Event()

        def work() -> None:
            try:
                for p in positions:
                    if stop.is_set():
                        return
                    buffer.put(self.row(p))
                buffer.put(None)
            except BaseException as err:  # surfaced in the consumer, never lost
                buffer.put(err)

        thread = threading.Thread(target=work, name="flashdraft-rows", daemon=True)
        thread.start()
        try:
            while True:
                item = buffer.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            while thread.is_alive():
                try:
                    buffer.get_nowait()
                except queue.Empty:
                    thread.join(timeout=0.05)

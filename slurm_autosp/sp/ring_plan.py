"""Which of a ring rank's queries attend to which keys of each visiting block, planned on the
host from the document boundaries and the sliding window: the ring's work and its traffic.

A ring rank holds chunks of every row laid end to end (`ring_layout`: the zigzag, or for packed
rows a deal of smaller chunks that balances the work). Against the block of another rank its
queries attend only to keys of their own document, no later than themselves and, with a window
of W tokens, less than W behind. So the plan cuts each pair of (query chunk, key chunk) by the
documents they share into pieces, each a query range over a key range with one rule: a chunk
over itself is causal, a chunk over an earlier one attends to all of it, a chunk over a later
one to none of it; under a window a piece keeps only the queries that reach a key and the keys
a query reaches, in query slices as document attention cuts them (`window_chunk`), so no piece
is wider than its window needs.

A piece is one sequence of flash attention's varlen kernel, its rule flash's window: keys j of
query i with i + (k_len - q_len) - left <= j <= i + (k_len - q_len) + right (aligned at the
ends; -1 unbounded). Pieces with the same rule run in one kernel call (a round) as long as no
query row repeats in it, since each piece's output is merged into the row's by its log-sum-exp.
A block no query of a rank attends to is not sent to it: `sources` lists the ring ranks whose
blocks a rank needs, which every rank can tell of every other (the boundaries are the same on
all), so sends and receives match without a word exchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from slurm_autosp.sp.document_attention import window_chunk
from slurm_autosp.sp.ring_layout import ChunkLayout, chunk_layout


@dataclass(frozen=True)
class Piece:
    """Queries [q_start, q_start + q_len) of local row `row` over keys [k_start, k_start +
    k_len) of the visiting block's row (offsets within a rank's local tokens), under flash's
    window (left, right), aligned at the ends: (-1, 0) causal, (-1, -1) every key."""

    row: int
    q_start: int
    q_len: int
    k_start: int
    k_len: int
    left: int = -1
    right: int = -1

    @property
    def rule(self) -> tuple[int, int]:
        return self.left, self.right

    def allowed_pairs(self) -> int:
        """How many (query, key) pairs the piece computes: its share of the ring's work."""
        aligned = torch.arange(self.q_len) + (self.k_len - self.q_len)
        low = (aligned - self.left).clamp(min=0) if self.left >= 0 else torch.zeros_like(aligned)
        high = (aligned + self.right).clamp(max=self.k_len - 1) if self.right >= 0 else None
        high = torch.full_like(aligned, self.k_len - 1) if high is None else high
        return int((high - low + 1).clamp(min=0).sum())


Index = slice | torch.Tensor  # a run of local tokens (read as a view), or the tokens gathered


class RoundTensors(NamedTuple):
    q_index: Index
    k_index: Index
    cu_q: torch.Tensor
    cu_k: torch.Tensor


@dataclass(frozen=True)
class Round:
    """Pieces run in one kernel call: one rule, no query row twice. The token indices are into
    the B x L local tokens laid end to end (row-major), a slice where they are one run;
    `cu_q`/`cu_k` the pieces' cumulative lengths, as the varlen kernel reads them."""

    pieces: tuple[Piece, ...]
    q_index: Index
    k_index: Index
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    # the tensors above copied to a device, by device: the first layer's call copies (a copy
    # from pageable host memory waits for the stream), every later one of the micro-batch reuses
    _on_device: dict[torch.device, RoundTensors] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def rule(self) -> tuple[int, int]:
        return self.pieces[0].rule

    def on(self, device: torch.device) -> RoundTensors:
        """The round's indices and cumulative lengths on `device`, copied there once."""
        if device not in self._on_device:
            q_index, k_index = (
                i if isinstance(i, slice) else i.to(device) for i in (self.q_index, self.k_index)
            )
            cu_q, cu_k = self.cu_q.to(device), self.cu_k.to(device)
            self._on_device[device] = RoundTensors(q_index, k_index, cu_q, cu_k)
        return self._on_device[device]


def _windowed(
    q_range: tuple[int, int], k_range: tuple[int, int], window: int
) -> Iterator[tuple[int, int, int, int, int, int]]:
    """(q_start, q_end, k_start, k_end, left, right) in global positions of the slices of queries
    `q_range` over keys `k_range` (no key after the last query) within a window: each query
    keeps keys q - W + 1 ... q, and every slice's queries reach at least one of its keys."""
    step = window_chunk(window)
    for q_start in range(q_range[0], q_range[1], step):
        k_end = min(k_range[1], q_start + step)
        q_end = min(q_start + step, q_range[1], k_end + window - 1)
        k_start = max(k_range[0], q_start - window + 1)
        if q_start >= q_end:
            return  # later slices are farther from the keys
        if k_start >= k_end:
            continue
        shift = q_end - k_end  # 0 .. W - 1: the last query's distance from the last key
        yield q_start, q_end, k_start, k_end, window - 1 - shift, shift


def _pair_pieces(
    row: int,
    q_range: tuple[int, int],
    k_range: tuple[int, int],
    offsets: tuple[int, int],
    window: int,
) -> Iterator[Piece]:
    """The pieces of queries `q_range` over keys `k_range` (global positions within one
    document, keys in the same chunk or an earlier one); `offsets` turn them into local ones."""
    diagonal = q_range == k_range
    q_off, k_off = offsets
    if window:
        for q0, q1, k0, k1, left, right in _windowed(q_range, k_range, window):
            yield Piece(row, q0 - q_off, q1 - q0, k0 - k_off, k1 - k0, left, right)
    else:
        length = q_range[1] - q_range[0]
        k_len = k_range[1] - k_range[0]
        right = 0 if diagonal else -1
        yield Piece(row, q_range[0] - q_off, length, k_range[0] - k_off, k_len, -1, right)


def step_pieces(
    ring_rank: int,
    source: int,
    layout: ChunkLayout,
    documents: tuple[tuple[int, int, int], ...],
    window: int,
) -> tuple[Piece, ...]:
    """What ring rank `ring_rank`'s queries compute against the block of ring rank `source`:
    `documents` are (row, start, end) in positions of the whole row."""
    chunk = layout.chunk
    q_slots = {c: slot for slot, c in enumerate(layout.held[ring_rank])}
    k_slots = {c: slot for slot, c in enumerate(layout.held[source])}
    pieces: list[Piece] = []
    for row, start, end in documents:
        spanned = range(start // chunk, (end - 1) // chunk + 1)
        for q_chunk in (c for c in spanned if c in q_slots):
            q_range = (max(start, q_chunk * chunk), min(end, (q_chunk + 1) * chunk))
            for k_chunk in (c for c in spanned if c in k_slots and c <= q_chunk):
                k_range = (max(start, k_chunk * chunk), min(end, (k_chunk + 1) * chunk))
                offsets = (q_chunk - q_slots[q_chunk]) * chunk, (k_chunk - k_slots[k_chunk]) * chunk
                pieces.extend(_pair_pieces(row, q_range, k_range, offsets, window))
    return tuple(_joined(pieces))


def _joined(pieces: list[Piece]) -> Iterator[Piece]:
    """Neighbouring pieces that attend to every key, made one: the same queries over adjacent
    keys, or adjacent queries over the same keys (a ring without documents then runs one
    sequence per row and block, as a plain ring would)."""
    held: Piece | None = None
    for piece in pieces:
        if held is not None and held.rule == piece.rule == (-1, -1) and held.row == piece.row:
            same_q = (held.q_start, held.q_len) == (piece.q_start, piece.q_len)
            if same_q and held.k_start + held.k_len == piece.k_start:
                held = Piece(
                    held.row, held.q_start, held.q_len, held.k_start, held.k_len + piece.k_len
                )
                continue
            same_k = (held.k_start, held.k_len) == (piece.k_start, piece.k_len)
            if same_k and held.q_start + held.q_len == piece.q_start:
                held = Piece(
                    held.row, held.q_start, held.q_len + piece.q_len, held.k_start, held.k_len
                )
                continue
        if held is not None:
            yield held
        held = piece
    if held is not None:
        yield held


def _index(spans: list[tuple[int, int]]) -> slice | torch.Tensor:
    """The tokens of `spans` (start, length) laid end to end: a slice where they are one run
    (the kernel then reads a view, nothing gathered), else their indices."""
    position = spans[0][0]
    for start, length in spans:
        if start != position:
            return torch.cat([torch.arange(start, start + length) for start, length in spans])
        position += length
    return slice(spans[0][0], position)


def _cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _rounds(pieces: tuple[Piece, ...], local: int) -> tuple[Round, ...]:
    """The kernel calls of one step: pieces grouped by rule, a row's queries at most once per
    call (a piece that repeats one starts the next call of its rule)."""
    calls: list[tuple[list[Piece], dict[int, list[tuple[int, int]]]]] = []
    for piece in pieces:
        span = (piece.q_start, piece.q_start + piece.q_len)
        for members, taken in calls:
            held = taken.setdefault(piece.row, [])
            if members[0].rule == piece.rule and all(e <= span[0] or span[1] <= s for s, e in held):
                members.append(piece)
                held.append(span)
                break
        else:
            calls.append(([piece], {piece.row: [span]}))
    rounds = []
    for members, _ in calls:
        q_spans = [(p.row * local + p.q_start, p.q_len) for p in members]
        k_spans = [(p.row * local + p.k_start, p.k_len) for p in members]
        rounds.append(
            Round(
                tuple(members),
                _index(q_spans),
                _index(k_spans),
                _cumulative([p.q_len for p in members]),
                _cumulative([p.k_len for p in members]),
                max(p.q_len for p in members),
                max(p.k_len for p in members),
            )
        )
    return tuple(rounds)


@dataclass(frozen=True)
class RingPlan:
    """The whole ring's plan: `rounds[i][j]` what ring rank i computes against ring rank j's
    block (empty: nothing, and the block is not sent to it)."""

    ring_size: int
    rounds: tuple[tuple[tuple[Round, ...], ...], ...]

    def sources(self, ring_rank: int) -> list[int]:
        """The ring steps (1 .. R-1) at which `ring_rank` receives a block: from ring rank
        (ring_rank - step) mod R, when it attends to any of it."""
        return [
            step
            for step in range(1, self.ring_size)
            if self.rounds[ring_rank][(ring_rank - step) % self.ring_size]
        ]

    def destinations(self, ring_rank: int) -> list[int]:
        """The ring steps at which `ring_rank` sends its block: to (ring_rank + step) mod R."""
        return [
            step
            for step in range(1, self.ring_size)
            if self.rounds[(ring_rank + step) % self.ring_size][ring_rank]
        ]

    def pairs(self, ring_rank: int) -> int:
        """The (query, key) pairs ring rank `ring_rank` computes in a whole ring pass."""
        return sum(
            piece.allowed_pairs()
            for rounds in self.rounds[ring_rank]
            for round_ in rounds
            for piece in round_.pieces
        )


@functools.lru_cache(maxsize=16)
def ring_plan(
    ring_size: int,
    local: int,
    documents: tuple[tuple[int, int, int], ...],
    window: int,
    packed: bool,
) -> RingPlan:
    """The plan of a ring of `ring_size` ranks each holding `local` tokens of each row, whose
    documents are (row, start, end) in positions of the whole row (every row's, in order),
    laid out as `ring_layout` lays out `packed` rows or whole ones; kept for the next layer and
    the backward, which ask for the same."""
    layout = chunk_layout(ring_size, local * ring_size, documents if packed else None)
    return RingPlan(
        ring_size,
        tuple(
            tuple(
                _rounds(step_pieces(rank, source, layout, documents, window), local)
                for source in range(ring_size)
            )
            for rank in range(ring_size)
        ),
    )

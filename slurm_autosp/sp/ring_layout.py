"""Which chunks of each row a ring rank holds: the split that gives every rank the same work.

Causal attention over one sequence costs a query as many keys as precede it, so the zigzag
split (2R chunks, ring rank i holding chunks i and 2R-1-i) gives every rank the same work.
Packed documents cut that triangle into one per document, and the zigzag no longer balances:
with documents of a median 2k tokens in 128k, the busiest of 8 ring ranks would do nearly twice
the mean's work. So rows with document boundaries are cut into 2R x `BALANCED_CHUNKS` chunks,
dealt out largest first to the rank with the least work so far that still has room (each rank
holds the same number, so every rank holds as many tokens): a chunk's work is its queries'
keys within their documents, summed over the rows. Both `prepare_sp_inputs` and ring attention
derive the layout from the same global boundaries, so they agree without a word exchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BALANCED_CHUNKS = 4  # chunks per zigzag chunk for packed rows: 8 a ring rank


@dataclass(frozen=True)
class ChunkLayout:
    """Ring rank i holds chunks `held[i]` (of `chunk` tokens, in order of position) of every
    row, laid end to end."""

    chunk: int
    held: tuple[tuple[int, ...], ...]

    def positions(self, ring_rank: int) -> torch.Tensor:
        """The positions of a row that ring rank `ring_rank` holds, in its order."""
        return torch.cat(
            [torch.arange(c * self.chunk, (c + 1) * self.chunk) for c in self.held[ring_rank]]
        )


def chunks_per_row(ring_size: int, packed: bool) -> int:
    """How many chunks a row is cut into: the padded length is a multiple of this times the
    Ulysses size."""
    return 2 * ring_size * (BALANCED_CHUNKS if packed else 1)


def _zigzag(ring_size: int, seq: int) -> ChunkLayout:
    return ChunkLayout(
        seq // (2 * ring_size),
        tuple((i, 2 * ring_size - 1 - i) for i in range(ring_size)),
    )


def _chunk_work(documents: tuple[tuple[int, int, int], ...], seq: int, count: int) -> list[int]:
    """Each chunk's causal query-key pairs within the documents, over all rows."""
    keys = torch.zeros(seq, dtype=torch.int64)
    for _, start, end in documents:
        keys[start:end] += torch.arange(1, end - start + 1)
    return keys.view(count, -1).sum(dim=1).tolist()


@functools.lru_cache(maxsize=16)
def chunk_layout(
    ring_size: int, seq: int, documents: tuple[tuple[int, int, int], ...] | None
) -> ChunkLayout:
    """The layout of rows of `seq` tokens (a multiple of `chunks_per_row`) over a ring:
    the zigzag without document boundaries, else the work-balanced deal of
    `BALANCED_CHUNKS` times as many chunks. `documents` are (row, start, end) of every row.
    Kept: the micro-batch's shards and its ring calls ask for the same one."""
    if documents is None:
        return _zigzag(ring_size, seq)
    count = chunks_per_row(ring_size, packed=True)
    if seq % count:
        raise ValueError(
            f"rows of {seq} tokens do not cut into {count} chunks: a ring of {ring_size} over "
            "packed rows needs them padded as prepare_sp_inputs(..., ring_size) pads them"
        )
    work = _chunk_work(documents, seq, count)
    room = count // ring_size
    load, held = [0] * ring_size, [list[int]() for _ in range(ring_size)]
    for index in sorted(range(count), key=lambda c: (-work[c], c)):
        rank = min((r for r in range(ring_size) if len(held[r]) < room), key=lambda r: (load[r], r))
        load[rank] += work[index]
        held[rank].append(index)
    return ChunkLayout(seq // count, tuple(tuple(sorted(chunks)) for chunks in held))

"""The packed rows `verify.documents=N` checks: N documents of uneven lengths, laid out where
sequence parallelism goes wrong if it mishandles boundaries: a document spanning a shard
boundary, one shorter than a shard, and a shard holding nothing but a document's tail (its
rank sees no document start, so its positions and attention come only from the global
boundaries)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from slurm_autosp.config import ConfigError
from slurm_autosp.verify.options import VerifyOptions, verify_seq_len


@dataclass(frozen=True)
class DocumentLayout:
    """Every row's documents, by length, over `sp_size` shards of the row (padded to a multiple
    of sp_size; the padding joins the last document)."""

    lengths: tuple[int, ...]
    sp_size: int

    @property
    def seq_len(self) -> int:
        return sum(self.lengths)

    @property
    def shard_len(self) -> int:
        return -(-self.seq_len // self.sp_size)

    @property
    def starts(self) -> list[int]:
        return [0, *accumulate(self.lengths)][:-1]

    def document_ids(self) -> torch.Tensor:
        """[S]: document i's tokens carry id i."""
        return torch.repeat_interleave(torch.arange(len(self.lengths)), torch.tensor(self.lengths))

    def spanning(self) -> list[int]:
        """Documents with tokens on both sides of a shard boundary."""
        return [
            i
            for i, (start, length) in enumerate(zip(self.starts, self.lengths, strict=True))
            if start // self.shard_len != (start + length - 1) // self.shard_len
        ]

    def shorter_than_shard(self) -> list[int]:
        return [i for i, length in enumerate(self.lengths) if length < self.shard_len]

    def tail_only_shards(self) -> list[int]:
        """Shards in which no document starts and whose document ends there: all they hold is
        the tail of a document begun on an earlier rank."""
        ends = [start + length for start, length in zip(self.starts, self.lengths, strict=True)]
        tails = []
        for shard in range(1, self.sp_size):
            first, last = shard * self.shard_len, (shard + 1) * self.shard_len
            begun = [i for i, start in enumerate(self.starts) if start < first]
            if first < self.seq_len and not any(first <= s < last for s in self.starts):
                if ends[begun[-1]] <= last:
                    tails.append(shard)
        return tails

    def describe(self) -> str:
        spanning, short, tails = self.spanning(), self.shorter_than_shard(), self.tail_only_shards()
        lengths = ", ".join(str(n) for n in self.lengths)
        return (
            f"{len(self.lengths)} documents per row (document_ids), lengths {lengths}; "
            f"spanning a shard boundary: document {', '.join(map(str, spanning))}; shorter than "
            f"a shard: document {', '.join(map(str, short))}; holding only a document's tail: "
            f"shard {', '.join(map(str, tails))}"
        )


def choose_layout(seq_len: int, sp_size: int, documents: int) -> DocumentLayout:
    """N documents over one row of `seq_len` tokens: the last starts half a shard before the
    last shard boundary and runs to the end (it spans the boundary, and the last shard holds
    only its tail); the others share the tokens before it with lengths growing 1 : 2 : ... : N-1,
    the first shorter than a shard. Refused, naming verify.documents, where that cannot be had."""
    key = f"verify.documents={documents}"
    if documents > seq_len:
        raise ConfigError(f"{key} is more documents than the row's {seq_len} tokens")
    if documents < 2 or sp_size < 2:
        raise ConfigError(
            f"{key} with parallel.sp_size={sp_size}: packed rows need 2 or more documents over 2 "
            "or more shards (verify.documents=0 checks one sequence per row)"
        )
    shard = -(-seq_len // sp_size)
    weights = documents * (documents - 1) // 2
    before_last = min((sp_size - 1) * shard - shard // 2, weights * (shard - 1))
    spare = before_last - (documents - 1)
    if spare < 0:
        raise ConfigError(
            f"{key}: {seq_len} tokens over {sp_size} shards of {shard} leave {before_last} tokens "
            f"before the document that ends the row, too few for {documents - 1} more; pass fewer "
            "documents or a longer verify.seq_len"
        )
    lengths = [1 + spare * w // weights for w in range(1, documents)]
    lengths[-1] += before_last - sum(lengths)
    layout = DocumentLayout((*lengths, seq_len - before_last), sp_size)
    missing = [
        what
        for what, found in (
            ("a document spanning a shard boundary", layout.spanning()),
            ("a document shorter than a shard", layout.shorter_than_shard()),
            ("a shard holding only a document's tail", layout.tail_only_shards()),
            ("uneven lengths", len(set(layout.lengths)) > 1),
        )
        if not found
    ]
    if missing:
        raise ConfigError(
            f"{key}: {seq_len} tokens over {sp_size} shards of {shard} cannot hold "
            f"{' or '.join(missing)}; pass a longer verify.seq_len"
        )
    return layout


def verify_layout(sp_size: int, options: VerifyOptions) -> DocumentLayout | None:
    """The packed rows `verify.documents` asks for; None for one sequence per row. Under a ring
    the shard boundaries are rank boundaries as well (each zigzag chunk splits over the
    Ulysses ranks at them), so the same layout checks the ring's."""
    if not options.documents:
        return None
    return choose_layout(verify_seq_len(sp_size, options), sp_size, options.documents)

"""Training samples addressed by a global sample index, so a checkpoint can record where it was.

Sample `i` is the same tensor on every run, rank count and restart: the data position of a
run is just the number of samples consumed (`step * global_batch`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from slurm_autosp.config import ConfigError, DataConfig, DataSource, DocumentBoundaries, JobConfig
from slurm_autosp.data.prepared import (
    TOKENIZER_DIR,
    SplitFiles,
    contents_identity,
    is_prepared,
    read_summary,
    recorded_tokenizer,
    tokenizer_file_paths,
    tokenizer_hash,
)
from slurm_autosp.data.token_file import read_token_file
from slurm_autosp.sp.inputs import IGNORE_INDEX


@dataclass(frozen=True)
class Sample:
    """One training sequence; `labels` hold IGNORE_INDEX where it is not trained on (chat data:
    everything but the assistant's tokens), None where every token is. `document_ids` (masked
    documents only) number the documents the sample cuts from the file 0, 1, 2, ... per token."""

    input_ids: torch.Tensor  # [seq_len] int64
    labels: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None


class SampleSource(Protocol):
    def sample(self, index: int) -> Sample:
        """Global sample `index`."""
        ...


@dataclass(frozen=True)
class _Cycles:
    """A permutation as its cycles, so that stepping k times along it from any element is a
    few array lookups, whatever k: synthetic samples are built without a loop per token."""

    order: np.ndarray  # the elements cycle by cycle, each cycle in successor order
    start: np.ndarray  # per element: where its cycle begins in `order`
    length: np.ndarray  # per element: the length of its cycle
    position: np.ndarray  # per element: its place in its cycle

    @classmethod
    def of(cls, successor: np.ndarray) -> _Cycles:
        """By pointer doubling (log2(n) array passes): each element's cycle is named by its
        smallest element, and its place is its distance from there."""
        n = len(successor)
        elements = np.arange(n)
        rounds = max(1, (n - 1).bit_length()) + 1
        label, jump = elements, successor
        for _ in range(rounds):
            label, jump = np.minimum(label, label[jump]), jump[jump]
        leader = label == elements
        ahead, to_leader = np.where(leader, elements, successor), np.where(leader, 0, 1)
        for _ in range(rounds):
            to_leader, ahead = to_leader + to_leader[ahead], ahead[ahead]
        length = to_leader[successor[label]] + 1
        position = (length - to_leader) % length
        order = np.argsort(label * n + position)
        where = np.empty(n, dtype=np.int64)
        where[order] = elements
        return cls(order=order, start=where[label], length=length, position=position)

    def advance(self, elements: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """successor applied `steps` times to each of `elements`."""
        place = (self.position[elements] + steps) % self.length[elements]
        return self.order[self.start[elements] + place]


@dataclass(frozen=True)
class SyntheticSource:
    """A learnable stream: each token follows a fixed random successor table, with 10% noise.

    A model that learns the table drives the loss from ln(vocab) towards the noise floor,
    so a falling loss means training works.
    """

    vocab_size: int
    seq_len: int
    seed: int = 0
    noise: float = 0.1

    @functools.cached_property
    def successor(self) -> np.ndarray:
        return np.random.default_rng(self.seed).permutation(self.vocab_size)

    @functools.cached_property
    def _cycles(self) -> _Cycles:
        return _Cycles.of(self.successor)

    def sample(self, index: int) -> Sample:
        """Token t is random where the stream jumps (and at t = 0), else the successor of
        token t-1: the successor applied (t - last jump) times to the token drawn there."""
        rng = np.random.default_rng((self.seed, index))
        jumps = rng.random(self.seq_len) < self.noise
        random_tokens = rng.integers(0, self.vocab_size, self.seq_len)
        t = np.arange(self.seq_len)
        last_jump = np.maximum.accumulate(np.where(jumps, t, 0))
        tokens = self._cycles.advance(random_tokens[last_jump], t - last_jump)
        return Sample(torch.from_numpy(tokens.astype(np.int64)))


class TokenFileSource:
    """Samples packed from a memory-mapped token file: documents joined by EOS, cut every
    `seq_len` tokens; past the end it wraps around (the next epoch). With a loss mask (chat
    data), tokens outside it are not trained on. With the documents' end offsets, each sample
    carries the document id of each token (a document cut by the sample's start is a document
    of its own there, from position 0)."""

    def __init__(
        self,
        path: str | Path,
        seq_len: int,
        vocab_size: int | None = None,
        loss_mask_path: Path | None = None,
        document_ends_path: Path | None = None,
    ):
        self.path = Path(path)
        header_vocab, self.tokens = read_token_file(self.path)
        if vocab_size is not None and header_vocab > vocab_size:
            raise ValueError(
                f"{self.path}: tokens use a vocabulary of {header_vocab} but model.vocab_size="
                f"{vocab_size}; train a model with vocab_size >= {header_vocab}"
            )
        self.loss_mask = None if loss_mask_path is None else np.load(loss_mask_path, mmap_mode="r")
        if self.loss_mask is not None and len(self.loss_mask) != len(self.tokens):
            raise ValueError(
                f"{loss_mask_path}: {len(self.loss_mask)} mask entries for {len(self.tokens)} "
                f"tokens in {self.path}; prepare the dataset again"
            )
        self.document_ends = None
        if document_ends_path is not None:
            self.document_ends = np.load(document_ends_path, mmap_mode="r")
            if not len(self.document_ends) or int(self.document_ends[-1]) != len(self.tokens):
                raise ValueError(
                    f"{document_ends_path}: its last document end is not the {len(self.tokens)} "
                    f"tokens of {self.path}; prepare the dataset again"
                )
        self.seq_len = seq_len
        self.num_samples = len(self.tokens) // seq_len
        if self.num_samples == 0:
            raise ValueError(
                f"{self.path}: {len(self.tokens)} tokens is less than one sample of "
                f"data.seq_len={seq_len}"
            )

    def sample(self, index: int) -> Sample:
        start = (index % self.num_samples) * self.seq_len
        span = slice(start, start + self.seq_len)
        input_ids = torch.from_numpy(self.tokens[span].astype(np.int64))
        labels = None
        if self.loss_mask is not None:
            trained = torch.from_numpy(self.loss_mask[span].astype(bool))
            labels = input_ids.masked_fill(~trained, IGNORE_INDEX)
        return Sample(input_ids, labels, self._document_ids(start))

    def _document_ids(self, start: int) -> torch.Tensor | None:
        """Per token of the sample at `start`: how many documents end within the sample before it."""
        if self.document_ends is None:
            return None
        ends = self.document_ends
        first, last = np.searchsorted(ends, [start, start + self.seq_len - 1], side="right")
        inside = np.asarray(ends[first:last], dtype=np.int64) - start
        return torch.from_numpy(np.searchsorted(inside, np.arange(self.seq_len), side="right"))


class ShuffledSource:
    """`inner`'s samples in a fresh order each epoch. The order is a function of the seed and
    the global sample index alone, so a resumed run, or one on another world size, reads the
    same sequence of samples."""

    def __init__(self, inner: TokenFileSource, seed: int):
        self.inner, self.seed, self.num_samples = inner, seed, inner.num_samples
        self._epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def order(self, epoch: int) -> np.ndarray:
        """The inner sample read at each position of `epoch` (kept for the current epoch)."""
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng((self.seed, epoch)).permutation(self.num_samples)
        return self._order

    def sample(self, index: int) -> Sample:
        epoch, position = divmod(index, self.num_samples)
        return self.inner.sample(int(self.order(epoch)[position]))


class BlendedSource:
    """Several sources mixed by weight. Every block of `block` samples holds each source's share
    of it (largest remainder), in an order seeded per block: sample i is a function of i alone,
    as the training position requires, and each source is read in its own order, unrepeated
    until it wraps."""

    def __init__(self, sources: list[SampleSource], weights: list[float], seed: int, block: int = 1000):  # fmt: skip
        share = np.asarray(weights, dtype=np.float64) / sum(weights) * block
        counts = np.floor(share).astype(np.int64)
        remainder_order = np.argsort(-(share - counts), kind="stable")
        counts[remainder_order[: block - int(counts.sum())]] += 1
        if (counts == 0).any():
            raise ValueError(
                f"data.blend weights {weights}: each must be at least 1/{block} of their sum"
            )
        self.sources, self.counts, self.seed, self.block = sources, counts, seed, block
        self._block_index, self._which, self._rank = -1, counts, counts

    def _layout(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Per position of `block`: the source it reads and its rank among that source's."""
        if block != self._block_index:
            labels = np.repeat(np.arange(len(self.counts)), self.counts)
            which = np.random.default_rng((self.seed, 1, block)).permutation(labels)
            rank = np.empty(self.block, dtype=np.int64)
            for source, count in enumerate(self.counts):
                rank[which == source] = np.arange(count)
            self._block_index, self._which, self._rank = block, which, rank
        return self._which, self._rank

    def sample(self, index: int) -> Sample:
        block, position = divmod(index, self.block)
        which, rank = self._layout(block)
        source = int(which[position])
        return self.sources[source].sample(block * int(self.counts[source]) + int(rank[position]))


def open_tokens(
    path: str | Path,
    seq_len: int,
    vocab_size: int | None,
    split: str = "train",
    documents: DocumentBoundaries = DocumentBoundaries.concat,
) -> TokenFileSource:
    """A token file, or a split of a prepared dataset (its loss mask included, and its document
    ends when `documents` is masked)."""
    path = Path(path)
    masked = documents is DocumentBoundaries.masked
    if not is_prepared(path):
        if masked:
            raise ValueError(
                f"{path}: a bare token file records no document ends, which data.documents=masked "
                "needs; train on a directory written by `python -m slurm_autosp data prepare`"
            )
        return TokenFileSource(path, seq_len, vocab_size)
    chat = read_summary(path).get("format") == "chat"
    files = SplitFiles.of(path, split)
    if split != "train" and not files.tokens.exists():
        raise ValueError(f"{path}: no {split} split (prepare with --eval-fraction > 0)")
    _require(files.tokens, f"the {split} split's tokens")
    if chat:
        _require(files.loss_mask, "which tokens of the chat data are trained on")
    if masked:
        _require(files.documents, "where each document ends, which data.documents=masked reads")
    mask = files.loss_mask if files.loss_mask.exists() else None
    return TokenFileSource(
        files.tokens, seq_len, vocab_size, mask, files.documents if masked else None
    )


def _require(path: Path, holding: str) -> None:
    """A file a prepared dataset wrote, gone since (copied in part, or removed by hand)."""
    if not path.exists():
        raise ValueError(
            f"{path.parent}: {path.name} ({holding}) is missing; prepare the dataset again with "
            "`python -m slurm_autosp data prepare`"
        )


def eval_data_path(cfg: JobConfig) -> tuple[str, str] | None:
    """(path, split) of the held-out data: data.eval_path (a prepared directory's eval split,
    its train split when it has none, or a token file), else data.path's eval split when it is
    a prepared directory that has one; None: the run has no held-out data, or evaluates none
    (train.eval_samples=0)."""
    if cfg.train.eval_samples == 0:
        return None
    path = cfg.data.eval_path
    if path is None and cfg.data.source is DataSource.tokens and cfg.data.path:
        path = cfg.data.path if SplitFiles.of(Path(cfg.data.path), "eval").tokens.exists() else None
    if path is None:
        return None
    has_eval = is_prepared(path) and SplitFiles.of(Path(path), "eval").tokens.exists()
    return path, "eval" if has_eval else "train"


def open_eval_source(cfg: JobConfig, vocab_size: int | None) -> TokenFileSource | None:
    """The held-out samples, in file order (never shuffled: every evaluation reads the same)."""
    located = eval_data_path(cfg)
    if located is None:
        return None
    path, split = located
    vocab_size = vocab_size or cfg.model.vocab_size
    return open_tokens(path, cfg.data.seq_len, vocab_size, split, cfg.data.documents)


def token_paths(data: DataConfig) -> list[str]:
    """The token files or prepared directories a job reads (data.blend's, or data.path)."""
    if data.source is not DataSource.tokens:
        return []
    return list(data.blend) or ([] if data.path is None else [data.path])


def data_identity(data: DataConfig) -> dict[str, str | None]:
    """What the training data is, beyond its paths: the contents of every file read
    (`data.contents`) and the tokenizer they were prepared with (`data.tokenizer`); None for
    synthetic data. A checkpoint records them, so that data prepared again at the same path
    does not resume silently on other tokens."""
    paths = [Path(p) for p in token_paths(data)]
    if not paths:
        return {"data.contents": None, "data.tokenizer": None}
    tokenizers = {t for t in map(recorded_tokenizer, paths) if t is not None}
    return {
        "data.contents": ",".join(contents_identity(p) for p in paths),
        "data.tokenizer": ",".join(sorted(tokenizers)) or None,
    }


def prepared_tokenizer(data: DataConfig) -> Path | None:
    """The tokenizer prepared data was made with (None for bare token files); check_token_file
    has made sure blended datasets share it."""
    directories = [Path(p) / TOKENIZER_DIR for p in token_paths(data)]
    return next((d for d in directories if d.is_dir()), None)


def check_token_file(cfg: JobConfig, model_vocab_size: int | None) -> None:
    """Before any rank starts: the token data reads, holds a sample, fits the vocabulary of the
    model actually trained (a pretrained checkpoint's, not the config's field), and was made
    with the pretrained model's tokenizer when that model ships one."""
    key = "data.blend: " if cfg.data.blend else "data.path="
    for path in token_paths(cfg.data):
        try:
            open_tokens(path, cfg.data.seq_len, model_vocab_size, documents=cfg.data.documents)
        except (OSError, ValueError) as err:
            raise ConfigError(f"{key}{path}: {err}") from err
    try:
        build_source(cfg, model_vocab_size)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    eval_key = f"data.eval_path={cfg.data.eval_path}" if cfg.data.eval_path else "data.path"
    try:
        open_eval_source(cfg, model_vocab_size)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{eval_key} (held-out data): {err}; or turn evaluation off with train.eval_samples=0"
        ) from err
    tokenizers = {
        p: tokenizer_hash(Path(p) / TOKENIZER_DIR)
        for p in token_paths(cfg.data)
        if (Path(p) / TOKENIZER_DIR).is_dir()
    }
    if len(set(tokenizers.values())) > 1:
        raise ConfigError(
            f"data.blend: {', '.join(tokenizers)} were prepared with different tokenizers; "
            "prepare them all with the tokenizer of the model trained"
        )
    pretrained = cfg.model.pretrained_path
    if not tokenizers or pretrained is None or not tokenizer_file_paths(Path(pretrained)):
        return
    if tokenizer_hash(Path(pretrained)) not in tokenizers.values():
        raise ConfigError(
            f"{key}{next(iter(tokenizers))} was prepared with another tokenizer than "
            f"model.pretrained_path={pretrained} ships (their tokenizer files differ); prepare "
            f"it with --tokenizer {pretrained}"
        )


def build_source(cfg: JobConfig, model_vocab_size: int | None = None) -> SampleSource:
    """`model_vocab_size`: the trained model's vocabulary, when it is not the config's field."""
    if cfg.data.source is DataSource.tokens:
        vocab_size = model_vocab_size or cfg.model.vocab_size
        sources: list[SampleSource] = []
        for path in token_paths(cfg.data):
            tokens = open_tokens(path, cfg.data.seq_len, vocab_size, documents=cfg.data.documents)
            sources.append(ShuffledSource(tokens, cfg.train.seed) if cfg.data.shuffle else tokens)
        if not cfg.data.blend:
            return sources[0]
        return BlendedSource(sources, list(cfg.data.blend.values()), cfg.train.seed)
    assert cfg.model.vocab_size is not None
    return SyntheticSource(cfg.model.vocab_size, cfg.data.seq_len, cfg.train.seed)


@dataclass(frozen=True)
class MicroBatch:
    input_ids: torch.Tensor  # [micro_batch, seq_len]
    labels: torch.Tensor | None  # the same shape, IGNORE_INDEX where not trained on; None: all
    document_ids: torch.Tensor | None = None  # the same shape (data.documents=masked)


def micro_batch(
    source: SampleSource, cfg: JobConfig, step: int, micro_step: int, dp_rank: int
) -> MicroBatch:
    """The samples `dp_rank` trains on at this step and micro-step."""
    t = cfg.train
    first = step * cfg.global_batch + (micro_step * cfg.dp_size + dp_rank) * t.micro_batch
    samples = [source.sample(first + i) for i in range(t.micro_batch)]
    input_ids = torch.stack([s.input_ids for s in samples])
    documents = [s.document_ids for s in samples if s.document_ids is not None]
    document_ids = torch.stack(documents) if documents else None
    if all(s.labels is None for s in samples):
        return MicroBatch(input_ids, None, document_ids)
    labels = [s.input_ids if s.labels is None else s.labels for s in samples]
    return MicroBatch(input_ids, torch.stack(labels), document_ids)

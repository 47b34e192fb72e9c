"""Training samples addressed by a global sample index, so a checkpoint can record where it was.

Sample `i` is the same tensor on every run, rank count and restart: the data position of a
run is just the number of samples consumed (`step * global_batch`).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from slurm_autosp.config import ConfigError, DataSource, JobConfig

TOKEN_FILE_MAGIC = b"SATOKENS"
_HEADER = struct.Struct("<8s8sQQ")  # magic, dtype name, vocab size, token count


class SampleSource(Protocol):
    def sample(self, index: int) -> torch.Tensor:
        """Token ids [seq_len] (int64) of global sample `index`."""
        ...


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

    def sample(self, index: int) -> torch.Tensor:
        successor = self.successor
        rng = np.random.default_rng((self.seed, index))
        jumps = rng.random(self.seq_len) < self.noise
        random_tokens = rng.integers(0, self.vocab_size, self.seq_len)
        tokens = np.empty(self.seq_len, dtype=np.int64)
        tokens[0] = random_tokens[0]
        for t in range(1, self.seq_len):
            tokens[t] = random_tokens[t] if jumps[t] else successor[tokens[t - 1]]
        return torch.from_numpy(tokens)


class TokenFileSource:
    """Samples packed from a memory-mapped token file: documents joined by EOS, cut every
    `seq_len` tokens; past the end it wraps around (the next epoch)."""

    def __init__(self, path: str | Path, seq_len: int, vocab_size: int | None = None):
        self.path = Path(path)
        header_vocab, self.tokens = read_token_file(self.path)
        if vocab_size is not None and header_vocab > vocab_size:
            raise ValueError(
                f"{self.path}: tokens use a vocabulary of {header_vocab} but model.vocab_size="
                f"{vocab_size}; train a model with vocab_size >= {header_vocab}"
            )
        self.seq_len = seq_len
        self.num_samples = len(self.tokens) // seq_len
        if self.num_samples == 0:
            raise ValueError(
                f"{self.path}: {len(self.tokens)} tokens is less than one sample of "
                f"data.seq_len={seq_len}"
            )

    def sample(self, index: int) -> torch.Tensor:
        start = (index % self.num_samples) * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len].astype(np.int64))


def write_token_file(path: str | Path, tokens: np.ndarray, vocab_size: int) -> None:
    """Write token ids as uint32 (a 128k vocabulary does not fit uint16) behind a header."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(
            f"token ids must lie in [0, {vocab_size}); got [{tokens.min()}, {tokens.max()}]"
        )
    with open(path, "wb") as f:
        f.write(_HEADER.pack(TOKEN_FILE_MAGIC, b"uint32".ljust(8, b"\0"), vocab_size, tokens.size))
        f.write(tokens.astype("<u4").tobytes())


def read_token_file(path: Path) -> tuple[int, np.ndarray]:
    """The vocabulary size and a read-only memory map of the token ids."""
    with open(path, "rb") as f:
        raw = f.read(_HEADER.size)
    if len(raw) < _HEADER.size or raw[:8] != TOKEN_FILE_MAGIC:
        raise ValueError(
            f"{path}: not a token file (write one with slurm_autosp.data.write_token_file)"
        )
    _, dtype, vocab_size, count = _HEADER.unpack(raw)
    dtype_name = dtype.rstrip(b"\0").decode()
    if dtype_name != "uint32":
        raise ValueError(f"{path}: unsupported token dtype {dtype_name!r}; expected uint32")
    expected, actual = _HEADER.size + 4 * count, Path(path).stat().st_size
    if actual < expected:
        raise ValueError(
            f"{path}: truncated: its header promises {count} tokens ({expected} bytes) but the file has "
            f"{actual} bytes; write it again (an interrupted copy?)"
        )
    tokens = np.memmap(path, dtype="<u4", mode="r", offset=_HEADER.size, shape=(count,))
    return vocab_size, tokens


def check_token_file(cfg: JobConfig, model_vocab_size: int | None) -> None:
    """Before any rank starts: the token file reads, holds a sample, and fits the vocabulary of
    the model actually trained (a pretrained checkpoint's, not the config's field)."""
    if cfg.data.source is not DataSource.tokens or cfg.data.path is None:
        return
    try:
        TokenFileSource(cfg.data.path, cfg.data.seq_len, model_vocab_size)
    except (OSError, ValueError) as err:
        raise ConfigError(f"data.path={cfg.data.path}: {err}") from err


def build_source(cfg: JobConfig, model_vocab_size: int | None = None) -> SampleSource:
    """`model_vocab_size`: the trained model's vocabulary, when it is not the config's field."""
    if cfg.data.source is DataSource.tokens:
        assert cfg.data.path is not None
        return TokenFileSource(
            cfg.data.path, cfg.data.seq_len, model_vocab_size or cfg.model.vocab_size
        )
    assert cfg.model.vocab_size is not None
    return SyntheticSource(cfg.model.vocab_size, cfg.data.seq_len, cfg.train.seed)


def micro_batch(
    source: SampleSource, cfg: JobConfig, step: int, micro_step: int, dp_rank: int
) -> torch.Tensor:
    """Token ids [micro_batch, seq_len] that `dp_rank` trains on at this step and micro-step."""
    t = cfg.train
    first = step * cfg.global_batch + (micro_step * cfg.dp_size + dp_rank) * t.micro_batch
    return torch.stack([source.sample(first + i) for i in range(t.micro_batch)])

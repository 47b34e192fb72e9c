"""The token file: uint32 ids behind a header naming the dtype, vocabulary and token count.

uint32, because a 128k vocabulary does not fit uint16. The count in the header lets a reader
tell a complete file from a truncated copy.
"""

from __future__ import annotations

import struct
from pathlib import Path
from types import TracebackType

import numpy as np

TOKEN_FILE_MAGIC = b"SATOKENS"
_HEADER = struct.Struct("<8s8sQQ")  # magic, dtype name, vocab size, token count
_DTYPE = b"uint32".ljust(8, b"\0")


class TokenFileWriter:
    """Appends token ids chunk by chunk (a corpus need not fit in memory); the header's count
    is written when the writer closes, so an unclosed file reads as truncated, never as whole."""

    def __init__(self, path: str | Path, vocab_size: int):
        self.path, self.vocab_size, self.count = Path(path), vocab_size, 0
        self._file = open(self.path, "wb")
        self._file.write(_HEADER.pack(TOKEN_FILE_MAGIC, _DTYPE, vocab_size, 2**64 - 1))

    def append(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.vocab_size}); got [{tokens.min()}, {tokens.max()}]"
            )
        self._file.write(tokens.astype("<u4").tobytes())
        self.count += tokens.size

    def close(self) -> None:
        self._file.seek(0)
        self._file.write(_HEADER.pack(TOKEN_FILE_MAGIC, _DTYPE, self.vocab_size, self.count))
        self._file.close()

    def __enter__(self) -> TokenFileWriter:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if kind is None:
            self.close()
        else:
            self._file.close()


def write_token_file(path: str | Path, tokens: np.ndarray, vocab_size: int) -> None:
    """Write token ids (each in [0, vocab_size)) as one token file."""
    with TokenFileWriter(path, vocab_size) as writer:
        writer.append(tokens)


def read_token_file(path: Path) -> tuple[int, np.ndarray]:
    """The vocabulary size and a read-only memory map of the token ids."""
    with open(path, "rb") as f:
        raw = f.read(_HEADER.size)
    if len(raw) < _HEADER.size or raw[:8] != TOKEN_FILE_MAGIC:
        raise ValueError(
            f"{path}: not a token file (write one with slurm_autosp.data.write_token_file "
            "or `python -m slurm_autosp data prepare`)"
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

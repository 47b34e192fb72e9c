"""A prepared dataset: what `python -m slurm_autosp data prepare` writes, one directory.

    summary.json          documents, tokens, vocabulary, tokenizer (name, hash), skipped rows
                          (and the first of each kind), EOS and the end-of-turn token
    train.tokens          token file (documents joined, each ending in EOS)
    train.documents.npy   uint64 end offset of each document in train.tokens
    train.loss_mask.npy   uint8 per token, 1 where trained on (chat data only)
    eval.*                the held-out split, the same files
    tokenizer/            the tokenizer's files, to load it and to copy beside the export

summary.json is written last, so a directory without it is not a prepared dataset.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUMMARY = "summary.json"
_EDGE_BYTES = 2**20  # a token file's identity hashes its first and last MiB, and its size
TOKENIZER_DIR = "tokenizer"
SPLITS = ("train", "eval")
# the files a Hugging Face tokenizer is saved as (any of them; none is a model weight)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)


@dataclass(frozen=True)
class SplitFiles:
    tokens: Path
    documents: Path
    loss_mask: Path

    @classmethod
    def of(cls, root: Path, split: str) -> SplitFiles:
        return cls(
            tokens=root / f"{split}.tokens",
            documents=root / f"{split}.documents.npy",
            loss_mask=root / f"{split}.loss_mask.npy",
        )


def is_prepared(path: str | Path) -> bool:
    return Path(path).is_dir()


def read_summary(root: Path) -> dict[str, Any]:
    """The summary of a complete prepared dataset; a directory without one is refused."""
    try:
        summary: dict[str, Any] = json.loads((root / SUMMARY).read_text())
    except FileNotFoundError as err:
        raise ValueError(
            f"{root}: a directory without {SUMMARY} is not a prepared dataset (an interrupted "
            "prepare?); write one with `python -m slurm_autosp data prepare`"
        ) from err
    return summary


def stop_token_ids(tokenizer_dir: Path) -> list[int]:
    """The tokens generation stops at, for a model trained on the prepared dataset whose
    tokenizer is `tokenizer_dir`: its end of turn (chat: the token that ends a reply, e.g.
    <|im_end|>, see `chat.end_of_turn_stop`; text: EOS), then EOS. A summary written before
    the end of turn was recorded gives EOS."""
    summary = read_summary(tokenizer_dir.parent)
    eos = summary["eos_token_id"]
    return list(dict.fromkeys([summary.get("end_of_turn_token_id", eos), eos]))


def tokenizer_file_paths(directory: Path) -> list[Path]:
    return [directory / name for name in TOKENIZER_FILES if (directory / name).is_file()]


def tokenizer_hash(directory: Path) -> str:
    """sha256 over the tokenizer files of `directory` (names and bytes): two datasets, or a
    dataset and a model, share a tokenizer when their hashes agree."""
    digest = hashlib.sha256()
    for path in tokenizer_file_paths(directory):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def contents_identity(path: Path) -> str:
    """A cheap fingerprint of what a token file, or a prepared directory's training split and
    summary, hold: each file's name, size, and first and last MiB. Preparing again at the same
    path (another corpus, another tokenizer, another seed) changes it; reading does not."""
    files = [path]
    if is_prepared(path):
        train = SplitFiles.of(path, "train")
        files = [
            path / SUMMARY,
            *(f for f in (train.tokens, train.documents, train.loss_mask) if f.exists()),
        ]
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            digest.update(f.read(_EDGE_BYTES))
            if size > 2 * _EDGE_BYTES:
                f.seek(size - _EDGE_BYTES)
            digest.update(f.read(_EDGE_BYTES))
    return digest.hexdigest()[:16]


def recorded_tokenizer(path: Path) -> str | None:
    """The hash of the tokenizer a prepared directory was made with (None: a bare token file)."""
    if not is_prepared(path):
        return None
    tokenizer = read_summary(path).get("tokenizer")
    return tokenizer.get("sha256") if isinstance(tokenizer, dict) else None

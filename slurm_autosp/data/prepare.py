"""Text to a prepared dataset: rows read and tokenized by Hugging Face `datasets` (in parallel
over workers) with a local tokenizer, written as token files with a document index, a loss
mask for chat data, the tokenizer's files and a summary (see `prepared.py`).

The output is a function of the input alone (same input, same bytes) and appears whole or
not at all: it is written to a hidden sibling directory that is renamed into place last, by
one prepare at a time (`output_lock.py`).
"""

from __future__ import annotations

import codecs
import enum
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from glob import glob
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from slurm_autosp.data.chat import (
    MARKERS_FIX,
    Messages,
    TemplateRejected,
    Unmaskable,
    encode_with_markers,
    end_of_turn_stop,
    end_of_turn_token,
    render,
    trained_tokens,
    unusable_end_of_turn,
    uses_generation_markers,
)
from slurm_autosp.data.chat_replies import reply_spans
from slurm_autosp.data.json_lines import MarkedLines, mark_unparseable
from slurm_autosp.data.output_lock import OutputBusy, output_lock
from slurm_autosp.data.prepared import (
    SUMMARY,
    TOKENIZER_DIR,
    SplitFiles,
    tokenizer_file_paths,
    tokenizer_hash,
)
from slurm_autosp.data.token_file import TokenFileWriter
from slurm_autosp.data.workers import children_die_with_this_process
from slurm_autosp.lifecycle.durable import rename_durably

log = logging.getLogger(__name__)

# Undecodable bytes become U+FFFF, a noncharacter no text carries, so a row holding one is
# counted as non-UTF-8 and skipped instead of failing the whole file.
_NOT_UTF8 = "\uffff"
_MARK_UNDECODABLE = "slurm_autosp.data.mark_undecodable"


def _mark_undecodable(err: UnicodeError) -> tuple[str, int]:
    assert isinstance(err, UnicodeDecodeError)
    return _NOT_UTF8, err.end


codecs.register_error(_MARK_UNDECODABLE, _mark_undecodable)
# the json loader decodes its input (and so applies encoding_errors) only when the encoding
# is not spelled "utf-8"; "utf8" is the same codec
_LOADER_ENCODING = {"encoding": "utf8", "encoding_errors": _MARK_UNDECODABLE}
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
WRITE_BATCH_ROWS = 4096


class PrepareError(Exception):
    """Input prepare cannot use; the message names the file or key and how to fix it."""


class DocumentFormat(str, enum.Enum):
    text = "text"  # a string per row: every token is trained on
    chat = "chat"  # a list of {role, content} messages per row: only the assistant's tokens


class ChatTurns(str, enum.Enum):
    """What one conversation becomes (`--chat-turns`)."""

    full = "full"  # one document: every reply as the template renders the whole conversation
    each = "each"  # one document per reply, ending with it: every reply's reasoning trained


class Skip(str, enum.Enum):
    """Why a row became no document (counted in the summary)."""

    empty = "empty"  # no text, only whitespace, or no messages
    not_utf8 = "non_utf8"  # undecodable bytes in the file
    malformed = "malformed"  # not a string (text) or not a list of {role, content} (chat)
    not_json = "not_json"  # a line of a JSON Lines file that is not a JSON object
    template_error = "template_error"  # the chat template raised on it (e.g. an unknown role)
    no_reply = "no_reply"  # --chat-turns each: no assistant message, so no turn to train


@dataclass(frozen=True)
class PrepareOptions:
    tokenizer: Path
    inputs: list[str]  # files, glob patterns, or a directory saved by datasets
    output: Path
    format: DocumentFormat = DocumentFormat.text
    chat_turns: ChatTurns = ChatTurns.full
    text_key: str | None = None  # default: "text", or "messages" for chat
    eval_fraction: float = 0.0
    workers: int = 1
    seed: int = 0  # of the documents held out for evaluation

    @property
    def key(self) -> str:
        default = "messages" if self.format is DocumentFormat.chat else "text"
        return self.text_key or default


def load_tokenizer(directory: Path, document_format: DocumentFormat) -> PreTrainedTokenizerBase:
    """A local Hugging Face tokenizer (never the hub) with the EOS that ends each document,
    and a chat template for chat data."""
    how = "save one with tokenizer.save_pretrained(DIR)"
    if not directory.is_dir():
        raise PrepareError(f"--tokenizer {directory}: no such directory ({how})")
    if not tokenizer_file_paths(directory):
        raise PrepareError(
            f"--tokenizer {directory}: not a Hugging Face tokenizer directory (no tokenizer.json, "
            f"tokenizer_config.json or vocabulary file in it; {how})"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as err:
        raise PrepareError(f"--tokenizer {directory}: cannot be loaded ({how}): {err}") from err
    if tokenizer.eos_token_id is None:
        raise PrepareError(
            f"--tokenizer {directory}: has no eos_token, which ends every document; set one "
            "(tokenizer.eos_token = ...) and save it again"
        )
    if document_format is DocumentFormat.chat and not tokenizer.chat_template:
        raise PrepareError(
            f"--tokenizer {directory}: has no chat template, which --format chat renders rows "
            "with; set tokenizer.chat_template and save it again, or use --format text"
        )
    if document_format is DocumentFormat.chat and (why := unusable_end_of_turn(tokenizer)):
        raise PrepareError(f"--tokenizer {directory}: {why}")
    return tokenizer


def resolve_inputs(patterns: list[str]) -> tuple[str, list[str]]:
    """The datasets builder (json, parquet, text, or "disk" for a saved dataset) and the input
    files in sorted order, so the same patterns always read the same rows in the same order."""
    files: list[str] = []
    for pattern in patterns:
        matched = sorted(glob(pattern)) or ([pattern] if os.path.exists(pattern) else [])
        if not matched:
            raise PrepareError(f"--input {pattern!r}: no such file (no file matches)")
        files += matched
    directories = [f for f in files if os.path.isdir(f)]
    if directories:
        if len(files) > 1:
            raise PrepareError(
                f"--input {directories[0]}: a dataset saved with datasets is read alone; "
                "prepare it without other inputs"
            )
        return "disk", files
    builder = BUILDERS.get(Path(files[0]).suffix)
    for file in files:
        if builder is None or BUILDERS.get(Path(file).suffix) != builder:
            raise PrepareError(
                f"--input {file}: inputs must all be of one kind: {', '.join(BUILDERS)} (or one "
                "directory saved with datasets.Dataset.save_to_disk)"
            )
    assert builder is not None
    return builder, files


@dataclass(frozen=True)
class Rows:
    table: datasets.Dataset
    unparseable: dict[int, str]  # row index: "file:line: why" (lines that are not JSON objects)


def load_rows(builder: str, files: list[str], key: str, cache_dir: Path) -> Rows:
    """The input's rows, in file order, with column `key` present. A JSON Lines file with a
    line that is not a JSON object is read with that line as a row of its own, to skip."""
    if builder != "disk" and not any(os.path.getsize(f) for f in files):
        raise PrepareError(f"--input {' '.join(files)}: empty, no rows to prepare")
    unparseable: dict[int, str] = {}
    try:
        table = _read(builder, files, cache_dir)
    except PrepareError:
        marked = _unparseable_lines(builder, files, cache_dir)
        if marked is None:
            raise
        table, unparseable = _read(builder, marked.files, cache_dir), marked.bad
        if len(table) != marked.rows:
            raise PrepareError(
                f"--input {' '.join(files)}: {len(table)} rows read but {marked.rows} lines with "
                f"text, so lines that are not JSON objects ({next(iter(marked.bad.values()))}) "
                "cannot be told apart; fix or remove them"
            ) from None
    if len(table) == 0:
        raise PrepareError(f"--input {' '.join(files)}: no rows in it to prepare")
    if key not in table.column_names:
        raise PrepareError(
            f"--input {' '.join(files)}: rows have no {key!r} field (they have "
            f"{', '.join(table.column_names)}); name the field with --text-key"
        )
    return Rows(table, unparseable)


def _unparseable_lines(builder: str, files: list[str], cache_dir: Path) -> MarkedLines | None:
    """The JSON Lines files with their bad lines marked; None when none is bad (the loader
    failed for another reason, which its error names)."""
    if builder != "json":
        return None
    try:
        marked = mark_unparseable(files, cache_dir / "marked", _MARK_UNDECODABLE)
    except OSError:
        return None
    return marked if marked.bad else None


def _read(builder: str, files: list[str], cache_dir: Path) -> datasets.Dataset:
    try:
        if builder == "disk":
            rows = datasets.load_from_disk(files[0])
            if isinstance(rows, datasets.DatasetDict):
                if "train" not in rows:
                    raise PrepareError(
                        f"--input {files[0]}: a DatasetDict without a train split "
                        f"(splits: {', '.join(rows)}); save the split to prepare"
                    )
                rows = rows["train"]
            return rows
        encoding = _LOADER_ENCODING if builder in ("json", "text") else {}
        return datasets.load_dataset(
            builder, data_files=files, split="train", cache_dir=str(cache_dir), **encoding
        )
    except (OSError, ValueError, pa.ArrowException, datasets.exceptions.DatasetGenerationError) as err:  # fmt: skip
        raise PrepareError(
            f"--input {' '.join(files)}: cannot be read as {builder}: {err}"
        ) from err


@dataclass(frozen=True)
class Document:
    ids: list[int]
    mask: list[int]  # chat: 1 where trained on; text: empty (every token is)


Documents = list[Document]  # what one row becomes: one, or one per turn (--chat-turns each)


@dataclass(frozen=True)
class Skipped:
    reason: Skip
    note: str = ""  # what a reader needs to find and fix the row (template errors, bad lines)


@dataclass(frozen=True)
class Tokenize:
    """The batched map function: a row becomes its documents' token ids, each ending in EOS,
    their lengths (and, for chat, a mask of the assistant's tokens), or no tokens and the
    reason it was skipped."""

    tokenizer: PreTrainedTokenizerBase
    key: str
    format: DocumentFormat
    chat_turns: ChatTurns = ChatTurns.full
    unparseable: dict[int, str] = field(default_factory=dict)  # row index: "file:line: why"
    tokenizer_dir: Path | None = None  # named in errors

    def __call__(self, batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        rows = batch[self.key]
        results: list[Documents | Skipped | None] = [
            self._check(row, index) for row, index in zip(rows, indices, strict=True)
        ]
        kept = [i for i, result in enumerate(results) if result is None]
        if self.format is DocumentFormat.chat:
            made = self._chats([rows[i] for i in kept], [indices[i] for i in kept])
        else:
            made = self._texts([rows[i] for i in kept])
        for i, result in zip(kept, made, strict=True):
            results[i] = result
        return self._columns(results)

    def _columns(self, results: list[Documents | Skipped | None]) -> dict[str, list[Any]]:
        eos, masked = self.tokenizer.eos_token_id, self.format is DocumentFormat.chat
        columns = ("input_ids", "loss_mask", "lengths", "skipped", "note")
        out: dict[str, list[Any]] = {column: [] for column in columns}
        for result in results:
            assert result is not None
            documents = [] if isinstance(result, Skipped) else result
            out["input_ids"].append([t for d in documents for t in [*d.ids, eos]])
            out["loss_mask"].append([m for d in documents for m in [*d.mask, 0]] if masked else [])
            out["lengths"].append([len(d.ids) + 1 for d in documents])
            out["skipped"].append(result.reason.value if isinstance(result, Skipped) else "")
            out["note"].append(result.note if isinstance(result, Skipped) else "")
        return out

    def _check(self, row: Any, index: int) -> Skipped | None:
        if index in self.unparseable:
            return Skipped(Skip.not_json, self.unparseable[index])
        if self.format is DocumentFormat.chat:
            if row is None or row == []:
                return Skipped(Skip.empty)
            if not isinstance(row, list) or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role")
                for m in row
            ):
                return Skipped(Skip.malformed)
            texts = [m["content"] for m in row]
        else:
            if row is None:
                return Skipped(Skip.empty)
            if not isinstance(row, str):
                return Skipped(Skip.malformed)
            texts = [row]
        if any(_NOT_UTF8 in text for text in texts):
            return Skipped(Skip.not_utf8)
        return None if any(text.strip() for text in texts) else Skipped(Skip.empty)

    def _texts(self, texts: list[str]) -> list[Documents | Skipped]:
        if not texts:
            return []
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [[Document(document, [])] for document in ids]

    def _chats(
        self, conversations: list[Messages], indices: list[int]
    ) -> list[Documents | Skipped]:
        """Each conversation rendered by the chat template and masked (see `chat.py`): one
        document, or one per reply (`--chat-turns each`); one the template raises on is
        skipped, one it cannot mask fails the preparation."""
        markers = uses_generation_markers(self.tokenizer)
        stop = end_of_turn_stop(self.tokenizer)
        each = self.chat_turns is ChatTurns.each
        results: list[Documents | Skipped | int] = []  # int: that many documents of `texts`
        texts, spans = [], []
        for messages, index in zip(conversations, indices, strict=True):
            samples = _turns(messages) if each else [messages]
            if not samples:
                results.append(Skipped(Skip.no_reply, f"input row {index}: no assistant message"))
                continue
            try:
                if markers:
                    results.append(
                        [
                            Document(*encode_with_markers(self.tokenizer, s, stop, each))
                            for s in samples
                        ]
                    )
                    continue
                rendered = [render(self.tokenizer, sample) for sample in samples]
                found = [
                    reply_spans(self.tokenizer, sample, text, stop, last_only=each)
                    for sample, text in zip(samples, rendered, strict=True)
                ]
            except TemplateRejected as err:
                results.append(Skipped(Skip.template_error, f"input row {index}: {err}"))
                continue
            except Unmaskable as err:
                raise PrepareError(
                    f"--tokenizer {self.tokenizer_dir}: its chat template cannot show which tokens "
                    f"are the assistant's in input row {index}, {err}; {MARKERS_FIX}"
                ) from err
            texts += rendered
            spans += found
            results.append(len(samples))
        masked: list[Document] = []
        if texts:
            encoded = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
            masked = [
                Document(ids, trained_tokens(offsets, trained))
                for ids, offsets, trained in zip(
                    encoded["input_ids"], encoded["offset_mapping"], spans, strict=True
                )
            ]
        made = iter(masked)
        return [
            [next(made) for _ in range(result)] if isinstance(result, int) else result
            for result in results
        ]


def _turns(messages: Messages) -> list[Messages]:
    """The conversation up to and including each assistant message."""
    return [messages[: i + 1] for i, m in enumerate(messages) if m["role"] == "assistant"]


def tokenize_rows(
    rows: datasets.Dataset, tokenize: Tokenize, workers: int, cache_dir: Path, fingerprint: str
) -> datasets.Dataset:
    features = datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("uint32")),
            "loss_mask": datasets.List(datasets.Value("uint8")),
            "lengths": datasets.List(datasets.Value("uint32")),
            "skipped": datasets.Value("string"),
            "note": datasets.Value("string"),
        }
    )
    with children_die_with_this_process():  # a killed prepare leaves no worker running
        return rows.map(
            tokenize,
            batched=True,
            with_indices=True,
            num_proc=workers if workers > 1 else None,
            remove_columns=rows.column_names,
            features=features,
            cache_file_name=str(cache_dir / "tokenized.arrow"),
            new_fingerprint=fingerprint,
            desc="tokenizing",
        )


def held_out(documents: int, fraction: float, seed: int) -> np.ndarray:
    """Which documents form the eval split: a seeded choice of round(fraction x documents),
    at least one when the fraction is positive and a document is left to train on."""
    count = round(documents * fraction)
    if fraction > 0 and documents > 1:
        count = min(max(count, 1), documents - 1)
    chosen = np.zeros(documents, dtype=bool)
    chosen[np.random.default_rng(seed).choice(documents, count, replace=False)] = True
    return chosen


class SplitWriter:
    """One split's token file, document ends and (chat) loss mask, appended batch by batch."""

    def __init__(self, root: Path, split: str, vocab_size: int, masked: bool):
        self.files = SplitFiles.of(root, split)
        self.tokens = TokenFileWriter(self.files.tokens, vocab_size)
        self.ends: list[np.ndarray] = []
        self.masks: list[np.ndarray] | None = [] if masked else None
        self.documents = 0

    def append(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None) -> None:
        self.ends.append(self.tokens.count + np.cumsum(lengths, dtype=np.uint64))
        self.tokens.append(tokens)
        self.documents += len(lengths)
        if self.masks is not None:
            assert mask is not None
            self.masks.append(mask)

    def close(self) -> dict[str, int]:
        self.tokens.close()
        np.save(self.files.documents, np.concatenate([np.zeros(0, np.uint64), *self.ends]))
        counts = {"documents": self.documents, "tokens": self.tokens.count}
        if self.masks is not None:
            mask = np.concatenate([np.zeros(0, np.uint8), *self.masks])
            np.save(self.files.loss_mask, mask)
            counts["trained_tokens"] = int(mask.sum())
        return counts


def write_splits(
    tokenized: datasets.Dataset, root: Path, options: PrepareOptions, vocab_size: int
) -> dict[str, dict[str, int]]:
    """Documents in input order, each row's to the train or the eval split (a conversation's
    turns stay together)."""
    kept = pc.equal(tokenized.data.column("skipped"), "")
    is_eval = held_out(int(pc.sum(kept).as_py() or 0), options.eval_fraction, options.seed)
    masked = options.format is DocumentFormat.chat
    splits = {"train": SplitWriter(root, "train", vocab_size, masked)}
    if is_eval.any():
        splits["eval"] = SplitWriter(root, "eval", vocab_size, masked)
    first = 0
    for table in tokenized.with_format("arrow").iter(batch_size=WRITE_BATCH_ROWS):
        assert isinstance(table, pa.Table)
        ids = table.column("input_ids").combine_chunks()
        row_tokens = pc.list_value_length(ids).to_numpy(zero_copy_only=False)
        column = table.column("lengths").combine_chunks()
        row_documents = pc.list_value_length(column).to_numpy(zero_copy_only=False)
        row_kept = row_tokens > 0
        lengths = column.flatten().to_numpy(zero_copy_only=False)
        tokens = ids.flatten().to_numpy(zero_copy_only=False)
        mask = table.column("loss_mask").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        in_eval = is_eval[first : first + int(row_kept.sum())]
        first += int(row_kept.sum())
        token_in_eval = np.repeat(in_eval, row_tokens[row_kept])
        document_in_eval = np.repeat(in_eval, row_documents[row_kept])
        for name, documents, at in (("train", ~document_in_eval, ~token_in_eval), ("eval", document_in_eval, token_in_eval)):  # fmt: skip
            if name in splits:
                splits[name].append(tokens[at], lengths[documents], mask[at] if masked else None)
    return {name: writer.close() for name, writer in splits.items()}


def prepare(options: PrepareOptions) -> dict[str, Any]:
    """Write the prepared dataset; returns its summary."""
    if not 0 <= options.eval_fraction < 1:
        raise PrepareError(f"--eval-fraction {options.eval_fraction} must be in [0, 1)")
    if options.workers < 1:
        raise PrepareError(f"--workers {options.workers} must be >= 1")
    if options.chat_turns is ChatTurns.each and options.format is not DocumentFormat.chat:
        raise PrepareError(
            "--chat-turns each: splits conversations into turns, so it needs --format chat"
        )
    _refuse_existing(options.output)
    tokenizer = load_tokenizer(options.tokenizer, options.format)
    builder, files = resolve_inputs(options.inputs)
    try:
        with output_lock(options.output):
            return _prepare_owned(options, tokenizer, builder, files)
    except OutputBusy as busy:
        raise PrepareError(f"--output {options.output}: {busy}") from None


def _refuse_existing(output: Path) -> None:
    if output.exists():
        raise PrepareError(
            f"--output {output}: already exists; remove it or choose another directory"
        )


def _prepare_owned(
    options: PrepareOptions, tokenizer: PreTrainedTokenizerBase, builder: str, files: list[str]
) -> dict[str, Any]:
    """Under the output's lock: no other prepare writes the partial directory."""
    _refuse_existing(options.output)  # written by a prepare that held the lock before
    partial = options.output.with_name(f".{options.output.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by a prepare that was killed
    cache = partial / ".cache"
    cache.mkdir(parents=True)
    try:
        summary = _prepare_into(partial, cache, options, tokenizer, builder, files)
        shutil.rmtree(cache)
        rename_durably(partial, options.output)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return summary


def _prepare_into(
    root: Path,
    cache: Path,
    options: PrepareOptions,
    tokenizer: PreTrainedTokenizerBase,
    builder: str,
    files: list[str],
) -> dict[str, Any]:
    rows = load_rows(builder, files, options.key, cache)
    tokenizer_sha = tokenizer_hash(options.tokenizer)
    fingerprint = hashlib.sha256(
        json.dumps(
            [
                tokenizer_sha,
                rows.table._fingerprint,
                options.key,
                options.format.value,
                options.chat_turns.value,
            ]
        ).encode()
    ).hexdigest()[:32]
    start = time.perf_counter()
    tokenize = Tokenize(
        tokenizer,
        options.key,
        options.format,
        options.chat_turns,
        rows.unparseable,
        options.tokenizer,
    )
    tokenized = tokenize_rows(rows.table, tokenize, options.workers, cache, fingerprint)
    vocab_size = len(tokenizer)
    splits = write_splits(tokenized, root, options, vocab_size)
    seconds = time.perf_counter() - start
    skipped, first = skipped_rows(tokenized)
    documents = sum(split["documents"] for split in splits.values())
    if documents == 0:
        notes = "".join(f"; first {why}: {first[why]['note']}" for why in first if "note" in first[why])  # fmt: skip
        raise PrepareError(
            f"--input {' '.join(files)}: every one of {len(rows.table)} rows was skipped "
            f"({', '.join(f'{n} {why}' for why, n in skipped.items())}){notes}; "
            f"check --text-key {options.key} and --format {options.format.value}"
        )
    tokens = sum(split["tokens"] for split in splits.values())
    log.info(
        "prepared %d documents, %d tokens in %.1f s (%.0f tokens/s)%s",
        documents,
        tokens,
        seconds,
        tokens / seconds,
        f"; skipped {skipped}" if skipped else "",
    )
    for why, row in first.items():
        log.info("first %s row: %s", why, row.get("note", f"input row {row['row']}"))
    (root / TOKENIZER_DIR).mkdir()
    for path in tokenizer_file_paths(options.tokenizer):
        shutil.copyfile(path, root / TOKENIZER_DIR / path.name)
    summary = {
        "format": options.format.value,
        "inputs": files,
        "key": options.key,
        "rows": len(rows.table),
        "skipped_rows": skipped,
        "first_skipped": first,
        "splits": splits,
        "eval_fraction": options.eval_fraction,
        "vocab_size": vocab_size,
        "eos_token_id": tokenizer.eos_token_id,
        "end_of_turn_token_id": end_of_turn(tokenizer, options.format),
        "tokenizer": {
            "name": options.tokenizer.resolve().name,
            "class": type(tokenizer).__name__,
            "sha256": tokenizer_sha,
        },
    }
    if options.format is DocumentFormat.chat:
        summary["chat_turns"] = options.chat_turns.value
    (root / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def skipped_rows(tokenized: datasets.Dataset) -> tuple[dict[str, int], dict[str, dict[str, Any]]]:
    """How many rows were skipped for each reason, and the first of them: its input row and,
    where there is one, the note that locates and explains it."""
    column = tokenized.data.column("skipped")
    counts = {r["values"]: r["counts"] for r in pc.value_counts(column).to_pylist() if r["values"]}
    first: dict[str, dict[str, Any]] = {}
    for why in sorted(counts):
        row = pc.index(column, why).as_py()
        note = tokenized.data.column("note")[row].as_py()
        first[why] = {"row": row, **({"note": note} if note else {})}
    return dict(sorted(counts.items())), first


def end_of_turn(tokenizer: PreTrainedTokenizerBase, document_format: DocumentFormat) -> int:
    """The token that ends what the model writes, for generation to stop at: chat, the token
    that ends a reply (`end_of_turn_stop`); text, the EOS that ends each document."""
    eos = int(tokenizer.eos_token_id)
    if document_format is DocumentFormat.text:
        return eos
    token = end_of_turn_token(tokenizer)
    if token is None:
        log.warning("the chat template writes no end-of-turn text after a reply; using EOS")
        return eos
    return token

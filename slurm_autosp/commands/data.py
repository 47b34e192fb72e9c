"""python -m slurm_autosp data prepare --tokenizer DIR --input 'corpus/*.jsonl' --output DIR

Tokenizes JSONL, Parquet or text files (or a directory saved with datasets) with a local
Hugging Face tokenizer into a prepared dataset that training reads as `data.path`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from slurm_autosp.commands.arguments import REFUSED
from slurm_autosp.data.prepare import (
    ChatTurns,
    DocumentFormat,
    PrepareError,
    PrepareOptions,
    prepare,
)


def parse(argv: list[str] | None) -> PrepareOptions:
    parser = argparse.ArgumentParser(prog="python -m slurm_autosp data", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="tokenize text into a prepared dataset")
    p.add_argument("--tokenizer", type=Path, required=True, help="a local HF tokenizer directory")
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="files or glob patterns (quoted), or a saved dataset",
    )
    p.add_argument("--output", type=Path, required=True, help="the directory to create")
    p.add_argument(
        "--format",
        type=DocumentFormat,
        default=DocumentFormat.text,
        choices=[f.value for f in DocumentFormat],
        help="text: every token is trained on; chat: rows of messages, the replies are",
    )
    p.add_argument(
        "--chat-turns",
        type=ChatTurns,
        default=ChatTurns.full,
        choices=[t.value for t in ChatTurns],
        help="full: a conversation is one document, each reply as the template renders it "
        "there; each: one document per reply, ending with it (every reply's reasoning trained)",
    )
    p.add_argument("--text-key", help='the field read: default "text" ("messages" for chat)')
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=0.0,
        help="rows held out (a conversation's turns together)",
    )
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    args = parser.parse_args(argv)
    return PrepareOptions(
        tokenizer=args.tokenizer,
        inputs=args.input,
        output=args.output,
        format=args.format,
        chat_turns=args.chat_turns,
        text_key=args.text_key,
        eval_fraction=args.eval_fraction,
        workers=args.workers,
    )


def main(argv: list[str] | None = None) -> int:
    options = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if options.workers > 1:  # forked workers each tokenize single-threaded
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        summary = prepare(options)
    except PrepareError as err:
        print(f"error: {err}", file=sys.stderr)
        return REFUSED
    splits = ", ".join(
        f"{name}: {split['documents']} documents, {split['tokens']} tokens"
        for name, split in summary["splits"].items()
    )
    print(f"wrote {options.output} ({splits}; vocabulary {summary['vocab_size']})")
    if summary["skipped_rows"]:
        reasons = ", ".join(f"{n} {why}" for why, n in summary["skipped_rows"].items())
        skipped = sum(summary["skipped_rows"].values())
        print(f"skipped {skipped} of {summary['rows']} rows: {reasons}")
        for why, first in summary["first_skipped"].items():
            where = first.get("note") or f"input row {first['row']}"
            print(f"  first {why}: {where}")
    return 0

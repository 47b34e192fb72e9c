"""prepare's throughput against a plain `datasets.map` with the same tokenizer, same corpus.

    python bench/prepare_bench.py                 # 40,000 documents, 1 and 2 workers
    python bench/prepare_bench.py --documents 5000

The corpus is JSONL of random words (50 to 500 per document); the tokenizer a byte-level BPE
of 8,000 tokens trained on it. The baseline is what a user would write:
`load_dataset("json").map(lambda b: tokenizer(b["text"]), batched=True, num_proc=workers)`,
timed from load to a tokenized dataset; prepare is timed from the same start to a complete
prepared directory (EOS appended, skipped rows counted, files written and renamed). Each is
run twice, alternating, and the faster run counts; the load cache is not shared.
"""

import json
import random
import tempfile
import time
from pathlib import Path

import datasets
from common import bench_parser
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from slurm_autosp.data.prepare import PrepareOptions, prepare


def build_corpus(root: Path, documents: int) -> Path:
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(5000)]  # fmt: skip
    corpus = root / "corpus.jsonl"
    with open(corpus, "w") as f:
        for _ in range(documents):
            text = " ".join(rng.choices(words, k=rng.randint(50, 500)))
            f.write(json.dumps({"text": text}) + "\n")
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<unk>", "<eos>"])
    bpe.train_from_iterator((rng.choice(words) for _ in range(200_000)), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", unk_token="<unk>")
    tokenizer.save_pretrained(root / "tokenizer")
    return corpus


def baseline(root: Path, corpus: Path, workers: int, run: int) -> tuple[float, int]:
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer", local_files_only=True)
    start = time.perf_counter()
    rows = datasets.load_dataset(
        "json", data_files=[str(corpus)], split="train", cache_dir=str(root / f"cache{run}")
    )
    tokenized = rows.map(
        lambda batch: tokenizer(batch["text"]),
        batched=True,
        num_proc=workers if workers > 1 else None,
        remove_columns=["text"],
    )
    seconds = time.perf_counter() - start
    return seconds, sum(len(ids) for ids in tokenized["input_ids"])


def ours(root: Path, corpus: Path, workers: int, run: int) -> tuple[float, int]:
    start = time.perf_counter()
    options = PrepareOptions(
        tokenizer=root / "tokenizer",
        inputs=[str(corpus)],
        output=root / f"prepared{run}",
        workers=workers,
    )
    summary = prepare(options)
    return time.perf_counter() - start, summary["splits"]["train"]["tokens"]


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--documents", type=int, default=40_000)
    args = parser.parse_args()
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = build_corpus(root, args.documents)
        print(f"corpus: {args.documents} documents, {corpus.stat().st_size / 2**20:.1f} MiB")
        run = 0
        for workers in (1, 2):
            best: dict[str, tuple[float, int]] = {}
            for _ in range(2):
                for name, fn in (("datasets.map", baseline), ("prepare", ours)):
                    run += 1
                    seconds, tokens = fn(root, corpus, workers, run)
                    if name not in best or seconds < best[name][0]:
                        best[name] = (seconds, tokens)
            for name, (seconds, tokens) in best.items():
                print(f"workers={workers} {name:>12}: {tokens} tokens in {seconds:.2f} s, {tokens / seconds:,.0f} tokens/s")  # fmt: skip
            ratio = (best["prepare"][1] / best["prepare"][0]) / (
                best["datasets.map"][1] / best["datasets.map"][0]
            )
            print(f"workers={workers} prepare / datasets.map throughput: {ratio:.2f}x")


if __name__ == "__main__":
    main()

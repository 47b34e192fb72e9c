"""`python -m slurm_autosp data prepare`: text and chat rows to a prepared dataset that
training reads, with a tokenizer trained here (a small byte-level BPE)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from slurm_helpers import REPO
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from slurm_autosp.commands.data import main
from slurm_autosp.config import ConfigError, load_config
from slurm_autosp.data import check_token_file, micro_batch, open_tokens, read_token_file
from slurm_autosp.data.prepared import SplitFiles
from slurm_autosp.sp.inputs import IGNORE_INDEX, prepare_sp_inputs

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()


def sentences(count: int) -> list[str]:
    return [
        " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(5 + i % 17))
        for i in range(count)
    ]


def save_tokenizer(directory: Path, texts: list[str], chat_template: str = CHAT_TEMPLATE) -> None:
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", unk_token="<unk>")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(directory, sentences(500))
    return directory


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def conversation(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": f"hi {i}"},
        {"role": "assistant", "content": f"hello number {i}"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "the quick fox"},
    ]


def prepare(tokenizer_dir: Path, inputs: list[Path | str], output: Path, *flags: str) -> int:
    args = ["prepare", "--tokenizer", str(tokenizer_dir), "--output", str(output)]
    return main([*args, "--input", *map(str, inputs), *flags])


def test_text_rows_become_documents_ending_in_eos_with_their_ends_indexed(tmp_path, tokenizer_dir):
    texts = sentences(40)
    corpus = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])
    assert prepare(tokenizer_dir, [corpus], tmp_path / "out") == 0
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out" / "tokenizer")
    vocab, tokens = read_token_file(SplitFiles.of(tmp_path / "out", "train").tokens)
    ends = np.load(SplitFiles.of(tmp_path / "out", "train").documents)
    assert vocab == len(tokenizer) and len(ends) == 40 and ends[-1] == len(tokens)
    ends = ends.astype(np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    for text, start, end in zip(texts, starts, ends, strict=True):
        assert tokens[end - 1] == tokenizer.eos_token_id
        assert tokenizer.decode(tokens[start : end - 1]) == text
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["splits"] == {"train": {"documents": 40, "tokens": len(tokens)}}
    assert summary["vocab_size"] == len(tokenizer) and summary["skipped_rows"] == {}
    assert summary["end_of_turn_token_id"] == summary["eos_token_id"] == tokenizer.eos_token_id
    assert summary["tokenizer"]["name"] == tokenizer_dir.name
    assert len(summary["tokenizer"]["sha256"]) == 64
    assert not (tmp_path / ".out.partial").exists()


def test_parquet_rows_prepare_the_same_tokens_as_jsonl(tmp_path, tokenizer_dir):
    texts = sentences(30)
    write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])
    pq.write_table(pa.table({"text": texts}), tmp_path / "a.parquet")
    assert prepare(tokenizer_dir, [tmp_path / "a.jsonl"], tmp_path / "from_jsonl") == 0
    assert prepare(tokenizer_dir, [tmp_path / "a.parquet"], tmp_path / "from_parquet") == 0
    for name in ("train.tokens", "train.documents.npy"):
        assert (tmp_path / "from_jsonl" / name).read_bytes() == (
            tmp_path / "from_parquet" / name
        ).read_bytes()


def test_the_same_input_prepares_byte_identical_output_for_any_worker_count(
    tmp_path, tokenizer_dir
):
    for name in ("b", "a"):  # a glob reads files in sorted order, not creation order
        write_jsonl(tmp_path / f"{name}.jsonl", [{"text": f"{name} {t}"} for t in sentences(300)])
    pattern = str(tmp_path / "*.jsonl")
    assert prepare(tokenizer_dir, [pattern], tmp_path / "one", "--eval-fraction", "0.05") == 0
    flags = ("--eval-fraction", "0.05", "--workers", "2")
    assert prepare(tokenizer_dir, [pattern], tmp_path / "two", *flags) == 0
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*"))
    assert [str(f) for f in files if f.suffix] == [
        "eval.documents.npy",
        "eval.tokens",
        "summary.json",
        "tokenizer/chat_template.jinja",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
        "train.documents.npy",
        "train.tokens",
    ]
    for f in files:
        if (tmp_path / "one" / f).is_file():
            assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "two" / f).read_bytes(), f
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert summary["splits"]["eval"]["documents"] == 30
    assert summary["splits"]["train"]["documents"] == 570


def test_chat_rows_train_only_on_the_assistant_tokens(tmp_path, tokenizer_dir):
    corpus = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation(i)} for i in range(8)])
    assert prepare(tokenizer_dir, [corpus], tmp_path / "chat", "--format", "chat") == 0
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "chat" / "tokenizer")
    files = SplitFiles.of(tmp_path / "chat", "train")
    _, tokens = read_token_file(files.tokens)
    mask = np.load(files.loss_mask).astype(bool)
    first = slice(0, int(np.load(files.documents)[0]))
    assert (
        tokenizer.decode(tokens[first][mask[first]]) == "hello number 0<|end|>the quick fox<|end|>"
    )
    assert tokenizer.decode(tokens[first][~mask[first]]).startswith("<|system|>be brief<|end|>")

    seq_len = 32
    cfg = load_config(
        [
            "cfg=configs/tiny_cpu.yaml",
            "data.source=tokens",
            f"data.path={tmp_path / 'chat'}",
            f"data.seq_len={seq_len}",
            "data.shuffle=false",
        ]
    )
    batch = micro_batch(open_tokens(cfg.data.path, seq_len, len(tokenizer)), cfg, 0, 0, 0)
    assert batch.labels is not None
    rows = slice(0, cfg.train.micro_batch * seq_len)
    expected = np.where(mask[rows], tokens[rows].astype(np.int64), IGNORE_INDEX)
    assert torch.equal(batch.labels, torch.from_numpy(expected).reshape(-1, seq_len))
    shards = [
        prepare_sp_inputs(batch.input_ids, batch.labels, sp_rank=r, sp_size=2) for r in range(2)
    ]
    trained_after_first = int(mask[rows].reshape(-1, seq_len)[:, 1:].sum())
    assert sum(s.valid_labels for s in shards) == trained_after_first


def test_empty_and_undecodable_rows_are_counted_and_skipped(tmp_path, tokenizer_dir, capsys):
    corpus = tmp_path / "mixed.jsonl"
    corpus.write_bytes(
        b'{"text": "the fox"}\n{"text": "bad \xff byte"}\n{"text": "   "}\n'
        b'{"text": null}\n{"text": 7}\n{"text": "a lazy dog"}\n'
    )
    assert prepare(tokenizer_dir, [corpus], tmp_path / "out") == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["rows"] == 6 and summary["splits"]["train"]["documents"] == 2
    assert summary["skipped_rows"] == {"empty": 2, "malformed": 1, "non_utf8": 1}
    assert "skipped 4 of 6 rows: 2 empty, 1 malformed, 1 non_utf8" in capsys.readouterr().out


def test_all_rows_bad_is_an_error_that_leaves_no_output(tmp_path, tokenizer_dir, capsys):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_bytes(b'{"text": ""}\n{"text": "\xfe"}\n')
    assert prepare(tokenizer_dir, [corpus], tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"--input {corpus}: every one of 2 rows was skipped (1 empty, 1 non_utf8)" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no_input", "--input '{tmp}/missing/*.jsonl': no such file"),
        ("no_key", "rows have no 'body' field (they have text); name the field with --text-key"),
        ("not_a_tokenizer", "--tokenizer {tmp}: not a Hugging Face tokenizer directory"),
        ("no_tokenizer", "--tokenizer {tmp}/nowhere: no such directory"),
        ("no_chat_template", "has no chat template, which --format chat renders rows with"),
        ("mixed_kinds", "inputs must all be of one kind"),
        ("exists", "already exists; remove it or choose another directory"),
        ("empty", "--input {tmp}/empty.jsonl: empty, no rows to prepare"),
    ],
)
def test_bad_input_is_a_named_error(tmp_path, tokenizer_dir, capsys, case, message):
    corpus = write_jsonl(tmp_path / "a.jsonl", [{"text": "the fox"}])
    tokenizer, inputs, flags = tokenizer_dir, [str(corpus)], []
    if case == "no_input":
        inputs = [f"{tmp_path}/missing/*.jsonl"]
    elif case == "no_key":
        flags = ["--text-key", "body"]
    elif case == "not_a_tokenizer":
        tokenizer = tmp_path
    elif case == "no_tokenizer":
        tokenizer = tmp_path / "nowhere"
    elif case == "no_chat_template":
        tokenizer = tmp_path / "plain"
        save_tokenizer(tokenizer, sentences(50), chat_template="")
        flags = ["--format", "chat"]
    elif case == "mixed_kinds":
        inputs.append(str(tmp_path / "b.txt"))
        (tmp_path / "b.txt").write_text("the fox\n")
    elif case == "exists":
        (tmp_path / "out").mkdir()
    elif case == "empty":
        inputs = [str(tmp_path / "empty.jsonl")]
        (tmp_path / "empty.jsonl").write_text("")
    assert prepare(tokenizer, inputs, tmp_path / "out", *flags) == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


def test_a_line_that_is_not_a_json_object_is_a_counted_skip_named_by_file_and_line(
    tmp_path, tokenizer_dir, capsys
):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "the fox"}, {"text": "a lazy dog"}])
    b = tmp_path / "b.jsonl"
    b.write_text('{"text": "seven wizards"}\n{"text": "cut short\n\n{"text": "hex"}\n[1, 2]\n')
    assert prepare(tokenizer_dir, [tmp_path / "*.jsonl"], tmp_path / "out") == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["rows"] == 6 and summary["splits"]["train"]["documents"] == 4
    assert summary["skipped_rows"] == {"not_json": 2}
    first = summary["first_skipped"]["not_json"]
    assert first["row"] == 3 and first["note"].startswith(f"{b}:2: not JSON (")
    out = capsys.readouterr().out
    assert "skipped 2 of 6 rows: 2 not_json" in out and f"first not_json: {b}:2: not JSON" in out
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out" / "tokenizer")
    _, tokens = read_token_file(SplitFiles.of(tmp_path / "out", "train").tokens)
    texts = tokenizer.decode(tokens).split(tokenizer.eos_token)
    assert texts == ["the fox", "a lazy dog", "seven wizards", "hex", ""]


def test_help_names_the_formats_as_they_are_typed(capsys):
    with pytest.raises(SystemExit):
        main(["prepare", "--help"])
    assert "--format {text,chat}" in capsys.readouterr().out


def start_prepare(
    tokenizer_dir: Path, corpus: Path, output: Path, log: Path, *flags: str
) -> subprocess.Popen:
    """A prepare in a process of its own, writing to `log` (not a pipe, which a process that
    outlives it would hold open)."""
    args = ["--tokenizer", str(tokenizer_dir), "--input", str(corpus), "--output", str(output)]
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "slurm_autosp", "data", "prepare", *args, *flags],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def wait_for(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.01)


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    """Whether any thread of `pid` is left. A killed process's first thread can be a zombie
    while its others still exit, holding its open files (the output's lock among them)."""
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            if (task / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                return True
        except OSError:
            continue
    return False


@pytest.mark.slow
def test_a_second_prepare_to_an_output_being_written_is_refused_by_name(
    tmp_path, tokenizer_dir, capsys
):
    """Before, the second removed the first's partial directory, and the first died."""
    corpus = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in sentences(30000)])
    first = start_prepare(tokenizer_dir, corpus, tmp_path / "out", tmp_path / "first.log")
    wait_for(lambda: (tmp_path / ".out.partial").exists() or first.poll() is not None, "partial")
    assert prepare(tokenizer_dir, [corpus], tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"--output {tmp_path / 'out'}: another prepare (process {first.pid} on " in err
    assert "is writing it; wait for it to finish or choose another directory" in err
    assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["splits"]["train"]["documents"] == 30000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "first.log", "out"]


@pytest.mark.slow
def test_workers_die_with_a_killed_prepare_whose_output_the_next_prepare_takes_over(
    tmp_path, tokenizer_dir
):
    rows = [{"messages": conversation(i)} for i in range(4000)]
    corpus = write_jsonl(tmp_path / "chat.jsonl", rows)
    flags = ("--format", "chat", "--workers", "2")
    killed = start_prepare(tokenizer_dir, corpus, tmp_path / "out", tmp_path / "killed.log", *flags)
    shards = tmp_path / ".out.partial" / ".cache"  # each worker writes its own while tokenizing
    wait_for(lambda: len(list(shards.glob("tmp*"))) >= 2 or killed.poll() is not None, "shards")
    workers = children(killed.pid)  # the pool's, and the manager it reports through
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    assert len(workers) >= 2
    deadline = time.monotonic() + 5
    while any(map(running, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [w for w in workers if running(w)]
    for worker in survivors:  # not to leave them to the rest of the suite
        os.kill(worker, signal.SIGKILL)
    assert not survivors, "workers outlived their prepare"
    assert (tmp_path / ".out.partial").exists()  # what the killed prepare left
    assert prepare(tokenizer_dir, [corpus], tmp_path / "out", "--format", "chat") == 0
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["rows"] == 4000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl", "killed.log", "out"]


def test_a_prepare_that_fails_midway_leaves_nothing_a_run_could_read(tmp_path, capsys):
    """A template whose text after a reply depends on the reply (here its length) fails inside
    the map, after files were begun: neither the output nor its hidden partial directory
    remains."""
    counting = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{{ messages | map(attribute='content') | join | length }}"
    )
    save_tokenizer(tmp_path / "tok", sentences(50), chat_template=counting)
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"messages": conversation(i)} for i in range(3)])
    assert prepare(tmp_path / "tok", [corpus], tmp_path / "out", "--format", "chat") == 2
    assert (
        "the text the template writes after this reply's end of turn depends on the reply"
        in capsys.readouterr().err
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "tok"]


def test_a_prepared_dataset_is_checked_against_the_model_before_any_rank_starts(
    tmp_path, tokenizer_dir
):
    corpus = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in sentences(200)])
    assert prepare(tokenizer_dir, [corpus], tmp_path / "data") == 0
    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    keys = ["cfg=configs/tiny_cpu.yaml", "data.source=tokens", f"data.path={tmp_path / 'data'}"]
    check_token_file(load_config(keys), vocab)
    with pytest.raises(ConfigError, match=rf"vocabulary of {vocab} but model.vocab_size=256"):
        check_token_file(load_config(keys), 256)

    other = tmp_path / "other_model"
    save_tokenizer(other, sentences(100)[::-1])
    with pytest.raises(ConfigError, match=r"prepared with another tokenizer than model\.pretrained_path"):  # fmt: skip
        check_token_file(load_config([*keys, f"model.pretrained_path={other}"]), vocab)

    (tmp_path / "data" / "summary.json").unlink()  # as an interrupted prepare would leave it
    with pytest.raises(ConfigError, match=r"without summary\.json is not a prepared dataset"):
        check_token_file(load_config(keys), vocab)


ENDS = "where each document ends, which data.documents=masked reads"


@pytest.mark.parametrize(
    ("missing", "flags", "why"),
    [
        ("train.tokens", [], "the train split's tokens"),
        ("train.documents.npy", ["data.documents=masked"], ENDS),
        ("eval.documents.npy", ["data.documents=masked"], ENDS),
        ("train.loss_mask.npy", [], "which tokens of the chat data are trained on"),
    ],
)
def test_a_prepared_directory_missing_a_file_is_named_before_any_rank_starts(
    tmp_path, tokenizer_dir, missing, flags, why
):
    corpus = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation(i)} for i in range(8)])
    data = tmp_path / "data"
    assert (
        prepare(tokenizer_dir, [corpus], data, "--format", "chat", "--eval-fraction", "0.25") == 0
    )
    (data / missing).unlink()
    keys = ["cfg=configs/tiny_cpu.yaml", "data.source=tokens", f"data.path={data}", *flags]
    cfg = load_config([*keys, "data.seq_len=32"])
    key = "data.path (held-out data)" if missing.startswith("eval") else f"data.path={data}"
    with pytest.raises(ConfigError) as refused:
        check_token_file(cfg, 300)
    assert str(refused.value).startswith(f"{key}: {data}: {missing} ({why}) is missing; ")
    assert "prepare the dataset again with `python -m slurm_autosp data prepare`" in str(refused.value)  # fmt: skip


@pytest.mark.slow
def test_jsonl_to_a_trained_model_that_loads_and_generates(tmp_path, tokenizer_dir):
    """docs/data.md's path: prepare, train (tiny_cpu, SP=2) evaluating on the eval split, reload the export with its tokenizer."""
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": t} for t in sentences(2000)])
    assert prepare(tokenizer_dir, [corpus], tmp_path / "data", "--eval-fraction", "0.01") == 0
    vocab = json.loads((tmp_path / "data" / "summary.json").read_text())["vocab_size"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "slurm_autosp.submit",
            "cfg=configs/tiny_cpu.yaml",
            "data.source=tokens",
            f"data.path={tmp_path / 'data'}",
            f"model.vocab_size={vocab}",
            "cluster.backend=local",
            f"run.output_root={tmp_path / 'runs'}",
            "train.steps=6",
            "train.eval_every=3",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    evals = [line for line in proc.stdout.splitlines() if "eval at step" in line]
    assert [line.split("eval at step ")[1].split()[0] for line in evals] == ["3", "6"], evals
    events = EventAccumulator(str(tmp_path / "runs" / "tiny_cpu" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/perplexity")] == [3, 6]
    hf = tmp_path / "runs" / "tiny_cpu" / "hf"
    tokenizer = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf)
    prompt = tokenizer("the quick brown", return_tensors="pt").input_ids
    out = model.generate(
        prompt, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.eos_token_id
    )
    assert out.shape == (1, prompt.shape[1] + 4)
    assert tokenizer.decode(out[0]).startswith("the quick brown")

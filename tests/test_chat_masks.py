"""`prepare --format chat`: the loss covers exactly the assistant's replies and the end-of-turn
token that ends each, for chat templates of several families (Jinja strings set on a
tokenizer built here), or preparation is refused by name. The published templates are in
tests/test_chat_templates.py."""

import json
from pathlib import Path

import numpy as np
import pytest
from test_data_prepare import conversation, prepare, sentences, write_jsonl
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from slurm_autosp.data import read_token_file
from slurm_autosp.data.prepared import SplitFiles, stop_token_ids

SPECIAL_TOKENS = [
    "<unk>",
    "<eos>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# the reply follows the template's space: its first token (" hello") straddles the boundary
MISTRAL_SPACED = (
    "<s>{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST] "
    "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
)
NO_GENERATION_PROMPT = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"  # fmt: skip
# the last reply gets an empty thinking block that earlier ones lose: a prefix is no prefix,
# and without a generation prompt the block is the template's text before the reply
THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
THINKING_WITH_MARKERS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "{% if loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
)
# markers around the reply alone, the end of turn outside them: it is trained all the same
MARKERS_BEFORE_THE_END_OF_TURN = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}{% endgeneration %}<|im_end|>\n"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
)
# Phi-3's shape: <|end|> after each turn, EOS after the last; generation stops at <|end|>
MARKERS_BEFORE_AN_END_OF_TURN_AND_EOS = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}<|end|>\n{% endfor %}{{ eos_token }}"
)
# the end of turn written once, after the last reply: the others end in none
MARKERS_END_OF_TURN_AFTER_THE_LAST_REPLY_ONLY = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}<|end|>"
)
# text written into one reply's turn, depending on it: part of that reply as rendered
HEADER_FROM_REPLY = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'assistant' and 'fox' in m['content'] %}(fox) {% endif %}"
    "{{ m['content'] }}<|end|>{% endfor %}"
)
RAISES_ON_TOOL = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)

# template: (the trained text of conversation(i): each reply and its end-of-turn token; what
# the trained tokens decode to; the end-of-turn token)
EXACT = {
    "chatml": (
        CHATML,
        ["hello number {i}<|im_end|>", "the quick fox<|im_end|>"],
        "hello number {i}<|im_end|>the quick fox<|im_end|>",
        "<|im_end|>",
    ),
    "rewrites_earlier_turns": (
        THINKING,
        ["hello number {i}<|im_end|>", "the quick fox<|im_end|>"],
        "hello number {i}<|im_end|>the quick fox<|im_end|>",
        "<|im_end|>",
    ),
    "header_depends_on_the_reply": (
        HEADER_FROM_REPLY,
        ["hello number {i}<|end|>", "(fox) the quick fox<|end|>"],
        "hello number {i}<|end|>(fox) the quick fox<|end|>",
        "<|end|>",
    ),
    "llama3": (
        LLAMA3,
        ["hello number {i}<|eot_id|>", "the quick fox<|eot_id|>"],
        "hello number {i}<|eot_id|>the quick fox<|eot_id|>",
        "<|eot_id|>",
    ),
    "mistral_reply_inside_a_token": (
        MISTRAL_SPACED,
        ["hello number {i}</s>", "the quick fox</s>"],
        # " he" holds the template's space and the reply's first letters: trained; before
        # "the", the space is a token of its own, the template's: not trained
        " hello number {i}</s>the quick fox</s>",
        "</s>",
    ),
    "ignores_add_generation_prompt": (
        NO_GENERATION_PROMPT,
        ["hello number {i}<|end|>", "the quick fox<|end|>"],
        "hello number {i}<|end|>the quick fox<|end|>",
        "<|end|>",
    ),
    "generation_markers": (
        THINKING_WITH_MARKERS,
        ["hello number {i}<|im_end|>", "the quick fox<|im_end|>"],
        "hello number {i}<|im_end|>the quick fox<|im_end|>",
        "<|im_end|>",
    ),
    "markers_before_the_end_of_turn": (
        MARKERS_BEFORE_THE_END_OF_TURN,
        ["hello number {i}<|im_end|>", "the quick fox<|im_end|>"],
        "hello number {i}<|im_end|>the quick fox<|im_end|>",
        "<|im_end|>",
    ),
    "markers_before_an_end_of_turn_and_eos": (
        MARKERS_BEFORE_AN_END_OF_TURN_AND_EOS,
        ["hello number {i}<|end|>", "the quick fox<|end|>"],
        "hello number {i}<|end|>the quick fox<|end|>",
        "<|end|>",
    ),
}


@pytest.fixture(scope="module")
def base_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE knowing the special tokens of every template here."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator([*sentences(500), "hello number", "hi again be brief"], trainer)
    directory = tmp_path_factory.mktemp("base_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", unk_token="<unk>").save_pretrained(directory)  # fmt: skip
    return directory


def with_template(base: Path, directory: Path, template: str) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(directory)
    return directory


def documents(root: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, mask) of each document of the train split, its EOS left off."""
    files = SplitFiles.of(root, "train")
    _, tokens = read_token_file(files.tokens)
    mask = np.load(files.loss_mask).astype(bool)
    ends = np.load(files.documents).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    return [(tokens[s : e - 1], mask[s : e - 1]) for s, e in zip(starts, ends, strict=True)]


def overlapping(tokenizer, text: str, pieces: list[str]) -> set[int]:
    """The positions of the tokens of `text` that hold a character of one of `pieces`,
    found in order: what the loss must cover."""
    spans, at = [], 0
    for piece in pieces:
        start = text.index(piece, at)
        spans.append((start, start + len(piece)))
        at = start + len(piece)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return {
        t
        for t, (a, b) in enumerate(offsets["offset_mapping"])
        if any(a < end and b > begin for begin, end in spans)
    }


@pytest.mark.parametrize("family", EXACT)
def test_the_loss_covers_exactly_the_replies_and_their_end_of_turn_text(
    tmp_path, base_tokenizer, family
):
    template, pieces, decoded, end_of_turn = EXACT[family]
    tok_dir = with_template(base_tokenizer, tmp_path / "tok", template)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    rows = [conversation(i) for i in range(3)]
    corpus = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in rows])
    assert prepare(tok_dir, [corpus], tmp_path / "out", "--format", "chat") == 0
    for i, (messages, (tokens, mask)) in enumerate(zip(rows, documents(tmp_path / "out"), strict=True)):  # fmt: skip
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        assert tokens.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
        expected = overlapping(tokenizer, text, [p.format(i=i) for p in pieces])
        assert set(np.flatnonzero(mask).tolist()) == expected
        assert tokenizer.decode(tokens[mask]) == decoded.format(i=i)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["end_of_turn_token_id"] == tokenizer.convert_tokens_to_ids(end_of_turn)
    assert summary["eos_token_id"] == tokenizer.convert_tokens_to_ids("<eos>")


def test_a_row_the_template_raises_on_is_skipped_and_named(tmp_path, base_tokenizer, capsys):
    tok_dir = with_template(base_tokenizer, tmp_path / "tok", RAISES_ON_TOOL)
    tool_call = [
        {"role": "user", "content": "what is six times seven"},
        {"role": "assistant", "content": "let me compute"},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "forty two"},
    ]
    rows = [conversation(0), conversation(1), tool_call, conversation(3)]
    corpus = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in rows])
    assert prepare(tok_dir, [corpus], tmp_path / "out", "--format", "chat") == 0
    out = capsys.readouterr().out
    assert "skipped 1 of 4 rows: 1 template_error" in out
    assert "first template_error: input row 2: unknown role tool" in out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["splits"]["train"]["documents"] == 3
    assert summary["skipped_rows"] == {"template_error": 1}
    assert summary["first_skipped"] == {
        "template_error": {"row": 2, "note": "input row 2: unknown role tool"}
    }


@pytest.mark.parametrize(
    ("template", "why"),
    [
        (
            MARKERS_END_OF_TURN_AFTER_THE_LAST_REPLY_ONLY,
            "the template's {% generation %} markers close a reply ('hello number 0') that no "
            "end of turn '<|end|>' ends or follows; end every reply with the end-of-turn text",
        ),
    ],
    ids=["markers_leave_a_reply_unended"],
)
def test_a_template_that_cannot_be_masked_is_refused_by_name(
    tmp_path, base_tokenizer, capsys, template, why
):
    tok_dir = with_template(base_tokenizer, tmp_path / "tok", template)
    corpus = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation(i)} for i in range(2)])
    assert prepare(tok_dir, [corpus], tmp_path / "out", "--format", "chat") == 2
    err = capsys.readouterr().err
    assert f"--tokenizer {tok_dir}: its chat template cannot show which tokens are the " in err
    assert "assistant's in input row 0, " in err
    assert why in err
    assert "{% generation %}" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl", "tok"]


# the end of turn written before the next turn only: the last reply ends in nothing
BETWEEN_TURNS = (
    "{% for m in messages %}{% if not loop.first %}<|end|>{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
)
NEWLINE_ENDS_A_TURN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.mark.parametrize(
    ("template", "written"),
    [(BETWEEN_TURNS, "''"), (NEWLINE_ENDS_A_TURN, "'\\n'")],
    ids=["end_of_turn_between_turns", "newline"],
)
def test_a_template_whose_replies_end_in_no_token_of_their_own_is_refused(
    tmp_path, base_tokenizer, capsys, template, written
):
    """Every reply must end in a trained stop token: here none would (the EOS appended to each
    conversation is never trained), and the export's eos_token_id would be a token never
    trained: refused before any row is read, nothing written."""
    tok_dir = with_template(base_tokenizer, tmp_path / "tok", template)
    corpus = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation(i)} for i in range(2)])
    assert prepare(tok_dir, [corpus], tmp_path / "out", "--format", "chat") == 2
    err = capsys.readouterr().err
    assert f"--tokenizer {tok_dir}: its chat template writes {written} after the assistant's" in err
    assert "no token of its own ends a reply" in err and "'<eos>'" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl", "tok"]


def test_a_batch_without_a_usable_chat_row_is_skipped_with_it(tmp_path, base_tokenizer, capsys):
    """The first tokenizing batch (1,000 rows) holds no conversation to render."""
    tok_dir = with_template(base_tokenizer, tmp_path / "tok", CHATML)
    rows = [{"messages": [{"role": "user"}]}] * 1000 + [{"messages": conversation(0)}]
    corpus = write_jsonl(tmp_path / "chat.jsonl", rows)
    assert prepare(tok_dir, [corpus], tmp_path / "out", "--format", "chat") == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["splits"]["train"]["documents"] == 1
    assert summary["skipped_rows"] == {"malformed": 1000}

    corpus = write_jsonl(tmp_path / "bad.jsonl", rows[:2])
    assert prepare(tok_dir, [corpus], tmp_path / "none", "--format", "chat") == 2
    assert "every one of 2 rows was skipped (2 malformed)" in capsys.readouterr().err


# "<end>" is ordinary text to the tokenizer here: five tokens, "<" first
END_TAG = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}{% endgeneration %}<end>\n"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
)


def test_an_end_of_turn_of_several_ordinary_tokens_is_refused_until_it_is_one_token(
    tmp_path, base_tokenizer, capsys
):
    """Generation stops at one token: before, "<" became the export's stop token, and the
    markers left "<end>" untrained. Refused by name; once "<end>" is a token of its own, it
    is trained after each reply and is the stop token."""
    tok_dir = with_template(base_tokenizer, tmp_path / "tok", END_TAG)
    rows = [conversation(i) for i in range(2)]
    corpus = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in rows])
    assert prepare(tok_dir, [corpus], tmp_path / "out", "--format", "chat") == 2
    err = capsys.readouterr().err
    assert f"--tokenizer {tok_dir}: its chat template ends the assistant's reply with '<end>', " in err  # fmt: skip
    assert "which the tokenizer splits into 5 tokens ['<', 'e', 'n', 'd', '>']" in err
    assert "tokenizer.add_special_tokens({'additional_special_tokens': ['<end>']})" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl", "tok"]

    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<end>"]})
    tokenizer.save_pretrained(tok_dir)
    assert prepare(tok_dir, [corpus], tmp_path / "out", "--format", "chat") == 0
    for i, (tokens, mask) in enumerate(documents(tmp_path / "out")):
        assert tokenizer.decode(tokens[mask]) == f"hello number {i}<end>the quick fox<end>"
    end = tokenizer.convert_tokens_to_ids("<end>")
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["end_of_turn_token_id"] == end  # fmt: skip
    assert stop_token_ids(tmp_path / "out" / "tokenizer")[0] == end

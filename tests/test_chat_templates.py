"""`prepare --format chat` with chat templates as their models publish them
(tests/fixtures/chat_templates/, sources in tests/fixtures/SOURCES.md): the loss covers exactly
each reply as the template renders it in the whole conversation and the end-of-turn token that
ends it, in one document per conversation or one per reply (`--chat-turns each`), or the
preparation is refused by name. The tokenizer is a small BPE built here that knows every
template's special tokens."""

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_chat_masks import THINKING_WITH_MARKERS, documents, overlapping
from test_data_prepare import conversation, prepare, sentences, write_jsonl
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from slurm_autosp.data.prepare import ChatTurns, DocumentFormat, Tokenize

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
SPECIAL_TOKENS = [
    "<unk>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<bos>",
    "<eos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
]


@dataclass(frozen=True)
class Published:
    """A published template, the BOS and EOS text it writes, and what conversation(0) trains."""

    bos: str | None
    eos: str
    takes_system: bool
    trained: tuple[str, str]  # each reply as the template renders it, through its end of turn
    first_alone: str | None = None  # the first reply ending the conversation, where it differs


def replies(end: str) -> tuple[str, str]:
    return f"hello number 0{end}", f"the quick fox{end}"


PUBLISHED = {
    # the last reply gets the empty thinking block the template writes after its prompt
    "qwen3": Published(
        None,
        "<|im_end|>",
        True,
        ("hello number 0<|im_end|>", "<think>\n\n</think>\n\nthe quick fox<|im_end|>"),
        "<think>\n\n</think>\n\nhello number 0<|im_end|>",
    ),
    "qwen3_0_6b": Published(
        None,
        "<|im_end|>",
        True,
        ("hello number 0<|im_end|>", "<think>\n\n</think>\n\nthe quick fox<|im_end|>"),
        "<think>\n\n</think>\n\nhello number 0<|im_end|>",
    ),
    "qwen2_5_7b_instruct": Published(None, "<|im_end|>", True, replies("<|im_end|>")),
    "llama3_1_8b_instruct": Published(
        "<|begin_of_text|>", "<|eot_id|>", True, replies("<|eot_id|>")
    ),
    "llama3_2_3b_instruct": Published(
        "<|begin_of_text|>", "<|eot_id|>", True, replies("<|eot_id|>")
    ),
    "gemma2_2b_it": Published("<bos>", "<eos>", False, replies("<end_of_turn>")),
    "gemma3_4b_it": Published("<bos>", "<eos>", True, replies("<end_of_turn>")),
    "phi3_mini_4k_instruct": Published("<s>", "<|endoftext|>", True, replies("<|end|>")),
    "phi3_5_mini_instruct": Published("<s>", "<|endoftext|>", True, replies("<|end|>")),
    "deepseek_r1_distill_qwen_32b": Published(
        "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", True, replies("<｜end▁of▁sentence｜>")
    ),
    "mistral_nemo_instruct_2407": Published("<s>", "</s>", True, replies("</s>")),
    # the template's space before each reply is one token with the reply's first word
    "mistral_7b_instruct_v0_3": Published(
        "<s>", "</s>", True, (" hello number 0</s>", " the quick fox</s>")
    ),
    "mixtral_8x7b_instruct_v0_1": Published("<s>", "</s>", False, replies("</s>")),
    "phi4_mini_instruct": Published(None, "<|endoftext|>", True, replies("<|end|>")),
    # its {% generation %} markers, used as is, hold the header and the newline after the end
    "smollm3_3b": Published(
        None,
        "<|im_end|>",
        True,
        (
            "<|im_start|>assistant\nhello number 0<|im_end|>\n",
            "<|im_start|>assistant\nthe quick fox<|im_end|>\n",
        ),
    ),
}


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([*sentences(500), "hello number", "think"], trainer)
    return tokenizer


def published(bpe: Tokenizer, name: str) -> PreTrainedTokenizerFast:
    spec = PUBLISHED[name]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token=spec.bos, eos_token=spec.eos
    )
    tokenizer.chat_template = (FIXTURES / f"{name}.jinja").read_text(encoding="utf-8")
    return tokenizer


def prepared(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], turns: ChatTurns = ChatTurns.full
) -> list[tuple[list[int], list[int]]]:
    """(tokens, mask) of each document `prepare` makes of one conversation, its EOS left off."""
    out = Tokenize(tokenizer, "messages", DocumentFormat.chat, turns)({"messages": [messages]}, [0])
    assert out["skipped"] == [""], out["note"]
    ids, mask, made, at = out["input_ids"][0], out["loss_mask"][0], [], 0
    for length in out["lengths"][0]:
        made.append((ids[at : at + length - 1], mask[at : at + length - 1]))
        at += length
    return made


def assert_trains_exactly(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], made: tuple, pieces: list[str]
) -> None:
    """The document is the conversation's rendering, and its trained tokens are those holding
    a character of `pieces` (found in order in the rendering): no more, no fewer."""
    ids, mask = made
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert {t for t, m in enumerate(mask) if m} == overlapping(tokenizer, text, pieces)
    assert tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "".join(pieces)


def plain(spec: Published) -> list[dict]:
    return conversation(0) if spec.takes_system else conversation(0)[1:]


@pytest.mark.parametrize("name", PUBLISHED)
def test_each_reply_is_trained_as_the_published_template_renders_it(bpe, name):
    tokenizer, spec = published(bpe, name), PUBLISHED[name]
    messages = plain(spec)
    [made] = prepared(tokenizer, messages)
    assert_trains_exactly(tokenizer, messages, made, list(spec.trained))


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("gemma2_2b_it", "System role not supported"),
        ("mixtral_8x7b_instruct_v0_1", "Conversation roles must alternate user/assistant/user/assistant/..."),
    ],
)  # fmt: skip
def test_a_system_message_the_template_raises_on_skips_the_row_by_name(bpe, name, why):
    """Gemma 2 and Mixtral take no system message: such a row is skipped, named by the
    template's own error."""
    tokenizer = published(bpe, name)
    tokenize = Tokenize(tokenizer, "messages", DocumentFormat.chat, ChatTurns.full)
    out = tokenize({"messages": [conversation(0)]}, [0])
    assert out["skipped"] == ["template_error"]
    assert out["note"] == [f"input row 0: {why}"]


def reasoning(inline: bool) -> list[dict]:
    """conversation(0) whose replies carry reasoning, as a field or inside the content."""
    messages = conversation(0)
    for i, thought in ((2, "first I think"), (4, "then I think")):
        if inline:
            messages[i] = {**messages[i], "content": f"<think>\n{thought}\n</think>\n\n{messages[i]['content']}"}  # fmt: skip
        else:
            messages[i] = {**messages[i], "reasoning_content": thought}
    return messages


FIRST_THOUGHT = "<think>\nfirst I think\n</think>\n\nhello number 0<|im_end|>"
LAST_THOUGHT = "<think>\nthen I think\n</think>\n\nthe quick fox<|im_end|>"


@pytest.mark.parametrize("inline", [False, True], ids=["reasoning_content", "think_in_content"])
def test_qwen3_trains_the_reasoning_its_rendering_keeps(bpe, inline):
    """Qwen3 drops the reasoning of replies before the last question: the first reply is
    trained without it, as the model will see its own history; the last with it."""
    tokenizer, messages = published(bpe, "qwen3"), reasoning(inline)
    [made] = prepared(tokenizer, messages)
    assert_trains_exactly(tokenizer, messages, made, ["hello number 0<|im_end|>", LAST_THOUGHT])


@pytest.mark.parametrize("inline", [False, True], ids=["reasoning_content", "think_in_content"])
def test_qwen3_each_turn_trains_every_replys_reasoning(bpe, inline):
    """--chat-turns each: one document per reply, ending with it, so every reasoning is
    rendered and trained; the earlier reply is context there, untrained."""
    tokenizer, messages = published(bpe, "qwen3"), reasoning(inline)
    first, last = prepared(tokenizer, messages, ChatTurns.each)
    assert_trains_exactly(tokenizer, messages[:3], first, [FIRST_THOUGHT])
    assert_trains_exactly(tokenizer, messages, last, [LAST_THOUGHT])


@pytest.mark.parametrize("name", PUBLISHED)
def test_each_turn_of_a_published_template_trains_its_reply(bpe, name):
    """--chat-turns each: a document per reply, ending with it, trains that reply alone, as
    the template renders it ending the conversation."""
    tokenizer, spec = published(bpe, name), PUBLISHED[name]
    messages = plain(spec)
    first, last = prepared(tokenizer, messages, ChatTurns.each)
    first_alone = spec.first_alone or spec.trained[0]
    assert_trains_exactly(tokenizer, messages[:-2], first, [first_alone])
    assert_trains_exactly(tokenizer, messages, last, [spec.trained[1]])


def test_smollm3_trains_every_replys_reasoning_and_its_no_think_block(bpe):
    """SmolLM3 keeps inline reasoning in every reply, and its markers hold the empty thinking
    block it writes in /no_think mode: both are trained, header to newline, as marked."""
    tokenizer, thinking = published(bpe, "smollm3_3b"), reasoning(inline=True)
    [made] = prepared(tokenizer, thinking)
    trained = [f"<|im_start|>assistant\n{m['content']}<|im_end|>\n" for m in thinking[2::2]]
    assert_trains_exactly(tokenizer, thinking, made, trained)
    plain_chat = [{"role": "system", "content": "be brief /no_think"}, *conversation(0)[1:]]
    [made] = prepared(tokenizer, plain_chat)
    no_think = "<|im_start|>assistant\n<think>\n\n</think>\n"
    trained = [f"{no_think}{r}\n" for r in replies("<|im_end|>")]
    assert_trains_exactly(tokenizer, plain_chat, made, trained)


TOOL_CALL = {
    "type": "function",
    "id": "call00001",
    "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}},
}
TOOL_CHAT = [
    {"role": "user", "content": "what is six times seven"},
    {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
    {"role": "tool", "content": "42", "tool_call_id": "call00001"},
    {"role": "assistant", "content": "forty two"},
]


QWEN_CALL = (
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call><|im_end|>'
)


@pytest.mark.parametrize(
    ("name", "trained"),
    [
        ("qwen3", [QWEN_CALL, "<think>\n\n</think>\n\nforty two<|im_end|>"]),
        ("qwen2_5_7b_instruct", [QWEN_CALL, "forty two<|im_end|>"]),
        ("llama3_1_8b_instruct", ['{"name": "multiply", "parameters": {"a": 6, "b": 7}}<|eot_id|>', "forty two<|eot_id|>"]),
    ],
)  # fmt: skip
def test_a_reply_of_tool_calls_is_trained_as_the_template_writes_it(bpe, name, trained):
    """Qwen writes a separator before the call only after content; Llama 3 leaves the empty
    content out: the call is found all the same, after the generation prompt."""
    tokenizer = published(bpe, name)
    [made] = prepared(tokenizer, TOOL_CHAT)
    assert_trains_exactly(tokenizer, TOOL_CHAT, made, trained)


def refusal(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> str:
    with pytest.raises(Exception) as raised:
        prepared(tokenizer, messages)
    return str(raised.value)


@pytest.mark.parametrize("name", ["mistral_nemo_instruct_2407", "mistral_7b_instruct_v0_3"])
def test_a_reply_of_tool_calls_mistral_writes_without_a_prompt_is_refused_by_name(bpe, name):
    """Mistral writes no generation prompt and leaves a tool-call reply's content out: nothing
    tells where that reply begins."""
    why = refusal(published(bpe, name), TOOL_CHAT)
    assert "input row 0, message 1: the template does not write this reply's content once, as given (it leaves it out, or repeats it), and writes no generation prompt the rendering starts with" in why  # fmt: skip


# the end of turn written once, after the last reply: the first reply ends in none
END_OF_TURN_ONCE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|end|>"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
REPLY_TWICE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ m['content'] }}<|end|>{% endfor %}"  # fmt: skip


@pytest.mark.parametrize(
    ("template", "why"),
    [
        (END_OF_TURN_ONCE, "message 2: the template ends this reply with '<|end|>' when it ends the conversation but writes '<|user|>again<|assistant|>the quick fox<|end|>' after it when more follow: the end of turn '<|end|>' does not end every reply"),
        (REPLY_TWICE, "the template writes the reply of no probe conversation ([user, assistant], with or without a system message first) once, as given, so the token that ends a reply is unknown"),
    ],
    ids=["end_of_turn_after_the_last_reply_only", "reply_written_twice"],
)  # fmt: skip
def test_a_template_whose_replies_cannot_be_located_is_refused_by_name(
    tmp_path, bpe, capsys, template, why
):
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="<eos>")
    tokenizer.chat_template = template
    tokenizer.save_pretrained(tmp_path / "tok")
    corpus = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation(0)}])
    assert prepare(tmp_path / "tok", [corpus], tmp_path / "out", "--format", "chat") == 2
    err = capsys.readouterr().err
    assert f"--tokenizer {tmp_path / 'tok'}: its chat template cannot show which tokens are the assistant's in input row 0, {why}" in err  # fmt: skip
    assert "{% generation %}" in err
    assert not (tmp_path / "out").exists()


# markers around the content alone: the template's thinking block after its prompt is untrained
MARKED_CONTENT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "{% if loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize(
    "template", [MARKED_CONTENT, THINKING_WITH_MARKERS], ids=["content", "reply"]
)
def test_generation_markers_win_in_each_turn(bpe, template):
    """Each turn's document trains what the markers mark in its own last reply, not the
    thinking block the rendering puts after the generation prompt."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="<eos>")
    tokenizer.chat_template = template
    messages = conversation(0)
    first, last = prepared(tokenizer, messages, ChatTurns.each)
    assert_trains_exactly(tokenizer, messages[:3], first, ["hello number 0<|im_end|>"])
    assert_trains_exactly(tokenizer, messages, last, ["the quick fox<|im_end|>"])


@pytest.fixture
def qwen3_dir(tmp_path, bpe) -> Path:
    published(bpe, "qwen3").save_pretrained(tmp_path / "qwen3")
    return tmp_path / "qwen3"


def test_qwen3_plain_and_reasoning_chats_prepare_with_exact_masks(tmp_path, qwen3_dir):
    """The acceptance case of #50: the published Qwen3 template, refused before, prepares
    plain chats and chats with reasoning through the command, one document per conversation."""
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    rows = [conversation(0), reasoning(inline=False), reasoning(inline=True)]
    corpus = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in rows])
    assert prepare(qwen3_dir, [corpus], tmp_path / "out", "--format", "chat") == 0
    trained = [PUBLISHED["qwen3"].trained, *[("hello number 0<|im_end|>", LAST_THOUGHT)] * 2]
    for messages, pieces, made in zip(rows, trained, documents(tmp_path / "out"), strict=True):
        assert_trains_exactly(tokenizer, messages, (made[0].tolist(), made[1].tolist()), list(pieces))  # fmt: skip
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["chat_turns"] == "full"
    assert summary["end_of_turn_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_each_turn_is_a_document_and_a_conversations_turns_stay_in_one_split(
    tmp_path, qwen3_dir, capsys
):
    rows = [reasoning(inline=False)] * 4 + [conversation(0)[:2]]
    corpus = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in rows])
    flags = ("--format", "chat", "--chat-turns", "each", "--eval-fraction", "0.25")
    assert prepare(qwen3_dir, [corpus], tmp_path / "out", *flags) == 0
    assert "first no_reply: input row 4: no assistant message" in capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["chat_turns"] == "each"
    assert summary["skipped_rows"] == {"no_reply": 1}
    assert summary["splits"]["train"]["documents"] == 6
    assert summary["splits"]["eval"]["documents"] == 2
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    for i, (tokens, mask) in enumerate(documents(tmp_path / "out")):
        assert tokenizer.decode(tokens[mask]) == (FIRST_THOUGHT, LAST_THOUGHT)[i % 2]


def test_each_turn_needs_chat_rows(tmp_path, qwen3_dir, capsys):
    corpus = write_jsonl(tmp_path / "text.jsonl", [{"text": "hello"}])
    assert prepare(qwen3_dir, [corpus], tmp_path / "out", "--chat-turns", "each") == 2
    assert "--chat-turns each: splits conversations into turns, so it needs --format chat" in capsys.readouterr().err  # fmt: skip

"""Which tokens of a chat are trained on: the assistant's replies, each with the end-of-turn
text the template writes after it (e.g. `<|im_end|>`, `<|eot_id|>`, `</s>`), and nothing else.

A template with `{% generation %}` markers says itself what the assistant generates, and
transformers' assistant mask is used. Any other template is read from its renderings: the
reply to message i lies between the rendering of messages[:i] and that of messages[:i+1],
after the header the template writes before any reply (learned by rendering a placeholder as
the reply). A template for which this does not hold exactly (it rewrites earlier text when a
message is added, or writes a header that depends on the reply) is refused, never guessed.

A token is trained when it holds at least one trained character, the rule of transformers'
assistant mask: a token that straddles the header and the reply (" Hello" after "[/INST]",
its space the template's) is trained, so the reply's first token is never lost.
"""

from __future__ import annotations

import re
from typing import Any

import jinja2
import numpy as np
from transformers import BatchEncoding, PreTrainedTokenizerBase

Messages = list[dict[str, Any]]
Spans = list[tuple[int, int]]

# transformers' own test for a template with generation markers
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
# rendered as a reply to learn the text the template writes around replies
PLACEHOLDER = "SLURMAUTOSPREPLYPLACEHOLDER"
MARKERS_FIX = (
    "mark what the assistant generates with {% generation %}...{% endgeneration %} in the "
    "template (transformers' assistant mask, used as is), or use a template whose rendering "
    "of a conversation's beginning is the beginning of its rendering"
)


class TemplateRejected(Exception):
    """The chat template raised on a conversation (e.g. a role it does not know): the row is
    skipped and counted."""


class Unmaskable(Exception):
    """The template's rendering does not show which characters are the assistant's."""


def uses_generation_markers(tokenizer: PreTrainedTokenizerBase) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and GENERATION_MARKER.search(template) is not None


def render(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> str:
    """The conversation as the template writes it (no generation prompt); TemplateRejected
    when the template raises."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except jinja2.TemplateError as err:
        raise TemplateRejected(str(err)) from err
    assert isinstance(text, str)
    return text


def reply_spans(tokenizer: PreTrainedTokenizerBase, messages: Messages, full: str) -> Spans:
    """The character spans of `full` (the rendering of `messages`) trained on: each assistant
    reply and the end-of-turn text after it. Unmaskable names the message that defeats it."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            spans.append(_reply_span(tokenizer, messages, i, full))
    return spans


def _reply_span(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, i: int, full: str
) -> tuple[int, int]:
    try:
        before = render(tokenizer, messages[:i]) if i else ""  # transformers refuses no messages
        through = render(tokenizer, messages[: i + 1])
        held = render(tokenizer, [*messages[:i], {**messages[i], "content": PLACEHOLDER}])
    except TemplateRejected as err:
        raise Unmaskable(
            f"message {i}: the template raises on the conversation up to it ({err})"
        ) from err
    if not (full.startswith(through) and through.startswith(before) and held.startswith(before)):
        raise Unmaskable(
            f"message {i}: the template renders a conversation differently from its beginning "
            "(text before this reply changes once it or a later message is added)"
        )
    turn = held[len(before) :]
    if turn.count(PLACEHOLDER) != 1:
        raise Unmaskable(f"message {i}: the template does not write a reply once, as given")
    header, footer = turn.split(PLACEHOLDER)
    start, end = len(before) + len(header), len(through) - len(footer)
    reply = through[start:end]
    content = messages[i]["content"]
    if not (
        start <= end
        and through.startswith(header, len(before))
        and through.endswith(footer)
        and reply in content
        and reply.strip() == content.strip()
    ):
        raise Unmaskable(
            f"message {i}: the text the template writes around this reply differs from what it "
            f"writes around another (header {header!r}, end of turn {footer!r}), so the reply "
            "cannot be told from the template's text"
        )
    return start, len(through)


def trained_tokens(offsets: list[tuple[int, int]], spans: Spans) -> list[int]:
    """1 for each token (by its character offsets) that holds a trained character."""
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    trained = np.zeros(len(bounds), dtype=bool)
    for begin, end in spans:
        trained |= (bounds[:, 0] < end) & (bounds[:, 1] > begin)
    return trained.astype(np.uint8).tolist()


def encode_with_markers(
    tokenizer: PreTrainedTokenizerBase, messages: Messages
) -> tuple[list[int], list[int]]:
    """Token ids and their mask by the template's own definition of the assistant's tokens
    (its generation markers); a conversation with replies that its markers leave untrained is
    refused (markers only in the generation prompt, say), not trained on nothing."""
    try:
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
    except jinja2.TemplateError as err:
        raise TemplateRejected(str(err)) from err
    assert isinstance(out, BatchEncoding)
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    if any(m["role"] == "assistant" and m["content"].strip() for m in messages) and not any(mask):
        raise Unmaskable(
            "the template's {% generation %} markers cover none of its assistant messages; "
            "put them around each reply"
        )
    return ids, mask


def end_of_turn_token(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The first token of what the template writes after a reply, blanks aside (<|im_end|>,
    <|eot_id|>, </s>): generation stops there. None when the template writes nothing there
    or renders no probe conversation."""
    text = end_of_turn_text(tokenizer) or ""
    ids = tokenizer(text.lstrip(), add_special_tokens=False)["input_ids"]
    return int(ids[0]) if ids else None


def missing_end_of_turn(tokenizer: PreTrainedTokenizerBase) -> str:
    """Why the template's replies would end in no trained token (empty: they do). A reply's
    trained tokens end with what the template writes after it; blanks alone (an end of turn
    written only between turns, or a newline) give the model no token that ends a reply,
    and generation would not stop."""
    text = end_of_turn_text(tokenizer)
    if text is None or text.strip():
        return ""
    return (
        f"its chat template writes {text!r} after the assistant's last reply: no token of its "
        "own ends a reply (an end of turn written only between turns, or a newline), so the "
        "loss would train none and generation would not stop. End every reply with an "
        f"end-of-turn token in the template (its EOS {tokenizer.eos_token!r}, or one like "
        "<|im_end|>)"
    )


def end_of_turn_text(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """What the template writes after an assistant's reply that ends the conversation; None
    when it renders no probe conversation."""
    probes: list[Messages] = [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": PLACEHOLDER}],
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": PLACEHOLDER},
        ],
    ]
    for messages in probes:
        try:
            text = render(tokenizer, messages)
        except TemplateRejected:
            continue
        if text.count(PLACEHOLDER) == 1:
            return text.split(PLACEHOLDER)[1]
    return None

"""Which tokens of a chat are trained on: the assistant's replies, each through the end-of-turn
token the template writes after it (e.g. `<|im_end|>`, `<|eot_id|>`, `</s>`), and nothing else.

A template with `{% generation %}` markers says itself what the assistant generates, and
transformers' assistant mask is used, each reply carried through the end-of-turn token the
markers may leave out. Any other template is read from renderings of the whole conversation
(`chat_replies.py`): each reply as the template writes it there, so a reply whose reasoning the
template drops from the history is trained without it, as the model will see it. A template
for which no reply can be located exactly is refused, never guessed.

A token is trained when it holds at least one trained character, the rule of transformers'
assistant mask: a token that straddles the header and the reply (" Hello" after "[/INST]",
its space the template's) is trained, so the reply's first token is never lost.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

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
    "template (transformers' assistant mask, used as is), or write each reply once, as given, "
    "with text around it that does not depend on it"
)


class Stop(NamedTuple):
    """The token that ends a reply, for generation to stop at, and its text."""

    token: int
    text: str


class TemplateRejected(Exception):
    """The chat template raised on a conversation (e.g. a role it does not know): the row is
    skipped and counted."""


class Unmaskable(Exception):
    """The template's rendering does not show which characters are the assistant's."""


def uses_generation_markers(tokenizer: PreTrainedTokenizerBase) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and GENERATION_MARKER.search(template) is not None


def render(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, generation_prompt: bool = False
) -> str:
    """The conversation as the template writes it, with the prompt for the next reply when
    `generation_prompt`; TemplateRejected when the template raises."""
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
    except jinja2.TemplateError as err:
        raise TemplateRejected(str(err)) from err
    assert isinstance(text, str)
    return text


def trained_tokens(offsets: list[tuple[int, int]], spans: Spans) -> list[int]:
    """1 for each token (by its character offsets) that holds a trained character."""
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    trained = np.zeros(len(bounds), dtype=bool)
    for begin, end in spans:
        trained |= (bounds[:, 0] < end) & (bounds[:, 1] > begin)
    return trained.astype(np.uint8).tolist()


def encode_with_markers(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, stop: Stop | None, last_only: bool
) -> tuple[list[int], list[int]]:
    """Token ids and their mask by the template's own definition of the assistant's tokens
    (its generation markers), each reply carried through the end-of-turn token `stop` that
    follows it where the markers leave it out. TRL and axolotl train that token (axolotl's
    train_on_eos: turn), and so does this: a model never taught to write it does not end its
    turns. `last_only` trains the last marked reply alone. A conversation with replies its
    markers leave untrained (markers only in the generation prompt, say), or with a reply that
    no end of turn ends, is refused (Unmaskable), not trained on nothing."""
    try:
        text = render(tokenizer, messages)
        out = tokenizer.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            tokenizer_kwargs={"return_offsets_mapping": True},
        )
    except jinja2.TemplateError as err:
        raise TemplateRejected(str(err)) from err
    assert isinstance(out, BatchEncoding)
    ids, marked, offsets = out["input_ids"], out["assistant_masks"], out["offset_mapping"]
    if any(m["role"] == "assistant" and m["content"].strip() for m in messages) and not any(marked):
        raise Unmaskable(
            "the template's {% generation %} markers cover none of its assistant messages; "
            "put them around each reply"
        )
    spans = _marked_spans(marked, offsets)[-1:] if last_only else _marked_spans(marked, offsets)
    if stop is not None:
        spans = [_through_end_of_turn(text, span, stop.text) for span in spans]
    return ids, trained_tokens(offsets, spans)


def _marked_spans(mask: list[int], offsets: list[tuple[int, int]]) -> Spans:
    """The character spans of the runs of marked tokens."""
    spans: Spans = []
    for i, marked in enumerate(mask):
        if marked and i and mask[i - 1]:
            spans[-1] = (spans[-1][0], offsets[i][1])
        elif marked:
            spans.append(offsets[i])
    return spans


def _through_end_of_turn(text: str, span: tuple[int, int], stop: str) -> tuple[int, int]:
    """`span` (a marked reply) through the end-of-turn text `stop` that ends it or follows it
    after blanks; Unmaskable when neither."""
    begin, end = span
    ends = begin + len(text[begin:end].rstrip())
    at = text.find(stop, max(begin, ends - len(stop)))
    if at < 0 or text[end:at].strip():
        raise Unmaskable(
            f"the template's {{% generation %}} markers close a reply ({text[begin:end][-40:]!r}) "
            f"that no end of turn {stop!r} ends or follows; end every reply with the end-of-turn "
            "text the template writes after the last one, inside {% endgeneration %} or right "
            "after it"
        )
    return begin, max(end, at + len(stop))


def end_of_turn_token(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The token generation stops at (see `end_of_turn_stop`); None when there is none."""
    stop = end_of_turn_stop(tokenizer)
    return stop.token if stop else None


def end_of_turn_stop(tokenizer: PreTrainedTokenizerBase) -> Stop | None:
    """The token that ends a reply: what the template writes after it, blanks aside, when
    that is one token (<|im_end|>, <|eot_id|>, </s>), or its first token when that is an added
    token, never a piece of other text (<|end|> of Phi-3's "<|end|>", newline, EOS). None when
    the template writes nothing after a reply, renders no probe conversation, or writes
    ordinary text of several tokens: their first ("<" of "<end>") also begins other text, and
    generation stopping at it would cut replies anywhere."""
    text = (end_of_turn_text(tokenizer) or "").strip()
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    if not ids or (len(ids) > 1 and ids[0] not in tokenizer.added_tokens_decoder):
        return None
    begin, end = offsets[0]
    return Stop(int(ids[0]), text[begin:end])


def unusable_end_of_turn(tokenizer: PreTrainedTokenizerBase) -> str:
    """Why the template's replies would end in no token generation can stop at (empty: they
    do). A reply's trained tokens end with what the template writes after it; blanks alone
    (an end of turn written only between turns, or a newline) give the model no token that
    ends a reply. Ordinary text of several tokens ("<end>") is refused rather than recorded
    as a stop string: generation stops at token ids, and a stop string in
    generation_config.json makes `generate` fail unless it is given the tokenizer."""
    text = end_of_turn_text(tokenizer)
    if text is None:
        return ""
    if not text.strip():
        return (
            f"its chat template writes {text!r} after the assistant's last reply: no token of "
            "its own ends a reply (an end of turn written only between turns, or a newline), "
            "so the loss would train none and generation would not stop. End every reply with "
            f"an end-of-turn token in the template (its EOS {tokenizer.eos_token!r}, or one "
            "like <|im_end|>)"
        )
    if end_of_turn_stop(tokenizer) is None:
        pieces = tokenizer.tokenize(text.strip())
        return (
            f"its chat template ends the assistant's reply with {text.strip()!r}, which the "
            f"tokenizer splits into {len(pieces)} tokens {pieces}: generation stops at one "
            f"token, and {pieces[0]!r} also begins other text. Make the end of turn one token "
            f"(tokenizer.add_special_tokens({{'additional_special_tokens': [{text.strip()!r}]}})"
            ", saved, and the model's embeddings resized to the new vocabulary), or end replies "
            f"with the tokenizer's EOS {tokenizer.eos_token!r} in the template"
        )
    return ""


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

"""Where each assistant reply lies in a chat template's rendering of a whole conversation, for
templates without `{% generation %}` markers: the text the model writes after its prompt,
through the end-of-turn token that ends the reply.

A reply's content is found by rendering the same conversation with that content replaced by a
sentinel, twice: the text before and after the sentinel must be the same both times, and the
conversation after the reply's end of turn must read the same in the real rendering. So a
template that rewrites earlier turns once more follow (Qwen3 drops old reasoning) or renders
the last turn apart (its empty `<think>` block) is read where it writes each reply, never
from renderings of a conversation's beginning; one whose text around a reply depends on that
reply is refused.

A reply begins where the template's generation prompt ends, when the rendering starts with
that prompt: what the template writes inside the reply before its content (Qwen3's `<think>`
block, a tool call) is what the model must write after that prompt, so it is trained.
Otherwise (no generation prompt, or one the rendering does not start with) it begins with its
content. It ends with the first end-of-turn token after its content, which must end the reply
the same way when it ends the conversation. A reply whose content the template leaves out (tool
calls alone, in Llama 3) is the turn the template writes after the generation prompt when the
reply ends the conversation, where the rendering holds that same turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from slurm_autosp.data.chat import Messages, Spans, Stop, TemplateRejected, Unmaskable, render

# rendered in place of a reply's content: two of one length, so no length test tells them apart
SENTINELS = ("SLURMAUTOSPREPLYAAAA", "SLURMAUTOSPREPLYBBBB")


@dataclass(frozen=True)
class Around:
    """The text a rendering holds before and after one reply's content."""

    before: str
    after: str


def reply_spans(
    tokenizer: PreTrainedTokenizerBase,
    messages: Messages,
    full: str,
    stop: Stop | None,
    last_only: bool = False,
) -> Spans:
    """The character spans of `full` (the rendering of `messages`) trained on: each assistant
    reply through its end-of-turn token, or the last message's alone (`last_only`).
    Unmaskable names the message that defeats it."""
    if stop is None:
        raise Unmaskable(
            "the template writes the reply of no probe conversation ([user, assistant], with or "
            "without a system message first) once, as given, so the token that ends a reply is "
            "unknown"
        )
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if last_only:
        replies = [i for i in replies if i == len(messages) - 1]
    return [reply_span(tokenizer, messages, i, full, stop) for i in replies]


def reply_span(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, i: int, full: str, stop: Stop
) -> tuple[int, int]:
    around = _around(tokenizer, messages, i)
    prompt = _prompt(tokenizer, messages, i, full)
    if around is None:
        return _without_content(tokenizer, messages, i, full, stop, prompt)
    turn = _turn_end(tokenizer, messages, i, around.after, stop)
    rest = around.after[turn:]  # the conversation after this reply's end of turn
    end = len(full) - len(rest)
    if not (full.endswith(rest) and full.endswith(stop.text, 0, end)):
        raise Unmaskable(
            f"message {i}: the text the template writes after this reply's end of turn depends "
            f"on the reply (with a placeholder reply it writes {rest[:60]!r})"
        )
    if prompt is not None and len(prompt) < end:
        return len(prompt), end
    if full.startswith(around.before):
        return len(around.before), end
    raise Unmaskable(
        f"message {i}: the template writes text before this reply that depends on the reply, "
        "and the rendering does not start with its generation prompt for it"
    )


def _around(tokenizer: PreTrainedTokenizerBase, messages: Messages, i: int) -> Around | None:
    """The text around message i's content in the rendering of `messages`, the same for any
    content; None when the template does not write the content once, as given."""
    found = []
    for sentinel in SENTINELS:
        held = [*messages[:i], {**messages[i], "content": sentinel}, *messages[i + 1 :]]
        try:
            text = render(tokenizer, held)
        except TemplateRejected as err:
            raise Unmaskable(
                f"message {i}: the template raises on a placeholder reply ({err})"
            ) from err
        if text.count(sentinel) != 1:
            return None
        before, after = text.split(sentinel)
        found.append(Around(before, after))
    if found[0] != found[1]:
        raise Unmaskable(
            f"message {i}: the text the template writes around this reply depends on the reply"
        )
    return found[0]


def _prompt(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, i: int, full: str
) -> str | None:
    """The generation prompt for reply i (the messages before it and the template's prompt),
    when the template writes one and `full` starts with it."""
    if not i:
        return None
    try:
        context = render(tokenizer, messages[:i])
        prompt = render(tokenizer, messages[:i], generation_prompt=True)
    except TemplateRejected:
        return None
    return prompt if prompt != context and full.startswith(prompt) else None


def _turn_end(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, i: int, after: str, stop: Stop
) -> int:
    """How far into `after` (the text after reply i's content) the reply runs: through the
    first end-of-turn token, which must end the reply the same way when it ends the
    conversation (a template that writes it only after the last reply is refused)."""
    at = after.find(stop.text)
    if at < 0:
        raise Unmaskable(f"message {i}: no end of turn {stop.text!r} follows this reply")
    end = at + len(stop.text)
    if i + 1 < len(messages):
        alone = _around(tokenizer, messages[: i + 1], i)
        if alone is None or alone.after[:end] != after[:end]:
            ending = alone.after[:end] if alone else "it differently"
            raise Unmaskable(
                f"message {i}: the template ends this reply with {ending!r} when it ends the "
                f"conversation but writes {after[:end]!r} after it when more follow: the end "
                f"of turn {stop.text!r} does not end every reply"
            )
    return end


def _without_content(
    tokenizer: PreTrainedTokenizerBase,
    messages: Messages,
    i: int,
    full: str,
    stop: Stop,
    prompt: str | None,
) -> tuple[int, int]:
    """Reply i, whose content the template does not write once as given: the turn the template
    writes after its generation prompt when the reply ends the conversation, found in `full`
    right after that prompt."""
    why = (
        f"message {i}: the template does not write this reply's content once, as given (it "
        "leaves it out, or repeats it)"
    )
    if prompt is None:
        raise Unmaskable(f"{why}, and writes no generation prompt the rendering starts with")
    alone = render(tokenizer, messages[: i + 1])
    at = alone.find(stop.text, len(prompt))
    if not alone.startswith(prompt) or at < 0:
        raise Unmaskable(f"{why}, and ends it with no end of turn {stop.text!r}")
    end = at + len(stop.text)
    if not full.startswith(alone[:end]):
        raise Unmaskable(f"{why}, and writes it otherwise when more messages follow")
    return len(prompt), end

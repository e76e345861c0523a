"""Chat prompts: the tokenizer's own template, one the user supplies, or a clear refusal.

Base models ship no chat template. transformers then raises its own message from deep inside
`apply_chat_template`; kvwise says what to do instead. A template given by the user (a file, as
vLLM's `--chat-template` takes, or the Jinja text itself) wins over the tokenizer's.

Token ids: a rendered template already holds the model's special tokens (BOS and turn markers), so
it is tokenized with `add_special_tokens=False`; a plain prompt is tokenized with them, so models
that need a BOS (Gemma, Llama 3) get it, as `model.generate(tokenizer(text))` would.
"""

from __future__ import annotations

from pathlib import Path

NO_TEMPLATE_SERVER_HINT = "use /v1/completions or start the server with --chat-template"


class NoChatTemplateError(ValueError):
    """The tokenizer has no chat template and none was given."""


def load_chat_template(source: str | Path | None) -> str | None:
    """A template from a file path, or `source` itself when it is Jinja text; None stays None."""
    if source is None:
        return None
    text = str(source)
    if "{" not in text:  # not Jinja: a path
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"chat template file {text!r} does not exist")
        text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError("the chat template is empty")
    return text


def has_chat_template(tokenizer, chat_template: str | None = None) -> bool:
    return bool(chat_template) or bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer, messages: list[dict], chat_template: str | None = None, hint: str | None = None) -> str:
    """The conversation as prompt text, ending with the assistant's turn opened.

    hint: what the user should do instead, in the error when there is no template at all."""
    if not has_chat_template(tokenizer, chat_template):
        advice = hint or "pass chat_template=... (a Jinja template or a file) or send a plain prompt"
        raise NoChatTemplateError(f"this model has no chat template; {advice}")
    return tokenizer.apply_chat_template(
        messages, chat_template=chat_template, tokenize=False, add_generation_prompt=True
    )


def plain_prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of plain text as the model's own tokenizer call gives them: with its BOS, if any."""
    return tokenizer(text).input_ids


def bos_ids(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before any plain text (BOS), possibly none."""
    with_special = tokenizer("a").input_ids
    without = tokenizer("a", add_special_tokens=False).input_ids
    if without and with_special[-len(without) :] == without:
        return with_special[: len(with_special) - len(without)]
    return []

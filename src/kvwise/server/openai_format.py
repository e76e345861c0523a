"""The JSON the OpenAI API answers with: completions, chat completions, their stream chunks,
usage and logprobs. Shapes follow the API reference so the official clients parse them."""

from __future__ import annotations

import time
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, kv: dict | list | None = None, cached_tokens: int = 0) -> dict:
    """kv: the KV mix the request ran with (kvwise's extension; absent when it kept everything by
    default), one entry, or one per choice when they differ. cached_tokens: prompt tokens found in
    the prefix cache instead of computed (OpenAI's `prompt_tokens_details.cached_tokens`)."""
    body = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if kv is not None:
        body["kv"] = kv
    return body


class Formatter:
    """Builds one response's objects; `chat` picks chat.completion(.chunk) or text_completion."""

    def __init__(self, model: str, chat: bool, tokenizer):
        self.model, self.chat, self.tokenizer = model, chat, tokenizer
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def response(self, completions, prompt_tokens: int, top_logprobs: int = 0, kv=None, cached_tokens: int = 0) -> dict:
        """completions: CompletionOutputs, one per choice; kv: see `usage`."""
        choices = []
        for completion in completions:
            choice = {"index": completion.index, "finish_reason": completion.finish_reason}
            logprobs = self.logprobs(completion.token_ids, completion.logprobs, top_logprobs)
            if self.chat:
                choice["message"] = {"role": "assistant", "content": completion.text}
            else:
                choice["text"] = completion.text
            choice["logprobs"] = logprobs
            choices.append(choice)
        body = self._envelope(sorted(choices, key=lambda c: c["index"]), chunk=False)
        body["usage"] = usage(prompt_tokens, sum(len(c.token_ids) for c in completions), kv, cached_tokens)
        return body

    def chunk(
        self, index: int, text: str | None, finish_reason: str | None, first: bool = False, logprobs: dict | None = None
    ) -> dict:
        """logprobs: `self.logprobs(...)` of the tokens this chunk's text came from, or None."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope([choice], chunk=True)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, kv=None, cached_tokens: int = 0) -> dict:
        body = self._envelope([], chunk=True)
        body["usage"] = usage(prompt_tokens, completion_tokens, kv, cached_tokens)
        return body

    def logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None, top: int) -> dict | None:
        """logprobs: per step, the chosen token's and the `top` likeliest tokens' log-probabilities."""
        if logprobs is None:
            return None
        steps = list(zip(token_ids, logprobs))  # an EOS that ended the text has no entry here
        likeliest = [sorted(options.items(), key=lambda item: -item[1])[:top] for _, options in steps]
        if self.chat:
            return {
                "content": [
                    {
                        **self._token_entry(token, options[token]),
                        "top_logprobs": [self._token_entry(t, p) for t, p in best],
                    }
                    for (token, options), best in zip(steps, likeliest)
                ]
            }
        piece = self.tokenizer.convert_ids_to_tokens
        offsets, offset = [], 0
        for token, _ in steps:
            offsets.append(offset)
            offset += len(self.tokenizer.decode([token]))
        return {
            "tokens": [piece(token) for token, _ in steps],
            "token_logprobs": [options[token] for token, options in steps],
            "top_logprobs": [{piece(t): p for t, p in best} for best in likeliest],
            "text_offset": offsets,
        }

    def _token_entry(self, token: int, logprob: float) -> dict:
        text = self.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

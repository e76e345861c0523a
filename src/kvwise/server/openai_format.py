"""The JSON the OpenAI API answers with: completions, chat completions, their stream chunks,
usage and logprobs. Shapes follow the API reference so the official clients parse them."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace


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


@dataclass(frozen=True)
class Echo:
    """What a completions response repeats of its prompts: prompts [prompt][token] (a choice's is
    prompts[index // n]); echo: the prompt's text and tokens first; score_only: max_tokens 0, so
    the generated token is left out; by_id: vLLM's prompt_logprobs field."""

    prompts: list[list[int]]
    n: int
    echo: bool
    score_only: bool
    by_id: bool


class Formatter:
    """Builds one response's objects; `chat` picks chat.completion(.chunk) or text_completion."""

    def __init__(self, model: str, chat: bool, tokenizer):
        self.model, self.chat, self.tokenizer = model, chat, tokenizer
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def response(
        self, completions, prompt_tokens: int, top_logprobs: int = 0, kv=None, cached_tokens: int = 0, echo=None
    ) -> dict:
        """completions: CompletionOutputs, one per choice; kv: see `usage`; echo: an `Echo`, or None."""
        choices = []
        for completion in completions:
            if echo is not None and echo.score_only:  # max_tokens 0: the token computed with it is not an answer
                completion = replace(completion, text="", token_ids=[], logprobs=[] if completion.logprobs else None)
            choice = {"index": completion.index, "finish_reason": completion.finish_reason}
            logprobs = self.logprobs(completion.token_ids, completion.logprobs, top_logprobs)
            if self.chat:
                choice["message"] = {"role": "assistant", "content": completion.text}
            else:
                choice["text"] = completion.text
            if echo is not None:
                prompt = echo.prompts[completion.index // echo.n]
                if echo.echo:
                    choice["text"] = self.tokenizer.decode(prompt) + completion.text
                    if logprobs is not None:
                        logprobs = self.echoed_logprobs(prompt, completion.prompt_logprobs, top_logprobs, logprobs)
                if echo.by_id:
                    choice["prompt_logprobs"] = self.prompt_logprobs_by_id(
                        prompt, completion.prompt_logprobs, completion.prompt_ranks
                    )
            choice["logprobs"] = logprobs
            choices.append(choice)
        body = self._envelope(sorted(choices, key=lambda c: c["index"]), chunk=False)
        body["usage"] = usage(prompt_tokens, sum(len(c.token_ids) for c in completions), kv, cached_tokens)
        return body

    def echoed_logprobs(self, prompt: list[int], prompt_logprobs, top: int, generated: dict) -> dict:
        """The legacy completions shape with the prompt's tokens first, as lm-evaluation-harness
        reads it (`token_logprobs[context:-1]`): the first prompt token's entries are null."""
        piece = self.tokenizer.convert_ids_to_tokens
        tokens, token_logprobs, top_logprobs, offsets, offset = [], [], [], [], 0
        for token, options in zip(prompt, prompt_logprobs):
            tokens.append(piece(token))
            offsets.append(offset)
            offset += len(self.tokenizer.decode([token]))
            if options is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(options[token])
            best = sorted(options.items(), key=lambda item: -item[1])[:top]
            top_logprobs.append({piece(t): p for t, p in best})
        return {
            "tokens": tokens + generated["tokens"],
            "token_logprobs": token_logprobs + generated["token_logprobs"],
            "top_logprobs": top_logprobs + generated["top_logprobs"],
            "text_offset": offsets + [offset + start for start in generated["text_offset"]],
        }

    def prompt_logprobs_by_id(self, prompt: list[int], prompt_logprobs, ranks) -> list:
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank,
        decoded_token}} for the token itself (its rank in the vocabulary) and the top alternatives
        (ranks 1, 2, ...)."""
        entries = []
        for token, options, rank in zip(prompt, prompt_logprobs, ranks):
            if options is None:
                entries.append(None)
                continue
            alternatives = sorted((item for item in options.items() if item[0] != token), key=lambda item: -item[1])
            # an alternative's rank counts the prompt token too when that one is likelier
            ranked = [
                (token, options[token], rank),
                *((t, p, i + 1 if i + 1 < rank else i + 2) for i, (t, p) in enumerate(alternatives)),
            ]
            entries.append(
                {str(t): {"logprob": p, "rank": r, "decoded_token": self.tokenizer.decode([t])} for t, p, r in ranked}
            )
        return entries

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

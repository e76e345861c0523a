"""`pipeline("kvwise-text-generation")`: kvpress's pipeline, on kvwise's caches.

    import kvwise  # registers the task
    from transformers import pipeline

    pipe = pipeline("kvwise-text-generation", model=model, tokenizer=tokenizer, policy="kvzip", compression_ratio=0.9)
    pipe(context, question="What is the access code?")["answer"]
    pipe(context, questions=["Who?", "When?"])["answers"]

The context is compressed once, before any question is read (query-agnostic, as kvpress's
pipeline does), and each question is answered greedily from its own copy of the compressed
cache. With a chat template, the context and the question form one user turn; without one (a base
model), the question follows the context on a new line. Options, at construction or per call:
`policy`, `compression_ratio`, `quant`, `max_new_tokens`, and any policy hyperparameter.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from kvwise.hf.cache import KVWiseCache
from kvwise.hf.chat_template import bos_ids, has_chat_template, render_chat
from kvwise.hf.compressed_contexts import cache_state, restore_cache_state

TASK = "kvwise-text-generation"


class KVWisePipeline(Pipeline):
    def _sanitize_parameters(self, question=None, questions=None, max_new_tokens=None, **options):
        if question is not None and questions is not None:
            raise ValueError("give question= or questions=, not both")
        preprocess = {}
        if question is not None or questions is not None:
            preprocess = {"questions": [question] if question is not None else list(questions)}
        forward = dict(options)
        if max_new_tokens is not None:
            forward["max_new_tokens"] = max_new_tokens
        return preprocess, forward, {"single": questions is None}

    def preprocess(self, context: str, questions: list[str] | None = None):
        """The context's token ids [1, n], and each question's [1, m] that follows it."""
        if not isinstance(context, str) or not context.strip():
            raise ValueError("the context must be non-empty text")
        context = context.strip()  # chat templates trim a message's ends: the context is found as rendered
        questions = questions or [""]
        tokenizer = self.tokenizer
        context_ids, question_ids = None, []
        for question in questions:
            if has_chat_template(tokenizer):
                whole = render_chat(tokenizer, [{"role": "user", "content": f"{context}\n\n{question}".strip()}])
                cut = whole.index(context) + len(context)
                head, tail = whole[:cut], whole[cut:]
                head_ids = tokenizer(head, add_special_tokens=False).input_ids
            else:
                head_ids = bos_ids(tokenizer) + tokenizer(context, add_special_tokens=False).input_ids
                tail = f"\n\n{question}\n" if question else "\n"
            context_ids = context_ids or head_ids
            question_ids.append(torch.tensor([tokenizer(tail, add_special_tokens=False).input_ids]))
        return {"context_ids": torch.tensor([context_ids]), "question_ids": question_ids}

    @torch.no_grad()
    def _forward(self, inputs, policy="full", compression_ratio=0.0, quant=None, max_new_tokens=50, **policy_kwargs):
        model, device = self.model, self.model.device
        context_ids = inputs["context_ids"].to(device)

        def new_cache():
            return KVWiseCache(model, policy, compression_ratio, tokenizer=self.tokenizer, quant=quant, **policy_kwargs)

        compressed = new_cache()
        compressed.compress_context(context_ids)
        state = {name: tensor.clone() for name, tensor in cache_state(compressed).items()}
        answers = []
        for question_ids in inputs["question_ids"]:
            cache = new_cache()
            restore_cache_state(cache, {name: tensor.clone() for name, tensor in state.items()}, device)
            answers.append(self._greedy(cache, question_ids.to(device), max_new_tokens))
        return {"answers": answers, "context_length": context_ids.shape[1], "cache_bytes": compressed.nbytes()}

    def _greedy(self, cache: KVWiseCache, question_ids: torch.Tensor, max_new_tokens: int) -> list[int]:
        """Greedy tokens after the question, up to EOS (not included) or `max_new_tokens`."""
        stop = self.tokenizer.eos_token_id
        tokens, next_ids = [], question_ids
        for _ in range(max_new_tokens):
            logits = self.model(input_ids=next_ids, cache=cache, use_cache=True, logits_to_keep=1).logits
            token = int(logits[0, -1].argmax())
            if token == stop:
                break
            tokens.append(token)
            next_ids = torch.tensor([[token]], device=question_ids.device)
        return tokens

    def postprocess(self, outputs, single=True):
        answers = [self.tokenizer.decode(tokens, skip_special_tokens=True).strip() for tokens in outputs["answers"]]
        return {"answer": answers[0]} if single else {"answers": answers}


def register() -> None:
    """Make `pipeline("kvwise-text-generation", ...)` available (importing kvwise does this)."""
    if TASK not in PIPELINE_REGISTRY.get_supported_tasks():
        PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=KVWisePipeline, pt_model=AutoModelForCausalLM)

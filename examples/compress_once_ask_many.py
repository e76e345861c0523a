"""Compress a document once, then answer several questions about it from the compressed KV.

    python examples/compress_once_ask_many.py [--policy kvzip] [--ratio 0.75] [--quant kivi4]

The engine computes the document, compresses it (query-agnostically: before any question is read)
and publishes the compressed region; each later request with the same document reuses it and
computes only its question.
"""

from __future__ import annotations

import argparse

from kvwise import LLM, Mix, SamplingParams

DOCUMENT = (
    "The harbour office keeps three ledgers. The blue ledger lists the ferries and their crews. "
    "The red ledger records every storm since 1902; the worst, in March 1953, sank two trawlers. "
    "The green ledger holds the lighthouse accounts, and its last page says the lamp was replaced "
    "in 2011 for 4,300 crowns. "
) * 6
QUESTIONS = ["Which ledger records the storms?", "When was the worst storm?", "How much did the new lamp cost?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="kvzip")
    parser.add_argument("--ratio", type=float, default=0.75)
    parser.add_argument("--quant", default=None)
    args = parser.parse_args()

    llm = LLM()  # the embedded SmolLM2; LLM("your/model") for another
    tokenizer = llm.tokenizer
    prompts, upto = [], []
    for question in QUESTIONS:
        messages = [{"role": "user", "content": f"{DOCUMENT}\n\n{question}"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        head = text[: text.index(DOCUMENT) + len(DOCUMENT)]
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
        upto.append(len(tokenizer(head, add_special_tokens=False).input_ids))  # where the document ends
    settings = Mix(args.policy, ratio=args.ratio, quant=args.quant)
    params = SamplingParams(temperature=0, max_tokens=24)
    first = llm.generate(prompts[:1], params, kv=settings, compress_upto=upto[:1], use_tqdm=False)
    rest = llm.generate(prompts[1:], params, kv=settings, compress_upto=upto[1:], use_tqdm=False)
    for question, output in zip(QUESTIONS, first + rest):
        request = output.requests[0]
        reused = "reused the compressed document" if request.compressed_hit else "compressed the document"
        print(f"Q: {question}\nA: {output.outputs[0].text.strip()}  ({reused})\n")


if __name__ == "__main__":
    main()

"""From kvpress to kvwise: the same pipeline call, with the press's name as a policy.

    # kvpress
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    pipe(context, question=question, press=KVzipPress(compression_ratio=0.5))["answer"]

    # kvwise
    pipe = pipeline("kvwise-text-generation", model=model, tokenizer=tokenizer)
    pipe(context, question=question, policy="kvzip", compression_ratio=0.5)["answer"]

docs/policies.md maps every press to its policy.
"""

from __future__ import annotations

import argparse

from transformers import pipeline

import kvwise  # registers "kvwise-text-generation"

CONTEXT = (
    "Field notes, day 14. The research station's generator failed at dawn. The spare fuse is kept in "
    "the blue toolbox under the radio desk, and the radio frequency for the supply boat is 156.8 MHz. "
) * 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="an HF id or folder (default: the embedded SmolLM2)")
    parser.add_argument("--policy", default="kvzip")
    parser.add_argument("--ratio", type=float, default=0.5)
    args = parser.parse_args()
    model, tokenizer = kvwise.load_model(args.model)
    pipe = pipeline("kvwise-text-generation", model=model, tokenizer=tokenizer)
    questions = ["Where is the spare fuse kept?", "What is the radio frequency for the supply boat?"]
    answers = pipe(CONTEXT, questions=questions, policy=args.policy, compression_ratio=args.ratio, max_new_tokens=24)
    for question, answer in zip(questions, answers["answers"]):
        print(f"Q: {question}\nA: {answer}\n")


if __name__ == "__main__":
    main()

"""`kvwise demo` (what `make run` runs): compress a long essay, then ask about it."""

from __future__ import annotations

from kvwise.bench.haystack import read_haystack
from kvwise.hf.run import generate_with_report
from kvwise.models import load_model

_NEEDLE = "\nThe secret code word of the archive is {word}.\n"
_QUESTION = "\n\nWhat is the secret code word of the archive mentioned in the text above? Answer in one sentence."


def run_demo(policy: str = "kvzip", ratio: float = 0.9, model_name: str | None = None, context_tokens: int = 1500):
    model, tokenizer = load_model(model_name)
    essays = read_haystack()
    head = tokenizer.decode(tokenizer(essays, add_special_tokens=False).input_ids[:context_tokens])
    middle = len(head) // 2
    document = head[:middle] + _NEEDLE.format(word="PELICAN") + head[middle:]
    print(
        f"model: {model.name_or_path} on {model.device}; "
        f"document: {context_tokens} essay tokens with a hidden code word"
    )
    print(f"policy: {policy}, compression_ratio: {ratio} (fraction of the KV removed)")
    report = generate_with_report(
        document + _QUESTION, (model, tokenizer), policy=policy, ratio=ratio, max_new_tokens=24
    )
    print(f"answer: {report.completion.strip()}")
    print(f"KV bytes before compression: {report.full_kv_bytes:,}")
    print(f"KV bytes after compression:  {report.compressed_kv_bytes:,}")
    print(f"compression achieved:        {report.compression:.1f}x")
    return report

"""Run kvwise's needle-in-a-haystack benchmark on your own model, on a quick grid.

    python examples/bench_your_model.py --model /path/to/model [--out results/mine]

The bench writes JSON, a Markdown table and plots under --out, and resumes if interrupted.
`kvwise bench ppl --model M` measures perplexity the same way. The commands take larger grids
(see `kvwise bench niah --help`), your own haystack (`--haystack-dir`) and needle (`--needle`,
`--question`, `--answer-prefix`).
"""

from __future__ import annotations

import argparse

from kvwise.cli import main as kvwise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="an HF id or folder (default: the embedded SmolLM2)")
    parser.add_argument("--out", default="results/mine")
    parser.add_argument("--policies", default="full,snapkv,kvzip")
    parser.add_argument("--lengths", default="1000")
    args = parser.parse_args()
    model = ["--model", args.model] if args.model else []
    niah = ["bench", "niah", "--quick", "--policies", args.policies, "--lengths", args.lengths]
    status = kvwise([*niah, *model, "--out", f"{args.out}/niah"])
    if status == 0:
        print(open(f"{args.out}/niah/niah.md").read())
    raise SystemExit(status)


if __name__ == "__main__":
    main()

"""Two tenants on one kvwise server: each reuses its own cached prefixes and never the other's.

    python examples/server_with_tenants.py [--port 8011]

Starts `kvwise serve` with a key file (alice and bob), asks the same long prompt as alice twice and
then as bob, and prints `usage.prompt_tokens_details.cached_tokens`: alice's second request hits
her cache, bob's does not, though the text is the same. Stops the server at the end.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from openai import OpenAI

PROMPT = "Summarise this inventory. " + " ".join(f"Crate {n} holds {n * 3} lamps." for n in range(40))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8011)
    args = parser.parse_args()
    keys = Path(tempfile.mkdtemp()) / "api_keys.txt"
    keys.write_text("sk-alice alice\nsk-bob bob\n")
    command = [sys.executable, "-m", "kvwise.cli", "serve", "--port", str(args.port), "--api-keys", str(keys)]
    server = subprocess.Popen([*command, "--log-level", "warning"])
    base = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"kvwise serve exited with {server.returncode}")
            time.sleep(0.5)
        else:
            raise SystemExit("kvwise serve did not come up within 5 minutes")
        for tenant, key in (("alice", "sk-alice"), ("alice", "sk-alice"), ("bob", "sk-bob")):
            client = OpenAI(base_url=f"{base}/v1", api_key=key)
            reply = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8)
            cached = reply.usage.prompt_tokens_details.cached_tokens
            print(f"{tenant}: {reply.usage.prompt_tokens} prompt tokens, {cached} from the cache")
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()

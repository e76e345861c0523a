"""Bad input gets one clear error: ValueError from the API, one line and exit 2 from the CLI."""

import pytest

from kvwise import KVWiseCache, make_policy
from kvwise.cli import main


def test_unknown_policy_lists_names(llama):
    with pytest.raises(ValueError, match="unknown policy 'snapk'; choose one of: full, random, .*snapkv"):
        KVWiseCache(llama, "snapk")


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5])
def test_ratio_out_of_range(llama, ratio):
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        KVWiseCache(llama, "snapkv", compression_ratio=ratio)


def test_unknown_policy_option():
    with pytest.raises(ValueError, match="has no option window"):
        make_policy("snapkv", window=3)


def test_context_longer_than_model_maximum(llama):
    import torch

    cache = KVWiseCache(llama, "snapkv", compression_ratio=0.5)
    with pytest.raises(ValueError, match="maximum is 512"):
        cache.compress_context(torch.zeros(1, 600, dtype=torch.long))


def test_bad_max_kv_tokens(llama):
    with pytest.raises(ValueError, match="max_kv_tokens"):
        KVWiseCache(llama, "h2o", max_kv_tokens=0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--prompt", "x", "--policy", "snapk"], "unknown policy 'snapk'; choose one of"),
        (["generate", "--prompt", "x", "--ratio", "1.2"], "must be in [0, 1)"),
        (["generate", "--prompt-file", "/no/such/file"], "cannot read prompt file"),
        (["bench", "niah", "--policies", "nope"], "unknown policy 'nope'"),
        (["bench", "niah", "--ratios", "0.5,2"], "must be in [0, 1)"),
        (["bench", "niah", "--quant", "kivi3"], "unknown quantizer 'kivi3'"),
        (["generate", "--prompt", "x", "--quant", "int4"], "unknown quantizer 'int4'"),
        (["bench", "ppl", "--mixes", "h2o@max=many+kivi4"], "max= takes a whole number"),
        (["bench", "ppl", "--peers", "bitsandbytes"], "unknown peer 'bitsandbytes'"),
        (["bench", "ppl", "--quants", "kivi8"], "unknown quantizer 'kivi8'"),
        (["bench", "ppl", "--budgets", "0"], "budgets must be positive"),
    ],
)
def test_cli_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_cli_context_too_long(tmp_path, capsys, monkeypatch):
    """A prompt longer than the model's maximum fails before any compute, naming the maximum."""
    from tests.conftest import TINY_MODELS

    model = TINY_MODELS["llama"]()

    class Tokenizer:
        chat_template = None
        eos_token_id = 2

        def __call__(self, text, return_tensors=None, **kwargs):
            import torch

            class Encoded:
                input_ids = torch.ones(1, len(text.split()), dtype=torch.long)

            return Encoded()

    monkeypatch.setattr("kvwise.models.load_model", lambda name=None, **kw: (model, Tokenizer()))
    prompt = tmp_path / "long.txt"
    prompt.write_text("word " * 700)
    assert main(["generate", "--prompt-file", str(prompt), "--no-chat-template"]) == 2
    assert "the model's maximum is 512" in capsys.readouterr().err


def test_unknown_preset(llama):
    with pytest.raises(ValueError, match="unknown preset 'tiny'; choose one of: int8, kivi4"):
        KVWiseCache.from_preset(llama, "tiny")


def test_unknown_quantizer_in_the_cache(llama):
    with pytest.raises(ValueError, match="unknown quantizer 'kivi3'; choose one of: none, kivi2, kivi4, int8, fp8"):
        KVWiseCache(llama, "full", quant="kivi3")

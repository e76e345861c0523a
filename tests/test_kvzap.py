"""kvzap: KVzip's selection from a learned surrogate of its scores, in the library and the engine;
the surrogate's training, file and errors."""

from __future__ import annotations

import pytest
import torch

from kvwise.adaptive.surrogate_training import SurrogateConfig, fit_layer, fit_surrogate
from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.sampling import SamplingParams
from kvwise.hf.attention_inputs import attention_modules
from kvwise.hf.cache import KVWiseCache
from kvwise.policies.base import PROTECTED
from kvwise.policies.kvzap import KVzapPolicy
from kvwise.policies.mix import Mix
from kvwise.policies.score_surrogate import ScoreSurrogate, find_surrogate
from kvwise.policies.selection import kept_per_head, select_across_layers
from tests.conftest import random_ids
from tests.kvzap_helpers import random_surrogate

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def surrogate_file(llama, tmp_path):
    return random_surrogate(llama).save(tmp_path / "tiny.kvzap.safetensors")


def _expected_keep(model, surrogate, ids, ratio):
    """The keep mask kvzap must produce: the surrogate's scores of a plain forward's attention
    inputs, sinks protected, one threshold over every layer and head."""
    inputs = {}

    def record(module, args, kwargs):
        inputs[module.layer_idx] = kwargs["hidden_states"]

    hooks = [m.register_forward_pre_hook(record, with_kwargs=True) for m in attention_modules(model)]
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    scores = torch.stack([surrogate.log_scores(layer, inputs[layer]).exp()[0] for layer in sorted(inputs)])
    scores[:, :, :4] = PROTECTED  # num_sinks
    valid = torch.ones_like(scores, dtype=torch.bool)
    return select_across_layers(KVzapPolicy(), ratio, scores[None], valid[None])[0]  # [layers, heads, tokens]


def _kept_positions(layer) -> list[list[int]]:
    """Sorted original positions each KV head of a library layer keeps."""
    _, _, valid = layer.padded()  # valid [1, kv_heads, max_len]
    positions = layer.padded_positions(valid)
    return [sorted(positions[0, head][valid[0, head]].tolist()) for head in range(valid.shape[1])]


def test_kvzap_keeps_the_surrogate_s_best_entries_and_frees_the_rest(llama, surrogate_file):
    ids = random_ids(1, 80, seed=3)
    full = KVWiseCache(llama)
    full.compress_context(ids)
    cache = KVWiseCache(llama, "kvzap", 0.75, surrogate_path=str(surrogate_file))
    cache.compress_context(ids)
    expected = _expected_keep(llama, ScoreSurrogate.load(surrogate_file), ids, 0.75)
    kept_total = 0
    for layer in cache.compressing_layers:
        kept = _kept_positions(layer)
        kept_total += sum(len(head) for head in kept)
        for head, positions in enumerate(kept):
            assert positions == expected[layer.layer_idx, head].nonzero().flatten().tolist()
    layers, heads = len(cache.compressing_layers), expected.shape[1]
    assert kept_total == kept_per_head(80, 0.75) * layers * heads
    assert cache.nbytes() < 0.4 * full.nbytes()  # real bytes freed


@pytest.mark.parametrize("window", [0, 8])
def test_kvzap_in_the_engine_with_a_chunked_prefill_keeps_what_the_library_keeps(llama, surrogate_file, window):
    prompt, ratio = 70, 0.6
    ids = random_ids(1, prompt, seed=11)
    library = KVWiseCache(llama, "kvzap", ratio, surrogate_path=str(surrogate_file), recent_window=window)
    library.compress_context(ids[:, :-1])
    # a token budget of 16 prefills the prompt in 5 chunks: each chunk's tokens are scored by its own forward
    config = CacheConfig(block_size=4, num_blocks=256, token_budget=16, prefix_caching=False)
    core = EngineCore(llama, None, config)
    options = {"surrogate_path": str(surrogate_file), "recent_window": window}
    settings = Mix("kvzap", ratio=ratio, options=options)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    request = core.make_request(ids[0].tolist(), params, kv=settings, compress_upto=prompt - 1)
    seen = {}
    core.add(request)
    while core.has_work:
        core.step()
        if request.region is not None and not seen:
            seen["positions"] = [p.clone() for p in request.region.positions]
            seen["counts"] = [list(c) for c in request.region.counts]
    for layer in library.compressing_layers:
        for head, library_kept in enumerate(_kept_positions(layer)):
            count = seen["counts"][layer.layer_idx][head]
            assert sorted(seen["positions"][layer.layer_idx][head, :count].tolist()) == library_kept
            if window:  # 28 kept per head on average, so the window is capped at 7: positions 62-68
                assert set(range(62, 69)) <= set(library_kept)


def test_kvzap_without_a_surrogate_names_the_command_that_trains_one(llama, tmp_path, monkeypatch):
    monkeypatch.setenv("KVWISE_HOME", str(tmp_path))
    with pytest.raises(ValueError, match="kvwise calibrate"):
        KVWiseCache(llama, "kvzap", 0.5)
    core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=64, prefix_caching=False))
    with pytest.raises(ValueError, match="kvwise calibrate"):
        core.make_request([5, 6, 7], SamplingParams(max_tokens=1), kv=Mix("kvzap", ratio=0.5))


def test_a_surrogate_file_round_trips_and_bad_files_are_named(llama, gemma2, surrogate_file, tmp_path):
    surrogate = ScoreSurrogate.load(surrogate_file)
    hidden = torch.randn(1, 9, llama.config.hidden_size)
    assert torch.equal(surrogate.log_scores(0, hidden), random_surrogate(llama).log_scores(0, hidden))
    assert surrogate.log_scores(0, hidden).shape == (1, llama.config.num_key_value_heads, 9)
    with pytest.raises(ValueError, match="other weights"):
        find_surrogate("0" * 32, surrogate_file)
    broken = tmp_path / "broken.kvzap.safetensors"
    broken.write_bytes(surrogate_file.read_bytes()[:100])
    with pytest.raises(ValueError, match="not a kvzap surrogate"):
        ScoreSurrogate.load(broken)
    with pytest.raises(ValueError, match="trained on other weights"):
        KVWiseCache(gemma2, "kvzap", 0.5, surrogate_path=str(surrogate_file))


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_a_layer_head_learns_a_target_its_features_determine(kind):
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(3000, 12, generator=generator) * 3 + 1
    weights = torch.randn(12, 2, generator=generator)
    targets = torch.tanh(features @ weights / 4) * 3 - 5 if kind == "mlp" else features @ weights - 5
    config = SurrogateConfig(kind=kind, width=32, steps=1500)
    head = fit_layer(features, targets, config)
    surrogate = ScoreSurrogate("x", {0: head})
    predicted = surrogate.log_scores(0, features[None])[0].T
    residual = (predicted - targets).pow(2).mean() / targets.var()
    assert residual < (1e-4 if kind == "linear" else 0.05)


def test_fit_surrogate_learns_kvzip_s_scores_on_a_model(llama):
    contexts = [random_ids(1, 128, seed=seed)[0].tolist() for seed in range(14)]
    config = SurrogateConfig(passages=12, held_out=2, kind="linear")
    surrogate = fit_surrogate(llama, None, contexts, "random ids", config)
    assert sorted(surrogate.layers) == [0, 1, 2]
    assert surrogate.info["training_passages"] == 12 and surrogate.info["training_tokens"] == 12 * (128 - 4)
    agreements = surrogate.info["agreement"]
    assert set(agreements) == {"0.75", "0.9", "0.95"}
    # better than chance: a random choice of 25% of the entries shares 25% of KVzip's
    assert agreements["0.75"] > 0.32

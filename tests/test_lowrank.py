"""The low-rank codec: per-head bases, the `lowrank` quantizer, the library cache and the engine."""

from __future__ import annotations

import pytest
import torch

from kvwise.adaptive.lowrank_training import fit_basis_on
from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.kv_settings import resolve
from kvwise.engine.sampling import SamplingParams
from kvwise.hf.cache import KVWiseCache
from kvwise.kv.lowrank_basis import LowRankBasis, find_basis, user_basis_path
from kvwise.kv.quantizer import make_quantizer
from kvwise.policies.mix import parse_mix
from kvwise.util.fingerprint import weights_fingerprint
from tests.conftest import random_ids

pytestmark = pytest.mark.timeout(300)


def random_basis(model, seed: int = 0) -> LowRankBasis:
    """A random orthonormal basis and mean per (layer, head), different for each: restoring with
    another head's basis cannot go unnoticed."""
    config = model.config
    heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    generator = torch.Generator().manual_seed(seed)
    layers = {}
    for index in range(config.num_hidden_layers):
        layers[index] = {}
        for role in ("keys", "values"):
            vectors, _ = torch.linalg.qr(torch.randn(heads, head_dim, head_dim, generator=generator))
            layers[index][f"{role}.mean"] = torch.randn(heads, head_dim, generator=generator)
            layers[index][f"{role}.basis"] = vectors
    return LowRankBasis(weights_fingerprint(model), layers, {"data": "random, for tests"})


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWISE_HOME", str(tmp_path))
    return tmp_path


def _greedy(model, ids, quant, tokens=8):
    cache = KVWiseCache(model, quant=quant)
    out = model.generate(ids, cache=cache, max_new_tokens=tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist(), cache


def test_spec_round_trips_and_bad_options_are_named():
    for name in ("lowrank", "lowrank:r=8+kivi4", "lowrank:r=4:values=1+kivi2:group_size=16", "lowrank:r=8+int8"):
        quantizer = make_quantizer(name)
        assert make_quantizer(quantizer.spec).spec == quantizer.spec
        assert parse_mix(parse_mix(f"kvzip@0.9+{name}").spec) == parse_mix(f"kvzip@0.9+{name}")
    assert make_quantizer("lowrank:r=8+kivi4").residual_length == make_quantizer("kivi4").residual_length
    for bad, message in (
        ("kivi4+int8", "only lowrank composes"),
        ("lowrank:r=0+kivi4", "rank r must be >= 1"),
        ("lowrank:values=2", "values is 0"),
        ("lowrank:r=8+lowrank", "inner quantizer"),
        ("lowrank:sink_tokens=0+kivi4", "give residual_length and sink_tokens to it"),
    ):
        with pytest.raises(ValueError, match=message):
            make_quantizer(bad)


def test_without_bases_the_error_names_calibrate(llama, home):
    with pytest.raises(ValueError, match="kvwise calibrate"):
        KVWiseCache(llama, quant="lowrank:r=8+kivi4")
    with pytest.raises(ValueError, match="no basis"):
        make_quantizer("lowrank").key_codec.encode_heads(torch.zeros(2, 16), None, torch.zeros(2, dtype=torch.long))


def test_a_basis_file_round_trips_and_bad_files_are_named(llama, home, tmp_path):
    basis = random_basis(llama)
    path = basis.save(user_basis_path(basis.fingerprint))
    found = find_basis(basis.fingerprint)
    assert torch.equal(found.layers[1]["keys.basis"], basis.layers[1]["keys.basis"])
    corrupt = tmp_path / "corrupt.lowrank.safetensors"
    corrupt.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="not a low-rank basis"):
        find_basis(basis.fingerprint, corrupt)
    other = random_basis(llama)
    other.fingerprint = "0" * 32
    with pytest.raises(ValueError, match="calibrated on other weights"):
        find_basis(basis.fingerprint, other.save(tmp_path / "other.lowrank.safetensors"))
    with pytest.raises(ValueError, match="rank r must be in"):
        basis.flat("keys", 17)


def test_full_rank_restores_every_head_with_its_own_basis(llama, home):
    """r = head_dim with 16-bit coefficients is lossless up to float16 rounding: the same greedy
    tokens as the full cache, and keys restored close to the originals."""
    random_basis(llama).save(user_basis_path(weights_fingerprint(llama)))
    ids = random_ids(1, 40, seed=3)
    full, _ = _greedy(llama, ids, None)
    lossless, cache = _greedy(llama, ids, "lowrank:r=16:values=1")
    assert lossless == full
    store = cache.layers[1].store
    assert store.quantized_lengths.sum() > 0 and store.errors.relative()[0] < 1e-2


def test_rank_sets_the_bytes_and_composes_with_kivi(llama, home):
    random_basis(llama).save(user_basis_path(weights_fingerprint(llama)))
    ids = random_ids(1, 300, seed=4)
    held = {}
    for quant in (None, "kivi4", "lowrank:r=8+kivi4", "lowrank:r=8:values=1+kivi4", "lowrank:r=4", "lowrank:r=8"):
        cache = KVWiseCache(llama, quant=quant)
        cache.compress_context(ids)
        held[quant] = sum(layer.store.nbytes() for layer in cache.layers)
    # keys at 8 of 16 channels: half their codes and scales (the residual window is the same)
    assert held["lowrank:r=8:values=1+kivi4"] < held["lowrank:r=8+kivi4"] < held["kivi4"]
    # alone, 16-bit coefficients: 4 fewer of them per key row than at r=8 (1 sink row per head)
    rows = (300 - 1) * llama.config.num_key_value_heads * llama.config.num_hidden_layers
    assert held["lowrank:r=8"] - held["lowrank:r=4"] == rows * 4 * 2
    assert held["lowrank:r=8"] < held[None]


def test_fitted_bases_restore_better_with_more_rank(llama):
    contexts = [random_ids(1, 120, seed=seed)[0].tolist() for seed in range(4)]
    basis = fit_basis_on(llama, contexts, "random ids")
    errors = basis.info["held_out_relative_error"]["keys"]
    assert errors["8"] > errors["16"] and errors["16"] < 1e-3  # rank 16 of 16: exact
    vectors = basis.layers[0]["keys.basis"][0]
    assert torch.allclose(vectors.T @ vectors, torch.eye(16), atol=1e-4)


@pytest.mark.parametrize(
    "plain_mix, mix",
    [
        (None, "lowrank:r=16:values=1:residual_length=8"),  # per-request: whole blocks, one layer each
        # evict, then pages of every layer in one store: 33 kept of 60, a sink and two whole pages
        ("snapkv@0.45", "snapkv@0.45+lowrank:r=16:values=1"),
    ],
)
def test_the_engine_stores_lowrank_blocks_and_pages(llama, home, plain_mix, mix):
    """Lossless at full rank, so the engine's tokens equal those without the codec, whichever
    head and layer each block or page restores with."""
    random_basis(llama).save(user_basis_path(weights_fingerprint(llama)))
    ids = random_ids(1, 60, seed=5)[0].tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs, cores = [], []
    for spelled in (plain_mix, mix):
        core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=256, prefix_caching=False))
        request = core.make_request(ids, params, kv=resolve(spelled) if spelled else None)
        core.add(request)
        while core.has_work:
            core.step()
        outputs.append(request.output)
        cores.append(core)
    assert outputs[1] == outputs[0]
    stores = {**cores[1].kv._quant_pools, **cores[1].kv._quantized_pages}
    assert stores and all(store.quantizer.key_codec.attached for store in stores.values())
    assert sum(getattr(store, "quantized_blocks", 1) for store in stores.values()) > 0

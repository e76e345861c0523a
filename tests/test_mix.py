"""The one mix syntax: policy@ratio or @max=N, quantizer:options, joined by '+'."""

from __future__ import annotations

import pytest

from kvwise.policies.mix import Mix, parse_mix


def test_the_issue_examples_parse():
    mix = parse_mix("kvzip@0.9+kivi4")
    assert (mix.policy, mix.ratio, mix.max_tokens, mix.quant.split(":")[0]) == ("kvzip", 0.9, None, "kivi4")
    capped = parse_mix("h2o@max=1024+kivi4:group_size=32")
    assert capped.max_tokens == 1024 and "group_size=32" in capped.quant and capped.evicts
    assert parse_mix("kivi2") == Mix(quant=parse_mix("kivi2").quant) and not parse_mix("kivi2").evicts
    assert parse_mix("full").spec == "full" and parse_mix("full").quant is None


@pytest.mark.parametrize(
    "spellings",
    [
        ("kvzip@0.9+kivi4", "kivi4+kvzip@0.9", "KVZIP@0.90+kivi4:sink_tokens=1", "kvzip:0.9+kivi4:"),
        ("h2o@max=1024", "h2o:1024", " h2o @max=1024 "),
        ("snapkv:window_size=32@0.5", "snapkv:window_size=32@0.50"),
        ("kvzip:recent_window=64,pass_chunk=128@0.9", "kvzip:pass_chunk=128:recent_window=64@0.9"),
    ],
)
def test_every_spelling_of_a_mix_has_one_spec(spellings):
    specs = {parse_mix(spelling).spec for spelling in spellings}
    assert len(specs) == 1
    spec = specs.pop()
    assert parse_mix(spec).spec == spec  # the spec reads back as itself


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("snapk@0.5", "unknown component 'snapk@0.5'"),
        ("kvzip@0.9+kivi5", "unknown component 'kivi5'"),
        ("kvzip@1.5", "'kvzip@1.5': the ratio is the fraction of KV removed"),
        ("kvzip@max=-3", "'kvzip@max=-3': max= takes"),
        ("kvzip@lots", "'kvzip@lots': expected @RATIO"),
        ("kvzip", "'kvzip': give a ratio"),
        ("snapkv:windw=32@0.5", "has no option windw"),
        ("kvzip:recent_window=many@0.9", "policy 'kvzip': recent_window takes a number, got 'many'"),
        ("kivi4:group_size=7", "'kivi4:group_size=7'"),
        ("kivi4@0.5", "a quantizer takes no ratio"),
        ("snapkv@0.5+h2o@0.5", "names two policies"),
        ("kivi2+kivi4", "names two quantizers"),
        ("kvzip@0.9++kivi4", "empty component"),
        ("", "a KV mix is a string"),
    ],
)
def test_bad_mixes_name_the_component_at_fault(text, message):
    with pytest.raises(ValueError, match=None) as error:
        parse_mix(text)
    assert message in str(error.value)


def test_a_ratio_and_a_cap_share_one_spelling_in_text_and_in_python():
    both = parse_mix("h2o@0.5,max=256+kivi4")
    assert (both.ratio, both.max_tokens) == (0.5, 256) and both.spec.startswith("h2o@0.5,max=256+kivi4")
    assert Mix("h2o", 0.5, 256, "kivi4") == both and parse_mix(both.spec) == both
    assert Mix("snapkv", options={"window_size": 8}, ratio=0.5).spec == "snapkv:window_size=8@0.5"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"policy": "snapk", "ratio": 0.5}, "unknown policy 'snapk'"),
        ({"policy": "full", "ratio": 0.5}, "needs an evicting policy"),
        ({"policy": "snapkv", "ratio": 1.0}, "ratio must be in [0, 1)"),
        ({"policy": "h2o", "max_tokens": 0}, "max_kv_tokens must be a positive integer"),
        ({"policy": "snapkv", "ratio": 0.5, "options": {"windw": 3}}, "windw"),
        ({"quant": "kivi5"}, "kivi5"),
    ],
)
def test_a_mix_made_in_python_is_checked_as_text_is(fields, message):
    with pytest.raises(ValueError) as error:
        Mix(**fields)
    assert message in str(error.value)


def test_resolve_builds_the_policy_and_quantizer_once_and_keeps_full_explicit():
    from kvwise.engine.kv_settings import KVSettings, resolve

    settings = resolve("kvzip@0.9+kivi4")
    assert isinstance(settings, KVSettings) and settings.scorer.name == "kvzip"
    assert settings.quantizer.spec == settings.quant == settings.mix.quant and resolve(settings) is settings
    full = resolve("full")  # asked for: it keeps everything, and still wins over an adaptive controller
    assert full is not None and not full.active and resolve(None) is None
    with pytest.raises(ValueError, match="pass_chunk"):  # the engine's own check, at its edge
        resolve("kvzip:pass_chunk=128@0.5")

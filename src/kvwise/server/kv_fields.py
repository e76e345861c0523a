"""kvwise's own request fields: `kv_policy`, `kv_ratio`, `kv_quant`, `max_kv_tokens`, `kv_mix`,
`kv_prefix.compress` and `kv_profile` into the engine's KV settings (or a 400 naming the field),
the quantizers a server enables, and the `usage.kv` an answer reports."""

from __future__ import annotations

from kvwise.engine.kv_settings import KVSettings, resolve
from kvwise.kv.quantizer import quantizer_names
from kvwise.policies.mix import Mix
from kvwise.server.protocol import OpenAIError

SEPARATE_KV_FIELDS = "kv_policy, kv_ratio, kv_quant and max_kv_tokens"  # what one mix spec replaces


def default_kv_quant_options() -> frozenset[str]:
    """The four scalar quantizers with their default settings (lowrank needs the model's bases
    from `kvwise calibrate`, so a server enables it by name: --kv-quant-options)."""
    return frozenset(Mix(quant=name).quant for name in quantizer_names() if name != "lowrank")


def parse_kv_quant_options(text: str | None) -> frozenset[str]:
    """--kv-quant-options "kivi2,kivi4:group_size=16" -> canonical specs ("none": no kv_quant at all)."""
    if text is None:
        return default_kv_quant_options()
    specs = (Mix(quant=name.strip()).quant for name in text.split(",") if name.strip())
    return frozenset(spec for spec in specs if spec is not None)


def request_kv_settings(body, allowed: frozenset[str]) -> KVSettings | None:
    """kvwise's per-request KV options (kv_policy, kv_ratio, kv_quant, max_kv_tokens, or all of
    them as one kv_mix), or None."""
    separate = (body.kv_policy, body.kv_ratio, body.max_kv_tokens, body.kv_quant)
    if body.kv_mix is not None:
        if any(option is not None for option in separate):
            message = f"kv_mix sets the request's KV mix: leave out {SEPARATE_KV_FIELDS}"
            raise OpenAIError(400, message, param="kv_mix")
        settings = mix_settings(body.kv_mix, "kv_mix")
        check_quant_enabled(allowed, settings, body.kv_mix, "kv_mix")
        return settings
    if all(option is None for option in separate):
        return None
    try:
        quant = Mix(quant=body.kv_quant).quant
    except ValueError as error:
        raise OpenAIError(400, str(error), param="kv_quant") from None
    policy = body.kv_policy or ("snapkv" if body.kv_ratio or body.max_kv_tokens is not None else "full")
    try:  # a ratio or a cap without a policy means snapkv's
        settings = resolve(Mix(policy, body.kv_ratio or 0.0, body.max_kv_tokens, quant))
    except ValueError as error:
        text = str(error)
        param = "max_kv_tokens" if "max_kv_tokens" in text else "kv_ratio" if "ratio" in text else "kv_policy"
        raise OpenAIError(400, text if text.startswith(param) else f"{param}: {text}", param=param) from None
    check_quant_enabled(allowed, settings, body.kv_quant, "kv_quant")
    return settings


def compression_settings(body, kv: KVSettings | None, allowed: frozenset[str]) -> KVSettings:
    """The settings of `kv_prefix.compress` (the document's length is the prefix's)."""
    marked = body.kv_prefix
    if kv is not None:
        message = f"kv_prefix.compress sets the request's KV mix: leave out kv_mix, {SEPARATE_KV_FIELDS}"
        raise OpenAIError(400, message, param="kv_prefix.compress")
    if marked.shared:
        message = "a compressed kv_prefix is cached per tenant: it cannot also be shared"
        raise OpenAIError(400, message, param="kv_prefix.compress")
    settings = mix_settings(marked.compress, "kv_prefix.compress")
    if not settings.evicts or settings.ratio <= 0:
        message = f"kv_prefix.compress needs a policy with a ratio, such as 'kvzip@0.9'; got {marked.compress!r}"
        raise OpenAIError(400, message, param="kv_prefix.compress")
    check_quant_enabled(allowed, settings, marked.compress, "kv_prefix.compress")
    return settings


def kv_auto(body, kv: KVSettings | None, has_controller: bool) -> str | None:
    """The class hint for the adaptive controller, or None when the request's own settings hold
    (they always win) or the server has no controller."""
    hint = body.kv_profile  # checked with the request, by the engine
    if hint is not None:
        if not has_controller:
            raise OpenAIError(400, "kv_profile needs a server started with --kv-policy auto", param="kv_profile")
    if not has_controller or kv is not None:
        return None
    return hint or "auto"


def check_quant_enabled(allowed: frozenset[str], settings: KVSettings | None, asked: str | None, param: str) -> None:
    """A 400 when `settings` asks for a quantizer this server has not enabled."""
    if settings is not None and settings.quant is not None and settings.quant not in allowed:
        # each quantizer holds a pool of its own: only the server's fixed set may be asked for
        raise OpenAIError(
            400,
            f"the quantizer in {asked!r} is not enabled on this server; choose one of: " + ", ".join(sorted(allowed)),
            param=param,
        )


def mix_settings(spec: str, param: str) -> KVSettings:
    """The settings of a mix spec sent as `param`; a 400 naming the bad component otherwise."""
    try:
        return resolve(spec)
    except ValueError as error:
        raise OpenAIError(400, f"{param}: {error}", param=param) from None


def kv_usage(requests) -> dict | list | None:
    """usage.kv: the mix each choice ran with, and why (one entry when they agree); None when no
    request had KV settings of its own or from the controller."""
    entries = []
    for request in sorted(requests, key=lambda r: r.choice):
        if request.kv_choice is not None:
            entries.append(request.kv_choice.as_usage())
        elif request.kv is not None:
            entries.append({"mix": request.kv.spec, "class": None, "reason": "explicit"})
        else:
            entries.append(None)
    if all(entry is None for entry in entries):
        return None
    return entries[0] if all(entry == entries[0] for entry in entries) else entries

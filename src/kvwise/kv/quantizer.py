"""Named KV quantizers: which codec stores keys, which stores values, and the residual window.

    kivi2, kivi4  KIVI (arXiv 2402.02750): keys per channel in groups of `group_size` tokens,
                  values per token in groups of `value_group_size` channels; the newest
                  `residual_length` tokens stay at full precision. kvwise also keeps the
                  first `sink_tokens` (default 1) at full precision: the attention sink's
                  outlier key costs a 135M model 0.08 of perplexity ratio at 2 bits
                  (IntactKV, arXiv 2403.01241, makes the same case).
    int8          symmetric, one scale per token and head; no residual window.
    fp8           float8 e4m3, one scale per token and head; no residual window.

Tokens leave the residual window for the quantized store `group_size` at a time, oldest first,
and are never quantized again.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwise.kv.codec import Codec
from kvwise.kv.minmax import ChannelCodec, TokenCodec
from kvwise.kv.scaled import Fp8Codec, Int8Codec

KIVI_BITS = (2, 4)


@dataclass(frozen=True)
class Quantizer:
    """How one cache stores its keys and values.

    name: the registered name ("kivi4", ...).
    key_codec, value_codec: the codecs of each role.
    residual_length: newest tokens per head kept at full precision (R).
    group_size: tokens that leave the residual window together (G); divides R.
    sink_tokens: oldest tokens per head kept at full precision (attention sinks).
    """

    name: str
    key_codec: Codec
    value_codec: Codec
    residual_length: int
    group_size: int
    sink_tokens: int = 0

    def check_head_dim(self, head_dim: int) -> None:
        self.key_codec.check_head_dim(head_dim)
        self.value_codec.check_head_dim(head_dim)

    @property
    def spec(self) -> str:
        """The canonical spelling: every setting that changes what is stored, in a fixed order, so
        "kivi4", "kivi4:sink_tokens=1" and "KIVI4:" name one quantizer (one pool, one cache key).
        `make_quantizer(q.spec)` rebuilds q."""
        options = {"residual_length": self.residual_length, "sink_tokens": self.sink_tokens}
        if self.name.startswith("kivi"):
            options = {"group_size": self.group_size, **options, "value_group_size": self.value_codec.channel_group}
        return ":".join([self.name, *(f"{option}={value}" for option, value in options.items())])

    def describe(self) -> str:
        return f"{self.name} (residual {self.residual_length}, group {self.group_size})"


def _kivi(
    name: str,
    bits: int,
    group_size: int = 32,
    residual_length: int = 128,
    value_group_size: int = 64,
    sink_tokens: int = 1,
):
    if bits not in KIVI_BITS:
        raise ValueError(f"kivi supports {KIVI_BITS[0]} or {KIVI_BITS[1]} bits, got {bits}")
    if group_size < 1 or residual_length < 0:
        raise ValueError(f"group_size must be >= 1 and residual_length >= 0, got {group_size} and {residual_length}")
    if residual_length % group_size:
        raise ValueError(
            f"group_size {group_size} must divide residual_length {residual_length}: keys leave the "
            "full-precision window one whole group at a time"
        )
    _check_sinks(sink_tokens)
    return Quantizer(
        name, ChannelCodec(bits), TokenCodec(bits, value_group_size), residual_length, group_size, sink_tokens
    )


def _per_token(name: str, codec: Codec, residual_length: int = 0, sink_tokens: int = 0):
    if residual_length < 0:
        raise ValueError(f"residual_length must be >= 0, got {residual_length}")
    _check_sinks(sink_tokens)
    return Quantizer(name, codec, codec, residual_length, 1, sink_tokens)


def _check_sinks(sink_tokens: int) -> None:
    if sink_tokens < 0:
        raise ValueError(f"sink_tokens must be >= 0, got {sink_tokens}")


_FACTORIES = {
    "kivi2": lambda **options: _kivi("kivi2", options.pop("bits", 2), **options),
    "kivi4": lambda **options: _kivi("kivi4", options.pop("bits", 4), **options),
    "kivi": lambda **options: _kivi(f"kivi{options.get('bits', 4)}", options.pop("bits", 4), **options),
    "int8": lambda **options: _per_token("int8", Int8Codec(), **options),
    "fp8": lambda **options: _per_token("fp8", Fp8Codec(), **options),
}


def _parse_options(spec: str, name: str) -> dict[str, int]:
    options = {}
    for item in spec.split(":"):
        option, equals, value = item.partition("=")
        if not equals or not value.strip().lstrip("-").isdigit():
            example = f"{name}:group_size=64:sink_tokens=0"
            raise ValueError(f"quantizer options are name=integer pairs, e.g. {example}; got {item!r}")
        options[option.strip()] = int(value)
    return options


def quantizer_names() -> list[str]:
    return ["kivi2", "kivi4", "int8", "fp8"]


def make_quantizer(name: str | Quantizer | None, **options) -> Quantizer | None:
    """A quantizer by name, e.g. make_quantizer("kivi2", group_size=32, residual_length=128).

    None or "none" means full precision. A name may carry integer options after a colon, as on
    the command line: "kivi2:sink_tokens=0:group_size=64". Unknown names and bad options raise
    ValueError.
    """
    if name is None or isinstance(name, Quantizer):
        if options:
            raise ValueError("quantizer options need a quantizer name")
        return name
    name, _, spec = str(name).partition(":")
    if spec:
        options = {**_parse_options(spec, name), **options}
    key = name.lower()
    if key == "none":
        return None
    if key not in _FACTORIES:
        raise ValueError(f"unknown quantizer {name!r}; choose one of: none, {', '.join(quantizer_names())}")
    try:
        return _FACTORIES[key](**dict(options))
    except TypeError as error:  # an option this quantizer does not have
        raise ValueError(f"bad option for quantizer {name!r}: {error}") from None

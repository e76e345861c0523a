"""Named KV quantizers: which codec stores keys, which stores values, and the residual window.

    kivi2, kivi4  KIVI (arXiv 2402.02750): keys per channel in groups of `group_size` tokens,
                  values per token in groups of `value_group_size` channels; the newest
                  `residual_length` tokens stay at full precision. kvwise also keeps the
                  first `sink_tokens` (default 1) at full precision: the attention sink's
                  outlier key costs a 135M model 0.08 of perplexity ratio at 2 bits
                  (IntactKV, arXiv 2403.01241, makes the same case).
    int8          symmetric, one scale per token and head; no residual window.
    fp8           float8 e4m3, one scale per token and head; no residual window.
    lowrank       keys (and with values=1, values) held as their first `r` coordinates in a
                  per-layer, per-head basis from `kvwise calibrate` (`kv.lowrank_basis`),
                  stored by the quantizer after the `+`: `lowrank:r=16+kivi4`. Alone, the
                  coordinates are 16-bit floats. Its window and sinks are the inner quantizer's.

Tokens leave the residual window for the quantized store `group_size` at a time, oldest first,
and are never quantized again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvwise.kv.codec import Codec
from kvwise.kv.lowrank_codec import LowRankCodec
from kvwise.kv.minmax import ChannelCodec, TokenCodec
from kvwise.kv.plain import Float16Codec
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
    canonical: str | None = None  # the spec, where the name and options do not make it (lowrank)

    def check_head_dim(self, head_dim: int) -> None:
        self.key_codec.check_head_dim(head_dim)
        self.value_codec.check_head_dim(head_dim)

    @property
    def spec(self) -> str:
        """The canonical spelling: every setting that changes what is stored, in a fixed order, so
        "kivi4", "kivi4:sink_tokens=1" and "KIVI4:" name one quantizer (one pool, one cache key).
        `make_quantizer(q.spec)` rebuilds q."""
        if self.canonical is not None:
            return self.canonical
        options = {"residual_length": self.residual_length, "sink_tokens": self.sink_tokens}
        if self.name.startswith("kivi"):
            options = {"group_size": self.group_size, **options, "value_group_size": self.value_codec.channel_group}
        return ":".join([self.name, *(f"{option}={value}" for option, value in options.items())])

    def describe(self) -> str:
        return f"{self.name} (residual {self.residual_length}, group {self.group_size})"

    @property
    def needs_heads(self) -> bool:
        """True when a codec must know each row's KV head (stores then work it out)."""
        return self.key_codec.needs_heads or self.value_codec.needs_heads

    @property
    def needs_model(self) -> bool:
        """True while a codec lacks what only the model can give (a low-rank basis)."""
        return any(isinstance(c, LowRankCodec) and not c.attached for c in (self.key_codec, self.value_codec))

    def attach(self, model) -> Quantizer:
        """This quantizer ready for `model`: low-rank codecs get the model's bases (a ValueError
        naming `kvwise calibrate` when it has none). Others come back as they are."""
        if not self.needs_model:
            return self
        from kvwise.kv.lowrank_basis import require_basis

        basis = require_basis(model)

        def attached(codec: Codec, role: str) -> Codec:
            return codec.attach(*basis.flat(role, codec.rank)) if isinstance(codec, LowRankCodec) else codec

        return replace(
            self, key_codec=attached(self.key_codec, "keys"), value_codec=attached(self.value_codec, "values")
        )

    def for_layer(self, layer_idx: int) -> Quantizer:
        """The quantizer of one layer's store: low-rank codecs keep that layer's bases only."""
        if not isinstance(self.key_codec, LowRankCodec) and not isinstance(self.value_codec, LowRankCodec):
            return self

        def of_layer(codec: Codec) -> Codec:
            return codec.for_layer(layer_idx) if isinstance(codec, LowRankCodec) else codec

        return replace(self, key_codec=of_layer(self.key_codec), value_codec=of_layer(self.value_codec))


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


def _lowrank(inner: Quantizer | None, r: int = 16, values: int = 0, residual_length: int = 0, sink_tokens: int = 1):
    if values not in (0, 1):
        raise ValueError(f"values is 0 (keys only) or 1 (keys and values), got {values}")
    stage = f"lowrank:r={r}:values={values}"
    if inner is None:
        if residual_length < 0:
            raise ValueError(f"residual_length must be >= 0, got {residual_length}")
        _check_sinks(sink_tokens)
        plain = Float16Codec()
        value_codec = LowRankCodec(r, plain) if values else plain
        spec = f"{stage}:residual_length={residual_length}:sink_tokens={sink_tokens}"
        return Quantizer(f"lowrank{r}", LowRankCodec(r, plain), value_codec, residual_length, 1, sink_tokens, spec)
    if (residual_length, sink_tokens) != (0, 1):
        raise ValueError(
            "with an inner quantizer, give residual_length and sink_tokens to it (lowrank:r=16+kivi4:sink_tokens=0)"
        )
    value_codec = LowRankCodec(r, inner.value_codec) if values else inner.value_codec
    return replace(
        inner,
        name=f"lowrank{r}+{inner.name}",
        key_codec=LowRankCodec(r, inner.key_codec),
        value_codec=value_codec,
        canonical=f"{stage}+{inner.spec}",
    )


_FACTORIES = {
    "kivi2": lambda **options: _kivi("kivi2", options.pop("bits", 2), **options),
    "kivi4": lambda **options: _kivi("kivi4", options.pop("bits", 4), **options),
    "kivi": lambda **options: _kivi(f"kivi{options.get('bits', 4)}", options.pop("bits", 4), **options),
    "int8": lambda **options: _per_token("int8", Int8Codec(), **options),
    "fp8": lambda **options: _per_token("fp8", Fp8Codec(), **options),
    "lowrank": lambda **options: _lowrank(None, **options),
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
    return ["kivi2", "kivi4", "int8", "fp8", "lowrank"]


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
    outer, plus, inner = str(name).partition("+")
    if plus:  # a low-rank stage, then the quantizer of its coefficients
        stage, _, stage_options = outer.partition(":")
        if stage.strip().lower() != "lowrank":
            raise ValueError(f"only lowrank composes with another quantizer (lowrank:r=16+kivi4), got {name!r}")
        inner_quantizer = make_quantizer(inner)
        if inner_quantizer is not None and inner_quantizer.canonical is not None:
            raise ValueError(f"lowrank's inner quantizer is one of kivi2, kivi4, int8, fp8, got {inner!r}")
        options = {**(_parse_options(stage_options, "lowrank") if stage_options else {}), **options}
        try:
            return _lowrank(inner_quantizer, **options)
        except TypeError as error:
            raise ValueError(f"bad option for quantizer 'lowrank': {error}") from None
    name, _, spec = outer.partition(":")
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

"""One syntax for a KV mix: what a request, a server option or a bench row asks the cache to do.

    kvzip@0.9+kivi4                      evict 90% with kvzip, quantize what is kept with KIVI 4-bit
    h2o@max=1024+kivi4:group_size=32     keep at most 1024 tokens per head, KIVI 4-bit in groups of 32
    snapkv:window_size=32@0.75           a policy option, then the ratio
    kivi2                                no eviction, KIVI 2-bit
    kvzip@0.9+lowrank:r=48+kivi2         keys as 48 coordinates of a calibrated basis, then KIVI 2-bit
    full                                 neither

Components are joined by `+`: at most one policy (with `@RATIO`, the fraction of KV removed in
[0, 1), or `@max=N`, a cap in tokens per head) and at most one quantizer (a `lowrank` stage
followed by its inner quantizer counts as one); options follow a colon as `key=value` pairs
separated by commas (or colons, as quantizer specs spell them). `policy:0.9` and `policy:1024`
are read as `policy@0.9` and `policy@max=1024`. Every error names the component at fault.
`Mix.spec` is the one canonical spelling: equal mixes have equal specs, so a spec can key a
pool or a cached entry.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwise.kv.quantizer import make_quantizer, quantizer_names
from kvwise.policies.registry import make_policy, policy_names


@dataclass(frozen=True)
class Mix:
    policy: str = "full"
    policy_options: tuple[tuple[str, int | float | bool | str], ...] = ()  # sorted (name, value) pairs
    ratio: float = 0.0  # fraction of the KV removed, in [0, 1)
    max_tokens: int | None = None  # cap on tokens per head while decoding
    quant: str | None = None  # the quantizer's canonical spec (`Quantizer.spec`), or None

    @property
    def evicts(self) -> bool:
        return self.policy != "full" and (self.ratio > 0 or self.max_tokens is not None)

    @property
    def spec(self) -> str:
        parts = []
        if self.policy != "full":
            options = ",".join(f"{name}={_text(value)}" for name, value in self.policy_options)
            budget = f"max={self.max_tokens}" if self.max_tokens is not None else _text(self.ratio)
            parts.append(f"{self.policy}{':' + options if options else ''}@{budget}")
        if self.quant is not None:  # a low-rank stage and its inner quantizer are two components
            for stage in self.quant.split("+"):
                name, _, options = stage.partition(":")
                parts.append(name + (":" + options.replace(":", ",") if options else ""))
        return "+".join(parts) or "full"

    def __str__(self) -> str:
        return self.spec


def parse_mix(text: str | Mix) -> Mix:
    """The Mix `text` spells; ValueError naming the bad component."""
    if isinstance(text, Mix):
        return text
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"a KV mix is a string such as 'kvzip@0.9+kivi4', got {text!r}")
    policy, quant = None, None
    for component in (part.strip() for part in text.split("+")):
        if not component:
            raise ValueError(f"empty component in KV mix {text!r} (two '+' in a row, or one at an end)")
        name = component.split("@", 1)[0].split(":", 1)[0].strip().lower()
        if name in quantizer_names() or name in ("kivi", "none"):
            if quant is not None and _is_bare_lowrank(quant[0]) and not _is_bare_lowrank(component):
                component = f"{quant[0]}+{component}"  # lowrank:r=16+kivi4: the low-rank stage's inner quantizer
                quant = (component, _quantizer(component))
                continue
            if quant is not None:
                raise ValueError(f"KV mix {text!r} names two quantizers ({quant[0]!r} and {component!r})")
            quant = (component, _quantizer(component))
        elif name in policy_names():
            if policy is not None:
                raise ValueError(f"KV mix {text!r} names two policies ({policy[0]!r} and {component!r})")
            policy = (component, _policy(component, name))
        else:
            choices = ", ".join([*policy_names(), *quantizer_names()])
            raise ValueError(f"unknown component {component!r} in KV mix {text!r}; choose from: {choices}")
    fields = policy[1] if policy is not None else {}
    return Mix(quant=quant[1] if quant is not None else None, **fields)


def _is_bare_lowrank(component: str) -> bool:
    return "+" not in component and component.split(":", 1)[0].strip().lower() == "lowrank"


def _quantizer(component: str) -> str | None:
    if "@" in component:
        raise ValueError(f"{component!r}: a quantizer takes no ratio; put '@' on the policy")
    stages = []
    for stage in component.split("+"):
        name, _, options = stage.partition(":")
        stages.append(name + (":" + options.replace(",", ":") if options.strip() else ""))
    spec = "+".join(stages)
    try:
        quantizer = make_quantizer(spec)
    except ValueError as error:
        raise ValueError(f"{component!r}: {error}") from None
    return None if quantizer is None else quantizer.spec


def _policy(component: str, name: str) -> dict:
    head, at, budget = component.partition("@")
    _, colon, options_text = head.partition(":")
    options = {}
    if colon and not at and _is_number(options_text):  # `h2o:1024`, `kvzip:0.9`: the short form
        budget, options_text = options_text, ""
    for item in filter(None, (part.strip() for part in options_text.replace(":", ",").split(","))):
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise ValueError(f"{component!r}: policy options are key=value pairs separated by commas, got {item!r}")
        options[key.strip()] = _value(value.strip())
    try:
        make_policy(name, **options)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{component!r}: {error}") from None
    fields = {"policy": name, "policy_options": tuple(sorted(options.items()))}
    budget = budget.strip()
    if not budget:
        if name != "full":
            raise ValueError(f"{component!r}: give a ratio (@0.9) or a cap (@max=1024)")
        return fields
    if budget.startswith("max="):
        budget = budget[4:]
        if not budget.isdigit() or int(budget) < 1:
            raise ValueError(f"{component!r}: max= takes a whole number of tokens >= 1, got {budget!r}")
        return {**fields, "max_tokens": int(budget)}
    if budget.isdigit():
        return {**fields, "max_tokens": int(budget)} if int(budget) >= 1 else {**fields, "ratio": 0.0}
    try:
        ratio = float(budget)
    except ValueError:
        raise ValueError(f"{component!r}: expected @RATIO in [0, 1) or @max=N, got {budget!r}") from None
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"{component!r}: the ratio is the fraction of KV removed, in [0, 1); got {ratio}")
    return {**fields, "ratio": ratio}


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _value(text: str) -> int | float | bool | str:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def _text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)

"""One syntax for a KV mix: what a request, a server option or a bench row asks the cache to do.

    kvzip@0.9+kivi4                      evict 90% with kvzip, quantize what is kept with KIVI 4-bit
    h2o@max=1024+kivi4:group_size=32     keep at most 1024 tokens per head, KIVI 4-bit in groups of 32
    snapkv:window_size=32@0.75           a policy option, then the ratio
    h2o@0.5,max=256                      evict half of the prompt, then hold each head to 256 tokens
    kivi2                                no eviction, KIVI 2-bit
    kvzip@0.9+lowrank:r=48+kivi2         keys as 48 coordinates of a calibrated basis, then KIVI 2-bit
    full                                 neither

Components are joined by `+`: at most one policy (with `@RATIO`, the fraction of KV removed in
[0, 1), `@max=N`, a cap in tokens per head while decoding, or both as `@RATIO,max=N`) and at
most one quantizer (a `lowrank` stage followed by its inner quantizer counts as one); options
follow a colon as `key=value` pairs separated by commas (or colons, as quantizer specs spell
them). `policy:0.9` and `policy:1024` are read as `policy@0.9` and `policy@max=1024`. Every
error names the component at fault. `Mix("kvzip", ratio=0.9, quant="kivi4")` is the same mix
from Python, checked the same way. `Mix.spec` is the one canonical spelling: equal mixes have
equal specs, so a spec can key a pool or a cached entry. The engine runs a mix once it is
resolved (`engine.kv_settings.resolve`: the policy and quantizer objects it names).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from kvwise.kv.quantizer import make_quantizer, quantizer_names
from kvwise.policies.registry import make_policy, policy_names
from kvwise.policies.selection import check_max_kv_tokens, check_ratio


@dataclass(frozen=True)
class Mix:
    """A KV mix as data: the one spec type, validated when it is made (`parse_mix` for text).

    policy: a registered policy ("full": no eviction); ratio: the fraction of the KV it removes,
    in [0, 1); max_tokens: a cap on tokens per head while decoding (with a ratio, or alone);
    quant: a quantizer, stored as its canonical spec; options: the policy's hyperparameters, as a
    dict or as sorted (name, value) pairs. Equal mixes have equal `spec`s.
    """

    policy: str = "full"
    ratio: float = 0.0
    max_tokens: int | None = None
    quant: str | None = None
    options: tuple[tuple[str, int | float | bool | str], ...] = ()  # sorted (name, value) pairs

    def __post_init__(self):
        policy = str(self.policy).strip().lower()
        options = tuple(sorted(dict(self.options).items()))
        if policy not in policy_names():
            raise ValueError(f"unknown policy {self.policy!r}; choose from: {', '.join(policy_names())}")
        make_policy(policy, **dict(options))  # its errors name the policy and the option at fault
        ratio = check_ratio(self.ratio, "ratio")
        max_tokens = check_max_kv_tokens(self.max_tokens)
        if policy == "full" and (ratio > 0 or max_tokens is not None):
            raise ValueError("'full' keeps every token: a ratio or a cap needs an evicting policy such as 'snapkv'")
        quantizer = make_quantizer(self.quant)
        for name, value in (("policy", policy), ("options", options), ("ratio", ratio), ("max_tokens", max_tokens)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "quant", None if quantizer is None else quantizer.spec)

    @property
    def evicts(self) -> bool:
        """A policy with a budget: a ratio above 0 or a cap."""
        return self.policy != "full" and (self.ratio > 0 or self.max_tokens is not None)

    def options_dict(self) -> dict:
        return dict(self.options)

    @property
    def spec(self) -> str:
        parts = []
        if self.evicts:
            options = ",".join(f"{name}={_text(value)}" for name, value in self.options)
            budgets = [_text(self.ratio)] if self.ratio > 0 else []
            budgets += [f"max={self.max_tokens}"] if self.max_tokens is not None else []
            parts.append(f"{self.policy}{':' + options if options else ''}@{','.join(budgets)}")
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
    return _parse(text)


@lru_cache(maxsize=256)  # a Mix is immutable; the controller and the server parse the same few texts
def _parse(text: str) -> Mix:
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
    try:
        return Mix(quant=quant[1] if quant is not None else None, **fields)
    except ValueError as error:  # the parts are checked one by one above; what is left is how they combine
        raise ValueError(f"KV mix {text!r}: {error}") from None


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
    fields = {"policy": name, "options": tuple(sorted(options.items()))}
    budgets = [part.strip() for part in budget.split(",")] if budget.strip() else []
    if not budgets and name != "full":
        raise ValueError(f"{component!r}: give a ratio (@0.9), a cap (@max=1024) or both (@0.9,max=1024)")
    for part in budgets:
        fields.update(_budget(component, part))
    try:
        Mix(**fields)  # the policy's own checks, named by this component
    except (TypeError, ValueError) as error:
        raise ValueError(f"{component!r}: {error}") from None
    return fields


def _budget(component: str, part: str) -> dict:
    """One budget after '@': `max=N` (or a bare whole number) caps, a fraction removes."""
    if part.startswith("max=") or part.isdigit():
        count = part.removeprefix("max=")
        if not count.isdigit() or int(count) < 1:
            if part.isdigit():  # `@0`: nothing removed
                return {"ratio": 0.0}
            raise ValueError(f"{component!r}: max= takes a whole number of tokens >= 1, got {count!r}")
        return {"max_tokens": int(count)}
    try:
        ratio = float(part)
    except ValueError:
        raise ValueError(f"{component!r}: expected @RATIO in [0, 1), @max=N or both, got {part!r}") from None
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"{component!r}: the ratio is the fraction of KV removed, in [0, 1); got {ratio}")
    return {"ratio": ratio}


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

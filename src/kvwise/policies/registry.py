"""Policies by name. Each policy module registers its class with `@register`."""

from __future__ import annotations

import dataclasses
import importlib

from kvwise.policies.base import Policy

_POLICY_MODULES = (
    "full",
    "random_policy",
    "streaming_llm",
    "h2o",
    "tova",
    "snapkv",
    "pyramidkv",
    "adakv",
    "knorm",
    "expected_attention",
    "scissorhands",
    "keydiff",
    "kvzip",
    "kvzap",
    "quest",
)
_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make `cls` available as `cls.name`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def _load_builtin_policies() -> None:
    for module in _POLICY_MODULES:
        importlib.import_module(f"kvwise.policies.{module}")


def policy_classes() -> dict[str, type[Policy]]:
    """Every registered policy, by name, in registration order."""
    _load_builtin_policies()
    # built-in policies in their listed order, whichever module was imported first; then any others
    builtin = [cls for cls in _REGISTRY.values() if cls.__module__.rsplit(".", 1)[-1] in _POLICY_MODULES]
    builtin.sort(key=lambda cls: _POLICY_MODULES.index(cls.__module__.rsplit(".", 1)[-1]))
    others = [cls for cls in _REGISTRY.values() if cls not in builtin]
    return {cls.name: cls for cls in [*builtin, *others]}


def policy_names() -> list[str]:
    return list(policy_classes())


def make_policy(name: str, **kwargs) -> Policy:
    """Build a policy from its name and hyperparameters, with clear errors for bad input."""
    classes = policy_classes()
    if name not in classes:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(classes)}")
    cls = classes[name]
    defaults = {field.name: field.default for field in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - defaults.keys())
    if unknown:
        options = ", ".join(sorted(defaults)) or "none"
        raise ValueError(f"policy {name!r} has no option {', '.join(unknown)}; its options are: {options}")
    for option, value in kwargs.items():
        _check_kind(name, option, defaults[option], value)
    return cls(**kwargs)


def _check_kind(policy: str, option: str, default, value) -> None:
    """A value of the option's kind, judged by its default (options without one are the class's to check)."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"policy {policy!r}: {option} takes true or false, got {value!r}")
    elif isinstance(default, (int, float)) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"policy {policy!r}: {option} takes a number, got {value!r}")

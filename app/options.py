"""Engine options, derived from the dataclasses in app/config.py (their single source).

`EngineConfig` nests `CacheConfig` and `SchedulerConfig`; every front end speaks one flat
namespace of option names (`kv_cache_dtype`, `max_num_seqs`, ...), the same in `LLM(...)`,
in CLI flags (`--kv-cache-dtype`) and in a Serve config's `engine:` block. This module
builds that table from the dataclass fields and turns flat options back into a validated
`EngineConfig`. No torch, no pydantic (app/serve/config.py derives its model from `OPTIONS`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from app.config import CacheConfig, EngineConfig, SchedulerConfig

_SECTIONS: dict[str | None, type] = {None: EngineConfig, "cache": CacheConfig}
_SECTIONS["scheduler"] = SchedulerConfig


@dataclass(frozen=True, slots=True)
class EngineOption:
    name: str
    section: str | None  # None: a field of EngineConfig itself; else its nested config
    type: type  # int | float | str | bool | dict (a nested config given as a mapping)
    optional: bool  # None is a valid value
    default: Any
    help: str
    choices: tuple | None


def _base_type(hint: Any) -> tuple[type, bool]:
    """(int, True) for `int | None`; nested dataclasses (SpeculativeConfig) become dict."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    optional = type(None) in args
    (base,) = [a for a in args if a is not type(None)]
    return (dict if dataclasses.is_dataclass(base) else base), optional


def _options() -> dict[str, EngineOption]:
    table: dict[str, EngineOption] = {}
    for section, cls in _SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in _SECTIONS:  # the nested configs themselves
                continue
            assert f.name not in table, f"option {f.name!r} is declared twice"
            base, optional = _base_type(hints[f.name])
            default = f.default if f.default is not dataclasses.MISSING else None
            meta = f.metadata
            table[f.name] = EngineOption(
                f.name, section, base, optional, default, meta.get("help", ""),
                meta.get("choices"),
            )  # fmt: skip
    return table


OPTIONS: dict[str, EngineOption] = _options()


def engine_config(options: Mapping[str, Any]) -> EngineConfig:
    """A validated EngineConfig from flat options (unset ones take the dataclass default).

    Raises TypeError naming an unknown option and ValueError naming a bad value.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(OPTIONS)}")
    parts: dict[str | None, dict[str, Any]] = {name: {} for name in _SECTIONS}
    for name, value in options.items():
        parts[OPTIONS[name].section][name] = value
    return EngineConfig(
        **parts[None],
        cache=CacheConfig(**parts["cache"]),
        scheduler=SchedulerConfig(**parts["scheduler"]),
    )


def flat_options(config: EngineConfig) -> dict[str, Any]:
    """The inverse of engine_config: every option's value in `config`."""
    out = {}
    for name, option in OPTIONS.items():
        owner = config if option.section is None else getattr(config, option.section)
        value = getattr(owner, name)
        out[name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return out


def add_engine_arguments(
    parser: argparse.ArgumentParser,
    names: list[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """One `--kebab-case` flag per engine option (or per name in `names`).

    Flags not given on the command line stay out of the namespace (argparse.SUPPRESS), so a
    CLI overrides only what the user typed; `defaults` are shown in the help text only.
    """
    group = parser.add_argument_group("engine options (app/config.py)")
    for name in names or list(OPTIONS):
        option = OPTIONS[name]
        default = (defaults or {}).get(name, option.default)
        kw: dict[str, Any] = {"default": argparse.SUPPRESS, "dest": name}
        kw["help"] = f"{option.help} (default: {default})"
        if option.type is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _parser_for(option)
            if option.choices:
                kw["choices"] = [c for c in option.choices if c is not None]
        group.add_argument("--" + name.replace("_", "-"), **kw)


def _parser_for(option: EngineOption):
    if option.type is dict:
        return _json_object
    return option.type


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def given_options(ns: argparse.Namespace) -> dict[str, Any]:
    """The engine options the user set on the command line (`--model` is each CLI's own:
    a positional argument of `LLM`, optional in a Serve config)."""
    return {k: v for k, v in vars(ns).items() if k in OPTIONS and k != "model"}

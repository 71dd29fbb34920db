"""`tokenmill serve`'s flags: one `--kebab-case` flag per settings field, generated from the class."""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal

from server.config.settings import ServerSettings
from server.config.vllm_flags import VLLM_DTYPES

# Other spellings of a flag (llama.cpp's), accepted beside the generated one.
FLAG_ALIASES = {"models_idle_unload_s": ("--sleep-idle-seconds",)}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One `--kebab-case` flag per settings field. A flag not given leaves the lower sources in force."""
    for name, info in ServerSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        flags = (flag, *FLAG_ALIASES.get(name, ()))
        default = info.get_default(call_default_factory=True)
        shown = "none" if default is None else (",".join(default) if isinstance(default, list) else default)
        help_text = f"{info.description or name} (default: {shown})"
        kind, choices = _flag_kind(info.annotation)
        if choices and name == "dtype":
            choices += list(VLLM_DTYPES)  # vLLM's names, mapped by the field's validator
        if kind is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        elif name == "lora_modules":  # vLLM's spelling: --lora-modules a=/path b=/path (or JSON objects)
            parser.add_argument(flag, dest=name, default=argparse.SUPPRESS, nargs="+", metavar="NAME=PATH",
                                help=help_text)
        else:
            parser.add_argument(*flags, dest=name, default=argparse.SUPPRESS, choices=choices,
                                metavar=None if choices else name.upper(), help=help_text)


def settings_from_flags(namespace: argparse.Namespace) -> ServerSettings:
    """Settings from parsed flags over env and the YAML file. Raises pydantic.ValidationError."""
    given: dict[str, Any] = {}
    for name, value in vars(namespace).items():
        if name in ServerSettings.model_fields:
            # "none" is a value of its own where the field lists it (--quantization none), else unset
            literal = "none" in (_flag_kind(ServerSettings.model_fields[name].annotation)[1] or [])
            null = isinstance(value, str) and value.lower() in ("none", "null") and not literal
            given[name] = None if null else value
    return ServerSettings(**given)


def parse_settings(argv: Sequence[str]) -> ServerSettings:
    """Settings from a `serve` argument list (for tests and embedding)."""
    parser = argparse.ArgumentParser(prog="tokenmill serve")
    add_flags(parser)
    return settings_from_flags(parser.parse_args(list(argv)))


def _flag_kind(annotation: Any) -> tuple[type | None, list[str] | None]:
    """bool for on/off flags, plus choices for Literal fields; None for everything else."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if annotation is bool:
        return bool, None
    if typing.get_origin(annotation) is Literal:
        return None, [str(a) for a in typing.get_args(annotation)]
    return None, None

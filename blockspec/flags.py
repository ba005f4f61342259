"""argparse pieces every command line of blockspec shares (``generate``, ``serve``, ``eval``,
``train-*``): the help formatter that shows defaults and choices, case-insensitive choices and
one flag per ``EngineArgs`` field. Torch-free, so building a parser stays instant."""
from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import MISSING, fields

from blockspec.args import EngineArgs, choices_of

_TYPES: dict[str, type] = {"str": str, "int": int, "float": float, "bool": bool}


class HelpFormatter(argparse.HelpFormatter):
    """Appends every option's default and choices to its help, so the two cannot drift apart.
    A help text that already says ``default:`` (for a default that is a behaviour, not a
    value) keeps its own words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is argparse.SUPPRESS or not action.option_strings:
            return text                                 # -h, --version, positionals, commands
        notes = []
        if "default" not in text and not action.required:
            d = action.default
            shown = "none" if d is None else ("on" if d else "off") if isinstance(d, bool) else d
            notes.append(f"default: {shown}")
        if action.choices and "choices" not in text:
            notes.append(f"choices: {', '.join(map(str, action.choices))}")
        extra = f" ({'; '.join(notes)})" if notes else ""
        return text + extra.replace("%", "%%")


def canonical(choices: Sequence[str]) -> Callable[[str], str]:
    """Case-insensitive choices: ``dflash`` is read as ``DFLASH``."""
    by_lower = {c.lower(): c for c in choices}

    def convert(text: str) -> str:
        return by_lower.get(text.lower(), text)

    return convert


def engine_flags(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per EngineArgs field (help, default and choices from the field)."""
    group = p.add_argument_group("engine options (EngineArgs fields)")
    for f in fields(EngineArgs):
        if f.name == "extra" or f.name in skip:
            continue
        flags = ("--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ()))
        kind = _TYPES[str(f.type).replace(" | None", "")]
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        kw = {"default": default, "help": f.metadata.get("help")}
        if kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction if default else "store_true",
                               **kw)
            continue
        choices = choices_of(f)
        group.add_argument(*flags, type=canonical(choices) if choices else kind, choices=choices,
                           metavar=f.name.upper() if not choices else None, **kw)

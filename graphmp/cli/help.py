"""The help style of every `graphmp` command: defaults shown, examples kept as written."""
from __future__ import annotations

import argparse


def _default_text(default) -> str:
    """A default as the user would type it: 1,8 for a list, 0.9 0.999 for a pair."""
    if isinstance(default, list):
        return ",".join(map(str, default))
    if isinstance(default, tuple):
        return " ".join(map(str, default))
    return str(default)


def _worth_saying(action) -> bool:
    """An option whose default tells the user something (not None, False, empty or a -v
    count; not a --no-X switch, whose default True reads as if --no-X were on)."""
    return (bool(action.option_strings) and action.default not in (None, False, (), [], "", argparse.SUPPRESS)
            and not isinstance(action, (argparse._CountAction, argparse._StoreFalseAction)))


def use_help_style(parser: argparse.ArgumentParser) -> None:
    """`parser` formats its help with HelpFormatter; an option given no help text still shows
    its default (argparse prints nothing after an option without help)."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if action.help is None and _worth_saying(action):
            action.help = "default: %(default)s"


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter with two changes. An option's help ends with "(default: X)"
    where it has a default worth saying (not None, False, an empty value or a -v count) and
    its text does not already give one. A description or epilog that holds line breaks (the
    examples, tables) is printed as written; one without is wrapped to the terminal."""

    def _get_help_string(self, action):
        text = action.help or ""
        said = f"({_default_text(action.default)})" in text  # "(0.5)": the help gives it already
        if not _worth_saying(action) or "default" in text.lower() or said:
            return text
        return f"{text} (default: {_default_text(action.default).replace('%', '%%')})"

    def _fill_text(self, text, width, indent):
        if "\n" in text.strip():
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

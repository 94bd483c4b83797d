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


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter with two changes. An option's help ends with "(default: X)"
    where it has a default worth saying (not None, False, an empty value or a -v count) and
    its text does not already give one. A description or epilog that holds line breaks (the
    examples, tables) is printed as written; one without is wrapped to the terminal."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default in (None, False, (), [], "", argparse.SUPPRESS)
                or isinstance(action, argparse._CountAction) or "default" in text.lower()):
            return text
        shown = _default_text(default).replace("%", "%%")
        return f"{text} (default: {shown})" if text else f"default: {shown}"

    def _fill_text(self, text, width, indent):
        if "\n" in text.strip():
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

"""Names taken from a model (tensors, nodes, outputs, locations) as graphmp prints them.

A model is untrusted text: a name may hold newlines, NULs or terminal escapes that clear
the screen, retitle the window or forge a `PASS` line, and it may be 100 KB long. Every
name a command prints goes through `shown`: control and other non-printable characters
appear escaped (`\\x1b`, `\\n`), and a long name is cut to `limit` characters with `...`.
"""
from __future__ import annotations

NAME_LIMIT = 120


def shown(name, limit: int = NAME_LIMIT) -> str:
    """`name` (any object; str() of it) safe for one line of a terminal: non-printable
    characters escaped, at most `limit` characters (then `...`). Printable names under
    the limit come back unchanged."""
    text = name if isinstance(name, str) else str(name)
    if not text.isprintable():
        text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return f"{text[:limit]}..." if len(text) > limit else text


def printable_lines(lines) -> str:
    """Lines of a report joined by newlines, each made one printable line (one_line): a
    name with a newline or a terminal escape inside cannot forge or hide a line."""
    return "\n".join(one_line(x) for x in lines)


def one_line(text: str) -> str:
    """A whole message as one printable line (no cut): non-printable characters escaped."""
    return text if text.isprintable() else "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)

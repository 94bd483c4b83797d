"""The one exception users see. Its message names the file (and node) and what to do."""


class GraphmpError(Exception):
    """A problem with the user's input or environment, explained in one line."""


def first_line(e: BaseException, limit: int = 240) -> str:
    """The first non-empty line of an exception's message (ONNX Runtime and onnx add
    pages of context), for one-line reports."""
    lines = [x for x in str(e).strip().splitlines() if x.strip()]
    return (lines[0] if lines else type(e).__name__)[:limit]

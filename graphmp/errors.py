"""The one exception users see. Its message names the file (and node) and what to do."""


class GraphmpError(Exception):
    """A problem with the user's input or environment, explained in one line."""

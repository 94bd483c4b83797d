"""graphmp's version (kept equal to pyproject.toml's), at the bottom of the import graph."""
__version__ = "0.1.0"

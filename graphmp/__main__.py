"""`python -m graphmp`: the `graphmp` command (as `python -m graphmp.cli`)."""
import sys

from .cli import main

sys.exit(main())

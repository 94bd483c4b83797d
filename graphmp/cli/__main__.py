"""`python -m graphmp.cli`: the `graphmp` command."""
import sys

from . import main

sys.exit(main())

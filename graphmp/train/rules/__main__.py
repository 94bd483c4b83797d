"""`python -m graphmp.train.rules --table`: print docs/training_ops.md (see table.py)."""
import os
import sys

from .table import render, tested_by


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["--table"]:
        print("usage: python -m graphmp.train.rules --table > docs/training_ops.md\n"
              "  prints the table of every ONNX op, its gradient rule and its tests", file=sys.stderr)
        return 2
    tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests")
    if not os.path.exists(os.path.join(tests, "test_autodiff.py")):
        print(f"error: {os.path.normpath(tests)} has no test_autodiff.py; run this from a source checkout",
              file=sys.stderr)
        return 2
    sys.stdout.write(render(tested_by(os.path.normpath(tests))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run `python -c CODE ...` or `python -m MODULE ...` and, at exit, write this process's
peak RSS (VmHWM, in kB) to the file named by $GRAPHMP_HWM_FILE.

ru_maxrss of a child counts the parent's RSS inherited through fork; VmHWM is reset by
exec, so it is the command's own peak (benchmarks/convert_speed.py)."""
import atexit
import os
import runpy
import sys


def _write():
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    with open(os.environ["GRAPHMP_HWM_FILE"], "w") as f:
        f.write(str(kb))


atexit.register(_write)
mode, target, *rest = sys.argv[1:]
if mode == "-c":
    sys.argv = ["-c"] + rest
    exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
else:
    sys.argv = [target] + rest
    runpy.run_module(target, run_name="__main__", alter_sys=True)

"""Every model run is bounded and stoppable (graphmp.run_limits).

A Loop with a constant trip count over MAX_LOOP_TRIPS is refused at load, naming the node;
a run past its time or memory limit is one line and exit 2 (never a different plan, never
an output); SIGTERM ends a run inside ONNX Runtime within seconds, with no traceback and no
temporary file left. The long runs are a Loop of 10^7 iterations (about a minute): each
test stops it early, by a limit set small through the environment or by a signal.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper as oh, numpy_helper as nph

from graphmp.cli import main
from graphmp.run_limits import BASE_SECONDS, MAX_LOOP_TRIPS, RunLimits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _body(inner=None):
    nodes = [oh.make_node("Add", ["x_in", "one"], ["x_add"], name="add"),
             oh.make_node("Identity", ["c_in"], ["c_out"], name="keep")]
    if inner is not None:
        nodes.append(oh.make_node("Loop", ["M_inner", "c_in", "x_add"], ["x_out"], name="inner", body=inner))
    else:
        nodes.append(oh.make_node("Identity", ["x_add"], ["x_out"], name="pass"))
    return oh.make_graph(nodes, "body",
                         [oh.make_tensor_value_info("i", T.INT64, []), oh.make_tensor_value_info("c_in", T.BOOL, []),
                          oh.make_tensor_value_info("x_in", T.FLOAT, [1, 4])],
                         [oh.make_tensor_value_info("c_out", T.BOOL, []),
                          oh.make_tensor_value_info("x_out", T.FLOAT, [1, 4])],
                         [nph.from_array(np.ones((1, 4), np.float32), "one")])


def loop_model(trips: int, inner_trips: int | None = None) -> onnx.ModelProto:
    """x -> Loop 'spin' (trips iterations of x + 1; with inner_trips, each iteration runs
    Loop 'inner' that many times) -> y."""
    inner = _body() if inner_trips is not None else None
    inits = [nph.from_array(np.array(trips, np.int64), "M"), nph.from_array(np.array(True), "cond")]
    if inner_trips is not None:
        inits.append(nph.from_array(np.array(inner_trips, np.int64), "M_inner"))
    g = oh.make_graph([oh.make_node("Loop", ["M", "cond", "x"], ["y"], name="spin", body=_body(inner))], "g",
                      [oh.make_tensor_value_info("x", T.FLOAT, [1, 4])],
                      [oh.make_tensor_value_info("y", T.FLOAT, [1, 4])], inits)
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])


@pytest.fixture
def long_loop(tmp_path):
    """A model whose one run takes about a minute (10^7 iterations: under the trip-count cap)."""
    p = tmp_path / "models" / "loop.onnx"
    p.parent.mkdir()
    onnx.save(loop_model(MAX_LOOP_TRIPS), str(p))
    return str(p)


def _err(capsys):
    """The one error line (progress lines before it are convert's log); no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [x for x in err.splitlines() if x.startswith("graphmp: error:")]
    assert len(errors) == 1 and err.endswith(errors[0] + "\n"), err
    return errors[0]


@pytest.mark.parametrize("argv", [["check", "{m}", "{m}"], ["pad", "{m}", "-o", "{o}", "--validate"],
                                  ["convert", "{m}", "-o", "{o}"], ["bench", "{m}", "--backends", "ort-cpu"]])
def test_a_constant_trip_count_of_1e12_is_refused_naming_the_loop(tmp_path, capsys, argv):
    m, o = str(tmp_path / "spin.onnx"), str(tmp_path / "out.onnx")
    onnx.save(loop_model(10 ** 12), m)
    t0 = time.monotonic()
    rc = main([a.format(m=m, o=o) for a in argv])
    err = _err(capsys)
    assert rc == 2 and time.monotonic() - t0 < 30
    assert "Loop node spin" in err and "1000000000000" in err
    assert not os.path.exists(o)


def test_nested_loops_count_as_the_product_of_their_trips(tmp_path, capsys):
    m = str(tmp_path / "nested.onnx")
    onnx.save(loop_model(10 ** 4, inner_trips=10 ** 4), m)  # 10^8 iterations of the inner body
    assert main(["check", m, m]) == 2
    err = _err(capsys)
    assert "Loop node inner" in err and "body of spin" in err


def test_the_default_time_limit_stops_a_trivial_model_within_about_a_minute(monkeypatch):
    monkeypatch.delenv("GRAPHMP_RUN_SECONDS", raising=False)
    tiny = RunLimits.for_model(len(loop_model(10).SerializeToString()))
    big = RunLimits.for_model(500 << 20)
    assert BASE_SECONDS <= tiny.seconds < BASE_SECONDS + 1 < big.seconds
    monkeypatch.setenv("GRAPHMP_RUN_SECONDS", "0")
    assert RunLimits.for_model(10).seconds is None


@pytest.mark.parametrize("cmd", ["check", "convert", "pad", "bench"])
def test_a_run_past_its_time_limit_is_one_line_and_writes_nothing(long_loop, tmp_path, capsys, monkeypatch, cmd):
    monkeypatch.setenv("GRAPHMP_RUN_SECONDS", "1")
    out = str(tmp_path / "out.onnx")
    argv = {"check": ["check", long_loop, long_loop], "convert": ["convert", long_loop, "-o", out],
            "pad": ["pad", long_loop, "-o", out, "--validate"],
            "bench": ["bench", long_loop, "--backends", "ort-cpu", "--json", out]}[cmd]  # an error, not a failed row
    t0 = time.monotonic()
    rc = main(argv)
    err = _err(capsys)
    assert rc == 2 and time.monotonic() - t0 < 30, err
    assert "stopped after 1 s, the time limit of one run" in err
    assert "GRAPHMP_RUN_SECONDS" in err
    assert cmd == "pad" or not os.path.exists(out)  # pad --validate validates what it wrote, as for a FAIL


def test_a_run_past_its_memory_limit_is_one_line(long_loop, capsys, monkeypatch):
    monkeypatch.setenv("GRAPHMP_RUN_MEMORY_MB", "1")  # below what any process holds: the first look stops it
    assert main(["check", long_loop, long_loop]) == 2
    err = _err(capsys)
    assert "memory limit of one run" in err and "GRAPHMP_RUN_MEMORY_MB" in err


def test_a_bad_limit_setting_is_one_line(long_loop, capsys, monkeypatch):
    monkeypatch.setenv("GRAPHMP_RUN_SECONDS", "soon")
    assert main(["check", long_loop, long_loop]) == 2
    assert "GRAPHMP_RUN_SECONDS='soon' is not a number" in _err(capsys)


# The child announces each run on stderr before it starts (a wrapper around the guard), so
# the signal is sent while ONNX Runtime runs, not while Python starts up.
_CHILD = textwrap.dedent("""
    import sys
    from graphmp import run_limits
    real = run_limits.guarded.__call__
    def announced(self, call):
        print("RUN STARTS", file=sys.stderr, flush=True)
        return real(self, call)
    run_limits.guarded.__call__ = announced
    from graphmp.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.parametrize("cmd, sig, code, said", [("check", signal.SIGTERM, 143, "terminated"),
                                                  ("convert", signal.SIGTERM, 143, "terminated"),
                                                  ("check", signal.SIGINT, 130, "interrupted")])
def test_a_signal_ends_a_run_inside_onnxruntime_within_seconds(long_loop, tmp_path, cmd, sig, code, said):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    argv = ["check", long_loop, long_loop] if cmd == "check" else ["convert", long_loop, "-o", str(out / "o.onnx")]
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("GRAPHMP_RUN_SECONDS", None)
    p = subprocess.Popen([sys.executable, "-c", _CHILD, *argv], stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in p.stderr:
            if "RUN STARTS" in line:
                break
        time.sleep(1.0)  # well inside the 10^7 iterations
        assert p.poll() is None
        t0 = time.monotonic()
        p.send_signal(sig)
        rc = p.wait(timeout=30)
        took = time.monotonic() - t0
        err = p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == code and took < 5, (rc, took, err)
    assert "Traceback" not in err and said in err
    assert os.listdir(out) == []
    # graphmp's temporary files: graphmp-* folders in TMPDIR, .graphmp-* / *.tmp next to outputs
    assert not [f for f in os.listdir(tmp) if "graphmp" in f or f.endswith(".tmp")]

"""What the commands print (issue 37): by default the result and real warnings, each once;
-q nothing on success; -v the steps with their timings; -vv per-node decisions; progress
lines only on a terminal or with -v; C/C++ libraries' prints never on stdout. Also the
entry points and help: `python -m graphmp`, defaults in every --help, examples that parse,
and no output in the source model's folder without -o."""
import os
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest

import graphmp.context
from graphmp import progress
from graphmp.cli import COMMANDS, _parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESNET = os.path.join(ROOT, "models", "tiny", "resnet.onnx")
MNIST = os.path.join(ROOT, "models", "real", "mnist_cntk.onnx")


def _graphmp(*argv, cwd=ROOT):
    """`python -m graphmp ...` in a fresh process (stderr is a pipe, not a terminal)."""
    return subprocess.run([sys.executable, "-m", "graphmp", *argv], capture_output=True, text=True, cwd=cwd)


def test_default_convert_prints_the_summary_and_each_warning_once(tmp_path):
    r = _graphmp("convert", RESNET, "-o", str(tmp_path / "r.onnx"))
    assert r.returncode == 0, r.stderr
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
    assert r.stderr == ""            # no step log, no progress line into a pipe, no third-party warning
    assert lines[0].startswith(f"{RESNET} -> ") and lines[-1].startswith("  time: ")
    assert len(lines) <= 10, r.stdout
    assert len(set(lines)) == len(lines), r.stdout   # the generated-inputs warning was printed twice
    assert not re.search(r"\w+\.run\b|plan_file|\[graphmp", r.stdout)  # no internal step names
    assert sum("warning: calibration ran on generated inputs" in x for x in lines) == 1


def test_the_validation_in_a_convert_summary_is_lines_of_its_own(tmp_path, capsys):
    assert main(["convert", RESNET, "-o", str(tmp_path / "r.onnx"), "--validate"]) == 0
    out = capsys.readouterr().out
    assert "\\n" not in out  # not one line with escaped newlines in it
    lines = out.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("  validation: ") and ": PASS (" in x)
    assert lines[at + 1].startswith("    inputs: ") and any(x.startswith("    logits: ok") for x in lines[at:])


def test_quiet_prints_nothing_on_success_and_still_the_error(tmp_path, capsys):
    out = str(tmp_path / "r.onnx")
    for argv in (["convert", RESNET, "-o", out, "-q"], ["check", RESNET, out, "-q"],
                 ["pad", RESNET, "-o", str(tmp_path / "p.onnx"), "-q"]):
        assert main(argv) == 0
        got = capsys.readouterr()
        assert got.out == "" and got.err == "", (argv, got)
    assert main(["convert", str(tmp_path / "missing.onnx"), "-o", out, "-q"]) == 2
    got = capsys.readouterr()
    assert got.out == "" and got.err.startswith("graphmp: error: ") and len(got.err.splitlines()) == 1


def test_verbose_adds_the_steps_with_timings_and_vv_the_decisions(tmp_path, capsys):
    out = str(tmp_path / "r.onnx")
    assert main(["convert", RESNET, "-o", out]) == 0
    plain = capsys.readouterr()
    assert main(["convert", RESNET, "-o", out, "-v"]) == 0
    v = capsys.readouterr()
    assert main(["convert", RESNET, "-o", out, "-vv"]) == 0
    vv = capsys.readouterr()
    assert re.search(r"calibrate\.run: \d+\.\d\d s", v.err) and "writing " in v.err
    assert "calibrate.run" not in plain.err
    assert "islands: drop" in vv.err and "islands: drop" not in v.err   # a per-node decision
    assert main(["convert", MNIST, "-o", out, "-vv", "--fp32-ops", "Relu"]) == 0
    assert re.search(r"FP32 Relu '[^']+': ", capsys.readouterr().err)     # why each FP32 node is FP32
    # the summary is the same whatever the level (stdout stays the result)
    strip = lambda s: re.sub(r"\d+(\.\d+)? s\b", "", s)  # noqa: E731  (timings: the total, the load check's)
    assert strip(plain.out) == strip(v.out) == strip(vv.out)


def test_progress_lines_only_on_a_terminal_or_with_v(tmp_path, capsys, monkeypatch):
    """A phase longer than the delay draws its progress line on stderr with -v; by default a
    pipe or file gets none (a terminal would); -q never; a library caller none."""
    monkeypatch.setattr(graphmp.context, "PROGRESS_DELAY_S", 0.0)  # every phase counts as long
    out = str(tmp_path / "r.onnx")
    assert main(["convert", RESNET, "-o", out, "-v"]) == 0
    assert re.search(r"calibration: batches: \d+ ", capsys.readouterr().err)
    assert main(["convert", RESNET, "-o", out]) == 0
    assert "calibration: batches" not in capsys.readouterr().err

    class Terminal:
        def isatty(self):
            return True
    for level, shown in ((progress.QUIET, False), (progress.NORMAL, True), (progress.VERBOSE, True), (None, False)):
        progress.set_verbosity(level)
        assert progress.shows_progress(Terminal()) is shown, level
    progress.set_verbosity(progress.NORMAL)
    with open(os.devnull, "w") as f:
        assert progress.shows_progress(f) is False   # a file at the default level
    progress.set_verbosity(None)


def test_a_short_phase_draws_nothing_a_long_one_draws_and_closes():
    import io
    buf = io.StringIO()
    with progress.Progress(desc="short", stream=buf, delay=3600) as bar:
        bar.update(1)
    assert buf.getvalue() == ""
    with progress.Progress(desc="long", stream=buf, delay=0.0) as bar:
        bar.update(1)
    assert buf.getvalue().startswith("long: 1 ")


def test_native_stdout_goes_to_stderr_while_a_command_runs():
    """onnx's and ORT's C++ code print straight to file descriptor 1; during a command it is
    stderr (shown) or nowhere, while graphmp's own print still reaches stdout."""
    code = ("import os, sys; from graphmp.progress import native_stdout_to_stderr\n"
            "with native_stdout_to_stderr(shown=sys.argv[1] == 'shown'):\n"
            "    os.write(1, b'native warning\\n'); print('result')\n"
            "print('after')\n"
            "os.write(1, b'native after\\n')\n")
    for shown in ("shown", "hidden"):
        r = subprocess.run([sys.executable, "-c", code, shown], capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        assert r.stdout == "result\nafter\nnative after\n"
        assert r.stderr == ("native warning\n" if shown == "shown" else "")


def test_onnx_cpp_warning_is_not_on_stdout(tmp_path):
    """style_mosaic's experimental ops make onnx's C++ checker print a warning on stdout
    (which the summary's "rewritten" line already says): off by default, on stderr with -v."""
    model = os.path.join(ROOT, "models", "real", "style_mosaic.onnx")
    for extra, on_stderr in (([], False), (["-v"], True)):
        r = _graphmp("convert", model, "-o", str(tmp_path / "s.onnx"), "--no-calibration", "--island-trials", "0",
                     *extra)
        assert r.returncode == 0, r.stderr
        assert "Warning:" not in r.stdout
        assert ("Warning: Model contains experimental ops" in r.stderr) is on_stderr
        assert r.stdout.count("rewritten (experimental ops") == 1


def test_python_dash_m_graphmp_works():
    r = _graphmp("--help")
    assert r.returncode == 0 and all(cmd in r.stdout for cmd in COMMANDS)
    assert "-v" in r.stdout and "python -m graphmp" in r.stdout
    r = _graphmp("--version")
    assert r.returncode == 0 and r.stdout.startswith("graphmp ")


def _help(command):
    sub = next(a for a in _parser()._actions if a.dest == "cmd")
    return sub.choices[command].format_help()


def _option_help(text, option):
    """The help of one option in a --help text, on one line."""
    m = re.search(rf"^  {re.escape(option)}\b.*?(?=^  -|\Z)", text, re.S | re.M)
    assert m, option
    return " ".join(m.group(0).split())


@pytest.mark.parametrize("command, option, default", [
    ("train", "--epochs", "1"), ("train", "--batch-size", "32"), ("train", "--checkpoint-every", "100"),
    ("pad", "--atol", "0.0001"), ("train-graph", "--optimizer", "adamw"), ("bench", "--rounds", "5"),
])
def test_help_shows_defaults(command, option, default):
    assert re.search(rf"default:? {re.escape(default)}\b", _option_help(_help(command), option)), option


def test_help_shows_accepted_values_and_no_default_none():
    for command in COMMANDS:
        text = _help(command)
        assert "default: None" not in text and "default: False" not in text, command
        assert "-q" in text and "-v" in text, command   # the shared verbosity group
    conv = _help("convert")
    assert "--max-error auto[:K]|E|tf32|floor[:K]" in conv
    assert "{fp16,bf16}" in conv and "{softmax,all,fp32}" in conv


def test_help_never_says_a_default_twice_nor_that_a_no_switch_is_on():
    assert "(default: True)" not in _option_help(_help("convert"), "--no-keep-io-types")
    assert "(default: True)" not in _option_help(_help("pad"), "--no-external-data")
    growth = _option_help(_help("train-graph"), "--growth-interval")
    assert "(2000)" in growth and "default: 2000" not in growth


def test_every_help_example_parses():
    """Each example line of every --help is a command line the parser accepts (a renamed
    flag in an example fails here), and each command shows one that runs from a clone."""
    for command in COMMANDS:
        text = _help(command)
        # an example: an indented line, or the rest of an "example: " line (not prose that wraps onto "graphmp")
        examples = [m.group(1).split("#")[0].strip() for m in re.finditer(r"^(?:\s+|.*examples?: )(graphmp .*)$",
                                                                         text, re.M)]
        examples = [e for e in examples if not e.endswith("\\")]    # a continued example: its first line only
        assert examples, f"`graphmp {command} --help` has no example"
        for e in examples:
            argv = shlex.split(e)[1:]
            try:
                _parser().parse_args(argv)
            except SystemExit:  # argparse's usage error
                pytest.fail(f"`graphmp {command} --help` example does not parse: {e}")
        if command not in ("build", "export"):   # TensorRT and a GPU; a trained run
            assert any("models/" in e for e in examples), f"`graphmp {command} --help`: no example from a clone"


def test_without_o_nothing_is_written_into_the_source_models_folder(tmp_path, monkeypatch, capsys):
    src = tmp_path / "models" / "m.onnx"
    src.parent.mkdir()
    shutil.copy(MNIST, src)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["convert", str(src), "-q"]) == 0
    assert main(["pad", str(src), "-q"]) == 0
    assert sorted(os.listdir(src.parent)) == ["m.onnx"]
    assert sorted(os.listdir(work)) == ["m.mp.onnx", "m.pad.onnx"]
    # a second run does not replace a file the user never named: one line, asking for -o
    before = (work / "m.mp.onnx").read_bytes()
    capsys.readouterr()
    assert main(["convert", str(src), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "m.mp.onnx exists" in err and "give -o m.mp.onnx" in err
    assert (work / "m.mp.onnx").read_bytes() == before
    assert main(["convert", str(src), "-o", "m.mp.onnx", "-q"]) == 0
    assert "in the current directory" in _option_help(_help("convert"), "-o OUTPUT, --output OUTPUT")


def test_the_calibration_line_summarises_many_batches(tmp_path, capsys):
    rng = np.random.default_rng(0)
    files = []
    for i, n in enumerate([4] * 6 + [2]):
        files.append(str(tmp_path / f"b{i}.npz"))
        np.savez(files[-1], pixel_values=rng.standard_normal((n, 3, 32, 32)).astype(np.float32))
    assert main(["convert", RESNET, "-o", str(tmp_path / "r.onnx"), "--calibration", *files]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  calibration:"))
    assert "7 batches (pixel_values:4x3x32x32 (x6); pixel_values:2x3x32x32)" in line, line


def test_same_file_error_reads_well(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    shutil.copy(MNIST, src)
    assert main(["convert", str(src), "-o", str(src)]) == 2
    assert "Choose another path for the output (-o)" in capsys.readouterr().err


def test_train_graph_train_and_export_quiet_print_nothing_on_success(tmp_path, capsys):
    rng = np.random.default_rng(0)
    run, data = str(tmp_path / "run"), str(tmp_path / "d.npz")
    np.savez(data, Input3=rng.standard_normal((3, 1, 28, 28)).astype(np.float32), labels=rng.integers(0, 10, 3))
    assert main(["train-graph", MNIST, "-o", run, "--precision", "fp32", "-q"]) == 0
    assert main(["train", run, "--data", data, "--batch-size", "1", "--max-steps", "2", "--device", "cpu",
                 "--checkpoint-every", "0", "-q"]) == 0
    assert main(["export", run, "-o", str(tmp_path / "e.onnx"), "-q"]) == 0
    got = capsys.readouterr()
    assert got.out == "" and got.err == "", got
    assert main(["train", run, "--data", data, "--batch-size", "1", "--max-steps", "3", "--device", "cpu",
                 "--checkpoint-every", "0"]) == 0   # resumes: one more step, and its summary
    got = capsys.readouterr()
    assert got.out.startswith("steps: ") and got.err == "", got


def test_verbose_lines_escape_names_from_the_model(tmp_path, capsys, monkeypatch):
    """-vv prints node names from an untrusted model: a newline or terminal escape in one
    cannot forge a line or reach the terminal."""
    import onnx
    monkeypatch.setattr(graphmp.context, "PROGRESS_DELAY_S", 3600.0)  # no progress line on a slow machine
    m = onnx.load(MNIST)
    relu = next(n for n in m.graph.node if n.op_type == "Relu")
    relu.name = "evil\n[graphmp    0.0s] forged\x1b[2J"
    onnx.save(m, str(tmp_path / "m.onnx"))
    assert main(["convert", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "o.onnx"), "-vv", "--fp32-ops", "Relu"]) == 0
    err = capsys.readouterr().err
    assert "\x1b" not in err and "forged" in err
    assert all(line.startswith("[graphmp ") for line in err.splitlines()), err

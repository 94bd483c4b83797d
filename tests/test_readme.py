"""The README runs as written (issue 22).

Every command line of README.md's fenced bash/sh blocks after the first (the first holds
the setup commands, which `.ci/run` runs) is run from the repository root, in order, with
the repository's .venv, and must exit 0, or the code a trailing `# exit N` comment names.
The tour writes only under /tmp/graphmp-tour/. Also: the README stays a short front door
that starts with the setup commands, and every relative link in README.md and docs/*.md
points to a file that exists.
"""
import os
import re
import shlex
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
GRAPHMP = os.path.join(ROOT, ".venv", "bin", "graphmp")
TOUR_DIR = "/tmp/graphmp-tour/"
SETUP = [
    "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && "
    ".venv/bin/graphmp convert models/real/mnist_cntk.onnx -o /tmp/mnist.mp.onnx --validate",
    "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && .venv/bin/python -m pytest",
]
COMMAND_TIMEOUT_S = 120
# options whose value is a file or folder a command writes
OUTPUT_OPTIONS = {"-o", "--output", "--report", "--json", "--save-plan", "--plot", "--keep"}
EXIT_RE = re.compile(r"#\s*exit\s+(\d+)\s*$")
FENCE_RE = re.compile(r"^```(\S*)\s*$")
LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def code_blocks(text):
    """[(language, [lines])] of the fenced blocks of a markdown text, in order."""
    blocks, lang, lines = [], None, []
    for line in text.splitlines():
        m = FENCE_RE.match(line)
        if lang is None and m:
            lang, lines = m.group(1).lower(), []
        elif lang is not None and line.strip() == "```":
            blocks.append((lang, lines))
            lang = None
        elif lang is not None:
            lines.append(line)
    assert lang is None, "README.md has an unclosed ``` block"
    return blocks


def commands(lines):
    """Command lines of a shell block: continuations joined, blank and comment lines dropped."""
    out, pending = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.strip() and not line.strip().startswith("#"):
            out.append(line.strip())
    assert not pending, "a shell block ends with a line continuation"
    return out


def tour_commands():
    shell = [lines for lang, lines in code_blocks(_read(README)) if lang in ("bash", "sh", "shell")]
    return [cmd for lines in shell[1:] for cmd in commands(lines)]


def expected_exit(cmd):
    m = EXIT_RE.search(cmd)
    return int(m.group(1)) if m else 0


def test_readme_starts_with_the_setup_commands_and_stays_short():
    text = _read(README)
    lines = text.splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; the front door keeps to 150"
    assert lines[:6] == ["# graphmp", "", "```bash", *SETUP, "```"]
    assert SETUP[1] in _read(os.path.join(ROOT, ".ci", "run"))


def test_tour_commands_use_the_venv_and_write_to_tmp():
    cmds = tour_commands()
    assert len(cmds) >= 10, cmds
    for cmd in cmds:
        words = shlex.split(cmd, comments=True)
        assert words[0].startswith(".venv/bin/") or words[0] == "mkdir", (
            f"not runnable from a fresh clone (use .venv/bin/...): {cmd}")
        for opt, value in zip(words, words[1:]):
            if opt in OUTPUT_OPTIONS:
                assert value.startswith(TOUR_DIR), f"{opt} {value} writes outside {TOUR_DIR}: {cmd}"
        for path in re.findall(r"savez\(\s*f?['\"]([^'\"]+)['\"]", cmd):
            assert path.startswith(TOUR_DIR), f"{path} is written outside {TOUR_DIR}: {cmd}"


@pytest.mark.skipif(not os.path.exists(GRAPHMP),
                    reason="no .venv/bin/graphmp: run the README's first command to make .venv")
def test_readme_commands_run_as_written():
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the .venv's own install, as a newcomer has it
    start = time.monotonic()
    for cmd in tour_commands():
        want = expected_exit(cmd)
        try:
            res = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True,
                                 text=True, timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"README command ran past {COMMAND_TIMEOUT_S} s: {cmd}")
        assert res.returncode == want, (
            f"README command exited {res.returncode}, expected {want}:\n{cmd}\n"
            f"--- stdout (tail)\n{res.stdout[-3000:]}\n--- stderr (tail)\n{res.stderr[-3000:]}")
    print(f"README tour: {time.monotonic() - start:.1f} s")


def _markdown_files():
    docs = os.path.join(ROOT, "docs")
    return [README] + sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_point_to_existing_files(path):
    text = re.sub(r"```.*?```", "", _read(path), flags=re.S)  # links only outside code blocks
    broken = []
    for target in LINK_RE.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        file = target.split("#", 1)[0]
        if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(path), file))):
            broken.append(target)
    assert not broken, f"{os.path.relpath(path, ROOT)}: links to missing files: {broken}"

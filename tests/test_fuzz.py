"""Fuzzing graphmp's commands with mutated models (untrusted input, see SECURITY.md).

Each example takes a small VALID model (a CNN, an MLP, a model with an If subgraph; each
inline or with its weights in `w.data`), applies one to three mutations (protobuf fields,
tensor data, external-data entries, graph wiring, the file itself) and runs a graphmp
command in-process (`graphmp.cli.main`). Every example must end in one of two ways:

* rc 0, and every model written passes `onnx.checker.check_model(path, full_check=True)`
  and loads in ONNX Runtime (CPU);
* rc 1 or 2, with stderr ending in exactly one `graphmp: error: ...` line and no traceback
  (`check` may also exit 1 for an accuracy verdict).

and whatever the outcome:

* no exception escapes `main` and nothing hangs (a FIFO that graphmp opens is unblocked);
* no byte is read from outside the model's folder: a secret file sits next to the model's
  folder (`ROOT/secret.bin`), and copies of it sit in the working directory under the
  model's data file names (`ROOT/cwd/w.data`, ...); the test fails if one is opened
  (inotify, Linux) or if the marker (raw, or converted to FP16/BF16) appears in any file
  written, or if a written model references external data outside its own folder;
* the input files (model, data files, links, FIFOs) are unchanged byte for byte, nothing
  is added to the input folders, nothing is written on an error, no temporary file stays.

Layout of one example:  ROOT/secret.bin  ROOT/model/m.onnx (+ w.data, link.bin, ...)
ROOT/other/ (the second model of `check`)  ROOT/out/ (outputs)  ROOT/cwd/ (working dir).
The *-beside commands write the output into ROOT/model/, next to the input.

Tests: one hypothesis test per command (derandomized: CI runs the same examples every
time; each reports the first failure it meets, with the mutations, the command, the
traceback's last frames or the leaked bytes, and a replay line), and a plain seeded sweep
over all commands that does not stop at the first failure: it reports one example of
every distinct failure class.

Run longer:   GRAPHMP_FUZZ_EXAMPLES=5000 python -m pytest tests/test_fuzz.py
All distinct failure classes at once (no stop at the first):
              GRAPHMP_FUZZ_EXAMPLES=300 python -m pytest tests/test_fuzz.py -k sweep
Replay the example of a failure message (it prints the JSON):
              GRAPHMP_FUZZ_REPLAY='<json>' python -m pytest tests/test_fuzz.py -k replay
Keep the folder of every failing example:  GRAPHMP_FUZZ_KEEP=/some/dir
Survey: append every failing example of the hypothesis tests to a JSON-lines file
instead of stopping at the first:  GRAPHMP_FUZZ_LOG=fuzz.jsonl
Shrink failures to a minimal example (slower):  GRAPHMP_FUZZ_SHRINK=1
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
import traceback

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from onnx import TensorProto, helper, numpy_helper

import onnxruntime as ort
from graphmp.cli import main
from graphmp.ir import iter_graphs
from graphmp.weight_rounding import to_bf16_bits
from graphmp.paths import iter_tensors

# Scale of the suite: examples of the main test (convert --no-calibration); the other
# tests get a share of it (_n), the sweep half. The default keeps the file well under a
# minute on a 2-core CI machine.
EXAMPLES = int(os.environ.get("GRAPHMP_FUZZ_EXAMPLES", "150"))
HANG_S = float(os.environ.get("GRAPHMP_FUZZ_HANG_S", "120"))   # an example running longer is a hang
KEEP = os.environ.get("GRAPHMP_FUZZ_KEEP")


def _n(share: float, least: int = 2) -> int:
    return max(least, int(EXAMPLES * share))


# Shrinking a failure costs many more runs than finding it; examples are small already
# (one to three mutations), so CI reports what it found. GRAPHMP_FUZZ_SHRINK=1 shrinks.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if os.environ.get("GRAPHMP_FUZZ_SHRINK")
                                                          else [])
SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=False, phases=PHASES,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])

# --------------------------------------------------------------------------- the secret
# 16 float32 values of moderate magnitude (inside the FP16 range, so a converter would
# turn them into FP16 rather than keep them): 64 bytes, repeated to fill the file.
_MARK = np.random.default_rng(20240917).uniform(-60.0, 60.0, 16).astype(np.float32)
MARKER = _MARK.tobytes()
SECRET = MARKER * 256  # 16 KiB


def _bf16(a: np.ndarray, rounding: bool) -> bytes:
    if rounding:
        return to_bf16_bits(a).tobytes()
    return (np.ascontiguousarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()


def _leak_patterns() -> list[tuple[str, bytes]]:
    """Byte strings that appear in a file only if secret bytes went into it: any 32-byte
    window of the raw stream (every byte offset), and 8 consecutive marker values (every
    value offset) converted to FP16 or BF16 (rounded or truncated)."""
    pats = []
    stream = MARKER * 3
    for k in range(64):
        pats.append((f"raw bytes (offset {k})", stream[k:k + 32]))
    vals = np.concatenate([_MARK, _MARK])
    for k in range(16):
        w = vals[k:k + 8]
        pats.append((f"as FP16 (value {k})", w.astype(np.float16).tobytes()))
        pats.append((f"as BF16 (value {k})", _bf16(w, True)))
        pats.append((f"as BF16 truncated (value {k})", _bf16(w, False)))
    return pats


LEAK_PATTERNS = _leak_patterns()


class SecretWatch:
    """inotify watches on the secret files: reports every open/read of them (Linux only;
    a no-op elsewhere, the marker scan still runs). events() -> {(label, "opened"|"read")}."""
    IN_ACCESS, IN_OPEN = 0x001, 0x020

    def __init__(self, paths: dict):
        """paths: {path: label}."""
        self.fd, self.labels = -1, {}
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if fd < 0:
                return
            for path, label in paths.items():
                wd = libc.inotify_add_watch(fd, os.fsencode(path), self.IN_ACCESS | self.IN_OPEN)
                if wd >= 0:
                    self.labels[wd] = label
            self.fd = fd
        except (OSError, AttributeError):
            self.fd = -1

    def events(self) -> set:
        seen = set()
        if self.fd < 0:
            return seen
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return seen
            if not buf:
                return seen
            i = 0
            while i + 16 <= len(buf):
                wd = int.from_bytes(buf[i:i + 4], sys.byteorder, signed=True)
                mask = int.from_bytes(buf[i + 4:i + 8], sys.byteorder)
                length = int.from_bytes(buf[i + 12:i + 16], sys.byteorder)
                label = self.labels.get(wd, "?")
                if mask & self.IN_OPEN:
                    seen.add((label, "opened"))
                if mask & self.IN_ACCESS:
                    seen.add((label, "read"))
                i += 16 + length

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# --------------------------------------------------------------------------- base models
OPSET = 17
F = TensorProto.FLOAT


def _w(seed, shape, scale=0.3):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _model(nodes, inputs, outputs, inits, name):
    g = helper.make_graph(nodes, name, inputs, outputs, initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="graphmp-fuzz")
    m.ir_version = 8
    return m


def _cnn():
    nodes = [
        helper.make_node("Conv", ["x", "conv_w", "conv_b"], ["c"], name="conv", kernel_shape=[3, 3],
                         pads=[1, 1, 1, 1], strides=[1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten", axis=1),
        helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["y"], name="fc", alpha=1.0, beta=1.0, transB=1),
    ]
    inits = [numpy_helper.from_array(_w(1, (8, 3, 3, 3)), "conv_w"), numpy_helper.from_array(_w(2, (8,)), "conv_b"),
             numpy_helper.from_array(_w(3, (4, 8)), "fc_w"), numpy_helper.from_array(_w(4, (4,)), "fc_b")]
    return _model(nodes, [helper.make_tensor_value_info("x", F, ["N", 3, 8, 8])],
                  [helper.make_tensor_value_info("y", F, ["N", 4])], inits, "cnn")


def _mlp():
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m1"], name="mm1"),
        helper.make_node("Add", ["m1", "b1"], ["a1"], name="add1"),
        helper.make_node("Relu", ["a1"], ["r1"], name="relu1"),
        helper.make_node("MatMul", ["r1", "w2"], ["m2"], name="mm2"),
        helper.make_node("Add", ["m2", "b2"], ["a2"], name="add2"),
        helper.make_node("Softmax", ["a2"], ["y"], name="softmax", axis=-1),
    ]
    inits = [numpy_helper.from_array(_w(5, (16, 32)), "w1"), numpy_helper.from_array(_w(6, (32,)), "b1"),
             numpy_helper.from_array(_w(7, (32, 10)), "w2"), numpy_helper.from_array(_w(8, (10,)), "b2")]
    return _model(nodes, [helper.make_tensor_value_info("x", F, ["N", 16])],
                  [helper.make_tensor_value_info("y", F, ["N", 10])], inits, "mlp")


def _if_model():
    then_g = helper.make_graph(
        [helper.make_node("MatMul", ["h", "wt"], ["t_out"], name="then_mm")], "then_branch", [],
        [helper.make_tensor_value_info("t_out", F, ["N", 8])],
        initializer=[numpy_helper.from_array(_w(9, (8, 8)), "wt")])
    else_g = helper.make_graph(
        [helper.make_node("Mul", ["h", "two"], ["e_out"], name="else_mul")], "else_branch", [],
        [helper.make_tensor_value_info("e_out", F, ["N", 8])],
        initializer=[numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["h"], name="mm0"),
        helper.make_node("ReduceSum", ["h"], ["s"], name="sum", keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["c"], name="gt"),
        helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then_g, else_branch=else_g),
    ]
    inits = [numpy_helper.from_array(_w(10, (8, 8)), "w0"), numpy_helper.from_array(np.array(0.0, np.float32), "zero")]
    return _model(nodes, [helper.make_tensor_value_info("x", F, ["N", 8])],
                  [helper.make_tensor_value_info("y", F, ["N", 8])], inits, "ifmodel")


def _with_external(m: onnx.ModelProto):
    """(model whose tensors reference w.data, {'w.data': bytes}) as onnx.save writes them."""
    d = tempfile.mkdtemp(prefix="graphmp-fuzz-base-")
    try:
        c = onnx.ModelProto()
        c.CopyFrom(m)
        p = os.path.join(d, "m.onnx")
        onnx.save(c, p, save_as_external_data=True, all_tensors_to_one_file=True, location="w.data",
                  size_threshold=0)
        with open(os.path.join(d, "w.data"), "rb") as f:
            data = f.read()
        return onnx.load(p, load_external_data=False), {"w.data": data}
    finally:
        shutil.rmtree(d, ignore_errors=True)


_BASES: dict = {}


def bases() -> dict:
    """name -> (ModelProto, {data file name: bytes}); built once."""
    if not _BASES:
        for name, build in (("cnn", _cnn), ("mlp", _mlp), ("if", _if_model)):
            m = build()
            onnx.checker.check_model(m, full_check=True)
            _BASES[name] = (m, {})
            _BASES[name + "+ext"] = _with_external(m)
    return _BASES


BASE_NAMES = ["cnn", "cnn+ext", "mlp", "mlp+ext", "if", "if+ext"]
_CONVERTED: dict = {}


def converted(name: str):
    """The base converted by graphmp (for `check`): (ModelProto, {data files})."""
    if name not in _CONVERTED:
        d = tempfile.mkdtemp(prefix="graphmp-fuzz-conv-")
        try:
            m, files = bases()[name]
            with open(os.path.join(d, "m.onnx"), "wb") as f:
                f.write(m.SerializeToString())
            for k, v in files.items():
                with open(os.path.join(d, k), "wb") as f:
                    f.write(v)
            out = os.path.join(d, "out")
            os.mkdir(out)
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                rc = main(["convert", os.path.join(d, "m.onnx"), "-o", os.path.join(out, "c.onnx"), "-q",
                           "--no-calibration"])
            assert rc == 0, f"converting the valid base model {name} failed: {err.getvalue()}"
            cm = onnx.load(os.path.join(out, "c.onnx"), load_external_data=False)
            data = {}
            for fn in os.listdir(out):
                if fn != "c.onnx":
                    with open(os.path.join(out, fn), "rb") as f:
                        data[fn] = f.read()
            _CONVERTED[name] = (cm, data)
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return _CONVERTED[name]


# --------------------------------------------------------------------------- examples
SECRET_ABS = "@SECRET_ABS@"   # replaced by the secret's absolute path when written


class Example:
    """A model being mutated: the proto, its data files, special files to create in the
    model's folder (symlinks, a FIFO, a directory) and edits of the serialized bytes."""

    def __init__(self, model, files):
        self.model = onnx.ModelProto()
        self.model.CopyFrom(model)
        self.files = dict(files)
        self.special = {}       # name -> ("symlink", target) | ("fifo",) | ("dir",)
        self.byte_edits = []    # functions bytes -> bytes, applied to the serialized model
        self.notes = []

    # targets (all graphs, subgraphs included)
    def graphs(self):
        return list(iter_graphs(self.model.graph))

    def nodes(self):
        return [(g, n) for g in self.graphs() for n in g.node]

    def tensors(self):
        return [(g, t) for g in self.graphs() for t in g.initializer]

    def write(self, folder: str, secret_abs: str):
        os.makedirs(folder, exist_ok=True)
        for t in all_tensors(self.model.graph):
            for e in t.external_data:
                if SECRET_ABS in e.value:
                    e.value = e.value.replace(SECRET_ABS, secret_abs)
        for k, spec in self.special.items():
            if spec[0] == "dir":
                os.makedirs(os.path.join(folder, k), exist_ok=True)
        for k, v in self.files.items():
            with open(os.path.join(folder, k), "wb") as f:
                f.write(v)
        for k, spec in self.special.items():
            p = os.path.join(folder, k)
            if spec[0] == "symlink":
                os.symlink(spec[1].replace(SECRET_ABS, secret_abs), p)
            elif spec[0] == "fifo":
                os.mkfifo(p)
        blob = self.model.SerializeToString()
        for edit in self.byte_edits:
            blob = edit(blob)
        with open(os.path.join(folder, "m.onnx"), "wb") as f:
            f.write(blob)


# Every TensorProto of a graph and its subgraphs: initializers, sparse initializers, tensor
# attributes (Constant values) -- all of them may name an external file.
all_tensors = iter_tensors


def _pick(seq, i):
    return seq[i % len(seq)] if seq else None


def _tname(t):
    return f"tensor '{t.name}'"


def _nname(n):
    return f"node '{n.name or n.op_type}'"


def _as_external(ex: Example, t, location, offset=None, length=None):
    """Make `t` an external tensor at `location` (its bytes kept only if it was external)."""
    info = {e.key: e.value for e in t.external_data}
    if t.data_location != TensorProto.EXTERNAL:
        info = {"location": location, "offset": "0", "length": str(len(t.raw_data) or 4)}
        for f in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
            t.ClearField(f)
        t.data_location = TensorProto.EXTERNAL
    info["location"] = location
    if offset is not None:
        info["offset"] = offset
    if length is not None:
        info["length"] = length
    del t.external_data[:]
    for k, v in info.items():
        e = t.external_data.add()
        e.key, e.value = k, v


# Each mutation: kind -> (parameter spaces, apply(ex, *params) -> description or None).
# A space is a range or a list; hypothesis draws from it (st.integers / st.sampled_from)
# and the sweep with random.Random, so both explore the same catalogue.
IDX = range(0, 64)
MUTATIONS: dict = {}


def mutation(kind, *spaces):
    def deco(fn):
        MUTATIONS[kind] = (spaces, fn)
        return fn
    return deco


# ---- protobuf fields
@mutation("ir_version", [-1, 0, 1, 2, 3, 4, 6, 7, 9, 10, 11, 12, 13, 99, 2**62])
def _(ex, v):
    ex.model.ir_version = v
    return f"ir_version = {v}"


@mutation("opset_version", [-1, 0, 1, 5, 6, 7, 11, 12, 13, 16, 18, 19, 21, 22, 23, 24, 25, 26, 99, 2**40])
def _(ex, v):
    ex.model.opset_import[0].version = v
    return f"default opset version = {v}"


@mutation("opset_domain", ["ai.onnx", "com.microsoft", "ai.onnx.ml", "evil.domain", "ai.onnx.preview.training",
                          "x" * 300])
def _(ex, d):
    ex.model.opset_import[0].domain = d
    return f"the default opset's domain = {d[:20]!r}"


@mutation("opset_extra", [("", 11), ("", 99), ("com.microsoft", 1), ("evil.domain", 1), ("ai.onnx.ml", 99),
                          ("", -1), ("drop", 0)])
def _(ex, spec):
    d, v = spec
    if d == "drop":
        del ex.model.opset_import[:]
        return "opset_import removed"
    ex.model.opset_import.add(domain=d, version=v)
    return f"extra opset_import {d!r} version {v}"


DTYPES = list(range(0, 27)) + [99, -1]


@mutation("init_dtype", IDX, DTYPES)
def _(ex, i, dt):
    g, t = _pick(ex.tensors(), i)
    t.data_type = dt
    return f"{_tname(t)} data_type = {dt}"


DIM_VALUES = [0, 1, 2, 3, 5, 1000, -1, -2**63, 2**31, 2**40, 2**62]


@mutation("dims", IDX, ["drop", "add", "negate", "set", "clear"], DIM_VALUES)
def _(ex, i, op, v):
    g, t = _pick(ex.tensors(), i)
    d = list(t.dims)
    if op == "drop" and d:
        d.pop()
    elif op == "add":
        d.append(v if v > 0 else 2)
    elif op == "negate" and d:
        d[0] = -d[0]
    elif op == "set" and d:
        d[len(d) // 2] = v
    elif op == "set":
        d = [v]
    elif op == "clear":
        d = []
    del t.dims[:]
    t.dims.extend(d)
    return f"{_tname(t)} dims = {d} ({op})"


OP_TYPES = ["", "Relu", "Identity", "Conv", "MatMul", "Gemm", "Softmax", "If", "Loop", "Scan", "LSTM", "Cast",
            "Constant", "Sigmoid", "NotAnOp", "FusedMatMul", "Gelu", "Resize", "Reshape", "Einsum", "Dropout",
            "BatchNormalization", "TopK", "Split", "Concat", "ReduceSum", "Greater", "Where", "relu", "Relu\n"]


@mutation("op_type", IDX, OP_TYPES)
def _(ex, i, op):
    g, n = _pick(ex.nodes(), i)
    old = n.op_type
    n.op_type = op
    return f"{_nname(n)} op_type {old} -> {op!r}"


@mutation("node_domain", IDX, ["ai.onnx", "com.microsoft", "ai.onnx.ml", "custom.evil", "ai.onnx.preview.training",
                               "com.microsoft.nchwc", "../../lib"])
def _(ex, i, d):
    g, n = _pick(ex.nodes(), i)
    n.domain = d
    return f"{_nname(n)} domain = {d!r}"


ATTR_VALUES = [("i", -1), ("i", 0), ("i", 2**62), ("i", 99), ("f", float("nan")), ("f", float("inf")),
               ("f", -1e30), ("s", b""), ("s", b"x" * 1000), ("s", b"\xff\xfe"), ("ints", []), ("ints", [-1]),
               ("ints", [2**62, 2**62]), ("ints", [0, 0, 0, 0, 0, 0, 0]), ("floats", [1.0, 2.0]),
               ("strings", [b"a"]), ("graph", None), ("tensor", None), ("type_only", 4)]


def _set_attr(a, kind, v):
    for f in ("i", "f", "s", "t", "g"):
        a.ClearField(f)
    for f in ("ints", "floats", "strings", "tensors", "graphs"):
        a.ClearField(f)
    if kind == "i":
        a.i, a.type = v, onnx.AttributeProto.INT
    elif kind == "f":
        a.f, a.type = v, onnx.AttributeProto.FLOAT
    elif kind == "s":
        a.s, a.type = v, onnx.AttributeProto.STRING
    elif kind == "ints":
        a.ints.extend(v)
        a.type = onnx.AttributeProto.INTS
    elif kind == "floats":
        a.floats.extend(v)
        a.type = onnx.AttributeProto.FLOATS
    elif kind == "strings":
        a.strings.extend(v)
        a.type = onnx.AttributeProto.STRINGS
    elif kind == "graph":
        a.g.CopyFrom(helper.make_graph([], "empty", [], []))
        a.type = onnx.AttributeProto.GRAPH
    elif kind == "tensor":
        a.t.CopyFrom(numpy_helper.from_array(np.zeros((2, 2), np.float32), "t"))
        a.type = onnx.AttributeProto.TENSOR


@mutation("attr_value", IDX, IDX, ATTR_VALUES)
def _(ex, i, j, val):
    g, n = _pick(ex.nodes(), i)
    kind, v = val
    if not n.attribute:
        a = n.attribute.add()
        a.name = "axis"
    else:
        a = _pick(n.attribute, j)
    if kind == "type_only":   # the type field says one thing, the value is another
        a.type = (a.type % 12) + 1 if a.type != v else v + 1
        return f"{_nname(n)} attribute {a.name}: type field = {a.type}, value unchanged"
    _set_attr(a, kind, v)
    return f"{_nname(n)} attribute {a.name} = {kind} {str(v)[:40]}"


@mutation("attr_edit", IDX, IDX, ["drop", "duplicate", "add_unknown", "ref_attr", "no_type", "drop_all"])
def _(ex, i, j, op):
    g, n = _pick(ex.nodes(), i)
    if op == "drop" and n.attribute:
        a = _pick(n.attribute, j)
        name = a.name
        n.attribute.remove(a)
        return f"{_nname(n)} attribute {name} removed"
    if op == "duplicate" and n.attribute:
        a = _pick(n.attribute, j)
        n.attribute.add().CopyFrom(a)
        return f"{_nname(n)} attribute {a.name} duplicated"
    if op == "ref_attr" and n.attribute:
        a = _pick(n.attribute, j)
        a.ref_attr_name = "outer"
        return f"{_nname(n)} attribute {a.name} ref_attr_name = 'outer' (outside a function)"
    if op == "no_type" and n.attribute:
        a = _pick(n.attribute, j)
        a.type = onnx.AttributeProto.UNDEFINED
        return f"{_nname(n)} attribute {a.name} type = UNDEFINED"
    if op == "drop_all":
        del n.attribute[:]
        return f"{_nname(n)} all attributes removed"
    n.attribute.add().CopyFrom(helper.make_attribute("evil_attr", 1))
    return f"{_nname(n)} unknown attribute evil_attr = 1 added"


# ---- tensor data
@mutation("data_truncate", IDX, [1, 2, 3, 4, 64, "all", "half"])
def _(ex, i, k):
    g, t = _pick(ex.tensors(), i)
    if t.data_location == TensorProto.EXTERNAL:
        name = next((e.value for e in t.external_data if e.key == "location"), None)
        if name not in ex.files:
            return None
        b = ex.files[name]
        ex.files[name] = b[:len(b) // 2] if k == "half" else b"" if k == "all" else b[:max(0, len(b) - k)]
        return f"external file {name} truncated ({k})"
    b = t.raw_data
    t.raw_data = b[:len(b) // 2] if k == "half" else b"" if k == "all" else b[:max(0, len(b) - k)]
    return f"{_tname(t)} raw_data truncated ({k}) to {len(t.raw_data)} bytes"


@mutation("data_extend", IDX, [1, 3, 4, 64, 4096])
def _(ex, i, k):
    g, t = _pick(ex.tensors(), i)
    if t.data_location == TensorProto.EXTERNAL:
        _as_external(ex, t, next((e.value for e in t.external_data if e.key == "location"), "w.data"),
                     length=str(int(next((e.value for e in t.external_data if e.key == "length"), "0")) + k))
        return f"{_tname(t)} external length + {k}"
    t.raw_data = t.raw_data + bytes(range(256)) * (k // 256) + b"\x01" * (k % 256)
    return f"{_tname(t)} raw_data extended by {k} bytes"


@mutation("data_field", IDX, ["float_data-1", "float_data+1", "float_data+0", "both", "int64_data", "nan", "inf",
                              "string_type", "empty"])
def _(ex, i, how):
    g, t = _pick(ex.tensors(), i)
    if t.data_location == TensorProto.EXTERNAL:
        return None
    count = int(np.prod([max(d, 0) for d in t.dims], dtype=object)) if t.dims else 1
    if count > 1 << 20:  # an earlier mutation made the dims huge: nothing sensible to write
        return None
    vals = np.frombuffer(t.raw_data[:len(t.raw_data) // 4 * 4], np.float32)
    if how.startswith("float_data"):
        n = count + int(how[len("float_data"):])
        t.ClearField("raw_data")
        t.float_data.extend([float(x) for x in np.resize(vals, max(n, 0))] if vals.size else [0.0] * max(n, 0))
        return f"{_tname(t)} raw_data -> float_data with {n} values ({count} expected)"
    if how == "both":
        t.float_data.extend([1.0] * count)
        return f"{_tname(t)} has raw_data and float_data"
    if how == "int64_data":
        t.ClearField("raw_data")
        t.int64_data.extend([7] * count)
        return f"{_tname(t)} FLOAT tensor with its values in int64_data"
    if how in ("nan", "inf"):
        a = np.full(max(count, 1), np.nan if how == "nan" else np.inf, np.float32)
        if t.data_type == TensorProto.FLOAT and t.raw_data:
            t.raw_data = a.tobytes()
            return f"{_tname(t)} all {how}"
        return None
    if how == "string_type":
        t.data_type = TensorProto.STRING
        return f"{_tname(t)} data_type STRING with raw_data"
    t.ClearField("raw_data")
    return f"{_tname(t)} has no data at all"


# ---- external data entries
LOCATIONS = ["../secret.bin", SECRET_ABS, "link.bin", "linkdir/secret.bin", "nonexistent.data", "m.onnx", "adir",
             "fifo.data", "", "w.data/../../secret.bin", "./../secret.bin", "sub/../../secret.bin", "..\\secret.bin",
             "w.data\x00../secret.bin", "x" * 5000, "abslink.bin", "//secret.bin", "file:../secret.bin"]


@mutation("ext_location", IDX, LOCATIONS)
def _(ex, i, loc):
    g, t = _pick(ex.tensors(), i)
    if loc == "link.bin":
        ex.special["link.bin"] = ("symlink", "../secret.bin")
    elif loc == "abslink.bin":
        ex.special["abslink.bin"] = ("symlink", SECRET_ABS)
    elif loc == "linkdir/secret.bin":
        ex.special["linkdir"] = ("symlink", "..")
    elif loc == "adir":
        ex.special["adir"] = ("dir",)
    elif loc == "fifo.data":
        ex.special["fifo.data"] = ("fifo",)
    elif loc.startswith("sub/"):
        ex.special["sub"] = ("dir",)
    _as_external(ex, t, loc)
    shown = {SECRET_ABS: "<absolute path of the secret>"}.get(loc, loc if len(loc) < 60 else loc[:20] + "...")
    return f"{_tname(t)} external location = {shown!r}"


OFFSETS = ["-1", "-64", "abc", "", "1e3", "0x40", " 64", "64.0", "9" * 30, str(2**63), str(2**62), "16384",
           "3", "+0", "\u0663", "\u00b2", "1_0", "0\n"]


@mutation("ext_offset", IDX, ["offset", "length"], OFFSETS)
def _(ex, i, key, v):
    g, t = _pick(ex.tensors(), i)
    if t.data_location != TensorProto.EXTERNAL:
        _as_external(ex, t, "w.data")
        ex.files.setdefault("w.data", b"\0" * 4096)
    _as_external(ex, t, next(e.value for e in t.external_data if e.key == "location"),
                 **{key: v})
    return f"{_tname(t)} external {key} = {v!r}"


@mutation("ext_in_attribute", IDX, ["constant", "sparse"], ["../secret.bin", SECRET_ABS, "link.bin", "w.data",
                                                         "nonexistent.data"])
def _(ex, i, how, loc):
    """An initializer moved into a Constant node's value, or into a sparse initializer,
    with an external location: tensors that are not initializers name files too."""
    g, t = _pick(ex.tensors(), i)
    if loc == "link.bin":
        ex.special["link.bin"] = ("symlink", "../secret.bin")
    if loc == "w.data":
        ex.files.setdefault("w.data", b"\0" * 4096)
    c = TensorProto()
    c.CopyFrom(t)
    g.initializer.remove(t)
    shown = "<absolute path of the secret>" if loc == SECRET_ABS else loc
    if how == "constant":
        _as_external(ex, c, loc)
        node = helper.make_node("Constant", [], [t.name], name=f"const_{t.name}")
        node.attribute.add().CopyFrom(helper.make_attribute("value", c))
        g.node.insert(0, node)
        return f"{_tname(t)} moved into a Constant node, external location {shown!r}"
    count = int(np.prod([max(d, 0) for d in t.dims], dtype=object)) if t.dims else 1
    if count > 1 << 20:
        return None
    values = TensorProto(name=t.name, data_type=t.data_type, dims=[count])
    values.raw_data = b"\0" * 4 * count
    _as_external(ex, values, loc)
    indices = numpy_helper.from_array(np.arange(count, dtype=np.int64), t.name + "_idx")
    g.sparse_initializer.add().CopyFrom(helper.make_sparse_tensor(values, indices, list(t.dims)))
    return f"{_tname(t)} moved into a sparse_initializer, values at external location {shown!r}"


@mutation("ext_entries", IDX, ["dup_location", "no_location", "flag_only", "entries_no_flag", "unknown_key",
                               "checksum", "basepath"])
def _(ex, i, how):
    g, t = _pick(ex.tensors(), i)
    if how == "flag_only":
        del t.external_data[:]
        t.data_location = TensorProto.EXTERNAL
        return f"{_tname(t)} data_location EXTERNAL without entries"
    if how == "entries_no_flag":
        t.external_data.add(key="location", value="../secret.bin")
        t.data_location = TensorProto.DEFAULT
        return f"{_tname(t)} external entries (location ../secret.bin) but data_location DEFAULT"
    if t.data_location != TensorProto.EXTERNAL:
        _as_external(ex, t, "w.data")
        ex.files.setdefault("w.data", b"\0" * 4096)
    if how == "dup_location":
        t.external_data.add(key="location", value="../secret.bin")
        return f"{_tname(t)} a second 'location' entry = '../secret.bin'"
    if how == "no_location":
        for e in list(t.external_data):
            if e.key == "location":
                t.external_data.remove(e)
        return f"{_tname(t)} external entry without 'location'"
    if how == "basepath":
        t.external_data.add(key="basepath", value="..")
        return f"{_tname(t)} external entry basepath = '..'"
    t.external_data.add(key="checksum" if how == "checksum" else "evil", value="deadbeef")
    return f"{_tname(t)} extra external entry {how}"


DATA_NAMES = ["o.onnx.data", "o.onnx", ".graphmp-o.onnx-999999-x.data.tmp", "m.onnx.data", "sub/w.data"]


@mutation("data_file_name", DATA_NAMES)
def _(ex, name):
    """Rename the external data file (and its references): names an output beside the
    model would take, or the pattern of graphmp's own stale temporary files."""
    if not ex.files:  # an inline model: move its first tensor out
        g, t = ex.tensors()[0]
        raw = t.raw_data
        _as_external(ex, t, "w.data")
        ex.files["w.data"] = raw
    old = next(iter(ex.files))
    ex.files[name] = ex.files.pop(old)
    if "/" in name:
        ex.special[name.split("/")[0]] = ("dir",)
    for g, t in ex.tensors():
        for e in t.external_data:
            if e.key == "location" and e.value == old:
                e.value = name
    return f"external data file {old} renamed to {name!r}"


# ---- graph wiring
@mutation("wiring", IDX, IDX, ["undefined_input", "empty_input", "dup_output", "cycle", "self_loop", "shuffle",
                               "reverse", "delete_node", "delete_output", "output_to_init", "output_to_input",
                               "dup_graph_output", "dup_initializer", "init_shadows_input", "delete_initializer",
                               "dup_node_name", "newline_name", "empty_output", "output_undefined"])
def _(ex, i, j, how):
    g, n = _pick(ex.nodes(), i)
    nodes = list(g.node)
    k = list(g.node).index(n)
    if how == "undefined_input" and n.input:
        old = n.input[j % len(n.input)]
        n.input[j % len(n.input)] = "undefined_tensor"
        return f"{_nname(n)} input {old} renamed to an undefined name"
    if how == "empty_input" and n.input:
        n.input[j % len(n.input)] = ""
        return f"{_nname(n)} input {j % len(n.input)} = '' (absent)"
    if how == "dup_output" and len(nodes) > 1:
        other = nodes[(k + 1 + j % (len(nodes) - 1)) % len(nodes)]
        n.output[0] = other.output[0]
        return f"{_nname(n)} output duplicates {_nname(other)}'s output {other.output[0]}"
    if how == "cycle" and len(nodes) > 1 and n.input:
        last = nodes[-1]
        first = nodes[0] if nodes[0] is not last else n
        first.input[0] = last.output[0]
        return f"cycle: {_nname(first)} consumes {last.output[0]} of the last {_nname(last)}"
    if how == "self_loop" and n.input:
        n.input[0] = n.output[0]
        return f"{_nname(n)} consumes its own output"
    if how == "shuffle" and len(nodes) > 1:
        order = list(range(len(nodes)))
        random.Random(j).shuffle(order)
        if order == sorted(order):
            order.reverse()
        copies = [onnx.NodeProto() for _ in nodes]
        for c, o in zip(copies, order):
            c.CopyFrom(nodes[o])
        del g.node[:]
        g.node.extend(copies)
        return f"graph {g.name}: nodes shuffled to order {order}"
    if how == "reverse" and len(nodes) > 1:
        copies = [onnx.NodeProto() for _ in nodes]
        for c, o in zip(copies, reversed(nodes)):
            c.CopyFrom(o)
        del g.node[:]
        g.node.extend(copies)
        return f"graph {g.name}: node order reversed"
    if how == "delete_node":
        g.node.remove(n)
        return f"{_nname(n)} deleted"
    if how == "delete_output" and g.output:
        name = g.output[j % len(g.output)].name
        del g.output[j % len(g.output)]
        return f"graph {g.name}: output {name} deleted"
    if how == "output_to_init" and g.output and ex.tensors():
        gg, t = _pick([(gg, t) for gg, t in ex.tensors() if gg is g] or ex.tensors(), j)
        g.output[0].name = t.name
        return f"graph {g.name}: output points at initializer {t.name}"
    if how == "output_to_input" and g.output and g.input:
        g.output[0].name = g.input[0].name
        return f"graph {g.name}: output points at input {g.input[0].name}"
    if how == "dup_graph_output" and g.output:
        g.output.add().CopyFrom(g.output[0])
        return f"graph {g.name}: output {g.output[0].name} listed twice"
    if how == "dup_initializer" and g.initializer:
        t = _pick(g.initializer, j)
        c = g.initializer.add()
        c.CopyFrom(t)
        c.ClearField("dims")
        c.dims.extend([3])
        return f"graph {g.name}: initializer {t.name} defined twice (second with dims [3])"
    if how == "init_shadows_input" and g.initializer and g.input:
        t = _pick(g.initializer, j)
        t.name = g.input[0].name
        return f"graph {g.name}: initializer renamed to the graph input {g.input[0].name}"
    if how == "delete_initializer" and g.initializer:
        t = _pick(g.initializer, j)
        g.initializer.remove(t)
        return f"graph {g.name}: initializer {t.name} deleted"
    if how == "dup_node_name" and len(nodes) > 1:
        n.name = nodes[(k + 1) % len(nodes)].name
        return f"{_nname(n)} has the name of another node"
    if how == "newline_name":
        n.name = "bad\nname\r\x1b[31m"
        if n.output:
            old = n.output[0]
            n.output[0] = "out\nnext"
            for m in nodes:
                for q, x in enumerate(m.input):
                    if x == old:
                        m.input[q] = "out\nnext"
            for o in g.output:
                if o.name == old:
                    o.name = "out\nnext"
        return f"node and tensor names with newline/escape characters (node {k})"
    if how == "empty_output" and n.output:
        n.output[0] = ""
        return f"{_nname(n)} output 0 = ''"
    if how == "output_undefined" and g.output:
        g.output[0].name = "nowhere"
        return f"graph {g.name}: output renamed to an undefined tensor"
    return None


@mutation("io_type", ["input", "output"], [0, 2, 7, 10, 8, 99, -1, "rank+1", "rank-1", "dim0", "dimbig", "dimneg",
                                           "no_shape", "no_type", "sequence"])
def _(ex, which, v):
    vis = ex.model.graph.input if which == "input" else ex.model.graph.output
    if not vis:
        return None
    vi = vis[0]
    tt = vi.type.tensor_type
    if isinstance(v, int):
        tt.elem_type = v
        return f"graph {which} {vi.name} elem_type = {v}"
    dims = tt.shape.dim
    if v == "rank+1":
        dims.add().dim_value = 2
    elif v == "rank-1" and len(dims):
        del dims[-1]
    elif v in ("dim0", "dimbig", "dimneg") and len(dims):
        dims[-1].dim_value = {"dim0": 0, "dimbig": 2**40, "dimneg": -5}[v]
    elif v == "no_shape":
        tt.ClearField("shape")
    elif v == "no_type":
        vi.ClearField("type")
    elif v == "sequence":
        vi.type.CopyFrom(helper.make_sequence_type_proto(helper.make_tensor_type_proto(F, [2])))
    return f"graph {which} {vi.name} type: {v}"


@mutation("value_info", IDX, ["wrong_dtype", "wrong_rank", "bad_dim"])
def _(ex, i, how):
    g, n = _pick(ex.nodes(), i)
    if not n.output:
        return None
    name = n.output[0]
    if how == "wrong_dtype":
        vi = helper.make_tensor_value_info(name, TensorProto.INT64, None)
    elif how == "wrong_rank":
        vi = helper.make_tensor_value_info(name, F, [1, 2, 3, 4, 5, 6, 7])
    else:
        vi = helper.make_tensor_value_info(name, F, [-3, 2**40])
    g.value_info.append(vi)
    return f"value_info for {name}: {how}"


@mutation("subgraph", IDX, ["drop_branch", "branch_extra_output", "branch_no_output", "branch_undefined",
                            "branch_shadow"])
def _(ex, i, how):
    ifs = [n for _, n in ex.nodes() if n.op_type == "If"]
    if not ifs:
        return None
    n = _pick(ifs, i)
    if how == "drop_branch":
        n.attribute.remove(_pick(list(n.attribute), i))
        return "If node: a branch attribute removed"
    b = _pick([a.g for a in n.attribute if a.type == onnx.AttributeProto.GRAPH], i)
    if b is None:
        return f"If node: no branch left for {how} (did not apply)"
    if how == "branch_extra_output":
        b.output.add().CopyFrom(b.output[0])
        b.output[-1].name = b.node[0].input[0]
        return f"If branch {b.name}: an extra output"
    if how == "branch_no_output":
        del b.output[:]
        return f"If branch {b.name}: no outputs"
    if how == "branch_undefined":
        b.node[0].input[0] = "not_in_outer_scope"
        return f"If branch {b.name}: reads an undefined outer name"
    b.node[0].output[0] = "h"
    b.output[0].name = "h"
    return f"If branch {b.name}: output shadows the outer tensor h"


# ---- the file itself
@mutation("file", ["garbage_tail", "truncate_half", "truncate_1", "empty", "zero_prefix", "flip_byte"], IDX)
def _(ex, how, j):
    if how == "garbage_tail":
        ex.byte_edits.append(lambda b: b + b"\x0a\xff\xff\xff\xff\x0f" + bytes(range(256)))
    elif how == "truncate_half":
        ex.byte_edits.append(lambda b: b[:len(b) // 2])
    elif how == "truncate_1":
        ex.byte_edits.append(lambda b: b[:-1])
    elif how == "empty":
        ex.byte_edits.append(lambda b: b"")
    elif how == "zero_prefix":
        ex.byte_edits.append(lambda b: b"\0" * 16 + b)
    else:
        ex.byte_edits.append(lambda b: b[:j * 7 % max(len(b), 1)] + bytes([b[j * 7 % max(len(b), 1)] ^ 0x5A])
                             + b[j * 7 % max(len(b), 1) + 1:] if b else b)
    return f"model file: {how}" + (f" at byte {j * 7}" if how == "flip_byte" else "")


MUTATION_KINDS = list(MUTATIONS)
# security-relevant kinds are drawn more often
WEIGHTED_KINDS = MUTATION_KINDS + ["ext_location"] * 4 + ["ext_offset"] * 2 + ["ext_entries", "wiring", "wiring",
                                                                                 "dims", "data_truncate"]


def apply_mutations(ex: Example, muts) -> list[str]:
    done = []
    for m in muts:
        kind, params = m[0], m[1:]
        try:
            d = MUTATIONS[kind][1](ex, *params)
        except (IndexError, ValueError, TypeError, StopIteration, OverflowError, MemoryError) as e:  # does not apply
            d = None
            ex.notes.append(f"{kind}{params} not applied ({type(e).__name__})")
        done.append(d or f"{kind}{tuple(params)} (did not apply: no target)")
    return done


def mutation_strategy():
    def one(kind):
        spaces = MUTATIONS[kind][0]
        parts = [st.integers(s.start, s.stop - 1) if isinstance(s, range) else st.sampled_from(s) for s in spaces]
        return st.tuples(st.just(kind), *parts)
    return st.sampled_from(WEIGHTED_KINDS).flatmap(one)


def random_mutation(rnd: random.Random):
    kind = rnd.choice(WEIGHTED_KINDS)
    return (kind, *[rnd.randrange(s.start, s.stop) if isinstance(s, range) else rnd.choice(s)
                    for s in MUTATIONS[kind][0]])


# --------------------------------------------------------------------------- commands
# name -> argv template. {m}: the mutated model; {o}: the output folder; {ref}/{conv}:
# the two models of `check` (one mutated, one valid in ROOT/other).
COMMANDS = {
    "convert-fast": "convert {m} -o {o}/o.onnx -q --no-calibration",
    "convert-fast-ext": "convert {m} -o {o}/o.onnx -q --no-calibration --external-data",
    "convert": "convert {m} -o {o}/o.onnx -q",
    "pad": "pad {m} -o {o}/o.onnx",
    "check": "check {ref} {conv}",
    "train-graph": "train-graph {m} -o {o}/run --loss mse",
    "inspect": "inspect {m}",
    # the output next to the input: it must never replace (or clean up) an input file
    "convert-beside": "convert {m} -o {md}/o.onnx -q --no-calibration --external-data",
    "pad-beside": "pad {m} -o {md}/o.onnx --external-data",
}
WRITE_NOTHING = ("check", "inspect")  # commands whose success writes no model
BESIDE_OUTPUT = "o.onnx"  # beside the input, new files named o.onnx* are the outputs (o.onnx.data, ...)


class Outcome:
    def __init__(self):
        self.findings = []      # (kind, detail)
        self.rc = None
        self.stderr = ""
        self.seconds = 0.0

    def add(self, kind, detail):
        self.findings.append((kind, detail))


def _snapshot(folder: str) -> dict:
    snap = {}
    for dp, dns, fns in os.walk(folder):
        for name in dns + fns:
            p = os.path.join(dp, name)
            rel = os.path.relpath(p, folder)
            st_ = os.lstat(p)
            if stat.S_ISLNK(st_.st_mode):
                snap[rel] = ("symlink", os.readlink(p))
            elif stat.S_ISFIFO(st_.st_mode):
                snap[rel] = ("fifo",)
            elif stat.S_ISDIR(st_.st_mode):
                snap[rel] = ("dir",)
            else:
                with open(p, "rb") as f:
                    snap[rel] = ("file", hashlib.sha256(f.read()).hexdigest(), st_.st_size)
        dns[:] = [d for d in dns if not os.path.islink(os.path.join(dp, d))]
    return snap


def _files_under(folder: str) -> list[str]:
    out = []
    for dp, dns, fns in os.walk(folder):
        for fn in fns:
            p = os.path.join(dp, fn)
            if os.path.isfile(p) and not os.path.islink(p):
                out.append(p)
    return out


class FifoGuard:
    """While graphmp runs, opens every FIFO of the example for writing without blocking:
    that succeeds only when someone has it open for reading (or is blocked opening it);
    closing it again gives that reader EOF instead of a hang."""

    def __init__(self, fifos):
        self.fifos = fifos
        self.opened = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.wait(0.05):
            for p in self.fifos:
                try:
                    fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)
                except OSError:
                    continue
                os.close(fd)
                if p not in self.opened:
                    self.opened.append(p)

    def __enter__(self):
        if self.fifos:
            self.thread.start()
        return self

    def __exit__(self, *a):
        self.stop.set()
        if self.fifos:
            self.thread.join()


class Hang(BaseException):
    pass


@contextlib.contextmanager
def _time_limit(seconds):
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum, frame):
        raise Hang()
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def _chdir(d):
    old = os.getcwd()
    os.chdir(d)
    try:
        yield
    finally:
        os.chdir(old)


def _exc_summary(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    frames = [f for f in tb if "graphmp" in f.filename.replace("\\", "/").split("/tests/")[0]] or tb
    where = "; ".join(f"{os.path.relpath(f.filename)}:{f.lineno} in {f.name}" for f in frames[-3:])
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}  [{where}]"


def _source_validity(path: str, fifos) -> tuple[str | None, bool]:
    """(the checker the mutated source passes: "full", "basic" or None; whether it loads in
    ONNX Runtime). An output is held to what its source meets, as `graphmp check` holds
    it: a source that fails the full check (a wrong value_info type, a bad graph input
    type) gives an output held to the basic check; one that fails even that (graphmp
    accepts tensor types without a shape, which old exporters write and ONNX Runtime
    runs) is not held to the checker; one ONNX Runtime refuses need not load there either.
    The full check runs on a copy whose external weights are graph inputs of their type
    and shape, so it reads no data file (the FIFO cases would hang it)."""
    try:
        m = onnx.load(path, load_external_data=False)
    except Exception:
        return None, False
    names = {i.name for i in m.graph.input}
    for t in [t for t in m.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]:
        m.graph.initializer.remove(t)
        if t.name not in names:
            m.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    full = None
    for level in ("basic", "full"):
        try:
            onnx.checker.check_model(m, full_check=level == "full")
            full = level
        except Exception:
            break
    if fifos:
        return full, False
    so = ort.SessionOptions()
    so.log_severity_level = 4
    try:
        ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        loads = True
    except Exception:
        loads = False
    return full, loads


def _check_model_file(path: str, checker: str | None = "full", loads: bool = True) -> str | None:
    """None if the model passes the checker (the full one, the basic one, or none: see
    _source_validity) and, when `loads`, loads in ONNX Runtime; else why not."""
    try:
        if checker is not None:
            onnx.checker.check_model(path, full_check=checker == "full")
    except Exception as e:
        return f"onnx.checker: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
    if not loads:
        return None
    so = ort.SessionOptions()
    so.log_severity_level = 3  # its warnings would flood the output; a failure is the finding
    try:
        ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    except Exception as e:
        return f"onnxruntime: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
    return None


def _external_refs_outside(path: str) -> list[str]:
    """External data locations of a written model that leave its folder."""
    try:
        m = onnx.load(path, load_external_data=False)
    except Exception:
        return []
    base = os.path.realpath(os.path.dirname(path))
    bad = []
    for t in all_tensors(m.graph):
        if t.data_location == TensorProto.EXTERNAL:
            loc = next((e.value for e in t.external_data if e.key == "location"), "")
            try:
                full = os.path.realpath(os.path.join(base, loc))
                outside = os.path.isabs(loc) or os.path.commonpath([base, full]) != base
            except ValueError:  # a NUL byte
                outside = True
            if outside:
                bad.append(f"{t.name} -> {loc!r}")
    return bad


def run_example(base: str, muts, command: str, mutate_ref: bool = True) -> tuple[Outcome, list[str], str]:
    """Build the example in a fresh folder, run the command, check every invariant."""
    root = tempfile.mkdtemp(prefix="graphmp-fuzz-")
    out = Outcome()
    desc: list[str] = []
    argv_shown = ""
    watch = None
    try:
        secret = os.path.join(root, "secret.bin")
        with open(secret, "wb") as f:
            f.write(SECRET)
        model_dir, other_dir, out_dir = (os.path.join(root, d) for d in ("model", "other", "out"))
        os.mkdir(out_dir)
        if command == "check":
            cm, cfiles = converted(base)
            bm, bfiles = bases()[base]
            # the mutated model is the reference (FP32) or the converted one; the other is valid
            mut_src, valid_src = ((bm, bfiles), (cm, cfiles)) if mutate_ref else ((cm, cfiles), (bm, bfiles))
            ex = Example(*mut_src)
            Example(*valid_src).write(other_dir, secret)
        else:
            ex = Example(*bases()[base])
        desc = apply_mutations(ex, muts)
        ex.write(model_dir, secret)
        m = os.path.join(model_dir, "m.onnx")
        other = os.path.join(other_dir, "m.onnx")
        ref, conv = (m, other) if mutate_ref else (other, m)
        argv = COMMANDS[command].format(m=m, o=out_dir, md=model_dir, ref=ref, conv=conv).split()
        argv_shown = "graphmp " + " ".join(a.replace(root, "ROOT") for a in argv)
        before = {d: _snapshot(d) for d in (model_dir, other_dir) if os.path.isdir(d)}
        beside = "{md}" in COMMANDS[command]

        def written():
            """The files the command wrote (outputs beside the input: the new output names)."""
            if not beside:
                return _files_under(out_dir)
            return [os.path.join(model_dir, n) for n in os.listdir(model_dir) if n.startswith(BESIDE_OUTPUT)
                    and n not in before[model_dir] and os.path.isfile(os.path.join(model_dir, n))]
        secret_before = hashlib.sha256(SECRET).hexdigest()
        fifos = [os.path.join(model_dir, k) for k, v in ex.special.items() if v[0] == "fifo"]

        # The command runs in ROOT/cwd, where every data file name of the model is a copy of
        # the secret: a read relative to the working directory (not the model's folder) is
        # caught like any other.
        src_full, src_loads = _source_validity(m, fifos)
        cwd = os.path.join(root, "cwd")
        os.mkdir(cwd)
        watched = {secret: "ROOT/secret.bin"}
        for name in set(ex.files) | {"w.data", "m.onnx.data"}:
            if "/" not in name:
                shutil.copyfile(secret, os.path.join(cwd, name))
                watched[os.path.join(cwd, name)] = f"ROOT/cwd/{name} (a read relative to the working directory)"
        watch = SecretWatch(watched)
        watch.events()  # drain our own write
        err, std = io.StringIO(), io.StringIO()
        t0 = time.perf_counter()
        with FifoGuard(fifos) as guard:
            try:
                with _time_limit(HANG_S), contextlib.redirect_stderr(err), contextlib.redirect_stdout(std), \
                        _chdir(cwd):
                    out.rc = main(argv)
            except Hang:
                out.add("hang", f"still running after {HANG_S:.0f} s")
            except SystemExit as e:
                out.rc = e.code
                if e.code not in (0, 1, 2):
                    out.add("bad-exit", f"SystemExit({e.code!r}) escaped main")
            except BaseException as e:  # noqa: BLE001 -- anything escaping main is the failure
                if isinstance(e, KeyboardInterrupt):
                    raise
                out.add(f"uncaught {type(e).__name__}", _exc_summary(e))
        out.seconds = time.perf_counter() - t0
        out.stderr = err.getvalue()
        events = watch.events()
        watch.close()

        # -- nothing outside the model's folder read
        for label in sorted({lbl for lbl, _ in events}):
            how = " and ".join(sorted(e for lbl, e in events if lbl == label))
            out.add("secret-read", f"a file outside the model's folder was {how}: {label}")
        for p in guard.opened:
            out.add("fifo-opened", f"graphmp opened the FIFO {os.path.relpath(p, root)} for reading (unblocked by "
                                   "the test; it would hang forever)")
        for p in written():
            with open(p, "rb") as f:
                blob = f.read()
            for what, pat in LEAK_PATTERNS:
                if pat in blob:
                    out.add("secret-leaked", f"the secret's marker ({what}) is in the output "
                                             f"{os.path.relpath(p, root)} at byte {blob.find(pat)}")
                    break
            if p.endswith(".onnx"):
                refs = _external_refs_outside(p)
                if refs:
                    out.add("output-refs-outside", f"{os.path.relpath(p, root)} references external data outside "
                                                   f"its folder: {refs[:3]}")
        # -- inputs unchanged, nothing added to input folders, no temporary files
        for d, snap in before.items():
            now = _snapshot(d)
            if beside and d == model_dir:
                now = {k: v for k, v in now.items() if k in snap or not k.startswith(BESIDE_OUTPUT)}
            changed = [f"{k} {'removed' if k not in now else 'added' if k not in snap else 'modified'}"
                       for k in sorted(set(snap) | set(now)) if snap.get(k) != now.get(k)]
            if changed:
                out.add("input-changed", f"input folder {os.path.relpath(d, root)}/: {', '.join(changed[:5])}")
        with open(secret, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != secret_before:
                out.add("input-changed", "the secret file was modified")
        inputs = {os.path.join(d, k) for d, snap in before.items() for k in snap} | set(watched)
        temps = [os.path.relpath(os.path.join(dp, fn), root) for dp, _, fns in os.walk(root) for fn in fns
                 if fn.startswith(".graphmp-") and os.path.join(dp, fn) not in inputs]
        if temps:
            out.add("temp-left", f"temporary files left: {temps[:3]}")
        # -- the exit: success with valid outputs, or one clear error line
        if any(k.startswith("uncaught") or k == "hang" for k, _ in out.findings):
            pass
        elif "Traceback" in out.stderr:
            out.add("traceback-in-stderr", out.stderr.strip()[-600:])
        elif out.rc == 0:
            models = [p for p in written() if p.endswith(".onnx")]
            if command not in WRITE_NOTHING and not models:
                out.add("no-output", "exit 0 but no model was written")
            for p in models:
                why = _check_model_file(p, src_full, src_loads)
                if why:
                    out.add("invalid-output", f"exit 0 but {os.path.relpath(p, root)} is invalid: {why}")
        elif out.rc in (1, 2):
            lines = [x for x in out.stderr.splitlines() if x.strip()]
            errs = [x for x in lines if x.startswith("graphmp: error:")]
            bad_chars = sorted({repr(c) for c in "".join(errs) if (ord(c) < 32 and c != "\t") or c in "\x7f\x85"})
            if bad_chars:
                out.add("control-chars-in-error", f"the error line carries control characters {bad_chars} "
                                                  f"(terminal escapes / forged lines): {errs[0][:200]!r}")
            if command == "check" and out.rc == 1:
                pass  # an accuracy verdict (printed on stdout)
            elif not lines or not lines[-1].startswith("graphmp:") or len(errs) > 1 or \
                    (out.rc == 2 and (not errs or lines[-1] != errs[0])):
                out.add("unclear-error", f"exit {out.rc}, stderr is not one 'graphmp: error:' line: "
                                         f"{out.stderr.strip()[-400:]!r}")
            leftovers = [os.path.relpath(p, root) for p in written()]
            if out.rc == 2 and leftovers:
                out.add("wrote-on-error", f"exit 2 but files were written: {leftovers[:5]}")
        else:
            out.add("bad-exit", f"exit code {out.rc!r}; stderr: {out.stderr.strip()[-300:]!r}")
        if out.findings and KEEP:
            keep = os.path.join(KEEP, os.path.basename(root))
            shutil.copytree(root, keep, symlinks=True, ignore=lambda d, names: [
                n for n in names if stat.S_ISFIFO(os.lstat(os.path.join(d, n)).st_mode)])
        return out, desc, argv_shown
    finally:
        if watch is not None:
            watch.close()
        shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------- reporting
_FAILURE_TYPES: dict = {}


def failure_type(kind: str):
    """One exception class per failure class, so that hypothesis reports (and shrinks)
    distinct bugs separately instead of merging them."""
    name = "Fuzz_" + re.sub(r"\W", "_", kind)
    if name not in _FAILURE_TYPES:
        _FAILURE_TYPES[name] = type(name, (AssertionError,), {})
    return _FAILURE_TYPES[name]


def _gist(text: str, n: int = 70) -> str:
    """A message without its particulars (paths, quoted names, numbers), to group by."""
    text = re.sub(r"(/[^\s:'\"]+)+", "P", text)
    text = re.sub(r"'[^']*'|\"[^\"]*\"|\([^)]*\)", "_", text)
    text = re.sub(r"\d+", "N", text)
    return re.sub(r"\s+", " ", text).strip()[:n]


def failure_class(kind: str, detail: str) -> str:
    """Group findings: the kind plus where an exception came from (file:line), or the
    gist of the checker's / ONNX Runtime's complaint about an output."""
    if kind.startswith("uncaught"):
        where = re.findall(r"\[([^\]]*)\]$", detail)
        last = where[0].split("; ")[-1] if where else ""
        return f"{kind} at {last}"
    if kind == "invalid-output":
        why = detail.split(" is invalid: ", 1)[-1]
        why = re.sub(r"^.*?(This is an invalid model\.|Load model from .*? failed:)", "", why)
        tool = "onnx.checker" if detail.split(" is invalid: ", 1)[-1].startswith("onnx.checker") else "onnxruntime"
        return f"invalid-output ({tool}): {_gist(why.split(': ', 2)[-1], 60)}"
    return kind


def encode_mutation(m) -> list:
    """[kind, i, ...]: each parameter as its index in its space (JSON-safe, replayable)."""
    kind, params = m[0], m[1:]
    return [kind] + [p if isinstance(s, range) else next(i for i, v in enumerate(s) if v is p or v == p)
                     for s, p in zip(MUTATIONS[kind][0], params)]


def decode_mutation(e) -> tuple:
    kind, idx = e[0], e[1:]
    return (kind, *[i if isinstance(s, range) else s[i] for s, i in zip(MUTATIONS[kind][0], idx)])


def _visible(text: str) -> str:
    """Control characters (from mutated names) escaped, so a report stays one readable block."""
    return re.sub(r"[\x00-\x08\x0b-\x1f\x7f\n]", lambda m: repr(m.group())[1:-1], text)


def report(base, muts, command, mutate_ref, outcome: Outcome, desc, argv) -> str:
    replay = json.dumps({"base": base, "mutations": [encode_mutation(m) for m in muts], "command": command,
                         "mutate_ref": mutate_ref})
    if command != "check":
        replay = replay.replace(f', "mutate_ref": {json.dumps(mutate_ref)}', "")
    lines = ["graphmp fuzz failure", f"  base model: {base}" + ("" if command != "check" else
                                                             f" ({'reference' if mutate_ref else 'converted'} "
                                                             "model mutated)"),
             "  mutations:"]
    lines += [f"    {i + 1}. {_visible(d)}" for i, d in enumerate(desc)]
    lines += [f"  command:    {argv}   (ROOT: the example folder; secret: ROOT/secret.bin; cwd: ROOT/cwd)",
              f"  exit:       {outcome.rc!r} after {outcome.seconds:.2f} s"]
    for kind, detail in outcome.findings:
        lines.append(f"  FAILED [{kind}]: {_visible(detail)}")
    if outcome.stderr.strip() and not any(k in ("unclear-error", "traceback-in-stderr") for k, _ in outcome.findings):
        lines.append(f"  stderr:     {outcome.stderr.strip()[-300:]!r}")
    lines.append(f"  replay:     GRAPHMP_FUZZ_REPLAY='{replay}' python -m pytest tests/test_fuzz.py -k replay")
    return "\n".join(lines)


LOG = os.environ.get("GRAPHMP_FUZZ_LOG")


def check_example(base, muts, command, mutate_ref=True):
    outcome, desc, argv = run_example(base, muts, command, mutate_ref)
    if outcome.findings:
        kind = failure_class(*outcome.findings[0])
        text = report(base, muts, command, mutate_ref, outcome, desc, argv)
        if LOG:  # survey mode: record every failing example and go on
            with open(LOG, "a") as f:
                f.write(json.dumps({"class": kind, "command": command, "report": text}) + "\n")
            return
        raise failure_type(kind)(text)


# --------------------------------------------------------------------------- tests
def test_base_models_pass_every_command():
    """The unmutated bases: every command succeeds (else every fuzz failure is noise);
    train-graph may refuse a base it cannot train, with a clear error."""
    problems = []
    for base in BASE_NAMES:
        for command in COMMANDS:
            for mutate_ref in ((True, False) if command == "check" else (True,)):
                outcome, desc, argv = run_example(base, [], command, mutate_ref)
                if outcome.findings or outcome.rc not in ((0, 2) if command == "train-graph" else (0,)):
                    problems.append(report(base, [], command, mutate_ref, outcome, desc, argv))
    assert not problems, "\n\n".join(problems)


def test_harness_sees_reads_leaks_and_fifo_opens(tmp_path):
    """The detectors themselves: an open/read of the secret, its bytes in a file (raw at
    any byte offset, converted to FP16/BF16 at any value offset), a reader on a FIFO."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(SECRET)
    watch = SecretWatch({str(secret): "s"})
    if watch.fd >= 0:
        assert watch.events() == set()
        with open(secret, "rb") as f:
            f.read(10)
        assert watch.events() == {("s", "opened"), ("s", "read")}
    watch.close()
    for k in (0, 1, 5, 36, 63):
        assert any(p in SECRET[k:k + 100] for _, p in LEAK_PATTERNS)
    for k in (0, 4, 28, 60):
        vals = np.frombuffer(SECRET[k:k + 4 * 40], np.float32)
        for blob in (vals.astype(np.float16).tobytes(), _bf16(vals, True), _bf16(vals, False)):
            assert any(p in blob for _, p in LEAK_PATTERNS)
    assert not any(p in _w(1, (8, 3, 3, 3)).tobytes() for _, p in LEAK_PATTERNS)
    fifo = str(tmp_path / "f.data")
    os.mkfifo(fifo)
    with FifoGuard([fifo]) as guard:
        with open(fifo, "rb") as f:  # blocks until the guard opens the other end
            assert f.read() == b""
    assert guard.opened == [fifo]


EXAMPLE = st.tuples(st.sampled_from(BASE_NAMES), st.lists(mutation_strategy(), min_size=1, max_size=3))


@settings(max_examples=_n(1.0), **SETTINGS)
@given(ex=EXAMPLE)
def test_fuzz_convert_no_calibration(ex):
    base, muts = ex
    check_example(base, muts, "convert-fast")


@settings(max_examples=_n(0.15), **SETTINGS)
@given(ex=EXAMPLE)
def test_fuzz_convert_external_data_output(ex):
    base, muts = ex
    check_example(base, muts, "convert-fast-ext")


@settings(max_examples=_n(0.15), **SETTINGS)
@given(ex=EXAMPLE)
def test_fuzz_convert_calibrated(ex):
    base, muts = ex
    check_example(base, muts, "convert")


@settings(max_examples=_n(0.4), **SETTINGS)
@given(ex=EXAMPLE)
def test_fuzz_pad(ex):
    base, muts = ex
    check_example(base, muts, "pad")


@settings(max_examples=_n(0.1), **SETTINGS)
@given(ex=EXAMPLE, mutate_ref=st.booleans())
def test_fuzz_check(ex, mutate_ref):
    base, muts = ex
    check_example(base, muts, "check", mutate_ref)


@settings(max_examples=_n(0.08), **SETTINGS)
@given(ex=st.tuples(st.sampled_from(["cnn", "cnn+ext", "mlp", "mlp+ext"]),
                    st.lists(mutation_strategy(), min_size=1, max_size=2)))
def test_fuzz_train_graph(ex):
    base, muts = ex
    check_example(base, muts, "train-graph")


@settings(max_examples=_n(0.1), **SETTINGS)
@given(ex=EXAMPLE)
def test_fuzz_inspect(ex):
    """inspect reads the mutated model: one line and exit 2, or a report; never a read
    outside the model's folder."""
    base, muts = ex
    check_example(base, muts, "inspect")


@settings(max_examples=_n(0.1), **SETTINGS)
@given(base=st.sampled_from(BASE_NAMES), name=st.sampled_from(DATA_NAMES),
       muts=st.lists(mutation_strategy(), max_size=2), command=st.sampled_from(["convert-beside", "pad-beside"]))
def test_fuzz_output_beside_the_input(base, name, muts, command):
    """-o next to the model, whose data file has the name of an output (or of graphmp's
    stale temporary files): the input must survive, byte for byte."""
    check_example(base, [("data_file_name", name)] + muts, command)


SWEEP_COMMANDS = ["convert-fast"] * 6 + ["convert-fast-ext", "convert", "pad", "pad", "check", "train-graph",
                                         "convert-beside", "pad-beside", "inspect"]


def test_fuzz_sweep_all_failure_classes():
    """A plain seeded loop over the same catalogue that does not stop at the first
    failure: it fails with one example (the smallest found) of every distinct failure
    class. Runs EXAMPLES // 2 examples (GRAPHMP_FUZZ_SWEEP overrides)."""
    n = int(os.environ.get("GRAPHMP_FUZZ_SWEEP", max(2, EXAMPLES // 2)))
    rnd = random.Random(1234)
    classes: dict = {}
    counts: dict = {}
    for _ in range(n):
        base = rnd.choice(BASE_NAMES)
        command = rnd.choice(SWEEP_COMMANDS)
        if command == "train-graph" and base.startswith("if"):
            base = base.replace("if", "mlp")
        muts = [random_mutation(rnd) for _ in range(rnd.choice([1, 1, 2, 3]))]
        mutate_ref = rnd.random() < 0.5
        outcome, desc, argv = run_example(base, muts, command, mutate_ref)
        for kind, detail in outcome.findings:
            key = (failure_class(kind, detail), command)
            counts[key] = counts.get(key, 0) + 1
            text = report(base, muts, command, mutate_ref, outcome, desc, argv)
            if key not in classes or len(muts) < classes[key][0]:
                classes[key] = (len(muts), text)
    if classes:
        summary = [f"{len(classes)} distinct failure classes in {n} examples:"]
        summary += [f"  {counts[k]:4d} x {k[0]}  [{k[1]}]" for k in sorted(classes, key=lambda k: -counts[k])]
        details = [f"=== {k[0]} [{k[1]}]\n{classes[k][1]}" for k in sorted(classes, key=lambda k: -counts[k])]
        pytest.fail("\n".join(summary) + "\n\n" + "\n\n".join(details), pytrace=False)


@pytest.mark.skipif(not os.environ.get("GRAPHMP_FUZZ_REPLAY"), reason="set GRAPHMP_FUZZ_REPLAY to a failure's JSON")
def test_fuzz_replay():
    spec = json.loads(os.environ["GRAPHMP_FUZZ_REPLAY"])
    check_example(spec["base"], [decode_mutation(m) for m in spec["mutations"]], spec["command"],
                  spec.get("mutate_ref", True))

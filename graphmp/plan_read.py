"""plan_read: reading a plan file that `graphmp convert --save-plan` wrote (passes/plan_file.py
uses it for --plan). The file is untrusted input: its size, JSON, types, lengths and
schema are checked, and any fault is one GraphmpError naming the file and the key.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

from .budget import METRICS, parse
from .errors import GraphmpError
from .policy import LOW_TYPES

SCHEMA, VERSION = "graphmp.plan", 1
MAX_BYTES = 64 << 20          # a plan of ~300k nodes; a bigger file is no plan graphmp wrote
MAX_NODES = 2_000_000
MAX_TEXT = 65536              # characters in one string (names, reasons, subgraph paths)


@dataclass
class Plan:
    """A checked plan file: `path` for messages, `data` its JSON."""
    path: str
    data: dict


def _fail(path, key, what):
    raise GraphmpError(f"{path}: plan key '{key}' {what} (a plan is the JSON that graphmp convert --save-plan "
                       "writes)")


def _read(path: str):
    """The JSON of a plan file, within MAX_BYTES; no NaN/Infinity, no duplicate keys."""
    def constant(c):
        raise ValueError(f"holds {c}, which JSON does not allow")

    def number(text):
        x = float(text)
        if not math.isfinite(x):
            raise ValueError(f"holds the number {text[:40]}, beyond the float range")
        return x

    def pairs(items):
        seen = {}
        for k, v in items:
            if k in seen:
                raise ValueError(f"holds key '{k[:80]}' twice in one object")
            seen[k] = v
        return seen
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(MAX_BYTES + 1) if size <= MAX_BYTES else b""
    except FileNotFoundError:
        raise GraphmpError(f"{path}: --plan: no such file") from None
    except OSError as e:
        raise GraphmpError(f"{path}: --plan: cannot read it ({e.strerror or e})") from None
    if size > MAX_BYTES or len(raw) > MAX_BYTES:
        raise GraphmpError(f"{path}: --plan: larger than {MAX_BYTES >> 20} MiB, so not a plan graphmp wrote")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=constant, parse_float=number,
                          object_pairs_hook=pairs)
    except UnicodeDecodeError:
        raise GraphmpError(f"{path}: --plan: not UTF-8 text, so not a plan file") from None
    except json.JSONDecodeError as e:
        raise GraphmpError(f"{path}: --plan: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise GraphmpError(f"{path}: --plan: JSON nested too deeply to be a plan") from None
    except ValueError as e:
        raise GraphmpError(f"{path}: --plan: not a plan: the JSON {e}") from None


TOP = {"schema": str, "version": int, "graphmp_version": str, "onnx_version": str, "source": str,
       "source_sha256": str, "target": str, "budget": (dict, type(None)), "measured": (dict, type(None)),
       "nodes": list}
ENTRY = {"graph": str, "scope": str, "op_type": str, "index": int, "name": str, "precision": str,
         "reason": (str, type(None))}
NAMES = {str: "a string", int: "an integer", list: "a list", dict: "an object"}


def _typed(path, key, value, want):
    """value is of type `want` (bool is no integer), a string at most MAX_TEXT long."""
    types = want if isinstance(want, tuple) else (want,)
    if isinstance(value, bool) or not isinstance(value, types):
        what = " or ".join(NAMES.get(t, "null") for t in types)
        _fail(path, key, f"must be {what}, not {type(value).__name__}")
    if isinstance(value, str) and len(value) > MAX_TEXT:
        _fail(path, key, f"is {len(value)} characters long (at most {MAX_TEXT})")


def _fields(path, prefix, obj, schema, required):
    if not isinstance(obj, dict):
        _fail(path, prefix or "(top level)", f"must be an object, not {type(obj).__name__}")
    for k in obj:
        if k not in schema:
            _fail(path, f"{prefix}{k[:80]}", "is not a key of a graphmp plan")
    for k in required:
        if k not in obj:
            _fail(path, f"{prefix}{k}", "is missing")
    for k, v in obj.items():
        _typed(path, f"{prefix}{k}", v, schema[k])


def _check_budget(path, b):
    _fields(path, "budget.", b, {"max_error": (str, int, float), "metric": str, "allowed": (dict, type(None))},
            ("max_error", "metric"))
    try:
        parse(b["max_error"])
    except GraphmpError as e:
        _fail(path, "budget.max_error", f"is no budget ({e})")
    if b["metric"] not in METRICS:
        _fail(path, "budget.metric", f"must be one of {', '.join(METRICS)}, not '{b['metric'][:40]}'")


def _check_nodes(path, nodes):
    if len(nodes) > MAX_NODES:
        _fail(path, "nodes", f"holds {len(nodes)} entries (at most {MAX_NODES})")
    names, places = set(), set()
    for i, e in enumerate(nodes):
        _fields(path, f"nodes[{i}].", e, ENTRY, ("graph", "scope", "op_type", "index", "name", "precision"))
        if e["precision"] not in ("low", "fp32"):
            _fail(path, f"nodes[{i}].precision", f"must be 'low' or 'fp32', not '{e['precision'][:40]}'")
        if e["index"] < 0:
            _fail(path, f"nodes[{i}].index", "must be >= 0")
        name, place = (e["graph"], e["name"]), (e["scope"], e["op_type"], e["index"])
        if name in names or place in places:
            _fail(path, f"nodes[{i}]", f"names node '{e['name'][:80]}' a second time")
        names.add(name)
        places.add(place)


def check(data, path: str) -> dict:
    """`data` (a plan's JSON) checked key by key; a GraphmpError names the first bad key."""
    _fields(path, "", data, TOP, ("schema", "version", "nodes"))
    if data["schema"] != SCHEMA:
        _fail(path, "schema", f"is '{data['schema'][:40]}', not '{SCHEMA}'")
    if data["version"] != VERSION:
        _fail(path, "version", f"is {data['version']}; this graphmp reads version {VERSION}")
    if "target" in data and data["target"] not in LOW_TYPES:
        _fail(path, "target", f"must be one of {', '.join(sorted(LOW_TYPES))}")
    if "source_sha256" in data and not re.fullmatch(r"[0-9a-f]{64}", data["source_sha256"]):
        _fail(path, "source_sha256", "must be 64 lowercase hex digits")
    if data.get("budget") is not None:
        _check_budget(path, data["budget"])
    _check_nodes(path, data["nodes"])
    return data


def load(source) -> Plan:
    """A Plan from a file path (or a dict or Plan, for the API), checked (see `check`)."""
    if isinstance(source, Plan):
        return source
    if isinstance(source, dict):
        return Plan("<plan>", check(source, "<plan>"))
    if not isinstance(source, (str, os.PathLike)):
        raise GraphmpError(f"--plan must be a plan file path, not {type(source).__name__}")
    path = os.fspath(source)
    return Plan(path, check(_read(path), path))

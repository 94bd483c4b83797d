"""graphmp.check: is a converted model valid, and how accurate is it against its FP32 source?

1. Validity first: the full onnx.checker (strict shape and type inference) and an
   ONNX Runtime session on the converted model. A failure of either is a FAIL with
   their message, and no numbers are compared: a model that ONNX Runtime refuses is
   never reported as passing. (Where the FP32 source itself fails the full checker,
   the converted model is held to the basic checker instead, and the report says so.)
2. Accuracy: the FP32 source runs in ONNX Runtime (CPU); the converted model runs
   FP16-faithfully, by one of two oracles, and where a GPU is present also in ONNX
   Runtime CUDA:
   - "emulation" (default): graphmp.emulate, FP16 storage with FP32 math on ONNX
     Runtime (what Tensor Cores do; the same measure --max-error uses), fast at any size;
   - "reference": onnx.reference with graphmp's ideal-kernel overrides (graphmp.model_runs):
     each FP16 op computed in float64 from its FP16 inputs and rounded once, as an ideal
     kernel stores it; slow on large activations. It is trusted only where it reproduces ONNX
     Runtime on the FP32 source; where it does not, or cannot run, the emulation judges
     and the report says so. ONNX Runtime CPU itself never judges: it computes most FP16
     ops in FP32 and hides overflow.
3. What the numbers mean (graphmp.verdict): class-score outputs are judged on their
   argmax decisions against what TF32 and FP16 inputs change; an output that those
   yardsticks alone move by more than its own spread is "not judged" on generated
   inputs (they are outside the model's range; the check fails until real data is
   given); a converted model that does not run is a FAIL with ONNX Runtime's cause.
Inputs: the user's data (checked against the model's inputs), or generated inputs whose
shapes come from --shapes or graphmp.inputs.find_shapes.
A model ONNX Runtime refuses (an op it does not implement, a node it cannot run) is a
FAIL with its message (the converted model) or a one-line GraphmpError naming the file,
never ONNX Runtime's traceback.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import onnx

from .errors import GraphmpError, first_line
from .names import printable_lines, shown
from .budget import DEFAULT, as_tensor, measure, output_error, parse
from .emulate import emulated_runner
from .inputs import find_shapes, input_specs, user_batches
from .model_io import load_model, load_with_weights
from .model_runs import cuda_available, run_reference, runner
from .session import CUDA, ran_on
from . import verdict

ORACLES = ("emulation", "reference")
EMULATION = "FP16-faithful emulation on ONNX Runtime (FP16 storage, FP32 math)"
REFERENCE = "onnx.reference as an ideal kernel (each FP16 op in float64, rounded once)"


def compare(ref: np.ndarray, got: np.ndarray, atol: float | None = None, rtol: float | None = None, *,
            allowed: float | None = None, metric: str = "max-rel") -> dict:
    """One output against its FP32 reference: max abs |a-b|, max rel = max|a-b| / max|ref|,
    argmax agreement (class-score outputs), new non-finite values and `error` under
    `metric` (graphmp.budget). passed: no new non-finite value, error <= allowed (when
    given) and, when atol/rtol are given, |a-b| <= atol + rtol*|ref| everywhere."""
    ref = as_tensor(ref)
    got = as_tensor(got)
    error = output_error(ref, got, metric)
    if ref.dtype.kind not in "fc":
        same = bool(np.array_equal(ref, got))
        return {"max_abs": 0.0 if same else float("inf"), "max_rel": 0.0 if same else float("inf"),
                "ref_max_abs": 0.0, "nonfinite": 0, "argmax_agree": None, "error": error, "passed": same}
    r = ref.astype(np.float64)
    g = got.astype(np.float64)
    if r.shape != g.shape:
        return {"max_abs": float("inf"), "max_rel": float("inf"), "ref_max_abs": 0.0, "nonfinite": 0,
                "argmax_agree": None, "error": float("inf"), "passed": False,
                "shape_mismatch": [list(r.shape), list(g.shape)]}
    new_nonfinite = int(np.count_nonzero(~np.isfinite(g) & np.isfinite(r)))
    ok = np.isfinite(r) & np.isfinite(g)
    diff = np.abs(g - r)[ok]
    scale = float(np.abs(r[ok]).max()) if ok.any() else 0.0
    # an inf/NaN where FP32 is finite is an infinite difference (not 0 where nothing else is finite)
    max_abs = float("inf") if new_nonfinite else float(diff.max()) if diff.size else 0.0
    agree = None
    if r.ndim in (2, 3) and r.shape[-1] > 1 and r.size:  # class scores [N, C] / [N, T, V], not image maps
        agree = float(np.mean(np.argmax(r, axis=-1) == np.argmax(np.nan_to_num(g), axis=-1)))
    passed = new_nonfinite == 0 and (allowed is None or error is None or error <= allowed)
    if atol is not None or rtol is not None:
        passed = passed and bool(np.all(diff <= (atol or 0.0) + (rtol or 0.0) * np.abs(r[ok])))
    return {"max_abs": max_abs, "max_rel": max_abs / scale if scale > 0 else max_abs, "ref_max_abs": scale,
            "nonfinite": new_nonfinite, "ref_nonfinite": int(np.count_nonzero(~np.isfinite(r))),
            "argmax_agree": agree, "error": error, "passed": passed}


def _full_check(model) -> str | None:
    try:
        onnx.checker.check_model(model if isinstance(model, onnx.ModelProto) else os.fspath(model), full_check=True)
        return None
    except Exception as e:  # noqa: BLE001 - checker raises ValidationError / InferenceError / ...
        return first_line(e)


def validity(converted, reference=None) -> dict:
    """{"valid", "checker", "ort", "note"}: the full checker and an ONNX Runtime CPU
    session on `converted` (path or ModelProto)."""
    out = {"checker": "ok", "ort": "ok", "note": None}
    err = _full_check(converted)
    if err and reference is not None and _full_check(reference):
        out["note"] = ("the FP32 source fails the full checker too; the converted model was held to the "
                       "basic checker")
        try:
            onnx.checker.check_model(converted if isinstance(converted, onnx.ModelProto) else os.fspath(converted))
            err = None
        except Exception as e:  # noqa: BLE001
            err = first_line(e)
    if err:
        out["checker"] = err
    out["ort"] = _ort_loads(converted)
    if out["ort"] != "ok" and "NOT_IMPLEMENTED" in out["ort"] and "implementation for" in out["ort"]:
        # a kernel this ONNX Runtime lacks (BF16 on the CPU provider) says nothing about the
        # model: the emulation judges its accuracy, and the note says where it runs
        out["note"] = ("ONNX Runtime's CPU provider has no kernel for a node of this model "
                       f"({out['ort'].split('NOT_IMPLEMENTED : ')[-1]}); the model is valid and its accuracy is "
                       "judged by the emulation; BF16 runs on ORT CUDA (Ampere or newer) or TensorRT")
        out["ort"] = "ok (no CPU kernel for a node; see the note)"
    out["valid"] = out["checker"] == "ok" and out["ort"].startswith("ok")
    return out


class CheckReport:
    def __init__(self, data):
        self.data = data

    @property
    def passed(self) -> bool:
        return self.data["passed"]

    @property
    def outputs(self) -> dict:
        return self.data["outputs"]

    def to_dict(self):
        return self.data

    def summary(self) -> str:
        d = self.data
        extra = f", and |a-b| <= {d['atol'] or 0} + {d['rtol'] or 0}*|ref|" if d["atol"] or d["rtol"] else ""
        lines = [f"{d['converted']} vs {d['reference']} ({d['oracle']}): {_headline(d)}"
                 f" ({d['metric']} <= {d['max_error']} per output{extra})"]
        v = d["validity"] or {}  # None: the check did not get that far (not_run)
        if v and not v["valid"]:
            lines.append(f"  INVALID: onnx.checker: {v['checker']}; ONNX Runtime: {v['ort']}")
        if d.get("crash"):
            lines.append(f"  DOES NOT RUN: {d['crash']}")
        if d.get("not_run"):
            lines.append(f"  NOT RUN: {d['not_run']}")
        if d.get("inputs"):
            lines.append(f"  inputs: {d['inputs']}")
        lines += [_output_line(d, name, o) for name, o in d["outputs"].items()]
        for w in d["warnings"] + ([v["note"]] if v.get("note") else []):
            lines.append(f"  warning: {w}")
        lines += [f"  hint: {h}" for h in verdict.hints(d)]
        if d.get("blame"):
            lines.append(f"  where: {d['blame']['hint']}")
        return printable_lines(lines)


def _headline(d: dict) -> str:
    """PASS, FAIL, or NOT JUDGED (every output that fails is one the inputs cannot judge)."""
    if d["passed"]:
        return "PASS"
    failing = [o for o in d["outputs"].values() if not o["passed"]]
    if failing and (d["validity"] or {}).get("valid") and all(o.get("not_judged") for o in failing):
        return "NOT JUDGED"
    return "FAIL"


def _output_line(d: dict, name: str, o: dict) -> str:
    """One output of the summary: its verdict, error against the budget and yardsticks,
    max abs, what it predicts (argmax, top-5) and new inf/NaN."""
    budget = d.get("budget") or {}
    floor, tf32 = budget.get("floor") or {}, budget.get("tf32") or {}
    spread = o.get("per_batch")
    judged = (f"{d['metric']} {o['error']:.4g}"
              + (f" (worst of {len(spread)} batches, best {min(spread):.3g})" if spread else "")
              + f" (allowed {o['allowed']:.4g}"
              + (f"; TF32 error {tf32[name]:.3g}" if name in tf32 else "")
              + (f"; FP16 input floor {floor[name]:.3g}" if name in floor else "") + ")"
              if o.get("error") is not None and o.get("allowed") is not None else "not judged by this metric")
    verdict_word = "n/a" if o.get("not_judged") else "ok " if o["passed"] else "BAD"
    head = f"  {shown(name)}: {verdict_word} " + (f"not judged: {o['not_judged']}; " if o.get("not_judged") else "")
    return (head + f"{judged}; max abs {o['max_abs']:.4g}" + _decisions_text(o)
            + (f", NON-FINITE x{o['nonfinite']}" if o["nonfinite"] else "")
            + (f"; the FP32 model itself gives {o['ref_nonfinite']} inf/NaN here (compared where both are finite)"
               if o.get("ref_nonfinite") else ""))


def _decisions_text(o: dict) -> str:
    """', argmax agree A' with, where the decisions are judged, the least agreement the
    yardsticks allow; ', top-5 T' where there are more than 5 classes."""
    if o["argmax_agree"] is None:
        return ""
    text = f", argmax agree {o['argmax_agree']:.4f}"
    dec = o.get("decisions")
    if dec and dec["allowed_changed"] is not None and dec["allowed_changed"] < 1:
        bad = verdict.decisions_fail(dec)
        by = "TF32" if dec["by"] == "tf32" else "FP16 input rounding"
        text += (f" ({'<' if bad else '>='} {1 - dec['allowed_changed']:.4f} allowed: {by} changes "
                 f"{dec['yardsticks'][dec['by']]} of {dec['rows']})")
    if dec and dec.get("top5") is not None:
        text += f", top-5 {dec['top5']:.4f}"
    return text


def _same_interface(ref, conv, names):
    """The converted model must have the reference's inputs and outputs (by name)."""
    ins = ({s.name for s in input_specs(ref)}, {s.name for s in input_specs(conv)})
    outs = ({o.name for o in ref.graph.output}, {o.name for o in conv.graph.output})
    if ins[0] != ins[1] or not outs[0] <= outs[1]:
        raise GraphmpError(f"{names['converted']} does not have the inputs and outputs of {names['reference']} "
                           f"(inputs {sorted(ins[1])} vs {sorted(ins[0])}, outputs {sorted(outs[1])} vs "
                           f"{sorted(outs[0])}): compare a converted model with the FP32 model it came from")


def _ort_loads(model) -> str:
    """'ok', or why ONNX Runtime (CPU, default options) cannot create a session for the
    model. Tried in a child process: ONNX Runtime can crash on a valid model (1.32
    segfaults optimising an FP16 Transpose(perm=[1,0,2]) -> MatMul), and a crash must be
    a FAIL with a reason, not the end of graphmp."""
    import contextlib
    import json
    import signal
    import subprocess
    import sys
    import tempfile
    from .paths import checked_descriptors
    # the child reads the data files through the descriptors graphmp checked (inherited,
    # mapped and handed to ONNX Runtime), never by a path the model names
    code = ("import json, mmap, os, sys, onnxruntime as ort\n"
            "so = ort.SessionOptions(); so.log_severity_level = 4\n"
            "fds = json.loads(sys.argv[2])\n"
            "maps = [mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if os.fstat(fd).st_size else b'' for fd in fds.values()]\n"
            "if fds:\n    so.add_external_initializers_from_files_in_memory(list(fds), maps, [len(m) for m in maps])\n"
            "try:\n    ort.InferenceSession(sys.argv[1], so, providers=['CPUExecutionProvider'])\n"
            "except Exception as e:\n    print(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)"
            "\n    sys.exit(3)\n")
    base_dir = None
    if not isinstance(model, onnx.ModelProto):
        base_dir = os.path.dirname(os.path.abspath(os.fspath(model)))
        model = load_model(os.fspath(model), by_reference=True)
    with checked_descriptors(model, base_dir) if base_dir else contextlib.nullcontext({}) as fds, \
            tempfile.TemporaryDirectory(prefix="graphmp-check-") as d:
        # the serialized proto into this private folder, and nothing else: onnx.save would
        # also write tensors that carry both raw data and an external location to that
        # location, a path the model chooses (absolute, or climbing out with '..')
        path = os.path.join(d, "model.onnx")
        with open(path, "xb") as f:
            f.write(model.SerializeToString())
        r = subprocess.run([sys.executable, "-c", code, path, json.dumps(fds)], capture_output=True, text=True,
                           pass_fds=tuple(fds.values()))
    if r.returncode == 0:
        return "ok"
    if r.returncode < 0:
        import onnxruntime as ort
        sig = signal.Signals(-r.returncode).name
        return (f"ONNX Runtime {ort.__version__} crashed ({sig}) creating a CPU session with its default options "
                "(an ONNX Runtime bug; it may load with fewer graph optimisations)")
    return (r.stdout.strip() or r.stderr.strip() or f"exit {r.returncode}").splitlines()[-1][:300]


class ConvertedRunError(GraphmpError):
    """The converted model does not run (its emulation cannot load it or fails on the
    inputs): check() makes it a FAIL that names the cause, not an input error."""


def _named(run, what: str, error=GraphmpError):
    """`run` (feeds -> outputs), raising a one-line `error` (a GraphmpError) `what (ONNX
    Runtime's message)` instead of ONNX Runtime's exception: a valid-looking model ORT
    refuses at run time (a Conv whose weight disagrees with its input) is an error, not a
    traceback."""
    def named(feeds):
        try:
            return run(feeds)
        except GraphmpError:
            raise
        except Exception as e:  # noqa: BLE001 - onnxruntime's Fail / InvalidArgument / RuntimeException
            raise error(f"{what} ({first_line(e)})") from None
    named.session = getattr(run, "session", None)
    return named


def _batches(ref, data, shapes, seed, run_ref, flag: str = "--data"):
    """[(feeds, description)] from the user's data or generated inputs; `flag` is the
    option that gives data in the command that asked (check: --data, convert: --calibration)."""
    specs = input_specs(ref)
    if data is None:
        plan = find_shapes(ref, run_ref, shapes, where="check")
        ids = [n for n, h in plan.hints.items() if isinstance(h, dict) and "below" in h]
        ids = f"; {', '.join(ids)} uniform over the rows they index" if ids else ""
        roles = "".join(f"; {n} uniform over [{h['span'][0]:g}, {h['span'][1]:g}) ({h['as']})"
                        for n, h in plan.hints.items() if isinstance(h, dict) and "span" in h)
        return [plan.feeds(seed)], (f"generated ({plan.describe()}; shapes {plan.how}; floats ~N(0,1){ids}{roles}: "
                                    f"{flag} with real inputs checks the range the model will really see)")
    out = [feeds for _, feeds in user_batches(data, specs, flag)]
    return out, f"{len(out)} batch(es) of user data"


@dataclass
class CheckOptions:
    """How `check` judges: its keyword arguments (the flags of `graphmp check --help`).
    data_flag is the option that gives data in the command that asked (check: --data,
    convert: --calibration), named in the report's description of generated inputs."""
    shapes: object = None               # --shapes for generated inputs ('x:1x3x640x640,...' or {name: dims})
    max_error: object = DEFAULT         # --max-error: a number, "auto[:K]", "tf32" or "floor[:K]"
    metric: str = "max-rel"             # --metric: max-rel, max-abs or argmax
    atol: float | None = None           # --atol/--rtol: an element-wise criterion on top of the budget
    rtol: float | None = None
    seed: int = 0                       # the seed of generated inputs
    oracle: str = "emulation"           # --oracle: emulation or reference (ORACLES)
    data_flag: str = "--data"

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> "CheckOptions":
        """Options from check()'s keyword arguments: an unknown one is a TypeError, a bad
        --max-error or --oracle a GraphmpError naming the flag."""
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"check() got unknown option(s) {unknown}; options: {sorted(names)}")
        o = cls(**kwargs)
        parse(o.max_error)
        if o.oracle not in ORACLES:
            raise GraphmpError(f"--oracle must be one of {', '.join(ORACLES)}, not '{o.oracle}'")
        return o


def check(ref, converted, data=None, **options) -> CheckReport:
    """Compare `converted` against the FP32 `ref` (paths or ModelProtos) on `data` (an
    .npz path, a dict of inputs, a list of them, or None for generated inputs whose
    dynamic dims come from `shapes` ('x:1x3x640x640,...') or a trial run), judged by
    `oracle` ("emulation" or "reference", see the module docstring).

    Options (CheckOptions, checked before any work): shapes, max_error, metric, atol,
    rtol, seed, oracle, data_flag. An output passes when it gains no inf/NaN and its
    error under `metric` is within `max_error` (a number, "auto[:K]", "tf32" or
    "floor[:K]", as --max-error of convert; the default "auto": max(1e-2 for max-rel,
    2 x the TF32 error, 2 x the FP16-input floor), see graphmp.budget); atol/rtol add
    an element-wise criterion; a class-score output must also keep its decisions, and an
    output the generated inputs cannot judge fails as 'not judged' (graphmp.verdict)."""
    opts = CheckOptions.from_kwargs(options)
    ref_graph, names = _open_pair(ref, converted, opts)
    valid = validity(converted, ref)
    if not valid["valid"]:
        return CheckReport(dict(names, oracle="not run: the converted model is invalid", batches=0, outputs={},
                                passed=False, warnings=[], validity=valid, inputs=None))
    run_ref = _reference_runner(ref, names)
    batches, described = _batches(ref_graph, data, opts.shapes, opts.seed, run_ref, opts.data_flag)
    warnings: list = []
    run_ref = _named(run_ref, f"{names['reference']}: ONNX Runtime cannot run the FP32 reference on these inputs")
    try:
        runs = _Runs(run_ref, _emulation_runner(converted, names), _cuda_runner(converted, warnings))
        wants, gots, cudas, judged_by = _run_batches(ref, converted, batches, runs, opts.oracle, warnings)
    except ConvertedRunError as e:  # the converted model is at fault, not the inputs: a FAIL with the cause
        return CheckReport(dict(names, oracle="not run: the converted model does not run", batches=len(batches),
                                outputs={}, passed=False, warnings=warnings, validity=valid, inputs=described,
                                crash=str(e)))
    budget = _budget(ref, batches, wants, opts, names)
    merged = _merge(_compare_all(wants, gots, cudas, budget, opts, names), budget)
    warnings += verdict.judge(merged, wants, gots, budget, generated_flag=None if data is not None else opts.data_flag,
                              explain=lambda outs: verdict.culprits(ref_graph, batches[0], run_ref, outs))
    passed = all(o["passed"] for o in merged.values())
    return CheckReport(dict(names, oracle=judged_by, batches=len(batches), inputs=described, outputs=merged,
                            budget=budget.to_dict(), passed=passed, warnings=list(dict.fromkeys(warnings)),
                            validity=valid, blame=None if not _accuracy_failed(merged) else
                            _blame(ref, converted, batches[0], data, _fix_flags(merged))))


def _fix_flags(merged: dict) -> str:
    """The budget flags of the suggested fix: the decisions where only they failed, else
    the yardstick."""
    failed = [o for o in merged.values() if not o["passed"] and not o.get("not_judged")]
    if failed and all(verdict.decisions_fail(o.get("decisions")) and not o["nonfinite"]
                      and (o.get("allowed") is None or o["error"] <= o["allowed"]) for o in failed):
        return "--metric argmax --max-error auto"
    return "--max-error auto"


def _accuracy_failed(merged: dict) -> bool:
    """An output failed on its numbers (not only 'not judged' on inputs outside the model's domain)."""
    return any(not o["passed"] and not o.get("not_judged") for o in merged.values())


def _open_pair(ref, converted, opts: CheckOptions) -> tuple:
    """(the reference's graph, the report's header fields): both graphs loaded (weights
    by reference, not parsed), so a bad file is a clear error, and the converted model
    checked for the reference's inputs and outputs."""
    ref_graph = ref if isinstance(ref, onnx.ModelProto) else load_model(ref, by_reference=True)
    conv_graph = converted if isinstance(converted, onnx.ModelProto) else load_model(converted, by_reference=True)
    names = {"reference": str(ref) if not isinstance(ref, onnx.ModelProto) else "<model>",
             "converted": str(converted) if not isinstance(converted, onnx.ModelProto) else "<model>",
             "atol": opts.atol, "rtol": opts.rtol, "max_error": str(opts.max_error), "metric": opts.metric}
    _same_interface(ref_graph, conv_graph, names)
    return ref_graph, names


def _reference_runner(ref, names: dict):
    """ONNX Runtime CPU on the FP32 `ref`, unoptimised as the emulation is (ORT's fusions
    are not FP16 error); a one-line GraphmpError when it cannot load."""
    try:
        return runner(ref, optimize=False)
    except Exception as e:  # noqa: BLE001
        raise GraphmpError(f"{names['reference']}: ONNX Runtime cannot load the FP32 reference ({first_line(e)})") from None


def _emulation_runner(converted, names: dict):
    """The FP16 emulation of `converted` (graphmp.emulate) as a _named runner; a one-line
    GraphmpError when the emulation's copy of the model does not load."""
    try:
        return _named(emulated_runner(converted), f"{names['converted']}: the FP16 emulation (ONNX Runtime CPU) "
                      "cannot run the converted model on these inputs", ConvertedRunError)
    except GraphmpError:
        raise
    except Exception as e:  # noqa: BLE001 - ORT loaded the model above; the emulation's copy is refused
        raise ConvertedRunError(f"{names['converted']}: the FP16 emulation (ONNX Runtime CPU) cannot load the converted "
                           f"model ({first_line(e)})") from None


def _cuda_runner(converted, warnings: list):
    """ORT CUDA on `converted` where a GPU is present, else None; a session that does not
    load or that came up on another provider is None with a line in `warnings`."""
    if not cuda_available():
        return None
    try:
        run_cuda = runner(converted, providers=[CUDA])
        got = ran_on(run_cuda.session)
        if got != CUDA:
            warnings.append(f"ORT CUDA was asked for but the session runs on {got}: no CUDA row")
            return None
        return run_cuda
    except Exception as e:  # noqa: BLE001
        warnings.append(f"ORT CUDA could not load the model: {first_line(e)}")
        return None


@dataclass
class _Runs:
    """The runners of one check (feeds -> outputs): the FP32 reference (ORT CPU), the
    converted model's FP16 emulation, and ORT CUDA on it (None: no GPU, or it failed)."""
    ref: object
    emu: object
    cuda: object = None


def _run_batches(ref, converted, batches: list, runs: _Runs, oracle: str, warnings: list) -> tuple:
    """(wants, gots, cudas, judged_by): per batch the reference's outputs, the converted
    model's by `oracle` (onnx.reference, or the emulation where that cannot judge, from
    then on) and ORT CUDA's ([] when it has none or failed once); judged_by says which
    oracle judged. Why the reference was not used goes into `warnings`."""
    judged_by = EMULATION if oracle == "emulation" else REFERENCE
    wants, gots, cudas = [], [], []
    for feeds in batches:
        want = runs.ref(feeds)
        got = None
        if judged_by == REFERENCE:
            got = _reference_outputs(ref, converted, feeds, want, warnings)
            if got is None:
                judged_by = EMULATION
        wants.append(want)
        gots.append(got if got is not None else runs.emu(feeds))
        if runs.cuda is not None:
            try:
                cudas.append(runs.cuda(feeds))
            except Exception as e:  # noqa: BLE001 - no CUDA rows then, said in the warnings
                warnings.append(f"ORT CUDA could not run the converted model: {first_line(e)}")
                runs.cuda, cudas = None, []
    return wants, gots, cudas, judged_by


def _in_memory(m):
    """The model as a ModelProto with its weights: the reference evaluator needs them in memory."""
    return m if isinstance(m, onnx.ModelProto) else load_with_weights(m)


def _reference_outputs(ref, converted, feeds: dict, want: dict, warnings: list) -> dict | None:
    """The converted model's outputs on `feeds` by onnx.reference (the ideal kernel), or
    None with a line in `warnings` when onnx.reference does not reproduce ONNX Runtime's
    `want` on the FP32 source or cannot run the model."""
    try:
        self_check = run_reference(_in_memory(ref), feeds)
        if all(compare(want[k], self_check[k], 1e-4, 1e-3)["passed"] for k in want):
            return run_reference(_in_memory(converted), feeds)
        warnings.append("onnx.reference does not reproduce ONNX Runtime on the FP32 source; "
                        "the FP16 emulation judged instead")
    except Exception as e:  # noqa: BLE001 - the reference evaluator lacks some ops/shapes
        warnings.append(f"onnx.reference cannot run this model ({first_line(e)[:120]}); "
                        "the FP16 emulation judged instead")
    return None


def _budget(ref, batches: list, wants: list, opts: CheckOptions, names: dict):
    """The error budget per output (graphmp.budget.measure under max_error and metric);
    a one-line GraphmpError when the reference cannot run for it."""
    try:
        return measure(ref, batches, wants, opts.max_error, opts.metric, keep=True)
    except GraphmpError:
        raise
    except Exception as e:  # noqa: BLE001 - the budget runs the reference (inputs rounded to FP16, TF32)
        raise GraphmpError(f"{names['reference']}: ONNX Runtime cannot run the FP32 reference to measure the error "
                           f"budget ({first_line(e)})") from None


def _compare_all(wants: list, gots: list, cudas: list, budget, opts: CheckOptions, names: dict) -> dict:
    """{output (+ ' [ORT CUDA]'): [compare() row per batch]}; a GraphmpError when an
    output of the reference is missing from the converted model's outputs."""
    outputs: dict = {}
    for i, want in enumerate(wants):
        for label, got in [("", gots[i])] + ([(" [ORT CUDA]", cudas[i])] if cudas else []):
            for k in want:
                if k not in got:
                    raise GraphmpError(f"{names['converted']}: output '{k}' of the reference is missing from the "
                                       "converted model")
                row = compare(want[k], got[k], opts.atol, opts.rtol, allowed=budget.allowed.get(k),
                              metric=opts.metric)
                outputs.setdefault(k + label, []).append(row)
    return outputs


def _merge(outputs: dict, budget) -> dict:
    """One row per output from its per-batch rows (_compare_all): the worst error and
    differences, the mean argmax agreement, every batch's error when there are several."""
    merged = {}
    for k, rows in outputs.items():
        agrees = [r["argmax_agree"] for r in rows if r["argmax_agree"] is not None]
        errs = [r["error"] for r in rows if r["error"] is not None]
        merged[k] = {"error": max(errs) if errs else None, "allowed": budget.allowed.get(k.replace(" [ORT CUDA]", "")),
                     "max_abs": max(r["max_abs"] for r in rows), "max_rel": max(r["max_rel"] for r in rows),
                     "ref_max_abs": max(r.get("ref_max_abs", 0.0) for r in rows),
                     "nonfinite": sum(r["nonfinite"] for r in rows),
                     "ref_nonfinite": sum(r.get("ref_nonfinite", 0) for r in rows),
                     "argmax_agree": float(np.mean(agrees)) if agrees else None,
                     "per_batch": errs if len(errs) > 1 else None,  # the spread the verdict's max hides
                     "passed": all(r["passed"] for r in rows)}
    return merged


def _blame(ref, converted, feeds, data, flags: str = "--max-error auto") -> dict | None:
    """Where the error of a FAIL grows (graphmp.attribute), and the commands that fix it;
    None when the attribution cannot run (it is a hint, never a second failure)."""
    from .attribute import blame, fix_hint

    def proto(m):
        if isinstance(m, onnx.ModelProto):
            return m, None
        return load_model(os.fspath(m)), os.path.dirname(os.path.abspath(os.fspath(m)))
    try:
        (src, src_dir), (conv, conv_dir) = proto(ref), proto(converted)
        rows = blame(src, conv, feeds, src_dir=src_dir, conv_dir=conv_dir)
    except Exception:  # noqa: BLE001 - best effort: the verdict stands without it
        return None
    if not rows:
        return None
    name = (lambda m, d: d if isinstance(m, onnx.ModelProto) else os.fspath(m))
    return {"nodes": rows, "hint": fix_hint(rows, name(ref, "SOURCE.onnx"), name(converted, "OUT.onnx"), data, flags)}

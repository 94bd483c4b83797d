"""Running models: ONNX Runtime (the CPU unless the caller gives providers) and the
reference oracle.

ONNX Runtime's CPU provider computes almost every FP16 op in FP32 and removes the
model's own round trips, so an FP16 overflow never shows there. `run_reference`
(`--oracle reference`) runs onnx.reference.ReferenceEvaluator with graphmp's op
overrides (graphmp.reference_ops) and models ideal FP16/BF16 kernels: tensors are
stored in their declared type, and each arithmetic op that reads an FP16/BF16 input
(reference_ops.IDEAL_OPS, Erf, Gelu, BatchNormalization) computes in float64 and rounds
each output once to its declared type: the exact result rounded once, with overflow to
inf and underflow at op boundaries, never inside an op. Ops not listed there run in
numpy in their declared type: those graphmp may lower to FP16 are exact in any type
(data movement, Cast, comparisons, Relu/Clip/Max/Min, MaxPool, ...), except Range (its
element count depends on the type). FP32 ops compute as plain onnx.reference has them
(BatchNormalization, Erf and Gelu: in float64, rounded to FP32). Plain onnx.reference
computes FP16 ops step by step in FP16 numpy instead (see graphmp.reference_ops for what
that does to Softmax, LayerNormalization, ReduceMean). The emulation (graphmp.emulate)
models the same kernels with FP32 math on ONNX Runtime.
Overrides where onnx.reference departs from the spec: BatchNormalization always in
inference mode, and Loop (graphmp.reference_ops); ONNX Runtime's fused com.microsoft
ops of `--fuse ort` models run with graphmp.fused_ops (FP32 math, outputs rounded once).
`runner(model)` wraps one ONNX Runtime session as a function of the feeds; each of its
runs is bounded and stoppable (graphmp.run_limits: a time and a memory limit, SIGINT and
SIGTERM end it inside ONNX Runtime). The reference oracle runs in Python: Ctrl-C and
SIGTERM stop it between ops, the limits do not apply to it.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np
import onnx

from .paths import checked_descriptors, iter_tensors, map_descriptors


def oracle_ops() -> list:
    """The reference op overrides (graphmp.reference_ops; imported on first use, since
    onnx.reference takes a tenth of a second to import and most commands never need it)."""
    from .fused_ops import FUSED_OPS  # ONNX Runtime's fused com.microsoft ops (--fuse ort)
    from .reference_ops import ORACLE_OPS
    return ORACLE_OPS + FUSED_OPS


def ort_session(model, providers=None, base_dir=None, optimize=True, in_node_order=False):
    """An InferenceSession of a ModelProto (external data read from base_dir, through the
    descriptors graphmp checked) or a path (loaded with graphmp.model_io.load_model).
    in_node_order: execute in the order of the node list where the graph allows
    (PRIORITY_BASED), not ONNX Runtime's default reverse-DFS order, which runs a chain to
    the model's output before side branches such as calibration's per-tensor reductions
    and so keeps every intermediate alive (3x the peak memory at 720 px)."""
    import onnxruntime as ort

    def options():
        so = ort.SessionOptions()
        so.log_severity_level = 4  # graphmp reports failures itself, in one line
        if not optimize:
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if in_node_order and hasattr(ort, "ExecutionOrder"):
            so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
        return so
    providers = providers or ["CPUExecutionProvider"]
    if not isinstance(model, onnx.ModelProto):
        from .model_io import load_model  # a path: its weights are read as any model's are
        base_dir = os.path.dirname(os.path.abspath(os.fspath(model)))
        model = load_model(os.fspath(model), by_reference=True)
    return checked_session(ort, model, base_dir, options, providers)


def checked_session(ort, model, base_dir, options, providers):
    """An InferenceSession of `model` (a ModelProto; external data under base_dir) that reads
    only the data files graphmp checked. options: a function returning fresh SessionOptions."""
    # ONNX Runtime never opens a data file by the path the model names, only the files
    # graphmp checked: through their descriptors (/dev/fd/N: the kernel reopens the checked
    # file whatever now lies at its path, and ONNX Runtime maps it as it maps any data file),
    # else given their contents (a copy of each weight per session)
    with checked_descriptors(model, base_dir) if base_dir else contextlib.nullcontext({}) as fds:
        if fds and os.path.isdir(FD_DIR):
            try:
                return _session_through_descriptors(ort, model, fds, options(), providers)
            except Exception:  # noqa: BLE001 - ONNX Runtime refused the path (a file deleted since): the contents
                pass
        so = options()
        names, maps = map_descriptors(fds)
        try:
            if names:
                so.add_external_initializers_from_files_in_memory(names, maps, [len(m) for m in maps])
            return ort.InferenceSession(model.SerializeToString(), so, providers=providers)
        finally:
            for m in maps:
                if not isinstance(m, bytes):
                    m.close()


FD_DIR = "/dev/fd"  # Linux (a link to /proc/self/fd) and macOS: opening FD_DIR/N opens descriptor N's file


def _session_through_descriptors(ort, model, fds: dict, so, providers):
    """An InferenceSession whose external data locations are FD_DIR/<descriptor> of the
    checked files (`fds`: location -> descriptor), under the folder '/' (ONNX Runtime
    resolves each location under that folder and refuses one that leaves it; graphmp has
    checked the real locations itself). The model's own locations are restored after."""
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", "/")
    entries = [e for t in iter_tensors(model.graph) if t.data_location == onnx.TensorProto.EXTERNAL
               for e in t.external_data if e.key == "location" and e.value in fds]
    before = [e.value for e in entries]
    try:
        for e in entries:
            e.value = f"{FD_DIR.lstrip('/')}/{fds[e.value]}"
        blob = model.SerializeToString()
    finally:
        for e, value in zip(entries, before):
            e.value = value
    return ort.InferenceSession(blob, so, providers=providers)


def runner(model, providers=None, base_dir=None, optimize=True, what: str | None = None):
    """One ONNX Runtime session as a function feeds -> {output name: array} (arrays in
    `feeds` that are not inputs are ignored; a float32 array fed to an input the model
    declares float16, such as a KV cache converted with --cache-io fp16, is rounded to
    it, as the model's caller stores it), each run under graphmp.run_limits (`what` names
    the model in a limit's error: default its path, or "the model"). `.session` is the
    session."""
    from .run_limits import guarded, model_bytes
    sess = ort_session(model, providers, base_dir, optimize=optimize)
    names = [o.name for o in sess.get_outputs()]
    wanted = [i.name for i in sess.get_inputs()]
    half = {i.name for i in sess.get_inputs() if i.type == "tensor(float16)"}
    guard = guarded(what or _label(model), model_bytes(model))

    def run(feeds: dict) -> dict:
        chosen = {k: feeds[k].astype(np.float16) if k in half and getattr(feeds[k], "dtype", None) == np.float32
                  else feeds[k] for k in wanted}
        return dict(zip(names, guard(lambda options: sess.run(names, chosen, options))))
    run.session = sess
    return run


def _label(model) -> str:
    from .names import shown
    return "the model" if isinstance(model, onnx.ModelProto) else shown(os.fspath(model), 300)


def run_ort(model, feeds: dict, providers=None) -> dict:
    """Outputs by name from ONNX Runtime (CPU unless providers say otherwise)."""
    return runner(model, providers)(feeds)


def run_reference(model, feeds: dict) -> dict:
    """Outputs by name, each tensor in its declared type and each op an ideal kernel
    (float64 math, outputs rounded once: see the module docstring)."""
    from onnx.reference import ReferenceEvaluator
    if not isinstance(model, onnx.ModelProto):
        from .model_io import load_with_weights
        model = load_with_weights(model)
    ev = ReferenceEvaluator(model, new_ops=oracle_ops())
    wanted = set(ev.input_names)
    with np.errstate(all="ignore"):  # FP16 overflow is a result here, reported by the caller
        outs = ev.run(None, {k: v for k, v in feeds.items() if k in wanted})
    return dict(zip(ev.output_names, outs))


def cuda_available() -> bool:
    try:
        import onnxruntime as ort
        return "CUDAExecutionProvider" in ort.get_available_providers()
    except ImportError:
        return False

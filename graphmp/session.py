"""graphmp.session(path): open a converted model in ONNX Runtime the way it runs fastest.

The converted model carries, in its `graphmp` metadata, the ONNX Runtime CUDA options
that suit it: `prefer_nhwc=1` when convolutions run in FP16 and none is a ConvTranspose
(Tensor Core convolutions are NHWC kernels; in NCHW, ORT CUDA adds a layout transpose
around each, measured on one H100 for ResNet-50 FP16 batch 32: 2.89 ms NCHW, 2.11 ms with
prefer_nhwc; conv_provider_options says why not with a ConvTranspose). `session()` applies
them when the CUDA provider is there, checks with ran_on() that CUDA really came up (it
falls back to the CPU silently), and otherwise opens a plain CPU session; `device="cuda"`
makes a missing CUDA an error.

ran_on(sess) is graphmp's one answer to "which provider does this session run on": every
place that asks ONNX Runtime for CUDA (check, bench, train, the benchmarks) reads it back.
"""
from __future__ import annotations

import json
import os

from .errors import GraphmpError

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
CONV_OPS = ("Conv", "ConvTranspose")


def ran_on(sess) -> str:
    """The execution provider an onnxruntime session runs on (the first of get_providers()).

    ONNX Runtime creates a CPU session, with at most a logged warning, when the CUDA
    provider is missing or does not load (CUDA/cuDNN libraries not found), so asking for
    CUDA proves nothing: compare this with what was asked for after creating a session."""
    return sess.get_providers()[0]


# cuDNN's convolution settings for a training step (ONNX Runtime's defaults since 1.14, pinned so
# that another default cannot change a run): a step repeats the same shapes for thousands of
# steps, so the exhaustive algorithm search of the first step pays back, and the weight- and
# input-gradient convolutions' fastest algorithms need cuDNN's large workspace.
TRAINING_CONV_OPTIONS = {"cudnn_conv_algo_search": "EXHAUSTIVE", "cudnn_conv_use_max_workspace": "1"}


def conv_provider_options(convs: int, fp16_convs: int, training: bool = False, fp16_transposed: int = 0) -> dict:
    """The ORT CUDA provider options graphmp asks for, from a graph's Conv/ConvTranspose nodes:
    `convs` of them, `fp16_convs` computing in FP16, `fp16_transposed` of those ConvTranspose.
    The one rule for converted models (session()) and training steps (graphmp.train.device):
    prefer_nhwc=1 when any runs in FP16 (Tensor Core convolutions are NHWC kernels) and none of
    them is a ConvTranspose, and for a training step with convolutions the cuDNN settings of
    TRAINING_CONV_OPTIONS. Values are strings, as ONNX Runtime takes them.

    Why not with an FP16 ConvTranspose: with prefer_nhwc=1, ONNX Runtime 1.31.1 placed every
    FP16 ConvTranspose of a mixed ResNet-50 training step (the input gradients, 52 nodes) on
    the CPU provider: 1670 ms per step on an H200 against 423 ms with ORT's default options
    (benchmarks/train_session.py)."""
    options = {"prefer_nhwc": "1"} if fp16_convs and not fp16_transposed else {}
    if training and convs:
        options.update(TRAINING_CONV_OPTIONS)
    return options


def cuda_options(ctx) -> dict:
    """The ORT CUDA provider options for a conversion (after paint: ctx.lowered)."""
    convs = [n for _, n in ctx.nodes() if n.op_type in CONV_OPS]
    low = [n for n in convs if n in ctx.lowered]
    return conv_provider_options(len(convs), len(low),
                                 fp16_transposed=sum(n.op_type == "ConvTranspose" for n in low))


def recorded_options(path) -> dict:
    """The CUDA options graphmp recorded in the model's metadata ({} when none)."""
    import onnx
    m = onnx.load(os.fspath(path), load_external_data=False)
    meta = {p.key: p.value for p in m.metadata_props}.get("graphmp")
    if meta is None:
        return {}
    try:
        return dict(json.loads(meta).get("ort_cuda_options", {}))
    except (ValueError, AttributeError, TypeError, RecursionError):  # the model's metadata, not graphmp's
        return {}


_PROBED: set = set()  # (file identity, providers, options) that opened in a child process


def _probe_once(path: str, providers: list, session_options: dict) -> None:
    """load_check.probe (load only) of `path` with these providers and options, unless this
    version of the file passed it in this process; a GraphmpError when it did not open."""
    from .load_check import failure_text, probe
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_mtime_ns, st.st_size, repr(providers), repr(sorted(session_options.items())))
    if key in _PROBED:
        return
    res = probe(path, run=False, providers=providers, options=session_options)
    if not res["passed"]:
        raise GraphmpError(f"{path}: ONNX Runtime cannot open this model ({failure_text(res)}); the session was not "
                           "created in this process. Open it with graph_optimization_level=ORT_ENABLE_EXTENDED "
                           "(graphmp.session(path, graph_optimization_level=...)) if a graph optimizer is the cause, "
                           "or convert the FP32 model again with this graphmp, whose load check avoids or refuses it")
    _PROBED.add(key)


def session(path, device: str = "auto", probe: bool = True, **session_options):
    """An onnxruntime.InferenceSession of `path` on CUDA (with the options recorded by
    graphmp convert) when available, else on the CPU. device: "auto" | "cuda" | "cpu".
    `.graphmp_device` on the result says what it runs on.

    probe: first open the model the same way (providers, session_options) in a child
    process (graphmp/load_check.py), once per file version: a model that crashes ONNX
    Runtime at session creation is a GraphmpError here, not the end of the caller's
    process. probe=False skips it (one session creation less)."""
    import onnxruntime as ort
    if device not in ("auto", "cuda", "cpu"):
        raise GraphmpError(f"device must be auto, cuda or cpu, not '{device}'")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GraphmpError(f"{path}: no such file. Give the path of a converted .onnx model.")
    def options():
        so = ort.SessionOptions()
        for k, v in session_options.items():
            setattr(so, k, v)
        return so
    want_cuda = device != "cpu" and CUDA in ort.get_available_providers()
    if device == "cuda" and not want_cuda:
        raise GraphmpError(f"{path}: device 'cuda' asked for, but this onnxruntime has no {CUDA}; install "
                           "onnxruntime-gpu, or use device='auto' / 'cpu'")
    providers = [(CUDA, recorded_options(path)), CPU] if want_cuda else [CPU]
    if probe:
        _probe_once(path, providers, session_options)
    from .model_io import load_model
    from .model_runs import checked_session
    model = load_model(path, by_reference=True)  # its data files read through the descriptors checked here
    sess = checked_session(ort, model, os.path.dirname(os.path.abspath(path)), options, providers)
    got = ran_on(sess)
    if want_cuda and got != CUDA and device == "cuda":
        raise GraphmpError(f"{path}: the session came up on {got}, not {CUDA}: check that the CUDA and cuDNN "
                           "libraries onnxruntime-gpu needs are found")
    sess.graphmp_device = got
    return sess

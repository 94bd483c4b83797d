"""Which ONNX Runtime providers a training run asks for, and whether it got them.

ONNX Runtime quietly creates a CPU session when the CUDA provider is missing or fails to
load (it logs a warning and retries on CPU). A run that asked for CUDA must therefore look
at what every session runs on (graphmp.session.ran_on) after creating it: `device="cuda"`
then fails with one line, `device="auto"` goes on on the CPU and says so (the note ends up in the progress
output, the summary and summary.json).
"""
from __future__ import annotations

from ..errors import GraphmpError
from ..session import CPU, CUDA, ran_on
DEVICES = ("auto", "cpu", "cuda")


def providers_for(device: str) -> tuple[list, str | None]:
    """(providers to ask for, note or None) for device "auto" | "cpu" | "cuda".

    "cuda" without a CUDA provider in this onnxruntime raises a GraphmpError; "auto" then
    returns the CPU with a note saying so."""
    from ..model_runs import cuda_available
    if device not in DEVICES:
        raise GraphmpError(f"device must be one of {list(DEVICES)}, not '{device}'")
    if device == "cpu":
        return [CPU], None
    if cuda_available():
        return [CUDA, CPU], None
    if device == "cuda":
        raise GraphmpError(f"--device cuda: this onnxruntime ({_ort_info()}) has no {CUDA}; install "
                           "onnxruntime-gpu (docs/gpu.md), or use --device cpu / --device auto.")
    return [CPU], f"auto: no CUDA in this onnxruntime ({_ort_info()}), so training runs on the CPU"


def check_session(sess, providers, device: str | None, what: str) -> str | None:
    """After creating `sess` with `providers`: None when it got what was asked for.

    When CUDA was asked for and the session did not get it: device "cuda" raises a
    GraphmpError; otherwise returns a note (the run goes on on the CPU)."""
    got = ran_on(sess)
    if not providers or providers[0] != CUDA or got == CUDA:
        return None
    msg = (f"the {what} session came up on {got}, not {CUDA} (the CUDA provider is installed but did not "
           "load: check that the CUDA and cuDNN libraries onnxruntime-gpu needs are found)")
    if device == "cuda":
        raise GraphmpError(f"--device cuda: {msg}; fix that, or use --device cpu / --device auto.")
    return f"{device or 'providers'}: {msg}; running on the CPU"


def _ort_info() -> str:
    try:
        import onnxruntime as ort
        return f"onnxruntime {ort.__version__}, providers {ort.get_available_providers()}"
    except ImportError:
        return "onnxruntime not importable"

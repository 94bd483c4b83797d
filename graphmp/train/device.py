"""Which ONNX Runtime providers a training run asks for, and whether it got them.

ONNX Runtime quietly creates a CPU session when the CUDA provider is missing or fails to
load (it logs a warning and retries on CPU). A run that asked for CUDA must therefore look
at what every session runs on (graphmp.session.ran_on) after creating it: `device="cuda"`
then fails with one line, `device="auto"` goes on on the CPU and says so (the note ends up in the progress
output, the summary and summary.json).

The step session's CUDA provider options are chosen from the step graph (step_providers):
graphmp.session's one rule for convolutions (prefer_nhwc=1 when any runs in FP16 and none is
a ConvTranspose, which a step's input gradients are; cuDNN's training settings), plus
enable_cuda_graph=1 for `--cuda-graph`, which a step graph can take only when every node
runs on CUDA (cuda_graph_blockers says why not, before ONNX Runtime does).
"""
from __future__ import annotations

import numpy as np

from ..errors import GraphmpError
from ..session import CONV_OPS, CPU, CUDA, conv_provider_options, ran_on
from . import shape_values
from .builder import cone
DEVICES = ("auto", "cpu", "cuda")
CONTROL_FLOW = ("If", "Loop", "Scan")


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


def step_cuda_options(model, cuda_graph: bool = False) -> dict:
    """The CUDA provider options for the step graph `model` (an onnx ModelProto): the
    convolution rule of graphmp.session.conv_provider_options (training=True; the element type
    of each Conv/ConvTranspose's input from ONNX shape inference, run only when there are
    convolutions), plus enable_cuda_graph=1 when cuda_graph."""
    convs = [n for n in model.graph.node if n.op_type in CONV_OPS]
    low = []
    if convs:
        from onnx import TensorProto
        from .cuda_kernels import _elem_types
        types = _elem_types(model)
        low = [n for n in convs if types.get(n.input[0], 0) in (TensorProto.FLOAT16, TensorProto.BFLOAT16)]
    options = conv_provider_options(len(convs), len(low), training=True,
                                    fp16_transposed=sum(n.op_type == "ConvTranspose" for n in low))
    if cuda_graph:
        options["enable_cuda_graph"] = "1"
    return options


def step_providers(providers, model, cuda_graph: bool = False) -> list:
    """The providers to create the step session with: `providers` (None: the CPU) with a plain
    CUDA entry given the step's options (step_cuda_options); a CUDA entry that already
    carries options, ("CUDAExecutionProvider", {...}), is kept as given."""
    providers = list(providers or [CPU])
    return [(CUDA, step_cuda_options(model, cuda_graph)) if p == CUDA else p for p in providers]


def batch_dims(model, meta, batch_size: int) -> dict:
    """{dim name: batch_size} for the free first dim of every batch input of the step graph
    `model` (not the state, not an input the model takes whole: data.whole_arrays)."""
    from .data import whole_arrays
    from .flat import graph_state_names
    skip = set(graph_state_names(meta)) | set(whole_arrays(meta))
    dims = {}
    for v in model.graph.input:
        shape = v.type.tensor_type.shape.dim
        if v.name not in skip and shape and shape[0].dim_param:
            dims[shape[0].dim_param] = int(batch_size)
    return dims


def pin_dims(model, dims: dict):
    """A copy of the step graph `model` whose inputs have the free dims named in `dims` ({dim
    name: size}) fixed, and whose Shape and Size nodes of tensors that are then of static shape
    are replaced by their values (initializers of the same names). ONNX Runtime folds Shape of
    a static shape itself but not Size, and under CUDA both write host memory, so each would
    cost a copy back to the device every step and keep the step from being captured as a
    CUDA graph. The values are those the nodes would compute: the step computes the same."""
    import copy
    from onnx import numpy_helper, shape_inference
    m = copy.deepcopy(model)
    for v in m.graph.input:
        for d in v.type.tensor_type.shape.dim:
            if d.dim_param in dims:
                d.dim_value = int(dims[d.dim_param])  # clears dim_param (a oneof)
    while True:  # a folded Shape can make more shapes static (Reshape to it): again until nothing folds
        static = _static_shapes(shape_values.infer(m))
        asked = {n.input[0] for n in m.graph.node if n.op_type in ("Shape", "Size") and n.input[0] not in static}
        if asked:  # data propagation (a Reshape to computed lengths) on what computes them only
            try:
                found = _static_shapes(shape_inference.infer_shapes(cone(m, asked), data_prop=True))
            except Exception:  # noqa: BLE001 - inference is best effort: what it found folds
                found = {}
            static.update({t: found[t] for t in asked if t in found})
        values = {n.output[0]: _shape_or_size(n, static[n.input[0]]) for n in m.graph.node
                  if n.op_type in ("Shape", "Size") and n.input[0] in static}
        if not values:
            return m
        kept = [n for n in m.graph.node if n.output[0] not in values or n.op_type not in ("Shape", "Size")]
        del m.graph.node[:]
        m.graph.node.extend(kept)
        m.graph.initializer.extend(numpy_helper.from_array(np.asarray(v, np.int64), name) for name, v in values.items())


def _static_shapes(model) -> dict:
    """{tensor name: [dims]} of the tensors whose every dim is known (after shape inference)."""
    return {name: dims for name, dims in shape_values.dims_table(model).items()
            if dims is not None and all(isinstance(d, int) for d in dims)}


def _shape_or_size(node, shape: list):
    """What Shape (with its start/end) or Size gives for an input of this shape."""
    if node.op_type == "Size":
        return int(np.prod(shape, dtype=np.int64)) if shape else 1
    attrs = {a.name: a.i for a in node.attribute}
    return list(shape)[attrs.get("start", 0):attrs.get("end", len(shape))]


def cuda_graph_blockers(model, state_names) -> list:
    """Why the step graph `model` (its batch axis pinned: pin_dims) cannot be captured as one
    CUDA graph (ONNX Runtime captures only graphs whose every node runs on CUDA, with no
    copies between host and device): one line per reason, [] when none is known. An input
    with a free dim (shape arithmetic on it runs on the CPU), a Shape or Size node left (its
    output is host memory), a node without a CUDA kernel (graphmp.train.cuda_kernels), a
    control-flow node. state_names: the step's state inputs."""
    from .cuda_kernels import nodes_without_kernel
    why = []
    for v in model.graph.input:
        dims = [d.dim_param or "?" for d in v.type.tensor_type.shape.dim if not d.HasField("dim_value")]
        if v.name not in state_names and dims:
            why.append(f"input '{v.name}' has free dims {dims} (shape arithmetic on them runs on the CPU); "
                       "--cuda-graph pins only the batch axis, to the batch size: export the model with its other "
                       "dims fixed")
    why += [f"node '{n.name}' ({n.op_type}) of a tensor whose shape is not static writes its output to host memory"
            for n in model.graph.node if n.op_type in ("Shape", "Size")]
    why += [f"node '{n.name}' ({n.op_type}) is control flow" for n in model.graph.node if n.op_type in CONTROL_FLOW]
    if not any("control flow" in w for w in why):
        why += [f"node '{name}' ({op}, opset {version}, {elem}) has no CUDA kernel and runs on the CPU"
                for name, op, version, elem in nodes_without_kernel(model)]
    return why


def _ort_info() -> str:
    try:
        import onnxruntime as ort
        return f"onnxruntime {ort.__version__}, providers {ort.get_available_providers()}"
    except ImportError:
        return "onnxruntime not importable"

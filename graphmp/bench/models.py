"""The models a bench run compares, written into its work folder.

- fp32 (and tf32): the FP32 source after graphmp's conversion pipeline with no precision
  change (every node kept FP32, no calibration): the same graph cleanups the converted
  model gets (graphmp/passes/prepare.py: initializer-inputs become constants, Constant
  nodes become initializers, an opset below 7 upgraded, redundant Casts dropped, sorted), so a row's
  speedup over it is precision alone.
- fp16: graphmp.convert of the source (or the user's --converted model).
- occ: onnxconverter-common's convert_float_to_float16(keep_io_types=True).
- ort-opt: onnxruntime.transformers.optimizer.optimize_model(model_type, num_heads=0,
  hidden_size=0) then convert_float_to_float16(keep_io_types=True).

Every model is written with graphmp.save.save_model (temporary file + rename; a data file
only under a name no file has), never through a symlink planted in the work folder
(`--keep DIR`), and never into a device or FIFO.
"""
from __future__ import annotations

import importlib.util
import os
import warnings

import onnx

from ..convert import MARK_KEY, convert
from ..errors import GraphmpError
from ..model_io import load_with_weights, model_weight_bytes
from ..save import save_model

ORT_OPT_TYPES = ("bert", "gpt2", "vit", "clip", "bart", "t5", "swin", "unet", "vae", "gpt_neox", "phi")


def _save(model: onnx.ModelProto, path: str, src_dir: str | None = None):
    """Write `model` atomically (graphmp.save.save_model): a symlink or a planted file named like
    the output or its data file is replaced or passed over, never written through; a device
    or FIFO there is refused. Weights over 1.8 GB go to a data file next to it.
    src_dir: where tensors that still reference external data are read from."""
    big = model_weight_bytes(model) > 1.8e9
    save_model(model, path, src_dir, None, external=big)


def fp32_baseline(src: str, dst: str) -> dict:
    """The FP32 source through graphmp's pipeline with every node kept FP32 (see the module
    docstring), without graphmp's converted-model mark. Returns what prepare changed."""
    rep = convert(src, fp32_nodes=".*", calibration="off")
    model = rep.model
    keep = [p for p in model.metadata_props if p.key != MARK_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    _save(model, dst)
    d = rep.to_dict()
    return {"path": dst, "how": "graphmp.convert pipeline, every node FP32, no calibration",
            "prepare": {k: v for k, v in d.get("prepare", {}).items() if isinstance(v, (int, float, str, bool))},
            "nodes_low": d["nodes"]["low"], "casts_added": d["casts_added"]}


def convert_occ(src: str, dst: str) -> str:
    """The source converted by onnxconverter-common (keep_io_types=True), written to `dst`."""
    try:
        from onnxconverter_common import float16
    except ImportError:
        raise GraphmpError("onnxconverter-common is not installed; pip install 'graphmp[bench]' "
                           "(or pip install onnxconverter-common) for --compare occ") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = float16.convert_float_to_float16(load_with_weights(src), keep_io_types=True)
    _save(conv, dst, os.path.dirname(os.path.abspath(src)))
    return dst


def guess_model_type(model: onnx.ModelProto) -> str:
    """The optimizer's model_type from the graph: gpt2 for decoders (past/present state
    inputs or outputs, or a causal mask: Trilu, or LessOrEqual comparing positions, as
    torch exports of GPT-2 build it), vit for attention over pixel inputs, else bert (the
    encoder fusions, harmless on other graphs). `--model-type` overrides the guess."""
    names = [i.name.lower() for i in model.graph.input] + [o.name.lower() for o in model.graph.output]
    ops = {n.op_type for n in model.graph.node}
    if any("past" in n or "present" in n for n in names) or ops & {"Trilu", "LessOrEqual"}:
        return "gpt2"
    if any("pixel" in n for n in names) and "Softmax" in ops and "MatMul" in ops:
        return "vit"
    return "bert"


def convert_ort_opt(src: str, dst: str, model_type: str | None = None) -> dict:
    """ONNX Runtime's own fused FP16 model of `src` (see the module docstring). Its fusions
    need sympy (symbolic shape inference); ORT's own pre-optimization (opt_level 1) needs
    torch, so without torch only the Python fusions run (opt_level 0), said in `how`."""
    try:
        import sympy  # noqa: F401
        from onnxruntime.transformers.optimizer import optimize_model
    except ImportError as e:
        raise GraphmpError(f"--compare ort-opt needs onnxruntime.transformers and sympy ({e}); "
                           "pip install sympy") from None
    mtype = model_type or guess_model_type(onnx.load(src, load_external_data=False))
    if mtype not in ORT_OPT_TYPES:
        raise GraphmpError(f"--model-type '{mtype}' is not one of {', '.join(ORT_OPT_TYPES)}")
    if importlib.util.find_spec("torch") is not None:
        level, how = None, "ORT pre-optimization + Python fusions"
    else:
        level, how = 0, "Python fusions only (ORT's opt_level 1 pass imports torch, not installed)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = optimize_model(src, model_type=mtype, num_heads=0, hidden_size=0, opt_level=level)
        fused = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
        opt.convert_float_to_float16(keep_io_types=True)
    _save(opt.model, dst, os.path.dirname(os.path.abspath(src)))
    return {"path": dst, "model_type": mtype, "guessed": model_type is None, "how": how, "fused": fused}

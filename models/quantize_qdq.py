#!/usr/bin/env python3
"""Make an INT8 Q/DQ model from a real FP32 ONNX model, to test graphmp on quantized graphs.

Already-quantized models are a case graphmp meets in practice: QuantizeLinear /
DequantizeLinear pairs around INT8 weights and activations, with FP32 scales that must
not be lowered carelessly. This script produces such a model from one of the committed
FP32 models with ONNX Runtime's own quantizer, so the result is what users really get:

* ``onnxruntime.quantization.quantize_static`` with ``QuantFormat.QDQ``, INT8 (signed)
  activations and weights, per-channel weights, MinMax calibration;
* calibration on a few seeded N(0,1) batches of a fixed shape given on the command line
  (random data: the scales are plausible, not tuned for accuracy; the point is the graph
  structure, and the same seed always gives the same file);
* models below opset 13 are first converted to opset 13 with ``onnx.version_converter``
  (per-channel DequantizeLinear needs the ``axis`` attribute of opset 13; ORT's quantizer
  only lifts them to opset 11 and writes an invalid model);
* the output is written to a temporary file next to the target, run once in ONNX
  Runtime (CPU) and only then renamed into place, so a failed or interrupted run never
  leaves a half-written or unloadable model.

Usage::

    python models/quantize_qdq.py models/real/super_resolution.onnx \\
        -o models/real/super_resolution_qdq.onnx --shapes input:1x1x224x224

``--shapes`` takes ``NAME:DIMS`` (dims joined by ``x``), repeatable or comma-separated;
it is needed for every float input whose shape has a symbolic or unknown dimension.
Needs ``onnx``, ``onnxruntime`` and ``numpy``.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, version_converter
from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                      quantize_static)

PER_CHANNEL_OPSET = 13


def parse_shapes(specs: list[str]) -> dict[str, tuple[int, ...]]:
    """``["x:1x3x224x224", "y:1x64"]`` (or one comma-joined string) -> ``{name: dims}``."""
    shapes = {}
    for spec in (s.strip() for arg in specs for s in arg.split(",")):
        if not spec:
            continue
        name, sep, dims = spec.rpartition(":")
        if not sep or not name:
            raise ValueError(f"bad --shapes entry {spec!r}: expected NAME:DIMS, e.g. x:1x3x224x224")
        try:
            shapes[name] = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError:
            raise ValueError(f"bad dims in --shapes entry {spec!r}: expected e.g. 1x3x224x224") from None
    return shapes


def input_specs(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple]:
    """``{input name: (numpy dtype, concrete shape)}`` for the graph inputs (not initializers).

    A shape comes from ``shapes`` if given there, else from the model when every dim is a
    fixed number. Only float inputs are supported: random integers would be meaningless
    (token ids, sample rates) and quantize_static only calibrates float tensors anyway.
    """
    inits = {t.name for t in model.graph.initializer}
    inputs = [vi for vi in model.graph.input if vi.name not in inits]
    unknown = set(shapes) - {vi.name for vi in inputs}
    if unknown:
        raise ValueError(f"--shapes names no input of the model: {', '.join(sorted(unknown))}; "
                         f"inputs: {', '.join(vi.name for vi in inputs)}")
    specs = {}
    for vi in inputs:
        tt = vi.type.tensor_type
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if dtype.kind != "f":
            raise ValueError(f"input {vi.name!r} is {dtype}: only float inputs can be calibrated here")
        if vi.name in shapes:
            shape = shapes[vi.name]
        else:
            dims = list(tt.shape.dim)
            if not all(d.HasField("dim_value") for d in dims):
                raise ValueError(f"input {vi.name!r} has a dynamic shape: "
                                 f"pass --shapes {vi.name}:DIMS")
            shape = tuple(d.dim_value for d in dims)
        specs[vi.name] = (dtype, shape)
    return specs


def default_opset(model: onnx.ModelProto) -> int:
    """The model's opset for the default ONNX domain."""
    return next(i.version for i in model.opset_import if i.domain in ("", "ai.onnx"))


class RandomBatches(CalibrationDataReader):
    """Yields ``count`` feeds of seeded N(0,1) data, one array per input, for calibration."""

    def __init__(self, specs: dict[str, tuple], count: int, seed: int):
        rng = np.random.default_rng(seed)
        self._feeds = iter([
            {name: rng.standard_normal(shape).astype(dtype) for name, (dtype, shape) in specs.items()}
            for _ in range(count)
        ])

    def get_next(self) -> dict | None:
        return next(self._feeds, None)


def quantize(src: str, dst: str, specs: dict[str, tuple], batches: int = 8,
             seed: int = 0) -> Counter:
    """Write an INT8 Q/DQ version of ``src`` to ``dst`` atomically; return its op counts.

    ``specs`` is what :func:`input_specs` returns for ``src``.
    """
    model = onnx.load(src)
    if default_opset(model) < PER_CHANNEL_OPSET:
        # Per-channel DequantizeLinear needs its ``axis`` attribute (opset 13); ORT's
        # quantizer lifts older models only to opset 11 and then writes an invalid graph.
        model = version_converter.convert_version(model, PER_CHANNEL_OPSET)
        # The converter keeps the IR version; IR < 4 wants every initializer to be a graph
        # input, which the quantizer's new scale/zero-point initializers are not.
        model.ir_version = max(model.ir_version, helper.find_min_ir_version_for(model.opset_import))
    out_dir, base = os.path.split(os.path.abspath(dst))
    tmp = os.path.join(out_dir, f".{base}.{os.getpid()}.tmp")
    try:
        quantize_static(model, tmp, RandomBatches(specs, batches, seed),
                        quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
        # Load it in ONNX Runtime before it replaces anything: a model that does not
        # run is no test input.
        sess = ort.InferenceSession(tmp, providers=["CPUExecutionProvider"])
        sess.run(None, RandomBatches(specs, 1, seed + 1).get_next())
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return Counter(n.op_type for n in onnx.load(dst).graph.node)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="FP32 ONNX model")
    ap.add_argument("-o", "--output", required=True, help="path of the Q/DQ model to write")
    ap.add_argument("--shapes", action="append", default=[], metavar="NAME:DIMS",
                    help="fixed input shape for calibration, e.g. input:1x1x224x224 "
                         "(repeatable; comma lists allowed)")
    ap.add_argument("--batches", type=int, default=8, help="calibration batches (default 8)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = ap.parse_args(argv)
    try:
        specs = input_specs(onnx.load(args.model, load_external_data=False),
                            parse_shapes(args.shapes))
    except ValueError as exc:
        ap.error(str(exc))
    ops = quantize(args.model, args.output, specs, args.batches, args.seed)
    size = Path(args.output).stat().st_size
    print(f"{args.output}: {size / 1e6:.3f} MB, {sum(ops.values())} nodes "
          f"({ops['QuantizeLinear']} QuantizeLinear, {ops['DequantizeLinear']} DequantizeLinear); "
          f"ops: {dict(ops.most_common())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

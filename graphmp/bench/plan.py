"""The row plan of one bench run: which (backend, precision, batch, variant) rows run.

Needs: validated backend / precision names and batch sizes. Guarantees: one RowSpec per
row that can exist on that backend, in a stable order (backend, batch, then precision,
then variant), so the rows of one backend and batch can be opened and timed together.

- ort-cpu has no TF32 (no `tf32` row) and no session-option variants.
- ort-cuda runs every precision with the provider's defaults (`default`), with
  `prefer_nhwc=1` (`nhwc`: cuDNN convolutions in NHWC, the Tensor Core layout) and, when
  the model's shapes are static, with CUDA graphs (`cuda-graph`: enable_cuda_graph=1,
  inputs and outputs bound once with I/O binding).
- trt runs one engine per precision and batch (TensorRT chooses its own layouts); not
  ort-opt, whose fused com.microsoft ops only ONNX Runtime runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx

from ..errors import GraphmpError
from ..model_io import iter_graphs

BACKENDS = ("trt", "ort-cuda", "ort-cpu")
PRECISIONS = ("fp32", "tf32", "fp16", "occ", "ort-opt")
COMPARE = ("occ", "ort-opt")   # precisions that come from another converter (--compare)
VARIANTS = ("default", "nhwc", "cuda-graph")
LABELS = {"fp32": "FP32 strict", "tf32": "TF32", "fp16": "mixed FP16 (graphmp)",
          "occ": "FP16 (onnxconverter-common)", "ort-opt": "FP16 (ORT transformers optimizer)"}
SOURCES = {"fp32": "fp32 source", "tf32": "fp32 source", "fp16": "graphmp", "occ": "onnxconverter-common",
           "ort-opt": "onnxruntime.transformers.optimizer"}
# Ops whose output shapes depend on the data, or that run subgraphs: a CUDA graph replays
# fixed kernels with fixed shapes, so such a model cannot be captured.
DYNAMIC_OPS = {"NonZero", "NonMaxSuppression", "Unique", "Loop", "If", "Scan", "Compress", "TopK",
               "RoiAlign", "StringNormalizer"}


@dataclass(frozen=True)
class RowSpec:
    backend: str
    precision: str
    batch: int
    variant: str = "default"

    @property
    def key(self) -> tuple:
        return (self.backend, self.precision, self.batch, self.variant)


def static_shapes(model: onnx.ModelProto) -> tuple[bool, str | None]:
    """(True, None) when every op of `model` has data-independent output shapes (a CUDA
    graph can be captured at fixed input shapes), else (False, why)."""
    found = sorted({n.op_type for g in iter_graphs(model.graph) for n in g.node
                    if n.op_type in DYNAMIC_OPS and n.domain in ("", "ai.onnx")})
    if found:
        return False, f"data-dependent shapes or control flow ({', '.join(found)})"
    return True, None


def variants_for(backend: str, static: bool) -> tuple:
    """The session-option variants planned on `backend`."""
    if backend != "ort-cuda":
        return ("default",)
    return VARIANTS if static else ("default", "nhwc")


def plan_rows(backends, precisions, batches, static: bool = True) -> list[RowSpec]:
    """Every row of the run (see the module docstring)."""
    for b in backends:
        if b not in BACKENDS:
            raise GraphmpError(f"unknown backend '{b}'; choose from {', '.join(BACKENDS)}")
    for p in precisions:
        if p not in PRECISIONS:
            raise GraphmpError(f"unknown precision '{p}'; choose from {', '.join(PRECISIONS)}")
    rows = []
    for b in backends:
        for batch in batches:
            for p in precisions:
                if (b == "ort-cpu" and p == "tf32") or (b == "trt" and p == "ort-opt"):
                    continue
                rows += [RowSpec(b, p, batch, v) for v in variants_for(b, static)]
    return rows


def groups(rows: list[RowSpec]) -> list[tuple[str, int, list[RowSpec]]]:
    """Rows grouped by (backend, batch), in plan order: each group is timed together."""
    out: dict = {}
    for r in rows:
        out.setdefault((r.backend, r.batch), []).append(r)
    return [(b, batch, rs) for (b, batch), rs in out.items()]

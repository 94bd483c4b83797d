"""`graphmp build`: a strongly typed TensorRT engine from an ONNX model."""
from __future__ import annotations

import argparse

from .args import add_output, add_shapes, add_timing_cache, add_verbosity, add_workspace
from .outputs import default_output

EPILOG_BUILD = """\
precision:
  The network is strongly typed (TensorRT 10: STRONGLY_TYPED flag; TensorRT 11: always), so
  the types and Casts in the ONNX graph ARE the engine's precision: build the output of
  `graphmp convert` for FP16 Tensor Cores. An FP32 model gives an FP32 engine, which uses
  TF32 Tensor Cores unless --no-tf32. No FP16/INT8 builder flag is set (gone in TensorRT 11).

shapes (trtexec syntax, NAME:DxDx..., several separated by commas):
  --shapes is the profile's opt shape of every input with a dynamic dim; --min-shapes and
  --max-shapes default to it (an engine for exactly that shape).

examples:
  graphmp build model.mp.onnx -o model.plan --shapes pixel_values:8x3x224x224
  graphmp build bert.mp.onnx -o bert.plan --shapes input_ids:8x128,attention_mask:8x128,token_type_ids:8x128 \\
      --min-shapes input_ids:1x128,attention_mask:1x128,token_type_ids:1x128 \\
      --max-shapes input_ids:32x128,attention_mask:32x128,token_type_ids:32x128
  graphmp build model.mp.onnx -o model.plan --shapes x:1x3x224x224 --timing-cache trt.cache
needs TensorRT 10 or 11 and an NVIDIA GPU: pip install 'graphmp[gpu]' (or pip install tensorrt).
"""

def add(sub):
    b = sub.add_parser("build", help="TensorRT engine from an ONNX model (its Casts set the precision)",
                       description="Build a strongly typed TensorRT engine from an ONNX model and save it. "
                       "The model is never modified.", epilog=EPILOG_BUILD,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("model", help="input .onnx (normally the output of graphmp convert); external data is read "
                   "from its folder")
    add_output(b, "engine file (default: MODEL.plan in the current directory)")
    add_shapes(b, "opt shapes of the dynamic inputs, e.g. input:8x3x224x224")
    b.add_argument("--min-shapes", metavar="NAME:DIMS,...", help="smallest shapes (default: --shapes)")
    b.add_argument("--max-shapes", metavar="NAME:DIMS,...", help="largest shapes (default: --shapes)")
    add_timing_cache(b, "read this timing cache if it exists and write it back after the build (rebuilds are much "
                     "faster)")
    b.add_argument("--no-tf32", action="store_true", help="strict FP32 for FP32 layers (clear BuilderFlag.TF32)")
    add_workspace(b, "limit the builder's workspace memory")
    add_verbosity(b, "print nothing but errors", "-v: TensorRT's verbose log on stderr")



def run(args) -> int:
    from ..trt import build_engine
    out = args.output or default_output(args.model, ".plan")
    res = build_engine(args.model, out, shapes=args.shapes, min_shapes=args.min_shapes, max_shapes=args.max_shapes,
                       tf32=not args.no_tf32, timing_cache=args.timing_cache, workspace_mb=args.workspace,
                       verbose=args.verbose > 0)
    if not args.quiet:
        print(res.summary())
    return 0

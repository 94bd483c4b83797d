#!/usr/bin/env python
"""Channel padding: what it costs and what it gains, padded vs unpadded, in one run.

Models (each skipped with a note when missing):
  lm_head     hidden [B, 128, 768] @ W [768, 50257]: GPT-2's odd-vocabulary head alone
  gpt2        models/build/gpt2.onnx (python models/export_hf.py gpt2), tied head 50257
  oddnet      a CNN with a 3-channel stem and odd widths (29, 45, 99, 201, 1001 classes)
  bytecls     a byte classifier: int64 bytes -> OneHot(257) -> MatMul 257x100 -> Relu -> 100x45 -> 45x7
              (K=257 is aligned only by raising OneHot's depth)
  resnet50    models/build/resnet50.onnx: already aligned, expect no change
  ppocr_cls   models/real/ppocr_mobile_v2_cls.onnx: a real mobile CNN with odd widths

Variants per model: FP32 and mixed FP16 (graphmp convert), each unpadded and padded
(graphmp pad / convert --pad-channels) to --multiple (default 8). Speed comes from the
same harness as `graphmp bench` (ONNX Runtime CUDA with I/O binding where a GPU is
present, else ONNX Runtime CPU); every variant's outputs are compared with the
unpadded one on the same inputs. The report also gives the padding's static cost:
added FLOPs and weight bytes, and the fraction of weight layers with every dim aligned
before and after (as `graphmp pad` reports it).

On the CPU, ONNX Runtime computes FP16 ops in FP32 (docs/bench.md), and Tensor Core
alignment does not apply: the CPU numbers show the overhead of padding, not its gain.

Usage:
  python benchmarks/pad.py [--models lm_head,oddnet,...] [--multiple 8] [--batch 1,8]
                           [--backends trt,ort-cuda|ort-cpu] [--json benchmarks/results/pad.json]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

import graphmp  # noqa: E402
from graphmp.save import write_json  # noqa: E402
from graphmp.pad import pad  # noqa: E402

RNG = np.random.default_rng(0)


def _init(name, shape, scale=0.05):
    return numpy_helper.from_array(RNG.normal(0, scale, shape).astype(np.float32), name)


def build_lm_head(path):
    x = helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["B", 128, 768])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", 128, 50257])
    g = helper.make_graph([helper.make_node("MatMul", ["hidden", "wte"], ["logits"], name="lm_head")], "lm_head",
                          [x], [y], [_init("wte", (768, 50257))])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)


def build_oddnet(path):
    """stem 3->29 (stride 2) then convs 29->45->99->201 (stride 2) with BN+Relu, GAP, 1001 classes."""
    nodes, inits = [], []
    x = "image"
    widths = [3, 29, 45, 99, 201]
    for i, (cin, cout) in enumerate(zip(widths, widths[1:])):
        inits += [_init(f"w{i}", (cout, cin, 3, 3), (2 / (9 * cin)) ** 0.5), _init(f"b{i}", (cout,), 0.1)]
        bn = [numpy_helper.from_array(v.astype(np.float32), f"bn{i}_{k}") for k, v in
              (("s", np.ones(cout)), ("b", np.zeros(cout)), ("m", np.zeros(cout)), ("v", np.ones(cout)))]
        inits += bn
        nodes += [helper.make_node("Conv", [x, f"w{i}", f"b{i}"], [f"c{i}"], kernel_shape=[3, 3], pads=[1] * 4,
                                   strides=[2, 2], name=f"conv{i}"),
                  helper.make_node("BatchNormalization", [f"c{i}"] + [t.name for t in bn], [f"n{i}"], name=f"bn{i}"),
                  helper.make_node("Relu", [f"n{i}"], [f"r{i}"], name=f"relu{i}")]
        x = f"r{i}"
    inits += [_init("fc", (201, 1001)), _init("fcb", (1001,))]
    nodes += [helper.make_node("GlobalAveragePool", [x], ["gap"], name="gap"),
              helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
              helper.make_node("Gemm", ["flat", "fc", "fcb"], ["logits"], name="fc")]
    g = helper.make_graph(nodes, "oddnet", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["B", 3, 224, 224])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", 1001])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)


def build_bytecls(path):
    inits = [numpy_helper.from_array(np.array(257, np.int64), "depth"),
             numpy_helper.from_array(np.array([0, 1], np.float32), "onoff"),
             _init("w1", (257, 100)), _init("b1", (100,)), _init("w2", (100, 45)), _init("w3", (45, 7))]
    nodes = [helper.make_node("OneHot", ["bytes", "depth", "onoff"], ["oh"], name="onehot", axis=-1),
             helper.make_node("MatMul", ["oh", "w1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="add1"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu1"),
             helper.make_node("MatMul", ["r", "w2"], ["h2"], name="mm2"),
             helper.make_node("Relu", ["h2"], ["r2"], name="relu2"),
             helper.make_node("MatMul", ["r2", "w3"], ["logits"], name="mm3")]
    g = helper.make_graph(nodes, "bytecls", [helper.make_tensor_value_info("bytes", TensorProto.INT64, ["B", "L"])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "L", 7])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)


MODELS = {
    "lm_head": build_lm_head,
    "gpt2": os.path.join(REPO, "models", "build", "gpt2.onnx"),
    "oddnet": build_oddnet,
    "bytecls": build_bytecls,
    "resnet50": os.path.join(REPO, "models", "build", "resnet50.onnx"),
    "ppocr_cls": os.path.join(REPO, "models", "real", "ppocr_mobile_v2_cls.onnx"),
}
DIMS = {"gpt2": 128, "ppocr_cls": 64, "bytecls": 512}      # size of the symbolic dims other than batch (sequence, H/W)


def variants(name, src, work, multiple):
    """(fp32, mixed) paths unpadded and padded, plus the padding report of the FP32 model."""
    j = lambda suffix: os.path.join(work, f"{name}.{suffix}.onnx")  # noqa: E731
    rep = pad(src, j("pad"), multiple=multiple)
    graphmp.convert(src, j("mp"))
    graphmp.convert(src, j("mp.pad"), pad_channels=multiple)
    return {"unpadded": (src, j("mp")), "padded": (j("pad"), j("mp.pad"))}, rep.to_dict()


def time_variants(paths, backends, batches, dim, args):
    """graphmp.bench on the unpadded and the padded pair; rows keyed by variant."""
    from graphmp.bench import bench
    precisions = "fp32,fp16" if backends == "ort-cpu" else "tf32,fp16"
    out = {}
    for variant, (fp32, mixed) in paths.items():
        res = bench(fp32, converted=mixed, backends=backends, precisions=precisions, batches=batches,
                    shapes=shapes_for(fp32, dim),
                    warmup=args.warmup, iterations=args.iterations, min_time=args.min_time, oracle_max_mb=0,
                    command=result_command(), progress=False).to_dict()
        out[variant] = res
    return out


def shapes_for(path, dim):
    """--shapes text: symbolic dims = `dim`, except axis 0 = 1 (bench's batches set it)."""
    from graphmp.inputs import input_specs
    specs = input_specs(onnx.load(path, load_external_data=False))
    return ",".join(f"{s.name}:" + "x".join(str(d if isinstance(d, int) else (1 if i == 0 else dim))
                                            for i, d in enumerate(s.dims)) for s in specs)


def result_command():
    return " ".join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), REPO)] + sys.argv[1:])


def ratios(entry):
    """padded / unpadded median latency per (backend, precision, batch)."""
    rows = {}
    for variant, res in entry["timing"].items():
        for r in res["rows"]:
            if r["status"] == "ok" and r["latency_ms"]:
                rows.setdefault((r["backend"], r["precision"], r["batch"]), {})[variant] = r["latency_ms"]["median"]
    out = []
    for (backend, prec, batch), v in sorted(rows.items()):
        if "unpadded" in v and "padded" in v:
            out.append({"backend": backend, "precision": prec, "batch": batch, "unpadded_ms": v["unpadded"],
                        "padded_ms": v["padded"], "speedup": v["unpadded"] / v["padded"]})
    return out


def print_table(result):
    print("\n| model | backend | precision | batch | unpadded ms | padded ms | speedup | +FLOPs | +weights | aligned |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, e in result["models"].items():
        if "skipped" in e:
            print(f"| {name} | skipped: {e['skipped']} ||||||||| ")
            continue
        st = e["static"]
        for r in e["ratios"]:
            print(f"| {name} | {r['backend']} | {r['precision']} | {r['batch']} | {r['unpadded_ms']:.3f} | "
                  f"{r['padded_ms']:.3f} | {r['speedup']:.3f}x | {st['flops_added_pct']:.2f}% | "
                  f"{st['weight_bytes_added_pct']:.2f}% | {st['aligned_before']:.2f} -> {st['aligned_after']:.2f} |")


def static_cost(rep):
    added = rep["flops_padded_layers_after"] - rep["flops_padded_layers_before"]
    return {"padded_dims": len(rep["padded"]), "unaligned": len(rep["unaligned"]), "slice_nodes": rep["slice_nodes"],
            "stem": [s["choice"] for s in rep["stem"]],
            "flops_added_pct": 100 * added / rep["flops_model_before"] if rep["flops_model_before"] else 0.0,
            "weight_bytes_added_pct": 100 * rep["weight_bytes_added"] / rep["weight_bytes_before"]
            if rep["weight_bytes_before"] else 0.0,
            "aligned_before": rep["aligned_before"]["fraction"], "aligned_after": rep["aligned_after"]["fraction"],
            "layers": [f"{p['node']} {p['dim']} {p['old']}->{p['new']}" for p in rep["padded"]]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--multiple", type=int, default=8)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--backends", default=None, help="default: trt,ort-cuda when a GPU is present, else ort-cpu")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=1.0)
    ap.add_argument("--json", default=os.path.join(HERE, "results", "pad.json"))
    args = ap.parse_args(argv)
    from graphmp.model_runs import cuda_available
    backend = args.backends or ("trt,ort-cuda" if cuda_available() else "ort-cpu")
    batches = [int(b) for b in args.batch.split(",")]
    result = {"command": result_command(), "multiple": args.multiple, "backends": backend, "models": {}}
    if "ort-cpu" in backend:
        print("note: no GPU here: ONNX Runtime CPU computes FP16 ops in FP32 and has no Tensor Cores, so these "
              "numbers show the padding's overhead, not its gain.")
    with tempfile.TemporaryDirectory() as work:
        for name in args.models.split(","):
            src = MODELS[name]
            if callable(src):
                path = os.path.join(work, f"{name}.onnx")
                src(path)
                src = path
            if not os.path.exists(src):
                print(f"{name}: {src} is missing (see models/README.md); skipped")
                result["models"][name] = {"skipped": f"{src} missing"}
                continue
            paths, rep = variants(name, src, work, args.multiple)
            entry = {"static": static_cost(rep), "timing": {}}
            print(f"\n{name}: {entry['static']['padded_dims']} dims padded, +{entry['static']['flops_added_pct']:.2f}% "
                  f"FLOPs, +{entry['static']['weight_bytes_added_pct']:.2f}% weight bytes, weight layers aligned "
                  f"{entry['static']['aligned_before']:.2f} -> {entry['static']['aligned_after']:.2f}")
            entry["timing"] = time_variants(paths, backend, batches, DIMS.get(name, 16), args)
            entry["ratios"] = ratios(entry)
            result["models"][name] = entry
            if "environment" not in result:
                result["environment"] = next(iter(entry["timing"].values()))["environment"]
    print_table(result)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    write_json(args.json, result)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Export real transformer / CNN architectures (random, seeded weights) to FP32 ONNX.

Run with the export venv (torch 2.13 CPU + transformers + onnxscript + onnxruntime)::

    /work/venv-export/bin/python models/export_hf.py            # resnet50 bert-base vit-base gpt2
    /work/venv-export/bin/python models/export_hf.py --large    # gpt2-large (> 2 GB, external data)
    /work/venv-export/bin/python models/export_hf.py --tiny     # tiny versions -> models/tiny/
    /work/venv-export/bin/python models/export_hf.py --only bert-base --dest /tmp/x

Models are built from ``transformers`` configs; no weights are downloaded. Export uses
``torch.onnx.export(dynamo=True)`` at opset 20 (native LayerNormalization / Gelu) and falls
back to the TorchScript exporter (``dynamo=False``, opset 17) if that fails. Models under
2 GB are saved with weights inline; larger ones with ``<name>.onnx.data`` beside them.
Node metadata (stack traces with absolute paths) and doc strings are stripped so that
the files are reproducible.

Every export is verified: onnxruntime (CPU) runs it on generated inputs of a shape other
than the one used for tracing and the outputs are compared with PyTorch's. For the
transformer models the script also reports whether the float32-min attention-mask
constant (-3.4e38, an FP16 hazard) is present in the graph.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
TWO_GB = 2 * 1024**3
SEED = 0

# --------------------------------------------------------------------------- models


class _Wrap(torch.nn.Module):
    """Wrap an HF model: named tensor arguments in, a plain tensor (or tuple) out."""

    def __init__(self, model, output_keys):
        super().__init__()
        self.model = model
        self.output_keys = list(output_keys)

    def _out(self, out):
        res = tuple(out[k] for k in self.output_keys)
        return res if len(res) > 1 else res[0]


class _Bert(_Wrap):
    def forward(self, input_ids, attention_mask, token_type_ids):
        return self._out(self.model(input_ids=input_ids, attention_mask=attention_mask,
                                    token_type_ids=token_type_ids))


class _Gpt2(_Wrap):
    def forward(self, input_ids, attention_mask):
        return self._out(self.model(input_ids=input_ids, attention_mask=attention_mask))


class _Image(_Wrap):
    def forward(self, pixel_values):
        return self._out(self.model(pixel_values=pixel_values))


def _text_inputs(batch, seq, vocab, token_types=False, gen=None):
    ids = torch.randint(0, vocab, (batch, seq), generator=gen, dtype=torch.int64)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    if batch > 1 and seq > 3:
        mask[1, -2:] = 0  # padding in the second row: exercises the additive mask
    inputs = {"input_ids": ids, "attention_mask": mask}
    if token_types:
        tt = torch.zeros(batch, seq, dtype=torch.int64)
        tt[:, seq // 2:] = 1
        inputs["token_type_ids"] = tt
    return inputs


def _eager(cfg):
    # eager attention: explicit MatMul/Softmax with the additive float32-min mask (the
    # pattern most exported transformers carry), rather than a fused SDPA
    cfg._attn_implementation = "eager"
    return cfg


def build(name: str, tiny: bool):
    """Return (module, trace_inputs, check_inputs, dynamic axes, output names, meta)."""
    import transformers as tf  # noqa: PLC0415

    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED + 1)

    if name in ("bert-base", "bert"):
        if tiny:
            cfg = tf.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                                num_attention_heads=2, intermediate_size=128,
                                max_position_embeddings=128)
        else:
            cfg = tf.BertConfig()
        model = tf.BertModel(_eager(cfg))
        names = ["input_ids", "attention_mask", "token_type_ids"]
        outs = ["last_hidden_state", "pooler_output"]
        trace = _text_inputs(2, 8 if tiny else 16, cfg.vocab_size, True, gen)
        check = _text_inputs(3, 11 if tiny else 24, cfg.vocab_size, True, gen)
        dyn = {n: {0: "batch", 1: "sequence"} for n in names}
        arch = "BertModel"
    elif name in ("gpt2", "gpt2-large"):
        if tiny:
            # odd vocabulary (1001) on purpose: exercises padding of the LM head
            cfg = tf.GPT2Config(vocab_size=1001, n_embd=64, n_layer=2, n_head=2, n_positions=128,
                                bos_token_id=1000, eos_token_id=1000)
        elif name == "gpt2-large":
            cfg = tf.GPT2Config(n_embd=1280, n_layer=36, n_head=20)
        else:
            cfg = tf.GPT2Config()
        cfg.use_cache = False
        model = tf.GPT2LMHeadModel(_eager(cfg))
        names = ["input_ids", "attention_mask"]
        outs = ["logits"]
        trace = _text_inputs(2, 8 if tiny else 16, cfg.vocab_size, False, gen)
        check = _text_inputs(3, 11 if tiny else 24, cfg.vocab_size, False, gen)
        dyn = {n: {0: "batch", 1: "sequence"} for n in names}
        arch = "GPT2LMHeadModel"
    elif name in ("vit-base", "vit"):
        if tiny:
            cfg = tf.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=128, image_size=32, patch_size=8, num_labels=10)
        else:
            cfg = tf.ViTConfig(num_labels=1000)
        model = tf.ViTForImageClassification(_eager(cfg))
        names = ["pixel_values"]
        outs = ["logits"]
        s = cfg.image_size
        trace = {"pixel_values": torch.randn(2, 3, s, s, generator=gen)}
        check = {"pixel_values": torch.randn(3, 3, s, s, generator=gen)}
        dyn = {"pixel_values": {0: "batch"}}
        arch = "ViTForImageClassification"
    elif name in ("resnet50", "resnet"):
        if tiny:
            cfg = tf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                  layer_type="bottleneck", num_labels=10)
            s = 32
        else:
            cfg = tf.ResNetConfig(num_labels=1000)
            s = 224
        model = tf.ResNetForImageClassification(cfg)
        names = ["pixel_values"]
        outs = ["logits"]
        trace = {"pixel_values": torch.randn(2, 3, s, s, generator=gen)}
        check = {"pixel_values": torch.randn(1, 3, s, s, generator=gen)}
        dyn = {"pixel_values": {0: "batch"}}
        arch = "ResNetForImageClassification"
    else:
        raise ValueError(name)

    model.eval()
    if tiny and arch == "ResNetForImageClassification":
        # random init leaves BatchNorm at identity; give it real statistics so that
        # BatchNormalization nodes carry non-trivial mean/var (like a trained model)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.5, 0.5, generator=gen)
                    m.running_var.uniform_(0.5, 2.0, generator=gen)
    meta = {"arch": arch, "config": {k: v for k, v in cfg.to_diff_dict().items()
                                     if isinstance(v, (int, float, str, list, bool))}}
    wrapper = {"BertModel": _Bert, "GPT2LMHeadModel": _Gpt2}.get(arch, _Image)
    # eval() on the wrapper itself: the TorchScript exporter restores the *outer* module's
    # training flag recursively after export
    return wrapper(model, outs).eval(), trace, check, names, outs, dyn, meta


# --------------------------------------------------------------------------- export


def _strip_metadata(path: Path) -> dict:
    """Drop node metadata_props / doc_strings (absolute paths); keep external data refs."""
    import onnx  # noqa: PLC0415

    m = onnx.load(str(path), load_external_data=False)
    n = 0

    def walk(g):
        nonlocal n
        for node in g.node:
            if len(node.metadata_props) or node.doc_string:
                n += 1
            del node.metadata_props[:]
            node.doc_string = ""
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)
                for sg in a.graphs:
                    walk(sg)
        del g.metadata_props[:]
        g.doc_string = ""
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            del vi.metadata_props[:]
        for t in g.initializer:
            del t.metadata_props[:]

    walk(m.graph)
    del m.metadata_props[:]
    m.doc_string = ""
    for f in m.functions:
        for node in f.node:
            del node.metadata_props[:]
            node.doc_string = ""
        del f.metadata_props[:]
    onnx.save(m, str(path))
    opset = next((i.version for i in m.opset_import if i.domain in ("", "ai.onnx")), None)
    return {"opset": int(opset) if opset else None, "nodes": len(m.graph.node),
            "stripped_nodes": n}


def _param_bytes(module) -> int:
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def export_one(module, trace, names, outs, dyn, path: Path, large: bool, exporter="auto"):
    """Export with dynamo (opset 20), falling back to TorchScript (opset 17)."""
    args = tuple(trace[n] for n in names)
    for suffix in ("", ".data"):
        p = Path(str(path) + suffix)
        if p.exists():
            p.unlink()
    errors = []
    if exporter == "torchscript":
        errors.append("dynamo: not tried (--exporter torchscript)")
    else:
        try:
            t0 = time.time()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(
                    module, args, str(path), dynamo=True, opset_version=20,
                    input_names=names, output_names=outs,
                    dynamic_shapes={n: dyn.get(n) for n in names},
                    external_data=large, optimize=True, verify=False, report=False,
                )
            return {"exporter": "dynamo", "export_s": round(time.time() - t0, 1)}
        except Exception as exc:  # noqa: BLE001
            errors.append(f"dynamo: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            if exporter == "dynamo":
                raise
            print(f"  dynamo export failed, falling back to TorchScript: {errors[-1]}", flush=True)
    t0 = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module, args, str(path), dynamo=False, opset_version=17,
            input_names=names, output_names=outs,
            dynamic_axes={n: dict(d) for n, d in dyn.items()}, do_constant_folding=True,
        )
    return {"exporter": "torchscript", "export_s": round(time.time() - t0, 1),
            "dynamo_error": errors[0]}


def verify(path: Path, module, check, names, outs) -> dict:
    import onnxruntime as ort  # noqa: PLC0415

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    feeds = {n: check[n].numpy() for n in names}
    got = sess.run(None, feeds)
    with torch.no_grad():
        ref = module(*[check[n] for n in names])
    ref = ref if isinstance(ref, tuple) else (ref,)
    diffs = {o: float(np.max(np.abs(g - r.numpy()))) for o, g, r in zip(outs, got, ref)}
    scale = {o: float(np.max(np.abs(r.numpy()))) for o, r in zip(outs, ref)}
    return {"max_abs_diff": diffs, "ref_max_abs": scale,
            "check_shapes": {n: list(check[n].shape) for n in names}}


def mask_constant(path: Path) -> dict:
    """Look for float32-min-like constants (|x| >= 1e38) in initializers and Constant nodes."""
    import onnx  # noqa: PLC0415
    from onnx import numpy_helper  # noqa: PLC0415

    m = onnx.load(str(path), load_external_data=False)
    hits = []

    def check(name, t):
        if t.data_type != onnx.TensorProto.FLOAT or t.data_location == onnx.TensorProto.EXTERNAL:
            return
        if int(np.prod(t.dims)) > 16:
            return
        a = numpy_helper.to_array(t)
        big = a[np.abs(a) >= 1e38]
        if big.size:
            hits.append({"name": name, "value": float(big.flat[0])})

    for t in m.graph.initializer:
        check(t.name, t)
    for node in m.graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    check(node.output[0], a.t)
    return {"present": bool(hits), "count": len(hits), "examples": hits[:3]}


def run(name: str, tiny: bool, dest: Path, large: bool, exporter: str = "auto") -> dict:
    t_all = time.time()
    module, trace, check, names, outs, dyn, meta = build(name, tiny)
    nbytes = _param_bytes(module)
    external = nbytes >= TWO_GB - 64 * 1024**2 or large
    out_name = f"{name}-ts" if exporter == "torchscript" else name
    path = dest / f"{out_name}.onnx"
    print(f"[{name}] {meta['arch']}: {nbytes / 1e6:.1f} MB of weights, "
          f"{'external data' if external else 'inline weights'} -> {path}", flush=True)
    info = export_one(module, trace, names, outs, dyn, path, external, exporter)
    info.update(_strip_metadata(path))
    size = path.stat().st_size
    data = Path(str(path) + ".data")
    if data.exists():
        size += data.stat().st_size
    info["size"] = size
    info["external_data"] = data.name if data.exists() else None
    print(f"[{name}] exported with {info['exporter']} in {info['export_s']}s: opset "
          f"{info['opset']}, {info['nodes']} nodes, {size / 1e6:.1f} MB", flush=True)
    v = verify(path, module, check, names, outs)
    info.update(v)
    diffs = ", ".join(f"{k}={d:.3g} (|ref|max {v['ref_max_abs'][k]:.3g})"
                      for k, d in v["max_abs_diff"].items())
    print(f"[{name}] onnxruntime vs torch on {v['check_shapes']}: max abs diff {diffs}",
          flush=True)
    bad = [k for k, d in v["max_abs_diff"].items()
           if not d <= 1e-3 * max(1.0, v["ref_max_abs"][k])]
    info["verified"] = not bad
    if bad:
        raise RuntimeError(f"verification failed for {out_name}: {bad} differ from torch")
    if meta["arch"] in ("BertModel", "GPT2LMHeadModel"):
        info["mask_constant"] = mask_constant(path)
        mc = info["mask_constant"]
        print(f"[{name}] float32-min attention-mask constant present: {mc['present']} "
              f"({mc['count']} tensors, e.g. {mc['examples'][:1]})", flush=True)
    info["total_s"] = round(time.time() - t_all, 1)
    info["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(f"[{name}] done in {info['total_s']}s, process peak RSS so far "
          f"{info['peak_rss_mb']} MB", flush=True)
    del module
    return {"name": out_name, "path": str(path.relative_to(REPO)) if path.is_relative_to(REPO)
            else str(path), **meta, **info}


BASE = ["resnet50", "bert-base", "vit-base", "gpt2"]
TINY = ["resnet", "bert", "vit", "gpt2"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", metavar="NAME",
                    help=f"export only this model (repeatable): {BASE + ['gpt2-large']} "
                         f"or, with --tiny, {TINY}")
    ap.add_argument("--dest", help="output folder (default models/build, or models/tiny with --tiny)")
    ap.add_argument("--large", action="store_true", help="export gpt2-large (3.1 GB, external data)")
    ap.add_argument("--tiny", action="store_true", help="export the tiny committed test models")
    ap.add_argument("--exporter", choices=["auto", "dynamo", "torchscript"], default="auto",
                    help="auto: dynamo, TorchScript on failure; torchscript writes <name>-ts.onnx")
    args = ap.parse_args(argv)

    torch.manual_seed(SEED)
    np.random.seed(SEED)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    if args.tiny:
        names, default_dest = TINY, REPO / "models" / "tiny"
    elif args.large:
        names, default_dest = ["gpt2-large"], REPO / "models" / "build"
    else:
        names, default_dest = BASE, REPO / "models" / "build"
    if args.only:
        names = [n.strip() for o in args.only for n in o.split(",") if n.strip()]
    dest = Path(args.dest).resolve() if args.dest else default_dest
    dest.mkdir(parents=True, exist_ok=True)

    results, failed = [], []
    for n in names:
        try:
            results.append(run(n, args.tiny, dest, large=(n == "gpt2-large"),
                               exporter=args.exporter))
        except Exception as exc:  # noqa: BLE001
            import traceback  # noqa: PLC0415
            traceback.print_exc()
            failed.append(n)
            print(f"[{n}] FAILED: {type(exc).__name__}: {exc}", flush=True)

    # merge into <dest>/EXPORTS.json (one entry per model name)
    report = dest / "EXPORTS.json"
    old = json.loads(report.read_text()) if report.exists() else {}
    old.setdefault("models", {})
    old["torch"] = torch.__version__
    import transformers  # noqa: PLC0415
    old["transformers"] = transformers.__version__
    for r in results:
        r = {k: v for k, v in r.items() if k not in ("export_s", "total_s", "peak_rss_mb")} \
            if args.tiny else r  # keep the committed tiny report free of timings
        old["models"][r["name"]] = r
    report.write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")
    print(f"done: {len(results)} ok, {len(failed)} failed {failed or ''}; report {report}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

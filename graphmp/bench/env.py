"""The environment of a bench run: what two runs must share to be compared."""
from __future__ import annotations

import glob
import importlib.metadata
import os
import platform
import re
import sys
from datetime import datetime, timezone

import numpy as np
import onnx

from ..version import __version__



def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _dist_version(*names):
    for n in names:
        try:
            return importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def gpu_names() -> list:
    """NVIDIA GPU names from the driver's /proc files (no CUDA call, no nvidia-smi)."""
    names = []
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        m = re.search(r"^Model:\s*(.+)$", _read(info), re.M)
        if m:
            names.append(m.group(1).strip())
    if not names and "torch" in sys.modules:
        torch = sys.modules["torch"]
        try:
            if torch.cuda.is_available():
                names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        except Exception:
            pass
    return names


def environment(command: str) -> dict:
    """What two runs must share to be compared: device, driver and library versions, command."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), None) or platform.processor() or None
    gpus = gpu_names()
    m = re.search(r"Kernel Module(?: for \S+)?\s+([\d.]+)", _read("/proc/driver/nvidia/version"))
    cuda, cudnn = {}, {}
    try:
        from onnxruntime.capi import build_and_package_info as b
        if getattr(b, "cuda_version", None):
            cuda["onnxruntime build"] = b.cuda_version
        if getattr(b, "cudnn_version", None):
            cudnn["onnxruntime build"] = b.cudnn_version
    except Exception:
        pass
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        if getattr(torch.version, "cuda", None):
            cuda["torch build"] = torch.version.cuda
            try:
                cudnn["torch"] = str(torch.backends.cudnn.version())
            except Exception:
                pass
    import onnxruntime as ort
    return {
        "device": gpus[0] if gpus else f"{cpu or 'unknown CPU'} (no NVIDIA GPU found)",
        "gpus": gpus, "cpu": cpu, "cpu_count": os.cpu_count(),
        "driver": m.group(1) if m else None, "cuda": cuda or None, "cudnn": cudnn or None,
        "tensorrt": _dist_version("tensorrt", "tensorrt-cu13", "tensorrt-cu12", "tensorrt-cu11"),
        "onnxruntime": ort.__version__,
        "onnxruntime_package": next((p for p in ("onnxruntime-gpu", "onnxruntime") if _dist_version(p)), None),
        "onnx": onnx.__version__, "numpy": np.__version__, "torch": _dist_version("torch"),
        "onnxconverter_common": _dist_version("onnxconverter-common"), "graphmp": __version__,
        "python": platform.python_version(), "platform": platform.platform(),
        "command": command, "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }

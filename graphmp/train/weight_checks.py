"""Checks of the weights a step graph will train, made while build_step selects them
(step.py): warnings that go into train.json, and the refusal of integer weights.

Both take build_step's source (`s`: path, values) and forward (`f`: model, weights,
warnings) records.
"""
from __future__ import annotations

import numpy as np

from ..errors import GraphmpError
from . import source


# AdamW moves every element by about lr a step whatever its gradient: above this fraction of a
# weight matrix's RMS, one step reshapes it (1e-3 is the usual fraction: lr 1e-3 on weights ~1)
ADAMW_STEP_OF_RMS = 0.25


def small_weight_warning(s, f, cfg: dict) -> None:
    """A train.json warning (train-graph prints it) when AdamW's lr is large beside the RMS of
    a trainable weight matrix (ndim >= 2; zero tensors, a fresh init, do not count): a fixed
    DSP front end (openwakeword's mel filterbank, RMS 1e-3, 97% zeros) is pushed negative
    under its Log in one step at lr 1e-3, its bins die at the Clip floor and the loss jumps
    100x. It names the --lr that gives steps of 1e-3 of that RMS."""
    if cfg["optimizer"] != "adamw":
        return
    lr = float(cfg["lr"])
    rms = {w: float(np.sqrt(np.mean(np.square(s.values[w], dtype=np.float64)))) for w in f.weights
           if s.values[w].ndim >= 2}
    small = sorted((r, w) for w, r in rms.items() if 0 < r and lr > ADAMW_STEP_OF_RMS * r)
    if not small:
        return
    r, w = small[0]
    more = f" (and {len(small) - 1} more)" if len(small) > 1 else ""
    f.warnings.append(f"{s.path}: weight '{w}'{more} has RMS {r:.2g}, small beside lr {lr:g}: AdamW moves every "
                      f"element by about lr a step ({lr / r:.0%} of its RMS), which can make the loss jump rather "
                      f"than fall; give --lr {1e-3 * r:.0e} (1e-3 of that RMS), or leave it out of --trainable")


def refuse_frozen_int8(s, f, deps: set, trainable: str | None) -> None:
    """Weight-only INT8 (or other integer) matrices behind DequantizeLinear cannot be trained.
    Without --trainable that is a refusal: training only the float tensors around them
    (biases, norms) is not what a user asking to train the model expects. With --trainable
    it is a warning that they stay frozen."""
    q = source.quantized_weights(f.model, deps)
    if not q:
        return
    what = f"{len(q)} weight(s) are stored as integers behind DequantizeLinear (e.g. '{q[0][0]}' -> '{q[0][1]}')"
    if trainable is None:
        raise GraphmpError(f"{s.path}: {what} and cannot be trained; train the FP32 model it was quantized from "
                           "(and quantize again), or pass --trainable REGEX to train only the float tensors it "
                           "names, the integer weights frozen.")
    f.warnings.append(f"{s.path}: {what}; they stay frozen (only the float tensors --trainable names train)")

"""graphmp.train: loss-scaled mixed-precision training graphs made of standard ONNX ops.

    config.py     StepConfig / TrainConfig: the options of build_step() and train(), checked by from_kwargs
    step.py       build_step(): forward + loss + backward + loss scaling + optimizer = one step graph, in phases
    weight_checks.py  checks of the weights build_step() selects (AdamW lr vs small weights, integer weights)
    builder.py    graph-building helpers shared by step/losses/optim/source (unique names, pruning, lifting)
    source.py     the source model before the step: Constant weights lifted, tied/shared/frozen params reported
    rnn.py        decompose_recurrent(): LSTM/GRU unrolled into primitive ops that have gradient rules
    removed_ops.py  rewrite_experimental(): ImageScaler/Crop/Affine/... (gone from ONNX) as standard ops
    measure.py    declare_measured(): tensor ranks/dims onnx inference loses, measured in ONNX Runtime
    losses.py     add_loss(): cross-entropy (torch's semantics: class axis, ignore index, smoothing, weights) or MSE
    optim.py      the update as ONNX nodes: finite check, clipping, lr schedule, grad accumulation, SGD/AdamW, loss scale
    lower.py      lower_forward_convs(): a step's wide convs on small maps as one Gemm over the batch
    update.py     add_update(): the update phase over flat buffers (one finite check, one select, the optimizer)
    flat.py       flat state buffers: the packing table, pack()/unpack()/next_state(), the weights' views in the graph
    step_cost.py  precision_cost(): the FP16 share of a step's GEMM FLOPs and its Cast bytes (train.json)
    shape_values.py  Reshape lengths computed from shapes (d // h) that onnx's inference leaves open
    autodiff.py   add_backward(): gradient nodes for a forward graph, dtype by dtype
    emitter.py    the node Emitter rules are written with, and the rule registry (RULES, ZERO_GRAD, NEEDS_OPSET)
    rules/        one gradient rule per ONNX op, a module per family (docs/training_ops.md lists them);
                  rules/conv_gemm.py writes convolution weight gradients as GEMMs
    loop.py       train() / export(): run the step graph on ONNX Runtime, checkpoints, eval, summary
    first_step.py FirstStepSearch: a dynamic loss scale backs off within the run's first step
    runner.py     StepRunner: one step per call, state packed into the flat buffers, fixed bindings on CUDA
    data.py       training/eval data: .npz or batch iterables, batching, label and NaN/inf checks before use
    device.py     which ONNX Runtime providers a run asks for, and a check that it got them
    cuda_kernels.py  ORT CUDA kernel table for the step graphs' ops; nodes_without_kernel() (docs/cuda_kernels.md)
    plot.py       write_loss_png(): run/loss.png with matplotlib; without it run/loss.csv and a hint
    runfiles.py   a run folder's files: names from its JSON checked, corrupt files and write errors as one line
    runlock.py    run_lock(): one process per run folder (flock on RUN/.graphmp.lock) for train and export
    evaluator.py  the inference graph with the current weights; eval loss/accuracy
    ort_checks.py ONNX Runtime runs while a step is built (calibration batch, the step graph loads and runs)
    split.py      split_step(): a fused step (expose_grads) cut into a gradient graph and an update graph

    from graphmp.train import StepConfig, TrainConfig, build_step, train
    build_step("model.onnx", "run", StepConfig.from_kwargs(optimizer="sgd", lr=0.1))   # or the same keywords
    train("run", "train.npz", TrainConfig.from_kwargs(epochs=3), eval_data="eval.npz")

The package itself is callable as loop.train, so that the top-level API reads
graphmp.train("run", "train.npz", epochs=3) while graphmp.train.step & co stay importable.
The public names are imported on first use (PEP 562), as graphmp's are.
"""
from __future__ import annotations

import importlib
import sys
import types

_LAZY = {"StepConfig": ".config", "TrainConfig": ".config", "build_step": ".step", "train": ".loop",
         "export": ".loop", "evaluate": ".loop"}

__all__ = sorted(_LAZY)


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'graphmp.train' has no attribute '{name}'")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


class _CallablePackage(types.ModuleType):
    """graphmp.train(...) is graphmp.train.loop.train(...) (see the module docstring)."""

    def __call__(self, run_dir, data, config=None, **options):
        from .loop import train
        return train(run_dir, data, config, **options)


sys.modules[__name__].__class__ = _CallablePackage

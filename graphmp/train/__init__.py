"""graphmp.train: loss-scaled mixed-precision training graphs made of standard ONNX ops.

    autodiff.py   add_backward(): gradient nodes for a forward graph (rules/: one rule per op,
                  registered through emitter.py; docs/training_ops.md lists them)
    step.py       build_step(): forward + loss + backward + loss scaling + optimizer = one step graph
    loop.py       train() / export(): run the step graph on ONNX Runtime, checkpoints, eval
"""

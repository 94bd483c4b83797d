#!/usr/bin/env python
"""Held-out check of graphmp's training step: models the repo's tests never use, exported from
torch, built as steps (FP32 and mixed) through the public API, run next to torch eager FP32
from the same weights (AdamW lr 1e-3) on the CPU.

    python benchmarks/train_heldout.py [--models resnet34,resnext,tagger]
        [--steps 5] [--rounds 3] [--threads 1] [--json benchmarks/results/train_heldout.json] [--tiny]

Models:
  resnet34  torchvision-layout ResNet-34 (BasicBlock 3-4-6-3), batch 4 of 3x64x64, 100 classes
  resnext   ResNeXt blocks 32x4d (grouped 3x3 convs, strided in the block, 1x1 shortcuts),
            one block per stage, batch 4 of 3x64x64, 100 classes
  tagger    nn.Embedding(1000, 128) + nn.TransformerEncoder (2 pre-LN layers, 4 heads, FFN 512,
            GELU, batch_first) + a Linear head per token (9 classes): int64 tokens [8, 64] in,
            cross-entropy over every token (class axis -1)
--tiny: the same models at toy size (checks the script; nothing to read in its numbers).

Per model and precision the JSON says:
- loss agreement: the losses of --steps + 1 steps carrying the state on, each on a new random
  batch (seeds 0, 1, ...; the loss of step k+1 is the loss of the weights after k updates, on
  batch k), graphmp vs torch; `after_1` and `after_N` are
  the relative differences after 1 and N updates, `agree` whether both are within the
  tolerance (FP32 1e-3; mixed 2e-2, FP16 forward) or within 10x of torch's own drift from
  weights perturbed by 1e-6 (`torch_noise_after_k`: AdamW's first steps move a weight whose
  gradient is near zero by +-lr, whichever sign rounding gives it, so on ResNet-34 torch
  against itself from weights 1e-6 apart already differs by 5e-3 after 1 step and 8e-3 after
  5); `skipped` counts graphmp's steps skipped by
  the dynamic loss scale (mixed starts at scale 65536, and the first steps of a CNN overflow,
  as they do under torch's GradScaler): torch's reference run skips the same steps (gradients
  computed, no optimizer step), so the losses stay comparable;
- step time: the interleaved protocol of benchmarks/train_cpu.py (each timed step AdamW's first
  from the initial state), median/min/max ms of each engine, and graphmp / torch.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import train_interleave as ti  # noqa: E402
import train_nets  # noqa: E402

LOSS_RTOL = {"fp32": 1e-3, "mixed": 2e-2}
# torch against itself from weights perturbed by this (relative, ~10 float32 roundings): how far
# float rounding alone moves the losses over the steps; graphmp may drift NOISE_FACTOR times as far
NOISE_REL, NOISE_FACTOR = 1e-6, 10.0
PRECISIONS = ("fp32", "mixed")


def models(tiny: bool = False) -> dict:
    """name -> {make, x, classes, vocab (token models), build (extra step options), what}."""
    if tiny:
        return {
            "resnet34": dict(make=lambda: train_nets.resnet("basic", (1, 1, 1, 1), width=4, classes=10),
                             x=(4, 3, 64, 64), classes=10, what="toy ResNet-34 layout"),
            "resnext": dict(make=lambda: train_nets.resnet("bottleneck", (1, 1, 1, 1), width=8, classes=10,
                                                           groups=4, width_per_group=32),
                            x=(4, 3, 64, 64), classes=10, what="toy ResNeXt blocks (4 groups)"),
            "tagger": dict(make=lambda: train_nets.token_tagger(50, 16, 2, 1, 32, 5), x=(2, 8), classes=5, vocab=50,
                           build=dict(class_axis=-1), what="toy Embedding + TransformerEncoder tagger")}
    return {
        "resnet34": dict(make=lambda: train_nets.resnet("basic", (3, 4, 6, 3), classes=100), x=(4, 3, 64, 64),
                         classes=100, what="ResNet-34 (torchvision layout), batch 4 of 3x64x64, 100 classes"),
        "resnext": dict(make=lambda: train_nets.resnet("bottleneck", (1, 1, 1, 1), classes=100, groups=32,
                                                       width_per_group=4),
                        x=(4, 3, 64, 64), classes=100,
                        what="ResNeXt 32x4d blocks, one per stage, batch 4 of 3x64x64, 100 classes"),
        "tagger": dict(make=lambda: train_nets.token_tagger(1000, 128, 4, 2, 512, 9), x=(8, 64), classes=9,
                       vocab=1000, build=dict(class_axis=-1),
                       what="Embedding + TransformerEncoder (2 pre-LN layers, d 128) + token head, 8 x 64 tokens"),
    }


def loss_agreement(torch_losses: list, graphmp_losses: list, skipped: int, precision: str,
                   noise_losses: list | None = None) -> dict:
    """Relative loss differences after 1 and after N steps, and whether they agree: within
    LOSS_RTOL, or within NOISE_FACTOR x torch's own drift from rounding-sized noise
    (`noise_losses`: torch's losses from perturbed weights; module docstring)."""
    n = len(torch_losses) - 1
    out = {"initial": round(ti.rel_diff(graphmp_losses[0], torch_losses[0]), 6), "tolerance": LOSS_RTOL[precision],
           "skipped": skipped, "agree": True}
    for k in (1, n):
        diff = ti.rel_diff(graphmp_losses[k], torch_losses[k])
        noise = ti.rel_diff(noise_losses[k], torch_losses[k]) if noise_losses else 0.0
        out[f"after_{k}"], out[f"torch_noise_after_{k}"] = round(diff, 6), round(noise, 6)
        out["agree"] = out["agree"] and bool(diff <= max(LOSS_RTOL[precision], NOISE_FACTOR * noise))
    out["graphmp_losses"] = [round(x, 6) for x in graphmp_losses]
    return out


def check_model(name: str, spec: dict, work: str, args) -> dict:
    """Export, build FP32 and mixed, compare the losses over args.steps updates, time the step."""
    import torch
    torch.manual_seed(0)
    module = spec["make"]()
    batch = train_nets.make_batch(spec)
    path = train_nets.export(module, batch, os.path.join(work, f"{name}.onnx"))
    token = bool(spec.get("vocab"))
    engines = {"torch-fp32": ti.torch_engine(module, batch, args.threads, token_classes=token)}
    out = {"what": spec["what"], "input_shape": list(spec["x"]), "build_s": {}, "losses": {}}
    for prec in PRECISIONS:
        run = os.path.join(work, f"{name}-{prec}")
        try:
            _, out["build_s"][prec] = ti.build(path, run, prec, **spec.get("build", {}))
        except Exception as e:  # noqa: BLE001  (a held-out model that does not build is the finding)
            out.setdefault("errors", {})[prec] = f"{type(e).__name__}: {e}"[:500]
            continue
        engines[f"graphmp-{prec}"] = ti.graphmp_engine(run, batch, args.threads)
    # a new batch every step: on one fixed batch of 4 a ResNet's loss falls to ~1e-3 within two
    # steps, where relative differences measure nothing
    feeds = [train_nets.make_batch(spec, seed=k) for k in range(args.steps + 1)]
    out["torch_losses"] = {}
    for prec in PRECISIONS:
        e = engines.get(f"graphmp-{prec}")
        if e is None:
            continue
        losses, applied = ti.carried_steps(e, feeds)
        # torch replays the steps graphmp's loss scale skipped (GradScaler would skip them too)
        ref, _ = ti.carried_steps(engines["torch-fp32"], feeds, applied)
        noisy, _ = ti.carried_steps(engines["torch-fp32"], feeds, applied, perturb=NOISE_REL)
        out["torch_losses"][prec] = [round(x, 6) for x in ref]
        out["losses"][prec] = loss_agreement(ref, losses, applied[:args.steps].count(False), prec, noisy)
    for prec in PRECISIONS if args.before else ():  # the same steps as an older checkout built them, timed alike
        engines[f"graphmp-{prec}-before"] = ti.graphmp_engine(os.path.join(args.before, f"{name}-{prec}"), batch,
                                                             args.threads, **ti.before_engine_kw(args))
    timed = ti.interleave(engines, args.rounds, args.warmup)
    out["rows"] = {k: ti.row(v) for k, v in timed.items()}
    t = out["rows"]["torch-fp32"]["median_ms"]
    out["ratios"] = {f"graphmp_{p}_vs_torch": round(out["rows"][f"graphmp-{p}"]["median_ms"] / t, 3)
                     for p in PRECISIONS if f"graphmp-{p}" in out["rows"]}
    out["ratios"].update({f"graphmp_{p}_before_vs_torch": round(out["rows"][f"graphmp-{p}-before"]["median_ms"] / t, 3)
                          for p in PRECISIONS if f"graphmp-{p}-before" in out["rows"]})
    out["build_s"] = {k: round(v, 1) for k, v in out["build_s"].items()}
    return out


def print_model(name: str, res: dict, steps: int) -> None:
    for prec, a in res["losses"].items():
        print(f"{name} {prec}: loss rel diff vs torch after 1 {a['after_1']:.2e}, after {steps} "
              f"{a[f'after_{steps}']:.2e} (tol {a['tolerance']}, skipped {a['skipped']}, agree {a['agree']}); "
              f"step {res['rows'][f'graphmp-{prec}']['median_ms']:.1f} ms = "
              f"{res['ratios'][f'graphmp_{prec}_vs_torch']:.2f}x torch "
              f"({res['rows']['torch-fp32']['median_ms']:.1f} ms)", flush=True)
    for prec in PRECISIONS:
        if f"graphmp_{prec}_before_vs_torch" in res["ratios"]:
            print(f"{name} {prec} before: {res['rows'][f'graphmp-{prec}-before']['median_ms']:.1f} ms = "
                  f"{res['ratios'][f'graphmp_{prec}_before_vs_torch']:.2f}x torch", flush=True)
    for prec, err in res.get("errors", {}).items():
        print(f"{name} {prec}: FAILED {err}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet34,resnext,tagger")
    ap.add_argument("--steps", type=int, default=5, help="updates in the loss-agreement run")
    ti.add_run_args(ap, os.path.join(HERE, "results", "train_heldout.json"), "model")
    args = ap.parse_args(argv)
    env = ti.enter_protocol_env(args.threads, reexec=argv is None)
    specs = models(args.tiny)
    names = ti.chosen(ap, args.models, specs, "model")
    work = ti.work_dir(args, "graphmp-train-heldout-")
    out = {"schema": "train_heldout/1", "host": platform.node(), **ti.versions(), "threads": args.threads, "env": env,
           "steps": args.steps, "rounds": args.rounds, "tiny": args.tiny,
           "optimizer": f"AdamW lr {ti.LR}, weight decay 0, both engines", "work": work,
           "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "models": {}}
    for name in names:
        out["models"][name] = check_model(name, specs[name], work, args)
        print_model(name, out["models"][name], args.steps)
        gc.collect()
    failed = [n for n, r in out["models"].items() if r.get("errors") or any(
        a["agree"] is False for a in r["losses"].values())]
    out["failed"] = failed
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json}" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

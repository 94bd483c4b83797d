"""graphmp.bench: how much faster mixed FP16 is than FP32 and TF32, and what it costs in accuracy.

    res = graphmp.bench("model.onnx", backends="ort-cpu", batches=(1, 8))
    print(res.table()); res.write_json("bench.json"); res.plot("bench.png")

One run (run.py) builds the compared models (models.py), plans the rows (plan.py: backend x
precision x batch x session-option variant), opens and times them behind one runner
interface (runners.py), judges their accuracy (judge.py) and writes the report (report.py):

- backends: `trt` (TensorRT engine, strongly typed, graphmp/trt.py), `ort-cuda` (ONNX
  Runtime CUDA EP, inputs and outputs bound on the device with I/O binding), `ort-cpu`.
- precisions: `fp32` = the FP32 baseline with TF32 off (strict FP32), `tf32` = the same
  with TF32 on (the default of TensorRT and ORT CUDA), `fp16` = the graphmp-converted
  model, `occ` = onnxconverter-common (--compare occ), `ort-opt` = ONNX Runtime's
  transformers optimizer, fused and float16 (--compare ort-opt). The FP32 baseline is the
  source through graphmp's pipeline with no precision change, so it has the same graph
  cleanups as the converted model and a speedup is precision alone.
- variants (ORT CUDA only): `default`, `nhwc` (prefer_nhwc=1), `cuda-graph`
  (enable_cuda_graph=1, static shapes only); `fastest` names the best per precision.
  Speedups compare rows of the same backend, batch and variant.
- provider: every ORT session's get_providers() is read back; a row runs only on what was
  asked. An ort-cuda session that came up on the CPU fails its row (error says what ran,
  `provider` names it) and the backend is marked `fell-back`: no CPU time under a CUDA label.
- timing ("host-sync", the same for every backend): host wall time around one synchronized
  run; `warmup` untimed runs, then `rounds` interleaved rounds until every row has
  `iterations` runs and `min_time` seconds. median / p90 / p99; throughput = batch / median.
- accuracy: per output, max|a-b|/max|ref| (`error`), max abs, cosine, SNR and argmax
  agreement, vs ONNX Runtime CPU on the FP32 source with the same inputs. The TF32 error
  is the yardstick: in tolerance = no new inf/NaN and error <= max(max_error, tf32_factor x
  TF32 error, tf32_factor x FP16-input floor) per output (the TF32 row of the same
  backend/batch/variant, else TF32 emulated on ORT CPU; the floor: the FP32 source on ORT
  CPU with only its inputs rounded to FP16), as graphmp check judges. The FP16-faithful
  oracle (graphmp.check, on the CPU, one sample) also checks the mixed models (fp16, occ)
  whose FP32 weights are at most `oracle_max_mb` (`oracle`).
- memory: GPU rows: device memory in use after warm-up minus before the session/engine.
- any source (source.py): the source's precision is detected (fp32, fp16, bf16, mixed,
  int8 qdq / dynamic / qoperator, no float) and rows that are not what their precision
  name says are labelled for what they run (`label`, `model`). An FP16/BF16/mixed source:
  the fp32/tf32 rows run it with every node raised to FP32 by graphmp, and that model is
  the accuracy reference; an INT8 source: the fp32/tf32 rows run it as it is (behind the
  cleanups) and the reference is the source itself (no FP32 model exists). Where graphmp
  converts nothing, the fp16 rows run the source as it is ("source (fp16)", model
  "converted: nothing to convert, same as source"). An ORT CPU row of the reference model
  itself is not judged (accuracy null, `accuracy_note` says why), nor is the oracle run.

JSON schema (schema_version 2; `BenchResult.to_dict()`, `graphmp bench --json`):
    schema_version: 2
    timing: "host-sync"
    environment: {device, gpus, cpu, cpu_count, driver, cuda, cudnn, tensorrt, onnxruntime,
                  onnxruntime_package, onnx, numpy, torch, onnxconverter_common, graphmp, python,
                  platform, command, timestamp}                      (null where not available)
    settings: {backends, precisions, compare, compare_occ, batches, data, shapes, inputs, seed,
               warmup, iterations, min_time_s, rounds, cudnn_conv_algo_search, timing_cache,
               workspace_mb, max_error, tf32_factor, atol, rtol, rule, oracle_max_mb, model_type,
               timing, timing_text}
    model: {path, source_precision: {precision, float_nodes, quantization, quant_ops},
            fp32_baseline: {path, how, prepare, nodes_low, casts_added}|null, converted_path (null when the
            fp16 rows run the source), conversion (+ nothing_converted: why, where graphmp converted
            nothing), compared: {occ|ort-opt: {path, ...}|{error}}, kept_in, fp32_available, weight_bytes,
            inputs: [{name, dtype, shape}], fixed_batch}
    backends: {name: {status: "ok"|"skipped"|"fell-back", reason}}
    rows: [{backend, precision, variant, label, model, batch, provider, tf32, status: "ok"|"failed",
            error, settings: {provider, ..., timing, model_file}, latency_ms: {median, p90, p99, mean, min, max}|null,
            iterations, throughput_per_s, speedup_vs_fp32, speedup_vs_tf32, speedup_noisy (the ratio compares a
            median whose p90/p99 spread is too wide: bench.rows.noisy), peak_device_memory_bytes,
            memory_note, engine_bytes, build_s, output_shapes, accuracy_note (only where not judged),
            accuracy: {reference, passed, error, max_abs, cosine, snr_db, argmax_agree, nonfinite,
                       tf32_error, vs_tf32, yardstick, outputs: {name: {error, max_abs, cosine, snr_db,
                       argmax_agree, nonfinite, shape_mismatch, tf32_error, input_floor, allowed,
                       vs_tf32, passed}}}|null}]
    fastest: [{backend, batch, precision, variant, median_ms, by_variant: {variant: ms}}]
    accuracy: {reference, rule, max_error, tf32_factor, yardsticks: [{batch, source, errors, input_floor}]}
    oracle: [{precision, batch, status, reason, oracle, passed, max_abs, max_rel, argmax_agree, nonfinite}]
    notes: [str]
    partial: false, or true when Ctrl-C stopped the run: `rows` holds only the rows that finished
    interrupted: null, or which row was cut and how far it got (the table's PARTIAL line)
Non-finite numbers are written as null. Ctrl-C during the rows raises BenchInterrupted (a
KeyboardInterrupt) whose `result` holds the finished rows ("partial": true).
"""
from .env import environment, gpu_names
from .judge import judge_outputs, output_metrics, rule_text
from .models import convert_occ, convert_ort_opt, fp32_baseline, guess_model_type
from .plan import BACKENDS, LABELS, PRECISIONS, VARIANTS, RowSpec, plan_rows, static_shapes
from .report import BenchResult
from .source import source_precision
from .run import SCHEMA_VERSION, BenchInterrupted, Settings, bench
from .runners import (TIMING, FellBack, OrtRunner, TrtRunner, device_memory_used, latency_stats,
                      ort_cuda_status, timed_loop, trt_status)

# the names benchmarks/*.py used before the split
_ort_cuda_status, _trt_status = ort_cuda_status, trt_status

__all__ = ["bench", "BenchResult", "BenchInterrupted", "Settings", "SCHEMA_VERSION", "BACKENDS", "PRECISIONS", "VARIANTS", "LABELS",
           "RowSpec", "plan_rows", "static_shapes", "judge_outputs", "output_metrics", "rule_text", "OrtRunner",
           "TrtRunner", "FellBack", "TIMING", "timed_loop", "latency_stats", "device_memory_used", "environment",
           "gpu_names", "convert_occ", "convert_ort_opt", "fp32_baseline", "guess_model_type", "ort_cuda_status",
           "trt_status", "source_precision"]

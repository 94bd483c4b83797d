"""StepRunner: one run of step.onnx per batch, on the session train() made for it.

Two paths, the same steps (tests/test_train.py, tests/test_train_session.py check them bit for bit):
- plain (device_state=False): session.run with the state as numpy arrays, fed and fetched each step;
- bound (the default, CPU and CUDA): the state stays in OrtValues on the session's device, in
  two sets used in turn (the outputs of step k are the inputs of step k+1), so no step
  allocates (and on the CPU page-faults) fresh state buffers: ResNet-18 (1 thread, steps
  carried one after another) 99.7 -> 94.7 ms, ResNet-50 270.4 -> 260.7 ms against the plain
  path. Both
  IOBindings are built once (_Bindings): set 0 -> set 1 and set 1 -> set 0, with the loss and
  the finite flag bound to fixed OrtValues. A step copies the batch into device OrtValues of its
  shape (OrtValue.update_inplace: made again only when the batch's shape or dtype changes),
  runs, and reads the loss, the flag and the loss scale: no per-step binding.
- --cuda-graph (cuda_graph=True, CUDA only): the bound path with enable_cuda_graph=1 and one
  captured graph per binding set (run option gpu_graph_id 1 and 2), on the step graph with its
  batch axis pinned to the batch size (device.pin_dims: no shape arithmetic left for the host). ONNX Runtime replays a
  captured graph without looking at the feeds, so every input and output stays at the address
  it was captured with: the loss and flag live on the device too, and a batch of another shape
  is an error (the pinned step graph takes one shape anyway).
The session's provider options come from the step graph (device.step_providers); what the
session got (get_provider_options) is kept in provider_options for the summary. A CPU session
runs the update's elementwise chain in cache-sized blocks (blocks.block_update, the same bits):
the state buffers it reads and writes are then fed and held as rows [N / C, C] (self.rows),
views of the same values, and state_numpy() gives them back per tensor as always.
"""
from __future__ import annotations

import numpy as np

from ..errors import GraphmpError, first_line
from ..session import CUDA, ran_on
from .blocks import for_session
from .data import run_failure
from .device import batch_dims, cuda_graph_blockers, pin_dims, step_providers
from .flat import graph_state_names, pack, unpack
from .runfiles import REBUILD, check_state, load_onnx, run_file
from .step import NEXT, SCALE

GRAPH_ID = "gpu_graph_id"  # ONNX Runtime's run option selecting one of a session's captured CUDA graphs (>= 1.18)
NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(bool)": np.bool_, "tensor(float16)": np.float16,
               "tensor(double)": np.float64}


class StepRunner:
    """Runs step.onnx; holds the step graph's state (its flat buffers and scalars: numpy on the plain
    path, device OrtValues when bound); state_numpy() gives it per tensor."""

    def __init__(self, run_dir, meta, state: dict, providers=None, device_state: bool | None = None,
                 threads: int | None = None, cuda_graph: bool = False, batch_size: int | None = None,
                 blocks: bool = True):
        """state: per tensor (train.json "state" names: state.npz, a checkpoint). providers: ONNX
        Runtime's (None: the CPU); a plain CUDA entry gets the step's options (step_providers).
        device_state: keep the state bound on the session's device (None: yes; False: numpy
        arrays fed and fetched each step, the plain path).
        threads: intra-op threads (None or 0: ONNX Runtime's default). cuda_graph: capture the
        step as CUDA graphs, its batch axis pinned to batch_size (needed then); refused in one
        line (GraphmpError) when that cannot work. A step graph ONNX Runtime cannot load is one
        line too. blocks: on the CPU, run the update's elementwise chain in cache-sized blocks
        (blocks.block_update: the same bits; False for the whole-buffer nodes of step.onnx, to
        compare)."""
        self.meta = meta
        self.names = graph_state_names(meta)  # the step graph's state: a few flat buffers and scalars
        path = run_file(run_dir, meta, "step_model")
        model = load_onnx(path)  # a one-line error for a corrupt file, and no external data (a run's never has any)
        source = path
        if cuda_graph:
            if not batch_size:
                raise GraphmpError("--cuda-graph pins the step's batch axis to the batch size: give batch_size")
            model = pin_dims(model, batch_dims(model, meta, batch_size))
            _refuse_cuda_graph(path, model, self.names, providers, device_state)
            source = model.SerializeToString()
        providers = step_providers(providers, model, cuda_graph)
        self.rows = {}  # state buffers the session takes as rows (blocks.block_update): name -> shape
        if blocks:
            lowered, self.rows = for_session(model, meta, providers, threads)
            source = source if lowered is model else lowered.SerializeToString()
        self.sess = _open_session(path, source, providers, threads, cuda_graph)
        self.providers = self.sess.get_providers()  # what it got, not what was asked for
        self.provider_options = self.sess.get_provider_options().get(ran_on(self.sess), {})
        self.device = "cuda" if ran_on(self.sess) == CUDA else "cpu"
        if cuda_graph and self.device != "cuda":
            raise GraphmpError(f"--cuda-graph: the step session came up on {ran_on(self.sess)}, not {CUDA}; "
                               "fix the CUDA setup (docs/gpu.md) or leave out --cuda-graph")
        self.bound = True if device_state is None else bool(device_state)
        self.cuda_graph = bool(cuda_graph)
        state = _as_rows(pack(meta, state, run_dir), self.rows)  # per-tensor state -> the graph's buffers, once
        check_state(self.sess, state, self.names, run_dir)
        if self.bound:
            self.bindings = _Bindings(self.sess, state, self.names, [meta["loss_output"], meta["finite_output"]],
                                      self.device, self.cuda_graph)
        else:
            self.state = {n: state[n] for n in self.names}
        self.scale_const = None if meta["dynamic_scale"] else float(meta["config"]["loss_scale"])

    where = "data"  # what the batches come from, for errors (train() sets the data file)

    def step(self, batch: dict) -> tuple[float, bool, float]:
        """One optimizer step; returns (loss, applied, loss scale after the step). An ONNX
        Runtime failure on the batch is a one-line GraphmpError naming self.where (run_failure)."""
        try:
            return self._step(batch)
        except GraphmpError:
            raise
        except Exception as e:  # noqa: BLE001  (ORT raises several pybind types for a bad feed)
            raise run_failure(e, self.sess, batch, self.where, "the training step graph", self.meta) from None

    def _step(self, batch: dict) -> tuple[float, bool, float]:
        if self.bound:
            loss, finite, state = self.bindings.run(self.sess, batch)
            scale = state[SCALE].numpy() if self.scale_const is None else self.scale_const
            return float(loss), bool(finite), float(scale)
        loss_name, fin = self.meta["loss_output"], self.meta["finite_output"]
        feeds = dict(batch)
        feeds.update(self.state)
        outs = self.sess.run([loss_name, fin] + [n + NEXT for n in self.names], feeds)
        self.state = dict(zip(self.names, outs[2:]))
        scale = self.state[SCALE] if self.scale_const is None else self.scale_const
        return float(outs[0]), bool(outs[1]), float(scale)

    def set_state(self, state: dict) -> None:
        """Replace the state by `state` (per tensor, as state_numpy gives it; checked as at
        construction), in place: a bound path keeps its OrtValues and bindings."""
        packed = _as_rows(pack(self.meta, state), self.rows)
        check_state(self.sess, packed, self.names, "the state")
        if not self.bound:
            self.state = {n: packed[n] for n in self.names}
            return
        for n, value in self.bindings.state().items():
            value.update_inplace(np.ascontiguousarray(packed[n]))

    def state_numpy(self) -> dict:
        """The state per tensor (train.json "state" names: what checkpoints, eval and export
        read), copies of the graph's buffers."""
        if not self.bound:
            return unpack(self.meta, _as_lines(self.state, self.rows))
        return unpack(self.meta, _as_lines({n: np.array(v.numpy()) for n, v in self.bindings.state().items()},
                                           self.rows))


class _Bindings:
    """The bound path's two IOBindings, built once: io[k] reads state set k and writes set 1 - k,
    and writes the loss and the finite flag into fixed OrtValues (on the host, or on the device
    for a CUDA graph). The batch inputs are bound at the first step and again only when a
    batch's shape or dtype changes; otherwise each step copies the batch into them."""

    def __init__(self, sess, state: dict, names: list, results: list, device: str, cuda_graph: bool):
        import onnxruntime as ort
        ov = ort.OrtValue
        self.device, self.cuda_graph, self.cur = device, cuda_graph, 0
        self.sets = [{n: ov.ortvalue_from_numpy(np.array(state[n], order="C"), device, 0) for n in names},
                     {n: ov.ortvalue_from_shape_and_type(list(state[n].shape), state[n].dtype, device, 0)
                      for n in names}]
        self.io = [sess.io_binding(), sess.io_binding()]
        self.results = results
        declared = {o.name: o for o in sess.get_outputs()}
        for k, io in enumerate(self.io):
            for n in names:
                io.bind_ortvalue_input(n, self.sets[k][n])
                io.bind_ortvalue_output(n + NEXT, self.sets[1 - k][n])
        self.result_values = [_result_value(declared[r], device if cuda_graph else "cpu") for r in results]
        for name, value in zip(results, self.result_values):
            for io in self.io:
                if value is None:  # a shape the session does not fix: ORT allocates it once, then reuses it
                    io.bind_output(name, device if cuda_graph else "cpu")
                else:
                    io.bind_ortvalue_output(name, value)
        self.run_options = [graph_run_options(k) for k in (0, 1)] if cuda_graph else [None, None]
        self.batch = {}  # input name -> ((shape, dtype), OrtValue bound on both IOBindings)

    def run(self, sess, batch: dict) -> tuple:
        """One step: the batch in, the run, then (loss, finite flag, the new state set)."""
        io = self.io[self.cur]
        self._feed(batch)
        sess.run_with_iobinding(io, self.run_options[self.cur])
        self.cur = 1 - self.cur
        outs = io.get_outputs()[-len(self.results):] if None in self.result_values else self.result_values
        loss, finite = (v.numpy() for v in outs)
        return loss, finite, self.sets[self.cur]

    def state(self) -> dict:
        return self.sets[self.cur]

    def _feed(self, batch: dict) -> None:
        import onnxruntime as ort
        for name, value in batch.items():
            a = np.ascontiguousarray(value)
            key = (a.shape, a.dtype)
            held = self.batch.get(name)
            if held is None or held[0] != key:
                if held is not None and self.cuda_graph:
                    raise GraphmpError(f"--cuda-graph: '{name}' of this batch is {a.dtype} {list(a.shape)}, the "
                                       f"captured step graph takes {held[0][1]} {list(held[0][0])}; a CUDA graph "
                                       "replays fixed shapes (keep drop_last, the default)")
                held = (key, ort.OrtValue.ortvalue_from_shape_and_type(list(a.shape), a.dtype, self.device, 0))
                for io in self.io:
                    io.bind_ortvalue_input(name, held[1])
                self.batch[name] = held
            held[1].update_inplace(a)
        if self.device != "cpu":
            # update_inplace is a cudaMemcpy from pageable memory, which may return before its DMA has
            # landed, on another stream than the session's: wait for the device before the run reads it
            self.io[self.cur].synchronize_inputs()


def _as_rows(state: dict, rows: dict) -> dict:
    """The buffers the session takes as rows, seen so (views of the same values); a buffer of
    another size is left as it is for check_state to name."""
    return {n: a.reshape(rows[n]) if n in rows and a.size == int(np.prod(rows[n])) else a for n, a in state.items()}


def _as_lines(state: dict, rows: dict) -> dict:
    """The buffers the session took as rows, 1-D again (what flat.unpack reads)."""
    return {n: np.asarray(a).reshape(-1) if n in rows else a for n, a in state.items()}


def _result_value(declared, device: str):
    """A fixed OrtValue for the step output `declared` (session output metadata) on `device`,
    or None when its shape or type is not fixed."""
    import onnxruntime as ort
    dtype = NUMPY_TYPES.get(declared.type)
    if dtype is None or not all(isinstance(d, int) for d in declared.shape):
        return None
    return ort.OrtValue.ortvalue_from_shape_and_type(list(declared.shape), dtype, device, 0)


def graph_run_options(parity: int):
    """The RunOptions of binding set `parity` (0 or 1) under --cuda-graph: its own captured graph,
    gpu_graph_id 1 or 2 (0 is what a run without the option uses; -1 runs without a graph)."""
    import onnxruntime as ort
    ro = ort.RunOptions()
    ro.add_run_config_entry(GRAPH_ID, str(parity + 1))
    return ro


def _refuse_cuda_graph(path: str, model, names, providers, device_state) -> None:
    """--cuda-graph's preconditions that the CPU can check: CUDA asked for, the state bound,
    ONNX Runtime >= 1.18 (one captured graph per gpu_graph_id), and a step graph whose every
    node can run on CUDA (device.cuda_graph_blockers). Else one line saying which."""
    import onnxruntime as ort
    if not any((p[0] if isinstance(p, tuple) else p) == CUDA for p in providers or []):
        raise GraphmpError("--cuda-graph needs ONNX Runtime's CUDA provider: use it with --device cuda")
    if device_state is False:
        raise GraphmpError("--cuda-graph needs the state bound on the device (device_state True or None)")
    version = tuple(int(x) for x in ort.__version__.split(".")[:2] if x.isdigit())
    if version < (1, 18):
        raise GraphmpError(f"--cuda-graph needs onnxruntime-gpu >= 1.18 (one captured graph per gpu_graph_id); "
                           f"this is {ort.__version__}")
    why = cuda_graph_blockers(model, set(names))
    if why:
        more = f" (and {len(why) - 1} more)" if len(why) > 1 else ""
        raise GraphmpError(f"--cuda-graph: {path}: {why[0]}{more}; or leave out --cuda-graph")


def _open_session(path: str, source, providers: list, threads: int | None, cuda_graph: bool):
    """The InferenceSession of the step graph at `path` (source: the path, or the serialized
    model when the runner changed it); a session ONNX Runtime refuses is one line naming path."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.log_severity_level = 4  # a failed run becomes one GraphmpError line (run_failure), not a log dump
    if threads:
        so.intra_op_num_threads = threads
    try:
        return ort.InferenceSession(source, so, providers=providers)
    except Exception as e:  # noqa: BLE001  (ORT raises several pybind types)
        if cuda_graph:
            raise GraphmpError(f"--cuda-graph: ONNX Runtime cannot capture {path} as a CUDA graph "
                               f"({first_line(e, 200)}); leave out --cuda-graph") from None
        raise GraphmpError(f"{path}: ONNX Runtime cannot load the run's step graph ({first_line(e, 200)}); "
                           f"{REBUILD}") from None

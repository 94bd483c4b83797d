"""switchable: the FP32 model with one boolean input per unit of the --max-error search
(graphmp.passes.search, step 2), so that any plan is one ONNX Runtime run.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..model_io import tensor_array
from ..ir import Names
from ..weight_rounding import to_fp16
from ..model_runs import runner
from .regions import Region


class Switchable:
    """The FP32 model with one boolean input per unit (see `whole`): True rounds the
    unit's low inputs and outputs to the low type (it runs in FP16), False: FP32.
    Lowered nodes that are no candidate (--fp16-nodes) are rounded always.

    Each evaluation of the search is one run of this model, so it holds as little extra
    work as the semantics allow (it ran 6x the FP32 model's time when every low edge had
    its own Cast-Cast-Where): a switch is an If (see _sel), a weight is rounded once here,
    in numpy, and a tensor that its producer already rounds in the same unit (or always)
    is not rounded again by its readers (rounding is idempotent)."""

    def __init__(self, ctx, regs: list[Region]):
        ctx.root.write_back()  # the proto holds exactly the IR's nodes
        model = onnx.ModelProto()
        model.CopyFrom(ctx.model)
        self.names = Names(model)
        self.flags = [self.names.fresh(f"graphmp_search_unit_{u}") for u in range(2 * len(regs))]
        self.low, self.base_dir = ctx.low, ctx.base_dir
        self.where = {n.name: (None, ctx.info[n]) for _, n in ctx.nodes() if n in ctx.lowered}
        for k, r in enumerate(regs):
            for part, nodes in enumerate(r.parts()):
                for n in nodes:
                    self.where[n.name] = (2 * k + part, ctx.info[n])
        self.main = model.graph
        self.weights = {t.name: t for t in model.graph.initializer}
        self.rounded_weights: dict = {}
        self._rewrite(model.graph)
        model.graph.initializer.extend(self.rounded_weights.values())
        for f in self.flags:
            model.graph.input.append(helper.make_tensor_value_info(f, TensorProto.BOOL, []))
        self.run = runner(model, base_dir=ctx.base_dir, optimize=False)  # see graphmp.emulate

    def _round_weight(self, x: str):
        """A main-graph initializer holding x's values rounded to the low type, or None
        (not an initializer of the main graph, or a type numpy cannot round)."""
        if x not in self.rounded_weights:
            t = self.weights[x]
            if self.low != TensorProto.FLOAT16:
                return None  # BF16: ONNX Runtime's Cast rounds it; no numpy twin relied on here
            a = to_fp16(tensor_array(t, self.base_dir)).astype(np.float32).reshape(tuple(t.dims))
            self.rounded_weights[x] = onnx.numpy_helper.from_array(a, self.names.fresh(f"{x}__s_rounded"))
        return self.rounded_weights[x].name

    def _sel(self, x, k, g, out=None) -> tuple[str, list]:
        """(name, nodes): x rounded when unit k runs in FP16 (k None: always). A switched
        rounding is an If on the unit's flag (Cast-Cast, or the pre-rounded weight, in
        one branch; x in the other): ONNX Runtime's Where cost 2.5x as much, and an If
        whose unit is FP32 costs almost nothing."""
        fresh = self.names.fresh
        y = out or fresh(f"{x}__s_r{k}")
        weight = None
        if out is None and g is self.main and x in self.weights and self.weights[x].data_type == TensorProto.FLOAT:
            weight = self._round_weight(x)
        if k is None:
            if weight is not None:
                return weight, []
            mid = fresh(f"{x}__s_low")
            return y, [helper.make_node("Cast", [x], [mid], to=self.low, name=fresh("search_cast")),
                       helper.make_node("Cast", [mid], [y], to=TensorProto.FLOAT, name=fresh("search_cast"))]
        low, up, same = fresh(f"{x}__s_low"), fresh(f"{x}__s_round"), fresh(f"{x}__s_keep")
        rounded = ([helper.make_node("Identity", [weight], [up], name=fresh("search_rounded"))] if weight is not None
                   else [helper.make_node("Cast", [x], [low], to=self.low, name=fresh("search_cast")),
                         helper.make_node("Cast", [low], [up], to=TensorProto.FLOAT, name=fresh("search_cast"))])
        then = helper.make_graph(rounded, fresh("search_fp16"), [],
                                 [helper.make_tensor_value_info(up, TensorProto.FLOAT, None)])
        keep = helper.make_graph([helper.make_node("Identity", [x], [same], name=fresh("search_keep"))],
                                 fresh("search_fp32"), [], [helper.make_tensor_value_info(same, TensorProto.FLOAT, None)])
        return y, [helper.make_node("If", [self.flags[k]], [y], name=fresh("search_switch"), then_branch=then,
                                    else_branch=keep)]

    def _rewrite(self, g):
        nodes, cache = [], {}
        rounded_in: dict = {}  # tensor -> the unit whose output rounding stores it (None: always)
        for n in g.node:
            for a in n.attribute:
                for sg in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    self._rewrite(sg)
            hit = self.where.get(n.name)
            if hit is None:
                nodes.append(n)
                continue
            k, info = hit
            for i in info.low_inputs:
                x = n.input[i]
                if x in rounded_in and rounded_in[x] in (None, k):
                    continue  # stored rounded by its producer in this state already
                if (x, k) not in cache:
                    cache[(x, k)], extra = self._sel(x, k, g)
                    nodes.extend(extra)
                n.input[i] = cache[(x, k)]
            post = []
            for i in info.low_outputs:
                y = n.output[i]
                raw = self.names.fresh(f"{y}__s_fp32")
                n.output[i] = raw
                post.extend(self._sel(raw, k, g, out=y)[1])
                rounded_in[y] = k
            nodes.append(n)
            nodes.extend(post)
        del g.node[:]
        g.node.extend(nodes)

    def outputs(self, batch: dict, fp32: frozenset) -> dict:
        """The model's outputs with the units in `fp32` computed in FP32, the rest in FP16."""
        flags = {f: np.array(u not in fp32) for u, f in enumerate(self.flags)}
        return self.run({**batch, **flags})

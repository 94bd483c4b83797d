#!/usr/bin/env python
"""Before/after table of two benchmarks/search.py runs (e.g. --graphmp-root on the commit
before a change, then the working tree): per model and row, "before -> after" of

  conv s       wall time of the conversion child (interpreter start and imports included;
               convert.wall_s); search s = the report's search.seconds
  evals        search.evaluations
  reached      search.reached (yes/no; "static" when the static plan was within budget)
  err          search.error, in units of the budget (<= 1: met)
  held-out     the benchmark's own error on the held-out inputs (errors.held_out_max,
               max|a-b|/max|ref| of the FP16 emulation, absolute)
  FP16 FLOPs   share of the Conv/MatMul/Gemm FLOPs in FP16: the report's
               search.model_compute_fp16 / the script's structure pass (flops.fp16_share);
               the FP32 share is 1 minus it
  weights MB   float weights FP16/FP32 (structure.weight_bytes)
  given back   search.given_back: nodes the static range rule keeps FP32 that the search
               let run in FP16 ("n/a" when that graphmp has no such report key)

Usage: python benchmarks/search_compare.py BEFORE.json AFTER.json [--markdown OUT.md]
"""
from __future__ import annotations

import argparse
import json
import sys

ARROW = " → "


def _f(x, fmt="{:.3g}"):
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return "yes" if x else "no"
    return fmt.format(x)


def _pct(x):
    return "-" if x is None else x if isinstance(x, str) else f"{100 * x:.1f}%"


def _pair(a, b, fn=_f):
    a, b = fn(a), fn(b)
    return a if a == b else f"{a}{ARROW}{b}"


def _row_values(r: dict | None) -> dict:
    """The cells' raw values of one row (None for a missing row)."""
    if r is None:
        return {"status": "absent"}
    s = r.get("search") or {}
    st = r.get("structure") or {}
    w = st.get("weight_bytes") or {}
    fl = st.get("flops") or {}
    e = r.get("errors") or {}
    reached = s.get("reached")
    if s and not s.get("evaluations") and reached is not False:
        reached = "static"
    given = (s.get("given_back") if s.get("given_back") is not None else "n/a") if s else None
    return {"status": r.get("status"), "wall": (r.get("convert") or {}).get("wall_s"), "search_s": s.get("seconds"),
            "evals": s.get("evaluations"), "reached": reached, "err": s.get("error"),
            "held": e.get("held_out_max"), "share_rep": s.get("model_compute_fp16"), "share_st": fl.get("fp16_share"),
            "w16": w.get("fp16"), "w32": w.get("fp32"), "given": given}


def table(before: dict, after: dict) -> str:
    hdr = ["model", "row", "conv s", "search s", "evals", "reached", "err (x budget)", "err held-out",
           "FP16 FLOPs report", "FP16 FLOPs structure", "weights MB FP16/FP32", "given back"]
    out = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    bm = {m["model"]: m for m in before.get("models", [])}
    am = {m["model"]: m for m in after.get("models", [])}
    for name in list(bm) + [n for n in am if n not in bm]:
        mb, ma = bm.get(name, {}), am.get(name, {})
        if mb.get("status") != "ok" or ma.get("status") != "ok":
            out.append(f"| {name} | {_pair(mb.get('status', 'absent'), ma.get('status', 'absent'))} |"
                       + " |" * (len(hdr) - 2))
            continue
        if mb.get("data_digest") and ma.get("data_digest") and mb["data_digest"] != ma["data_digest"]:
            name += " (inputs differ!)"
        rb = {r["label"]: r for r in mb.get("rows", [])}
        ra = {r["label"]: r for r in ma.get("rows", [])}
        for label in list(rb) + [x for x in ra if x not in rb]:
            b, a = _row_values(rb.get(label)), _row_values(ra.get(label))
            for v in (b, a):  # a side that did not convert shows its status in every cell
                if v["status"] != "ok":
                    word = str(v["status"]).split(":")[0].replace("|", "/")
                    v.update({k: word for k in v if k != "status"} | {"w16": word, "w32": word, "wall": word})

            def mb_(x):
                return "-" if x is None else x if isinstance(x, str) else f"{x / 1e6:.2f}"
            cells = [name, label, _pair(b["wall"], a["wall"], lambda x: _f(x, "{:.1f}")),
                     _pair(b["search_s"], a["search_s"], lambda x: _f(x, "{:.1f}")),
                     _pair(b["evals"], a["evals"], lambda x: _f(x, "{:d}") if isinstance(x, int) else _f(x)),
                     _pair(b["reached"], a["reached"]), _pair(b["err"], a["err"]), _pair(b["held"], a["held"]),
                     _pair(b["share_rep"], a["share_rep"], _pct), _pair(b["share_st"], a["share_st"], _pct),
                     _pair(*(v["w16"] if isinstance(v["w16"], str) else f"{mb_(v['w16'])}/{mb_(v['w32'])}"
                             for v in (b, a))),
                     _pair(b["given"], a["given"])]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def summary(before: dict, after: dict) -> str:
    lines = []
    for what, d in (("before", before), ("after", after)):
        rows = [r for m in d.get("models", []) for r in m.get("rows", []) if (r.get("search") or {}).get("seconds")]
        load = d.get("load") or {}
        lines.append(f"- {what}: graphmp {d.get('settings', {}).get('graphmp_root') or '(this checkout)'}, "
                     f"{len(rows)} searches, {sum(r['search']['seconds'] for r in rows):.0f} s of search, "
                     f"{sum(r['search'].get('evaluations') or 0 for r in rows)} evaluations; run "
                     f"{d.get('duration_s', 0):.0f} s, load average (1/5/15 min) at start "
                     f"{'/'.join(f'{x:.2f}' for x in load.get('start', []))}, at end "
                     f"{'/'.join(f'{x:.2f}' for x in load.get('end', []))}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--markdown", default=None, help="also write the table to this file")
    args = ap.parse_args(argv)
    with open(args.before) as f:
        before = json.load(f)
    with open(args.after) as f:
        after = json.load(f)
    text = table(before, after) + "\n\n" + summary(before, after) + "\n"
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Markdown tables from the fixture written by measure.py (plain Python, no torch needed).

    python3 validation/report.py > /tmp/tables.md

Prints: the measured table (with an empty "estimated" column for oomprobe's numbers), the
alive-at-peak accounting of the breakdown rows, and per-layer saved tensors from
validation/saved_breakdown.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict

MiB = 2**20
VARIANTS = ("free_first", "free_steady", "keep_first", "keep_steady")
LAYER_RE = re.compile(r"^(.*?\b(?:h|layer|layers)\.\d+|layer\d\.\d+)(?:\.|$)")


def mib(n: int) -> str:
    return f"{n / MiB:,.1f}"


def measured_table(rows: list[dict]) -> str:
    head = ("| row | params | saved | saved (CPU dropout) | caller-held | "
            + " | ".join(f"train {v.replace('_', ' ')}" for v in VARIANTS)
            + " | inference | estimated | error |")
    sep = "|" + "---|" * (head.count("|") - 1)
    lines = [head, sep]
    for r in rows:
        cells = [r["id"], f"{r['params'] / 1e6:.1f} M", mib(r["saved_bytes"]),
                 mib(r["saved_bytes_cpu_dropout"]), mib(r["caller_held_bytes"])]
        for v in VARIANTS:
            k = f"train_foreach_{v}"
            cells.append(f"{mib(r[k + '_peak_bytes'])} ({r[k + '_peak_phase']})")
        cells.append(mib(r["inference_peak_bytes"]))
        cells += ["_tbd_", "_tbd_"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def phase_table(rows: list[dict]) -> str:
    head = "| row | variant | forward max | loss max | backward max | optimizer max | peak op |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        for v in VARIANTS:
            k = f"train_foreach_{v}"
            lines.append("| " + " | ".join(
                [r["id"], v] + [mib(r[f"{k}_{ph}_max_bytes"]) for ph in ("forward", "loss", "backward", "optimizer")]
                + [f"`{r[k + '_peak_op']}`"]) + " |")
    return "\n".join(lines)


def alive_at_peak(r: dict) -> str:
    out = [f"#### {r['id']}", "",
           "| variant | peak MiB | phase | op | params | grads before | Adam before | inputs | new live at peak (MiB, by kind) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for name, s in r["train_steps"].items():
        kinds = ", ".join(f"{k} {mib(v)}" for k, v in sorted(s["live_at_peak_new"].items(), key=lambda kv: -kv[1]))
        out.append("| " + " | ".join([
            name, mib(s["peak_bytes"]), s["peak_phase"], f"`{s['peak_op']}` in {s['peak_stack'][-1] if s['peak_stack'] else ''}",
            mib(s["params_bytes"]), mib(s["grads_before_bytes"]), mib(s["adam_state_before_bytes"]),
            mib(s["inputs_bytes"]), kinds]) + " |")
    s = r["train_steps"]["foreach_free_steady"]
    out += ["", "Largest allocations live at the peak of foreach_free_steady (phase: autograd node or module / op):", ""]
    out += [f"- {mib(a['bytes'])} MiB — {a['what']}" for a in s["top_live_allocations_at_peak"]]
    inf = r["inference"]
    out += ["", f"Inference: peak {mib(inf['peak_bytes'])} MiB at `{inf['peak_op']}` in `{inf['peak_module']}`; "
            f"params+inputs {mib(inf['baseline_bytes'])} MiB, new live at peak: "
            + ", ".join(f"{k} {mib(v)}" for k, v in inf["live_at_peak_new"].items()), ""]
    return "\n".join(out)


def layer_of(module: str) -> str:
    module = module or "<model>"
    m = LAYER_RE.match(module)
    return m.group(1) if m else module


def breakdown(name: str, bd: dict) -> str:
    saved = bd["saved"]
    per_layer: dict[str, int] = defaultdict(int)
    for s in saved:
        per_layer[layer_of(s["module"])] += s["storage_bytes"]
    layers = [k for k in per_layer if LAYER_RE.match(k + ".")]
    out = [f"#### {name}", "",
           f"Saved storages: {len(saved)}, {mib(sum(s['storage_bytes'] for s in saved))} MiB. "
           f"Per layer ({len(layers)} layers): "
           + (f"{mib(per_layer[layers[0]])} MiB each" if len({per_layer[k] for k in layers}) == 1
              else ", ".join(f"{k} {mib(per_layer[k])}" for k in layers) + " MiB")
           + ". Outside the layers: "
           + ", ".join(f"{k} {mib(v)} MiB" for k, v in per_layer.items() if k not in layers) + ".", ""]
    # one representative layer in full: the second one (the first may differ, e.g. a downsample)
    picks = layers[1:2] or layers[:1]
    if len(layers) > 1 and per_layer[layers[0]] != per_layer[layers[1]]:
        picks.append(layers[0])  # the first block differs (e.g. ResNet's downsample)
    for pick in picks:
        out += ["", f"Every storage saved in `{pick}`:", "",
                "| module | storage bytes | saved as | saved by (grad_fn.attr shape dtype) |", "|---|---|---|---|"]
        for s in saved:
            if layer_of(s["module"]) == pick:
                out.append(f"| {s['module']} | {s['storage_bytes']:,} | {'; '.join(s['saved_as'])} | "
                           f"{'; '.join(s['saved_by']) or '(not reached from loss)'} |")
    rest = [s for s in saved if layer_of(s["module"]) not in layers]
    if rest:
        out += ["", "Outside the layers:", "", "| module | phase | storage bytes | saved as | saved by |", "|---|---|---|---|---|"]
        for s in rest:
            out.append(f"| {s['module'] or '<model>'} | {s['phase']} | {s['storage_bytes']:,} | {'; '.join(s['saved_as'])} | "
                       f"{'; '.join(s['saved_by'])} |")
    if bd["caller_held"]:
        out += ["", "Held by the returned output object, not saved: "
                + ", ".join(f"{h['shape']} {h['dtype']} ({h['storage_bytes']:,} B)" for h in bd["caller_held"])]
    return "\n".join(out) + "\n"


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixture", default=os.path.join(os.path.dirname(here), "tests", "fixtures", "validation.json"))
    ap.add_argument("--breakdown", default=os.path.join(here, "saved_breakdown.json"))
    ap.add_argument("--part", choices=("tables", "breakdown", "all"), default="all")
    args = ap.parse_args()
    doc = json.load(open(args.fixture))
    rows = doc["rows"]
    extra = os.path.join(os.path.dirname(args.fixture), "validation_autocast.json")
    if os.path.exists(extra):
        rows = rows + json.load(open(extra))["rows"]
    if args.part == "breakdown":
        print("# Saved tensors per layer (generated by validation/report.py --part breakdown)\n")
        print(f"torch {doc['versions']['torch']}, transformers {doc['versions']['transformers']}, "
              f"torchvision {doc['versions']['torchvision']}, CPU, fp32 unless the row id says autocast. "
              "One entry per saved storage (views of one storage are listed together); "
              "parameters are not listed; `[weight cast]` marks autocast's copies of parameters.\n")
        for name, bd in json.load(open(args.breakdown))["rows"].items():
            print(breakdown(name, bd))
        return 0
    print(f"Measured with torch {doc['versions']['torch']}, transformers {doc['versions']['transformers']}, "
          f"torchvision {doc['versions']['torchvision']} on CPU ({doc['threads']} threads), {doc['generated']}. "
          "MiB = 2^20 bytes; train peaks with Adam foreach=True.\n")
    print(measured_table(rows))
    print("\n### Maximum live bytes per phase (MiB)\n")
    print(phase_table(rows))
    print("\n### Alive at the peak\n")
    for r in rows:
        if "forloop_free_steady" in r["train_steps"] or r["precision"] != "fp32":
            print(alive_at_peak(r))
    if args.part == "all" and os.path.exists(args.breakdown):
        print("\n### Saved tensors per layer\n")
        for name, bd in json.load(open(args.breakdown))["rows"].items():
            print(breakdown(name, bd))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""LitGPT phi rows with LoRA beyond query + value: the MLP (GptNeoxMLP fc / proj as LoRALinear),
the attention projection, and the head (lora_head, with the 128-token chunked head).

Uses validation/litgpt_step.py as it is (build_litgpt already takes any of LitGPT's six LoRA
switches; measure_fixture_row measures a row as the fixture's rows are measured). The rows are the
existing `phi-qv-p05` row's shape and Config fields (family_rows()), at batch 2, and are written to
a separate file; tests/fixtures/finetune/litgpt_measured.json is not touched.

    ~/.cache/oomprobe-validation-venv/bin/python validation/litgpt_phi_all.py --threads 1 \
        [--out tests/fixtures/finetune/litgpt_phi_all_measured.json] [--commits 5895df10,0cc02afa]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import litgpt_step as L  # noqa: E402

OUT = os.path.join(os.path.dirname(HERE), "tests", "fixtures", "finetune", "litgpt_phi_all_measured.json")


def rows(batch: int, seq: int) -> list[dict]:
    base = [r for r in L.family_rows() if r["id"] == "phi-qv-p05"][0]

    def row(id_, targets):
        return dict(base, id=id_, holdout=False, batch=batch, seq=seq, targets=list(targets))

    return [
        row(f"phi-qv-p05-b{batch}", ["query", "value"]),  # control: the fixture row's targets
        row(f"phi-alllinear-p05-b{batch}", L.ALL_LINEAR),  # (a) query, key, value, projection, mlp
        row(f"phi-allhead-p05-b{batch}", L.ALL_LINEAR + ["head"]),  # (b) and the head
    ]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--commits", default="5895df10")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=L.SEQ)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    log = lambda m: print(m, flush=True)  # noqa: E731
    out = []
    t0 = time.time()
    for c in args.commits.split(","):
        for spec in rows(args.batch, args.seq):
            if args.only and args.only not in spec["id"]:
                continue
            log(f"{spec['id']} @ {c}")
            ex: dict = {}
            r = L.measure_fixture_row(spec, c, log, ex)
            r["saved_layer0"] = ex["saved_layer0"]
            out.append(r)
            log(f"  per layer {r['saved_per_layer_bytes']} outside {r['saved_outside_layers']}")
            for e in r["saved_layer1"]:
                log(f"    {e['module']:<28} {str(e['shape']):<18} {e['dtype']:<9} {e['bytes']:>9,}  {e['grad_fn']}")
    doc = {"versions": {"torch": torch.__version__}, "device": "cpu", "threads": args.threads,
           "method": dict(L.FIXTURE_METHOD, rows="validation/litgpt_phi_all.py: family_rows()'s phi-qv-p05 "
                          "Config at batch/seq given, targets as each row's (head = lora_head)"),
           "seconds": round(time.time() - t0, 1), "rows": out}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

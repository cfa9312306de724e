#!/usr/bin/env python3
"""Fits the cost model's efficiency, E_ARCH · h / (h + H0) of the dense 16-bit peak
(src/cost/mod.rs `efficiency`), on the build rows of tests/fixtures/throughput/published.json,
compute only (the rows are FSDP on NVLink, where the collectives hide under compute). The held
out rows are not read here; tests/it/cost/published.rs checks both sets with the whole model.

Usage: fit.py tests/fixtures/throughput/published.json
"""
import json
import math
import statistics
import sys

PEAK = {"a100-80gb": 312e12, "a100-40gb": 312e12, "h100-sxm": 989.4e12}
ARCH = {"a100-80gb": "Ampere", "a100-40gb": "Ampere", "h100-sxm": "Hopper"}


def executed_per_token(r):
    n, attn = r["matmul_params"], r["layers"] * r["attn_width"] * r["seq"]
    return 6 * n + 12 * attn + r["recompute"] * (2 * n + 4 * attn)


def implied(r):
    """The fraction of peak the row reached, counting the recompute."""
    return r["tokens_per_second_per_gpu"] * executed_per_token(r) / PEAK[r["card"]]


def fit(rows):
    best = None
    for h0 in range(0, 4001, 25):
        tops = {}
        for arch in ("Ampere", "Hopper"):
            logs = [math.log(implied(r) * (r["hidden"] + h0) / r["hidden"])
                    for r in rows if ARCH[r["card"]] == arch]
            tops[arch] = math.exp(statistics.median(logs))
        errs = [abs(math.log(tops[ARCH[r["card"]]] * r["hidden"] / (r["hidden"] + h0)
                             / implied(r))) for r in rows]
        score = statistics.mean(errs)
        if best is None or score < best[0]:
            best = (score, h0, tops)
    return best


if __name__ == "__main__":
    rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["split"] == "build"]
    score, h0, tops = fit(rows)
    print(f"build rows: {len(rows)}; mean |log error| {score:.4f}")
    print(f"H0 = {h0}; E_AMPERE = {tops['Ampere']:.3f}; E_HOPPER = {tops['Hopper']:.3f}")

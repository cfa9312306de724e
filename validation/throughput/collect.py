#!/usr/bin/env python3
"""Published training throughput, as rows the cost model (src/cost) is fitted and checked on.

Writes tests/fixtures/throughput/published.json from:
- llm-foundry's benchmark tables (mosaicml/llm-foundry @ 8c8dd48,
  scripts/train/benchmarking/README.md): MPT models, FSDP FULL_SHARD, bf16. The model shapes are
  the yamls of the same commit (scripts/train/yamls/pretrain/mpt-*.yaml); NumParams is the
  table's own column (the tied embedding is the head: every parameter is a matmul's).
  Build: "H100 80GB BF16" and "A100 80GB". Held out: "A100 40GB" and "H100 80GB BF16 (Large
  Scale, >= 128 GPUs)".
- torchtitan's (pytorch/torchtitan): docs/performance.md @ 0413364 (Llama 3 and Llama 2 on 64
  A100 80GB with FSDP2) and benchmarks/llama3_h100_202412_torchtitan.md @ 31a17bf (Llama 3.1 8B
  on 8 and 128 H100 with FSDP2, the rows without torch.compile or Float8). All held out.

Usage: collect.py LLM_FOUNDRY_README > tests/fixtures/throughput/published.json
"""
import json
import re
import sys

MPT = {  # d_model, n_heads, n_layers (expansion 4, vocab 50368, ALiBi, tied)
    "125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24),
    "1b": (2048, 16, 24), "3b": (2560, 20, 32), "7b": (4096, 32, 32),
    "13b": (5120, 40, 40), "30b": (7168, 56, 48), "70b": (8192, 64, 80),
}
CARD = {"h100_80gb": "h100-sxm", "a100_80gb": "a100-80gb", "a100_40gb": "a100-40gb"}
TABLES = {
    "H100 80GB BF16": "build",
    "A100 80GB with 1600 Gbps node-node interconnect (RoCE)": "build",
    "A100 40GB with 1600 Gbps node-node interconnect (RoCE)": "holdout",
    "H100 80GB BF16 (Large Scale, >= 128 GPUs)": "holdout",
}
FOUNDRY = "mosaicml/llm-foundry@8c8dd48 scripts/train/benchmarking/README.md"


def foundry(path):
    rows, table, cols = [], None, None
    for line in open(path, encoding="utf-8"):
        line = line.strip()
        if line.startswith("## "):
            table, cols = line[3:].strip(), None
            continue
        if table not in TABLES or not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cols is None:
            cols = cells
            continue
        if set(cells[0]) <= {"-", " "}:
            continue
        r = dict(zip(cols, cells))
        if r.get("Precision") not in ("amp_bf16", "bf16"):
            continue
        d, heads, layers = MPT[r["Model"]]
        rows.append({
            "source": f"{FOUNDRY} ({table})",
            "split": TABLES[table],
            "model": "mpt-" + r["Model"],
            "card": CARD[r["GPU"]],
            "gpus": int(r["# GPUs"]),
            "hidden": d,
            "layers": layers,
            "attn_width": d,
            "matmul_params": int(r["NumParams"]),
            "params": int(r["NumParams"]),
            "seq": int(r["SeqLen (T)"]),
            "micro_batch": int(r["MicroBatchSize"]),
            "accumulation": int(r["GradAccum"]),
            "recompute": 1.0 if r["Activation Checkpointing"] == "True" else 0.0,
            "shard": int(r["# GPUs"]),
            "tp": 1,
            "tokens_per_second_per_gpu": float(r["Throughput (T/s/GPU)"]),
            "mfu": float(r["MFU"]) / 100,
        })
    return rows


TITAN_A100 = "pytorch/torchtitan@0413364 docs/performance.md (64 A100 80GB, FSDP2)"
TITAN_H100 = "pytorch/torchtitan@31a17bf benchmarks/llama3_h100_202412_torchtitan.md (H100 96GB HBM2e at 500 W; FSDP2, no compile, no Float8)"
# name: (hidden, layers, q width, params, input embedding, seq)
LLAMA = {
    "llama3-8b": (4096, 32, 4096, 8_030_261_248, 128256 * 4096, 8192),
    "llama3-70b": (8192, 80, 8192, 70_553_706_496, 128256 * 8192, 8192),
    "llama2-13b": (5120, 40, 5120, 13_015_864_320, 32000 * 5120, 4096),
    "llama2-70b": (8192, 80, 8192, 68_976_648_192, 32000 * 8192, 4096),
}
# source, model, card, gpus, local batch, AC (share of the forward recomputed), TPS/GPU, MFU
# Selective layer AC checkpoints every other block (0.5); selective op AC saves the outputs of
# the compute ops except every second mm (torchtitan's `_get_custom_policy`: "Saves output of
# all compute ops, except every second mm"), so half the matmuls are recomputed (0.5; the
# attention kernel's output is saved, which 0.5 of the whole forward slightly overcounts).
TITAN = [
    (TITAN_A100, "llama3-8b", "a100-80gb", 64, 1, 0.5, 2904, 0.568),
    (TITAN_A100, "llama3-8b", "a100-80gb", 64, 1, 0.5, 2973, 0.582),
    (TITAN_A100, "llama3-70b", "a100-80gb", 64, 1, 1.0, 331, 0.517),
    (TITAN_A100, "llama2-13b", "a100-80gb", 64, 2, 0.0, 2162, 0.611),
    (TITAN_A100, "llama2-13b", "a100-80gb", 64, 2, 0.5, 1914, 0.541),
    (TITAN_A100, "llama2-13b", "a100-80gb", 64, 2, 0.5, 1904, 0.538),
    (TITAN_A100, "llama2-70b", "a100-80gb", 64, 1, 0.5, 355, 0.508),
    (TITAN_A100, "llama2-70b", "a100-80gb", 64, 2, 1.0, 353, 0.505),
    (TITAN_H100, "llama3-8b", "h100-sxm", 8, 2, 0.5, 5762, None),
    (TITAN_H100, "llama3-8b", "h100-sxm", 128, 2, 0.5, 5605, None),
]


def titan():
    rows = []
    for src, model, card, gpus, b, ac, tps, mfu in TITAN:
        h, layers, w, params, emb, seq = LLAMA[model]
        rows.append({
            "source": src, "split": "holdout", "model": model, "card": card, "gpus": gpus,
            "hidden": h, "layers": layers, "attn_width": w, "matmul_params": params - emb,
            "params": params, "seq": seq, "micro_batch": b, "accumulation": 1,
            "recompute": ac, "shard": gpus, "tp": 1, "tokens_per_second_per_gpu": float(tps),
            "mfu": mfu,
        })
    return rows


if __name__ == "__main__":
    rows = foundry(sys.argv[1]) + titan()
    json.dump({"rows": rows}, sys.stdout, indent=1)
    print()

#!/usr/bin/env python3
"""Measure what torchao's float8 training saves and peaks at, on CPU (random init, nothing downloaded),
and write tests/fixtures/float8_measured.json (issue 45, item 5).

    "${OOMPROBE_VENV:-$HOME/.cache/oomprobe-validation-venv}/bin/pip" install --no-deps torchao==0.18.0
    "${OOMPROBE_VENV:-$HOME/.cache/oomprobe-validation-venv}/bin/python" validation/measure_float8.py

The model is measure_lora.py's small grouped-query Llama (hidden 256, ffn 688, 4 layers, 8 heads, 2 kv
heads, vocab 1024, untied head, sdpa) in bf16 (model.bfloat16()), full fine-tuning, AdamW for-loop.
`float8` converts every decoder layer's nn.Linear with torchao.float8.convert_to_float8_training
(Float8LinearConfig.from_recipe_name(recipe); the head left out, as torchtitan's
`filter_fqns = ["output"]`), eager (no torch.compile). CPU `torch._scaled_mm` runs the matmuls.

Per row: `saved_bytes` and `saved_count` (the forward's saved tensors through
torch.autograd.graph.saved_tensors_hooks, unique storages, and how many were float8), then for bf16
and tensorwise measure_optimizers.py's first and steady step peaks (torch.profiler(profile_memory=True));
the CPU's float8 matmuls under the profiler take minutes a step, so rowwise has its saved tensors
only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import measure as M  # noqa: E402
import measure_lora as L  # noqa: E402
import measure_optimizers as O  # noqa: E402

SCHEMA_VERSION = 1
RECIPES = ("off", "tensorwise", "rowwise")
PEAKS = ("off", "tensorwise")


def row(recipe: str, shape: dict) -> dict:
    r = dict(L.BASE, **shape, method="full", rank=0, lora_alpha=0, targets="", lora_dropout=0.0,
             grad_ckpt=False, attn_implementation="sdpa", precision="bf16", quant_type="",
             double_quant=False, compute_dtype="", optimizer="adamw-forloop", zero_grad="set_to_none=True")
    M.fill_config_defaults(r)
    r["float8"] = recipe
    r["holdout"] = False
    r["id"] = f"float8-{recipe}-l{r['layers']}-b{r['batch']}-s{r['seq']}"
    return r


def converted_build(recipe: str):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    plain = L.build

    def build(r: dict):
        model, head = plain(r)
        if recipe != "off":
            convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                       module_filter_fn=lambda m, fqn: "lm_head" not in fqn)
        return model, head

    return plain, build


def saved(r: dict) -> dict:
    model, _ = L.build(r)
    inputs = M.make_inputs(r)
    seen = {}
    fp8 = 0

    def pack(t):
        nonlocal fp8
        key = M.storage_key(t)
        if key not in seen:
            seen[key] = t.untyped_storage().nbytes()
            fp8 += "float8" in str(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, out = M.run_forward(r, model, inputs)
    n = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    del loss, out, model
    return {"saved_bytes": sum(seen.values()), "saved_count": len(seen), "saved_float8_count": fp8,
            "float8_linears": n}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    root = os.path.dirname(HERE)
    ap.add_argument("--out", default=os.path.join(root, "tests", "fixtures", "float8_measured.json"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import torchao

    t0 = time.time()
    rows = []
    for shape in ({"seq": 256},):
        for recipe in RECIPES:
            r = row(recipe, shape)
            plain, build = converted_build(recipe)
            L.build = build
            try:
                out = {k: r[k] for k in O.FIELDS}
                out["float8"] = recipe
                out.update(saved(r))
                model, _ = L.build(r)
                out["params_total"] = sum(p.numel() for p in model.parameters())
                del model
                # The CPU's float8 matmuls under the profiler take minutes a step: the step
                # peaks of bf16 and tensorwise only.
                if recipe in PEAKS:
                    for k, v in O.measure_train(r).items():
                        out[f"{k}_peak_bytes"] = v["peak_bytes"]
                        out[f"{k}_peak_phase"] = v["peak_phase"]
                        out[f"{k}_peak_op"] = v["peak_op"]
            finally:
                L.build = plain
            print(f"{out['id']}: saved {out['saved_bytes']:,} ({out['saved_count']} tensors, "
                  f"{out['saved_float8_count']} float8; {out['float8_linears']} Float8Linear) peaks "
                  f"{out.get('first_peak_bytes')} {out.get('steady_peak_bytes')}", flush=True)
            rows.append(out)
    M.write_fixture(args.out, SCHEMA_VERSION, __doc__, args.threads, time.time() - t0, rows,
                    torchao=torchao.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Measure one training step under torchtitan's op-level selective activation checkpointing, on CPU
(random init, nothing downloaded), and write tests/fixtures/sac_measured.json (issue 45, item 4).

    "${OOMPROBE_VENV:-$HOME/.cache/oomprobe-validation-venv}/bin/python" validation/measure_sac.py

The model is measure_lora.py's small grouped-query Llama (hidden 256, ffn 688, 4 layers, 8 heads, 2 kv
heads, vocab 1024, untied head, sdpa), full fine-tuning, fp32 or bf16 (model.bfloat16()), AdamW
for-loop (torch's CPU default). Each decoder layer is checkpointed by transformers'
gradient_checkpointing_enable(use_reentrant=False), as measure_lora.py's gc rows, with:

* ckpt "full": no context_fn (every layer recomputed whole), the reference;
* ckpt "ops": torchtitan's SelectiveAC policy (pytorch/torchtitan b5bcd76,
  torchtitan/distributed/activation_checkpoint.py, `SelectiveAC._wrap_block` and
  `_get_default_save_ops`) through torch.utils.checkpoint.create_selective_checkpoint_contexts: the
  outputs of functorch's compute-intensive ops (mm, addmm, bmm, the CUDA SDPA kernels, ...), linear,
  max, topk and the collectives are MUST_SAVE, except every second mm/linear of the layer's forward
  (a count per checkpoint call), which is recomputed with everything else. One change: the CPU's
  flash kernel (aten::_scaled_dot_product_flash_attention_for_cpu) joins the list, standing in for
  the CUDA flash/efficient/cuDNN kernels the list names, so that the attention's output is saved as
  it is on a GPU. `saved_ops` records the ops the policy saved in one layer's forward.

Train steps: first = no grads, no optimizer state before; steady = AdamW state present. Peak and
phase maxima as measure_optimizers.py (torch.profiler(profile_memory=True) CPU allocator events);
`*_backward_start_bytes` is what is live when the backward begins (what the forward saved and
stored, the checkpoints, the logits' graph). The rows marked holdout were measured after the model
was fitted on the others, and compared once.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import measure as M  # noqa: E402
import measure_lora as L  # noqa: E402
import measure_optimizers as O  # noqa: E402

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts  # noqa: E402

SCHEMA_VERSION = 1


def save_ops() -> set:
    """torchtitan b5bcd76's `_get_default_save_ops()` (the ops this torch registers), plus the CPU's
    flash attention kernel."""
    from torch._functorch.partitioners import get_default_op_list

    ops = {op.default for op in get_default_op_list().compute_intensive_ops}
    a = torch.ops.aten
    ops |= {a._scaled_dot_product_cudnn_attention.default, a._scaled_dot_product_attention_math.default,
            a._scaled_dot_product_fused_attention_overrideable.default, a.max.default, a.linear.default,
            a.topk.default, torch.ops._c10d_functional.reduce_scatter_tensor.default,
            torch.ops._c10d_functional.all_to_all_single.default}
    ops.add(a._scaled_dot_product_flash_attention_for_cpu.default)
    return ops


SAVED_OPS: list[str] = []  # the first layer's forward, for the record


def context_fn():
    """SelectiveAC._wrap_block's policy, one meta per checkpoint call (torchtitan b5bcd76)."""
    ops = save_ops()
    mm_ops = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)
    meta = {"forward_mm_count": 0, "recompute_mm_count": 0}
    record = not SAVED_OPS

    def policy(ctx, func, *args, **kwargs):
        key = "recompute_mm_count" if ctx.is_recompute else "forward_mm_count"
        if func in mm_ops:
            meta[key] += 1
        save = func in ops and not (func in mm_ops and meta[key] % 2 == 0)
        if save and record and not ctx.is_recompute:
            SAVED_OPS.append(str(func))
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def rows() -> list[dict]:
    spec = [
        # ckpt, precision, shape, holdout
        ("full", "fp32", dict(seq=512), False),
        ("ops", "fp32", dict(seq=512), False),
        ("ops", "bf16", dict(seq=512), False),
        ("ops", "fp32", {}, False),
        ("full", "bf16", dict(seq=512), False),
        # held out: another depth, batch and length
        ("ops", "fp32", dict(layers=6, batch=3, seq=320), True),
        ("ops", "bf16", dict(layers=6, batch=1, seq=1024), True),
        ("ops", "bf16", dict(batch=4, seq=256), True),
    ]
    out = []
    for ckpt, precision, shape, holdout in spec:
        r = dict(L.BASE, **shape, method="full", rank=0, lora_alpha=0, targets="", lora_dropout=0.0,
                 grad_ckpt=True, attn_implementation="sdpa", precision=precision, quant_type="",
                 double_quant=False, compute_dtype="", optimizer="adamw-forloop", zero_grad="set_to_none=True")
        M.fill_config_defaults(r)
        r["ckpt"] = ckpt
        r["holdout"] = holdout
        r["id"] = f"{ckpt}-{precision}-l{r['layers']}-b{r['batch']}-s{r['seq']}"
        out.append(r)
    return out


def measure_row(row: dict) -> dict:
    L.GC_EXTRA.clear()
    SAVED_OPS.clear()
    if row["ckpt"] == "ops":
        L.GC_EXTRA["context_fn"] = context_fn
    out = {k: row[k] for k in O.FIELDS}
    out["ckpt"] = row["ckpt"]
    model, _ = L.build(row)
    params = list(model.parameters())
    out["params_total"] = sum(p.numel() for p in params)
    del model
    steps = O.measure_train(row)
    for k, v in steps.items():
        out[f"{k}_peak_bytes"] = v["peak_bytes"]
        out[f"{k}_peak_phase"] = v["peak_phase"]
        out[f"{k}_peak_op"] = v["peak_op"]
        out[f"{k}_backward_start_bytes"] = v["phase_start_bytes"].get("backward", 0)
        for ph in M.PHASES:
            out[f"{k}_{ph}_max_bytes"] = v["phase_max_bytes"].get(ph, 0)
    out["saved_ops"] = list(SAVED_OPS)
    out["steps"] = steps
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    root = os.path.dirname(HERE)
    ap.add_argument("--out", default=os.path.join(root, "tests", "fixtures", "sac_measured.json"))
    ap.add_argument("--only", default="", help="regex on row ids")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    sel = [r for r in rows() if re.search(args.only, r["id"])]
    t0 = time.time()
    measured = []
    for i, row in enumerate(sel):
        m = measure_row(row)
        print(f"[{i + 1}/{len(sel)}] {row['id']}: " + " ".join(
            f"{k}={m[k + '_peak_bytes']:,}@{m[k + '_peak_phase']} bwd-start {m[k + '_backward_start_bytes']:,} "
            f"bwd-max {m[k + '_backward_max_bytes']:,}" for k in ("first", "steady")), flush=True)
        if m["saved_ops"]:
            counts = defaultdict(int)
            for op in m["saved_ops"]:
                counts[op] += 1
            print("    saved per layer:", dict(counts), flush=True)
        measured.append(m)
    M.write_fixture(args.out, SCHEMA_VERSION, __doc__, args.threads, time.time() - t0, measured)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Measure consecutive training steps of varying sequence length on CPU (random init, nothing
downloaded) and write tests/fixtures/lengths_measured.json (issue 45, item 8: `estimate
--seq-lengths`).

    "${OOMPROBE_VENV:-$HOME/.cache/oomprobe-validation-venv}/bin/python" validation/measure_lengths.py

The model is measure_lora.py's small grouped-query Llama (full fine-tuning, SDPA, fp32), trained
with torch.optim.AdamW(foreach=True) and zero_grad(set_to_none=True). One unprofiled step at the
first length creates the optimizer state; then every length of the row is one profiled step, in
order, in one torch.profiler(profile_memory=True) session. Measured: the exact baseline (params +
buffers + AdamW state + inputs of the first step) + the CPU allocator's maximum cumulative delta
over all the steps (the sequence's peak), and each step's own maximum. The CPU allocator does not
cache: what is compared is the tensors' peak of the sequence, not the reserved bytes (those are
the caching-allocator model's, checked against real CUDA snapshots elsewhere).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import measure as M  # noqa: E402
import measure_lora as L  # noqa: E402

from torch.profiler import ProfilerActivity, profile  # noqa: E402

SCHEMA_VERSION = 1
ROWS = [
    # id, batch, lengths, holdout
    ("b2-rising", 2, [64, 128, 192, 256], False),
    ("b2-mixed", 2, [192, 64, 320, 96, 128, 320, 32], False),
    ("b1-long-first", 1, [512, 64, 128, 256], True),
    ("b3-mixed", 3, [96, 256, 48, 160, 256, 80], True),
]


def row_config(batch: int, seq: int) -> dict:
    r = dict(L.BASE, batch=batch, seq=seq, method="full", rank=0, lora_alpha=0, targets="", lora_dropout=0.0,
             grad_ckpt=False, attn_implementation="sdpa", precision="fp32", quant_type="", double_quant=False,
             compute_dtype="", optimizer="AdamW(foreach=True)", zero_grad="set_to_none=True")
    M.fill_config_defaults(r)
    return r


def measure(batch: int, lengths: list[int]) -> dict:
    rows = [row_config(batch, s) for s in lengths]
    model, _ = L.build(rows[0])
    model.train()
    params, buffers = M.model_tensors(model)
    opt = torch.optim.AdamW(params, foreach=True)
    inputs = [M.make_inputs(r) for r in rows]
    # The first step, unprofiled: AdamW's state.
    loss, out = M.run_forward(rows[0], model, inputs[0])
    loss.backward()
    del loss, out
    opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    baseline = M.unique_bytes(params + buffers) + M.unique_bytes(M.optimizer_state_tensors(opt)) + sum(
        M.unique_bytes(i.values()) for i in inputs)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for k, (r, inp) in enumerate(zip(rows, inputs)):
            M.mark(f"step{k + 1}")
            loss, out = M.run_forward(r, model, inp)
            loss.backward()
            del loss, out
            opt.step()
            opt.zero_grad(set_to_none=True)
        M.mark("end")
    res = M.analyse_profile(prof, baseline, {})
    per_step = [res["phase_max_bytes"].get(f"step{k + 1}", 0) for k in range(len(rows))]
    return {"peak_bytes": res["peak_bytes"], "peak_step": res["peak_phase"], "step_max_bytes": per_step,
            "baseline_bytes": baseline, "inputs_bytes": sum(M.unique_bytes(i.values()) for i in inputs),
            "params_total": sum(p.numel() for p in params)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    root = os.path.dirname(HERE)
    ap.add_argument("--out", default=os.path.join(root, "tests", "fixtures", "lengths_measured.json"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    t0 = time.time()
    out = []
    for rid, batch, lengths, holdout in ROWS:
        m = measure(batch, lengths)
        row = dict(row_config(batch, lengths[0]), id=rid, holdout=holdout, lengths=lengths, **m)
        print(f"{rid}: peak {m['peak_bytes']:,} at {m['peak_step']}", flush=True)
        out.append(row)
    doc = {"schema_version": SCHEMA_VERSION,
           "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version()},
           "device": "cpu", "threads": args.threads, "method": __doc__, "seconds": round(time.time() - t0, 1),
           "rows": out}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out} ({len(out)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

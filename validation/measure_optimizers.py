#!/usr/bin/env python3
"""Measure one training step's peak under optimizers as frameworks build them, on CPU (random init,
nothing downloaded), and write tests/fixtures/optimizers_measured.json (issue 45, item 6).

    "${OOMPROBE_VENV:-$HOME/.cache/oomprobe-validation-venv}/bin/python" validation/measure_optimizers.py

The model is measure_lora.py's small grouped-query Llama (hidden 256, ffn 688, 4 layers, 8 heads, 2 kv
heads, vocab 1024, untied head, sdpa), full fine-tuning, fp32 or bf16 (model.bfloat16(), no autocast).
Optimizers:

* adafactor: transformers.optimization.Adafactor as the Trainer builds it for `optim="adafactor"`
  (transformers 5.24 trainer.py: `scale_parameter=False, relative_step=False`, lr 1e-3): beta1 None,
  so no first moment; factored fp32 row/column second moments for >= 2-D parameters.
* adafactor-beta1: the same with beta1=0.9 (`optim_args="beta1=0.9"`): an fp32 exp_avg per parameter.
* adamw-in-backward: torchtune's optimizer-in-backward (torchtune/training/memory.py,
  `register_optim_in_bwd_hooks`): one torch.optim.AdamW per parameter, stepped and zero_grad'ed
  (set_to_none) from the parameter's post-accumulate-grad hook, so no gradient outlives its update.
  AdamW fused=True (torchtune's recipes set `fused: True`) or foreach=False.
* adamw-hf: transformers' own AdamW (`optim="adamw_hf"`, the Trainer's default in transformers 4.16,
  removed in 5), written out here as its `step` runs per parameter in v4.16.0
  `src/transformers/optimization.py` (`exp_avg.mul_().add_()`, `exp_avg_sq.mul_().addcmul_()`,
  `denom = exp_avg_sq.sqrt().add_(eps)`, `p.data.addcdiv_(exp_avg, denom)`, then the decoupled
  weight decay in place): one temporary, `denom`, per parameter.
* adamw-forloop: torch.optim.AdamW(foreach=False), whose `_single_tensor_adam` makes two
  (`exp_avg_sq.sqrt()` and its quotient by the bias correction), beside it on the same shapes.

Train steps: first = no grads, no optimizer state before; steady = optimizer state present (from
the first step). Peak = exact baseline (params + buffers + grads before + optimizer state before +
inputs) + max cumulative delta of torch.profiler(profile_memory=True) CPU allocator events over
forward, loss, backward (with the in-backward steps), outputs dropped, optimizer.step() and
zero_grad(set_to_none=True) (none for in-backward). The rows marked holdout were measured after
the model was fitted on the others, and compared once.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import measure as M  # noqa: E402
import measure_lora as L  # noqa: E402

from torch.profiler import ProfilerActivity, profile  # noqa: E402

SCHEMA_VERSION = 1
OPTIMIZERS = ("adafactor", "adafactor-beta1", "adamw-in-backward-fused", "adamw-in-backward-forloop",
              "adamw-hf", "adamw-forloop")
# A large vocabulary makes the embedding and the head the largest tensors by far, so that one
# temporary of the optimizer's more or less is seen in the step's peak.
BIG_VOCAB = dict(vocab=32000, batch=1, seq=16)


def rows() -> list[dict]:
    spec = [
        # optimizer, precision, shape, holdout
        ("adafactor", "fp32", {}, False),
        ("adafactor-beta1", "fp32", {}, False),
        ("adamw-in-backward-fused", "fp32", {}, False),
        ("adamw-in-backward-forloop", "fp32", {}, False),
        ("adafactor", "bf16", {}, False),
        ("adamw-in-backward-fused", "bf16", {}, False),
        # one token pair: the activations are small, the optimizer's own memory sets the peak
        ("adafactor", "fp32", dict(batch=1, seq=16), False),
        ("adafactor", "bf16", dict(batch=1, seq=16), False),
        ("adafactor-beta1", "fp32", dict(batch=1, seq=16), False),
        ("adamw-in-backward-forloop", "fp32", dict(batch=1, seq=16), False),
        # held out: another shape, and the combinations not fitted on
        ("adafactor-beta1", "bf16", dict(layers=6, batch=1, seq=16), True),
        ("adamw-in-backward-fused", "bf16", dict(layers=6, batch=1, seq=16), True),
        ("adafactor-beta1", "bf16", {}, True),
        ("adafactor", "fp32", dict(layers=6, batch=3, seq=320), True),
        ("adafactor-beta1", "fp32", dict(layers=6, batch=3, seq=320), True),
        ("adamw-in-backward-fused", "fp32", dict(layers=6, batch=3, seq=320), True),
        ("adamw-in-backward-forloop", "bf16", dict(layers=6, batch=3, seq=320), True),
        # transformers' AdamW beside torch's for-loop (added 2026-12-07); held out: the rest
        ("adamw-hf", "fp32", BIG_VOCAB, False),
        ("adamw-forloop", "fp32", BIG_VOCAB, False),
        ("adamw-hf", "bf16", BIG_VOCAB, True),
        ("adamw-hf", "fp32", dict(layers=6, batch=3, seq=320), True),
        ("adamw-forloop", "bf16", BIG_VOCAB, True),
    ]
    out = []
    for opt, precision, shape, holdout in spec:
        r = dict(L.BASE, **shape, method="full", rank=0, lora_alpha=0, targets="", lora_dropout=0.0,
                 grad_ckpt=False, attn_implementation="sdpa", precision=precision, quant_type="",
                 double_quant=False, compute_dtype="", optimizer=opt, zero_grad="set_to_none=True")
        M.fill_config_defaults(r)
        r["holdout"] = holdout
        r["id"] = f"{opt}-{precision}-l{r['layers']}-b{r['batch']}-s{r['seq']}"
        if r["vocab"] != L.BASE["vocab"]:
            r["id"] += f"-v{r['vocab']}"
        out.append(r)
    return out


class TransformersAdamW(torch.optim.Optimizer):
    """transformers' AdamW as v4.16.0 ran it (`optimization.py`, `class AdamW`), per parameter:
    in-place moments, one `denom` temporary, in-place update and decoupled weight decay."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                m.mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
                denom = v.sqrt().add_(group["eps"])
                scale = (1.0 - beta2 ** state["step"]) ** 0.5 / (1.0 - beta1 ** state["step"])
                p.addcdiv_(m, denom, value=-group["lr"] * scale)
                if group["weight_decay"] > 0.0:
                    p.add_(p, alpha=-group["lr"] * group["weight_decay"])


def make_optimizer(name: str, params: list[torch.nn.Parameter]):
    """(optimizer or None, per-parameter optimizers or None)."""
    if name == "adamw-forloop":
        return torch.optim.AdamW(params, foreach=False), None
    if name == "adamw-hf":
        return TransformersAdamW(params), None
    if name.startswith("adafactor"):
        from transformers.optimization import Adafactor

        beta1 = 0.9 if name == "adafactor-beta1" else None
        return Adafactor(params, lr=1e-3, scale_parameter=False, relative_step=False, warmup_init=False,
                         beta1=beta1), None
    fused = name.endswith("fused")
    per = {p: torch.optim.AdamW([p], fused=True) if fused else torch.optim.AdamW([p], foreach=False)
           for p in params}

    def optim_step(param) -> None:
        per[param].step()
        per[param].zero_grad()

    for p in params:
        p.register_post_accumulate_grad_hook(optim_step)
    return None, per


def state_tensors(opt, per) -> list[torch.Tensor]:
    if opt is not None:
        return M.optimizer_state_tensors(opt)
    return [t for o in per.values() for t in M.optimizer_state_tensors(o)]


def measure_train(row: dict) -> dict:
    model, head = L.build(row)
    model.train()
    inputs = M.make_inputs(row)
    params, buffers = M.model_tensors(model)
    all_keys = {M.storage_key(t) for t in params + buffers}
    opt, per = make_optimizer(row["optimizer"], params)
    results = {}
    for step in ("first", "steady"):
        for p in params:
            p.grad = None
        gc.collect()
        pbytes = M.unique_bytes(params + buffers)
        sbytes = M.unique_bytes(state_tensors(opt, per))
        ibytes = M.unique_bytes(inputs.values())
        baseline = pbytes + sbytes + ibytes
        t0 = time.time()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            M.mark("forward")
            loss, out = M.run_forward(row, model, inputs)
            M.mark("backward")
            loss.backward()
            grad_keys = {M.storage_key(p.grad) for p in params if p.grad is not None}
            del loss, out
            M.mark("optimizer")
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            M.mark("end")
        state_keys = {M.storage_key(t) for t in state_tensors(opt, per)}
        tags = {"weight_grads": (grad_keys, ("backward",)),
                "optimizer_state": (state_keys, ("backward", "optimizer"))}
        res = M.analyse_profile(prof, baseline, tags)
        res.update({"seconds": round(time.time() - t0, 1), "baseline_bytes": baseline, "params_bytes": pbytes,
                    "state_before_bytes": sbytes, "inputs_bytes": ibytes,
                    "state_after_bytes": M.unique_bytes(state_tensors(opt, per)),
                    "grads_after_bytes": M.unique_bytes([p.grad for p in params if p.grad is not None])})
        results[step] = res
        del prof
        gc.collect()
    return results


FIELDS = ("id", "holdout", "optimizer", "zero_grad", "method", "rank", "lora_alpha", "targets", "lora_dropout",
          "grad_ckpt", "quant_type", "double_quant", "compute_dtype", "precision", "attn_implementation", "hidden", "layers",
          "heads", "kv_heads", "ffn", "vocab", "batch", "seq", "max_positions", "rms_norm_eps",
          "tied_embeddings", "use_cache")


def measure_row(row: dict) -> dict:
    out = {k: row[k] for k in FIELDS}
    model, _ = L.build(row)
    params = list(model.parameters())
    out["params_total"] = sum(p.numel() for p in params)
    out["params_bytes"] = M.unique_bytes(params)
    del model
    steps = measure_train(row)
    for k, v in steps.items():
        out[f"{k}_peak_bytes"] = v["peak_bytes"]
        out[f"{k}_peak_phase"] = v["peak_phase"]
        out[f"{k}_peak_op"] = v["peak_op"]
        out[f"{k}_state_after_bytes"] = v["state_after_bytes"]
        for ph in M.PHASES:
            out[f"{k}_{ph}_max_bytes"] = v["phase_max_bytes"].get(ph, 0)
    out["steps"] = steps
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    root = os.path.dirname(HERE)
    ap.add_argument("--out", default=os.path.join(root, "tests", "fixtures", "optimizers_measured.json"))
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
            f"{k}={m[k + '_peak_bytes']:,}@{m[k + '_peak_phase']} state {m[k + '_state_after_bytes']:,}"
            for k in ("first", "steady")), flush=True)
        measured.append(m)
    M.write_fixture(args.out, SCHEMA_VERSION, __doc__, args.threads, time.time() - t0, measured)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What one LitGPT LoRA fine-tuning step holds, next to the HF + PEFT step oomprobe models.

Question: oomprobe plans LoRA as transformers + PEFT build it and lands within 1 % of LitGPT's
published max_memory_allocated for Llama 2 7B (micro-batch 1, 1,304 tokens, LoRA r8 on query +
value, dropout 0.05), although PEFT's adapters save more than LitGPT's. What does LitGPT hold that
HF + PEFT does not? This script measures both on CPU (random init, nothing downloaded):

* LitGPT at commit 0cc02afa (Oct 2023, package `lit_gpt/`, `finetune/lora.py`) and, with
  `--commit 5895df10`, at 5895df10 (Apr 2024, package `litgpt/`, `litgpt/finetune/lora.py`),
  from the git mirror /work/.mirror/Lightning-AI+litgpt/repo (`git archive` into
  /tmp/litgpt-<commit>, outside this repository). Lightning is not installed: `lightning.*`
  is stubbed in sys.modules (only names that lit_gpt/utils.py imports at module level) and the
  package's __init__.py (which imports lightning_utilities and the tokenizer) is skipped by
  registering an empty package module; lit_gpt/config.py, model.py, lora.py, utils.py run as they
  are. Nothing of LitGPT is edited.
* LitGPT's GPT with LoRA (lora.py Config: r 8, alpha 16, dropout 0.05, query + value; at 5895df10
  lora_r / lora_alpha / lora_dropout / lora_query / lora_value), `mark_only_lora_as_trainable`, on
  a small Llama: n_embd 256, 4 layers, 8 heads, 8 query groups (MHA, as Llama 2 7B), ffn 688,
  vocab = padded vocab = 1024, no bias, RMSNorm, LLaMAMLP, rotary 1.0, sequential residual,
  block_size 1024. Fabric's bf16-true is emulated as lightning 2.1's HalfPrecision does it:
  convert_module = `model.to(torch.bfloat16)` (adapters too: they are bf16 in LitGPT), forward
  under default dtype bf16 (forward_context), convert_output = every returned floating tensor (the
  logits chunks) cast to `torch.get_default_dtype()` = fp32. Order as finetune/lora.py: model
  built and converted first, then `model.max_seq_length = 300` (lora.py:176), which rebuilds the
  rope cache in fp32 (model.py:51-53). One sample, b 1, s 300: logits = model(ids,
  lm_head_chunk_size=128); logits[-1] = logits[-1][..., :-1, :]; loss =
  chunked_cross_entropy(logits, targets[..., 1:]) (lit_gpt/utils.py:238); backward;
  AdamW(trainable, foreach=True) step; zero_grad().
* HF + PEFT: measure_lora.build (LlamaForCausalLM, hidden 256, 4 layers, 8 heads, 8 kv heads,
  ffn 688, vocab 1024, untied head, sdpa, model.bfloat16(), PEFT LoRA r8 alpha 16 dropout 0.05 on
  q_proj, v_proj; adapters fp32). Two loss paths: "hf-litloss" = the decoder's hidden states,
  LitGPT's loss path (lm_head per 128-token chunk, chunks cast to fp32, the same
  chunked_cross_entropy); "hf-native" = model(input_ids, labels=input_ids) (transformers' own loss).

Instruments are measure.py's / measure_lora.py's, imported: SavedRecorder (saved_tensors_hooks,
unique storages, parameters and buffers excluded), dropout_mode(True) (torch.native_dropout: a
1-byte bool mask, as CUDA), ModuleTracker (the module that saved it), saved_breakdown (the grad_fn
and saved attribute of each storage, walked from the loss), analyse_profile + delta_at_mark (the
step peak: exact baseline + max cumulative delta of torch.profiler(profile_memory=True) CPU
allocator events; forward_retained = the delta when backward starts).

Run (one thread; another session measures too):

    ~/.cache/oomprobe-validation-venv/bin/python validation/litgpt_step.py --threads 1 \
        [--commit 5895df10] [--json out.json]

It prints per-layer saved bytes, layer 1's saved tensors of each, and the step peaks.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import subprocess
import sys
import time
import types
import warnings
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import measure as M  # noqa: E402
import measure_lora as ML  # noqa: E402

from torch.profiler import ProfilerActivity, profile  # noqa: E402

MIRROR = "/work/.mirror/Lightning-AI+litgpt/repo"
COMMITS = {"0cc02afa": "lit_gpt", "5895df10": "litgpt"}
SEQ = 300
CHUNK = 128
SHAPE = dict(n_embd=256, n_layer=4, n_head=8, n_query_groups=8, intermediate_size=688, vocab=1024)


# ----------------------------------------------------------------------------------------------
# LitGPT import (no lightning)
# ----------------------------------------------------------------------------------------------


class _Stub(types.ModuleType):
    """A module whose every missing attribute is a dummy class (L.Fabric in annotations, etc.)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (), {})
        setattr(self, name, cls)
        return cls


def _stub_lightning() -> list[str]:
    names = ["lightning", "lightning.fabric", "lightning.fabric.strategies", "lightning.fabric.utilities",
             "lightning.fabric.utilities.load", "lightning.fabric.loggers", "lightning.fabric.plugins",
             "lightning.pytorch", "lightning.pytorch.loggers", "lightning_utilities",
             "lightning_utilities.core", "lightning_utilities.core.imports"]
    made = []
    for n in names:
        if n not in sys.modules:
            sys.modules[n] = _Stub(n)
            made.append(n)
    return made


def import_litgpt(commit: str):
    """(package name, lora module, utils module) of LitGPT at `commit`, extracted to /tmp."""
    pkg = COMMITS[commit]
    root = f"/tmp/litgpt-{commit}"
    if not os.path.isdir(os.path.join(root, pkg)):
        os.makedirs(root, exist_ok=True)
        arch = subprocess.run(["git", "-C", MIRROR, "archive", commit, pkg], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", root], input=arch, check=True)
    stubs = _stub_lightning()
    # the package without its __init__.py (lightning_utilities check, tokenizer, prompts)
    mod = types.ModuleType(pkg)
    mod.__path__ = [os.path.join(root, pkg)]
    sys.modules[pkg] = mod
    model = importlib.import_module(f"{pkg}.model")
    mod.GPT = model.GPT
    config = importlib.import_module(f"{pkg}.config")
    mod.Config = config.Config
    lora = importlib.import_module(f"{pkg}.lora")
    utils = importlib.import_module(f"{pkg}.utils")
    mod.lora = lora
    return pkg, lora, utils, stubs


def build_litgpt(commit: str, lora):
    if commit == "0cc02afa":
        extra = dict(_norm_class="RMSNorm", _mlp_class="LLaMAMLP", r=8, alpha=16, dropout=0.05,
                     to_query=True, to_key=False, to_value=True, to_projection=False, to_mlp=False,
                     to_head=False)
    else:
        extra = dict(norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", lora_r=8, lora_alpha=16,
                     lora_dropout=0.05, lora_query=True, lora_key=False, lora_value=True,
                     lora_projection=False, lora_mlp=False, lora_head=False)
    cfg = lora.Config(name="llama-mini", block_size=1024, vocab_size=SHAPE["vocab"],
                      padded_vocab_size=SHAPE["vocab"], n_layer=SHAPE["n_layer"], n_head=SHAPE["n_head"],
                      n_embd=SHAPE["n_embd"], n_query_groups=SHAPE["n_query_groups"], rotary_percentage=1.0,
                      parallel_residual=False, bias=False, intermediate_size=SHAPE["intermediate_size"],
                      norm_eps=1e-5, **extra)
    torch.manual_seed(0)
    # fabric.init_module() under bf16-true: default dtype bf16 while the modules are built
    with default_dtype(torch.bfloat16):
        model = lora.GPT(cfg)
    model.apply(model._init_weights)
    lora.mark_only_lora_as_trainable(model)
    model = model.to(torch.bfloat16)  # HalfPrecision.convert_module
    model.max_seq_length = SEQ  # finetune/lora.py:176, after setup: rope cache rebuilt (fp32)
    return model, cfg


@contextlib.contextmanager
def default_dtype(dt):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# ----------------------------------------------------------------------------------------------
# Variants: (model, forward+loss function returning (loss, logits list), layer prefix)
# ----------------------------------------------------------------------------------------------


def make_inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SHAPE["vocab"], (1, SEQ), generator=g)
    return ids, ids.clone()


def variant_litgpt(commit: str):
    _pkg, lora, utils, _ = import_litgpt(commit)
    model, _cfg = build_litgpt(commit, lora)

    def step(model, ids, targets, on_logits):
        with default_dtype(torch.bfloat16):  # HalfPrecision.forward_context
            logits = model(ids, lm_head_chunk_size=CHUNK)
        logits = [t.to(torch.get_default_dtype()) for t in logits]  # HalfPrecision.convert_output
        on_logits()
        logits[-1] = logits[-1][..., :-1, :]
        loss = utils.chunked_cross_entropy(logits, targets[..., 1:])
        return loss, logits

    return model, step, "transformer.h.", utils


def hf_row():
    r = dict(ML.BASE, kv_heads=8, batch=1, seq=SEQ, method="lora", rank=8, lora_alpha=16, targets="q_proj,v_proj",
             lora_dropout=0.05, grad_ckpt=False, attn_implementation="sdpa", precision="bf16", quant_type="",
             double_quant=False, compute_dtype="")
    M.fill_config_defaults(r)
    return r


def variant_hf(loss_path: str, chunked_ce):
    row = hf_row()
    model, head = ML.build(row)
    base = model.base_model.model  # LlamaForCausalLM

    if loss_path == "litloss":
        def step(model, ids, targets, on_logits):
            hs = base.model(input_ids=ids).last_hidden_state
            logits = [base.lm_head(x).float() for x in hs.split(CHUNK, dim=1)]
            on_logits()
            logits[-1] = logits[-1][..., :-1, :]
            loss = chunked_ce(logits, targets[..., 1:])
            return loss, logits
    else:
        def step(model, ids, targets, on_logits):
            h = head.register_forward_hook(lambda *_: on_logits())
            out = model(input_ids=ids, labels=ids)
            h.remove()
            return out.loss, out

    return model, step, "model.layers.", None


# ----------------------------------------------------------------------------------------------
# Measurements
# ----------------------------------------------------------------------------------------------


def short(name: str) -> str:
    return ML.short(name)


def measure_saved(model, step, layer_prefix: str) -> dict:
    model.train()
    ids, targets = make_inputs()
    params, buffers = M.model_tensors(model)
    exclude = {M.storage_key(t) for t in params + buffers}
    tracker = M.ModuleTracker(model, profile_ranges=False)
    rec = M.SavedRecorder(exclude, tracker)

    def to_loss():
        rec.phase = "loss"

    torch.manual_seed(2)
    with M.dropout_mode(True), tracker, rec.hooks():
        loss, out = step(model, ids, targets, to_loss)
    totals = rec.totals()
    held = [t for t in M.collect_tensors(out) if M.storage_key(t) not in rec.keys | rec.cast_keys]
    held_keys = {M.storage_key(t): M.storage_nbytes(t) for t in held
                 if M.storage_key(t) not in exclude and M.storage_nbytes(t)}
    bd = M.saved_breakdown(loss, rec, out, held_keys)
    per_layer: dict[str, int] = defaultdict(int)
    layers: dict[str, list] = {"0": [], "1": []}
    for e in bd["saved"]:
        mod = short(e["module"])
        if mod.startswith(layer_prefix):
            idx = mod[len(layer_prefix):].split(".", 1)[0]
            per_layer[f"layer{idx}"] += e["storage_bytes"]
            if idx in layers:
                layers[idx].append(dict(e, module=mod[len(layer_prefix) + len(idx) + 1:]))
        else:
            per_layer[f"outside: {mod}"] += e["storage_bytes"]
    buffers_info = [(n, list(b.shape), str(b.dtype).replace("torch.", ""), M.storage_nbytes(b))
                    for n, b in model.named_buffers()]
    res = {
        "saved_bytes": totals["saved_bytes"],
        "saved_forward_bytes": totals["saved_forward_bytes"],
        "saved_loss_bytes": totals["saved_loss_bytes"],
        "dropout_mask_bytes": totals["dropout_mask_bytes"],
        "weight_cast_bytes": totals["weight_cast_bytes"],
        "caller_held_bytes": sum(held_keys.values()),
        "caller_held": bd["caller_held"],
        "per_layer": dict(per_layer),
        "layer0": layers["0"],
        "layer1": layers["1"],
        "buffers": buffers_info,
        "trainable": [(short(n), list(p.shape), str(p.dtype).replace("torch.", ""))
                      for n, p in model.named_parameters() if p.requires_grad][:4],
        "trainable_bytes": M.unique_bytes([p for p in params if p.requires_grad]),
        "params_bytes": M.unique_bytes(params),
    }
    del loss, out, bd
    return res


def measure_train(model, step) -> dict:
    model.train()
    ids, targets = make_inputs()
    params, buffers = M.model_tensors(model)
    trainable = [p for p in params if p.requires_grad]
    all_keys = {M.storage_key(t) for t in params + buffers}
    opt = torch.optim.AdamW(trainable, foreach=True)
    tracker = M.ModuleTracker(model, profile_ranges=True)
    results = {}
    for which in ("first", "steady"):
        for p in params:
            p.grad = None
        gc.collect()
        pbytes = M.unique_bytes(params + buffers)
        gbytes = M.unique_bytes([p.grad for p in params])
        sbytes = M.unique_bytes(M.optimizer_state_tensors(opt))
        ibytes = M.unique_bytes([ids, targets])
        baseline = pbytes + gbytes + sbytes + ibytes
        rec = M.SavedRecorder(all_keys, None)

        def to_loss():
            rec.phase = "loss"
            M.mark("loss")

        torch.manual_seed(2)
        with M.dropout_mode(True), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            M.mark("forward")
            with tracker, rec.hooks():
                loss, out = step(model, ids, targets, to_loss)
            held = {M.storage_key(t) for t in M.collect_tensors(out)} - rec.keys - all_keys
            held_bytes = sum(M.storage_nbytes(t) for t in {M.storage_key(t): t for t in M.collect_tensors(out)
                                                           if M.storage_key(t) in held}.values())
            M.mark("backward")
            loss.backward()
            grad_keys = {M.storage_key(p.grad) for p in trainable if p.grad is not None}
            del loss, out
            M.mark("optimizer")
            opt.step()
            state_keys = {M.storage_key(t) for t in M.optimizer_state_tensors(opt)}
            opt.zero_grad()
            M.mark("end")
        tags = {
            "saved_activations": (set(rec.keys), ("forward", "loss")),
            "caller_held_outputs": (held, ("forward", "loss")),
            "weight_grads": (grad_keys, ("backward",)),
            "adam_state": (state_keys, ("optimizer",)),
        }
        res = M.analyse_profile(prof, baseline, tags)
        saved = rec.totals()["saved_bytes"]
        res["forward_retained_bytes"] = ML.delta_at_mark(prof, "backward")
        res["saved_bytes"] = saved
        res["caller_held_bytes"] = held_bytes
        res["baseline_bytes"] = baseline
        res["params_bytes"] = pbytes
        res["adam_state_before_bytes"] = sbytes
        results[which] = res
        del prof
        gc.collect()
    return results


def run(name: str, builder) -> dict:
    t0 = time.time()
    model, step, prefix, _ = builder()
    out = {"variant": name}
    out.update(measure_saved(model, step, prefix))
    model2, step2, _, _ = builder()
    out["train"] = measure_train(model2, step2)
    out["seconds"] = round(time.time() - t0, 1)
    return out


def fmt_layer1(entries) -> list[str]:
    lines = []
    for e in entries:
        by = "; ".join(e["saved_by"]) or "(no grad_fn found from the loss)"
        lines.append(f"  {e['module']:<28} {e['storage_bytes']:>9,}  {', '.join(e['saved_as'])}  <- {by}")
    return lines


def report(res: dict) -> None:
    print(f"=== {res['variant']}  ({res['seconds']} s)")
    print(f"saved {res['saved_bytes']:,} (forward {res['saved_forward_bytes']:,}, loss {res['saved_loss_bytes']:,}, "
          f"masks {res['dropout_mask_bytes']:,}, weight casts {res['weight_cast_bytes']:,}); caller held "
          f"{res['caller_held_bytes']:,}; params {res['params_bytes']:,}, trainable {res['trainable_bytes']:,}")
    for k, v in sorted(res["per_layer"].items()):
        print(f"  {k:<40} {v:>10,}")
    print("buffers:", res["buffers"])
    print("trainable (first 4):", res["trainable"])
    for i in ("1", "0"):
        print(f"layer {i} saved storages:")
        print("\n".join(fmt_layer1(res[f"layer{i}"])))
    for k, t in res["train"].items():
        print(f"train {k}: peak {t['peak_bytes']:,} @ {t['peak_phase']} / {t['peak_op']} ({t['peak_module']}); "
              f"baseline {t['baseline_bytes']:,}; forward retained {t['forward_retained_bytes']:,} "
              f"(saved {t['saved_bytes']:,} + held {t['caller_held_bytes']:,} -> rest "
              f"{t['forward_retained_bytes'] - t['saved_bytes'] - t['caller_held_bytes']:,}); "
              f"live at peak {t['live_at_peak_new']}")
        print("   phase max:", t["phase_max_bytes"])
        print("   top live at peak:", t["top_live_allocations_at_peak"][:5])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--commit", default="0cc02afa", choices=sorted(COMMITS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="", help="substring of the variant names: litgpt, hf-litloss, hf-native")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    _pkg, _lora, utils, stubs = import_litgpt(args.commit)
    print(f"LitGPT {args.commit}: stubbed {stubs}; torch {torch.__version__}")
    variants = {
        f"litgpt-{args.commit}": lambda: variant_litgpt(args.commit),
        "hf-litloss": lambda: variant_hf("litloss", utils.chunked_cross_entropy),
        "hf-native": lambda: variant_hf("native", None),
    }
    results = []
    for name, b in variants.items():
        if args.only and args.only not in name:
            continue
        r = run(name, b)
        report(r)
        results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

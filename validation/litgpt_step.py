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

Fixture (LitGPT alone, no HF; fixture_rows(): MHA / GQA, LoRA on query + value, all linears, query + key +
value or value only, dropout 0.05 / 0.0, b1 s300 and two held-out b2 rows), for oomprobe's tests:

    ~/.cache/oomprobe-validation-venv/bin/python validation/litgpt_step.py --threads 1 --fixture \
        [PATH, default tests/fixtures/finetune/litgpt_measured.json] [--only ROW-ID-SUBSTRING]

Each row is measured at 5895df10; the first row is measured again at 0cc02afa ("cross_check", with its
differences from the 5895df10 row).

Family rows (family_rows(): LitGPT's phi-1_5 and stablelm-base-alpha-3b Config fields from lit_gpt/config.py
at 0cc02afa, scaled to h 256, 8 heads, 4 layers, ffn 1024; LoRA r8 alpha 16 dropout 0.05 on query + value),
measured at 0cc02afa and 5895df10, the 0cc02afa rows put into the fixture after the others (which stay as
they are); and their transformers + PEFT counterparts (PhiForCausalLM / GPTNeoXForCausalLM, LitGPT's loss
path):

    ~/.cache/oomprobe-validation-venv/bin/python validation/litgpt_step.py --threads 1 --family-rows \
        [PATH] [--json dump.json]
    ~/.cache/oomprobe-validation-venv/bin/python validation/litgpt_step.py --threads 1 --hf-family [--json out]
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
TARGETS = ("query", "key", "value", "projection", "mlp", "head")  # LitGPT's LoRA switches, in its order
# the report's row (and the fixture's first): MHA, LoRA r8 alpha 16 dropout 0.05 on query + value, b1 s300
DEFAULT_ROW = dict(hidden=SHAPE["n_embd"], layers=SHAPE["n_layer"], heads=SHAPE["n_head"],
                   kv_heads=SHAPE["n_query_groups"], ffn=SHAPE["intermediate_size"], vocab=SHAPE["vocab"],
                   batch=1, seq=SEQ, rank=8, lora_alpha=16, lora_dropout=0.05, targets=["query", "value"])


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


# LitGPT Config fields a row may set (family rows); the defaults are the Llama-like rows' shape
ARCH_DEFAULTS = dict(family="llama", parallel_residual=False, shared_attention_norm=False, bias=False,
                     rotary_percentage=1.0, norm="RMSNorm", mlp="LLaMAMLP", gelu_approximate="none",
                     lm_head_bias=False)


def arch(row: dict) -> dict:
    return {k: row.get(k, v) for k, v in ARCH_DEFAULTS.items()}


def build_litgpt(commit: str, lora, row: dict | None = None):
    """LitGPT's GPT with LoRA for `row` (DEFAULT_ROW: the report's shape), bf16-true as Fabric sets it up."""
    row = row or DEFAULT_ROW
    a = arch(row)
    t = set(row["targets"])
    assert t <= set(TARGETS), t
    on = {n: n in t for n in TARGETS}
    if commit == "0cc02afa":
        extra = dict(_norm_class=a["norm"], _mlp_class=a["mlp"], r=row["rank"], alpha=row["lora_alpha"],
                     dropout=row["lora_dropout"], to_query=on["query"], to_key=on["key"], to_value=on["value"],
                     to_projection=on["projection"], to_mlp=on["mlp"], to_head=on["head"])
    else:
        extra = dict(norm_class_name=a["norm"], mlp_class_name=a["mlp"], lora_r=row["rank"],
                     lora_alpha=row["lora_alpha"], lora_dropout=row["lora_dropout"], lora_query=on["query"],
                     lora_key=on["key"], lora_value=on["value"], lora_projection=on["projection"],
                     lora_mlp=on["mlp"], lora_head=on["head"])
    cfg = lora.Config(name=f"{a['family']}-mini", block_size=1024, vocab_size=row["vocab"],
                      padded_vocab_size=row["vocab"], n_layer=row["layers"], n_head=row["heads"],
                      n_embd=row["hidden"], n_query_groups=row["kv_heads"],
                      rotary_percentage=a["rotary_percentage"], parallel_residual=a["parallel_residual"],
                      shared_attention_norm=a["shared_attention_norm"], bias=a["bias"],
                      lm_head_bias=a["lm_head_bias"], gelu_approximate=a["gelu_approximate"],
                      intermediate_size=row["ffn"], norm_eps=1e-5, **extra)
    torch.manual_seed(0)
    # fabric.init_module() under bf16-true: default dtype bf16 while the modules are built
    with default_dtype(torch.bfloat16):
        model = lora.GPT(cfg)
    model.apply(model._init_weights)
    lora.mark_only_lora_as_trainable(model)
    model = model.to(torch.bfloat16)  # HalfPrecision.convert_module
    model.max_seq_length = row["seq"]  # finetune/lora.py:176, after setup: rope cache rebuilt (fp32)
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


def make_inputs(row: dict | None = None):
    row = row or DEFAULT_ROW
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, row["vocab"], (row["batch"], row["seq"]), generator=g)
    return ids, ids.clone()  # LitGPT's batch holds input_ids and labels as two tensors


def variant_litgpt(commit: str, row: dict | None = None):
    _pkg, lora, utils, _ = import_litgpt(commit)
    model, _cfg = build_litgpt(commit, lora, row)

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


def measure_saved(model, step, layer_prefix: str, row: dict | None = None) -> dict:
    model.train()
    ids, targets = make_inputs(row)
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


def measure_train(model, step, row: dict | None = None) -> dict:
    model.train()
    ids, targets = make_inputs(row)
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
            opt.zero_grad(set_to_none=True)
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
        res["inputs_bytes"] = ibytes
        res["adam_state_after_bytes"] = M.unique_bytes(M.optimizer_state_tensors(opt))
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


# ----------------------------------------------------------------------------------------------
# Fixture: tests/fixtures/finetune/litgpt_measured.json
# ----------------------------------------------------------------------------------------------

FIXTURE_PATH = os.path.join(os.path.dirname(HERE), "tests", "fixtures", "finetune", "litgpt_measured.json")
FIXTURE_COMMIT = "5895df10"  # the 2024 package `litgpt/`
CROSS_CHECK_COMMIT = "0cc02afa"  # the first row again, `lit_gpt/`
FIXTURE_SCHEMA_VERSION = 1
ALL_LINEAR = ["query", "key", "value", "projection", "mlp"]  # head off


def fixture_rows() -> list[dict]:
    def row(id_, kv, targets, p, batch=1, seq=SEQ, holdout=False):
        return dict(DEFAULT_ROW, id=id_, holdout=holdout, kv_heads=kv, targets=list(targets), lora_dropout=p,
                    batch=batch, seq=seq)

    return [
        row("mha-qv-p05", 8, ["query", "value"], 0.05),
        row("mha-qv-p0", 8, ["query", "value"], 0.0),
        row("gqa-qv-p05", 2, ["query", "value"], 0.05),
        row("mha-all-p05", 8, ALL_LINEAR, 0.05),
        row("gqa-all-p05", 2, ALL_LINEAR, 0.05),
        row("gqa-qkv-p0-b2", 2, ["query", "key", "value"], 0.0, batch=2, seq=192, holdout=True),
        row("mha-v-p05-b2", 8, ["value"], 0.05, batch=2, seq=160, holdout=True),
    ]


ROW_FIELDS = ("id", "holdout", "hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "batch", "seq", "rank",
              "lora_alpha", "lora_dropout", "targets")


def _grad_fns(saved_by: list[str]) -> list[str]:
    """'IndexCopyBackward0.source [600, 512] bfloat16' -> 'IndexCopyBackward0.source' (unique, sorted)."""
    return sorted({x.split(" ", 1)[0] for x in saved_by})


def _tensor_entry(e: dict) -> dict:
    """One saved storage of a layer: its (first) saved view's shape and dtype, the storage's bytes."""
    first = e["saved_as"][0]
    shape, dtype = first.rsplit(" ", 1)
    out = {"module": e["module"], "shape": json.loads(shape), "dtype": dtype, "bytes": e["storage_bytes"],
           "grad_fn": _grad_fns(e["saved_by"])}
    if len(e["saved_as"]) > 1:
        out["views"] = e["saved_as"]
    return out


def measure_fixture_row(spec: dict, commit: str, log, extra: dict | None = None) -> dict:
    t0 = time.time()
    out = {k: spec[k] for k in ROW_FIELDS}
    if "family" in spec:  # family rows: LitGPT's Config fields
        out.update(arch(spec))
    out["litgpt_commit"] = commit
    model, step, prefix, _ = variant_litgpt(commit, spec)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    out["params_total"] = sum(p.numel() for p in params)
    out["params_trainable"] = sum(p.numel() for p in trainable)
    out["params_bytes"] = M.unique_bytes(params)
    out["trainable_bytes"] = M.unique_bytes(trainable)
    out["buffers_bytes"] = M.unique_bytes(list(model.buffers()))
    out["param_dtypes"] = sorted({str(p.dtype).replace("torch.", "") for p in params})
    out["lora_modules"] = sorted({short(n).rsplit(".", 1)[0] for n, p in model.named_parameters()
                                  if p.requires_grad and "transformer.h.1." in n})
    sv = measure_saved(model, step, prefix, spec)
    del model
    for k in ("saved_bytes", "saved_forward_bytes", "saved_loss_bytes", "dropout_mask_bytes", "caller_held_bytes"):
        out[k] = sv[k]
    out["caller_held"] = sv["caller_held"]
    out["saved_layer0_bytes"] = sv["per_layer"].get("layer0", 0)
    out["saved_layer1_bytes"] = sv["per_layer"].get("layer1", 0)
    out["saved_per_layer_bytes"] = [sv["per_layer"].get(f"layer{i}", 0) for i in range(spec["layers"])]
    out["saved_outside_layers"] = {k[len("outside: "):]: v for k, v in sv["per_layer"].items()
                                   if k.startswith("outside: ")}
    out["saved_layer1"] = [_tensor_entry(e) for e in sv["layer1"]]
    if extra is not None:
        extra["saved_layer0"] = [_tensor_entry(e) for e in sv["layer0"]]
        extra["saved_outside"] = out["saved_outside_layers"]
    log(f"  saved {out['saved_bytes']:,} (layer1 {out['saved_layer1_bytes']:,}, masks "
        f"{out['dropout_mask_bytes']:,}) held {out['caller_held_bytes']:,} params {out['params_total']:,} "
        f"trainable {out['params_trainable']:,}  [{time.time() - t0:.0f}s]")
    model2, step2, _, _ = variant_litgpt(commit, spec)
    steps = measure_train(model2, step2, spec)
    del model2
    compact = {}
    for which, v in steps.items():
        k = f"foreach_free_{which}"
        out[f"train_{k}_peak_bytes"] = v["peak_bytes"]
        out[f"train_{k}_peak_phase"] = v["peak_phase"]
        out[f"train_{k}_peak_op"] = v["peak_op"]
        out[f"train_{k}_forward_retained_bytes"] = v["forward_retained_bytes"]
        for ph in M.PHASES:
            out[f"train_{k}_{ph}_max_bytes"] = v["phase_max_bytes"].get(ph, 0)
        compact[k] = {x: v[x] for x in ("baseline_bytes", "params_bytes", "adam_state_before_bytes",
                                        "adam_state_after_bytes", "inputs_bytes", "forward_retained_bytes",
                                        "saved_bytes", "caller_held_bytes", "peak_bytes", "peak_delta_bytes",
                                        "peak_phase", "peak_op", "peak_module", "peak_stack", "live_at_peak_new",
                                        "phase_max_bytes") if x in v}
        compact[k]["forward_unaccounted_bytes"] = (v["forward_retained_bytes"] - v["saved_bytes"]
                                                   - v["caller_held_bytes"])
        compact[k]["top_live_allocations_at_peak"] = v["top_live_allocations_at_peak"][:6]
    out["train_steps"] = compact
    out["seconds"] = round(time.time() - t0, 1)
    log("  train " + " ".join(f"{k}={v['peak_bytes']:,}@{v['peak_phase']}/{v['peak_op']} (fwd retained "
                              f"{v['forward_retained_bytes']:,})" for k, v in compact.items())
        + f"  [{out['seconds']}s]")
    return out


FIXTURE_METHOD = {
    "model": "LitGPT's GPT + LoRA (litgpt/lora.py at 5895df10, the 2024 package; cross_check: lit_gpt/lora.py at "
             "0cc02afa) imported from the git mirror as it is, lightning stubbed; Config(n_embd=hidden, "
             "n_layer=layers, n_head=heads, n_query_groups=kv_heads, intermediate_size=ffn, vocab_size = "
             "padded_vocab_size = vocab, RMSNorm, LLaMAMLP, rotary_percentage 1.0, bias False, parallel_residual "
             "False, block_size 1024); random init (model._init_weights), CPU",
    "lora": "lora_r=rank, lora_alpha, lora_dropout (0.0: LitGPT's identity, no dropout module), lora_<target>=True "
            "for each of targets (LitGPT names: query, key, value = the fused qkv LoRAQKVLinear; projection = "
            "attn.proj; mlp = fc_1, fc_2, proj; head off); mark_only_lora_as_trainable",
    "precision": "Fabric bf16-true emulated as lightning 2.1's HalfPrecision: modules built under default dtype "
                 "bf16, model.to(bfloat16) (adapters bf16), forward under default dtype bf16, the returned logits "
                 "chunks cast to fp32 (convert_output); then model.max_seq_length = seq (rope cache rebuilt fp32)",
    "loss": "logits = model(input_ids, lm_head_chunk_size=128); logits[-1] = logits[-1][..., :-1, :]; "
            "loss = chunked_cross_entropy(logits, targets[..., 1:]) (LitGPT's utils); input_ids and targets are "
            "two tensors (random ids, batch x seq)",
    "saved_bytes": "saved_tensors_hooks during one training forward + loss, unique storages, parameters and buffers "
                   "excluded; dropout via torch.native_dropout (1-byte bool mask, as CUDA)",
    "caller_held_bytes": "tensors reachable from the caller's outputs (the fp32 logits list, loss) that autograd "
                         "did not save",
    "saved_layer1": "layer 1's unique saved storages: module (under transformer.h.1), the first saved view's shape "
                    "and dtype, the storage's bytes, the grad_fn.attribute(s) that saved it (walked from the loss); "
                    "views: all saved views when more than one",
    "saved_per_layer_bytes": "unique saved storages by the layer whose module first saved them; "
                             "saved_outside_layers: the rest by module ('<model>' = the loss)",
    "train_peak": "baseline (all params + buffers + grads before + AdamW state before + input_ids + targets, exact) "
                  "+ max cumulative delta of torch.profiler CPU allocator events over forward, loss, backward, "
                  "outputs (logits list, loss) dropped, optimizer.step() (torch AdamW(trainable, foreach=True)), "
                  "zero_grad(set_to_none=True); as validation/measure_lora.py's measure_train",
    "variants": "foreach_free_first: no grads, no AdamW state before; foreach_free_steady: AdamW state of the "
                "trainable params present (from the first step), no grads before",
    "forward_retained_bytes": "allocator delta at the start of backward: what forward + loss left alive",
    "holdout": "rows to check a prediction against after the rules were fitted to the others",
    "cross_check": "the first row measured at LitGPT 0cc02afa (lit_gpt/, Oct 2023)",
}


# LitGPT's phi-1_5 and stablelm-base-alpha-3b (lit_gpt/config.py at 0cc02afa: Config defaults, i.e.
# parallel_residual True, bias True, LayerNorm, GptNeoxMLP, n_query_groups = n_head, plus phi's
# rotary_percentage 0.5, shared_attention_norm, lm_head_bias, gelu_approximate "tanh"; StableLM's
# rotary_percentage 0.25), scaled down to h 256, 8 heads (head size 32), 4 layers, ffn 4h, vocab 1024
FAMILY_COMMIT = "0cc02afa"  # the 2023 resource table's LitGPT
FAMILY_ARCH = {
    "phi": dict(family="phi", parallel_residual=True, shared_attention_norm=True, bias=True,
                rotary_percentage=0.5, norm="LayerNorm", mlp="GptNeoxMLP", gelu_approximate="tanh",
                lm_head_bias=True),
    "gpt_neox": dict(family="gpt_neox", parallel_residual=True, shared_attention_norm=False, bias=True,
                     rotary_percentage=0.25, norm="LayerNorm", mlp="GptNeoxMLP", gelu_approximate="none",
                     lm_head_bias=False),
}


def family_rows() -> list[dict]:
    return [dict(DEFAULT_ROW, id=id_, holdout=False, kv_heads=8, ffn=1024, targets=["query", "value"],
                 lora_dropout=0.05, **FAMILY_ARCH[fam])
            for id_, fam in (("phi-qv-p05", "phi"), ("neox-qv-p05", "gpt_neox"))]


# transformers' counterparts of the family rows (the configs oomprobe plans them as, at the rows' shape)
HF_FAMILY = {
    "phi": dict(model_type="phi", partial_rotary_factor=0.5, hidden_act="gelu_pytorch_tanh", resid_pdrop=0.0,
                embd_pdrop=0.0, attention_dropout=0.0, qk_layernorm=False, targets=["q_proj", "v_proj"]),
    "gpt_neox": dict(model_type="gpt_neox", rotary_pct=0.25, hidden_act="gelu", use_parallel_residual=True,
                     attention_bias=True, attention_dropout=0.0, hidden_dropout=0.0,
                     targets=["query_key_value"]),
}


def variant_hf_family(row: dict, chunked_ce):
    """PhiForCausalLM / GPTNeoXForCausalLM at the row's shape: bf16 (`model.bfloat16()`), sdpa, PEFT LoRA
    (adapters fp32, as PEFT makes them after the cast) on q_proj + v_proj (phi) or the fused
    query_key_value (gpt_neox), r / alpha / dropout as the row; LitGPT's loss path (head per 128-token chunk,
    fp32 chunks, LitGPT's chunked_cross_entropy)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    fam = dict(HF_FAMILY[row["family"]])
    targets = fam.pop("targets")
    mt = fam.pop("model_type")
    cls = transformers.PhiConfig if mt == "phi" else transformers.GPTNeoXConfig
    cfg = cls(vocab_size=row["vocab"], hidden_size=row["hidden"], intermediate_size=row["ffn"],
              num_hidden_layers=row["layers"], num_attention_heads=row["heads"], max_position_embeddings=1024,
              layer_norm_eps=1e-5, tie_word_embeddings=False, use_cache=False, **fam)
    if mt == "phi":
        cfg.num_key_value_heads = row["kv_heads"]
    torch.manual_seed(0)
    mcls = transformers.PhiForCausalLM if mt == "phi" else transformers.GPTNeoXForCausalLM
    model = mcls._from_config(cfg, attn_implementation="sdpa").bfloat16()
    model = get_peft_model(model, LoraConfig(r=row["rank"], lora_alpha=row["lora_alpha"], target_modules=targets,
                                             lora_dropout=row["lora_dropout"], bias="none",
                                             task_type="CAUSAL_LM"))
    base = model.base_model.model
    decoder = base.model if mt == "phi" else base.gpt_neox
    head = base.get_output_embeddings()

    def step(model, ids, targets_, on_logits):
        hs = decoder(input_ids=ids).last_hidden_state
        logits = [head(x).float() for x in hs.split(CHUNK, dim=1)]
        on_logits()
        logits[-1] = logits[-1][..., :-1, :]
        loss = chunked_ce(logits, targets_[..., 1:])
        return loss, logits

    prefix = "model.layers." if mt == "phi" else "gpt_neox.layers."
    return model, step, prefix, None


def hf_family_report(only: str, log, dump: str = "") -> list[dict]:
    """Saved tensors (per layer, layers 0 and 1 by tensor) and step peaks of the HF + PEFT counterparts."""
    _pkg, _lora, utils, _ = import_litgpt(FAMILY_COMMIT)
    out = []
    for spec in family_rows():
        if only and only not in spec["id"]:
            continue
        t0 = time.time()
        model, step, prefix, _ = variant_hf_family(spec, utils.chunked_cross_entropy)
        sv = measure_saved(model, step, prefix, spec)
        del model
        model2, step2, _, _ = variant_hf_family(spec, utils.chunked_cross_entropy)
        tr = measure_train(model2, step2, spec)
        del model2
        r = {"id": "hf-" + spec["id"], "per_layer": sv["per_layer"], "saved_bytes": sv["saved_bytes"],
             "caller_held_bytes": sv["caller_held_bytes"], "dropout_mask_bytes": sv["dropout_mask_bytes"],
             "params_bytes": sv["params_bytes"], "trainable_bytes": sv["trainable_bytes"],
             "saved_layer0": [_tensor_entry(e) for e in sv["layer0"]],
             "saved_layer1": [_tensor_entry(e) for e in sv["layer1"]],
             "train": {k: {x: v[x] for x in ("baseline_bytes", "peak_bytes", "peak_phase", "peak_op",
                                               "forward_retained_bytes")} for k, v in tr.items()},
             "seconds": round(time.time() - t0, 1)}
        log(f"{r['id']}: saved {r['saved_bytes']:,} per layer {dict(sorted(r['per_layer'].items()))} "
            f"peaks {[(k, v['peak_bytes']) for k, v in r['train'].items()]}")
        for L in ("saved_layer0", "saved_layer1"):
            log(f"  {L}: {sum(e['bytes'] for e in r[L]):,}")
            for e in r[L]:
                log(f"    {e['module']:<34} {str(e['shape']):<18} {e['dtype']:<9} {e['bytes']:>9,}  {e['grad_fn']}")
        out.append(r)
    if dump:
        with open(dump, "w") as f:
            json.dump(out, f, indent=1)
    return out


def write_family_rows(path: str, only: str, log, commits=(FAMILY_COMMIT, FIXTURE_COMMIT),
                      dump: str = "") -> None:
    """Measure family_rows() (at the 2023 table's commit, and at 5895df10 for comparison) and put the
    first commit's rows into the fixture at `path`, after its other rows (which stay as they are)."""
    with open(path) as f:
        doc = json.load(f)
    specs = [s for s in family_rows() if not only or only in s["id"]]
    measured, side = {}, {}
    for spec in specs:
        for c in commits:
            log(f"{spec['id']} @ {c}")
            ex = {}
            measured[(spec["id"], c)] = measure_fixture_row(spec, c, log, ex)
            side[(spec["id"], c)] = ex
    if len(commits) > 1:
        for spec in specs:
            a, b = measured[(spec["id"], commits[0])], measured[(spec["id"], commits[1])]
            diff = {k: a[k] - b[k] for k in a if isinstance(a[k], int) and not isinstance(a[k], bool)
                    and k in b and a[k] != b[k]}
            log(f"{spec['id']}: {commits[0]} - {commits[1]} = {diff}")
    if dump:
        with open(dump, "w") as f:
            json.dump([dict(r, commit=c, **side[(i, c)]) for (i, c), r in measured.items()], f, indent=1)
    new = [measured[(s["id"], commits[0])] for s in specs]
    ids = {r["id"] for r in new}
    doc["rows"] = [r for r in doc["rows"] if r["id"] not in ids] + new
    doc["versions"]["litgpt_family_rows"] = commits[0]
    doc["method"]["family_rows"] = (
        "rows with a `family` key: LitGPT's phi-1_5 / stablelm-base-alpha-3b Config fields (lit_gpt/config.py at "
        "0cc02afa) at the rows' shape, measured at litgpt_commit (0cc02afa, lit_gpt/, the 2023 resource table's); "
        "Config(parallel_residual, shared_attention_norm, bias, rotary_percentage, _norm_class=norm, "
        "_mlp_class=mlp, gelu_approximate, lm_head_bias), otherwise as the other rows")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    log(f"wrote {path}: {len(new)} family rows ({sorted(ids)})")


def write_fixture(path: str, threads: int, only: str, log) -> None:
    import platform
    import datetime as _dt

    t0 = time.time()
    rows, cross = [], []
    specs = [s for s in fixture_rows() if not only or only in s["id"]]
    for i, spec in enumerate(specs):
        log(f"[{i + 1}/{len(specs)}] {spec['id']} @ {FIXTURE_COMMIT}")
        rows.append(measure_fixture_row(spec, FIXTURE_COMMIT, log))
    if specs and specs[0]["id"] == "mha-qv-p05":
        log(f"[cross-check] mha-qv-p05 @ {CROSS_CHECK_COMMIT}")
        # each commit's package is imported under its own name; a fresh import per commit
        c = measure_fixture_row(specs[0], CROSS_CHECK_COMMIT, log)
        c["cross_check"] = True
        c["minus_5895df10"] = {k: c[k] - rows[0][k] for k in c
                               if isinstance(c[k], int) and not isinstance(c[k], bool) and k in rows[0]
                               and c[k] != rows[0][k]}
        cross.append(c)
    doc = {
        "schema_version": FIXTURE_SCHEMA_VERSION,
        "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": {"torch": torch.__version__, "litgpt": FIXTURE_COMMIT, "litgpt_cross_check": CROSS_CHECK_COMMIT,
                     "python": platform.python_version()},
        "device": "cpu",
        "threads": threads,
        "method": FIXTURE_METHOD,
        "seconds": round(time.time() - t0, 1),
        "rows": rows,
        "cross_check": cross,
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    log(f"wrote {path} ({len(rows)} rows + {len(cross)} cross-check, {doc['seconds']} s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--commit", default="0cc02afa", choices=sorted(COMMITS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="", help="substring of the variant names: litgpt, hf-litloss, hf-native")
    ap.add_argument("--json", default="")
    ap.add_argument("--fixture", nargs="?", const=FIXTURE_PATH, default="",
                    help="write the fixture rows (LitGPT 5895df10, the first row also at 0cc02afa) to this path "
                         f"(default {os.path.relpath(FIXTURE_PATH)}) instead of the report; --only: substring of row ids")
    ap.add_argument("--family-rows", nargs="?", const=FIXTURE_PATH, default="",
                    help="measure the phi / gpt_neox rows (family_rows(), at 0cc02afa and 5895df10) and put the "
                         "0cc02afa ones into this fixture, other rows unchanged; --only: substring of row ids; "
                         "--json: every measured row (both commits, layer 0's tensors too)")
    ap.add_argument("--hf-family", action="store_true",
                    help="the family rows' transformers + PEFT counterparts (PhiForCausalLM, GPTNeoXForCausalLM) "
                         "with LitGPT's loss path: saved tensors and step peaks (--json: dump)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    if args.hf_family:
        hf_family_report(args.only, lambda m: print(m, flush=True), dump=args.json)
        return 0
    if args.family_rows:
        write_family_rows(args.family_rows, args.only, lambda m: print(m, flush=True), dump=args.json)
        return 0
    if args.fixture:
        write_fixture(args.fixture, args.threads, args.only, lambda m: print(m, flush=True))
        return 0
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

#!/usr/bin/env python3
"""Measure what one LoRA (PEFT) / QLoRA (bitsandbytes 4-bit + PEFT) fine-tuning step really holds
on CPU (random init, nothing downloaded) and write tests/fixtures/finetune/lora_measured.json.

Run it with the venv that validation/setup.sh creates (it installs peft, bitsandbytes, accelerate):

    "${OOMPROBE_VENV:-$HOME/.cache/oomprobe-validation-venv}/bin/python" validation/measure_lora.py

The model is a small Llama with grouped-query attention (hidden 256, ffn 688, 4 layers, 8 heads,
2 kv heads, vocab 1024, untied head; b2 s192, so b*s = 384 tokens differs from every width; attn
"sdpa" or "eager"), built from a LlamaConfig by measure.build_model; fp32, or bf16 (`precision`
"bf16": model.bfloat16(), no autocast). Per row:

* LoRA: peft.get_peft_model(model, LoraConfig(r, lora_alpha=16, target_modules, lora_dropout,
  bias="none")); targets ["q_proj", "v_proj"] (PEFT's llama default) or "all-linear" (every
  nn.Linear but lm_head). Gradient checkpointing (when on) is enabled on the transformers model
  before get_peft_model: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=
  {"use_reentrant": False}), which in transformers 5.x also calls enable_input_require_grads().
* full: the same model without adapters, every parameter trained (the reference).
* qlora: every nn.Linear inside the decoder layers replaced by bnb.nn.Linear4bit (nf4, double
  quant, compute dtype fp32, quantized on CPU by bitsandbytes' own CPU backend), then
  peft.prepare_model_for_kbit_training(use_gradient_checkpointing=gc, gradient_checkpointing_kwargs=
  {"use_reentrant": False}) and get_peft_model. CPU backend: forward and backward dequantize the
  whole weight to the compute dtype and run F.linear, as CUDA's dequant fallback does for
  M = b*s > 1536 tokens (here M = 384, where CUDA may take its fused kernel instead). The bf16
  qlora rows start from a bf16 model, compute in bf16, and prepare_model_for_kbit_training casts
  every non-4-bit parameter (embeddings, norms, lm_head) to fp32, as a QLoRA recipe does.
* bf16 lora rows: PEFT's default autocast_adapter_dtype=True keeps the adapters fp32 on the bf16
  base; the LoRA branch casts x to fp32 (per adapted linear) and the sum back to bf16.

Measured (functions reused from measure.py):

* saved_hooks_bytes: tensors saved for backward during one training forward + loss, seen by
  torch.autograd.graph.saved_tensors_hooks, unique storages, parameters, buffers and 4-bit quant
  state excluded; dropout as CUDA runs it (torch.native_dropout: a 1-byte bool mask).
* checkpoint_inputs_bytes (gradient checkpointing rows): the tensors passed to each checkpointed
  decoder layer (positional args and the partial's keyword args: hidden states, cos/sin, mask),
  unique storages not already in the saved set. Non-reentrant checkpoint keeps them alive until
  backward; its own saved-tensor hooks hide the layer's internals from ours.
* saved_bytes = saved_hooks_bytes + checkpoint_inputs_bytes.
* caller_held_bytes: tensors reachable from the output object (logits) that autograd did not save.
* train steps: AdamW(trainable params only, foreach=True), zero_grad(set_to_none=True); first =
  no grads and no AdamW state before; steady = AdamW state present. peak = exact baseline (all
  params + buffers + quant state + grads before + AdamW state before + inputs) + max cumulative
  delta of torch.profiler(profile_memory=True) CPU allocator events over forward, loss, backward,
  outputs dropped, optimizer.step(), zero_grad. forward_retained_bytes = the allocator delta when
  backward starts (everything the forward + loss left alive: saved + checkpoint inputs + logits +
  loss).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import os
import platform
import re
import sys
import time
import warnings
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import measure as M  # noqa: E402

from torch.profiler import ProfilerActivity, profile  # noqa: E402

SCHEMA_VERSION = 1
LORA_ALPHA = 16
# seq 192: b*s = 384 tokens, unlike hidden (256), ffn (688) or vocab (1024), so a tensor's size names it
BASE = dict(M.LLAMA, model="llama-gqa-lora-mini", vocab=1024, seq=192, batch=2, max_positions=1024,
            dropout=0.0, use_cache=False, precision="fp32")
PREFIX = "base_model.model."
# Extra keywords for torch.utils.checkpoint.checkpoint (measure_sac.py sets a context_fn).
GC_EXTRA: dict = {}


# ----------------------------------------------------------------------------------------------
# Rows
# ----------------------------------------------------------------------------------------------


def row_id(r: dict) -> str:
    if r["method"] == "full":
        core = "full"
    else:
        tgt = "qv" if r["targets"] == "q_proj,v_proj" else "all"
        core = f"{r['method']}-r{r['rank']}-{tgt}"
        if r["method"] == "qlora":
            core += f"-{r['quant_type']}{'-dq' if r['double_quant'] else ''}"
    gc_ = "-gc" if r["grad_ckpt"] else ""
    prec = "" if r["precision"] == "fp32" else f"-{r['precision']}"
    return f"{core}-{r['attn_implementation']}-p{r['lora_dropout']:g}{gc_}-b{r['batch']}-s{r['seq']}{prec}"


def rows() -> list[dict]:
    spec = [
        # method, rank, targets, lora_dropout, grad_ckpt, attn[, precision]
        ("full", 0, "", 0.0, False, "sdpa"),
        ("full", 0, "", 0.0, True, "sdpa"),
        ("lora", 8, "q_proj,v_proj", 0.0, False, "sdpa"),
        ("lora", 64, "q_proj,v_proj", 0.0, False, "sdpa"),
        ("lora", 8, "all-linear", 0.0, False, "sdpa"),
        ("lora", 64, "all-linear", 0.0, False, "sdpa"),
        ("lora", 8, "q_proj,v_proj", 0.1, False, "sdpa"),
        ("lora", 8, "all-linear", 0.1, False, "sdpa"),
        ("lora", 8, "q_proj,v_proj", 0.0, True, "sdpa"),
        ("lora", 8, "all-linear", 0.0, True, "sdpa"),
        ("lora", 64, "all-linear", 0.1, True, "sdpa"),
        ("lora", 8, "q_proj,v_proj", 0.0, False, "eager"),
        ("lora", 8, "all-linear", 0.1, False, "eager"),
        ("qlora", 8, "all-linear", 0.0, False, "sdpa"),
        ("qlora", 8, "all-linear", 0.0, True, "sdpa"),
        # bf16 base (model.bfloat16()): PEFT upcasts the adapters to fp32 (autocast_adapter_dtype=True)
        ("lora", 8, "q_proj,v_proj", 0.0, False, "sdpa", "bf16"),
        ("lora", 8, "all-linear", 0.1, False, "sdpa", "bf16"),
        # QLoRA as usually run: bf16 model, 4-bit compute bf16, prepare_model_for_kbit_training upcasts
        # every non-4-bit param (embeddings, norms, lm_head) to fp32
        ("qlora", 8, "all-linear", 0.0, False, "sdpa", "bf16"),
        ("qlora", 8, "all-linear", 0.0, True, "sdpa", "bf16"),
        # Checkpointed eager layers (issue 35): the [b, 1, s, s] mask and the RNG states each
        # checkpoint keeps until its layer's backward, at s 512 and 1024 (s^2 terms). The first
        # four built the plan's model; the last three were held out until it was done.
        ("full", 0, "", 0.0, True, "eager", "fp32", dict(seq=512)),
        ("lora", 8, "q_proj,v_proj", 0.0, True, "eager", "fp32", dict(seq=512)),
        ("lora", 8, "all-linear", 0.1, True, "eager", "fp32", dict(seq=512)),
        ("lora", 8, "all-linear", 0.0, True, "eager", "fp32", dict(seq=1024)),
        ("qlora", 8, "all-linear", 0.0, True, "eager", "fp32", dict(seq=512)),
        ("qlora", 8, "all-linear", 0.0, True, "eager", "fp32", dict(seq=1024)),
        ("lora", 16, "all-linear", 0.1, True, "eager", "bf16", dict(batch=3, seq=512)),
    ]
    out = []
    for method, rank, targets, p, gc_, attn, *rest in spec:
        precision = rest[0] if rest else "fp32"
        shape = rest[1] if len(rest) > 1 else {}
        r = dict(BASE, **shape, method=method, rank=rank, lora_alpha=LORA_ALPHA if rank else 0, targets=targets,
                 lora_dropout=p, grad_ckpt=gc_, attn_implementation=attn, precision=precision,
                 quant_type="nf4" if method == "qlora" else "", double_quant=method == "qlora",
                 compute_dtype=("bfloat16" if precision == "bf16" else "float32") if method == "qlora" else "",
                 optimizer="AdamW(trainable, foreach=True)", zero_grad="set_to_none=True")
        M.fill_config_defaults(r)
        r["id"] = row_id(r)
        out.append(r)
    return out


CONFIG_FIELDS = ("id", "method", "rank", "lora_alpha", "targets", "lora_dropout", "grad_ckpt",
                 "attn_implementation", "quant_type", "double_quant", "compute_dtype", "optimizer",
                 "zero_grad", "precision", "hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "batch",
                 "seq", "max_positions", "rms_norm_eps", "tied_embeddings", "use_cache")


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------


def quantize_decoder_linears(model: torch.nn.Module, compute_dtype: torch.dtype) -> int:
    """Every nn.Linear inside model.model.layers -> bnb.nn.Linear4bit (nf4, double quant, the given
    compute dtype), quantized by moving it to the CPU (Params4bit._quantize). Returns how many."""
    import bitsandbytes as bnb

    n = 0
    for layer in model.model.layers:
        for name, mod in list(layer.named_modules()):
            if type(mod) is not torch.nn.Linear:
                continue
            parent = layer.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer
            q = bnb.nn.Linear4bit(mod.in_features, mod.out_features, bias=mod.bias is not None,
                                  compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4")
            q.weight = bnb.nn.Params4bit(mod.weight.data.clone(), requires_grad=False, compress_statistics=True,
                                         quant_type="nf4", module=q)
            q = q.to("cpu")
            if not getattr(q.weight, "bnb_quantized", False):
                raise RuntimeError(f"{name}: bitsandbytes did not quantize the weight on CPU")
            setattr(parent, name.rsplit(".", 1)[-1], q)
            n += 1
    model.is_loaded_in_4bit = True  # what transformers' bnb quantizer sets; PEFT dispatches on it
    return n


def quant_state_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    out = []
    for mod in model.modules():
        qs = getattr(getattr(mod, "weight", None), "quant_state", None)
        if qs is None:
            continue
        out += [qs.absmax, qs.code]
        if getattr(qs, "offset", None) is not None:
            out.append(qs.offset)
        if getattr(qs, "state2", None) is not None:
            out += [qs.state2.absmax, qs.state2.code]
    return [t for t in out if isinstance(t, torch.Tensor)]


def build(row: dict):
    """(model, head): the transformers model, wrapped by PEFT for lora/qlora."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    model, head = M.build_model(row)
    gc_kwargs = {"use_reentrant": False, **GC_EXTRA}
    if row["method"] == "full":
        if row["grad_ckpt"]:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)
        return model, head
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if row["method"] == "qlora":
        quantize_decoder_linears(model, getattr(torch, row["compute_dtype"]))
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=row["grad_ckpt"],
                                                gradient_checkpointing_kwargs=gc_kwargs)
    elif row["grad_ckpt"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)
    targets = row["targets"] if row["targets"] == "all-linear" else row["targets"].split(",")
    cfg = LoraConfig(r=row["rank"], lora_alpha=row["lora_alpha"], target_modules=targets,
                     lora_dropout=row["lora_dropout"], bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(model, cfg)
    return model, head


def lora_layers(model) -> list[str]:
    from peft.tuners.lora import LoraLayer

    return sorted(n[len(PREFIX):] if n.startswith(PREFIX) else n for n, m in model.named_modules()
                  if isinstance(m, LoraLayer))


class CheckpointInputs:
    """Records the tensors handed to every checkpointed decoder layer (args + partial keywords)."""

    def __init__(self, model):
        from transformers.modeling_layers import GradientCheckpointingLayer

        self.active = False
        self.tensors: list[torch.Tensor] = []
        self.layers = 0
        for m in model.modules():
            if isinstance(m, GradientCheckpointingLayer) and getattr(m, "gradient_checkpointing", False):
                orig = m._gradient_checkpointing_func

                def wrapped(fn, *args, _orig=orig):
                    if self.active:
                        self.tensors += M.collect_tensors(list(args))
                        self.tensors += M.collect_tensors(dict(getattr(fn, "keywords", {}) or {}))
                    return _orig(fn, *args)

                m._gradient_checkpointing_func = wrapped
                self.layers += 1


# ----------------------------------------------------------------------------------------------
# Measurements
# ----------------------------------------------------------------------------------------------


def short(name: str) -> str:
    return name[len(PREFIX):] if name.startswith(PREFIX) else name


def saved_by_module(rec: M.SavedRecorder) -> dict[str, int]:
    """Unique saved storages by the module that first saved them: layers 0 and 1 and outside."""
    first: dict[int, tuple[str, int]] = {}
    for r in rec.records:
        if r["param"] or r["weight_cast"] or r["storage_bytes"] == 0 or r["key"] in first:
            continue
        first[r["key"]] = (short(r["module"]), r["storage_bytes"])
    out: dict[str, int] = defaultdict(int)
    for mod, n in first.values():
        m = re.match(r"^model\.layers\.(\d+)\.", mod)
        if m and int(m.group(1)) > 1:
            continue
        out[mod] += n
    return dict(out)


def saved_list_layer(rec: M.SavedRecorder, layer: int) -> list[str]:
    """'module | shape dtype | bytes' of each unique storage first saved inside one layer."""
    seen = set()
    lines = []
    pat = f"model.layers.{layer}."
    for r in rec.records:
        if r["param"] or r["weight_cast"] or r["storage_bytes"] == 0 or r["key"] in seen:
            continue
        seen.add(r["key"])
        mod = short(r["module"])
        if mod.startswith(pat):
            lines.append(f"{mod[len(pat):]} | {r['shape']} {r['dtype']} | {r['storage_bytes']}")
    return lines


def measure_saved(row: dict) -> dict:
    model, head = build(row)
    model.train()
    inputs = M.make_inputs(row)
    params, buffers = M.model_tensors(model)
    qst = quant_state_tensors(model)
    exclude = {M.storage_key(t) for t in params + buffers + qst}
    tracker = M.ModuleTracker(model, profile_ranges=False)
    rec = M.SavedRecorder(exclude, tracker)
    ck = CheckpointInputs(model) if row["grad_ckpt"] else None

    def to_loss():
        rec.phase = "loss"

    h = M.head_hook(head, to_loss)
    if ck:
        ck.active = True
    with M.dropout_mode(True), tracker, rec.hooks():
        loss, out = M.run_forward(row, model, inputs)
    if ck:
        ck.active = False
    h.remove()
    totals = rec.totals()
    res = {
        "saved_hooks_bytes": totals["saved_bytes"],
        "saved_forward_bytes": totals["saved_forward_bytes"],
        "saved_loss_bytes": totals["saved_loss_bytes"],
        "dropout_mask_bytes": totals["dropout_mask_bytes"],
    }
    ck_keys: dict[int, int] = {}
    if ck:
        for t in ck.tensors:
            k = M.storage_key(t)
            if k in exclude or k in rec.keys:
                continue
            n = M.storage_nbytes(t)
            if n:
                ck_keys[k] = n
        res["checkpointed_layers"] = ck.layers
    res["checkpoint_inputs_bytes"] = sum(ck_keys.values())
    res["saved_bytes"] = res["saved_hooks_bytes"] + res["checkpoint_inputs_bytes"]
    held = {}
    for t in M.collect_tensors(out):
        k = M.storage_key(t)
        if k in exclude or k in rec.keys or k in ck_keys or not M.storage_nbytes(t):
            continue
        held[k] = M.storage_nbytes(t)
    res["caller_held_bytes"] = sum(held.values())
    res["saved_by_module"] = saved_by_module(rec)
    res["saved_layer1"] = saved_list_layer(rec, 1)
    del loss, out
    return res


def delta_at_mark(prof, name: str) -> int:
    """Cumulative allocator delta at the first phase mark `name` (events before it)."""
    roots = prof.profiler.kineto_results.experimental_event_tree()
    allocs, mark_ts = [], None
    for n in M._walk(roots):
        if str(n.tag).endswith("Allocation"):
            allocs.append((n.start_time_ns, n.extra_fields.alloc_size))
        elif n.name == M.PHASE_MARK + name and mark_ts is None:
            mark_ts = n.start_time_ns
    return sum(sz for ts, sz in allocs if mark_ts is not None and ts < mark_ts)


def measure_train(row: dict) -> dict:
    model, head = build(row)
    model.train()
    inputs = M.make_inputs(row)
    params, buffers = M.model_tensors(model)
    qst = quant_state_tensors(model)
    trainable = [p for p in params if p.requires_grad]
    all_keys = {M.storage_key(t) for t in params + buffers + qst}
    opt = torch.optim.AdamW(trainable, foreach=True)
    tracker = M.ModuleTracker(model, profile_ranges=True)
    results = {}
    for step in ("first", "steady"):
        for p in params:
            p.grad = None
        gc.collect()
        pbytes = M.unique_bytes(params + buffers)
        qbytes = M.unique_bytes(qst)
        gbytes = M.unique_bytes([p.grad for p in params])
        sbytes = M.unique_bytes(M.optimizer_state_tensors(opt))
        ibytes = M.unique_bytes(inputs.values())
        baseline = pbytes + qbytes + gbytes + sbytes + ibytes
        rec = M.SavedRecorder(all_keys, None)

        def to_loss():
            rec.phase = "loss"
            M.mark("loss")

        h = M.head_hook(head, to_loss)
        t0 = time.time()
        with M.dropout_mode(True), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            M.mark("forward")
            with tracker, rec.hooks():
                loss, out = M.run_forward(row, model, inputs)
            held = {M.storage_key(t) for t in M.collect_tensors(out)} - rec.keys - all_keys
            M.mark("backward")
            loss.backward()
            grad_keys = {M.storage_key(p.grad) for p in trainable if p.grad is not None}
            del loss, out
            M.mark("optimizer")
            opt.step()
            state_keys = {M.storage_key(t) for t in M.optimizer_state_tensors(opt)}
            opt.zero_grad(set_to_none=True)
            M.mark("end")
        h.remove()
        tags = {
            "saved_activations": (set(rec.keys), ("forward", "loss")),
            "caller_held_outputs": (held, ("forward", "loss")),
            "weight_grads": (grad_keys, ("backward",)),
            "adam_state": (state_keys, ("optimizer",)),
        }
        res = M.analyse_profile(prof, baseline, tags)
        res["forward_retained_bytes"] = delta_at_mark(prof, "backward")
        res.update({"seconds": round(time.time() - t0, 1), "baseline_bytes": baseline, "params_bytes": pbytes,
                    "quant_state_bytes": qbytes, "grads_before_bytes": gbytes, "adam_state_before_bytes": sbytes,
                    "inputs_bytes": ibytes})
        res["adam_state_after_bytes"] = M.unique_bytes(M.optimizer_state_tensors(opt))
        results[f"foreach_free_{step}"] = res
        del prof
        gc.collect()
    return results


def measure_row(row: dict, log) -> dict:
    t0 = time.time()
    out = {k: row[k] for k in CONFIG_FIELDS}
    model, _ = build(row)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    qst = quant_state_tensors(model)
    out["params_total"] = sum(p.numel() for p in params)  # Params4bit: packed uint8 elements
    out["params_trainable"] = sum(p.numel() for p in trainable)
    out["params_bytes"] = M.unique_bytes(params)
    out["trainable_bytes"] = M.unique_bytes(trainable)
    out["frozen_bytes"] = out["params_bytes"] - out["trainable_bytes"]
    out["buffers_bytes"] = M.unique_bytes(list(model.buffers()))
    out["quant_state_bytes"] = M.unique_bytes(qst)
    out["param_dtypes"] = sorted({str(p.dtype).replace("torch.", "") for p in params})
    if row["method"] == "qlora":
        import bitsandbytes as bnb

        w4 = [m.weight for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        out["linear4bit_layers"] = len(w4)
        out["packed_weight_bytes"] = M.unique_bytes(w4)
        qs = w4[0].quant_state
        out["quant_state_example"] = {
            "shape": list(qs.shape), "blocksize": qs.blocksize, "quant_type": qs.quant_type,
            "absmax": f"{list(qs.absmax.shape)} {str(qs.absmax.dtype).replace('torch.', '')}",
            "code": f"{list(qs.code.shape)} {str(qs.code.dtype).replace('torch.', '')}",
            "nested": qs.nested,
            "state2_absmax": f"{list(qs.state2.absmax.shape)} {str(qs.state2.absmax.dtype).replace('torch.', '')}"
            if qs.nested else None,
            "state2_blocksize": qs.state2.blocksize if qs.nested else None,
            "state2_code": f"{list(qs.state2.code.shape)} {str(qs.state2.code.dtype).replace('torch.', '')}"
            if qs.nested else None,
            "packed_weight": f"{list(w4[0].shape)} {str(w4[0].dtype).replace('torch.', '')}",
            "dtype": str(qs.dtype).replace("torch.", ""),
        }
    if row["method"] != "full":
        layers = lora_layers(model)
        out["lora_layers"] = len(layers)
        out["lora_target_names"] = sorted({n.rsplit(".", 1)[-1] for n in layers})
        out["lora_adapter_dtype"] = str(next(p for n, p in model.named_parameters() if "lora_A" in n).dtype)
    del model
    out.update(measure_saved(row))
    log(f"  saved {out['saved_bytes']:,} (hooks {out['saved_hooks_bytes']:,} + ckpt inputs "
        f"{out['checkpoint_inputs_bytes']:,}) held {out['caller_held_bytes']:,} trainable "
        f"{out['params_trainable']:,}  [{time.time() - t0:.0f}s]")
    steps = measure_train(row)
    for k, v in steps.items():
        out[f"train_{k}_peak_bytes"] = v["peak_bytes"]
        out[f"train_{k}_peak_phase"] = v["peak_phase"]
        out[f"train_{k}_peak_op"] = v["peak_op"]
        out[f"train_{k}_forward_retained_bytes"] = v["forward_retained_bytes"]
        for ph in M.PHASES:
            out[f"train_{k}_{ph}_max_bytes"] = v["phase_max_bytes"].get(ph, 0)
    out["train_steps"] = steps
    out["seconds"] = round(time.time() - t0, 1)
    log("  train " + " ".join(f"{k}={v['peak_bytes']:,}@{v['peak_phase']} (fwd retained "
                              f"{v['forward_retained_bytes']:,})" for k, v in steps.items())
        + f"  [{out['seconds']}s]")
    return out


METHOD = {
    "model": "small Llama GQA from LlamaConfig (measure.build_model), random init, CPU; precision fp32, or "
             "bf16 = model.bfloat16() (no autocast; adapters fp32 by PEFT's autocast_adapter_dtype=True)",
    "lora": "peft.get_peft_model(model, LoraConfig(r, lora_alpha=16, target_modules, lora_dropout, bias='none', "
            "task_type='CAUSAL_LM')); targets 'q_proj,v_proj' or 'all-linear' (all nn.Linear except lm_head)",
    "grad_ckpt": "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) "
                 "before get_peft_model (transformers 5 then calls enable_input_require_grads()); qlora: "
                 "prepare_model_for_kbit_training(use_gradient_checkpointing=gc, same kwargs)",
    "qlora": "decoder-layer nn.Linear -> bnb.nn.Linear4bit(nf4, compress_statistics=True, compute fp32), "
             "quantized by bitsandbytes' CPU backend (dequantize whole weight + F.linear in forward and backward); "
             "model.is_loaded_in_4bit = True; embed_tokens, norms, lm_head fp32 (bf16 rows: bf16 model, compute "
             "bf16, prepare_model_for_kbit_training casts the non-4-bit params to fp32)",
    "saved_hooks_bytes": "saved_tensors_hooks during one training forward + loss, unique storages, params, "
                         "buffers and quant state excluded; dropout via torch.native_dropout (bool mask, as CUDA)",
    "checkpoint_inputs_bytes": "gradient checkpointing: tensors passed to each checkpointed decoder layer (args + "
                               "partial keywords), unique storages not in the saved set",
    "saved_bytes": "saved_hooks_bytes + checkpoint_inputs_bytes",
    "caller_held_bytes": "tensors reachable from the output object that autograd did not save (logits)",
    "saved_by_module": "unique saved storages (hooks) by the module that first saved them; layers 0, 1 and "
                       "everything outside the layers (names without PEFT's 'base_model.model.' prefix)",
    "train_peak": "baseline (all params + buffers + quant state + grads before + AdamW state before + inputs, "
                  "exact) + max cumulative delta of torch.profiler CPU allocator events over forward, loss, "
                  "backward, outputs dropped, optimizer.step(), zero_grad(set_to_none=True)",
    "variants": "foreach_free_first: no grads, no AdamW state before; foreach_free_steady: AdamW state of "
                "the trainable params present (from the first step), no grads before",
    "forward_retained_bytes": "allocator delta at the start of backward: what forward + loss left alive "
                              "(saved, checkpoint inputs, logits, loss)",
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    root = os.path.dirname(HERE)
    ap.add_argument("--out", default=os.path.join(root, "tests", "fixtures", "finetune", "lora_measured.json"))
    ap.add_argument("--only", default="", help="regex on row ids")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sel = [r for r in rows() if re.search(args.only, r["id"])]
    if args.list:
        print("\n".join(r["id"] for r in sel))
        return 0
    import accelerate
    import bitsandbytes
    import peft
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                "bitsandbytes": bitsandbytes.__version__, "accelerate": accelerate.__version__,
                "python": platform.python_version()}
    t0 = time.time()
    measured = []
    for i, row in enumerate(sel):
        print(f"[{i + 1}/{len(sel)}] {row['id']}", flush=True)
        measured.append(measure_row(row, lambda m: print(m, flush=True)))
    doc = {
        "schema_version": SCHEMA_VERSION,
        "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": versions,
        "device": "cpu",
        "threads": args.threads,
        "method": METHOD,
        "seconds": round(time.time() - t0, 1),
        "rows": measured,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out} ({len(measured)} rows, {doc['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

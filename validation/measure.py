#!/usr/bin/env python3
"""Measure what PyTorch really holds in one training step (CPU, random init) and write the
reference fixture that oomprobe's plans are checked against.

Run it with the venv that validation/setup.sh creates:

    validation/setup.sh && "${OOMPROBE_VENV:-$HOME/.cache/oomprobe-validation-venv}/bin/python" \
        validation/measure.py

Per row (one model config at one shape) it measures:

* saved bytes: tensors saved for backward during one training forward (model + loss), seen by
  torch.autograd.graph.saved_tensors_hooks, deduplicated by storage, parameters and buffers
  excluded. Dropout runs as CUDA runs it (torch.native_dropout, 1-byte bool mask); the plain CPU
  path (fp32 noise tensor) is measured too, as `saved_bytes_cpu_dropout`.
* caller-held bytes: tensors the returned output object keeps alive that autograd did not save
  (HF logits, the KV cache of use_cache).
* the training step peak for grads free/keep x first/steady Adam step, with Adam foreach=True
  (CUDA's default) and foreach=False (CPU's default), from the CPU allocator's events in
  torch.profiler(profile_memory=True): peak = bytes live before the step (computed exactly from
  the tensors) + the max cumulative delta of the allocator's events. Phase and op at the peak,
  and what is live at the peak by kind.
* the inference peak: eval(), no_grad, one forward.

No weights or data are downloaded: every model is built from a config with random init.
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
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

SCHEMA_VERSION = 1
PHASES = ("forward", "loss", "backward", "optimizer")
PHASE_MARK = "oomprobe::phase::"
MODULE_MARK = "oomprobe::module::"

# ----------------------------------------------------------------------------------------------
# Dropout as CUDA runs it. On CUDA, at::dropout takes the fused path (native_dropout: output +
# bool mask, NativeDropoutBackward0 saves the 1-byte mask). On CPU it takes _dropout_impl
# (bernoulli_ noise in the input's dtype, MulBackward0 saves the fp32 noise: 4 bytes/element).
# native_dropout has a CPU kernel with the CUDA semantics, so routing F.dropout there makes the
# CPU step hold what a CUDA step holds. p == 0 or eval() stays on the original path (which
# returns the input unchanged on both devices: no op, nothing saved).
# ----------------------------------------------------------------------------------------------
_ORIGINAL_DROPOUT = F.dropout


def _cuda_like_dropout(input, p=0.5, training=True, inplace=False):  # noqa: A002
    if training and 0.0 < p < 1.0 and input.numel() > 0 and not inplace:
        return torch.native_dropout(input, p, True)[0]
    return _ORIGINAL_DROPOUT(input, p, training, inplace)


@contextlib.contextmanager
def dropout_mode(cuda_like: bool):
    F.dropout = _cuda_like_dropout if cuda_like else _ORIGINAL_DROPOUT
    try:
        yield
    finally:
        F.dropout = _ORIGINAL_DROPOUT


# ----------------------------------------------------------------------------------------------
# Tensor accounting helpers
# ----------------------------------------------------------------------------------------------


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def unique_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        n = storage_nbytes(t)
        if n:
            seen[storage_key(t)] = n
    return sum(seen.values())


def model_tensors(model: torch.nn.Module):
    params = list(model.parameters())
    buffers = list(model.buffers())
    return params, buffers


def optimizer_state_tensors(opt: torch.optim.Optimizer):
    out = []
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


def collect_tensors(obj, depth: int = 0, seen: set | None = None) -> list[torch.Tensor]:
    """Every tensor reachable from a model output object (ModelOutput, tuples, HF Cache)."""
    if seen is None:
        seen = set()
    if depth > 6 or id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    out: list[torch.Tensor] = []
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        items = list(vars(obj).values())
    else:
        items = []
    for it in items:
        out.extend(collect_tensors(it, depth + 1, seen))
    return out


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


def build_model(row: dict) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model (random init, fp32) and the module whose output is the logits (loss starts after it)."""
    torch.manual_seed(0)
    arch = row["arch"]
    p = row["dropout"]
    if arch in ("gpt2",):
        import transformers

        cfg = transformers.GPT2Config(
            vocab_size=row["vocab"],
            n_positions=row["max_positions"],
            n_embd=row["hidden"],
            n_layer=row["layers"],
            n_head=row["heads"],
            n_inner=row["ffn"],
            activation_function=row["gelu"],
            resid_pdrop=p,
            embd_pdrop=p,
            attn_pdrop=p,
            use_cache=row["use_cache"],
            tie_word_embeddings=row["tied_embeddings"],
        )
        model = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")
        head = model.lm_head
    elif arch == "bert":
        import transformers

        cfg = transformers.BertConfig(
            vocab_size=row["vocab"],
            hidden_size=row["hidden"],
            num_hidden_layers=row["layers"],
            num_attention_heads=row["heads"],
            intermediate_size=row["ffn"],
            hidden_act=row["gelu"],
            hidden_dropout_prob=p,
            attention_probs_dropout_prob=p,
            max_position_embeddings=row["max_positions"],
            tie_word_embeddings=row["tied_embeddings"],
        )
        model = transformers.BertForMaskedLM._from_config(cfg, attn_implementation="eager")
        head = model.cls
    elif arch == "vit":
        import transformers

        cfg = transformers.ViTConfig(
            hidden_size=row["hidden"],
            num_hidden_layers=row["layers"],
            num_attention_heads=row["heads"],
            intermediate_size=row["ffn"],
            hidden_act=row["gelu"],
            hidden_dropout_prob=p,
            attention_probs_dropout_prob=p,
            image_size=row["image"],
            patch_size=row["patch"],
            num_labels=row["classes"],
        )
        model = transformers.ViTForImageClassification._from_config(cfg, attn_implementation="eager")
        head = model.classifier
    elif arch == "resnet50":
        import torchvision

        model = torchvision.models.resnet50(weights=None, num_classes=row["classes"])
        head = model.fc
    else:
        raise ValueError(f"unknown arch {arch}")
    if arch != "resnet50":
        impl = model.config._attn_implementation
        if impl != "eager":
            raise RuntimeError(f"{arch}: attention implementation is {impl}, expected eager")
    return model.float(), head


def make_inputs(row: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    b = row["batch"]
    arch = row["arch"]
    if arch == "gpt2":
        ids = torch.randint(0, row["vocab"], (b, row["seq"]), generator=g)
        return {"input_ids": ids, "labels": ids}
    if arch == "bert":
        ids = torch.randint(0, row["vocab"], (b, row["seq"]), generator=g)
        labels = ids.clone()
        keep = torch.rand(ids.shape, generator=g) < 0.15  # the 15 % masked positions
        labels[~keep] = -100
        return {"input_ids": ids, "labels": labels}
    if arch in ("vit", "resnet50"):
        px = torch.randn(b, 3, row["image"], row["image"], generator=g)
        y = torch.randint(0, row["classes"], (b,), generator=g)
        return {"pixel_values": px, "labels": y}
    raise ValueError(arch)


def precision_context(row: dict):
    """fp32 rows run as they are; autocast-bf16 rows run forward and loss under CPU autocast."""
    if row["precision"] == "autocast-bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def run_forward(row: dict, model, inputs, with_labels: bool = True):
    """One forward in the model's own way; returns (loss or None, output object)."""
    with precision_context(row):
        return _run_forward(row, model, inputs, with_labels)


def _run_forward(row: dict, model, inputs, with_labels: bool):
    if row["arch"] == "resnet50":
        logits = model(inputs["pixel_values"])
        loss = F.cross_entropy(logits, inputs["labels"]) if with_labels else None
        return loss, logits
    kwargs = dict(inputs)
    if not with_labels:
        kwargs.pop("labels")
    out = model(**kwargs)
    return (out.loss if with_labels else None), out


# ----------------------------------------------------------------------------------------------
# Module context: which module is running (for saved-tensor attribution and the profiler)
# ----------------------------------------------------------------------------------------------


class ModuleTracker:
    def __init__(self, model: torch.nn.Module, profile_ranges: bool):
        self.names = {id(m): (n or "<model>") for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.ranges: list[Any] = []
        self.profile_ranges = profile_ranges
        self.handles: list[Any] = []

    def __enter__(self):
        from torch.nn.modules import module as mm

        def pre(mod, _inp):
            name = self.names.get(id(mod))
            if name is None:
                return
            self.stack.append(name)
            if self.profile_ranges:
                rf = record_function(MODULE_MARK + (name or "<model>"))
                rf.__enter__()
                self.ranges.append(rf)

        def post(mod, _inp, _out):
            if self.names.get(id(mod)) is None:
                return
            self.stack.pop()
            if self.profile_ranges:
                self.ranges.pop().__exit__(None, None, None)

        self.handles = [
            mm.register_module_forward_pre_hook(pre),
            mm.register_module_forward_hook(post),
        ]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        while self.ranges:
            self.ranges.pop().__exit__(None, None, None)

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else "<outside>"


def mark(phase: str):
    with record_function(PHASE_MARK + phase):
        pass


# ----------------------------------------------------------------------------------------------
# Saved tensors
# ----------------------------------------------------------------------------------------------


VIEW_NODES = ("TBackward0", "TransposeBackward0", "ViewBackward0", "PermuteBackward0", "ExpandBackward0",
              "UnsqueezeBackward0", "SqueezeBackward0", "AsStridedBackward0", "ReshapeAliasBackward0")


def is_param_cast(t: torch.Tensor) -> bool:
    """A dtype cast of a parameter (autocast's weight-cast cache), possibly seen through views."""
    node = t.grad_fn
    for _ in range(4):
        if node is None:
            return False
        if node.name() == "ToCopyBackward0":
            nxt = [n for n, _ in node.next_functions if n is not None]
            return len(nxt) == 1 and nxt[0].name() == "torch::autograd::AccumulateGrad"
        if node.name() not in VIEW_NODES:
            return False
        nxt = [n for n, _ in node.next_functions if n is not None]
        node = nxt[0] if len(nxt) == 1 else None
    return False


class SavedRecorder:
    """saved_tensors_hooks that record every saved tensor and keep memory behaviour unchanged:
    pack returns a detached alias (same storage, no grad_fn: no reference cycle)."""

    def __init__(self, exclude_keys: set[int], tracker: ModuleTracker | None):
        self.exclude = exclude_keys
        self.tracker = tracker
        self.phase = "forward"
        self.records: list[dict] = []
        self.keys: set[int] = set()
        self.cast_keys: set[int] = set()  # autocast's low-precision copies of parameters

    def pack(self, t: torch.Tensor):
        key = storage_key(t)
        rec = {
            "key": key,
            "storage_bytes": storage_nbytes(t),
            "shape": list(t.shape),
            "dtype": str(t.dtype).replace("torch.", ""),
            "numel": t.numel(),
            "param": key in self.exclude,
            "weight_cast": key not in self.exclude and is_param_cast(t),
            "phase": self.phase,
            "module": self.tracker.current if self.tracker else "",
        }
        self.records.append(rec)
        if rec["weight_cast"]:
            self.cast_keys.add(key)
        elif not rec["param"]:
            self.keys.add(key)
        return t.detach()

    @staticmethod
    def unpack(t):
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def totals(self) -> dict[str, int]:
        by_phase: dict[str, dict[int, int]] = {"forward": {}, "loss": {}}
        first_phase: dict[int, str] = {}
        bool_bytes: dict[int, int] = {}
        casts: dict[int, int] = {}
        for r in self.records:
            if r["weight_cast"]:
                casts[r["key"]] = r["storage_bytes"]
            if r["param"] or r["weight_cast"] or r["storage_bytes"] == 0:
                continue
            ph = first_phase.setdefault(r["key"], r["phase"])
            by_phase[ph][r["key"]] = r["storage_bytes"]
            if r["dtype"] == "bool":
                bool_bytes[r["key"]] = r["storage_bytes"]
        fwd = sum(by_phase["forward"].values())
        loss = sum(by_phase["loss"].values())
        return {
            "saved_bytes": fwd + loss,
            "saved_forward_bytes": fwd,
            "saved_loss_bytes": loss,
            "dropout_mask_bytes": sum(bool_bytes.values()),
            "weight_cast_bytes": sum(casts.values()),
        }


def head_hook(head: torch.nn.Module, on_output: Callable[[], None]):
    return head.register_forward_hook(lambda *_: on_output())


def measure_saved(row: dict, cuda_like_dropout: bool, breakdown: bool = False) -> dict:
    model, head = build_model(row)
    model.train()
    inputs = make_inputs(row)
    params, buffers = model_tensors(model)
    exclude = {storage_key(t) for t in params + buffers}
    tracker = ModuleTracker(model, profile_ranges=False)
    rec = SavedRecorder(exclude, tracker)

    def to_loss():
        rec.phase = "loss"

    h = head_hook(head, to_loss)
    with dropout_mode(cuda_like_dropout), tracker, rec.hooks():
        loss, out = run_forward(row, model, inputs)
    h.remove()
    totals = rec.totals()
    held = [t for t in collect_tensors(out) if storage_key(t) not in rec.keys | rec.cast_keys]
    held_keys = {storage_key(t): storage_nbytes(t) for t in held}
    for k in list(held_keys):
        if k in exclude or held_keys[k] == 0:
            del held_keys[k]
    totals["caller_held_bytes"] = sum(held_keys.values())
    totals["caller_held"] = sorted(
        {(tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in held if storage_key(t) in held_keys}
    )
    if breakdown:
        totals["breakdown"] = saved_breakdown(loss, rec, out, held_keys)
    del loss, out
    return totals


def saved_breakdown(loss, rec: SavedRecorder, out, held_keys) -> dict:
    """Per storage: which grad_fn saved which view of it, in which module."""
    by_key_nodes: dict[int, list[str]] = defaultdict(list)
    seen = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                val = getattr(node, attr)
            except Exception:  # noqa: BLE001 - some saved attributes cannot be read back
                continue
            vals = val if isinstance(val, (list, tuple)) else [val]
            for v in vals:
                if isinstance(v, torch.Tensor) and v.untyped_storage().nbytes():
                    by_key_nodes[storage_key(v)].append(
                        f"{node.name()}.{attr[len('_saved_'):]} {list(v.shape)} {str(v.dtype).replace('torch.', '')}"
                    )
        for nxt, _ in node.next_functions:
            stack.append(nxt)
    storages: dict[int, dict] = {}
    order = 0
    for r in rec.records:
        if r["param"] or r["storage_bytes"] == 0:
            continue
        if r["weight_cast"]:
            r = dict(r, module=r["module"] + " [weight cast]")
        s = storages.get(r["key"])
        if s is None:
            s = storages[r["key"]] = {
                "order": order,
                "module": r["module"],
                "phase": r["phase"],
                "storage_bytes": r["storage_bytes"],
                "saved_as": [],
                "saved_by": sorted(set(by_key_nodes.get(r["key"], []))),
            }
            order += 1
        s["saved_as"].append(f"{r['shape']} {r['dtype']}")
    for s in storages.values():
        s["saved_as"] = sorted(set(s["saved_as"]))
    entries = sorted(storages.values(), key=lambda s: s["order"])
    for e in entries:
        del e["order"]
    held = [
        {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "storage_bytes": storage_nbytes(t)}
        for t in collect_tensors(out)
        if storage_key(t) in held_keys
    ]
    return {"saved": entries, "caller_held": held}


# ----------------------------------------------------------------------------------------------
# Profiled steps
# ----------------------------------------------------------------------------------------------


def _walk(nodes):
    stack = list(nodes)
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children)


def alloc_context(n) -> str:
    """'<autograd node or module> / <outermost aten op>' for an allocation event."""
    op = ""
    p = n.parent
    while p is not None and p.name.startswith("aten::"):
        op = p.name
        p = p.parent
    ctx = ""
    while p is not None and not ctx:
        if p.name.startswith(MODULE_MARK):
            ctx = p.name[len(MODULE_MARK):]
        elif not p.name.startswith(PHASE_MARK):
            ctx = p.name.replace("autograd::engine::evaluate_function: ", "")
        p = p.parent
    return f"{ctx or '-'} / {op or '-'}"


def analyse_profile(prof, baseline: int, tagged: dict[str, tuple[set[int], tuple[str, ...]]]) -> dict:
    """Live-bytes curve from the allocator's events; peak, phase, op and what is live there."""
    roots = prof.profiler.kineto_results.experimental_event_tree()
    allocs = []
    marks = []
    for n in _walk(roots):
        tag = str(n.tag)
        if tag.endswith("Allocation"):
            allocs.append(n)
        elif n.name.startswith(PHASE_MARK):
            marks.append((n.start_time_ns, n.name[len(PHASE_MARK):]))
    allocs.sort(key=lambda n: n.start_time_ns)
    marks.sort()

    def phase_at(ts: int) -> str:
        ph = "before"
        for mts, name in marks:
            if mts <= ts:
                ph = name
            else:
                break
        return ph

    live: dict[int, tuple[int, Any, str]] = {}  # ptr -> (bytes, event, phase at alloc)
    cum = 0
    peak_delta = 0
    peak_i = -1
    peak_live_snapshot: dict[int, tuple[int, Any, str]] = {}
    freed_pre_step = 0
    freed_pre_at_peak = 0
    phase_peaks: dict[str, int] = {}
    for i, n in enumerate(allocs):
        ef = n.extra_fields
        size = ef.alloc_size
        cum += size
        ph = phase_at(n.start_time_ns)
        if size > 0:
            live[ef.ptr] = (size, n, ph)
        else:
            if ef.ptr in live:
                del live[ef.ptr]
            else:
                freed_pre_step += -size
        phase_peaks[ph] = max(phase_peaks.get(ph, cum), cum)
        if cum > peak_delta:
            peak_delta = cum
            peak_i = i
            freed_pre_at_peak = freed_pre_step
            peak_live_snapshot = dict(live)
    end_delta = cum
    peak_phase = "before"
    peak_op = ""
    peak_stack: list[str] = []
    if peak_i >= 0:
        ev = allocs[peak_i]
        peak_phase = phase_at(ev.start_time_ns)
        p = ev.parent
        while p is not None:
            peak_stack.append(p.name)
            p = p.parent
        ops = [s for s in peak_stack if s.startswith("aten::")]
        peak_op = ops[0] if ops else (peak_stack[0] if peak_stack else "")
    # What is live at the peak (beyond the baseline), by kind and by allocating op
    kinds: dict[str, int] = defaultdict(int)
    by_op: dict[str, int] = defaultdict(int)
    for ptr, (size, n, ph) in peak_live_snapshot.items():
        kind = None
        for name, (ptrs, phases) in tagged.items():
            if ptr in ptrs and ph in phases:
                kind = name
                break
        kinds[kind or f"other_{ph}"] += size
        by_op[f"{ph}: {alloc_context(n)}"] += size
    top_ops = sorted(by_op.items(), key=lambda kv: -kv[1])[:8]
    return {
        "peak_bytes": baseline + peak_delta,
        "peak_delta_bytes": peak_delta,
        "end_delta_bytes": end_delta,
        "peak_phase": peak_phase,
        "peak_op": peak_op,
        "peak_stack": [s for s in peak_stack if not s.startswith(MODULE_MARK)][:6],
        "peak_module": next((s[len(MODULE_MARK):] for s in peak_stack if s.startswith(MODULE_MARK)), ""),
        "live_at_peak_new": dict(sorted(kinds.items())),
        "baseline_freed_before_peak_bytes": freed_pre_at_peak,
        "top_live_allocations_at_peak": [{"what": k, "bytes": v} for k, v in top_ops],
        "phase_max_bytes": {ph: baseline + v for ph, v in phase_peaks.items()},
        "events": len(allocs),
    }


def measure_train_steps(row: dict, foreach_modes=(True, False), saved_hooks: bool = True) -> dict:
    """Four variants (grads free/keep x first/steady) per Adam foreach mode."""
    model, head = build_model(row)
    model.train()
    inputs = make_inputs(row)
    params, buffers = model_tensors(model)
    param_keys = {storage_key(t) for t in params + buffers}
    results: dict[str, dict] = {}
    tracker = ModuleTracker(model, profile_ranges=True)
    for foreach in foreach_modes:
        for grads in ("free", "keep"):
            opt = torch.optim.Adam(params, foreach=foreach)
            for step in ("first", "steady"):
                for p in params:
                    p.grad = torch.zeros_like(p) if grads == "keep" else None
                gc.collect()
                pbytes = unique_bytes(params + buffers)
                gbytes = unique_bytes([p.grad for p in params])
                sbytes = unique_bytes(optimizer_state_tensors(opt))
                ibytes = unique_bytes(inputs.values())
                baseline = pbytes + gbytes + sbytes + ibytes
                rec = SavedRecorder(param_keys, None)

                def to_loss():
                    rec.phase = "loss"
                    mark("loss")

                h = head_hook(head, to_loss)
                t_step = time.time()
                saving = rec.hooks() if saved_hooks else contextlib.nullcontext()
                with dropout_mode(True), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    mark("forward")
                    with tracker, saving:
                        loss, out = run_forward(row, model, inputs)
                    held = {storage_key(t) for t in collect_tensors(out)} - rec.keys - rec.cast_keys - param_keys
                    mark("backward")
                    loss.backward()
                    grad_keys = {storage_key(p.grad) for p in params if p.grad is not None}
                    del loss, out  # a training_step returns here: its outputs die before optimizer.step()
                    mark("optimizer")
                    opt.step()
                    state_keys = {storage_key(t) for t in optimizer_state_tensors(opt)}
                    opt.zero_grad(set_to_none=(grads == "free"))
                    mark("end")
                h.remove()
                # a pointer names a tensor only among allocations of the phase that made it
                tags = {
                    "saved_activations": (set(rec.keys), ("forward", "loss")),
                    "weight_casts": (set(rec.cast_keys), ("forward", "loss")),
                    "caller_held_outputs": (held, ("forward", "loss")),
                    "weight_grads": (grad_keys, ("backward",)),
                    "adam_state": (state_keys, ("optimizer",)),
                }
                res = analyse_profile(prof, baseline, tags)
                res.update(
                    {
                        "seconds": round(time.time() - t_step, 1),
                        "baseline_bytes": baseline,
                        "params_bytes": pbytes,
                        "grads_before_bytes": gbytes,
                        "adam_state_before_bytes": sbytes,
                        "inputs_bytes": ibytes,
                    }
                )
                results[f"{'foreach' if foreach else 'forloop'}_{grads}_{step}"] = res
                del prof
                gc.collect()
    for p in params:
        p.grad = None
    return results


def measure_inference(row: dict) -> dict:
    model, _head = build_model(row)
    model.eval()
    inputs = make_inputs(row)
    params, buffers = model_tensors(model)
    gc.collect()
    pbytes = unique_bytes(params + buffers)
    ibytes = unique_bytes([v for k, v in inputs.items() if k != "labels"])
    baseline = pbytes + ibytes
    tracker = ModuleTracker(model, profile_ranges=True)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        mark("forward")
        with tracker:
            _loss, out = run_forward(row, model, inputs, with_labels=False)
        held = {storage_key(t) for t in collect_tensors(out)}
        mark("end")
    res = analyse_profile(prof, baseline, {"outputs": (held, ("forward",))})
    res["end_held_bytes"] = unique_bytes(collect_tensors(out))
    res["baseline_bytes"] = baseline
    del out
    return res


# ----------------------------------------------------------------------------------------------
# Rows
# ----------------------------------------------------------------------------------------------

GPT2 = dict(arch="gpt2", hidden=768, layers=12, heads=12, ffn=3072, vocab=50257, max_positions=1024,
            tied_embeddings=True, image=0, patch=0, classes=0, head="lm")
BERT = dict(arch="bert", hidden=768, layers=12, heads=12, ffn=3072, vocab=30522, max_positions=512,
            tied_embeddings=True, image=0, patch=0, classes=0, gelu="gelu", use_cache=False, head="mlm")
VIT = dict(arch="vit", hidden=768, layers=12, heads=12, ffn=3072, vocab=0, max_positions=0,
           tied_embeddings=False, image=224, patch=16, classes=1000, gelu="gelu", use_cache=False,
           head="classifier")
RESNET = dict(arch="resnet50", hidden=0, layers=50, heads=0, ffn=0, vocab=0, max_positions=0,
              tied_embeddings=False, patch=0, classes=1000, gelu="", use_cache=False, dropout=0.0,
              head="classifier")


def all_rows(autocast: bool = True) -> list[dict]:
    """Every row; the committed fixture is the fp32 ones (autocast=False)."""
    rows = []
    for variant, gelu, cache in (("hf", "gelu_new", True), ("fused", "gelu_pytorch_tanh", False)):
        for p in (0.1, 0.0):
            for b, s in ((1, 128), (2, 256)):
                rows.append(dict(GPT2, model=f"gpt2-{variant}", gelu=gelu, use_cache=cache, dropout=p,
                                 batch=b, seq=s))
    for p in (0.1, 0.0):
        for b, s in ((1, 128), (2, 256)):
            rows.append(dict(BERT, model="bert-base", dropout=p, batch=b, seq=s))
    for p in (0.1, 0.0):
        for b in (1, 2):
            rows.append(dict(VIT, model="vit-b16", dropout=p, batch=b, seq=(224 // 16) ** 2 + 1))
    for b, img in ((1, 224), (2, 224), (2, 128)):
        rows.append(dict(RESNET, model="resnet50", batch=b, image=img, seq=0))
    for r in rows:
        r["precision"] = "fp32"
    # CPU autocast bf16 (params, grads and Adam state stay fp32; CPU's autocast op lists, not CUDA's).
    # Opt-in (--autocast): on a CPU without AVX512-BF16 the bf16 matmuls are emulated and slow.
    if autocast:
        rows += autocast_rows()
    for r in rows:
        r["id"] = row_id(r)
    return rows


def autocast_rows() -> list[dict]:
    """CPU autocast-bf16 rows. The first two are full GPT-2 / ViT-B (slow: minutes per step where
    the CPU emulates bf16); the `-mini` rows are the same architectures at a small width and depth
    (2 layers, hidden 256), which check the per-op dtypes in seconds per row."""
    rows = []
    rows.append(dict(GPT2, model="gpt2-fused", gelu="gelu_pytorch_tanh", use_cache=False, dropout=0.0,
                     batch=1, seq=128, precision="autocast-bf16"))
    rows.append(dict(VIT, model="vit-b16", dropout=0.0, batch=1, seq=197, precision="autocast-bf16"))
    mini = dict(hidden=256, layers=2, heads=4, ffn=1024)
    for variant, gelu, cache, p in (("hf", "gelu_new", True, 0.1), ("fused", "gelu_pytorch_tanh", False, 0.0)):
        rows.append(dict(GPT2, **mini, model=f"gpt2-{variant}-mini", gelu=gelu, use_cache=cache, dropout=p,
                         vocab=8000, max_positions=256, batch=2, seq=128, precision="autocast-bf16"))
    rows.append(dict(BERT, **mini, model="bert-mini", dropout=0.1, vocab=8000, max_positions=256, batch=2,
                     seq=128, precision="autocast-bf16"))
    rows.append(dict(VIT, **mini, model="vit-mini", dropout=0.0, image=96, classes=100, batch=2,
                     seq=(96 // 16) ** 2 + 1, precision="autocast-bf16"))
    return rows


def row_id(r: dict) -> str:
    shape = f"b{r['batch']}-s{r['seq']}" if r["arch"] in ("gpt2", "bert") else f"b{r['batch']}-i{r['image']}"
    prec = "" if r["precision"] == "fp32" else f"-{r['precision']}"
    return f"{r['model']}-p{r['dropout']:g}-{shape}{prec}"


BREAKDOWN_IDS = {
    "gpt2-fused-p0-b1-s128-autocast-bf16",
    "gpt2-hf-mini-p0.1-b2-s128-autocast-bf16",
    "gpt2-fused-mini-p0-b2-s128-autocast-bf16",
    "bert-mini-p0.1-b2-s128-autocast-bf16",
    "vit-mini-p0-b2-i96-autocast-bf16",
    "vit-b16-p0-b1-i224-autocast-bf16",
    "gpt2-hf-p0.1-b1-s128",
    "gpt2-fused-p0.1-b1-s128",
    "bert-base-p0.1-b1-s128",
    "vit-b16-p0.1-b1-i224",
    "resnet50-p0-b1-i224",
}

CONFIG_FIELDS = ("id", "model", "arch", "precision", "hidden", "layers", "heads", "ffn", "vocab",
                 "max_positions", "batch", "seq", "image", "patch", "classes", "dropout", "gelu",
                 "use_cache", "tied_embeddings", "head")


def measure_row(row: dict, breakdown: bool, log) -> tuple[dict, dict | None]:
    t0 = time.time()
    out = {k: row[k] for k in CONFIG_FIELDS}
    model, _ = build_model(row)
    out["params"] = sum(p.numel() for p in model.parameters())
    out["params_bytes"] = unique_bytes(list(model.parameters()))
    out["buffers_bytes"] = unique_bytes(list(model.buffers()))
    del model
    saved = measure_saved(row, cuda_like_dropout=True, breakdown=breakdown)
    bd = saved.pop("breakdown", None)
    out.update({k: v for k, v in saved.items() if k != "caller_held"})
    out["caller_held"] = [f"{list(s)} {d}" for s, d in saved["caller_held"]]
    if row["dropout"] > 0:
        raw = measure_saved(row, cuda_like_dropout=False)
        out["saved_bytes_cpu_dropout"] = raw["saved_bytes"]
    else:
        out["saved_bytes_cpu_dropout"] = out["saved_bytes"]
    log(f"  saved {out['saved_bytes']:,} (cpu dropout {out['saved_bytes_cpu_dropout']:,}) "
        f"held {out['caller_held_bytes']:,}  [{time.time() - t0:.0f}s]")
    forloop_too = breakdown and row["precision"] == "fp32"
    steps = measure_train_steps(row, (True, False) if forloop_too else (True,))
    for name, res in steps.items():
        out[f"train_{name}_peak_bytes"] = res["peak_bytes"]
        out[f"train_{name}_peak_phase"] = res["peak_phase"]
        out[f"train_{name}_peak_op"] = res["peak_op"]
        for ph in PHASES:
            out[f"train_{name}_{ph}_max_bytes"] = res["phase_max_bytes"].get(ph, 0)
    out["train_steps"] = steps
    log("  train peaks " + " ".join(f"{k}={v['peak_bytes'] / 2**20:.1f}MiB@{v['peak_phase']}"
                                     for k, v in steps.items()) + f"  [{time.time() - t0:.0f}s]")
    inf = measure_inference(row)
    out["inference_peak_bytes"] = inf["peak_bytes"]
    out["inference_peak_op"] = inf["peak_op"]
    out["inference"] = inf
    out["seconds"] = round(time.time() - t0, 1)
    log(f"  inference peak {inf['peak_bytes'] / 2**20:.1f}MiB  [{out['seconds']}s]")
    return out, bd


METHOD = {
    "saved_bytes": "saved_tensors_hooks during one training forward + loss, unique storages, "
                   "params and buffers excluded; dropout via torch.native_dropout (bool mask, as CUDA)",
    "saved_bytes_cpu_dropout": "same with PyTorch's CPU dropout path (fp32 bernoulli noise saved)",
    "caller_held_bytes": "tensors reachable from the returned output object (logits, KV cache) "
                         "that autograd did not save",
    "train_peak": "baseline (params+buffers+grads before+Adam state before+inputs, exact) + max "
                  "cumulative delta of torch.profiler CPU allocator events over forward, loss, "
                  "backward, outputs dropped, optimizer.step(), zero_grad",
    "variants": "train_{foreach|forloop}_{free|keep}_{first|steady}: Adam foreach=True (CUDA default) "
                "or False (CPU default); grads free = zero_grad(set_to_none=True) and no grads before "
                "the step, keep = grads exist before and zero_grad(set_to_none=False); first = no Adam "
                "state before the step, steady = Adam state present",
    "inference_peak": "eval(), no_grad, one forward without labels: params+buffers+inputs + max delta",
}


def write_fixture(path: str, rows: list[dict], versions: dict, threads: int, seconds: float, merge: bool) -> int:
    doc = {
        "schema_version": SCHEMA_VERSION,
        "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": versions,
        "device": "cpu",
        "threads": threads,
        "method": METHOD,
        "seconds": seconds,
        "rows": rows,
    }
    if merge and os.path.exists(path):
        old = json.load(open(path))
        if old.get("versions") != versions:
            print(f"measure.py: --merge: {path} was measured with {old.get('versions')}", file=sys.stderr)
            return 2
        mine = {r["id"] for r in rows}
        order = [r["id"] for r in all_rows()]
        kept = [r for r in old["rows"] if r["id"] not in mine]
        doc["rows"] = sorted(kept + rows, key=lambda r: order.index(r["id"]) if r["id"] in order else 1e9)
        doc["seconds"] = round(old.get("seconds", 0) + seconds, 1)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
        f.write("\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    ap.add_argument("--out", default=os.path.join(root, "tests", "fixtures", "validation.json"))
    ap.add_argument("--autocast-out", default=os.path.join(root, "tests", "fixtures", "validation_autocast.json"),
                    help="where the autocast rows go (a separate file: the fp32 fixture's reader models fp32)")
    ap.add_argument("--breakdown-out", default=os.path.join(here, "saved_breakdown.json"))
    ap.add_argument("--only", default="", help="regex on row ids")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--autocast", action="store_true",
                    help="also the CPU autocast-bf16 rows (slow where the CPU has no native bf16)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of an existing --out file that this run does not measure (same versions only)")
    ap.add_argument("--check-hooks", action="store_true",
                    help="measure the matching rows' steps with and without the saved-tensor hooks and compare")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [r for r in all_rows(args.autocast) if re.search(args.only, r["id"])]
    if args.list:
        print("\n".join(r["id"] for r in rows))
        return 0
    if not rows:
        print(f"measure.py: no row matches --only {args.only!r}", file=sys.stderr)
        return 2

    def log(msg):
        print(msg, flush=True)

    if args.check_hooks:
        bad = 0
        for row in rows:
            a = measure_train_steps(row, (True,), saved_hooks=True)
            b = measure_train_steps(row, (True,), saved_hooks=False)
            for k in a:
                same = a[k]["peak_bytes"] == b[k]["peak_bytes"] and a[k]["phase_max_bytes"] == b[k]["phase_max_bytes"]
                bad += not same
                log(f"{row['id']} {k}: with hooks {a[k]['peak_bytes']:,} {a[k]['phase_max_bytes']} "
                    f"without {b[k]['peak_bytes']:,} {b[k]['phase_max_bytes']} {'same' if same else 'DIFFERENT'}")
        return 1 if bad else 0

    import torchvision
    import transformers

    measured = []
    breakdowns = {}
    t0 = time.time()
    for i, row in enumerate(rows):
        log(f"[{i + 1}/{len(rows)}] {row['id']}")
        res, bd = measure_row(row, row["id"] in BREAKDOWN_IDS, log)
        measured.append(res)
        if bd is not None:
            breakdowns[row["id"]] = bd
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torchvision": torchvision.__version__,
        "python": platform.python_version(),
    }
    seconds = round(time.time() - t0, 1)
    for path, group in ((args.out, [r for r in measured if r["precision"] == "fp32"]),
                        (args.autocast_out, [r for r in measured if r["precision"] != "fp32"])):
        if group and write_fixture(path, group, versions, args.threads, seconds, args.merge) != 0:
            return 2
        if group:
            log(f"wrote {path} ({len(group)} rows measured now)")
    if breakdowns:
        if args.merge and os.path.exists(args.breakdown_out):
            old_bd = json.load(open(args.breakdown_out))["rows"]
            breakdowns = {**{k: v for k, v in old_bd.items() if k not in breakdowns}, **breakdowns}
        with open(args.breakdown_out, "w") as f:
            json.dump({"versions": versions, "rows": breakdowns}, f, indent=1)
            f.write("\n")
        log(f"wrote {args.breakdown_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Measure what bitsandbytes < 0.44's MatMul4Bit keeps alive in a QLoRA training step (its
`ctx.tensors = (A, B)`: the 4-bit linear's input A held as a plain ctx attribute), against the
stock 0.50.2 function, on CPU (random init, nothing downloaded); writes
tests/fixtures/finetune/bnb_legacy_measured.json.

    "${OOMPROBE_VENV:-$HOME/.cache/oomprobe-validation-venv}/bin/python" validation/measure_bnb_legacy.py --threads 1

Versions: torch 2.15.0, transformers 5.24.0, peft 0.21.2, bitsandbytes 0.50.2 (CPU backend),
accelerate 1.15.0 (validation/setup.sh's pins). The 0.42.0 code is not installed: it is replayed.

What 0.42.0 did (mirror TimDettmers/bitsandbytes, tag 0.42.0):

* bitsandbytes/autograd/_functions.py:494-548 `class MatMul4Bit`: forward (:499) dequantizes the
  whole weight and runs F.linear (:516), then `if any(ctx.needs_input_grad[:2]): ctx.tensors =
  (A, B)` (:522-523): A, the linear's input, is a ctx ATTRIBUTE, not ctx.save_for_backward.
  backward (:529) reads `A, B = ctx.tensors` (:536) and computes grad_A only (:546).
  Identical at 0.41.0 (:523) and 0.43.1 (:516); 0.44 keeps `ctx.tensors = (None, B)` (0.50.2:
  autograd/_functions.py:357-358).
* _functions.py:565-577 `matmul_4bit`: every input that is not a single row goes to
  MatMul4Bit.apply (:577).
* bitsandbytes/nn/modules.py:256 `Linear4bit.forward`: `bnb.matmul_4bit(x, self.weight.t(), ...)`.

PyTorch's engine releases only a node's saved_variables after it runs; ctx attributes live as
long as the node, i.e. as long as anything references the graph (the loss / logits the training
loop still holds). Saved-tensor hooks (non-reentrant checkpointing's included) never see them.

The replay: `MatMul4Bit_0_42_0` below is 0.42.0's forward and backward verbatim (prod(A.shape),
ctx.tensors = (A, B), grad_A via dequantize + matmul), calling the installed 0.50.2
`bitsandbytes.functional.dequantize_4bit` (its BC shim returns [K, N] for the transposed
[1, n] packed weight, as 0.42.0's did). 0.50.2's Linear4bit.forward (nn/modules.py:637) calls
`bnb.matmul_4bit(x, self.weight, ...)` through the package attribute, so the replay is
installed as `bitsandbytes.matmul_4bit` = a wrapper that passes `self.weight.t()` (0.42.0's
Linear4bit call) to 0.42.0's matmul_4bit. A check (fixture "replay_check") shows that it is
called once per Linear4bit per forward, that its output and input gradient equal the stock
function's within bf16 rounding, and that its node holds A while the stock node does not.
The stock 0.50.2 matmul_4bit (autograd/_functions.py:407-490) calls MatMul4Bit only when
`A.requires_grad or bias.requires_grad` (:453) and runs the gemm_4bit op, saving only B.

Model and rows: measure_lora.py's small Llama GQA (hidden 256, ffn 688, 4 layers, 8 heads, 2 kv
heads, vocab 1024, untied head, sdpa; b2 s192), bf16 = model.bfloat16(); every nn.Linear of the
decoder layers -> bnb.nn.Linear4bit nf4, no double quant, compute bfloat16 (and, "quant_head",
lm_head too, as Lightning Fabric's BitsandbytesPrecision without ignore_modules); NO
prepare_model_for_kbit_training (norms, embeddings, lm_head stay bf16, as LitGPT trains); PEFT
LoRA (lora_alpha 16, adapters fp32 by PEFT's autocast_adapter_dtype); AdamW(trainable,
foreach=True), zero_grad(set_to_none=True). Gradient checkpointing (the -gc row):
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
before get_peft_model (transformers 5 also calls enable_input_require_grads()).

Loops:

* kept (measure_lora.measure_train, reused): out = model(input_ids, labels); out.loss.backward();
  del loss, out; optimizer.step(); zero_grad. train_foreach_free_{first,steady}_* as in
  lora_measured.json (peak = exact baseline + max cumulative torch.profiler allocator delta).
* next (LitGPT's loop): two steps, each `out = model(input_ids=..., labels=...)`; `loss =
  out.loss`; `loss.backward()`; `loss = loss.item()`; optimizer.step(); zero_grad. Step 1's `out`
  is only rebound when step 2's model(...) returns, so step 1's logits and graph (and, legacy,
  every ctx-held A) live through step 2's forward. Both steps in one profile; next_steady_* =
  exact baseline before step 1 (params + buffers + quant state + inputs; no grads, no AdamW
  state) + the maximum cumulative allocator delta within step 2 (from its forward mark to after
  its zero_grad); next_steady_forward_end_bytes = live when step 2's model(...) is about to
  return (a forward hook on the PEFT model, after the loss), before `out` is rebound.

Rows: legacy-kept-qv-p05 / modern-kept-qv-p05 (no checkpointing, lm_head bf16, LoRA r8 q,v,
dropout 0.05), legacy-kept-qv-p05-qhead, legacy-next-qv-p05-qhead / modern-next-qv-p05-qhead;
held out: legacy-next-all-p0-qhead (LoRA on every linear, dropout 0), legacy-kept-qv-p05-gc, and
their stock controls modern-next-all-p0-qhead, modern-kept-qv-p05-gc.

ctx_held_bytes (legacy rows): the unique storages of the A tensors the replayed forward put in
ctx.tensors during one training forward (the recorder runs in the saved-bytes pass);
ctx_held_unsaved_bytes: those among them autograd does not also save (saved-tensor hooks) and
that are not checkpoint inputs: what 0.42.0 adds. next_*_head_input_freed: when lm_head's input
(the final norm's output) is freed, from the profile (stock: after the loss, when
LlamaForCausalLM.forward returns and drops its `outputs`; legacy: kept by the head's ctx).

Results and reading: validation/bnb_legacy_notes.md. Takes about 2 minutes with --threads 1.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import operator
import os
import re
import sys
import time
import warnings
from collections import defaultdict
from functools import reduce
from warnings import warn

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import measure as M  # noqa: E402
import measure_lora as L  # noqa: E402

from torch.profiler import ProfilerActivity, profile  # noqa: E402

SCHEMA_VERSION = 1
LEGACY = "0.42.0"
STOCK = "stock 0.50.2"

# ----------------------------------------------------------------------------------------------
# bitsandbytes 0.42.0's MatMul4Bit, replayed
# ----------------------------------------------------------------------------------------------


def prod(iterable):
    return reduce(operator.mul, iterable, 1)


class CtxRecorder:
    """Counts replayed calls; while `active`, records each A that a replayed ctx keeps."""

    def __init__(self):
        self.calls = 0
        self.active = False
        self.held: dict[int, int] = {}  # storage key -> nbytes
        self.held_shapes: list[str] = []
        self.held_where: dict[int, str] = {}  # storage key -> "module | shape dtype" (first keeper)
        self.tracker = None

    def reset(self):
        self.held, self.held_shapes, self.held_where, self.tracker = {}, [], {}, None


REC = CtxRecorder()


class MatMul4Bit_0_42_0(torch.autograd.Function):  # noqa: N801
    """bitsandbytes 0.42.0 autograd/_functions.py:494-548, verbatim but for the recorder."""

    @staticmethod
    def forward(ctx, A, B, out=None, bias=None, quant_state=None):
        import bitsandbytes.functional as F

        REC.calls += 1
        # default of pytorch behavior if inputs are empty
        ctx.is_empty = False
        if prod(A.shape) == 0:
            ctx.is_empty = True
            ctx.A = A
            ctx.B = B
            ctx.bias = bias
            B_shape = quant_state.shape
            if A.shape[-1] == B_shape[0]:
                return torch.empty(A.shape[:-1] + B_shape[1:], dtype=A.dtype, device=A.device)
            else:
                return torch.empty(A.shape[:-1] + B_shape[:1], dtype=A.dtype, device=A.device)

        # 1. Dequantize
        # 2. MatmulnN
        output = torch.nn.functional.linear(A, F.dequantize_4bit(B, quant_state).to(A.dtype).t(), bias)

        # 3. Save state
        ctx.state = quant_state
        ctx.dtype_A, ctx.dtype_B, ctx.dtype_bias = A.dtype, B.dtype, None if bias is None else bias.dtype

        if any(ctx.needs_input_grad[:2]):
            ctx.tensors = (A, B)
            if REC.active and A.untyped_storage().nbytes():
                REC.held[M.storage_key(A)] = M.storage_nbytes(A)
                what = f"{list(A.shape)} {str(A.dtype).replace('torch.', '')}"
                REC.held_shapes.append(what)
                where = L.short(REC.tracker.current) if REC.tracker else ""
                REC.held_where.setdefault(M.storage_key(A), f"{where} | {what}")
        else:
            ctx.tensors = (None, None)

        return output

    @staticmethod
    def backward(ctx, grad_output):
        import bitsandbytes.functional as F

        if ctx.is_empty:
            bias_grad = None if ctx.bias is None else torch.zeros_like(ctx.bias)
            return torch.zeros_like(ctx.A), torch.zeros_like(ctx.B), None, bias_grad, None

        req_gradA, _, _, req_gradBias, _ = ctx.needs_input_grad
        A, B = ctx.tensors

        grad_A, grad_B, grad_bias = None, None, None

        if req_gradBias:
            # compute grad_bias first before changing grad_output dtype
            grad_bias = grad_output.sum(0, dtype=ctx.dtype_bias)

        # not supported by PyTorch. TODO: create work-around
        # if req_gradB: grad_B = torch.matmul(grad_output.t(), A)
        if req_gradA:
            grad_A = torch.matmul(grad_output, F.dequantize_4bit(B, ctx.state).to(grad_output.dtype).t())

        return grad_A, grad_B, None, grad_bias, None


_STOCK_MATMUL_4BIT = None


def matmul_4bit_0_42_0(A, B, quant_state, out=None, bias=None):
    """0.42.0 _functions.py:565-577; B is 0.42.0's `self.weight.t()`. The single-row
    inference branch (gemv) never runs in training; it goes to the stock function."""
    assert quant_state is not None
    if A.numel() == A.shape[-1] and A.requires_grad == False:  # noqa: E712
        if A.shape[-1] % quant_state.blocksize != 0:
            warn(f"Some matrices hidden dimension is not a multiple of {quant_state.blocksize} ...")
            return MatMul4Bit_0_42_0.apply(A, B, out, bias, quant_state)
        return _STOCK_MATMUL_4BIT(A, B.t(), quant_state=quant_state, out=out, bias=bias)
    return MatMul4Bit_0_42_0.apply(A, B, out, bias, quant_state)


def replay_entry(A, B, quant_state=None, out=None, bias=None):
    """Installed as bitsandbytes.matmul_4bit: 0.50.2's Linear4bit.forward passes self.weight,
    0.42.0's passed self.weight.t() (nn/modules.py:256)."""
    return matmul_4bit_0_42_0(A, B.t(), quant_state, out=out, bias=bias)


@contextlib.contextmanager
def bnb_mode(replay: str):
    """replay == LEGACY: bitsandbytes.matmul_4bit -> 0.42.0's; else the stock function."""
    global _STOCK_MATMUL_4BIT
    import bitsandbytes as bnb

    if _STOCK_MATMUL_4BIT is None:
        _STOCK_MATMUL_4BIT = bnb.matmul_4bit
    if replay == LEGACY:
        bnb.matmul_4bit = replay_entry
    try:
        yield
    finally:
        bnb.matmul_4bit = _STOCK_MATMUL_4BIT


def replay_check() -> dict:
    """One Linear4bit (256 -> 688, nf4, bf16): stock vs replay output and input gradient; the
    replay's node holds A; calls per model forward = Linear4bit count."""
    import bitsandbytes as bnb

    torch.manual_seed(0)
    lin = to_linear4bit(torch.nn.Linear(256, 688, bias=False).bfloat16(), torch.bfloat16)
    x = torch.randn(2, 192, 256, dtype=torch.bfloat16)
    res = {}
    outs = {}
    for mode in (STOCK, LEGACY):
        xi = x.clone().requires_grad_(True)
        before = REC.calls
        with bnb_mode(mode):
            y = lin(xi)
        node_tensors = getattr(y.grad_fn, "tensors", None)
        res[f"{'replay' if mode == LEGACY else 'stock'}_node"] = type(y.grad_fn).__name__
        y.float().square().sum().backward()
        outs[mode] = (y.detach(), xi.grad)
        res[f"replay_calls_{'replay' if mode == LEGACY else 'stock'}_mode"] = REC.calls - before
        res[f"{'replay' if mode == LEGACY else 'stock'}_node_holds_input"] = bool(
            node_tensors is not None and node_tensors[0] is not None and node_tensors[0] is xi)
    (y0, g0), (y1, g1) = outs[STOCK], outs[LEGACY]
    res["max_abs_diff_output"] = float((y0.float() - y1.float()).abs().max())
    res["max_abs_output"] = float(y0.float().abs().max())
    res["max_abs_diff_grad_input"] = float((g0.float() - g1.float()).abs().max())
    res["max_abs_grad_input"] = float(g0.float().abs().max())
    res["output_equal"] = bool(torch.equal(y0, y1))
    res["allclose_bf16"] = bool(torch.allclose(y0.float(), y1.float(), rtol=2e-2, atol=2e-2)
                                and torch.allclose(g0.float(), g1.float(), rtol=2e-2, atol=2e-2))
    # in the model: one replayed call per Linear4bit per forward
    row = rows()[2]  # legacy, quantized head
    model, _ = build(row)
    n4 = sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    inputs = M.make_inputs(row)
    before = REC.calls
    with bnb_mode(LEGACY), M.dropout_mode(True):
        model(**inputs)
    res["model_linear4bit"] = n4
    res["model_replay_calls_per_forward"] = REC.calls - before
    return res


# ----------------------------------------------------------------------------------------------
# Rows and model
# ----------------------------------------------------------------------------------------------


def rows() -> list[dict]:
    spec = [
        # id, replay, targets, dropout, grad_ckpt, quant_head, loop, holdout
        ("legacy-kept-qv-p05", LEGACY, "q_proj,v_proj", 0.05, False, False, "kept", False),
        ("modern-kept-qv-p05", STOCK, "q_proj,v_proj", 0.05, False, False, "kept", False),
        ("legacy-kept-qv-p05-qhead", LEGACY, "q_proj,v_proj", 0.05, False, True, "kept", False),
        ("legacy-next-qv-p05-qhead", LEGACY, "q_proj,v_proj", 0.05, False, True, "next", False),
        ("modern-next-qv-p05-qhead", STOCK, "q_proj,v_proj", 0.05, False, True, "next", False),
        ("legacy-next-all-p0-qhead", LEGACY, "all-linear", 0.0, False, True, "next", True),
        ("legacy-kept-qv-p05-gc", LEGACY, "q_proj,v_proj", 0.05, True, False, "kept", True),
        # the held-out rows' stock controls (measured after the plan was fixed, for the notes)
        ("modern-next-all-p0-qhead", STOCK, "all-linear", 0.0, False, True, "next", True),
        ("modern-kept-qv-p05-gc", STOCK, "q_proj,v_proj", 0.05, True, False, "kept", True),
    ]
    out = []
    for rid, replay, targets, p, gc_, qhead, loop, holdout in spec:
        r = dict(L.BASE, method="qlora", rank=8, lora_alpha=L.LORA_ALPHA, targets=targets, lora_dropout=p,
                 grad_ckpt=gc_, attn_implementation="sdpa", precision="bf16", quant_type="nf4",
                 double_quant=False, compute_dtype="bfloat16", optimizer="AdamW(trainable, foreach=True)",
                 zero_grad="set_to_none=True")
        M.fill_config_defaults(r)
        r.update(id=rid, bnb_replay=replay, quant_head=qhead, loop=loop, holdout=holdout)
        out.append(r)
    return out


def to_linear4bit(mod: torch.nn.Linear, compute_dtype: torch.dtype, double_quant: bool = False):
    """nn.Linear -> bnb.nn.Linear4bit nf4 quantized on the CPU (as measure_lora.
    quantize_decoder_linears, but double quant optional: off here)."""
    import bitsandbytes as bnb

    q = bnb.nn.Linear4bit(mod.in_features, mod.out_features, bias=mod.bias is not None,
                          compute_dtype=compute_dtype, compress_statistics=double_quant, quant_type="nf4")
    q.weight = bnb.nn.Params4bit(mod.weight.data.clone(), requires_grad=False, compress_statistics=double_quant,
                                 quant_type="nf4", module=q)
    q = q.to("cpu")
    if not getattr(q.weight, "bnb_quantized", False):
        raise RuntimeError("bitsandbytes did not quantize the weight on CPU")
    return q


def quantize(model: torch.nn.Module, compute_dtype: torch.dtype, double_quant: bool, head: bool) -> int:
    """Every nn.Linear of the decoder layers (and, head=True, lm_head) -> Linear4bit."""
    n = 0
    for layer in model.model.layers:
        for name, mod in list(layer.named_modules()):
            if type(mod) is not torch.nn.Linear:
                continue
            parent = layer.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer
            setattr(parent, name.rsplit(".", 1)[-1], to_linear4bit(mod, compute_dtype, double_quant))
            n += 1
    if head:
        model.lm_head = to_linear4bit(model.lm_head, compute_dtype, double_quant)
        n += 1
    model.is_loaded_in_4bit = True  # what transformers' bnb quantizer sets; PEFT dispatches on it
    return n


def build(row: dict):
    """(PEFT model, head module) of a row: bf16 model, 4-bit linears, no
    prepare_model_for_kbit_training, checkpointing (row) before get_peft_model."""
    from peft import LoraConfig, get_peft_model

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    model, head = M.build_model(row)
    quantize(model, getattr(torch, row["compute_dtype"]), row["double_quant"], row["quant_head"])
    head = model.lm_head
    if row["grad_ckpt"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    targets = row["targets"] if row["targets"] == "all-linear" else row["targets"].split(",")
    cfg = LoraConfig(r=row["rank"], lora_alpha=row["lora_alpha"], target_modules=targets,
                     lora_dropout=row["lora_dropout"], bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, cfg), head


# measure_lora's measure_saved / measure_train / measure_row build through its module-level build
L.build = build


# ----------------------------------------------------------------------------------------------
# Measurements
# ----------------------------------------------------------------------------------------------


def measure_ctx(row: dict) -> dict:
    """One training forward + loss: what the replayed ctx keeps (legacy rows; 0 for stock)."""
    model, head = build(row)
    model.train()
    inputs = M.make_inputs(row)
    params, buffers = M.model_tensors(model)
    exclude = {M.storage_key(t) for t in params + buffers + L.quant_state_tensors(model)}
    tracker = M.ModuleTracker(model, profile_ranges=False)
    rec = M.SavedRecorder(exclude, tracker)
    ck = L.CheckpointInputs(model) if row["grad_ckpt"] else None
    REC.reset()
    REC.active = True
    REC.tracker = tracker
    if ck:
        ck.active = True
    with bnb_mode(row["bnb_replay"]), M.dropout_mode(True), tracker, rec.hooks():
        loss, out = M.run_forward(row, model, inputs)
    REC.active = False
    ck_keys = {M.storage_key(t) for t in ck.tensors} if ck else set()
    held = dict(REC.held)
    unsaved = {k: v for k, v in held.items() if k not in rec.keys and k not in ck_keys and k not in exclude}
    shapes: dict[str, int] = defaultdict(int)
    for s in REC.held_shapes:
        shapes[s] += 1
    res = {
        "ctx_held_bytes": sum(held.values()),
        "ctx_held_unsaved_bytes": sum(unsaved.values()),
        "ctx_held_storages": len(held),
        "ctx_held_tensors": len(REC.held_shapes),
        "ctx_held_shapes": dict(sorted(shapes.items())),
        # layer 1 and outside the layers: each held storage, where first kept, whether autograd saves it too
        "ctx_held_layer1": [f"{w} | {held[k]} | {'saved' if k not in unsaved else 'not saved'}"
                            for k, w in REC.held_where.items()
                            if w.startswith("model.layers.1.") or not w.startswith("model.layers.")],
    }
    # the held storages autograd saves as well: the module that first saved each, its saved view
    also: dict[str, int] = defaultdict(int)
    seen = set()
    for r in rec.records:
        if r["key"] in held and r["key"] not in unsaved and r["key"] not in seen:
            seen.add(r["key"])
            mod = re.sub(r"^model\.layers\.\d+\.", "model.layers.N.", L.short(r["module"]))
            also[f"{mod} | {r['shape']} {r['dtype']}"] += r["storage_bytes"]
    res["ctx_held_also_saved_by"] = dict(sorted(also.items()))
    del loss, out
    REC.reset()
    return res


def _phase_of(name: str) -> tuple[int, str] | None:
    """'s2:backward' -> (2, 'backward'); the forward-end marks are not phases."""
    step, _, ph = name.partition(":")
    if not step.startswith("s") or ph in ("forward_end", "head_in"):
        return None
    return int(step[1:]), ph


def analyse_two_steps(prof, baseline: int, head_ptrs: dict[int, int]) -> dict:
    """Per step window [sN:forward, sN:end]: peak = baseline + max cumulative delta, its phase,
    op and what is live there; the live bytes at the window's start and at sN:forward_end."""
    allocs, marks = M.allocations_and_marks(prof)
    phase_marks = [(ts, _phase_of(nm)) for ts, nm in marks if _phase_of(nm)]
    mark_ts = {nm: ts for ts, nm in marks}

    def phase_at(ts):
        cur = (0, "before")
        for mts, ph in phase_marks:
            if mts <= ts:
                cur = ph
            else:
                break
        return cur

    def delta_before(ts):
        return sum(a.extra_fields.alloc_size for a in allocs if a.start_time_ns < ts)

    out = {}
    for step in (1, 2):
        t0, t1 = mark_ts[f"s{step}:forward"], mark_ts[f"s{step}:end"]
        cum = delta_before(t0)
        start = cum
        peak, peak_ev = cum, None
        phase_max: dict[str, int] = {}
        live: dict[int, tuple[int, object, str]] = {}
        snap = {}
        for a in allocs:  # live allocations made inside the profile, for the peak's breakdown
            ts = a.start_time_ns
            if ts >= t1:
                break
            ef = a.extra_fields
            st, ph = phase_at(ts)
            if ef.alloc_size > 0:
                live[ef.ptr] = (ef.alloc_size, a, f"s{st}:{ph}")
            else:
                live.pop(ef.ptr, None)
            if ts < t0:
                continue
            cum += ef.alloc_size
            phase_max[ph] = max(phase_max.get(ph, cum), cum)
            if cum > peak:
                peak, peak_ev, snap = cum, a, dict(live)
        by: dict[str, int] = defaultdict(int)
        for size, n, ph in snap.values():
            by[f"{ph}: {M.alloc_context(n)}"] += size
        peak_phase, peak_op = "start", ""
        if peak_ev is not None:
            peak_phase = phase_at(peak_ev.start_time_ns)[1]
            p, ops = peak_ev.parent, []
            while p is not None:
                if p.name.startswith("aten::"):
                    ops.append(p.name)
                p = p.parent
            peak_op = ops[0] if ops else ""
        key = "next_first" if step == 1 else "next_steady"
        out[f"{key}_peak_bytes"] = baseline + peak
        out[f"{key}_peak_phase"] = peak_phase
        out[f"{key}_peak_op"] = peak_op
        out[f"{key}_start_bytes"] = baseline + start
        out[f"{key}_forward_end_bytes"] = baseline + delta_before(mark_ts[f"s{step}:forward_end"])
        out[f"{key}_end_bytes"] = baseline + cum
        for ph in M.PHASES:
            out[f"{key}_{ph}_max_bytes"] = baseline + phase_max[ph] if ph in phase_max else 0
        # when lm_head's input (the final norm's output) is freed: before / after the loss's last
        # nll_loss_forward, before step N's model(...) returns, or later
        hin = mark_ts[f"s{step}:head_in"]
        ptr = head_ptrs[step]
        free = next((a.start_time_ns for a in allocs if a.start_time_ns > hin and a.extra_fields.ptr == ptr
                     and a.extra_fields.alloc_size < 0), None)
        nll = max((n.end_time_ns for n in M._walk(roots) if n.name == "aten::nll_loss_forward"
                   and t0 <= n.start_time_ns < t1), default=None)
        fend = mark_ts[f"s{step}:forward_end"]
        out[f"{key}_head_input_freed"] = (
            "not freed in the profile" if free is None else
            "before the loss" if nll is None or free < nll else
            "after the loss, before the model returns" if free < fend else
            "after the model returns, before backward" if free < mark_ts[f"s{step}:backward"] else
            f"in step {step}'s {phase_at(free)[1]}" if free < t1 else "after the step")
        out[f"{key}_top_live_at_peak"] = [{"what": k, "bytes": v}
                                          for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:10]]
    return out


def measure_next(row: dict) -> dict:
    """LitGPT's loop, two steps; step 1's `out` rebound only when step 2's forward returns."""
    model, head = build(row)
    model.train()
    inputs = M.make_inputs(row)
    params, buffers = M.model_tensors(model)
    qst = L.quant_state_tensors(model)
    trainable = [p for p in params if p.requires_grad]
    opt = torch.optim.AdamW(trainable, foreach=True)
    gc.collect()
    pbytes = M.unique_bytes(params + buffers)
    qbytes = M.unique_bytes(qst)
    ibytes = M.unique_bytes(inputs.values())
    baseline = pbytes + qbytes + ibytes  # no grads, no AdamW state before step 1
    step = [0]
    head_ptrs: dict[int, int] = {}

    def head_in(_mod, args):
        head_ptrs[step[0]] = M.storage_key(args[0])
        M.mark(f"s{step[0]}:head_in")

    h0 = head.register_forward_pre_hook(head_in)
    h1 = M.head_hook(head, lambda: M.mark(f"s{step[0]}:loss"))
    h2 = model.register_forward_hook(lambda *_: M.mark(f"s{step[0]}:forward_end"))
    t0 = time.time()
    with bnb_mode(row["bnb_replay"]), M.dropout_mode(True), \
            profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = None
        for s in (1, 2):
            step[0] = s
            M.mark(f"s{s}:forward")
            out = model(input_ids=inputs["input_ids"], labels=inputs["labels"])  # step 1's out lives until here
            loss = out.loss
            M.mark(f"s{s}:backward")
            loss.backward()
            loss = loss.item()
            M.mark(f"s{s}:optimizer")
            opt.step()
            opt.zero_grad(set_to_none=True)
            M.mark(f"s{s}:end")
        del out
    h0.remove()
    h1.remove()
    h2.remove()
    res = analyse_two_steps(prof, baseline, head_ptrs)
    sbytes = M.unique_bytes(M.optimizer_state_tensors(opt))
    res.update({
        "next_baseline_bytes": baseline,
        "next_params_buffers_bytes": pbytes,
        "next_quant_state_bytes": qbytes,
        "next_inputs_bytes": ibytes,
        "next_adam_state_bytes": sbytes,
        # what step 1 left alive when step 2 starts, beyond params + quant state + inputs + AdamW state
        "next_step1_leftover_bytes": res["next_steady_start_bytes"] - baseline - sbytes,
        "next_seconds": round(time.time() - t0, 1),
    })
    del prof
    gc.collect()
    return res


def measure(row: dict, log) -> dict:
    t0 = time.time()
    with bnb_mode(row["bnb_replay"]):
        out = L.measure_row(row, log)  # params, saved bytes, kept-loop first / steady steps
    out = {k: row[k] for k in ("id", "bnb_replay", "quant_head", "loop", "holdout")} | out
    out.update(measure_ctx(row))
    log(f"  ctx held {out['ctx_held_bytes']:,} (not otherwise saved {out['ctx_held_unsaved_bytes']:,}, "
        f"{out['ctx_held_tensors']} tensors, {out['ctx_held_storages']} storages)")
    if row["loop"] == "next":
        out.update(measure_next(row))
        log(f"  next: step2 peak {out['next_steady_peak_bytes']:,}@{out['next_steady_peak_phase']} "
            f"start {out['next_steady_start_bytes']:,} fwd end {out['next_steady_forward_end_bytes']:,} "
            f"step1 leftover {out['next_step1_leftover_bytes']:,}; step1 peak {out['next_first_peak_bytes']:,}"
            f"@{out['next_first_peak_phase']}")
    out["seconds"] = round(time.time() - t0, 1)
    return out


METHOD = dict(L.METHOD, **{
    "model": "measure_lora's small Llama GQA (sdpa, b2 s192), bf16 = model.bfloat16(); every decoder nn.Linear "
             "(and lm_head when quant_head) -> bnb.nn.Linear4bit nf4, no double quant, compute bfloat16; NO "
             "prepare_model_for_kbit_training (norms, embeddings, lm_head stay bf16); PEFT LoRA r8 alpha 16 "
             "(adapters fp32); AdamW(trainable, foreach=True); zero_grad(set_to_none=True)",
    "bnb_replay": "'0.42.0': bitsandbytes.matmul_4bit replaced by a replay of 0.42.0's matmul_4bit + MatMul4Bit "
                  "(ctx.tensors = (A, B), A a ctx attribute), called with self.weight.t() as 0.42.0's "
                  "Linear4bit.forward; 'stock 0.50.2': the installed function (ctx.tensors = (None, B))",
    "loop": "kept: measure_lora.measure_train (outputs dropped after backward); next: LitGPT's loop, step 1's "
            "output object rebound only when step 2's forward returns, loss rebound to loss.item()",
    "next_steady": "baseline before step 1 (params + buffers + quant state + inputs) + max cumulative allocator "
                   "delta within step 2 (its forward mark .. after its zero_grad); phase: forward / loss (after "
                   "lm_head) / backward / optimizer; forward_end: live as step 2's model(...) returns (a forward "
                   "hook on the PEFT model), before step 1's output is rebound; next_first: the same for step 1",
    "next_head_input_freed": "from the profile: when lm_head's input storage is freed relative to the step's "
                             "last aten::nll_loss_forward, its model(...) return and backward",
    "next_step1_leftover_bytes": "live at step 2's start - baseline - AdamW state: what step 1's output object "
                                 "(logits, loss, graph) still holds",
    "ctx_held_bytes": "legacy: unique storages of the A tensors the replayed forward stored in ctx.tensors in one "
                      "training forward; ctx_held_unsaved_bytes: those autograd does not also save (hooks) and "
                      "that are no checkpoint input",
})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    root = os.path.dirname(HERE)
    ap.add_argument("--out", default=os.path.join(root, "tests", "fixtures", "finetune", "bnb_legacy_measured.json"))
    ap.add_argument("--only", default="", help="regex on row ids")
    ap.add_argument("--threads", type=int, default=1)
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

    t0 = time.time()
    check = replay_check()
    print("replay check:", check, flush=True)
    if not (check["replay_calls_replay_mode"] == 1 and check["replay_calls_stock_mode"] == 0 and check["replay_node_holds_input"]
            and not check["stock_node_holds_input"] and check["allclose_bf16"]
            and check["model_replay_calls_per_forward"] == check["model_linear4bit"]):
        raise SystemExit("the replay check failed")
    measured = []
    for i, row in enumerate(sel):
        print(f"[{i + 1}/{len(sel)}] {row['id']}", flush=True)
        r = measure(row, lambda m: print(m, flush=True))
        measured.append(r)
    import json
    import platform

    import transformers

    doc = {
        "schema_version": SCHEMA_VERSION,
        "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                     "bitsandbytes": bitsandbytes.__version__, "bitsandbytes_replayed": LEGACY,
                     "accelerate": accelerate.__version__, "python": platform.python_version()},
        "device": "cpu",
        "threads": args.threads,
        "method": METHOD,
        "replay_check": check,
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

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
  (CUDA's default) and foreach=False (CPU's default). first = the real first step: no gradients
  and no Adam state before it (keep or free; with keep, backward creates the gradients and
  zero_grad(set_to_none=False) keeps them); steady = Adam state before it, and with keep the
  gradients too. From the CPU allocator's events in
  torch.profiler(profile_memory=True): peak = bytes live before the step (computed exactly from
  the tensors) + the max cumulative delta of the allocator's events. Phase and op at the peak,
  and what is live at the peak by kind.
* the inference peak: eval(), no_grad, one forward.

No weights or data are downloaded: every model is built from a config with random init.

Decoder LLMs (small Llama GQA/MHA, eager/sdpa, use_cache; Qwen2; Mixtral; fp32 and CPU
autocast-bf16) are separate rows: `measure.py --llm [--autocast]` measures only them (Adam foreach
and for-loop, every row's breakdown) into tests/fixtures/validation_llm.json and
validation/saved_breakdown_llm.json; `--llm --autocast` measures fp32 and bf16 together, `--llm
--autocast --only autocast --merge` adds the bf16 rows to an existing file; `--llm-digest` prints
the Markdown digest of those two files (validation/llm_notes.md).

Holdout rows (`--holdout`: pure bf16 training = `model.bfloat16()` and Adam on bf16 params, an
8-layer GQA Llama in fp32/bf16/sdpa-bf16; inference-only BERT-base b16 s512 and BERT-large b8
s256, `inference_only` true, no train steps; GPT-2 fused b2 s1024, Adam foreach only) go to
tests/fixtures/validation_holdout.json and validation/saved_breakdown_holdout.json.

Today's families (`--families`): tiny random-init models of gpt_oss, olmo2, llama4_text (text only),
cohere, cohere2, glm4_moe, minimax_m2, smollm3, granite, granitemoe, qwen3_moe (mlp_only_layers [0]),
gemma3_text, deepseek_v3 (MLA), qwen3_next (Gated DeltaNet, its torch fallback) and nemotron_h
(Mamba-2, its torch fallback), hidden 256, 4 layers (nemotron_h 5: "M-M*-"), b2 s256, fp32,
attention "eager" and "sdpa" where the class supports it (not gpt_oss). Each model is built from a
config.json FILE that the mode writes first, tests/fixtures/validation_families/<name>.json (FAMILIES:
the config class with FAMILY_COMMON and the family's overrides, `to_dict()` without the generic
fields), with `AutoConfig.from_pretrained(FILE)` and `architectures[0]`, so `oomprobe estimate
--config FILE --batch 2 --seq 256` reads the very same file. Rows (validation_llm.json's schema plus
`config`, the file's path relative to the repository root; a row that raises goes to `failures`) ->
tests/fixtures/validation_families.json, every row's breakdown -> validation/saved_breakdown_families.json
(notes: validation/families_notes.md). torchvision is not needed there. Measured with

    OMP_NUM_THREADS=2 "$OOMPROBE_VENV/bin/python" validation/measure.py --families --threads 2

(torch 2.15.0, transformers 5.24.0: 29 rows, no failure, 269 s of measuring, 4 min 53 s wall on 2 cores).

Sequence classification (`--bert-cls`): BertForSequenceClassification (eager; pooler = token 0 ->
dense -> tanh, dropout, classifier Linear(h, num_labels), CrossEntropyLoss over random labels
[batch] in [0, num_labels); the loss starts after `classifier`), rows with head "seq-cls" and a
`num_labels` field, fp32 and autocast-bf16, Adam foreach and for-loop. The build set (hidden 256,
2 layers, b2/b4 s128, dropout 0.1/0) -> tests/fixtures/validation_bert_cls.json; a held-out shape
(hidden 384, 3 layers, b3 s192; one row with 5 labels) -> validation_bert_cls_holdout.json;
`--bert-cls-breakdown-out PATH` also writes every row's saved-tensor breakdown. Measured with

    OMP_NUM_THREADS=2 "$OOMPROBE_VENV/bin/python" validation/measure.py --bert-cls --threads 2

`--variants REGEX` measures only the train variants whose key (e.g. `foreach_keep_first`)
matches; with `--update-variants` it measures only those steps of the selected rows and writes
them into the existing rows of their fixture (the rows' train_<key>_* fields and
train_steps[<key>]; everything else stays; refused where the file's versions differ).
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


def write_fixture(path: str, schema_version: int, method: str, threads: int, seconds: float,
                  rows: list[dict], **versions: str) -> None:
    """Write a measuring script's fixture: its schema, when, the versions (torch, transformers,
    python and any given), the device (cpu), threads, the script's docstring, seconds, rows."""
    import transformers

    doc = {
        "schema_version": schema_version,
        "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     **versions, "python": platform.python_version()},
        "device": "cpu",
        "threads": threads,
        "method": method,
        "seconds": round(seconds, 1),
        "rows": rows,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {path} ({len(rows)} rows, {doc['seconds']} s)")


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
    """The model (random init; fp32, or bf16 for precision "bf16": `model.bfloat16()`, params and
    floating buffers) and the module whose output is the logits (loss starts after it)."""
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
            **({"num_labels": row["num_labels"]} if row["head"] == "seq-cls" else {}),
        )
        if row["head"] == "seq-cls":  # pooler (token 0 -> dense -> tanh), dropout, classifier
            model = transformers.BertForSequenceClassification._from_config(cfg, attn_implementation="eager")
            head = model.classifier
        else:
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
    elif "config" in row:  # --families: the model of a config.json file
        model = build_family(row)
        head = model.get_output_embeddings()  # lm_head; GPT-NeoX's embed_out
    elif arch in LLM_ARCHS:
        model = build_llm(row)
        head = model.lm_head
    else:
        raise ValueError(f"unknown arch {arch}")
    if arch != "resnet50":
        impl = model.config._attn_implementation
        want = row.get("attn_implementation", "eager")
        if impl != want:
            raise RuntimeError(f"{arch}: attention implementation is {impl}, expected {want}")
    return (model.bfloat16() if row["precision"] == "bf16" else model.float()), head


LLM_ARCHS = ("llama", "qwen2", "mixtral", "qwen3", "gemma2", "phi3", "qwen2_moe")


def build_llm(row: dict) -> torch.nn.Module:
    """Decoder LLMs (Llama / Qwen2 / Mixtral / Qwen3 / Gemma2 / Phi3 / Qwen2-MoE) from a config,
    random init. Attention dropout 0 (their default); RMSNorm, rotary positions, SwiGLU MLP (Gemma2:
    GeGLU; Mixtral, Qwen2-MoE: a sparse MoE of SwiGLU experts). Fields not set here keep the
    config's default (use_cache is set from the row); head_dim is passed only where the row sets it."""
    import transformers

    common = dict(
        vocab_size=row["vocab"],
        hidden_size=row["hidden"],
        num_hidden_layers=row["layers"],
        num_attention_heads=row["heads"],
        num_key_value_heads=row["kv_heads"],
        intermediate_size=row["ffn"],
        max_position_embeddings=row["max_positions"],
        rms_norm_eps=row["rms_norm_eps"],
        tie_word_embeddings=row["tied_embeddings"],
        attention_dropout=row["dropout"],
        use_cache=row["use_cache"],
    )
    if row.get("head_dim") is not None:
        common["head_dim"] = row["head_dim"]
    arch = row["arch"]
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, attention_bias=row["attention_bias"])
        cls = transformers.Qwen3ForCausalLM
    elif arch == "gemma2":
        cfg = transformers.Gemma2Config(**common, attn_logit_softcapping=row["attn_logit_softcapping"],
                                        final_logit_softcapping=row["final_logit_softcapping"],
                                        query_pre_attn_scalar=row["query_pre_attn_scalar"],
                                        sliding_window=row["sliding_window"])
        cls = transformers.Gemma2ForCausalLM
    elif arch == "phi3":
        # pad_token_id: Phi3Config's default 32000 is past this vocab (nn.Embedding padding_idx)
        cfg = transformers.Phi3Config(**common, resid_pdrop=row["dropout"], embd_pdrop=row["dropout"],
                                      pad_token_id=None, bos_token_id=None, eos_token_id=None)
        cls = transformers.Phi3ForCausalLM
    elif arch == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**common, num_experts=row["experts"],
                                          num_experts_per_tok=row["experts_per_token"],
                                          moe_intermediate_size=row["expert_ffn"],
                                          shared_expert_intermediate_size=row["shared_expert_ffn"],
                                          decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False,
                                          output_router_logits=row["output_router_logits"])
        cls = transformers.Qwen2MoeForCausalLM
    else:
        cfg = transformers.MixtralConfig(**common, num_local_experts=row["experts"],
                                         num_experts_per_tok=row["experts_per_token"])
        cls = transformers.MixtralForCausalLM
    model = cls._from_config(cfg, attn_implementation=row["attn_implementation"])
    c = model.config
    act = c.hidden_activation if arch == "gemma2" else c.hidden_act
    attn0 = model.model.layers[0].self_attn
    checks = {"hidden_act": (act, row["gelu"] or "silu"),
              "tie_word_embeddings": (c.tie_word_embeddings, row["tied_embeddings"]),
              "tied lm_head": (model.lm_head.weight is model.model.embed_tokens.weight, row["tied_embeddings"]),
              "use_cache": (c.use_cache, row["use_cache"]), "num_key_value_heads": (c.num_key_value_heads, row["kv_heads"]),
              "_attn_implementation": (c._attn_implementation, row["attn_implementation"]),
              "head_dim": (attn0.head_dim, row.get("head_dim") or row["hidden"] // row["heads"])}
    if arch == "gemma2":
        for k in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "sliding_window"):
            checks[k] = (getattr(c, k), row[k])
    if arch == "qwen2_moe":
        checks["output_router_logits"] = (c.output_router_logits, row["output_router_logits"])
        checks["router_aux_loss_coef"] = (c.router_aux_loss_coef, row["router_aux_loss_coef"])
        checks["_experts_implementation"] = (c._experts_implementation, row["experts_implementation"])
        checks["moe_intermediate_size"] = (c.moe_intermediate_size, row["expert_ffn"])
        checks["shared_expert_intermediate_size"] = (c.shared_expert_intermediate_size, row["shared_expert_ffn"])
        checks["norm_topk_prob"] = (c.norm_topk_prob, False)
    if arch == "mixtral":
        checks["output_router_logits"] = (c.output_router_logits, row["output_router_logits"])
        checks["router_aux_loss_coef"] = (c.router_aux_loss_coef, row["router_aux_loss_coef"])
        checks["_experts_implementation"] = (c._experts_implementation, row["experts_implementation"])
    for k, (got, want) in checks.items():
        if got != want:
            raise RuntimeError(f"{arch}: config {k} is {got!r}, the row says {want!r}")
    return model


def make_inputs(row: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    b = row["batch"]
    arch = row["arch"]
    if arch == "gpt2" or arch in LLM_ARCHS or "config" in row:
        ids = torch.randint(0, row["vocab"], (b, row["seq"]), generator=g)
        return {"input_ids": ids, "labels": ids}
    if arch == "bert":
        ids = torch.randint(0, row["vocab"], (b, row["seq"]), generator=g)
        if row["head"] == "seq-cls":  # one class per sequence: CrossEntropyLoss over [b, num_labels]
            return {"input_ids": ids, "labels": torch.randint(0, row["num_labels"], (b,), generator=g)}
        labels = ids.clone()
        keep = torch.rand(ids.shape, generator=g) < 0.15  # the 15 % masked positions
        labels[~keep] = -100
        return {"input_ids": ids, "labels": labels}
    if arch in ("vit", "resnet50"):
        px = torch.randn(b, 3, row["image"], row["image"], generator=g)
        if row["precision"] == "bf16":
            px = px.bfloat16()
        y = torch.randint(0, row["classes"], (b,), generator=g)
        return {"pixel_values": px, "labels": y}
    raise ValueError(arch)


def precision_context(row: dict):
    """fp32 and pure-bf16 rows (a bf16 model, no autocast) run as they are; autocast-bf16 rows run
    forward and loss under CPU autocast."""
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


def allocations_and_marks(prof) -> tuple[list, list[tuple[int, str]]]:
    """The profile's allocator events and its phase marks (start time, name), each in time order."""
    roots = prof.profiler.kineto_results.experimental_event_tree()
    allocs = []
    marks = []
    for n in _walk(roots):
        if str(n.tag).endswith("Allocation"):
            allocs.append(n)
        elif n.name.startswith(PHASE_MARK):
            marks.append((n.start_time_ns, n.name[len(PHASE_MARK):]))
    allocs.sort(key=lambda n: n.start_time_ns)
    marks.sort()
    return allocs, marks


def phase_at(marks: list[tuple[int, str]], ts: int) -> str:
    """The name of the last mark at or before `ts` ("before" when none)."""
    ph = "before"
    for mts, name in marks:
        if mts <= ts:
            ph = name
        else:
            break
    return ph


def analyse_profile(prof, baseline: int, tagged: dict[str, tuple[set[int], tuple[str, ...]]]) -> dict:
    """Live-bytes curve from the allocator's events; peak, phase, op and what is live there."""
    allocs, marks = allocations_and_marks(prof)

    live: dict[int, tuple[int, Any, str]] = {}  # ptr -> (bytes, event, phase at alloc)
    cum = 0
    peak_delta = 0
    peak_i = -1
    peak_live_snapshot: dict[int, tuple[int, Any, str]] = {}
    freed_pre_step = 0
    freed_pre_at_peak = 0
    phase_peaks: dict[str, int] = {}
    phase_starts: dict[str, int] = {}
    for i, n in enumerate(allocs):
        ef = n.extra_fields
        size = ef.alloc_size
        cum += size
        ph = phase_at(marks, n.start_time_ns)
        phase_starts.setdefault(ph, cum - size)
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
        peak_phase = phase_at(marks, ev.start_time_ns)
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
        # what was live when the phase's first allocator event came (its start, give or take
        # frees before that event)
        "phase_start_bytes": {ph: baseline + v for ph, v in phase_starts.items()},
        "events": len(allocs),
    }


def variant_keys(foreach_modes=(True, False)) -> list[str]:
    """The train variant keys in measuring order: {foreach|forloop}_{free|keep}_{first|steady}."""
    return [f"{'foreach' if fe else 'forloop'}_{g}_{st}" for fe in foreach_modes for g in ("free", "keep")
            for st in ("first", "steady")]


def measure_train_steps(row: dict, foreach_modes=(True, False), saved_hooks: bool = True,
                        variants: str | None = None) -> dict:
    """Four variants (grads free/keep x first/steady) per Adam foreach mode; `variants` (a regex on
    the key, e.g. `foreach_keep_first`) measures only the matching ones.

    Before each step: first = no gradients and no Adam state (a fresh Adam), whether grads are
    kept or freed: the real first step has no .grad before its first backward (backward creates
    them, zero_grad(set_to_none=False) then keeps them). steady = Adam state present (from the
    first step) and, for keep, gradients present (zeros, as zero_grad(set_to_none=False) leaves
    them). A steady variant measured without its first one gets its Adam state from an
    unprofiled first step."""
    model, head = build_model(row)
    model.train()
    inputs = make_inputs(row)
    params, buffers = model_tensors(model)
    param_keys = {storage_key(t) for t in params + buffers}
    results: dict[str, dict] = {}
    tracker = ModuleTracker(model, profile_ranges=True)

    def wanted(key: str) -> bool:
        return variants is None or re.search(variants, key) is not None

    for foreach in foreach_modes:
        for grads in ("free", "keep"):
            prefix = f"{'foreach' if foreach else 'forloop'}_{grads}"
            want = {st: wanted(f"{prefix}_{st}") for st in ("first", "steady")}
            if not any(want.values()):
                continue
            opt = torch.optim.Adam(params, foreach=foreach)
            for step in ("first", "steady"):
                for p in params:
                    p.grad = torch.zeros_like(p) if (grads == "keep" and step == "steady") else None
                if not want[step]:
                    if step == "first":  # the Adam state the steady step starts from
                        with dropout_mode(True):
                            loss, out = run_forward(row, model, inputs)
                            loss.backward()
                            del loss, out
                            opt.step()
                            opt.zero_grad(set_to_none=(grads == "free"))
                    continue
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
                results[f"{prefix}_{step}"] = res
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
        fill_config_defaults(r)
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


# Today's decoder LLMs, small (seconds per step on 2 CPU cores), random init. Not in all_rows():
# --llm selects them (fp32; with --autocast also the autocast-bf16 ones) and writes
# tests/fixtures/validation_llm.json and validation/saved_breakdown_llm.json (every row).
LLAMA = dict(arch="llama", hidden=256, layers=4, heads=8, kv_heads=2, ffn=688, vocab=8000, max_positions=1024,
             rms_norm_eps=1e-5, tied_embeddings=False, image=0, patch=0, classes=0, gelu="", dropout=0.0,
             use_cache=False, attn_implementation="eager", experts=0, experts_per_token=0, head="lm",
             batch=2, seq=256)
QWEN2 = dict(LLAMA, arch="qwen2", ffn=704, tied_embeddings=True)
# output_router_logits / router_aux_loss_coef: MixtralConfig's defaults, recorded (and checked
# against the built config): output_router_logits=False, so the model adds no aux loss.
# experts_implementation: not set, transformers 5 picks "grouped_mm" (sorted token copies through
# torch grouped_mm), not the per-expert eager loop of MixtralExperts.forward; recorded and checked.
MIXTRAL = dict(LLAMA, arch="mixtral", layers=2, ffn=512, experts=4, experts_per_token=2,
               output_router_logits=False, router_aux_loss_coef=0.001, experts_implementation="grouped_mm")


# Qwen3: q_norm / k_norm (RMSNorm over head_dim) on q and k before rotary; head_dim set explicitly.
QWEN3 = dict(LLAMA, arch="qwen3", head_dim=32, rms_norm_eps=1e-6, attention_bias=False)
# Gemma2: GeGLU (gelu_pytorch_tanh), embeddings scaled by sqrt(hidden), sandwich norms, tanh softcaps
# on the attention scores (50) and on the logits (30); query_pre_attn_scalar 32 (= head_dim); the
# sliding window (4096) is wider than seq, so its layers' masks equal the full ones. Ties embeddings.
GEMMA2 = dict(LLAMA, arch="gemma2", head_dim=32, rms_norm_eps=1e-6, tied_embeddings=True, gelu="gelu_pytorch_tanh",
              attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=32,
              sliding_window=4096)
# Phi3: fused qkv_proj and gate_up_proj (chunked), MHA; resid/embd/attention dropout 0.
PHI3 = dict(LLAMA, arch="phi3", kv_heads=8)
# Qwen2-MoE: every layer sparse (decoder_sparse_step 1), top-2 of 4 experts (softmax, no renorm),
# plus a shared SwiGLU expert gated by sigmoid(shared_expert_gate). output_router_logits False (no
# aux loss); experts_implementation not set (transformers picks grouped_mm; recorded and checked).
QWEN2_MOE = dict(LLAMA, arch="qwen2_moe", layers=2, ffn=512, expert_ffn=256, shared_expert_ffn=512, experts=4,
                 experts_per_token=2, rms_norm_eps=1e-6, output_router_logits=False, router_aux_loss_coef=0.001,
                 experts_implementation="grouped_mm")


def llm_rows(autocast: bool = False) -> list[dict]:
    """The decoder-LLM rows (fp32; autocast=True adds their autocast-bf16 twins)."""
    fp32 = [
        dict(LLAMA, model="llama-gqa-mini"),
        dict(LLAMA, model="llama-gqa-mini-cache", use_cache=True),  # the config default; HF keeps a DynamicCache
        dict(LLAMA, model="llama-gqa-mini-sdpa", attn_implementation="sdpa"),
        dict(LLAMA, model="llama-mha-mini", kv_heads=8),
        dict(QWEN2, model="qwen2-mini"),
        dict(MIXTRAL, model="mixtral-mini"),
        dict(QWEN3, model="qwen3-mini"),
        dict(GEMMA2, model="gemma2-mini"),
        dict(PHI3, model="phi3-mini-tiny"),
        dict(QWEN2_MOE, model="qwen2moe-mini"),
    ]
    rows = [dict(r, precision="fp32") for r in fp32]
    if autocast:
        bf16 = ("llama-gqa-mini", "llama-gqa-mini-sdpa", "qwen2-mini", "mixtral-mini")
        rows += [dict(r, precision="autocast-bf16") for r in fp32 if r["model"] in bf16]
    for r in rows:
        fill_config_defaults(r)
        r["id"] = row_id(r)
    return rows


def holdout_rows() -> list[dict]:
    """Shapes never in the other fixtures (--holdout -> tests/fixtures/validation_holdout.json,
    every row's breakdown in validation/saved_breakdown_holdout.json): pure bf16 training (a
    `model.bfloat16()` model, Adam on bf16 params, no autocast) next to its fp32 twin, inference-only
    rows (no train steps: `inference_only` true, no train_* fields) and a long-sequence GPT-2."""
    llama = dict(LLAMA, model="llama-gqa-small", layers=8, hidden=512, heads=8, kv_heads=2, ffn=1376,
                 vocab=8000, max_positions=1024, tied_embeddings=False, use_cache=False, batch=2, seq=512)
    rows = [
        dict(llama, precision="fp32"),
        dict(llama, precision="bf16"),
        dict(llama, model="llama-gqa-small-sdpa", attn_implementation="sdpa", precision="bf16"),
        dict(BERT, model="bert-base", dropout=0.1, batch=16, seq=512, precision="fp32", inference_only=True),
        dict(BERT, model="bert-large", hidden=1024, layers=24, heads=16, ffn=4096, dropout=0.1, batch=8,
             seq=256, precision="fp32", inference_only=True),
        dict(GPT2, model="gpt2-fused", gelu="gelu_pytorch_tanh", use_cache=False, dropout=0.1, batch=2,
             seq=1024, precision="fp32", adam_foreach=(True,)),
    ]
    for r in rows:
        fill_config_defaults(r)
        r["id"] = row_id(r)
    return rows


# BertForSequenceClassification (--bert-cls): BertModel with its pooler (hidden_states[:, 0] ->
# dense h x h -> tanh), dropout (hidden_dropout_prob), classifier Linear(h, num_labels),
# CrossEntropyLoss over integer labels [batch]. The loss starts after `classifier`. Every variant,
# Adam foreach and for-loop. tied_embeddings: the config's (True), nothing to tie without an LM head.
BERT_CLS = dict(BERT, head="seq-cls", num_labels=2, adam_foreach=(True, False))


def bert_cls_rows(holdout: bool | None = None) -> list[dict]:
    """The seq-cls rows: the build set (holdout False) -> --bert-cls-out; the held-out shape
    (holdout True) -> --bert-cls-holdout-out; None: both."""
    mini = dict(BERT_CLS, model="bert-cls-mini", hidden=256, layers=2, heads=4, ffn=1024)
    small = dict(BERT_CLS, model="bert-cls-small", hidden=384, layers=3, heads=6, ffn=1536, batch=3, seq=192,
                 dropout=0.1)
    build = [dict(mini, dropout=p, batch=b, seq=128, precision=prec)
             for prec in ("fp32", "autocast-bf16") for p in (0.1, 0.0) for b in (2, 4)]
    held = [dict(small, precision="fp32"), dict(small, precision="autocast-bf16"),
            dict(small, model="bert-cls5-small", num_labels=5, precision="fp32")]
    rows = (build if holdout is not True else []) + (held if holdout is not False else [])
    for r in rows:
        fill_config_defaults(r)
        r["id"] = row_id(r)
    return rows


# ----------------------------------------------------------------------------------------------
# Today's families, tiny (--families): each row's model is built from a config.json FILE under
# tests/fixtures/validation_families/, the same file `oomprobe estimate --config FILE` reads.
# ----------------------------------------------------------------------------------------------

FAMILIES_DIR = os.path.join("tests", "fixtures", "validation_families")
# Shapes every family shares (a family's spec overrides them): hidden 256, 4 layers, 8 heads of 32,
# 2 kv heads, ffn 688, vocab 8000, no dropout, no KV cache, token ids unset (the vocab is small).
FAMILY_COMMON = dict(vocab_size=8000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=32, intermediate_size=688, max_position_embeddings=1024,
                     attention_dropout=0.0, use_cache=False, pad_token_id=None, bos_token_id=None,
                     eos_token_id=None)
# Experts where the family has them: 4, top-2, expert ffn 128.
_MOE4 = dict(num_local_experts=4, num_experts_per_tok=2)
# name -> (model_type, architectures[0], overrides of FAMILY_COMMON, extra keys written into the
# file only (fields real checkpoints ship that this transformers reads from kwargs), keys dropped).
FAMILIES: dict[str, tuple[str, str, dict, dict, tuple[str, ...]]] = {
    # sinks in every attention layer; sliding (64) and full layers alternate; every layer MoE
    # (intermediate_size = the expert width); attention_bias true; no dense MLP. Ships untied.
    # max_position_embeddings as shipped (131072): YaRN's factor 32 over 4096 matches it.
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM",
                dict(_MOE4, intermediate_size=128, sliding_window=64, tie_word_embeddings=False,
                     max_position_embeddings=131072,
                     layer_types=["sliding_attention", "full_attention"] * 2), {}, ()),
    # q_norm / k_norm (RMSNorm over the whole q / k projection), post-norms only. Untied.
    "olmo2": ("olmo2", "Olmo2ForCausalLM", dict(tie_word_embeddings=False), {}, ("head_dim",)),
    # text only. RoPE layers: chunked attention (64) + L2 qk norm; every 4th layer NoPE (full
    # attention, temperature tuning). MoE every 2nd layer (layers 1, 3: 4 experts top-2, width
    # intermediate_size, + a shared expert of the same width); dense layers intermediate_size_mlp.
    "llama4_text": ("llama4_text", "Llama4ForCausalLM",
                    dict(_MOE4, intermediate_size=128, intermediate_size_mlp=688, interleave_moe_layer_step=2,
                         attention_chunk_size=64, tie_word_embeddings=False), {}, ("moe_layers",)),
    # parallel block (attention and MLP from one LayerNorm), LayerNorm without bias, logit_scale.
    # Command-R ships tied.
    "cohere": ("cohere", "CohereForCausalLM", dict(use_qk_norm=False, tie_word_embeddings=True), {},
               ("head_dim",)),
    # Command R7B: 3 sliding (64) + 1 full layer (sliding_window_pattern 4, its shipped value); the
    # full layer has no RoPE. Tied.
    "cohere2": ("cohere2", "Cohere2ForCausalLM", dict(sliding_window=64, tie_word_embeddings=True),
                {"sliding_window_pattern": 4}, ()),
    # GLM-4.5: layer 0 dense (first_k_dense_replace 1), then MoE (4 routed top-2 of width 128 + 1
    # shared; sigmoid router with e_score_correction_bias); partial RoPE 0.5; qk norm and attention
    # bias as GLM-4.5 ships them. Untied.
    "glm4_moe": ("glm4_moe", "Glm4MoeForCausalLM",
                 dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, n_shared_experts=1,
                      first_k_dense_replace=1, n_group=1, topk_group=1, use_qk_norm=True, attention_bias=True,
                      tie_word_embeddings=False), {}, ()),
    # every layer MoE (intermediate_size = expert width 128), sigmoid router + correction bias,
    # q_norm / k_norm over the whole projection, partial RoPE (rotary_dim 16 of head_dim 32, as
    # M2 ships 64 of 128). Untied.
    "minimax_m2": ("minimax_m2", "MiniMaxM2ForCausalLM",
                   dict(_MOE4, intermediate_size=128, tie_word_embeddings=False),
                   {"rotary_dim": 16, "use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
                    "use_routing_bias": True, "shared_intermediate_size": 0}, ()),
    # Llama-like; every 4th layer NoPE (no_rope_layer_interval 4). Tied.
    "smollm3": ("smollm3", "SmolLM3ForCausalLM", dict(tie_word_embeddings=True), {}, ("head_dim",)),
    # Llama + multipliers (Granite 3.3's: embedding 12, attention 1/128, residual 0.22, logits 16). Tied.
    "granite": ("granite", "GraniteForCausalLM",
                dict(embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22,
                     logits_scaling=16.0, tie_word_embeddings=True), {}, ("head_dim",)),
    # Granite's multipliers, every layer MoE (4 experts top-2, width intermediate_size 128). Tied.
    "granitemoe": ("granitemoe", "GraniteMoeForCausalLM",
                   dict(_MOE4, intermediate_size=128, embedding_multiplier=12.0, attention_multiplier=0.015625,
                        residual_multiplier=0.22, logits_scaling=6.0, tie_word_embeddings=True), {}, ("head_dim",)),
    # q_norm / k_norm per head; layer 0 dense (mlp_only_layers [0], ffn 688), layers 1-3 MoE (4
    # experts top-2 of width 128, no shared expert). Untied. transformers 5 writes the expert count
    # as num_local_experts; the file spells it num_experts, as Qwen3-MoE checkpoints ship it.
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, mlp_only_layers=[0],
                       tie_word_embeddings=False), {"num_experts": 4}, ("num_local_experts",)),
    # sliding (64) and full layers alternate (sliding_window_pattern 2); q/k norm; GeGLU; sandwich
    # norms; query_pre_attn_scalar = head_dim; embeddings scaled by sqrt(hidden). Tied.
    "gemma3_text": ("gemma3_text", "Gemma3ForCausalLM",
                    dict(sliding_window=64, query_pre_attn_scalar=32, tie_word_embeddings=True,
                         layer_types=["sliding_attention", "full_attention"] * 2),
                    {"sliding_window_pattern": 2}, ("_sliding_window_pattern",)),
    # MLA (q_lora 64, kv_lora 32, nope 32 + rope 16, v 32; 8 heads, kv heads = heads); layer 0
    # dense (ffn 688), layers 1-3 MoE (4 routed top-2 of width 128 + 1 shared). Untied.
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM",
                    dict(num_key_value_heads=8, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
                         qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
                         n_shared_experts=1, moe_intermediate_size=128, first_k_dense_replace=1, n_group=1,
                         topk_group=1, tie_word_embeddings=False), {}, ("head_dim", "qk_head_dim")),
    # 3 Gated DeltaNet layers + 1 gated full-attention layer (full_attention_interval 4); linear
    # heads: 2 key heads, 4 value heads of 32; conv kernel 4; every layer MoE (4 experts top-2 of
    # width 128 + a gated shared expert of 128). Untied.
    "qwen3_next": ("qwen3_next", "Qwen3NextForCausalLM",
                   dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                        shared_expert_intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=32, linear_value_head_dim=32, tie_word_embeddings=False,
                        layer_types=["linear_attention"] * 3 + ["full_attention"]),
                   {"full_attention_interval": 4}, ()),
    # "M-M*-": Mamba-2 (8 heads of 32, state 16, 1 group, conv 4, chunk 128), MLP (relu², not
    # gated), Mamba-2, attention, MLP; one norm per block. No expert block (no E): the MoE fields
    # the config class writes anyway are set tiny and unused. Untied.
    "nemotron_h": ("nemotron_h", "NemotronHForCausalLM",
                   dict(hybrid_override_pattern="M-M*-", mamba_num_heads=8,
                        mamba_head_dim=32, ssm_state_size=16, n_groups=1, tie_word_embeddings=False,
                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                        moe_shared_expert_intermediate_size=128),
                   {"hybrid_override_pattern": "M-M*-", "num_hidden_layers": 5}, ("layers_block_type",)),
    # Phi (phi-1.5 / phi-2's layer): one LayerNorm; attention (q, k, v, dense, all biased) and
    # the fc1 / gelu_new / fc2 MLP (biased) in parallel; partial RoPE (0.5, the class default);
    # the head biased. MHA as shipped (kv heads = heads). Untied.
    "phi": ("phi", "PhiForCausalLM", dict(num_key_value_heads=8, intermediate_size=1024,
                                          tie_word_embeddings=False), {}, ("head_dim",)),
    # GPT-NeoX (Pythia, StableLM-Alpha): fused query_key_value (biased) split as views, partial
    # RoPE 0.25 (the class default), LayerNorms before attention and before the MLP both over the
    # layer's input (use_parallel_residual), GELU MLP with biases. MHA. Untied.
    "gpt_neox": ("gpt_neox", "GPTNeoXForCausalLM", dict(intermediate_size=1024, tie_word_embeddings=False),
                 {}, ("head_dim", "num_key_value_heads")),
}
# transformers' generic PretrainedConfig fields that a model's config.json need not carry.
_GENERIC_CONFIG_KEYS = ("output_hidden_states", "return_dict", "dtype", "chunk_size_feed_forward",
                        "is_encoder_decoder", "id2label", "label2id", "problem_type", "_name_or_path",
                        "output_attentions")


def family_config(name: str) -> dict:
    """The tiny config.json dict of a family: the family's config class with FAMILY_COMMON and its
    overrides, `to_dict()` without the generic fields, `architectures` set, the spec's file-only
    keys added and dropped keys removed. Keys sorted (as save_pretrained writes them)."""
    from transformers import CONFIG_MAPPING

    model_type, arch, over, extra, drop = FAMILIES[name]
    kw = {**FAMILY_COMMON, **over}
    if model_type == "nemotron_h":
        kw.pop("num_hidden_layers")
    cls = CONFIG_MAPPING[model_type]
    for k in drop:  # a dropped key the class computes (Falcon's head_dim) is not passed at all
        if isinstance(getattr(cls, k, None), property):
            kw.pop(k, None)
    cfg = cls(**kw)
    d = cfg.to_dict()
    for k in _GENERIC_CONFIG_KEYS + tuple(drop):
        d.pop(k, None)
    d["architectures"] = [arch]
    d.update(extra)
    return dict(sorted(d.items()))


def write_family_configs(root: str, names) -> dict[str, str]:
    """Write each family's config file; returns name -> path relative to the repository root."""
    out = {}
    os.makedirs(os.path.join(root, FAMILIES_DIR), exist_ok=True)
    for name in names:
        rel = os.path.join(FAMILIES_DIR, f"{name}.json")
        text = json.dumps(family_config(name), indent=2) + "\n"
        path = os.path.join(root, rel)
        if not os.path.exists(path) or open(path).read() != text:
            with open(path, "w") as f:
                f.write(text)
        out[name] = rel
    return out


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_family_config(row: dict):
    """The row's config file read back as a user would: AutoConfig.from_pretrained(FILE)."""
    import transformers

    return transformers.AutoConfig.from_pretrained(os.path.join(_repo_root(), row["config"]))


def _decoder_layers(model):
    """The decoder layers of a causal LM: `model.layers` of its base model (`model`, Phi's;
    `gpt_neox`, GPT-NeoX's)."""
    return model.base_model.layers


def build_family(row: dict) -> torch.nn.Module:
    """The family model from its config FILE (random init, `architectures[0]`, the row's attention
    implementation); checks that the built model has the file's shapes."""
    import transformers

    cfg = load_family_config(row)
    cls = getattr(transformers, cfg.architectures[0])
    model = cls._from_config(cfg, attn_implementation=row["attn_implementation"])
    c = model.config
    emb = model.get_input_embeddings().weight
    checks = {"hidden_size": (c.hidden_size, row["hidden"]), "vocab_size": (c.vocab_size, row["vocab"]),
              "layers": (len(_decoder_layers(model)), row["layers"]),
              "tied lm_head": (model.get_output_embeddings().weight is emb, row["tied_embeddings"]),
              "use_cache": (c.use_cache, False),
              "_attn_implementation": (c._attn_implementation, row["attn_implementation"])}
    if row["experts"]:  # (dense models carry one too: "eager", nemotron_h "grouped_mm"; unused there)
        checks["_experts_implementation"] = (c._experts_implementation, row["experts_implementation"])
    for k, (got, want) in checks.items():
        if got != want:
            raise RuntimeError(f"{row['id']}: {k} is {got!r}, the row says {want!r}")
    return model


def family_rows(root: str | None = None) -> list[dict]:
    """One row per family and attention implementation (eager; sdpa where the model class has
    `_supports_sdpa`), fp32, b2 s256, dropout 0; the CONFIG_FIELDS read from the config file
    (informative: the file is the model). Writes the config files."""
    import transformers
    from transformers import CONFIG_MAPPING

    root = root or _repo_root()
    paths = write_family_configs(root, FAMILIES)
    rows = []
    for name, rel in paths.items():
        d = json.load(open(os.path.join(root, rel)))
        cfg = CONFIG_MAPPING[d["model_type"]](**{k: v for k, v in d.items() if k != "model_type"})
        cls = getattr(transformers, d["architectures"][0])
        g = lambda *ks, default=None: next((getattr(cfg, k) for k in ks if getattr(cfg, k, None) is not None),  # noqa: E731
                                           default)
        experts = g("num_local_experts", "n_routed_experts", "num_experts", default=0)
        if name == "nemotron_h" and "moe" not in cfg.layer_types:
            experts = 0
        if name in ("gpt_oss", "granitemoe", "minimax_m2"):  # every layer MoE: intermediate_size is the expert's
            ffn, expert_ffn, shared = 0, cfg.intermediate_size, 0
        elif name == "llama4_text":
            ffn, expert_ffn, shared = cfg.intermediate_size_mlp, cfg.intermediate_size, cfg.intermediate_size
        elif experts:
            ffn = cfg.intermediate_size
            expert_ffn = cfg.moe_intermediate_size
            shared = g("shared_expert_intermediate_size", default=0) or (g("n_shared_experts", default=0) * expert_ffn)
        else:
            ffn, expert_ffn, shared = cfg.intermediate_size, 0, 0
        act = g("hidden_activation", "mlp_hidden_act", "hidden_act", default="")
        kv = g("num_key_value_heads", default=cfg.num_attention_heads)
        base = dict(arch=d["model_type"], config=rel, family=name, precision="fp32", hidden=cfg.hidden_size,
                    layers=len(cfg.layer_types) if name == "nemotron_h" else cfg.num_hidden_layers,
                    heads=cfg.num_attention_heads, kv_heads=kv,
                    ffn=ffn, vocab=cfg.vocab_size, max_positions=cfg.max_position_embeddings, batch=2, seq=256,
                    image=0, patch=0, classes=0, dropout=0.0, gelu="" if act == "silu" else act, use_cache=False,
                    tied_embeddings=bool(cfg.tie_word_embeddings), head="lm", experts=experts,
                    experts_per_token=g("num_experts_per_tok", default=0) if experts else 0,
                    rms_norm_eps=d.get("rms_norm_eps"),
                    output_router_logits=bool(g("output_router_logits", default=False)),
                    router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.0)) if experts else 0.0,
                    experts_implementation=("eager" if name == "llama4_text" else "grouped_mm") if experts else "",
                    head_dim=d.get("head_dim"), expert_ffn=expert_ffn, shared_expert_ffn=shared,
                    adam_foreach=(True, False))
        for impl in ("eager", "sdpa") if cls._supports_sdpa else ("eager",):
            model = f"{name}-tiny" + ("" if impl == "eager" else f"-{impl}")
            r = dict(base, model=model, attn_implementation=impl)
            r["id"] = f"{model}-p0-b{r['batch']}-s{r['seq']}"
            rows.append(r)
    return rows


def fill_config_defaults(r: dict) -> None:
    """The decoder-LLM config fields for every row (other architectures: their fixed values)."""
    r.setdefault("kv_heads", r["heads"])
    r.setdefault("attn_implementation", "" if r["arch"] == "resnet50" else "eager")
    r.setdefault("experts", 0)
    r.setdefault("experts_per_token", 0)
    r.setdefault("rms_norm_eps", None)  # not an RMSNorm model
    r.setdefault("output_router_logits", False)
    r.setdefault("router_aux_loss_coef", 0.0)
    r.setdefault("experts_implementation", "")
    r.setdefault("head_dim", None)  # null: hidden // heads (the config does not set it)
    r.setdefault("expert_ffn", 0)  # MoE expert width where the config has its own (Qwen2-MoE)
    r.setdefault("shared_expert_ffn", 0)  # Qwen2-MoE's shared expert


def row_id(r: dict) -> str:
    seq_archs = ("gpt2", "bert") + LLM_ARCHS
    shape = f"b{r['batch']}-s{r['seq']}" if r["arch"] in seq_archs else f"b{r['batch']}-i{r['image']}"
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
                 "use_cache", "tied_embeddings", "head",
                 # decoder LLMs (other rows: kv_heads = heads, eager, no experts, rms_norm_eps null)
                 "kv_heads", "attn_implementation", "experts", "experts_per_token", "rms_norm_eps",
                 "output_router_logits", "router_aux_loss_coef", "experts_implementation",
                 "head_dim", "expert_ffn", "shared_expert_ffn")


def row_foreach_modes(row: dict, breakdown: bool) -> tuple[bool, ...]:
    """Adam foreach only, or foreach and for-loop: the fp32 breakdown rows and every decoder-LLM
    row get the for-loop too (small: seconds per step); a row's `adam_foreach` overrides."""
    if "adam_foreach" in row:
        return tuple(row["adam_foreach"])
    forloop_too = (breakdown and row["precision"] == "fp32") or row["arch"] in LLM_ARCHS
    return (True, False) if forloop_too else (True,)


def train_fields(steps: dict) -> dict:
    """The flat train_<key>_* fields of a row for the measured variants."""
    out = {}
    for name, res in steps.items():
        out[f"train_{name}_peak_bytes"] = res["peak_bytes"]
        out[f"train_{name}_peak_phase"] = res["peak_phase"]
        out[f"train_{name}_peak_op"] = res["peak_op"]
        for ph in PHASES:
            out[f"train_{name}_{ph}_max_bytes"] = res["phase_max_bytes"].get(ph, 0)
    return out


def log_steps(steps: dict, t0: float, log) -> None:
    log("  train peaks " + " ".join(f"{k}={v['peak_bytes'] / 2**20:.1f}MiB@{v['peak_phase']}"
                                     for k, v in steps.items()) + f"  [{time.time() - t0:.0f}s]")


def measure_row(row: dict, breakdown: bool, log, variants: str | None = None) -> tuple[dict, dict | None]:
    t0 = time.time()
    out = {k: row[k] for k in CONFIG_FIELDS}
    if "config" in row:  # --families rows: the config.json file the model was built from
        out["config"] = row["config"]
    if "num_labels" in row:  # --bert-cls rows: the classifier's width
        out["num_labels"] = row["num_labels"]
    if row.get("inference_only"):
        out["inference_only"] = True
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
    if not row.get("inference_only"):
        steps = measure_train_steps(row, row_foreach_modes(row, breakdown), variants=variants)
        out.update(train_fields(steps))
        out["train_steps"] = steps
        log_steps(steps, t0, log)
    inf = measure_inference(row)
    out["inference_peak_bytes"] = inf["peak_bytes"]
    out["inference_peak_op"] = inf["peak_op"]
    out["inference"] = inf
    out["seconds"] = round(time.time() - t0, 1)
    log(f"  inference peak {inf['peak_bytes'] / 2**20:.1f}MiB  [{out['seconds']}s]")
    return out, bd


def update_variants(path: str, rows: list[dict], variants: str, versions: dict, log) -> int:
    """Re-measure only the train variants matching `variants` of `rows` and write them into the
    existing rows of the fixture at `path`: per row, the train_<key>_* fields and
    train_steps[<key>] of each measured key are replaced (new keys are added); every other field,
    the file's versions and its other top-level fields stay. The Adam modes are the ones the
    stored row has (for-loop only where it has forloop variants). The method's "variants" text is
    set to this harness's, and the update is recorded in `variant_updates`. Refuses a file measured
    with other versions; skips (with a warning) the rows it does not hold."""
    if not os.path.exists(path):
        print(f"measure.py: --update-variants: no {path}", file=sys.stderr)
        return 2
    doc = json.load(open(path))
    if doc.get("versions") != versions:
        print(f"measure.py: --update-variants: {path} was measured with {doc.get('versions')}, "
              f"this is {versions}", file=sys.stderr)
        return 2
    by_id = {r["id"]: r for r in doc["rows"]}
    missing = [r["id"] for r in rows if r["id"] not in by_id]
    if missing:  # nothing to merge into: skipped (measure them without --update-variants, --merge)
        print(f"measure.py: --update-variants: {path} has no row {missing}: skipped", file=sys.stderr)
        rows = [r for r in rows if r["id"] in by_id]
    t_all = time.time()
    done: list[str] = []
    entry: dict = {}
    for i, row in enumerate(rows):
        old = by_id[row["id"]]
        if old.get("inference_only") or "train_steps" not in old:
            log(f"[{i + 1}/{len(rows)}] {row['id']}: no train steps, skipped")
            continue
        modes = (True, False) if any(k.startswith("forloop_") for k in old["train_steps"]) else (True,)
        if not any(re.search(variants, k) for k in variant_keys(modes)):
            continue
        log(f"[{i + 1}/{len(rows)}] {row['id']} (update {variants!r})")
        t0 = time.time()
        steps = measure_train_steps(row, modes, variants=variants)
        log_steps(steps, t0, log)
        for k, v in steps.items():
            prev = old["train_steps"].get(k)
            if prev is not None:
                log(f"    {k}: {prev['peak_bytes']:,} ({prev['peak_phase']}) -> {v['peak_bytes']:,} ({v['peak_phase']})")
        old.update(train_fields(steps))
        old["train_steps"].update(steps)
        done.append(row["id"])
        # written after every row: a long run keeps what it has measured
        doc.setdefault("method", {})["variants"] = METHOD["variants"]
        if len(done) == 1:
            doc.setdefault("variant_updates", []).append(entry)
        entry.update({"variants": variants, "rows": list(done), "threads": torch.get_num_threads(),
                      "seconds": round(time.time() - t_all, 1),
                      "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")})
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
    log(f"updated {len(done)} rows of {path} [{time.time() - t_all:.0f}s]")
    return 0


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
                "or False (CPU default); grads free = zero_grad(set_to_none=True), keep = "
                "zero_grad(set_to_none=False); first = the real first step: no grads and no Adam state "
                "before it (free or keep: backward creates the grads, keep then keeps them, zeroed); "
                "steady = Adam state present before, and for keep the grads too (zeros); free+steady "
                "has no grads before",
    "inference_peak": "eval(), no_grad, one forward without labels: params+buffers+inputs + max delta",
    "precision": "fp32; autocast-bf16 = forward and loss under torch.autocast('cpu', bfloat16), params, "
                 "grads and Adam state fp32; bf16 = model.bfloat16() (params and floating buffers), Adam "
                 "on the bf16 params (bf16 state), no autocast",
    "inference_only": "rows with inference_only true: saved, caller-held and the inference peak; no "
                      "train steps, no train_* fields",
}


def write_rows_fixture(path: str, rows: list[dict], versions: dict, threads: int, seconds: float, merge: bool,
                  order: list[str] | None = None) -> int:
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
        order = order or [r["id"] for r in all_rows()]
        kept = [r for r in old["rows"] if r["id"] not in mine]
        doc["rows"] = sorted(kept + rows, key=lambda r: order.index(r["id"]) if r["id"] in order else 1e9)
        doc["seconds"] = round(old.get("seconds", 0) + seconds, 1)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
        f.write("\n")
    return 0


def llm_digest(fixture_path: str, breakdown_path: str) -> str:
    """Markdown digest per decoder-LLM row: layer 0's and the embedding/head/loss's saved
    storages (module, shape, dtype, bytes, which autograd nodes saved them), per-layer totals,
    what the caller holds, every train variant's peak and the inference peak."""
    fx = json.load(open(fixture_path))
    bd = json.load(open(breakdown_path))["rows"]
    layer_re = re.compile(r"^model\.layers\.(\d+)\.")
    out = [f"Measured with {fx['versions']}, {fx['threads']} threads, fixture `{os.path.basename(fixture_path)}`.", ""]
    for r in fx["rows"]:
        b = bd.get(r["id"])
        out += [f"### {r['id']}", ""]
        out.append(f"{r['arch']}, {r['precision']}, attn {r['attn_implementation']}, heads {r['heads']} / kv "
                   f"{r['kv_heads']}, hidden {r['hidden']}, ffn {r['ffn']}, layers {r['layers']}, experts "
                   f"{r['experts']}x{r['experts_per_token']}, tied {r['tied_embeddings']}, use_cache {r['use_cache']}, "
                   f"b{r['batch']} s{r['seq']}; params {r['params']:,} ({r['params_bytes']:,} B), buffers "
                   f"{r['buffers_bytes']:,} B.")
        out.append(f"saved {r['saved_bytes']:,} B (forward {r['saved_forward_bytes']:,} + loss "
                   f"{r['saved_loss_bytes']:,}); weight casts {r['weight_cast_bytes']:,} B; caller-held "
                   f"{r['caller_held_bytes']:,} B; saved + held {r['saved_bytes'] + r['caller_held_bytes']:,} B.")
        out.append("")
        if b is None:
            out += ["(no breakdown)", ""]
            continue
        per_layer: dict[str, int] = defaultdict(int)
        lines = []
        for i, e in enumerate(b["saved"]):
            m = layer_re.match(e["module"])
            per_layer[f"layer {m.group(1)}" if m else "outside layers"] += e["storage_bytes"]
            if m and m.group(1) != "0":
                continue
            by = sorted({x.split(" ")[0] for x in e["saved_by"]})
            lines.append(f"| {i} | {e['module']} | {e['phase']} | {'; '.join(e['saved_as'])} | "
                         f"{e['storage_bytes']:,} | {', '.join(by) or '-'} |")
        out += ["Saved storages of layer 0 and outside the layers (in order; # = position among all):", "",
                "| # | module | phase | saved as | bytes | saved by (node.attribute) |", "|---|---|---|---|---|---|"]
        out += lines
        out += ["", "Per layer: " + ", ".join(f"{k} {v:,}" for k, v in per_layer.items()), ""]
        held: dict[str, int] = defaultdict(int)
        for h in b["caller_held"]:
            held[f"{h['shape']} {h['dtype']} {h['storage_bytes']:,} B"] += 1
        out.append("Caller holds (not saved by autograd): "
                   + ("; ".join(f"{n} x {k}" if n > 1 else k for k, n in held.items()) if held else "nothing") + ".")
        out += ["", "| train variant | peak bytes | MiB | phase | op | module |", "|---|---|---|---|---|---|"]
        for k, v in r["train_steps"].items():
            out.append(f"| {k} | {v['peak_bytes']:,} | {v['peak_bytes'] / 2**20:.2f} | {v['peak_phase']} | "
                       f"{v['peak_op']} | {v['peak_module'] or (v['peak_stack'][1] if len(v['peak_stack']) > 1 else '')} |")
        inf = r["inference"]
        out += ["", f"Inference peak {inf['peak_bytes']:,} B ({inf['peak_bytes'] / 2**20:.2f} MiB) at "
                    f"{inf['peak_op']} in {inf['peak_module'] or '-'}; the output holds {inf['end_held_bytes']:,} B.", ""]
    return "\n".join(out)


def measure_families(rows: list[dict], args, versions: dict, log) -> int:
    """--families: measure each row as measure_row does (breakdown always, Adam foreach and
    for-loop); a row that raises is recorded under the fixture's `failures` (id, config, where,
    error, the traceback's last frames) and the run goes on. Writes --families-out and
    --families-breakdown-out (with --merge: the file's other rows and failures kept)."""
    import traceback

    measured, breakdowns, failures = [], {}, []
    t0 = time.time()
    for i, row in enumerate(rows):
        log(f"[{i + 1}/{len(rows)}] {row['id']} ({row['config']})")
        t_row = time.time()
        try:
            res, bd = measure_row(row, True, log, args.variants)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            tb = traceback.extract_tb(e.__traceback__)
            failures.append({"id": row["id"], "config": row["config"], "attn_implementation": row["attn_implementation"],
                             "error": f"{type(e).__name__}: {e}"[:2000],
                             "where": [f"{os.path.relpath(f.filename, os.path.dirname(torch.__file__) + '/..')}:"
                                       f"{f.lineno} {f.name}" for f in tb[-6:]],
                             "seconds": round(time.time() - t_row, 1)})
            log(f"  FAILED: {failures[-1]['error'][:300]}")
            gc.collect()
            continue
        measured.append(res)
        breakdowns[row["id"]] = bd
    seconds = round(time.time() - t0, 1)
    order = [r["id"] for r in family_rows(_repo_root())]
    path = args.families_out
    old_failures = []
    if args.merge and os.path.exists(path):
        old_failures = json.load(open(path)).get("failures", [])
    if write_rows_fixture(path, measured, versions, args.threads, seconds, args.merge, order) != 0:
        return 2
    doc = json.load(open(path))
    done = {r["id"] for r in measured} | {f["id"] for f in failures}
    doc["method"]["config"] = ("each row's model is `architectures[0]._from_config(AutoConfig.from_pretrained("
                               "config), attn_implementation=...)` of its `config` file (relative to the "
                               "repository root; written by measure.py --families from FAMILIES); fp32, random init")
    doc["failures"] = sorted([f for f in old_failures if f["id"] not in done] + failures,
                             key=lambda f: order.index(f["id"]) if f["id"] in order else 1e9)
    doc["rows"] = [r for r in doc["rows"] if r["id"] not in {f["id"] for f in failures}]
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
        f.write("\n")
    log(f"wrote {path} ({len(measured)} rows measured now, {len(failures)} failed) [{seconds:.0f}s]")
    bpath = args.families_breakdown_out
    if args.merge and os.path.exists(bpath):
        old_bd = json.load(open(bpath))["rows"]
        breakdowns = {**{k: v for k, v in old_bd.items() if k not in breakdowns}, **breakdowns}
    breakdowns = dict(sorted(breakdowns.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 1e9))
    with open(bpath, "w") as f:
        json.dump({"versions": versions, "rows": breakdowns}, f, indent=1)
        f.write("\n")
    log(f"wrote {bpath}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  measure.py                          fp32 rows -> tests/fixtures/validation.json\n"
               "  measure.py --autocast               + autocast-bf16 rows -> tests/fixtures/validation_autocast.json\n"
               "  measure.py --llm --autocast         decoder-LLM rows, fp32 + bf16 -> tests/fixtures/validation_llm.json,\n"
               "                                      breakdowns -> validation/saved_breakdown_llm.json (~2 min, 2 threads)\n"
               "  measure.py --llm                    only the fp32 LLM rows (the bf16 ones: --llm --autocast --only autocast --merge)\n"
               "  measure.py --llm-digest             Markdown digest of the LLM fixture + breakdowns (validation/llm_notes.md)\n"
               "  measure.py --holdout                holdout rows -> tests/fixtures/validation_holdout.json,\n"
               "                                      breakdowns -> validation/saved_breakdown_holdout.json\n"
               "  measure.py --llm --autocast --variants keep_first --update-variants\n"
               "                                      re-measure only keep_first in the LLM fixture's rows, in place\n"
               "  measure.py --families               tiny rows of today's families from config files ->\n"
               "                                      tests/fixtures/validation_families.json (+ the config files,\n"
               "                                      validation/saved_breakdown_families.json)\n"
               "  measure.py --bert-cls               BertForSequenceClassification rows -> tests/fixtures/validation_bert_cls.json\n"
               "                                      (build set) and validation_bert_cls_holdout.json (held-out shape)\n")
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
    ap.add_argument("--llm", action="store_true",
                    help="only the decoder-LLM rows (Llama GQA/MHA eager, sdpa, use_cache; Qwen2; Mixtral; Qwen3; "
                         "Gemma2; Phi3; Qwen2-MoE; "
                         "fp32, and with --autocast also their autocast-bf16 rows), all in --llm-out, every "
                         "row's saved-tensor breakdown in --llm-breakdown-out; Adam foreach and for-loop")
    ap.add_argument("--llm-out", default=os.path.join(root, "tests", "fixtures", "validation_llm.json"),
                    help="the --llm fixture (fp32 and autocast-bf16 rows together; same schema)")
    ap.add_argument("--llm-breakdown-out", default=os.path.join(here, "saved_breakdown_llm.json"))
    ap.add_argument("--holdout", action="store_true",
                    help="only the holdout rows (shapes never in the other fixtures: pure bf16 training, "
                         "inference-only BERT-base/large, GPT-2 at s1024) -> --holdout-out, every row's "
                         "breakdown -> --holdout-breakdown-out")
    ap.add_argument("--holdout-out", default=os.path.join(root, "tests", "fixtures", "validation_holdout.json"))
    ap.add_argument("--holdout-breakdown-out", default=os.path.join(here, "saved_breakdown_holdout.json"))
    ap.add_argument("--families", action="store_true",
                    help="only the tiny rows of today's families (gpt_oss, olmo2, llama4_text, cohere, cohere2, phi, gpt_neox, "
                         "glm4_moe, minimax_m2, smollm3, granite, granitemoe, qwen3_moe, gemma3_text, deepseek_v3, "
                         "qwen3_next, nemotron_h; eager, and sdpa where supported), each built from the config "
                         "file it writes to tests/fixtures/validation_families/<name>.json -> --families-out, "
                         "every row's breakdown -> --families-breakdown-out; a row that fails is recorded under "
                         "`failures`")
    ap.add_argument("--families-out", default=os.path.join(root, "tests", "fixtures", "validation_families.json"))
    ap.add_argument("--families-breakdown-out", default=os.path.join(here, "saved_breakdown_families.json"))
    ap.add_argument("--bert-cls", action="store_true",
                    help="only the BertForSequenceClassification rows (pooler, classifier, CrossEntropyLoss over "
                         "[batch] labels; fp32 and autocast-bf16; Adam foreach and for-loop): the build set -> "
                         "--bert-cls-out, the held-out shape -> --bert-cls-holdout-out; breakdowns only where "
                         "--bert-cls-breakdown-out is given")
    ap.add_argument("--bert-cls-out", default=os.path.join(root, "tests", "fixtures", "validation_bert_cls.json"))
    ap.add_argument("--bert-cls-holdout-out",
                    default=os.path.join(root, "tests", "fixtures", "validation_bert_cls_holdout.json"))
    ap.add_argument("--bert-cls-breakdown-out", default="", metavar="PATH",
                    help="with --bert-cls: every measured row's saved-tensor breakdown to PATH (default: none)")
    ap.add_argument("--variants", default=None, metavar="REGEX",
                    help="measure only the train variants whose key ({foreach|forloop}_{free|keep}_{first|steady}) "
                         "matches, e.g. 'keep_first'")
    ap.add_argument("--update-variants", action="store_true",
                    help="with --variants: measure only those train steps of the selected rows and write them "
                         "into the existing rows of the fixture (train_<key>_* and train_steps[<key>] replaced, "
                         "all else kept; same versions only; Adam for-loop where the stored row has it)")
    ap.add_argument("--llm-digest", action="store_true",
                    help="print a Markdown digest of --llm-out and --llm-breakdown-out (layer 0, embedding, "
                         "head and loss storages; caller-held; peaks) and exit; needs no torch run")
    args = ap.parse_args(argv)
    if args.llm_digest:
        print(llm_digest(args.llm_out, args.llm_breakdown_out))
        return 0
    torch.set_num_threads(args.threads)
    if args.update_variants and not args.variants:
        print("measure.py: --update-variants needs --variants REGEX", file=sys.stderr)
        return 2
    if args.families:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs from files only, nothing downloaded
        candidates = family_rows(root)
    elif args.bert_cls:
        candidates = bert_cls_rows()
    elif args.holdout:
        candidates = holdout_rows()
    elif args.llm:
        candidates = llm_rows(args.autocast)
    else:
        candidates = all_rows(args.autocast)
    rows = [r for r in candidates if re.search(args.only, r["id"])]
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
            a = measure_train_steps(row, (True,), saved_hooks=True, variants=args.variants)
            b = measure_train_steps(row, (True,), saved_hooks=False, variants=args.variants)
            for k in a:
                same = a[k]["peak_bytes"] == b[k]["peak_bytes"] and a[k]["phase_max_bytes"] == b[k]["phase_max_bytes"]
                bad += not same
                log(f"{row['id']} {k}: with hooks {a[k]['peak_bytes']:,} {a[k]['phase_max_bytes']} "
                    f"without {b[k]['peak_bytes']:,} {b[k]['phase_max_bytes']} {'same' if same else 'DIFFERENT'}")
        return 1 if bad else 0

    import transformers

    if args.families or args.bert_cls:  # no torchvision model among them: its version only where it is installed
        try:
            import torchvision
        except ImportError:
            torchvision = None
    else:
        import torchvision
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torchvision": torchvision.__version__ if torchvision is not None else None,
        "python": platform.python_version(),
    }
    if versions["torchvision"] is None:
        del versions["torchvision"]
    if args.families:
        out_for = lambda r: args.families_out  # noqa: E731
    elif args.bert_cls:
        held_ids = {r["id"] for r in bert_cls_rows(holdout=True)}
        out_for = lambda r: args.bert_cls_holdout_out if r["id"] in held_ids else args.bert_cls_out  # noqa: E731
    elif args.holdout:
        out_for = lambda r: args.holdout_out  # noqa: E731
    elif args.llm:
        out_for = lambda r: args.llm_out  # noqa: E731
    else:
        out_for = lambda r: args.out if r["precision"] == "fp32" else args.autocast_out  # noqa: E731
    if args.update_variants:
        for path in dict.fromkeys(out_for(r) for r in rows):
            if update_variants(path, [r for r in rows if out_for(r) == path], args.variants, versions, log) != 0:
                return 2
        return 0

    if args.families:
        return measure_families(rows, args, versions, log)
    measured = []
    breakdowns = {}
    t0 = time.time()
    for i, row in enumerate(rows):
        log(f"[{i + 1}/{len(rows)}] {row['id']}")
        res, bd = measure_row(row, args.llm or args.holdout or args.bert_cls or row["id"] in BREAKDOWN_IDS, log,
                              args.variants)
        measured.append(res)
        if bd is not None:
            breakdowns[row["id"]] = bd
    seconds = round(time.time() - t0, 1)
    if args.bert_cls:
        groups = ((args.bert_cls_out, [r for r in measured if out_for(r) == args.bert_cls_out]),
                  (args.bert_cls_holdout_out, [r for r in measured if out_for(r) == args.bert_cls_holdout_out]))
        order = [r["id"] for r in bert_cls_rows()]
        breakdown_out = args.bert_cls_breakdown_out
        if not breakdown_out:
            breakdowns = {}
    elif args.holdout:
        groups = ((args.holdout_out, measured),)
        order = [r["id"] for r in holdout_rows()]
        breakdown_out = args.holdout_breakdown_out
    elif args.llm:
        groups = ((args.llm_out, measured),)
        order = [r["id"] for r in llm_rows(True)]
        breakdown_out = args.llm_breakdown_out
    else:
        groups = ((args.out, [r for r in measured if r["precision"] == "fp32"]),
                  (args.autocast_out, [r for r in measured if r["precision"] != "fp32"]))
        order = None
        breakdown_out = args.breakdown_out
    for path, group in groups:
        if group and write_rows_fixture(path, group, versions, args.threads, seconds, args.merge, order) != 0:
            return 2
        if group:
            log(f"wrote {path} ({len(group)} rows measured now)")
    if breakdowns:
        if args.merge and os.path.exists(breakdown_out):
            old_bd = json.load(open(breakdown_out))["rows"]
            breakdowns = {**{k: v for k, v in old_bd.items() if k not in breakdowns}, **breakdowns}
        if order:
            breakdowns = dict(sorted(breakdowns.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 1e9))
        with open(breakdown_out, "w") as f:
            json.dump({"versions": versions, "rows": breakdowns}, f, indent=1)
            f.write("\n")
        log(f"wrote {breakdown_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

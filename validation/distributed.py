#!/usr/bin/env python3
"""Measure what each rank of a real multi-process PyTorch training step holds (CPU, gloo, random
init) and write tests/fixtures/distributed.json, the per-rank reference for oomprobe's
distributed-memory model.

Run it with the venv that validation/setup.sh creates (2 CPU cores are enough; every rank runs
with torch.set_num_threads(1) and only one process group runs at a time):

    "${OOMPROBE_VENV:-$HOME/.cache/oomprobe-validation-venv}/bin/python" validation/distributed.py \
        [--holdout] [--only REGEX] [--out tests/fixtures/distributed.json]

`--only` measures the rows whose id matches (re.search) and merges them into an existing --out
file (other rows stay); without it every row is measured and the file is rewritten.

`--holdout` measures the held-out rows instead (HOLDOUT_ROWS, default --out
tests/fixtures/distributed_holdout.json; --only then selects among them): the same builders,
baseline, peak method and row / rank schema as below, with a different model and layouts. Model
(HOLDOUT_MODEL, "llama-gqa-holdout"): measure.py's LLAMA with hidden 384, 6 layers, 12 heads, 4 kv
heads, ffn 1024, vocab 6000, max_positions 1024, eager, fp32, untied, rms_norm_eps 1e-5; per-rank
(micro-)batch 1, seq 384. Rows: `holdout-ddp-bucket1` (DDP world 2, bucket_cap_mb 1,
gradient_as_bucket_view False: one bucket at construction, 26 after the second step's rebuild,
recorded in info.ddp_logging_after_steps), `holdout-fsdp2-w4` (FSDP2 world 4, per-layer + root,
reshard_after_forward True), `holdout-tp-sp` and `holdout-tp-replicated` (tp 2, built as `tp-sp`
and `tp`), `holdout-pp3-1f1b` (3 stages, Schedule1F1B, 6 micro-batches of 1: stage 0 =
embed_tokens + layers 0-1, stage 1 = layers 2-3 (a middle stage: no embedding, no head; it
computes its own positions, mask and cos/sin like the last stage and returns hidden states; its
schedule.step gets neither input nor target), stage 2 = layers 4-5 + norm + lm_head + loss),
`holdout-single` (world 1). The pipeline's stages split the layers evenly (pp_bounds; the default
rows' split is the same 0-1 / 2-3 as before).

Model: measure.py's LLAMA row (Llama GQA mini: hidden 256, 4 layers, 8 heads, 2 kv heads, ffn
688, vocab 8000, eager attention, fp32, untied), built by measure.build_llm after
torch.manual_seed(0) on every rank (identical weights), inputs from measure.make_inputs (seeded);
Adam(foreach=True); grads freed by zero_grad(set_to_none=True), as measure.py's
`foreach_free` variants.

What each rank measures, for three consecutive steps: `first` (no grads, no Adam state), `second`
(Adam state present; for DDP this step also rebuilds the reducer's buckets in its forward) and
`steady` (the third step; reported as train_foreach_free_steady_*):

* the step peak = bytes live before the step + the max cumulative delta of the CPU allocator's
  events in torch.profiler(activities=[CPU], profile_memory=True) (measure.analyse_profile),
  with measure.py's phase marks (forward, loss at lm_head's output, backward, optimizer, end);
  the phase and op at the peak, each phase's max and what is live at the peak by allocating op.
* the baseline (bytes live before the step), from the tensors: local storages of params +
  buffers, grads, Adam state and the inputs (DTensors: `._local_tensor`; FSDP2's sharded params
  are views of its padded per-rank storage, counted by storage, i.e. with padding), plus
  `other_before_bytes`: framework buffers that are not reachable as tensors. For DDP that is the
  reducer's bucket buffers (gradient_as_bucket_view=False: the flat `bucket.gradients` tensors
  the reducer allocates in its constructor and again when it rebuilds buckets); they are obtained
  from DDP's logging data (bucket_sizes, bytes) and checked against the profiler: it runs from
  before the model is built (windows chained without a
  gap: model build + wrapping + optimizer + inputs, then each step, gc.collect() at each window's
  end inside it), so the torch-allocator bytes live before every step are known exactly
  (`baseline_profiler_bytes`), and that minus the tensor-visible bytes equals the logged bucket
  bytes to within ~1 KB (`baseline_check_diff_bytes`: 0, 128 or 1104 on some ranks; small
  broadcast buffers freed on gloo's thread) on every run but one, where a build-time free of a
  bucket-sized buffer on gloo's thread went unseen (+27468800). For every other
  layout other_before is 0 and `baseline_profiler_bytes` is the independent cross-check of the
  tensor baseline (`baseline_check_diff_bytes` = profiler - tensor baseline).
* gloo: allocations made on gloo's worker threads, and gloo's own scratch memory (plain malloc),
  are NOT seen: the CPU profiler records allocator events only on threads where it is enabled
  (checked: an allocation on another Python thread does not appear; profile_all_threads records
  no allocator events at all). Every tensor a collective's caller passes in or gets back that the
  caller's thread allocates (FSDP2's all-gather outputs and reduce-scatter inputs, DDP's buckets,
  DTensor redistribute outputs, pipeline recv buffers) is seen. What is missed is what NCCL would
  also keep outside PyTorch's caching allocator, so the seen bytes are the ones a per-rank model
  of torch-allocated memory needs. Two consequences are handled: (1) allocations made inside a
  ProcessGroup backend op (`c10d::*`: gloo's clone/flat staging of _allgather_base_ and
  _reduce_scatter_base_ inputs, scatter_ chunks) are dropped from the curve (FilteredProfile;
  their bytes per op are reported as backend_internal_*): gloo frees them on its worker thread
  at random, and NCCL has no such torch allocation; (2) outputs of functional collectives
  (DTensor's redistributes) are real and kept, and each wait on them sleeps 1 ms
  (SettleAfterWait) so that their frees happen on the main thread. With both, every peak is
  the same on every run, rank and steady step (c10d Work.wait gets the same 1 ms settle; the last
  run left one 160-byte difference on ddp rank 1). Remaining baseline_check_diff_bytes: 4-8 bytes
  from process-group/mesh set-up; the tensor baseline is the one reported.

Layouts (row ids):

* `single`: world 1, no wrapper: the reference (same code path as every row; measure.py's
  llama-gqa-mini-p0-b2-s256 first step: 154959016).
* `ddp`, `ddp-bucket-view`: DistributedDataParallel(bucket_cap_mb=25, gradient_as_bucket_view
  False / True), world 2, per-rank batch 2 (rank r's batch: make_inputs with seed 1 + r, so the
  ranks see different data).
* `fsdp2`, `fsdp2-no-reshard`: fully_shard on each decoder layer, then on the root
  LlamaForCausalLM (embedding, final norm, lm_head in the root group), 1-D CPU mesh of 2,
  reshard_after_forward True / False; per-rank batch 2 (different data per rank).
* `tp`: parallelize_module per decoder layer, tp 2: q/k/v/gate/up ColwiseParallel, o/down
  RowwiseParallel; embedding, norms and lm_head plain replicated modules (not DTensors). Both ranks
  see the same batch 2. Local heads 4, local kv heads 1 (HF's view(..., -1, head_dim)). Adam gets two
  param groups (DTensor params; plain params) because foreach ops refuse a mixed list; Adam runs
  its foreach ops per group (info.adam_param_groups records the split of every row).
* `tp-sp`: sequence parallel as torchtitan does it: embed_tokens RowwiseParallel(input_layouts=
  Replicate(), output_layouts=Shard(1)); input_layernorm, post_attention_layernorm, final norm
  SequenceParallel(); q/k/v/gate/up ColwiseParallel(input_layouts=Shard(1)); o/down
  RowwiseParallel(output_layouts=Shard(1)); lm_head ColwiseParallel(input_layouts=Shard(1),
  output_layouts=Replicate()) (full logits on each rank, HF's own loss; no loss_parallel). HF's
  LlamaModel derives positions and the mask's query length from inputs_embeds.shape[1], which is
  the local sequence (128) under SP, so the step passes position_ids = arange(256) and a 4-D eager
  mask built by transformers' create_causal_mask for the full sequence (HF returns a 4-D mask
  as-is); both are made inside the step's forward phase.
* `pp-1f1b`, `pp-gpipe`: torch.distributed.pipelining PipelineStage + Schedule1F1B /
  ScheduleGPipe, 2 stages, 4 micro-batches of 2 (global batch 8, seq 256), step(...,
  return_outputs=False) as torchtitan calls it (the last stage keeps no logits). Stage 0 (rank
  0) = embed_tokens + layers 0-1: it computes position_ids = arange(seq), the eager 4-D causal mask
  (create_causal_mask, as LlamaModel does) and rotary cos/sin (the model's rotary_emb), and returns
  the hidden states. Stage 1 (rank 1) = layers 2-3 + final norm + lm_head: it computes its own
  position_ids, mask and cos/sin from the received hidden states; the schedule's loss_fn is HF's
  ForCausalLMLoss (model.loss_function, mean over the micro-batch; the schedule scales grads by
  1/4). Each rank builds the full model (seed 0) and keeps only its stage's modules; Adam over the
  stage's params. One step = schedule.step(...) + opt.step() + zero_grad. Marks: forward at each
  forward_one_chunk, loss in loss_fn, backward at each backward_one_chunk, optimizer; each chunk's
  micro-batch index is marked too (pp rows: `microbatch_marks`, live delta at each chunk start).
* `pp-interleaved`: ScheduleInterleaved1F1B, world 2, 2 virtual stages per rank (layout.chunks
  2), 4 stages of one decoder layer each, loop style (layout.pp_rank_stages: rank 0 holds stages 0
  and 2, rank 1 stages 1 and 3); stage 0 = embed_tokens + layer 0 (Stage0), stages 1-3 = one layer
  each (Stage1; stage 3 also norm + lm_head + loss); 4 micro-batches of 2 (global batch 8, seq 256;
  the schedule runs 2 rounds of 2). Same step, loss_fn and Adam (over the params of both of the
  rank's stage modules) as `pp-1f1b`; the chunk marks also name the stage: `fwd{mb}@s{stage}`.

* `fsdp2-ckpt`, `ddp-ckpt`: `fsdp2` / `ddp` with activation checkpointing of every decoder layer as
  torchtitan's full AC does it (apply_checkpointing): each layer is replaced by torch.distributed's
  checkpoint_wrapper(layer, CheckpointImpl.NO_REENTRANT, preserve_rng_state=False) before
  fully_shard / DDP, so fully_shard wraps the checkpointed layer (layout.checkpoint =
  "checkpoint_wrapper"; "hf_gradient_checkpointing" would be HF's gradient_checkpointing_enable(
  use_reentrant=False); null on the other rows). FSDP2 all-gathers each layer once in forward and
  once in backward as without checkpointing: the recomputation runs after the layer's pre-backward
  unshard, so it gathers nothing again. The global module hooks (ModuleTracker) are off in
  backward, so recomputed allocations are named by their autograd node.
* `fsdp2-mp-bf16`: `fsdp2` with MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) on
  every fully_shard call (layers and root), no autocast, the model built in fp32: the sharded params,
  grads and Adam state are fp32, the all-gathers bf16, the reduce-scatters fp32
  (layout.mp_param_dtype / mp_reduce_dtype; null on the other rows). The residual stream, norms'
  outputs, rotary cos/sin and the logits are bf16 (HF's loss upcasts the logits to fp32); eager
  attention's softmax is fp32 (softmax(dtype=float32), then cast to bf16).

FSDP1 (`--fsdp1`, kind "fsdp1", build_fsdp1; validation/fsdp1_notes.md has the step's memory
timeline from the torch sources and these rows): FullyShardedDataParallel(model, auto_wrap_policy=
ModuleWrapPolicy({LlamaDecoderLayer}), sharding_strategy, use_orig_params, limit_all_gathers,
forward_prefetch, backward_prefetch, mixed_precision, device_id=torch.device("cpu")) (device_id None
raises "FSDP needs a non-CPU accelerator device"), world 2, per-rank batch 2 (different data per
rank), same MODEL, Adam(foreach) over the trainable params, three steps, written to
tests/fixtures/fsdp1_measured.json (FSDP1_ROWS; `--fsdp1 --holdout`: FSDP1_HOLDOUT_ROWS ->
tests/fixtures/fsdp1_holdout.json; `--only` works as above). Every row's layout carries
sharding_strategy, use_orig_params, limit_all_gathers, forward_prefetch, backward_prefetch,
mp_param/reduce/buffer_dtype, frozen and auto_wrap_policy (fsdp1_layout; the other rows' layout is
unchanged). Rows: `fsdp1` (FULL_SHARD, use_orig_params False, limit_all_gathers True,
BACKWARD_PRE, no forward prefetch: torch's defaults), `fsdp1-orig-params`, `fsdp1-shard-grad-op`,
`fsdp1-no-shard`, `fsdp1-mp-bf16` (MixedPrecision(param bf16, reduce fp32, buffer bf16)),
`fsdp1-frozen` (use_orig_params, every attention / MLP weight but q_proj and v_proj frozen inside
the flat params), `fsdp1-ckpt` (checkpoint_wrapper NO_REENTRANT per layer first, FSDP units wrap the
CheckpointWrapper: FSDP(CheckpointWrapper(layer)), Accelerate's nesting), `fsdp1-bwd-post`
(BACKWARD_POST), `fsdp1-no-prefetch` (backward_prefetch None: Accelerate's plugin defaults),
`fsdp1-no-limit` (limit_all_gathers False), `fsdp1-fwd-prefetch`, `fsdp1-hf-trainer` (transformers'
Trainer FSDP1 defaults: use_orig_params True, backward_prefetch None; its sync_module_states=True
raises on CPU modules ("requires them to be on GPU") and only broadcasts at construction),
`fsdp1-no-wrap` (Lightning FSDPStrategy's defaults: use_orig_params True and no auto_wrap_policy,
so the whole model is one flat param; layout.auto_wrap_policy null), and PEFT LoRA (apply_lora:
peft.get_peft_model(model, LoraConfig(r, lora_alpha, lora_dropout, target_modules, bias="none")) on
the built model before wrapping; use_orig_params True, since the frozen base and the trainable
adapters share each layer's flat param; ModuleWrapPolicy({LlamaDecoderLayer}) still finds the
layers inside PeftModelForCausalLM; the root unit wraps the PeftModel; Adam over the adapters):
`fsdp1-lora` (r 8, alpha 16, q_proj + v_proj, dropout 0), `fsdp1-lora-drop` (dropout 0.05),
`fsdp1-lora-mp-bf16` (MixedPrecision as fsdp1-mp-bf16), `fsdp1-lora-ckpt` (PEFT first, then
checkpoint_wrapper on each decoder layer of the PEFT model's base, units FSDP(CheckpointWrapper));
their layout has lora = {r, alpha, dropout, targets, bias, lib} and frozen = "peft_lora_base"
(every base parameter frozen); peft is imported before the build window (its import allocates two
8-byte class constants). Held out:
`holdout-fsdp1-w4` (HOLDOUT_MODEL, world 4), `holdout-fsdp1-orig-frozen` (HOLDOUT_MODEL, world 2,
use_orig_params + frozen), `holdout-fsdp1-pad-w4` / `-orig` (FSDP1_PAD_MODEL, world 4, seq 128,
batch 1: flat params that need world-size and (use_orig_params) alignment padding),
`holdout-fsdp1-lora` (HOLDOUT_MODEL, world 2, LoRA r 16 alpha 16 on q/k/v/o_proj, dropout 0). The baseline
adds each unit's FlatParameter storage, its .grad / _saved_grad_shard and any unsharded storage
still allocated (fsdp1_state_tensors; with use_orig_params the sharded flat grad outlives
zero_grad(set_to_none=True) until the next forward frees it); info.fsdp1_units records each unit's
flat-param sizes and padding. FSDP1's CPU all-gather is dist.all_gather into chunk views of the
padded unsharded flat param: gloo stages it in a flat tensor of the full output size both inside
c10d::allgather_ (caller thread) and in its worker's gloo:all_gather range, which the profiler does
record (the work carries the caller's profiler state); FSDP1 rows drop both (backend_prefixes;
reported in backend_internal_by_op). The unsharded flat params (FSDP._pre_forward /
_pre_backward_prefetch), reduce-scatter outputs (_post_backward_hook / empty_like) and the
autograd-built unsharded flat grads (SplitWithSizesBackward0 / cat) are caller-thread
allocations and are seen.

Numbers are bytes of the CPU allocator (no caching: every torch allocation is a malloc), fp32
(fsdp2-mp-bf16, fsdp1-mp-bf16: fp32 states, bf16 compute).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import re
import socket
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import measure  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

SCHEMA_VERSION = 1
MB_MARK = "oomprobe::mb::"
STEPS = ("first", "second", "steady")

MODEL = dict(measure.LLAMA, model="llama-gqa-mini", precision="fp32")
measure.fill_config_defaults(MODEL)

ROWS = [
    dict(id="single", kind="single", world=1),
    dict(id="ddp", kind="ddp", world=2, bucket_cap_mb=25, gradient_as_bucket_view=False),
    dict(id="ddp-bucket-view", kind="ddp", world=2, bucket_cap_mb=25, gradient_as_bucket_view=True),
    dict(id="fsdp2", kind="fsdp2", world=2, reshard_after_forward=True),
    dict(id="fsdp2-no-reshard", kind="fsdp2", world=2, reshard_after_forward=False),
    dict(id="tp", kind="tp", world=2, sp=False),
    dict(id="tp-sp", kind="tp", world=2, sp=True),
    dict(id="pp-1f1b", kind="pp", world=2, schedule="1F1B", microbatches=4),
    dict(id="pp-gpipe", kind="pp", world=2, schedule="GPipe", microbatches=4),
    dict(id="pp-interleaved", kind="pp", world=2, schedule="Interleaved1F1B", microbatches=4, chunks=2),
    dict(id="fsdp2-ckpt", kind="fsdp2", world=2, reshard_after_forward=True, checkpoint="checkpoint_wrapper"),
    dict(id="fsdp2-mp-bf16", kind="fsdp2", world=2, reshard_after_forward=True, mp=("bfloat16", "float32")),
    dict(id="ddp-ckpt", kind="ddp", world=2, bucket_cap_mb=25, gradient_as_bucket_view=False,
         checkpoint="checkpoint_wrapper"),
]

# --holdout: a second model and layouts, measured by the same builders, baseline and peak method
# and written with the same row / rank schema (tests/fixtures/distributed_holdout.json). Each row
# carries its model config as `cfg` (the default rows have none: MODEL).
HOLDOUT_MODEL = dict(measure.LLAMA, model="llama-gqa-holdout", precision="fp32", hidden=384, layers=6, heads=12,
                     kv_heads=4, ffn=1024, vocab=6000, max_positions=1024, rms_norm_eps=1e-5, tied_embeddings=False,
                     attn_implementation="eager", batch=1, seq=384)
measure.fill_config_defaults(HOLDOUT_MODEL)

HOLDOUT_ROWS = [
    dict(id="holdout-ddp-bucket1", kind="ddp", world=2, bucket_cap_mb=1, gradient_as_bucket_view=False,
         cfg=HOLDOUT_MODEL, log_rebuilt_buckets=True),
    dict(id="holdout-fsdp2-w4", kind="fsdp2", world=4, reshard_after_forward=True, cfg=HOLDOUT_MODEL),
    dict(id="holdout-tp-sp", kind="tp", world=2, sp=True, cfg=HOLDOUT_MODEL),
    dict(id="holdout-tp-replicated", kind="tp", world=2, sp=False, cfg=HOLDOUT_MODEL),
    dict(id="holdout-pp3-1f1b", kind="pp", world=3, schedule="1F1B", microbatches=6, cfg=HOLDOUT_MODEL),
    dict(id="holdout-single", kind="single", world=1, cfg=HOLDOUT_MODEL),
    # Issue 45, item 9: the two layouts the issue found off, on this model's shape.
    dict(id="holdout-fsdp2-hf-ckpt", kind="fsdp2", world=2, reshard_after_forward=True,
         checkpoint="hf_gradient_checkpointing", cfg=HOLDOUT_MODEL),
    dict(id="holdout-fsdp2-w4-hf-ckpt", kind="fsdp2", world=4, reshard_after_forward=True,
         checkpoint="hf_gradient_checkpointing", cfg=HOLDOUT_MODEL),
    dict(id="holdout-fsdp2-hf-ckpt-mini", kind="fsdp2", world=2, reshard_after_forward=True,
         checkpoint="hf_gradient_checkpointing", cfg=MODEL),
    dict(id="holdout-tp-sp-sdpa-b2", kind="tp", world=2, sp=True,
         cfg=dict(HOLDOUT_MODEL, attn_implementation="sdpa", batch=2, seq=512)),
]


# --fsdp1: FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) rows, written to
# tests/fixtures/fsdp1_measured.json (FSDP1_ROWS, MODEL) and, with --holdout,
# tests/fixtures/fsdp1_holdout.json (FSDP1_HOLDOUT_ROWS). Each row carries every FSDP1 setting;
# fsdp1_row fills torch's defaults (FULL_SHARD, use_orig_params False, limit_all_gathers True,
# forward_prefetch False, backward_prefetch BACKWARD_PRE, no mixed precision, nothing frozen).
def fsdp1_row(id: str, **kw) -> dict:
    return dict(dict(id=id, kind="fsdp1", world=2, sharding_strategy="FULL_SHARD", use_orig_params=False,
                     limit_all_gathers=True, forward_prefetch=False, backward_prefetch="BACKWARD_PRE"), **kw)


FSDP1_ROWS = [
    fsdp1_row("fsdp1"),
    fsdp1_row("fsdp1-orig-params", use_orig_params=True),
    fsdp1_row("fsdp1-shard-grad-op", sharding_strategy="SHARD_GRAD_OP"),
    fsdp1_row("fsdp1-no-shard", sharding_strategy="NO_SHARD"),
    fsdp1_row("fsdp1-mp-bf16", mp=("bfloat16", "float32", "bfloat16")),
    fsdp1_row("fsdp1-frozen", use_orig_params=True, frozen="attn_mlp_except_q_v"),
    fsdp1_row("fsdp1-ckpt", checkpoint="checkpoint_wrapper"),
    fsdp1_row("fsdp1-bwd-post", backward_prefetch="BACKWARD_POST"),
    # Accelerate's FullyShardedDataParallelPlugin defaults (backward_prefetch NO_PREFETCH -> None)
    fsdp1_row("fsdp1-no-prefetch", backward_prefetch=None),
    fsdp1_row("fsdp1-no-limit", limit_all_gathers=False),
    fsdp1_row("fsdp1-fwd-prefetch", forward_prefetch=True),
    # transformers' Trainer with fsdp_config version 1 (TrainingArguments._process_fsdp_args); its
    # sync_module_states=True cannot run here (FSDP refuses CPU module states with it; it only
    # broadcasts rank 0's states at construction)
    fsdp1_row("fsdp1-hf-trainer", use_orig_params=True, backward_prefetch=None),
    # Lightning's FSDPStrategy() defaults: use_orig_params True, no auto_wrap_policy (one unit)
    fsdp1_row("fsdp1-no-wrap", use_orig_params=True, auto_wrap="none"),
    # PEFT LoRA (get_peft_model before wrapping; frozen base and trainable adapters share each
    # layer's flat param, so use_orig_params=True is required)
    fsdp1_row("fsdp1-lora", use_orig_params=True, lora=dict(r=8, alpha=16, dropout=0.0, targets=["q_proj", "v_proj"])),
    fsdp1_row("fsdp1-lora-drop", use_orig_params=True,
              lora=dict(r=8, alpha=16, dropout=0.05, targets=["q_proj", "v_proj"])),
    fsdp1_row("fsdp1-lora-mp-bf16", use_orig_params=True, mp=("bfloat16", "float32", "bfloat16"),
              lora=dict(r=8, alpha=16, dropout=0.0, targets=["q_proj", "v_proj"])),
    fsdp1_row("fsdp1-lora-ckpt", use_orig_params=True, checkpoint="checkpoint_wrapper",
              lora=dict(r=8, alpha=16, dropout=0.0, targets=["q_proj", "v_proj"])),
]

# An odd-sized Llama (hidden 390 = 13 heads x 30, 1 kv head, ffn 1001, vocab 6001, 2 layers) whose
# flat parameters need padding: world-size padding (numel % 4 = 2) and, with use_orig_params,
# 16-byte alignment padding between original parameters (390- and 390*1001-element tensors).
FSDP1_PAD_MODEL = dict(measure.LLAMA, model="llama-odd-pad", precision="fp32", hidden=390, layers=2, heads=13,
                       kv_heads=1, ffn=1001, vocab=6001, max_positions=1024, rms_norm_eps=1e-5,
                       tied_embeddings=False, attn_implementation="eager", batch=1, seq=128)
measure.fill_config_defaults(FSDP1_PAD_MODEL)

FSDP1_HOLDOUT_ROWS = [
    fsdp1_row("holdout-fsdp1-w4", world=4, cfg=HOLDOUT_MODEL),
    fsdp1_row("holdout-fsdp1-orig-frozen", use_orig_params=True, frozen="attn_mlp_except_q_v", cfg=HOLDOUT_MODEL),
    fsdp1_row("holdout-fsdp1-pad-w4", world=4, cfg=FSDP1_PAD_MODEL),
    fsdp1_row("holdout-fsdp1-pad-w4-orig", world=4, use_orig_params=True, cfg=FSDP1_PAD_MODEL),
    fsdp1_row("holdout-fsdp1-lora", use_orig_params=True, cfg=HOLDOUT_MODEL,
              lora=dict(r=16, alpha=16, dropout=0.0, targets=["q_proj", "k_proj", "v_proj", "o_proj"])),
]


def cfg_of(row: dict) -> dict:
    """The row's model config: its `cfg` (holdout rows) or MODEL."""
    return row.get("cfg", MODEL)


def pp_bounds(row: dict) -> list:
    """Each pipeline stage's decoder layers [lo, hi): layers split evenly over the world * chunks
    stages (default rows: (0, 2), (2, 4); pp-interleaved: one layer per stage; holdout-pp3-1f1b:
    (0, 2), (2, 4), (4, 6)). Stage 0 also has embed_tokens, the last stage norm + lm_head + loss; a
    middle stage has neither."""
    n, s = cfg_of(row)["layers"], pp_stages(row)
    assert n % s == 0, (n, s)
    k = n // s
    return [(i * k, (i + 1) * k) for i in range(s)]


def pp_stages(row: dict) -> int:
    """The number of pipeline stages: world * chunks (chunks = virtual stages per rank, 1 unless
    the row is interleaved)."""
    return row["world"] * row.get("chunks", 1)


def pp_rank_stages(row: dict) -> list:
    """Each rank's stage indices, loop style (stage s on rank s % world; pp-interleaved: [[0, 2],
    [1, 3]])."""
    w = row["world"]
    return [[r + k * w for k in range(row.get("chunks", 1))] for r in range(w)]


def pp_split_of(row: dict) -> str:
    n_st, w = pp_stages(row), row["world"]
    parts = []
    for i, (lo, hi) in enumerate(pp_bounds(row)):
        s = f"stage{i}" + (f" (rank {i % w})" if n_st > w else "") + " = " + \
            ("embed_tokens + " if i == 0 else "") + (f"layers {lo}-{hi - 1}" if hi - lo > 1 else f"layer {lo}")
        parts.append(s + (" + norm + lm_head + loss" if i == n_st - 1 else ""))
    return "; ".join(parts)


def layout_of(r: dict) -> dict:
    k = r["kind"]
    w = r["world"]
    return {
        "kind": k, "world": w,
        "dp": w if k in ("ddp", "fsdp2") else 1,
        "tp": w if k == "tp" else 1,
        "sp": bool(r.get("sp", False)),
        "pp": w if k == "pp" else 1,
        "microbatches": r.get("microbatches", 1),
        "schedule": r.get("schedule"),
        "chunks": r.get("chunks"),
        "pp_rank_stages": pp_rank_stages(r) if k == "pp" else None,
        "reshard_after_forward": r.get("reshard_after_forward"),
        "bucket_cap_mb": r.get("bucket_cap_mb"),
        "gradient_as_bucket_view": r.get("gradient_as_bucket_view"),
        "embedding_placement": ("RowwiseParallel(Replicate -> Shard(1)), vocab-sharded weight" if r.get("sp")
                                else "replicated (plain module)") if k == "tp" else None,
        "lm_head_placement": ("ColwiseParallel(Shard(1) -> Replicate), vocab-sharded weight, full logits"
                              if r.get("sp") else "replicated (plain module)") if k == "tp" else None,
        "norm_placement": ("SequenceParallel (Replicate DTensor params)" if r.get("sp") else "replicated")
        if k == "tp" else None,
        "loss": "HF ForCausalLMLoss on full logits" + (" per micro-batch (schedule loss_fn)" if k == "pp" else ""),
        "pp_split": pp_split_of(r) if k == "pp" else None,
        "return_outputs": False if k == "pp" else None,
        "checkpoint": r.get("checkpoint"),
        "mp_param_dtype": r["mp"][0] if r.get("mp") else None,
        "mp_reduce_dtype": r["mp"][1] if r.get("mp") else None,
    } | (fsdp1_layout(r) if k == "fsdp1" else {})


def fsdp1_layout(r: dict) -> dict:
    """The FSDP1 rows' extra layout fields (only on kind "fsdp1" rows; dp = world)."""
    return {"dp": r["world"], "sharding_strategy": r["sharding_strategy"], "use_orig_params": r["use_orig_params"],
            "limit_all_gathers": r["limit_all_gathers"], "forward_prefetch": r["forward_prefetch"],
            "backward_prefetch": r["backward_prefetch"],
            "mp_buffer_dtype": r["mp"][2] if r.get("mp") else None,
            "frozen": "peft_lora_base" if r.get("lora") else r.get("frozen"),
            "auto_wrap_policy": None if r.get("auto_wrap") == "none" else
            "ModuleWrapPolicy({CheckpointWrapper})" if r.get("checkpoint") == "checkpoint_wrapper"
            else "ModuleWrapPolicy({LlamaDecoderLayer})",
            "device_id": "cpu", "sync_module_states": bool(r.get("sync_module_states", False))} | \
        ({"lora": dict(r["lora"], bias="none", lib="peft")} if r.get("lora") else {})


# ----------------------------------------------------------------------------------------------
# Accounting
# ----------------------------------------------------------------------------------------------


def local(t):
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t._local_tensor
    return t


def ubytes(tensors) -> int:
    return measure.unique_bytes([local(t) for t in tensors if t is not None])


def state_tensors(opt) -> list:
    return measure.optimizer_state_tensors(opt)


def mbmark(name: str):
    with record_function(MB_MARK + name):
        pass


def profile_ctx():
    return profile(activities=[ProfilerActivity.CPU], profile_memory=True)


class _Node:
    __slots__ = ("name", "tag", "start_time_ns", "extra_fields", "parent", "children")


class _Results:
    def __init__(self, roots):
        self._roots = roots

    def experimental_event_tree(self):
        return self._roots


class FilteredProfile:
    """The profiler's event tree without the allocations made inside a ProcessGroup backend op
    (`c10d::*`, e.g. gloo's clone of a reduce-scatter input): gloo frees them on its worker thread
    whenever its Work object dies there, which the profiler cannot see, so they would stay "live"
    at random. NCCL makes no such torch allocation. `_c10d_functional::*` ops (DTensor's
    collectives, whose outputs are real tensors the caller keeps) are not filtered. FSDP1 rows also
    drop what gloo's worker thread allocates under its `gloo:*` ranges (`prefixes`; see
    backend_prefixes): FSDP1's CPU all-gather is dist.all_gather into a list of chunk views, and
    gloo's worker stages it in a flat tensor of the full output size (alloc + free inside
    gloo:all_gather, recorded because the work carries the caller's profiler state); NCCL's
    all_gather_into_tensor has no such buffer."""

    def __init__(self, prof, prefixes=("c10d::",)):
        roots = prof.profiler.kineto_results.experimental_event_tree()
        allocs = sorted((n for n in measure._walk(roots) if str(n.tag).endswith("Allocation")),
                        key=lambda n: n.start_time_ns)
        drop: set = set()
        dropped_live: dict = {}
        self.ops: dict = defaultdict(int)
        self.bytes = 0
        for n in allocs:
            ef = n.extra_fields
            key = (n.start_time_ns, ef.ptr, ef.alloc_size)
            if ef.alloc_size > 0:
                p, op = n.parent, None
                while p is not None:
                    if p.name.startswith(prefixes):
                        op = p.name
                    p = p.parent
                if op is not None:
                    drop.add(key)
                    dropped_live[ef.ptr] = ef.alloc_size
                    self.ops[op] += ef.alloc_size
                    self.bytes += ef.alloc_size
                else:
                    dropped_live.pop(ef.ptr, None)  # its earlier dropped owner was freed unseen
            elif ef.ptr in dropped_live:
                drop.add(key)
                del dropped_live[ef.ptr]
        self.unfreed_bytes = sum(dropped_live.values())
        out: list = []
        stack = [(r, None) for r in roots]
        while stack:
            n, par = stack.pop()
            if n.name == "PythonDispatchMode":  # SettleAfterWait's mode: splice it out
                stack.extend((c, par) for c in n.children)
                continue
            if str(n.tag).endswith("Allocation") and \
                    (n.start_time_ns, n.extra_fields.ptr, n.extra_fields.alloc_size) in drop:
                continue
            m = _Node()
            m.name, m.tag, m.start_time_ns, m.parent, m.children = n.name, n.tag, n.start_time_ns, par, []
            m.extra_fields = n.extra_fields if str(n.tag).endswith("Allocation") else None
            (par.children if par is not None else out).append(m)
            stack.extend((c, m) for c in n.children)
        out.sort(key=lambda m: m.start_time_ns)
        for m in measure._walk(out):
            m.children.sort(key=lambda c: c.start_time_ns)
        self.profiler = _Results.__new__(_Results)
        self.profiler.kineto_results = _Results(out)

    def info(self) -> dict:
        return {"backend_internal_alloc_bytes": self.bytes, "backend_internal_unfreed_bytes": self.unfreed_bytes,
                "backend_internal_by_op": dict(self.ops)}


def backend_prefixes(row: dict) -> tuple:
    """The profiler ranges whose allocations FilteredProfile drops: `c10d::*` for every row, and
    gloo's worker ranges `gloo:*` for FSDP1 rows (the other rows' numbers were measured without
    that filter and stay as they are)."""
    return ("c10d::", "gloo:") if row["kind"] == "fsdp1" else ("c10d::",)


class SettleAfterWait:
    """Sleep 1 ms after each wait on a functional collective (`_c10d_functional.wait_tensor(s)`:
    the Python wrappers in torch.distributed._functional_collectives, which AsyncCollectiveTensor
    and the collectives' backward call by name, patched). (A TorchDispatchMode doing the same hid
    the module context of every allocation, so it is built but not entered.) gloo's Work object holds a reference to the collective's output; its worker
    thread drops it right after the collective completes, racing the main thread: when the main
    thread drops its tensor first, the storage is freed on the worker thread, unseen by the
    profiler, and the tensor looks live to the end of the step (+-0.5..2.6 MB run-to-run noise in
    tp / tp-sp before this). Letting the worker settle first makes every such free happen, and be
    seen, on the main thread. c10d Work.wait (FSDP2, DDP, pipelining) is patched the same way.
    The mode's own profiler range ("PythonDispatchMode") is spliced out of the event tree
    (FilteredProfile) so allocations keep their module / autograd-node context. Nothing is
    allocated or changed."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        waits = {torch.ops._c10d_functional.wait_tensor.default, torch.ops._c10d_functional.wait_tensors.default}

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func in waits:
                    time.sleep(0.001)
                return out

        self.mode = _Mode()

    def __enter__(self):
        import torch.distributed._functional_collectives as funcol

        self.saved = (funcol.wait_tensor, funcol.wait_tensors)
        wt, wts = self.saved

        def wait_tensor(t):
            out = wt(t)
            time.sleep(0.001)
            return out

        def wait_tensors(ts):
            out = wts(ts)
            time.sleep(0.001)
            return out

        funcol.wait_tensor, funcol.wait_tensors = wait_tensor, wait_tensors
        work_cls = dist.distributed_c10d.Work
        self.saved_work_wait = work_cls.wait
        ww = self.saved_work_wait

        def work_wait(work, *a, **k):  # FSDP2, DDP and pipelining wait on c10d Work objects
            out = ww(work, *a, **k)
            time.sleep(0.001)
            return out

        work_cls.wait = work_wait
        return self

    def __exit__(self, *exc):
        import torch.distributed._functional_collectives as funcol

        funcol.wait_tensor, funcol.wait_tensors = self.saved
        dist.distributed_c10d.Work.wait = self.saved_work_wait
        return False


def curve_detail(prof) -> dict:
    """The peak's timestamp, the micro-batch mark before it, and the live delta at each mb mark."""
    roots = prof.profiler.kineto_results.experimental_event_tree()
    allocs, mbs = [], []
    live: dict = {}
    unmatched_free = 0
    evs = sorted((n for n in measure._walk(roots) if str(n.tag).endswith("Allocation")), key=lambda n: n.start_time_ns)
    for n in evs:
        ef = n.extra_fields
        if ef.alloc_size > 0:
            live[ef.ptr] = (ef.alloc_size, n)
        elif ef.ptr in live:
            del live[ef.ptr]
        else:
            unmatched_free += -ef.alloc_size
    end_live: dict = defaultdict(int)
    for size, n in live.values():
        end_live[measure.alloc_context(n)] += size
    for n in measure._walk(roots):
        if str(n.tag).endswith("Allocation"):
            allocs.append((n.start_time_ns, n.extra_fields.alloc_size))
        elif n.name.startswith(MB_MARK):
            mbs.append((n.start_time_ns, n.name[len(MB_MARK):]))
    allocs.sort()
    mbs.sort()
    cum, peak, peak_ts = 0, 0, None
    at_marks = []
    j = 0
    for ts, size in allocs:
        while j < len(mbs) and mbs[j][0] <= ts:
            at_marks.append((mbs[j][1], cum))
            j += 1
        cum += size
        if cum > peak:
            peak, peak_ts = cum, ts
    while j < len(mbs):
        at_marks.append((mbs[j][1], cum))
        j += 1
    mb_at_peak = None
    if peak_ts is not None:
        for ts, name in mbs:
            if ts <= peak_ts:
                mb_at_peak = name
    return {"live_at_end_by_op": [{"what": k, "bytes": v} for k, v in sorted(end_live.items(), key=lambda kv: -kv[1])[:8]],
            "freed_not_allocated_in_step_bytes": unmatched_free,
            "microbatch_at_peak": mb_at_peak, "microbatch_marks": [{"mark": m, "delta_bytes": d} for m, d in at_marks]}


# ----------------------------------------------------------------------------------------------
# Building each layout (inside the build profiler window)
# ----------------------------------------------------------------------------------------------


def build_base(cfg=MODEL):
    torch.manual_seed(0)
    model = measure.build_llm(cfg).float()
    model.train()
    return model


def inputs_for(batch: int, seed: int, cfg=MODEL) -> dict:
    r = dict(cfg, batch=batch)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, r["vocab"], (batch, r["seq"]), generator=g)
    return {"input_ids": ids, "labels": ids}


class Ctx:
    """What one rank runs: the module(s), optimizer, inputs and a step function."""


def build_single(row, rank, world, info):
    cfg = cfg_of(row)
    c = Ctx()
    c.model = build_base(cfg)
    c.inner = c.model
    c.inputs = measure.make_inputs(cfg)  # seed 1, exactly measure.py's inputs
    c.fwd_kwargs = lambda: dict(c.inputs)
    return c


def apply_checkpointing(model, row, info):
    """Activation checkpointing of every decoder layer (rows with `checkpoint`), before any wrapper:
    "checkpoint_wrapper" wraps each layer as torchtitan's full AC does (torch.distributed's
    checkpoint_wrapper, CheckpointImpl.NO_REENTRANT, preserve_rng_state=False) and puts the wrapper
    in the layer's place, so fully_shard / DDP wrap the checkpointed layer;
    "hf_gradient_checkpointing" is HF's gradient_checkpointing_enable(use_reentrant=False)."""
    how = row.get("checkpoint")
    if how is None:
        return
    if how == "checkpoint_wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

        layers = model.model.layers
        for i, layer in enumerate(layers):
            layers.register_module(str(i), checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                              preserve_rng_state=False))
    elif how == "hf_gradient_checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise ValueError(how)
    info["checkpointed_layers"] = [type(m).__name__ for m in model.model.layers]


def build_ddp(row, rank, world, info):
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg = cfg_of(row)
    c = Ctx()
    c.inner = build_base(cfg)
    apply_checkpointing(c.inner, row, info)
    c.model = DDP(c.inner, bucket_cap_mb=row["bucket_cap_mb"],
                  gradient_as_bucket_view=row["gradient_as_bucket_view"])
    try:
        ld = c.model._get_ddp_logging_data()
        info["ddp_logging"] = {k: ld[k] for k in ("bucket_sizes", "bucket_cap_bytes", "gradient_as_bucket_view")
                               if k in ld}
    except Exception as e:  # noqa: BLE001
        info["ddp_logging"] = {"error": repr(e)}
    c.inputs = inputs_for(cfg["batch"], 1 + rank, cfg)
    c.fwd_kwargs = lambda: dict(c.inputs)
    return c


def build_fsdp2(row, rank, world, info):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cfg = cfg_of(row)
    c = Ctx()
    mesh = init_device_mesh("cpu", (world,))
    c.model = build_base(cfg)
    apply_checkpointing(c.model, row, info)
    raf = row["reshard_after_forward"]
    kw = {}
    if row.get("mp"):  # the model stays fp32 (sharded params, grads, Adam state); no autocast
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, row["mp"][0]),
                                               reduce_dtype=getattr(torch, row["mp"][1]))
    for layer in c.model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=raf, **kw)
    fully_shard(c.model, mesh=mesh, reshard_after_forward=raf, **kw)
    c.inner = c.model
    c.inputs = inputs_for(cfg["batch"], 1 + rank, cfg)
    c.fwd_kwargs = lambda: dict(c.inputs)
    return c


def freeze_params(model, row, info):
    """Rows with `frozen` = "attn_mlp_except_q_v": every decoder layer's attention and MLP weight
    is frozen (requires_grad False) except q_proj and v_proj (a LoRA-like frozen base that stays
    inside the FSDP1 flat parameters; norms, embedding and lm_head stay trainable). Adam gets
    only the trainable params (param_groups)."""
    how = row.get("frozen")
    if how is None:
        return
    assert how == "attn_mlp_except_q_v", how
    frozen = 0
    for name, p in model.named_parameters():
        if (".self_attn." in name or ".mlp." in name) and not (".q_proj." in name or ".v_proj." in name):
            p.requires_grad_(False)
            frozen += p.numel()
    info["frozen_numel"] = frozen
    info["trainable_numel"] = sum(p.numel() for p in model.parameters() if p.requires_grad)


def apply_lora(model, row, info):
    """Rows with `lora` ({r, alpha, dropout, targets}): peft.get_peft_model(model, LoraConfig(r,
    lora_alpha, lora_dropout, target_modules, bias="none")) on the built model, before checkpointing
    and wrapping. Every base parameter (embedding, norms, lm_head, all linear weights) is frozen;
    each targeted nn.Linear becomes a peft LoraLinear whose base_layer keeps the weight and whose
    lora_A / lora_B (fp32 nn.Linear, no bias) are trainable. The decoder layers stay
    LlamaDecoderLayer modules (inside PeftModelForCausalLM -> LoraModel -> LlamaForCausalLM), so
    ModuleWrapPolicy({LlamaDecoderLayer}) wraps them; their flat params hold the frozen weights and
    the adapters. Returns the PeftModel."""
    from peft import LoraConfig, get_peft_model

    lc = row["lora"]
    model = get_peft_model(model, LoraConfig(r=lc["r"], lora_alpha=lc["alpha"], lora_dropout=lc["dropout"],
                                             target_modules=list(lc["targets"]), bias="none"))
    info["lora_numel"] = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    info["trainable_numel"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    info["frozen_numel"] = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    info["model_class"] = type(model).__name__
    return model


def build_fsdp1(row, rank, world, info):
    """FSDP1: FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
    ...) with the row's settings, on CPU: device_id=torch.device("cpu") (with device_id None the
    constructor raises "FSDP needs a non-CPU accelerator device" in _init_device_handle; with the
    cpu device the handle is torch.cpu: streams and events are no-ops, all-gathers run as
    dist.all_gather into chunk views of the padded unsharded flat param (_all_gather_flat_param's
    is_cpu branch), reduce-scatters as reduce_scatter_single). Checkpointed rows wrap each layer
    in checkpoint_wrapper first (apply_checkpointing) and wrap the CheckpointWrapper, so each
    FSDP unit is FSDP(CheckpointWrapper(LlamaDecoderLayer)), the nesting Accelerate's
    apply_activation_checkpointing after wrapping also gives."""
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cfg = cfg_of(row)
    c = Ctx()
    c.inner = build_base(cfg)
    freeze_params(c.inner, row, info)
    if row.get("lora"):  # PEFT first; checkpoint_wrapper then replaces the PEFT model's decoder layers
        c.inner = apply_lora(c.inner, row, info)
    apply_checkpointing(c.inner.get_base_model() if row.get("lora") else c.inner, row, info)
    if row.get("auto_wrap") == "none":  # one FSDP unit: the whole model is the root's flat param
        policy = None
    elif row.get("checkpoint") == "checkpoint_wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        policy = ModuleWrapPolicy({CheckpointWrapper})
    else:
        policy = ModuleWrapPolicy({LlamaDecoderLayer})
    mp = None
    if row.get("mp"):  # the model stays fp32 (sharded params, grads, Adam state); no autocast
        pd, rd, bd = (getattr(torch, d) for d in row["mp"])
        mp = MixedPrecision(param_dtype=pd, reduce_dtype=rd, buffer_dtype=bd)
    bp = row["backward_prefetch"]
    c.model = FSDP(c.inner, auto_wrap_policy=policy,
                   sharding_strategy=getattr(ShardingStrategy, row["sharding_strategy"]),
                   use_orig_params=row["use_orig_params"], limit_all_gathers=row["limit_all_gathers"],
                   forward_prefetch=row["forward_prefetch"],
                   backward_prefetch=getattr(BackwardPrefetch, bp) if bp else None,
                   mixed_precision=mp, sync_module_states=bool(row.get("sync_module_states", False)),
                   device_id=torch.device("cpu"))
    c.inputs = inputs_for(cfg["batch"], 1 + rank, cfg)
    c.fwd_kwargs = lambda: dict(c.inputs)
    return c


def fsdp1_handles(c) -> list:
    from torch.distributed.fsdp._traversal_utils import _get_fsdp_handles

    return _get_fsdp_handles(c.model)


def fsdp1_state_tensors(c):
    """What an FSDP1 rank holds between steps beyond model.parameters() and their .grad: the
    FlatParameters (with use_orig_params the original params are views into them, or size-0),
    each flat param's .grad (with use_orig_params, zero_grad(set_to_none=True) sets only the
    original params' grads to None; the sharded flat grad lives on until the next forward's
    _root_pre_forward -> _reset_flat_param_grad_info_if_needed), _saved_grad_shard (gradient
    accumulation), and any storage of _full_param_padded / _full_prec_full_param_padded / _mp_shard
    still allocated (returned as (name, tensor) pairs; expected none between steps)."""
    params, grads, other = [], [], []
    for h in fsdp1_handles(c):
        fp = h.flat_param
        params.append(fp)
        grads.append(fp.grad)
        grads.append(getattr(fp, "_saved_grad_shard", None))
        for a in ("_full_param_padded", "_full_prec_full_param_padded", "_mp_shard"):
            t = getattr(fp, a, None)
            if t is not None and t.untyped_storage().nbytes() > 0:
                other.append((a, t))
    return params, grads, other


def fsdp1_units(c) -> list:
    """Each FSDP1 unit's flat parameter: original numel, alignment / world-size padding, padded
    unsharded and sharded sizes, this rank's shard padding, dtype."""
    out = []
    for h in fsdp1_handles(c):
        fp = h.flat_param
        pad = [n for n, is_pad in zip(fp._numels_with_padding, fp._is_padding_mask) if is_pad]
        padded = getattr(fp, "_padded_unsharded_size", None)
        out.append({
            "module": type(h._fully_sharded_module).__name__,
            "num_params": fp._num_params,
            "orig_numel": sum(fp._numels),
            "requires_grad_numel": (sum(fp._numels) if fp.requires_grad else 0) if fp._params is None
            else sum(n for n, p in zip(fp._numels, fp._params) if p.requires_grad),
            "padding_tensor_numels": pad,
            "unpadded_unsharded_numel": fp._unpadded_unsharded_size.numel(),
            "padded_unsharded_numel": padded.numel() if padded is not None else None,
            "sharded_numel": fp._sharded_size.numel(),
            "shard_numel_padded": fp._shard_numel_padded,
            "dtype": str(fp.dtype).replace("torch.", ""),
            "flat_param_requires_grad": fp.requires_grad,
        })
    return out


def build_tp(row, rank, world, info):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    from transformers.masking_utils import create_causal_mask

    cfg = cfg_of(row)
    c = Ctx()
    mesh = init_device_mesh("cpu", (world,))
    c.model = build_base(cfg)
    sp = row["sp"]
    for layer in c.model.model.layers:
        if sp:
            plan = {
                "input_layernorm": SequenceParallel(),
                "post_attention_layernorm": SequenceParallel(),
                "self_attn.q_proj": ColwiseParallel(input_layouts=Shard(1)),
                "self_attn.k_proj": ColwiseParallel(input_layouts=Shard(1)),
                "self_attn.v_proj": ColwiseParallel(input_layouts=Shard(1)),
                "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                "mlp.gate_proj": ColwiseParallel(input_layouts=Shard(1)),
                "mlp.up_proj": ColwiseParallel(input_layouts=Shard(1)),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            }
        else:
            plan = {
                "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            }
        parallelize_module(layer, mesh, plan)
    if sp:
        parallelize_module(c.model, mesh, {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })
    c.inner = c.model
    c.inputs = inputs_for(cfg["batch"], 1, cfg)  # every TP rank sees the same batch
    seq = cfg["seq"]
    batch = cfg["batch"]
    cfg = c.model.config

    def fwd_kwargs():
        kw = dict(c.inputs)
        if sp:  # positions and the mask for the full sequence (HF would size them by the local shard)
            pos = torch.arange(seq).unsqueeze(0)
            shape_only = torch.empty((batch, seq, 1))
            kw["position_ids"] = pos
            kw["attention_mask"] = create_causal_mask(config=cfg, inputs_embeds=shape_only, attention_mask=None,
                                                      cache=None, position_ids=pos)
        return kw

    c.fwd_kwargs = fwd_kwargs
    return c


def _run_layers(stage, h):
    """A stage's layers over `h`, with the positions, causal mask and rotary cos/sin it makes for
    them (as LlamaModel makes them, from the hidden states it holds)."""
    from transformers.masking_utils import create_causal_mask

    pos = torch.arange(h.shape[1]).unsqueeze(0)
    mask = create_causal_mask(config=stage.config, inputs_embeds=h, attention_mask=None, cache=None,
                              position_ids=pos)
    pe = stage.rotary_emb(h, position_ids=pos)
    for layer in stage.layers:
        h = layer(h, attention_mask=mask, position_embeddings=pe, position_ids=pos)
    return h


class Stage0(torch.nn.Module):
    """The first stage: embed_tokens + layers [0, hi)."""

    def __init__(self, m, hi=2):
        super().__init__()
        self.config = m.config
        self.embed_tokens = m.model.embed_tokens
        self.layers = torch.nn.ModuleList(list(m.model.layers[:hi]))
        self.rotary_emb = m.model.rotary_emb

    def forward(self, input_ids):
        return _run_layers(self, self.embed_tokens(input_ids))


class Stage1(torch.nn.Module):
    """A later stage: layers [lo, hi), then (the last stage, head=True) the final norm + lm_head; a
    middle stage (head=False) returns the hidden states."""

    def __init__(self, m, lo=2, hi=None, head=True):
        super().__init__()
        self.config = m.config
        self.layers = torch.nn.ModuleList(list(m.model.layers[lo:hi]))
        self.head = head
        if head:
            self.norm = m.model.norm
            self.lm_head = m.lm_head
        self.rotary_emb = m.model.rotary_emb

    def forward(self, h):
        h = _run_layers(self, h)
        if not self.head:
            return h
        return self.lm_head(self.norm(h))


def build_pp(row, rank, world, info):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    cfg = cfg_of(row)
    c = Ctx()
    full = build_base(cfg)
    loss_function = full.loss_function
    vocab = full.config.vocab_size
    n_st = pp_stages(row)
    bounds = pp_bounds(row)
    my_stages = pp_rank_stages(row)[rank]  # one stage, or (interleaved) this rank's virtual stages
    mods = []
    for s in my_stages:
        lo, hi = bounds[s]
        mods.append(Stage0(full, hi) if s == 0 else Stage1(full, lo, hi, head=s == n_st - 1))
    del full
    gc.collect()
    for m in mods:
        m.train()
    # one stage: the stage module itself (as before); several: a container of them, so that
    # parameters() (Adam, the baseline) covers every local stage
    c.model = c.inner = mods[0] if len(mods) == 1 else torch.nn.ModuleDict({f"stage{s}": m
                                                                           for s, m in zip(my_stages, mods)})
    n_mb = row["microbatches"]
    c.inputs = inputs_for(cfg["batch"] * n_mb, 1, cfg)
    stages = [PipelineStage(m, s, n_st, torch.device("cpu")) for s, m in zip(my_stages, mods)]

    def loss_fn(logits, target):
        measure.mark("loss")
        return loss_function(logits=logits, labels=target, vocab_size=vocab)

    if row["schedule"] == "Interleaved1F1B":
        c.schedule = ScheduleInterleaved1F1B(stages, n_microbatches=n_mb, loss_fn=loss_fn)
    else:
        sched_cls = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[row["schedule"]]
        c.schedule = sched_cls(stages[0], n_microbatches=n_mb, loss_fn=loss_fn)
    for s, stage in zip(my_stages, stages):
        # the mark names the micro-batch and, with several stages per rank, the stage: fwd{mb}@s{stage}
        sfx = f"@s{s}" if len(stages) > 1 else ""
        f_orig, b_orig = stage.forward_one_chunk, stage.backward_one_chunk

        def fwd(fwd_chunk_id, *a, _f=f_orig, _sfx=sfx, **k):
            measure.mark("forward")
            mbmark(f"fwd{fwd_chunk_id}{_sfx}")
            return _f(fwd_chunk_id, *a, **k)

        def bwd(bwd_chunk_id, *a, _b=b_orig, _sfx=sfx, **k):
            measure.mark("backward")
            mbmark(f"bwd{bwd_chunk_id}{_sfx}")
            return _b(bwd_chunk_id, *a, **k)

        stage.forward_one_chunk = fwd
        stage.backward_one_chunk = bwd
    c.stage = stages[0]
    c.stages = stages
    if len(mods) == 1:
        info["stage_modules"] = [n for n, _ in mods[0].named_children()]
    else:
        info["stage_modules"] = {f"stage{s}": [n for n, _ in m.named_children()] for s, m in zip(my_stages, mods)}
    info["pp_stages"] = my_stages
    return c


def param_groups(model) -> list:
    """One Adam param group, or two where DTensor and plain params mix (tp: the replicated embedding,
    norms and lm_head stay plain): foreach ops refuse mixed lists, and Adam runs its foreach ops per
    param group."""
    from torch.distributed.tensor import DTensor

    ps = [p for p in model.parameters() if p.requires_grad]  # frozen rows: trainable only
    dt = [p for p in ps if isinstance(p, DTensor)]
    plain = [p for p in ps if not isinstance(p, DTensor)]
    return [{"params": g} for g in (dt, plain) if g]


BUILDERS = {"single": build_single, "ddp": build_ddp, "fsdp2": build_fsdp2, "tp": build_tp, "pp": build_pp,
            "fsdp1": build_fsdp1}


# ----------------------------------------------------------------------------------------------
# One step
# ----------------------------------------------------------------------------------------------


def run_step(row, rank, c, tracker, losses_out):
    if row["kind"] == "pp":
        measure.mark("forward")
        losses = []
        if rank == 0:
            c.schedule.step(c.inputs["input_ids"], return_outputs=False)
        elif rank == row["world"] - 1:
            c.schedule.step(target=c.inputs["labels"], losses=losses, return_outputs=False)
            losses_out.append(float(sum(x.detach() for x in losses) / len(losses)))
        else:  # a middle stage: receives activations, sends activations; no input, no target
            c.schedule.step(return_outputs=False)
        del losses
    else:
        h = c.inner.lm_head.register_forward_hook(lambda *_: measure.mark("loss"))
        measure.mark("forward")
        with tracker:
            out = c.model(**c.fwd_kwargs())
        loss = out.loss
        h.remove()
        measure.mark("backward")
        loss.backward()
        losses_out.append(float(loss.detach()))
        del loss, out
    measure.mark("optimizer")
    c.opt.step()
    c.opt.zero_grad(set_to_none=True)
    measure.mark("end")


def worker(rank: int, row: dict, port: int, tmpdir: str):
    torch.set_num_threads(1)
    world = row["world"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t0 = time.time()
    info: dict = {}
    if row.get("lora"):  # import peft outside the build window: its import allocates two 8-byte class
        import peft  # noqa: F401  constants (peft/tuners/loha/layer.py HadaWeight, HadaWeightCP)
    # Build window: model, wrapper, optimizer, inputs; everything allocated from here is seen.
    with profile_ctx() as prof, SettleAfterWait():
        c = BUILDERS[row["kind"]](row, rank, world, info)
        c.opt = torch.optim.Adam(param_groups(c.model), foreach=True)
        info["adam_param_groups"] = [len(g["params"]) for g in c.opt.param_groups]
        gc.collect()
    fprof = FilteredProfile(prof, backend_prefixes(row))
    live = measure.analyse_profile(fprof, 0, {})["end_delta_bytes"]
    info["build_backend_internal"] = fprof.info()
    del prof
    info["build_live_bytes"] = live
    params = list(c.model.parameters())
    buffers = list(c.model.buffers())
    info["params_local_numel_bytes"] = sum(local(p).numel() * local(p).element_size() for p in params)
    tracker = measure.ModuleTracker(c.inner, profile_ranges=True)
    steps = {}
    losses: list[float] = []
    for name in STEPS:
        dist.barrier()
        # FSDP1: the flat params, their (sharded) grads and any unsharded storage still allocated
        fp_params, fp_grads, fp_other = fsdp1_state_tensors(c) if row["kind"] == "fsdp1" else ([], [], [])
        pbytes = ubytes(params + buffers + fp_params)
        gbytes = ubytes([p.grad for p in params] + fp_grads)
        sbytes = ubytes(state_tensors(c.opt))
        ibytes = measure.unique_bytes(list(c.inputs.values()))
        visible = pbytes + gbytes + sbytes + ibytes
        other = 0
        if row["kind"] == "ddp":  # the reducer's buckets: DDP's logged bucket sizes (bytes), which the
            # profiler chain (live - visible) cross-checks; the chain alone once read one bucket too
            # many on a rank (a build-time free on gloo's thread went unseen)
            other = sum(int(x) for x in str(info["ddp_logging"]["bucket_sizes"]).split(","))
        elif fp_other:  # FSDP1 unsharded flat-param storages alive between steps (none expected)
            other = measure.unique_bytes([t for _, t in fp_other])
            info.setdefault("fsdp1_other_before", {})[name] = sorted({a for a, _ in fp_other})
        baseline = visible + other
        # FSDP1 with use_orig_params frees the previous step's flat grads in the next forward
        # (_root_pre_forward): hold no reference to them across the step
        del fp_params, fp_grads, fp_other
        t_step = time.time()
        with profile_ctx() as prof, SettleAfterWait():
            run_step(row, rank, c, tracker, losses)
            gc.collect()
        fprof = FilteredProfile(prof, backend_prefixes(row))
        res = measure.analyse_profile(fprof, baseline, {})
        res.update(fprof.info())
        detail = curve_detail(fprof)
        if row["kind"] != "pp":
            detail.pop("microbatch_at_peak")
            detail.pop("microbatch_marks")
        res.update(detail)
        del prof, fprof
        res.update(seconds=round(time.time() - t_step, 1), baseline_bytes=baseline, params_bytes=pbytes,
                   grads_before_bytes=gbytes, optimizer_before_bytes=sbytes, inputs_bytes=ibytes,
                   other_before_bytes=other, baseline_profiler_bytes=live,
                   baseline_check_diff_bytes=live - baseline)
        live += res["end_delta_bytes"]
        steps[name] = res
        print(f"[{row['id']} rank {rank}] {name}: peak {res['peak_bytes']:,} @{res['peak_phase']} "
              f"{res['peak_op']}  base {baseline:,} (params {pbytes:,} grads {gbytes:,} opt {sbytes:,} "
              f"other {other:,}; profiler {res['baseline_profiler_bytes']:,})  loss {losses[-1] if losses else '-'}"
              f"  [{res['seconds']}s]", flush=True)
    if row.get("log_rebuilt_buckets"):  # holdout-ddp-bucket1: DDP's logging data after the steps; with
        # find_unused_parameters=False the constructor makes one bucket of every param (sys.maxsize
        # limit; info.ddp_logging.bucket_sizes) and the second step's forward rebuilds them by
        # bucket_cap_mb (rebuilt_bucket_sizes; the same total bytes, so other_before is unchanged)
        ld = c.model._get_ddp_logging_data()
        info["ddp_logging_after_steps"] = {k: ld[k] for k in ("bucket_sizes", "rebuilt_bucket_sizes",
                                                              "has_rebuilt_buckets") if k in ld}
    if row["kind"] == "fsdp1":
        info["fsdp1_units"] = fsdp1_units(c)
    info["losses"] = losses
    info["seconds"] = round(time.time() - t0, 1)
    with open(os.path.join(tmpdir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "steps": steps, "info": info}, f)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Rows
# ----------------------------------------------------------------------------------------------


def rank_fields(rank: int, steps: dict, info: dict) -> dict:
    f = steps["first"]
    out = {"rank": rank, "params_bytes": f["params_bytes"], "grads_before_bytes": f["grads_before_bytes"],
           "optimizer_before_bytes": f["optimizer_before_bytes"], "other_before_bytes": f["other_before_bytes"],
           "inputs_bytes": f["inputs_bytes"], "params_local_numel_bytes": info["params_local_numel_bytes"]}
    for name, res in steps.items():
        p = f"train_foreach_free_{name}"
        out[f"{p}_baseline_bytes"] = res["baseline_bytes"]
        out[f"{p}_optimizer_before_bytes"] = res["optimizer_before_bytes"]
        out[f"{p}_other_before_bytes"] = res["other_before_bytes"]
        out[f"{p}_baseline_profiler_bytes"] = res["baseline_profiler_bytes"]
        out[f"{p}_baseline_check_diff_bytes"] = res["baseline_check_diff_bytes"]
        out[f"{p}_peak_bytes"] = res["peak_bytes"]
        out[f"{p}_peak_phase"] = res["peak_phase"]
        out[f"{p}_peak_op"] = res["peak_op"]
        out[f"{p}_peak_module"] = res["peak_module"]
        for ph in measure.PHASES:
            out[f"{p}_{ph}_max_bytes"] = res["phase_max_bytes"].get(ph, 0)
        out[f"{p}_end_delta_bytes"] = res["end_delta_bytes"]
        out[f"{p}_top_live_allocations_at_peak"] = res["top_live_allocations_at_peak"]
        out[f"{p}_live_at_end_by_op"] = res["live_at_end_by_op"]
        out[f"{p}_freed_not_allocated_in_step_bytes"] = res["freed_not_allocated_in_step_bytes"]
        for k in ("backend_internal_alloc_bytes", "backend_internal_unfreed_bytes", "backend_internal_by_op"):
            out[f"{p}_{k}"] = res[k]
        if "microbatch_marks" in res:
            out[f"{p}_microbatch_at_peak"] = res["microbatch_at_peak"]
            out[f"{p}_microbatch_marks"] = res["microbatch_marks"]
        out[f"{p}_seconds"] = res["seconds"]
    out["info"] = info
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_row(row: dict) -> dict:
    import torch.multiprocessing as mp

    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(row, free_port(), tmp), nprocs=row["world"], join=True)
        ranks = []
        for r in range(row["world"]):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                d = json.load(f)
            ranks.append(rank_fields(r, d["steps"], d["info"]))
    n_mb = row.get("microbatches", 1)
    cfg = cfg_of(row)
    model = {k: cfg[k] for k in measure.CONFIG_FIELDS if k != "id"}
    model["batch"] = cfg["batch"] * (n_mb if row["kind"] == "pp" else 1)
    model["microbatch_batch"] = cfg["batch"]
    model["seq"] = cfg["seq"]
    return {"id": row["id"], "model": model, "layout": layout_of(row), "ranks": ranks,
            "seconds": round(time.time() - t0, 1)}


METHOD = {
    "peak": "per rank: baseline + max cumulative delta of torch.profiler CPU allocator events (profile_memory) "
            "over one step: forward, loss (from lm_head's output), backward, outputs dropped, Adam(foreach) step, "
            "zero_grad(set_to_none=True); pp: schedule.step(return_outputs=False) + opt.step + zero_grad",
    "steps": "first = no grads, no Adam state; second = the next step (DDP rebuilds its buckets in this forward); "
             "steady = the third step",
    "baseline": "local storages of params+buffers, grads, Adam state, inputs (DTensor: _local_tensor; FSDP2 padded "
                "shard storages) + other_before (DDP reducer buckets: profiler-chained live bytes minus the "
                "tensor-visible bytes); baseline_profiler_bytes = torch-allocator bytes live before the step, from "
                "profiler windows chained from before the model build",
    "gloo": "allocations on gloo worker threads and gloo's internal buffers are not seen by the profiler",
    "threads": "torch.set_num_threads(1) per rank; one process group at a time",
}

FSDP1_METHOD = ("FullyShardedDataParallel(device_id=cpu) per row settings (layout); baseline params = FlatParameter "
                "shard storages (padded; with use_orig_params the original params are views into them), grads = "
                "flat_param.grad / _saved_grad_shard storages (with use_orig_params the sharded flat grad outlives "
                "zero_grad(set_to_none=True) until the next forward), other_before = unsharded flat-param storages "
                "still allocated before the step (none expected); info.fsdp1_units: each unit's flat-param sizes")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", help="regex on row ids; merges into --out")
    ap.add_argument("--holdout", action="store_true",
                    help="measure HOLDOUT_ROWS (HOLDOUT_MODEL) instead; --out defaults to distributed_holdout.json")
    ap.add_argument("--fsdp1", action="store_true",
                    help="measure FSDP1_ROWS (with --holdout: FSDP1_HOLDOUT_ROWS) instead; --out defaults to "
                         "fsdp1_measured.json (fsdp1_holdout.json)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.out is None:
        name = ("fsdp1_holdout.json" if args.holdout else "fsdp1_measured.json") if args.fsdp1 else \
            ("distributed_holdout.json" if args.holdout else "distributed.json")
        args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", name)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if args.fsdp1:
        all_rows = FSDP1_HOLDOUT_ROWS if args.holdout else FSDP1_ROWS
    else:
        all_rows = HOLDOUT_ROWS if args.holdout else ROWS
    rows = [r for r in all_rows if args.only is None or re.search(args.only, r["id"])]
    import transformers

    out_rows = []
    t0 = time.time()
    for r in rows:
        print(f"== {r['id']}", flush=True)
        out_rows.append(measure_row(r))
    doc = {"schema_version": SCHEMA_VERSION,
           "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version()},
           "device": "cpu", "backend": "gloo", "threads": 1,
           "method": dict(METHOD, fsdp1=FSDP1_METHOD) if args.fsdp1 else METHOD, "rows": out_rows,
           "seconds": round(time.time() - t0, 1)}
    path = os.path.abspath(args.out)
    if args.only and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        new_ids = {r["id"] for r in out_rows}
        merged = [r for r in old["rows"] if r["id"] not in new_ids] + out_rows
        order = {r["id"]: i for i, r in enumerate(all_rows)}
        doc["rows"] = sorted(merged, key=lambda r: order.get(r["id"], 99))
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {path} ({len(doc['rows'])} rows) [{time.time() - t0:.0f}s]")


if __name__ == "__main__":
    main()

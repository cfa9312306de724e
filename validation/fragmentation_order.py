#!/usr/bin/env python3
"""Is the BERT-large rows' excess reserved memory in the plan's allocation order? (issue 45)

The transformers docs' BERT-large rows (tests/fixtures/published_memory.json, `hf-bertL-*`) are
NVML after training: the context plus the caching allocator's reserved pool. oomprobe's
allocated peak is within a few percent of them, but its replayed reserved pool is 4 to 7 % over,
in fragmentation. Fragmentation follows the order and sizes of the requests, so this script puts
two request sequences of the same step through the same model of the caching allocator
(validation/snapshot_from_cpu.py's `CachingAllocator`: CUDACachingAllocator.cpp's default rules,
one stream, no limit) and compares their reserved peaks:

* REAL: BertForSequenceClassification (bert-large's shape, random init, eager attention, two
  labels) trained on the CPU, transformers' AdamW as v4.16 stepped it (measure_optimizers.py's
  `TransformersAdamW`), dropout routed to CUDA's `native_dropout` (1-byte masks), gradients kept
  (`zero_grad(set_to_none=False)`, as torch before 2.0), only the loss leaving the step. After one
  warm-up step, the parameters, gradients and Adam state are allocated first (as they exist when
  a steady step starts), then every allocation and free of two recorded steps, in the CPU
  allocator's order (torch.profiler, profile_memory=True);
* PLAN, WHOLE TENSORS: oomprobe's timeline of the same step (`estimate --export-snapshot`: its
  segments at the start, then its allocs and frees), one block per plan tensor, replayed for two
  steps the same way: what oomprobe's own replay did before 2026-12-07 (it gave the same
  reserved peak to the byte);
* PLAN: oomprobe's own replay now (`estimate --json`, `allocator`), which asks for one block per
  PyTorch tensor a piece's model states stand for (`TensorSpec::part_bytes`).

`--family llama` runs the same comparison on a LlamaForCausalLM built from
tests/fixtures/fragmentation_order_llama.json (a made-up grouped-query shape: hidden 1024, 8
layers, 16 heads, 4 key/value heads, ffn 2816, a 32,000-token vocabulary), torch's AdamW with `foreach=True` (one
`_foreach_sqrt` output per parameter), gradients freed (`set_to_none=True`), SDPA: a check the
per-tensor blocks were not built from.

Run it with the validation venv and a release build:

    "${OOMPROBE_VENV:-$HOME/.cache/oomprobe-validation-venv}/bin/python" \
        validation/fragmentation_order.py [--family bert|llama] [--batch 1] [--seq 512] [--layers N]

It prints, for each sequence: requests per step, the allocated (block) peak, the reserved peak
and their difference, and adds the row to tests/fixtures/fragmentation_order.json (a row of the
same shape is replaced), which tests/it/alloc re-predicts.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from measure import _walk, dropout_mode  # noqa: E402
from measure_optimizers import TransformersAdamW  # noqa: E402
from snapshot_from_cpu import CachingAllocator, round_size  # noqa: E402

MIB = 1024 * 1024
LLAMA_CONFIG = "tests/fixtures/fragmentation_order_llama.json"
with open(os.path.join(ROOT, LLAMA_CONFIG)) as _f:
    LLAMA = json.load(_f)


class Replay:
    """A request sequence through `CachingAllocator`: the allocated (as blocks) and reserved
    peaks."""

    def __init__(self):
        self.alloc = CachingAllocator()
        self.allocated = 0
        self.allocated_peak = 0
        self.reserved_peak = 0
        self.at_reserved_peak = 0
        self.requests = 0

    def reserved(self) -> int:
        return sum(s["size"] for s in self.alloc.segments)

    def malloc(self, size: int) -> int:
        addr = self.alloc.malloc(size, [], 0)
        self.requests += 1
        self.allocated += round_size(size)
        self.allocated_peak = max(self.allocated_peak, self.allocated)
        r = self.reserved()
        if r > self.reserved_peak:
            self.reserved_peak, self.at_reserved_peak = r, self.allocated
        return addr

    def free(self, addr: int) -> None:
        self.allocated -= self.alloc.by_addr[addr].size
        self.alloc.free(addr, [], 0)

    def summary(self, steps: int) -> dict:
        return dict(requests_per_step=self.requests // steps if steps else self.requests,
                    allocated_peak_bytes=self.allocated_peak, reserved_peak_bytes=self.reserved_peak,
                    allocated_at_reserved_peak_bytes=self.at_reserved_peak,
                    reserved_over_allocated_peak_bytes=self.reserved_peak - self.allocated_peak)


def real(family: str, batch: int, seq: int, layers: int, steps: int) -> dict:
    import transformers

    torch.manual_seed(0)
    if family == "llama":
        cfg = transformers.LlamaConfig.from_dict(dict(LLAMA, num_hidden_layers=layers))
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq))
        labels, keep_grads = ids, False
    else:
        cfg = transformers.BertConfig(hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16,
                                      intermediate_size=4096, vocab_size=30522, max_position_embeddings=512,
                                      num_labels=2)
        model = transformers.BertForSequenceClassification._from_config(cfg, attn_implementation="eager").train()
        opt = TransformersAdamW(model.parameters(), lr=1e-5)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq))
        labels, keep_grads = torch.randint(0, 2, (batch,)), True

    def step():
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=not keep_grads)

    with dropout_mode(cuda_like=True):
        step()  # warm-up: gradients and Adam state exist
        rep = Replay()
        live = {}
        before = list(model.parameters())
        if keep_grads:
            before += [p.grad for p in model.parameters()]
        before += [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
        before += [ids, labels]
        for t in before:
            s = t.untyped_storage()
            if s.data_ptr() not in live:
                live[s.data_ptr()] = rep.malloc(s.nbytes())
        rep.requests = 0
        t0 = time.time()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            for _ in range(steps):
                step()
        seconds = time.time() - t0
    events = [n for n in _walk(prof.profiler.kineto_results.experimental_event_tree())
              if str(n.tag).endswith("Allocation") and n.extra_fields.alloc_size != 0]
    events.sort(key=lambda n: (n.start_time_ns, n.extra_fields.id))
    unmatched = 0
    for n in events:
        ef = n.extra_fields
        if ef.alloc_size > 0:
            live[ef.ptr] = rep.malloc(ef.alloc_size)
        elif ef.ptr in live:
            rep.free(live.pop(ef.ptr))
        else:
            unmatched += 1
    out = rep.summary(steps)
    out.update(unmatched_frees=unmatched, seconds=round(seconds, 1))
    return out


def plan(family: str, batch: int, seq: int, layers: int, steps: int, binary: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        if family == "llama":
            flags = ["--config", LLAMA_CONFIG, "--attention", "sdpa", "--optimizer-impl", "foreach", "--grads", "free",
                     "--autocast-device", "cpu", "--dropout-mask", "input"]
        else:
            flags = ["--model", "bert-large", "--head", "seq-cls", "--attention", "eager", "--optimizer-impl",
                     "transformers", "--grads", "keep", "--attention-mask", "off"]
        if layers != (8 if family == "llama" else 24):
            flags += ["--layers", str(layers)]
        flags += ["--seq", str(seq), "--batch", str(batch), "--precision", "fp32", "--outputs", "dropped",
                  "--cublas-workspace", "0"]
        path = os.path.join(tmp, "plan.pickle")
        js = subprocess.run([binary, "estimate", "--json", *flags, "--export-snapshot", path],
                            check=True, capture_output=True, text=True, cwd=ROOT).stdout
        with open(path, "rb") as f:
            snap = pickle.load(f)
    est = json.loads(js)
    trace = snap["device_traces"][0]
    # The timeline's blocks at the start are the segments not allocated in the trace.
    in_trace = {e["addr"] for e in trace if e["action"] == "segment_alloc"}
    rep = Replay()
    for s in snap["segments"]:
        for b in s["blocks"]:
            if b["state"] == "active_allocated" and s["address"] not in in_trace:
                rep.malloc(b["requested_size"])
    rep.requests = 0
    for _ in range(steps):
        live = {}
        for e in trace:
            if e["action"] == "alloc":
                live[e["addr"]] = rep.malloc(e["size"])
            elif e["action"] == "free_completed" and e["addr"] in live:
                rep.free(live.pop(e["addr"]))
    whole = rep.summary(steps)
    a = est["allocator"]
    own = dict(flags=" ".join(flags), tensors_peak_bytes=est["breakdown"]["total"],
               allocated_peak_bytes=a["allocated_peak_bytes"], reserved_peak_bytes=a["reserved_peak_bytes"],
               allocated_at_reserved_peak_bytes=a["allocated_at_reserved_peak_bytes"],
               reserved_over_allocated_peak_bytes=a["reserved_peak_bytes"] - a["allocated_peak_bytes"])
    return whole, own


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--family", choices=("bert", "llama"), default="bert")
    ap.add_argument("--layers", type=int, default=0, help="default: 24 (bert), 8 (llama)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "oomprobe"))
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "fragmentation_order.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    layers = args.layers or (8 if args.family == "llama" else 24)
    whole, own = plan(args.family, args.batch, args.seq, layers, args.steps, args.binary)
    r = real(args.family, args.batch, args.seq, layers, args.steps)
    for name, d in (("real", r), ("plan, whole tensors", whole), ("plan", own)):
        n = f"{d['requests_per_step']} requests a step, " if "requests_per_step" in d else ""
        print(f"{name}: {n}allocated peak "
              f"{d['allocated_peak_bytes'] / MIB:,.1f} MiB, reserved peak {d['reserved_peak_bytes'] / MIB:,.1f} MiB, "
              f"over {d['reserved_over_allocated_peak_bytes'] / MIB:,.1f} MiB")
    import transformers

    doc = dict(generated=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               versions=dict(torch=torch.__version__, transformers=transformers.__version__),
               shape=dict(family=args.family, batch=args.batch, seq=args.seq, layers=layers, steps=args.steps),
               method=__doc__, real=r, plan_whole_tensors=whole, plan=own)
    rows = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            rows = [x for x in json.load(f).get("rows", []) if x["shape"] != doc["shape"]]
    rows.append(doc)
    with open(args.out, "w") as f:
        json.dump(dict(rows=rows), f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

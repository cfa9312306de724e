#!/usr/bin/env python3
"""Make PyTorch memory-snapshot fixtures (the format of torch.cuda.memory._dump_snapshot) from a
GPT-2 training step run on the CPU, for oomprobe's `--snapshot` tests.

A real snapshot needs CUDA. This script takes what the CPU can measure and synthesizes the rest:

REAL (measured by torch.profiler(profile_memory=True, with_stack=True) on the CPU allocator):
  * every allocation and free of the recorded training step, in order, with its byte size and
    its (CPU) address, which pairs each free with its allocation;
  * the op that allocated it and its Python stack (module code), or the autograd node that ran
    it in backward;
  * the tensors alive before recording started (parameters, Adam state), sized exactly from
    their storages.
SYNTHESIZED (what the CUDA caching allocator would have done with those requests; rules from
c10/cuda/CUDACachingAllocator.cpp with default settings):
  * block sizes: requests rounded up to a multiple of 512 bytes (kMinBlockSize);
  * pools: requests of at most 1 MiB (kSmallSize) go to the small pool, larger to the large pool;
  * segments (cudaMalloc calls) when no cached free block fits: 2 MiB (kSmallBuffer) for the
    small pool, 20 MiB (kLargeBuffer) for requests under 10 MiB (kMinLargeAlloc), otherwise the
    request rounded up to 2 MiB (kRoundLarge);
  * best fit among free blocks of the pool, a block split when the rest is at least 512 bytes
    (small pool) or more than 1 MiB (large pool), freed blocks merged with free neighbours;
    no segment is ever returned (no empty_cache, no OOM retry);
  * device addresses (segments laid out from 0x7f0000000000 in 2 MiB-aligned steps), one stream
    (0), time stamps from the profiler's clock, frames: the allocating op as a C++-style frame
    ("??", line 0, like the unwinder's) followed by at most two Python frames, innermost first;
  * the trace starts after one warm-up step (as a user calls _record_memory_history after
    building the model), so parameters and Adam state are in `segments` but not in the trace,
    with empty frames (PyTorch has no stack for blocks allocated before recording).

Run it with the validation venv (validation/setup.sh):

    "${OOMPROBE_VENV:-$HOME/.cache/oomprobe-validation-venv}/bin/python" \
        validation/snapshot_from_cpu.py --out tests/fixtures/snapshots

It writes gpt2-tiny-b{1,2,3}.pickle (pickle protocol 4, as pickle.dump writes), peaks.json
(each file's block-level and segment-level peaks, computed here independently of oomprobe) and
the hand-built parser fixtures (hand-oom.pickle, bad-*.pickle). No weights are downloaded
(random init).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import _walk, dropout_mode  # noqa: E402  (shared with the validation harness)

KIB, MIB = 1024, 1024 * 1024
MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 * MIB  # kSmallSize: largest request of the small pool
SMALL_BUFFER = 2 * MIB  # kSmallBuffer: small-pool segment
LARGE_BUFFER = 20 * MIB  # kLargeBuffer: large-pool segment for requests under kMinLargeAlloc
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc
ROUND_LARGE = 2 * MIB  # kRoundLarge
BASE_ADDR = 0x7F0000000000

# The model: GPT-2's architecture at a size that keeps the fixtures small (random init).
CONFIG = dict(n_layer=2, n_embd=128, n_head=4, vocab_size=2048, n_positions=128)
SEQ = 64


def round_size(size: int) -> int:
    return MIN_BLOCK if size < MIN_BLOCK else MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


class Block:
    __slots__ = ("addr", "size", "requested", "free", "segment", "frames")

    def __init__(self, addr, size, segment):
        self.addr, self.size, self.segment = addr, size, segment
        self.requested, self.free, self.frames = 0, True, []


class CachingAllocator:
    """The CUDA caching allocator's block and segment bookkeeping (default settings, one stream,
    unlimited device memory), writing the trace entries PyTorch records."""

    def __init__(self):
        self.segments: list[dict] = []  # {"addr", "size", "small", "blocks": [Block] by address}
        self.next_addr = BASE_ADDR
        self.by_addr: dict[int, Block] = {}
        self.trace: list[dict] = []
        self.recording = False

    def _record(self, action, addr, size, frames, time_us):
        if self.recording:
            self.trace.append(dict(action=action, addr=addr, size=size, stream=0,
                                   time_us=time_us, frames=frames))

    def malloc(self, size: int, frames: list, time_us: int) -> int:
        rsize = round_size(size)
        small = rsize <= SMALL_SIZE
        best = None
        for seg in self.segments:
            if seg["small"] != small:
                continue
            for b in seg["blocks"]:
                if b.free and b.size >= rsize and (best is None or (b.size, b.addr) < (best.size, best.addr)):
                    best = b
        if best is None:
            ssize = segment_size(rsize)
            seg = dict(addr=self.next_addr, size=ssize, small=small, blocks=[])
            self.next_addr += ROUND_LARGE * ((ssize + ROUND_LARGE - 1) // ROUND_LARGE)
            best = Block(seg["addr"], ssize, seg)
            seg["blocks"].append(best)
            self.segments.append(seg)
            self._record("segment_alloc", seg["addr"], ssize, frames, time_us)
        rest = best.size - rsize
        if (small and rest >= MIN_BLOCK) or (not small and rest > SMALL_SIZE):
            tail = Block(best.addr + rsize, rest, best.segment)
            blocks = best.segment["blocks"]
            blocks.insert(blocks.index(best) + 1, tail)
            best.size = rsize
        best.free, best.requested, best.frames = False, size, frames
        self.by_addr[best.addr] = best
        self._record("alloc", best.addr, size, frames, time_us)
        return best.addr

    def free(self, addr: int, frames: list, time_us: int):
        b = self.by_addr.pop(addr)
        self._record("free_requested", b.addr, b.requested, frames, time_us)
        self._record("free_completed", b.addr, b.requested, frames, time_us)
        b.free, b.requested, b.frames = True, 0, []
        blocks = b.segment["blocks"]
        i = blocks.index(b)
        if i + 1 < len(blocks) and blocks[i + 1].free:
            b.size += blocks.pop(i + 1).size
        if i > 0 and blocks[i - 1].free:
            blocks[i - 1].size += blocks.pop(i).size

    def segments_state(self) -> list[dict]:
        out = []
        for seg in self.segments:
            blocks = [dict(address=b.addr, size=b.size, requested_size=b.requested,
                           state="inactive" if b.free else "active_allocated", frames=b.frames)
                      for b in seg["blocks"]]
            allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
            out.append(dict(device=0, address=seg["addr"], total_size=seg["size"], stream=0,
                            segment_type="small" if seg["small"] else "large",
                            segment_pool_id=(0, 0), allocated_size=allocated, active_size=allocated,
                            requested_size=sum(b["requested_size"] for b in blocks),
                            is_expandable=False, blocks=blocks))
        return out


_PY_FRAME = re.compile(r"^(.*)\((\d+)\): (.*)$")


class Frames:
    """Frame dicts shared between entries (pickle stores a repeated object once)."""

    def __init__(self):
        self.cache: dict[tuple, dict] = {}
        self.lists: dict[tuple, list] = {}

    def frame(self, filename, line, name):
        key = (filename, line, name)
        if key not in self.cache:
            self.cache[key] = dict(filename=filename, line=line, name=name)
        return self.cache[key]

    def of_event(self, n) -> list:
        op, node, py = None, None, []
        p = n.parent
        while p is not None:
            name = p.name
            m = _PY_FRAME.match(name)
            if m and len(py) < 2 and "site-packages/torch/" not in m.group(1):
                path = m.group(1)
                path = path.split("site-packages/")[-1]
                py.append(self.frame(path, int(m.group(2)), m.group(3)))
            elif name.startswith("aten::") and op is None:
                op = name
            elif name.startswith("autograd::engine::evaluate_function: ") and node is None:
                node = name.split(": ", 1)[1]
            p = p.parent
        frames = []
        if op:
            frames.append(self.frame("??", 0, op))
        if node:
            frames.append(self.frame("torch/csrc/autograd/engine.cpp", 0, f"evaluate_function: {node}"))
        frames.extend(py)
        key = tuple(id(f) for f in frames)
        return self.lists.setdefault(key, frames)


def training_step(model, opt, batch, vocab):
    ids = torch.randint(0, vocab, (batch, SEQ))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del out, ids


def snapshot_at(batch: int) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(**CONFIG)
    cfg.use_cache = False
    model = GPT2LMHeadModel(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    with dropout_mode(cuda_like=True):
        training_step(model, opt, batch, cfg.vocab_size)  # warm-up: Adam state exists
        alloc = CachingAllocator()
        # Before recording: what the step starts with (on CUDA Adam's `step` counters stay on
        # the CPU, so only params and exp_avg / exp_avg_sq are device blocks).
        before = [p for p in model.parameters()]
        for st in opt.state.values():
            before += [t for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
        pre_ptr = {}
        for t in before:
            s = t.untyped_storage()
            if s.data_ptr() not in pre_ptr:
                pre_ptr[s.data_ptr()] = alloc.malloc(s.nbytes(), [], 0)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
            training_step(model, opt, batch, cfg.vocab_size)
    events = [n for n in _walk(prof.profiler.kineto_results.experimental_event_tree())
              if str(n.tag).endswith("Allocation") and n.extra_fields.alloc_size != 0]
    # Time order; at one time stamp keep the allocator's own sequence (its `id`).
    events.sort(key=lambda n: (n.start_time_ns, n.extra_fields.id))
    t0 = events[0].start_time_ns if events else 0
    frames = Frames()
    alloc.recording = True
    live = dict(pre_ptr)  # CPU address -> synthesized device address
    unmatched = 0
    for n in events:
        ef = n.extra_fields
        t_us = (n.start_time_ns - t0) // 1000
        if ef.alloc_size > 0:
            live[ef.ptr] = alloc.malloc(ef.alloc_size, frames.of_event(n), t_us)
        elif ef.ptr in live:
            alloc.free(live.pop(ef.ptr), frames.of_event(n), t_us)
        else:
            unmatched += 1  # a CPU-side free of memory allocated before the model existed
    if unmatched:
        print(f"batch {batch}: {unmatched} frees of allocations older than the step ignored",
              file=sys.stderr)
    return {"segments": alloc.segments_state(), "device_traces": [alloc.trace]}


def peaks(snap: dict) -> tuple[int, int]:
    """Block-level (bytes as recorded) and segment-level peaks of the whole step, counted as
    oomprobe counts them, independently of its Rust importer."""
    trace = snap["device_traces"][0]
    seg_end = sum(s["total_size"] for s in snap["segments"])
    seg_now = seg_end - sum(e["size"] for e in trace if e["action"] == "segment_alloc")
    blk_end = sum(b["requested_size"] for s in snap["segments"] for b in s["blocks"]
                  if b["state"] == "active_allocated")
    delta = sum(e["size"] for e in trace if e["action"] == "alloc") - sum(
        e["size"] for e in trace if e["action"] == "free_completed")
    blk_now = blk_end - delta
    blk_peak, seg_peak = blk_now, seg_now
    for e in trace:
        if e["action"] == "alloc":
            blk_now += e["size"]
        elif e["action"] == "free_completed":
            blk_now -= e["size"]
        elif e["action"] == "segment_alloc":
            seg_now += e["size"]
        blk_peak, seg_peak = max(blk_peak, blk_now), max(seg_peak, seg_now)
    return blk_peak, seg_peak


def hand_built(out: str) -> None:
    """Schema-exact small files for the parser (fields as torch/cuda/memory.py lists them):
    a trace that ends in an OOM, with a block allocated before recording and freed in the trace,
    one still awaiting its free at dump time, an expandable segment mapped in two steps and
    partly unmapped; then a truncated copy, a pickle that is not a snapshot, and an unknown
    action."""
    f_mm = dict(filename="train.py", line=42, name="forward")
    f_op = dict(filename="??", line=0, name="aten::mm")
    seg0 = 0x7F0000000000
    seg1 = 0x7F0000200000
    exp = 0x7F1000000000

    def entry(action, addr, size, frames=(), **extra):
        e = dict(action=action, addr=addr, size=size, stream=0, time_us=len(trace), frames=list(frames))
        e.update(extra)
        return e

    trace: list = []
    trace.append(entry("free_requested", seg0, 1024))  # allocated before recording
    trace.append(entry("free_completed", seg0, 1024))
    trace.append(entry("segment_alloc", seg1, 2 * MIB, [f_op, f_mm]))
    trace.append(entry("alloc", seg1, 4096, [f_op, f_mm]))
    trace.append(entry("alloc", seg1 + 4096, 8192, [f_op, f_mm]))
    trace.append(entry("free_requested", seg1 + 4096, 8192, [f_op, f_mm]))  # awaits another stream
    trace.append(entry("segment_map", exp, 20 * MIB, [f_op, f_mm]))
    trace.append(entry("segment_map", exp + 20 * MIB, 20 * MIB, [f_op, f_mm]))
    trace.append(entry("segment_unmap", exp + 30 * MIB, 10 * MIB, [f_op, f_mm]))
    trace.append(dict(action="oom", size=3 * 1024 * MIB, stream=0, time_us=len(trace),
                      frames=[f_op, f_mm], device_free=123 * MIB))
    blk = lambda a, size, req, state, frames=(): dict(address=a, size=size, requested_size=req,
                                                      state=state, frames=list(frames))
    segments = [
        dict(device=0, address=seg0, total_size=2 * MIB, stream=0, segment_type="small",
             segment_pool_id=(0, 0), allocated_size=512, active_size=512, requested_size=100,
             is_expandable=False,
             blocks=[blk(seg0, 1024, 0, "inactive"), blk(seg0 + 1024, 512, 100, "active_allocated"),
                     blk(seg0 + 1536, 2 * MIB - 1536, 0, "inactive")]),
        dict(device=0, address=seg1, total_size=2 * MIB, stream=0, segment_type="small",
             segment_pool_id=(0, 0), allocated_size=4096, active_size=4096 + 8192,
             requested_size=4096 + 8192, is_expandable=False,
             blocks=[blk(seg1, 4096, 4096, "active_allocated", [f_op, f_mm]),
                     blk(seg1 + 4096, 8192, 8192, "active_awaiting_free", [f_op, f_mm]),
                     blk(seg1 + 12288, 2 * MIB - 12288, 0, "inactive")]),
        dict(device=0, address=exp, total_size=30 * MIB, stream=0, segment_type="large",
             segment_pool_id=(0, 0), allocated_size=0, active_size=0, requested_size=0,
             is_expandable=True, blocks=[blk(exp, 30 * MIB, 0, "inactive")]),
    ]
    snap = {"segments": segments, "device_traces": [trace], "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""}}
    with open(os.path.join(out, "hand-oom.pickle"), "wb") as f:
        pickle.dump(snap, f, protocol=5)
    data = pickle.dumps(snap, protocol=4)
    with open(os.path.join(out, "bad-truncated.pickle"), "wb") as f:
        f.write(data[: len(data) // 2])
    with open(os.path.join(out, "bad-not-snapshot.pickle"), "wb") as f:
        pickle.dump([1, 2, 3], f, protocol=4)
    bad = {"segments": [], "device_traces": [[dict(action="teleport", addr=1, size=2, stream=0, frames=[])]]}
    with open(os.path.join(out, "bad-action.pickle"), "wb") as f:
        pickle.dump(bad, f, protocol=4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="tests/fixtures/snapshots")
    ap.add_argument("--batches", default="1,2,3")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    hand_built(args.out)
    torch.set_num_threads(1)
    table = {}
    for b in [int(x) for x in args.batches.split(",")]:
        snap = snapshot_at(b)
        path = os.path.join(args.out, f"gpt2-tiny-b{b}.pickle")
        with open(path, "wb") as f:
            pickle.dump(snap, f, protocol=4)
        blk, seg = peaks(snap)
        table[os.path.basename(path)] = {"batch": b, "blocks_peak_bytes": blk, "segments_peak_bytes": seg}
        n = sum(1 for e in snap["device_traces"][0] if e["action"] == "alloc")
        print(f"{path}: {os.path.getsize(path)} bytes, {n} allocations in the trace, "
              f"block peak {blk} B, segment peak {seg} B")
    with open(os.path.join(args.out, "peaks.json"), "w") as f:
        json.dump({"torch": torch.__version__, "config": CONFIG, "seq": SEQ, "files": table}, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

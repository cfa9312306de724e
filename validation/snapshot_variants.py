#!/usr/bin/env python3
"""Write small snapshot files in each layout PyTorch (and its viewer) has produced, for
tests/it/snapshot/real_files.rs, with the totals validation/snapshot_totals.py computes from each.

Usage: python3 validation/snapshot_variants.py [OUT_DIR]
       (default tests/fixtures/snapshots/variants; needs no torch)

The layouts follow PyTorch's own writers (docs/snapshots.md cites the files and commits):
  expandable-oom-4dev.pickle  2.6+ dict with allocator_settings and external_annotations,
                              expandable segments (segment_map/segment_unmap), four trace
                              lists (cuda:3 empty), an `oom` on cuda:1 with size and
                              device_free and no addr, `compile_context` on entries, memory
                              from before the trace on cuda:0 (one block freed in the trace)
  expandable-oom-4dev.json    the same dict as JSON (json.dump of torch.cuda.memory._snapshot())
  expandable-oom-4dev.html    the page torch.cuda._memory_viz trace_plot writes around it
                              (`const local_files = [{name, base64}]`, the pickle NUL-padded)
  profile-to-snapshot.pickle  what torch.cuda._memory_viz._profile_to_snapshot builds from a
                              profiler run: blocks of only size/state, no addresses, frames
                              with filename 'none', trace entries with a `category`
  profile-to-snapshot-cpu.pickle  the same from a CPU profile (no CUDA device: the host is
                              device 0): heap and mmap addresses ~41 TiB apart make one
                              made-up segment of that size (PyTorch's `_profile_to_snapshot`,
                              torch/cuda/_memory_viz.py; the shape issue 35 met in a real file)
  segments-list-dev1.json     a bare list of segments (torch.cuda.memory_snapshot()) on cuda:1
  future-actions.pickle       `user_defined` annotations and an action no release has written
The same generator state (fixed sizes, no randomness) always writes the same bytes.
"""
import base64
import json
import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import snapshot_totals  # noqa: E402

MIB = 1 << 20


def frames(*names):
    """Innermost first, as PyTorch lists them: a C++ op frame, then Python frames."""
    out = [{"filename": "??", "line": 0, "name": "torch::unwind::unwind()"}]
    for n in names:
        if n.startswith("at::"):
            out.append({"filename": "??", "line": 0, "name": n})
        else:
            file, line, fn = n.split(":")
            root = "/usr/lib/python3.11/site-packages" if file.startswith("torch/") else "/home/user/job"
            out.append({"filename": f"{root}/{file}", "line": int(line), "name": fn})
    return out


class Device:
    """A toy caching allocator with expandable segments: each allocation maps its own range
    (2 MiB pages), frees keep the range mapped (cache), `release` unmaps every free range."""

    def __init__(self, index, base):
        self.index = index
        self.trace = []
        self.next = base
        self.ranges = {}  # addr -> [size, block or None]
        self.time = 1_700_000_000_000_000 + index * 1000

    def entry(self, action, **kw):
        self.time += 7
        e = {"action": action, "stream": 0, "time_us": self.time, "compile_context": "N/A"}
        e.update(kw)
        e.setdefault("frames", [])
        self.trace.append(e)

    def alloc(self, size, fr, traced=True):
        pages = -(-size // (2 * MIB)) * 2 * MIB
        free = [a for a, (s, b) in self.ranges.items() if b is None and s >= size]
        if free:
            addr = free[0]
        else:
            addr = self.next
            self.next += pages
            self.ranges[addr] = [pages, None]
            if traced:
                self.entry("segment_map", addr=addr, size=pages, frames=fr)
        self.ranges[addr][1] = {"size": -(-size // 512) * 512, "requested": size, "frames": fr}
        if traced:
            self.entry("alloc", addr=addr, size=size, frames=fr)
        return addr

    def free(self, addr, fr=()):
        b = self.ranges[addr][1]
        self.entry("free_requested", addr=addr, size=b["requested"], frames=list(fr))
        self.entry("free_completed", addr=addr, size=b["requested"], frames=list(fr))
        self.ranges[addr][1] = None

    def release(self):
        for addr in [a for a, (s, b) in self.ranges.items() if b is None]:
            self.entry("segment_unmap", addr=addr, size=self.ranges[addr][0])
            del self.ranges[addr]

    def segments(self):
        out = []
        for addr, (size, b) in sorted(self.ranges.items()):
            blocks = []
            if b is not None:
                blocks.append({"address": addr, "size": b["size"], "requested_size": b["requested"],
                               "state": "active_allocated", "frames": b["frames"]})
                if size > b["size"]:
                    blocks.append({"address": addr + b["size"], "size": size - b["size"],
                                   "requested_size": 0, "state": "inactive", "frames": []})
            else:
                blocks.append({"address": addr, "size": size, "requested_size": 0,
                               "state": "inactive", "frames": []})
            used = b["size"] if b else 0
            out.append({"device": self.index, "address": addr, "total_size": size,
                        "allocated_size": used, "active_size": used,
                        "requested_size": b["requested"] if b else 0, "stream": 0,
                        "segment_type": "large", "segment_pool_id": (0, 0),
                        "is_expandable": True, "frames": blocks[0]["frames"], "blocks": blocks})
        return out


def expandable_oom():
    d0 = Device(0, 0x7F00_0000_0000)
    # Weights loaded before recording: no trace entries; one of them is freed in the trace.
    weights = [d0.alloc(5 * MIB, frames("at::_ops::empty::call", "torch/nn/modules/module.py:1340:to", "train.py:12:main"), traced=False)
               for _ in range(3)]
    old = d0.alloc(1 * MIB, frames("at::_ops::empty::call", "train.py:20:setup"), traced=False)
    d0.free(old)
    acts = [d0.alloc(3 * MIB + i * 4096, frames("at::_ops::mm::call", f"model.py:{40 + i}:forward"))
            for i in range(5)]
    for a in acts[:3]:
        d0.free(a, frames("at::_ops::mm::call", "engine.py:5:backward"))
    d0.release()
    del weights

    d1 = Device(1, 0x7E00_0000_0000)
    held = [d1.alloc(12 * MIB + i * 512, frames("at::_ops::clamp_min::call", "torch/nn/functional.py:1701:relu",
                                                 f"models.py:{170 + i}:update_nodes"))
            for i in range(6)]
    d1.free(held[0])
    # The request that failed: no addr, what the driver had free in device_free.
    d1.entry("oom", size=90 * MIB + 12345, device_free=9 * MIB + MIB // 2,
             frames=frames("at::_ops::clamp_min::call", "torch/nn/functional.py:1701:relu",
                           "models.py:181:update_nodes", "parallel_apply.py:99:_worker"))
    d1.release()  # the allocator empties its cache after the OOM
    for a in held[1:3]:
        d1.free(a)

    d2 = Device(2, 0x7D00_0000_0000)
    x = d2.alloc(6 * MIB, frames("at::_ops::cat::call", "models.py:194:update_nodes"))
    d2.alloc(20 * MIB, frames("at::_ops::mul::call", "models.py:178:update_nodes"))
    d2.free(x)

    devs = [d0, d1, d2]
    return {
        "segments": [s for d in devs for s in d.segments()],
        "device_traces": [d0.trace, d1.trace, d2.trace, []],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                               "max_split_size": -1, "garbage_collection_threshold": 0.0,
                               "expandable_segments": True, "roundup_power2_divisions": {"1": 0}},
        "external_annotations": [{"stage": "START", "name": "step", "device": 1,
                                  "time_us": 1_700_000_000_000_100}],
    }


def profile_to_snapshot():
    """The shape _profile_to_snapshot returns: one pseudo-segment per device spanning the
    lowest to the highest address seen, blocks of size/state only (inactive gaps between)."""
    base = 0x5000_0000
    allocs = [  # (addr offset, size, category, pre-existing, freed)
        (0, 4 * MIB, "parameter", True, False),
        (4 * MIB, 4 * MIB, "optimizer_state", True, False),
        (8 * MIB, 16 * MIB, "activation", False, True),
        (24 * MIB, 8 * MIB, "temporary", False, True),
        (32 * MIB, 4 * MIB, "gradient", False, False),
    ]
    trace = []
    for off, size, cat, pre, _ in allocs:
        if not pre:
            trace.append({"action": "alloc", "addr": base + off, "size": size, "stream": 0,
                          "frames": [{"filename": "none", "line": 0, "name": "forward"}],
                          "category": cat})
    for off, size, cat, pre, freed in allocs:
        if freed:
            for a in ("free_requested", "free_completed"):
                trace.append({"action": a, "addr": base + off, "size": size, "stream": 0,
                              "frames": [{"filename": "none", "line": 0, "name": "forward"}]})
    blocks, last = [], base
    for off, size, cat, pre, freed in allocs:
        if freed:
            continue
        if last < base + off:
            blocks.append({"size": base + off - last, "state": "inactive"})
        blocks.append({"size": size, "state": "active_allocated", "requested_size": size,
                       "frames": [{"filename": "none", "line": 0, "name": cat}]})
        last = base + off + size
    return {"device_traces": [trace, []],
            "segments": [{"device": 0, "address": base, "total_size": last - base, "stream": 0,
                          "blocks": blocks}]}


def cpu_profile_to_snapshot():
    """_profile_to_snapshot over a CPU profile, built as its code builds it: the segment runs
    from the lowest tensor address (glibc's heap, 0x55..) to the highest (an mmap, 0x7f..)."""
    heap, mmap = 0x55D4_1A20_0000, 0x7F3A_C000_0000
    allocs = [  # (addr, size, category, pre-existing, freed)
        (heap, 4 * MIB, "parameter", True, False),
        (heap + 4 * MIB, 4 * MIB, "optimizer_state", True, False),
        (mmap, 16 * MIB, "activation", False, True),
        (mmap + 16 * MIB, 8 * MIB, "temporary", False, True),
        (mmap + 32 * MIB, 4 * MIB, "gradient", False, False),
    ]
    fr = [{"filename": "none", "line": 0, "name": "forward"}]
    trace = []
    for addr, size, cat, pre, _ in allocs[:4]:
        if not pre:
            trace.append({"action": "alloc", "addr": addr, "size": size, "stream": 0,
                          "frames": fr, "category": cat})
    for addr, size, cat, pre, freed in reversed(allocs[:4]):
        if freed:
            for a in ("free_requested", "free_completed"):
                trace.append({"action": a, "addr": addr, "size": size, "stream": 0, "frames": fr})
    addr, size, cat, _, _ = allocs[4]
    trace.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": fr,
                  "category": cat})
    end = max(a + s for a, s, *_ in allocs)
    blocks, last = [], heap
    for addr, size, cat, pre, freed in allocs:
        if freed:
            continue
        if last < addr:
            blocks.append({"size": addr - last, "state": "inactive"})
        blocks.append({"size": size, "state": "active_allocated", "requested_size": size,
                       "frames": fr})
        last = addr + size
    if last < end:
        blocks.append({"size": end - last, "state": "inactive"})
    return {"device_traces": [trace],
            "segments": [{"device": 0, "address": heap, "total_size": end - heap, "stream": 0,
                          "blocks": blocks}]}


def segments_list_dev1():
    d = Device(1, 0x7C00_0000_0000)
    for i in range(4):
        d.alloc((i + 1) * 10 * MIB + 100, frames("at::_ops::empty::call", f"layout.py:{i}:f"), traced=False)
    return [dict(s, is_expandable=False) for s in d.segments()]


def future_actions():
    d = Device(0, 0x6000_0000)
    a = d.alloc(10 * MIB, frames("at::_ops::mm::call", "x.py:1:f"))
    d.entry("user_defined", addr=0, size=0, frames=[], user_metadata="epoch 1")
    d.entry("from_the_future", addr=0, size=123, frames=[])
    d.free(a)
    return {"segments": d.segments(), "device_traces": [d.trace]}


def html_page(pickled):
    """What torch.cuda._memory_viz writes: the pickle, NUL-padded to a multiple of 3, as base64
    in a one-line JSON list inside a module script."""
    padded = pickled + b"\x00" * (3 - len(pickled) % 3)
    files = json.dumps([{"name": "snapshot.pickle",
                         "base64": base64.b64encode(padded).decode()}])
    return ("\n<!DOCTYPE html>\n<html>\n<head>\n</head>\n<body>\n<script type=\"module\">\n"
            "import {add_local_files} from \"https://cdn.jsdelivr.net/gh/pytorch/pytorch@main/"
            "torch/utils/viz/MemoryViz.js\"\n"
            f"const local_files = {files}\n"
            "add_local_files(local_files, 'Active Memory Timeline')\n</script>\n</body>\n")


def summary(path):
    """Per device: the reserved and allocated peaks and the OOM, by snapshot_totals."""
    t = snapshot_totals.totals(path)
    out = {}
    devs = set(t["devices"]) | set(t.get("traces", {}))
    for dev in sorted(devs):
        d = t["devices"].get(dev, {})
        r = t.get("traces", {}).get(dev)
        row = {"reserved_at_dump": d.get("segment_bytes", 0),
               "allocated_at_dump": d.get("block_bytes_active_allocated", 0)}
        if r:
            row["reserved_peak"] = r["reserved"]["peak"]
            row["allocated_peak"] = r["allocated"]["peak"]
            if "oom_events" in r:
                o = r["oom_events"][0]
                row["oom"] = {"size": o["size"], "device_free": o["device_free"]}
        else:
            row["reserved_peak"] = row["reserved_at_dump"]
            row["allocated_peak"] = row["allocated_at_dump"]
        out[str(dev)] = row
    return out


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/snapshots/variants"
    os.makedirs(out_dir, exist_ok=True)
    expected = {}

    def write(name, data, kind="pickle"):
        path = os.path.join(out_dir, name)
        pickled = pickle.dumps(data, protocol=4)
        if kind == "pickle":
            open(path, "wb").write(pickled)
        elif kind == "json":
            open(path, "w").write(json.dumps(data, indent=None))
        elif kind == "html":
            open(path, "w").write(html_page(pickled))
        # Totals come from the pickle of the same data.
        tmp = path + ".tmp"
        open(tmp, "wb").write(pickled)
        expected[name] = summary(tmp)
        os.remove(tmp)

    snap = expandable_oom()
    write("expandable-oom-4dev.pickle", snap)
    write("expandable-oom-4dev.json", snap, "json")
    write("expandable-oom-4dev.html", snap, "html")
    write("profile-to-snapshot.pickle", profile_to_snapshot())
    write("profile-to-snapshot-cpu.pickle", cpu_profile_to_snapshot())
    write("segments-list-dev1.json", segments_list_dev1(), "json")
    write("future-actions.pickle", future_actions())
    with open(os.path.join(out_dir, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    print(json.dumps(expected, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()

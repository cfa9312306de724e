#!/usr/bin/env python3
"""Totals computed directly from a PyTorch CUDA memory snapshot, to check
oomprobe's snapshot importer against.

Usage: python3 validation/snapshot_totals.py FILE [FILE ...] [--json]

Reads every layout PyTorch has written:
  * a bare list of segments (torch.cuda.memory_snapshot(), pickled by hand);
  * {"segments", "device_traces"} from torch.cuda.memory._snapshot() (2.0+),
    blocks carrying "history" (2.0) or "address"/"frames" (2.1+);
  * later extras: "allocator_settings", "external_annotations".

Per device it prints the state at the moment of the snapshot (segment bytes,
allocated/active/requested, blocks by state) and, where a trace exists, a
replay of that device's trace backwards from the final state to get the state
before the trace ("setup") and the peak:
  reserved   -- segment bytes: segment_alloc/segment_map add, segment_free/
                segment_unmap remove (what PyTorch's viewer calls "segments")
  allocated  -- block bytes, replayed forward from the blocks the trace never
                allocated: alloc adds, free_completed removes (trace sizes)
  requested  -- as allocated, but a block leaves at free_requested
(trace "size" can be smaller than the block's "size": the replay's end
then differs from the snapshot's active_allocated bytes by that rounding.)
OOM events ("action": "oom") are listed with their fields.

Snapshots are plain dicts/lists, so pickle.load is used; it refuses (rather
than imports) if the pickle names any class.
"""
import io
import json
import pickle
import sys
from collections import Counter, defaultdict


class _NoClasses(pickle.Unpickler):
    def find_class(self, module, name):  # pragma: no cover - defensive
        raise pickle.UnpicklingError(f"pickle references {module}.{name}")


def load(path):
    with open(path, "rb") as f:
        return _NoClasses(io.BytesIO(f.read())).load()


RESERVE = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def replay(trace, end_value, deltas):
    """Walk a trace backwards from end_value; return (start, peak, i, low) where
    the peak is the value before entry i (after entry i-1)."""
    vals = [end_value]
    cur = end_value
    for e in reversed(trace):
        d = deltas(e)
        cur -= d
        vals.append(cur)
    vals.reverse()  # vals[i] = value before event i; vals[-1] = end
    peak = max(vals)
    return vals[0], peak, vals.index(peak), min(vals)


def totals(path):
    snap = load(path)
    out = {"file": path}
    if isinstance(snap, list):
        out["layout"] = "list of segments (torch.cuda.memory_snapshot())"
        segments, traces = snap, None
    elif isinstance(snap, dict) and "segments" in snap:
        out["layout"] = "dict " + ",".join(sorted(snap))
        segments, traces = snap["segments"], snap.get("device_traces")
    else:
        raise SystemExit(f"{path}: not a memory snapshot ({type(snap).__name__})")

    block_keys = sorted({k for s in segments for b in s.get("blocks", []) for k in b})
    # Blocks without an address (PyTorch 2.0, _profile_to_snapshot) lie front to back in their
    # segment, in the order listed.
    for s in segments:
        at = s.get("address") or 0
        for b in s.get("blocks", []):
            b.setdefault("address", at)
            at = b["address"] + b["size"]
    out["segment_keys"] = sorted({k for s in segments for k in s})
    out["block_keys"] = block_keys
    per_dev = defaultdict(lambda: defaultdict(int))
    states = defaultdict(Counter)
    for s in segments:
        d = per_dev[s.get("device", 0)]
        d["segments"] += 1
        d["segment_bytes"] += s["total_size"]
        d["allocated_size"] += s.get("allocated_size", 0)
        d["active_size"] += s.get("active_size", 0)
        d["requested_size"] += s.get("requested_size", 0)
        d["expandable_segments"] += bool(s.get("is_expandable", False))
        for b in s.get("blocks", []):
            states[s.get("device", 0)][b["state"]] += b["size"]
            d["blocks"] += 1
            if b["state"] == "active_allocated":
                d["block_bytes_active_allocated"] += b["size"]
                d["block_requested_active_allocated"] += b.get("requested_size", b["size"])
    devices = {}
    for dev in sorted(per_dev):
        info = dict(per_dev[dev])
        info["bytes_by_block_state"] = dict(states[dev])
        devices[dev] = info
    out["devices"] = devices

    if traces is not None:
        out["device_traces_len"] = [len(t) for t in traces]
        tr = {}
        for dev, trace in enumerate(traces):
            if not trace:
                continue
            final = devices.get(dev, {})
            actions = Counter(e["action"] for e in trace)
            r = {"entries": len(trace), "actions": dict(actions)}
            seg_events = [e for e in trace if e["action"] in RESERVE]
            r["segment_events"] = len(seg_events)
            start, peak, idx, low = replay(
                trace, final.get("segment_bytes", 0),
                lambda e: RESERVE.get(e["action"], 0) * e["size"])
            r["reserved"] = {"before_trace": start, "peak": peak, "peak_after_entry": idx - 1, "min": low,
                             "at_snapshot": final.get("segment_bytes", 0)}

            # blocks: replay forward from the blocks live at the snapshot that the
            # trace never allocated (they predate it).  The trace's sizes are used
            # for traced blocks; a setup block counts as its block size ("size") or
            # as what was asked for ("requested_size") -- the two setups differ.
            traced = {e["addr"] for e in trace if e["action"] == "alloc"}
            live_end = [b for s in segments if s.get("device", 0) == dev
                        for b in s.get("blocks", []) if b["state"] == "active_allocated"]
            setup_size = sum(b["size"] for b in live_end if b.get("address") not in traced)
            setup_req = sum(b.get("requested_size", b["size"]) for b in live_end
                            if b.get("address") not in traced)
            freed_untraced = 0
            seen = set()
            for e in trace:
                if e["action"] == "alloc":
                    seen.add(e["addr"])
                elif e["action"] == "free_completed" and e["addr"] not in seen:
                    freed_untraced += e["size"]
            for name, free_action in (("allocated", "free_completed"), ("requested_view", "free_requested")):
                cur = setup_size + freed_untraced
                peak, idx, low = cur, -1, cur
                for i, e in enumerate(trace):
                    if e["action"] == "alloc":
                        cur += e["size"]
                    elif e["action"] == free_action:
                        cur -= e["size"]
                    if cur > peak:
                        peak, idx = cur, i
                    low = min(low, cur)
                r[name] = {"before_trace": setup_size + freed_untraced, "peak": peak,
                           "peak_after_entry": idx, "min": low, "end_of_replay": cur,
                           "setup_by_requested_size": setup_req + freed_untraced,
                           "at_snapshot": final.get("block_bytes_active_allocated", 0)}
            ooms = [{k: v for k, v in e.items() if k != "frames"} | {"frames": len(e.get("frames", []))}
                    for e in trace if e["action"] == "oom"]
            if ooms:
                r["oom_events"] = ooms
            tr[dev] = r
        out["traces"] = tr
    for k in ("allocator_settings",):
        if isinstance(snap, dict) and k in snap:
            out[k] = snap[k]
    if isinstance(snap, dict) and "external_annotations" in snap:
        out["external_annotations"] = len(snap["external_annotations"])
    return out


def gib(n):
    return f"{n} B ({n / 2**30:.2f} GiB)"


def show(t):
    print(f"== {t['file']}: {t['layout']}")
    print(f"   segment keys: {', '.join(t['segment_keys'])}")
    print(f"   block keys:   {', '.join(t['block_keys'])}")
    for dev, d in t["devices"].items():
        print(f"   device {dev}: {d['segments']} segments, {d.get('blocks', 0)} blocks, "
              f"segments {gib(d['segment_bytes'])}, allocated_size {gib(d['allocated_size'])}, "
              f"active_allocated blocks {gib(d.get('block_bytes_active_allocated', 0))}, "
              f"expandable {d['expandable_segments']}")
    if "device_traces_len" in t:
        print(f"   device_traces lengths: {t['device_traces_len']}")
    for dev, r in t.get("traces", {}).items():
        print(f"   trace device {dev}: {r['entries']} entries {r['actions']}")
        for k in ("reserved", "allocated", "requested_view"):
            v = r[k]
            extra = ""
            if "setup_by_requested_size" in v:
                extra = (f", setup by requested_size {v['setup_by_requested_size']}"
                         f", replay ends {v['end_of_replay']} vs snapshot {v['at_snapshot']}")
            print(f"     {k:<14} before trace {gib(v['before_trace'])}, peak {gib(v['peak'])} "
                  f"(after entry {v['peak_after_entry']}), min {v['min']}{extra}")
        for o in r.get("oom_events", []):
            print(f"     OOM: {o}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--json"]
    res = [totals(a) for a in args]
    if "--json" in sys.argv:
        print(json.dumps(res, indent=1, default=str))
    else:
        for t in res:
            show(t)

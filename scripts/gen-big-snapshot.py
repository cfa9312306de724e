#!/usr/bin/env python3
"""Make a large memory snapshot from a real one, for measuring how oomprobe reads big files.

The trace entries of `device_traces` are repeated REPS times. Each repetition's entries are new
dicts (shallow copies: their `frames` lists stay shared, as the lists and frame dicts of a real
`torch.cuda.memory._dump_snapshot` are shared between entries), with every address shifted past
the previous repetition so each alloc/free pair stays a pair. Written with pickle protocol 4,
what `_dump_snapshot` uses (torch/cuda/memory.py: `pickle.dump(s, f)` on Python >= 3.8).

    python3 scripts/gen-big-snapshot.py SRC.pickle OUT.pickle [TARGET_MB]   (default 58)

No torch needed: the snapshot pickles hold only dicts, lists, str and int.
"""
import os
import pickle
import sys


def grow(snap, reps):
    out = dict(snap)
    traces = []
    for trace in snap.get("device_traces", []):
        addrs = [e["addr"] for e in trace if "addr" in e]
        span = (max(addrs) - min(addrs) + max((e.get("size", 0) for e in trace), default=0)) if addrs else 0
        # Keep addresses aligned like the allocator's (2 MiB segments).
        shift = (span // (2 << 20) + 1) * (2 << 20)
        new = []
        for r in range(reps):
            for e in trace:
                c = dict(e)
                if "addr" in c and r:
                    c["addr"] = c["addr"] + r * shift
                new.append(c)
        traces.append(new)
    out["device_traces"] = traces
    return out


def main():
    src, dst = sys.argv[1], sys.argv[2]
    target = float(sys.argv[3]) if len(sys.argv) > 3 else 58.0
    with open(src, "rb") as f:
        snap = pickle.load(f)
    one = len(pickle.dumps(grow(snap, 2), protocol=4)) - len(pickle.dumps(snap, protocol=4))
    base = len(pickle.dumps(snap, protocol=4))
    reps = max(1, int((target * 1e6 - base) / max(one, 1)) + 1)
    with open(dst, "wb") as f:
        pickle.dump(grow(snap, reps), f, protocol=4)
    n = sum(len(t) for t in grow(snap, 1)["device_traces"]) * reps
    print(f"{dst}: {os.path.getsize(dst) / 1e6:.1f} MB, {reps} repetitions, {n} trace entries")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Trace what is live at the backward maximum of one train step (diagnostic; not a fixture writer).

Replays measure.py's measure_train_steps for ONE variant (default foreach_free_first) of one row,
with the same model build, inputs, ModuleTracker ranges, SavedRecorder and profiler, so the numbers
equal the fixture's `train_<variant>_backward_max_bytes`. Then walks the CPU allocator's events:
every allocation is attributed (forward: module / aten op, saved-for-backward or not; backward:
autograd node, the module that created that node in forward, aten op; parameter gradients by name).
Prints the backward maximum (op, node, module, live bytes), the live allocations there, and the same
at a chosen "probe" allocation (default: the last layer's fc2 input gradient, [b, s, ffn]).

    OMP_NUM_THREADS=2 ~/.cache/oomprobe-validation-venv/bin/python validation/trace_backward_max.py \
        --row bert-cls-small-p0.1-b3-s192 [--variant foreach_free_first] [--min-kb 200]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import measure as M  # noqa: E402

EVAL = "autograd::engine::evaluate_function: "


def find_row(row_id: str) -> dict:
    for r in M.bert_cls_rows() + M.all_rows() + M.holdout_rows():
        if r["id"] == row_id:
            return r
    raise SystemExit(f"no row {row_id}")


class NodeClaimer:
    """Forward hooks: each module, when its forward returns, claims the not-yet-claimed autograd
    nodes reachable from its outputs (inner modules return first, so they claim first)."""

    def __init__(self, model):
        self.names = {id(m): (n or "<model>") for n, m in model.named_modules()}
        self.owner: dict[int, tuple[str, str]] = {}  # sequence_nr -> (node name, module)
        self.claimed: set = set()
        self.handle = None

    def __enter__(self):
        from torch.nn.modules import module as mm

        def post(mod, _inp, out):
            name = self.names.get(id(mod))
            if name is None:
                return
            stack = [t.grad_fn for t in M.collect_tensors(out) if t.grad_fn is not None]
            while stack:
                n = stack.pop()
                if n is None or n._sequence_nr() < 0 or n._sequence_nr() in self.claimed:
                    continue  # AccumulateGrad (sequence_nr -1): a leaf, nothing to claim
                self.claimed.add(n._sequence_nr())
                self.owner[n._sequence_nr()] = (n.name(), name)
                stack.extend(x for x, _ in n.next_functions)

        self.handle = mm.register_module_forward_hook(post)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def ctx_of(n, owner) -> dict:
    """aten op (outermost aten:: above the allocation), module range, autograd node."""
    op = ""
    p = n.parent
    while p is not None and p.name.startswith("aten::"):
        op = p.name
        p = p.parent
    module = node = ""
    seq = None
    while p is not None:
        if not module and p.name.startswith(M.MODULE_MARK):
            module = p.name[len(M.MODULE_MARK):]
        sn = getattr(p.extra_fields, "sequence_number", -1)
        if seq is None and sn is not None and sn >= 0:
            seq = sn  # the node's own range (e.g. AddmmBackward0) under evaluate_function
        if not node and p.name.startswith(EVAL):
            node = p.name[len(EVAL):].replace("torch::autograd::", "")
            seq = sn if sn is not None and sn >= 0 else seq
        if not node and not module and not p.name.startswith(M.PHASE_MARK) and not p.name.startswith("aten::"):
            node = p.name  # e.g. Optimizer.step#Adam.step
        p = p.parent
    if node and seq is not None and seq in owner:
        module = module or owner[seq][1]
    return {"op": op or "-", "module": module or "-", "node": node or "-"}


def run(row: dict, variant: str):
    foreach = variant.startswith("foreach")
    grads = "free" if "_free_" in variant else "keep"
    step_kind = variant.rsplit("_", 1)[1]
    model, head = M.build_model(row)
    model.train()
    inputs = M.make_inputs(row)
    params, buffers = M.model_tensors(model)
    pname = {id(p): n for n, p in model.named_parameters()}
    param_keys = {M.storage_key(t) for t in params + buffers}
    tracker = M.ModuleTracker(model, profile_ranges=True)
    opt = torch.optim.Adam(params, foreach=foreach)
    if step_kind == "steady":  # the Adam state (and kept grads) the steady step starts from
        with M.dropout_mode(True):
            loss, out = M.run_forward(row, model, inputs)
            loss.backward()
            del loss, out
            opt.step()
            opt.zero_grad(set_to_none=(grads == "free"))
    for p in params:
        p.grad = torch.zeros_like(p) if (grads == "keep" and step_kind == "steady") else None
    gc.collect()
    pbytes = M.unique_bytes(params + buffers)
    gbytes = M.unique_bytes([p.grad for p in params])
    sbytes = M.unique_bytes(M.optimizer_state_tensors(opt))
    ibytes = M.unique_bytes(inputs.values())
    baseline = pbytes + gbytes + sbytes + ibytes
    rec = M.SavedRecorder(param_keys, tracker)  # the tracker only labels records: same memory
    claimer = NodeClaimer(model)

    def to_loss():
        rec.phase = "loss"
        M.mark("loss")

    h = M.head_hook(head, to_loss)
    with M.dropout_mode(True), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        M.mark("forward")
        with tracker, rec.hooks(), claimer:
            loss, out = M.run_forward(row, model, inputs)
        held = {M.storage_key(t) for t in M.collect_tensors(out)} - rec.keys - rec.cast_keys - param_keys
        M.mark("backward")
        loss.backward()
        grad_of = {M.storage_key(p.grad): pname[id(p)] for p in params if p.grad is not None}
        del loss, out
        M.mark("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=(grads == "free"))
        M.mark("end")
    h.remove()
    return prof, baseline, dict(params=pbytes, grads=gbytes, adam=sbytes, inputs=ibytes), rec, held, \
        grad_of, claimer.owner


def analyse(prof, baseline, rec, held, grad_of, owner, probe):
    allocs, marks = M.allocations_and_marks(prof)

    def phase_at(ts):
        return M.phase_at(marks, ts)

    saved_by: dict[int, list] = defaultdict(list)  # storage key -> [(module that saved, shape, dtype)]
    for r in rec.records:
        if not r["param"] and r["storage_bytes"]:
            saved_by[r["key"]].append((r["module"], tuple(r["shape"]), r["dtype"]))
    # the last allocation at each pointer per phase group names the tensor the keys were read from
    last_fwd, last_bwd = {}, {}
    for i, n in enumerate(allocs):
        if n.extra_fields.alloc_size > 0:
            ph = phase_at(n.start_time_ns)
            if ph in ("forward", "loss"):
                last_fwd[n.extra_fields.ptr] = i
            elif ph == "backward":
                last_bwd[n.extra_fields.ptr] = i
    recs = []
    for i, n in enumerate(allocs):
        ef = n.extra_fields
        ph = phase_at(n.start_time_ns)
        c = ctx_of(n, owner)
        kind = "temp"
        what = ""
        if ef.alloc_size > 0:
            if ph in ("forward", "loss") and last_fwd.get(ef.ptr) == i and ef.ptr in saved_by:
                kind = "saved"
                sb = saved_by[ef.ptr]
                mods = sorted({s[0] for s in sb})
                what = f"saved by {','.join(mods)} as {list(sb[0][1])} {sb[0][2]}"
            elif ph in ("forward", "loss") and last_fwd.get(ef.ptr) == i and ef.ptr in held:
                kind = "held"
            elif ph == "backward" and last_bwd.get(ef.ptr) == i and ef.ptr in grad_of:
                kind = "grad"
                what = grad_of[ef.ptr]
        recs.append(dict(i=i, ptr=ef.ptr, size=ef.alloc_size, phase=ph, kind=kind, what=what, **c))

    live: dict[int, dict] = {}
    cum = 0
    bmax, bmax_i, bmax_live = None, -1, {}
    probe_i, probe_live, probe_cum = -1, {}, 0
    freed_at: dict[int, int] = {}  # alloc index -> index of the event freeing it
    for r in recs:
        cum += r["size"]
        if r["size"] > 0:
            live[r["ptr"]] = r
        elif r["ptr"] in live:
            freed_at[live.pop(r["ptr"])["i"]] = r["i"]
        if r["phase"] == "backward" and (bmax is None or cum > bmax):
            bmax, bmax_i, bmax_live = cum, r["i"], dict(live)
        if probe_i < 0 and r["size"] > 0 and r["phase"] == "backward" and probe(r):
            probe_i, probe_live, probe_cum = r["i"], dict(live), cum
    return recs, baseline, (bmax, bmax_i, bmax_live), (probe_i, probe_live, probe_cum), freed_at


def label(r):
    if r["kind"] == "grad":
        return f"grad {r['what']}  [{r['node']} / {r['op']}]"
    if r["kind"] == "saved":
        return f"saved fwd {r['module']} / {r['op']}  ({r['what']})"
    if r["kind"] == "held":
        return f"caller-held output {r['module']} / {r['op']}"
    where = r["node"] if r["phase"] == "backward" else r["module"]
    mod = f" <{r['module']}>" if r["phase"] == "backward" and r["module"] != "-" else ""
    return f"{r['phase']} temp {where}{mod} / {r['op']}"


def show_live(title, live, total, base_parts, min_bytes, top=None):
    rows = sorted(live.values(), key=lambda r: -r["size"])
    print(f"{title}: live {total:,} B = baseline {sum(base_parts.values()):,} "
          f"({', '.join(f'{k} {v:,}' for k, v in base_parts.items() if v)}) + {total - sum(base_parts.values()):,}")
    by_kind = defaultdict(int)
    for r in rows:
        by_kind[r["kind"] + ("" if r["kind"] != "temp" else "_" + r["phase"])] += r["size"]
    print("  by kind: " + ", ".join(f"{k} {v:,}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])))
    shown = rows if top is None else rows[:top]
    rest = 0
    for r in shown:
        if r["size"] >= min_bytes:
            print(f"  {r['size']:>11,}  {label(r)}")
        else:
            rest += r["size"]
    rest += sum(r["size"] for r in rows[len(shown):])
    print(f"  {rest:>11,}  ({len([r for r in rows if r['size'] < min_bytes]) if top is None else len(rows) - len(shown)}"
          f" smaller/other allocations)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--row", default="bert-cls-small-p0.1-b3-s192")
    ap.add_argument("--variant", default="foreach_free_first")
    ap.add_argument("--min-kb", type=float, default=200)
    ap.add_argument("--top", type=int, default=None, help="list only the N biggest live allocations")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    row = find_row(a.row)
    L, b, s, ffn = row["layers"], row["batch"], row["seq"], row["ffn"]
    fc2 = f"bert.encoder.layer.{L - 1}.output.dense"
    fc2_in_grad = b * s * ffn * 4
    prof, baseline, parts, rec, held, grad_of, owner = run(row, a.variant)
    recs, baseline, (bmax, bmax_i, bmax_live), (pi, plive, pcum), freed_at = analyse(
        prof, baseline, rec, held, grad_of, owner,
        lambda r: r["module"] == fc2 and r["size"] == fc2_in_grad and r["node"].startswith("Addmm"))
    ev = recs[bmax_i]
    print(f"row {a.row} variant {a.variant}: backward max {baseline + bmax:,} B at alloc #{bmax_i} "
          f"({ev['size']:,} B) node {ev['node']} module {ev['module']} op {ev['op']} -> {label(ev)}")
    bwd = [r for r in recs if r["phase"] == "backward"]
    print(f"backward start (first bwd event) live {baseline + sum(r['size'] for r in recs[:bwd[0]['i']]):,} B")
    show_live("AT BACKWARD MAX", bmax_live, baseline + bmax, parts, a.min_kb * 1024, a.top)
    if pi >= 0:
        pr = recs[pi]
        print(f"\nPROBE: {fc2} input grad ({fc2_in_grad:,} B) allocated at #{pi} node {pr['node']} op {pr['op']}")
        show_live("AT PROBE", plive, baseline + pcum, parts, a.min_kb * 1024, a.top)
        grads_then = [r["what"] for r in plive.values() if r["kind"] == "grad"]
        print(f"  param grads existing then: {grads_then or 'none'}")
        lay = f"bert.encoder.layer.{L - 1}."
        gone = [r for r in recs if r["kind"] == "saved" and r["module"].startswith(lay) and r["size"] > 0
                and r["i"] in freed_at and freed_at[r["i"]] < pi]
        print(f"  saved tensors allocated in {lay}* already freed then: "
              + ("; ".join(f"{r['module']}/{r['op']} {r['size']:,}" for r in gone) or "none"))
        # every allocator event of the last layer's MLP backward (output.LayerNorm .. intermediate.dense)
        lo = min(r["i"] for r in recs if r["phase"] == "backward" and r["module"] == f"{lay}output.LayerNorm")
        hi = max(r["i"] for r in recs if r["phase"] == "backward" and r["module"] == f"{lay}intermediate.dense")
        print(f"  allocator events of {lay}output.LayerNorm .. intermediate.dense backward (live after each):")
        cum = baseline + sum(r["size"] for r in recs[:lo])
        alloc_by_ptr = {}
        for r in recs[:hi + 1]:
            if r["size"] > 0:
                alloc_by_ptr[r["ptr"]] = r
            if r["i"] < lo:
                continue
            cum += r["size"]
            if abs(r["size"]) < a.min_kb * 1024:
                continue
            src = r if r["size"] > 0 else alloc_by_ptr.get(r["ptr"], r)
            print(f"    #{r['i']:<4} {r['size']:>+12,} live {cum:>12,}  {r['node']} <{r['module']}> {r['op']}"
                  + ("" if r["size"] > 0 else f"  frees: {label(src)}"))
    print("\nbackward node order (node <module>: net bytes, max live within):")
    cum = sum(r["size"] for r in recs[:bwd[0]["i"]])
    cur, net, mx = None, 0, 0
    out = []
    for r in bwd:
        key = (r["node"], r["module"])
        if key != cur:
            if cur is not None:
                out.append((cur, net, mx))
            cur, net, mx = key, 0, 0
        cum += r["size"]
        net += r["size"]
        mx = max(mx, baseline + cum)
    out.append((cur, net, mx))
    for (node, mod), net, mx in out:
        print(f"  {node:<32} <{mod}>  net {net:+,}  max {mx:,}")


if __name__ == "__main__":
    main()

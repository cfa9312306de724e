#!/usr/bin/env python3
"""Lightning's own BatchSizeFinder against oomprobe, under a real memory cap, on this CPU.

For each row (a GPT-2-style and a LLaMA-style model built from a config with random init, at
two or more address-space limits) three answers to "what is the max batch?", each in a fresh
process started under `prlimit --as=LIMIT`:

* lightning: Lightning's `BatchSizeFinder(mode="binsearch", margin=0)` (margin 0, so it reports
  the edge it found rather than 95 % of it), its trials counted;
* predicted: oomprobe's prediction for the same limit less the process's measured baseline
  (its address space after the hook's warm-up trial at batch 1, less the model states live
  then: parameters, gradients, Adam's state, which the plan counts);
* hook: `oomprobe.lightning.BatchSizeFinder`, that prediction checked with real trials;
* fresh: what a real training run gets: the largest batch at which a fresh process completes
  TRUTH_STEPS optimizer steps under the cap (bisection, one process per probe).

Each row runs under two host allocators (ALLOCATORS): glibc's defaults, and every
allocation of 128 KiB or more its own mapping (MALLOC_MMAP_THRESHOLD_), which takes glibc's
retained heaps out of the address space.

Both finders run `steps_per_trial` (2) optimizer steps a trial. Lightning treats
"DefaultCPUAllocator: can't allocate memory" as an OOM (lightning.pytorch.utilities.memory
.is_out_of_cpu_memory). The table goes to tests/fixtures/batch_finder.json and a summary to
stdout. Needs the validation venv (validation/setup.sh installs lightning there):

    "$VENV/bin/python" validation/batch_finder.py            # every row
    "$VENV/bin/python" validation/batch_finder.py --rows gpt2-5.0GiB
    "$VENV/bin/python" validation/batch_finder.py peak        # step peaks vs the plan, no cap
    "$VENV/bin/python" validation/batch_finder.py configs     # tests/fixtures/batch_finder/*.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "batch_finder.json"
CONFIGS = REPO / "tests" / "fixtures" / "batch_finder"
THREADS = 2
STEPS_PER_TRIAL = 2
# A fresh training run "fits" when this many optimizer steps complete under the cap.
TRUTH_STEPS = 3
# The host allocator, as the processes run it: glibc's defaults (its mmap threshold rises to
# the size of the largest freed block, up to 32 MiB, so mid-sized tensors come from heaps it
# keeps), or every allocation of 128 KiB and more its own mapping, returned when freed.
ALLOCATORS = {"glibc": {}, "mmap": {"MALLOC_MMAP_THRESHOLD_": "131072"}}
GiB = 1 << 30

# Models from configs (random init). GPT-2's vocabulary and layout at a small width; a LLaMA
# layout (RMSNorm, SwiGLU, RoPE, grouped-query attention) with LLaMA-2's vocabulary.
MODELS = {
    "gpt2": {
        "family": "gpt2",
        "config": {"n_layer": 4, "n_embd": 256, "n_head": 4, "n_positions": 512,
                   "vocab_size": 50257},
        "seq": 64,
    },
    "llama": {
        "family": "llama",
        "config": {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 688,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32000,
                   "max_position_embeddings": 512, "tie_word_embeddings": False},
        "seq": 128,
    },
}
LIMITS_GIB = {"gpt2": [6.0, 8.0], "llama": [6.0, 8.0]}
# Held out until the four rows above were done, then run once.
HOLDOUT = {"gpt2": [7.0], "llama": [7.0]}


def rows(holdout: bool = False) -> list[dict]:
    table = HOLDOUT if holdout else LIMITS_GIB
    return [{"id": f"{m}-{g}GiB-{a}", "model": m, "limit": int(g * GiB), "allocator": a,
             "holdout": holdout}
            for a in ALLOCATORS for m, gs in table.items() for g in gs]


# ---------------------------------------------------------------------------------------------
# In the child (under the cap)


def vm_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def build(model_name: str):
    import torch
    import lightning.pytorch as pl
    import transformers

    spec = MODELS[model_name]
    torch.manual_seed(0)
    if spec["family"] == "gpt2":
        cfg = transformers.GPT2Config(**spec["config"])
        net = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(**spec["config"])
        net = transformers.LlamaForCausalLM(cfg)
    seq, vocab = spec["seq"], cfg.vocab_size

    class Tokens(torch.utils.data.Dataset):
        """Random token ids made on demand (no data held): long enough for any batch."""

        def __len__(self):
            return 1 << 20

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return torch.randint(0, vocab, (seq,), generator=g)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = net
            self.config = net.config
            self.batch_size = 2

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Tokens(), batch_size=self.batch_size)

    return Module(), spec


def tensor_bytes(module, optimizers=()) -> int:
    """Bytes of the tensors the plan counts as model states that are live now: parameters,
    buffers, gradients and the optimizers' state."""
    import torch

    tensors = list(module.parameters()) + list(module.buffers())
    tensors += [p.grad for p in module.parameters() if p.grad is not None]
    for opt in optimizers:
        for st in opt.state.values():
            tensors += [t for t in st.values() if torch.is_tensor(t)]
    seen, total = set(), 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def oomprobe_flags(spec: dict) -> dict:
    """The workload as Lightning runs it here: fp32, AdamW for-loop (torch's CPU default),
    gradients alive until the next backward (Lightning's closure), only the loss leaving
    training_step, the CPU's SDPA kernels and dropout noise."""
    return dict(seq=spec["seq"], precision="fp32", optimizer_impl="for-loop",
                grads="until-backward", outputs="dropped", autocast_device="cpu",
                dropout_mask="input")


def trainer_for(callback, max_steps: int = 1):
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0,
                      default_root_dir=os.environ.get("TMPDIR", "/tmp"),
                      callbacks=[callback] if callback is not None else [])


def child(mode: str, model_name: str, limit: int) -> dict:
    import torch
    from lightning.pytorch.callbacks import BatchSizeFinder as LightningFinder

    sys.path.insert(0, str(REPO / "python"))
    import oomprobe
    from oomprobe.lightning import BatchSizeFinder as HookFinder

    torch.set_num_threads(THREADS)
    module, spec = build(model_name)
    out: dict = {"mode": mode}
    t0 = time.time()
    if mode == "lightning":
        finder = LightningFinder(mode="binsearch", steps_per_trial=STEPS_PER_TRIAL, margin=0.0)
        finder._early_exit = True  # the search only, as `Tuner.scale_batch_size` runs it
        trials: list = []
        _count_trials(trials)
        trainer_for(finder).fit(module)
        out.update(batch=finder.optimal_batch_size, trials=len(trials),
                   trial_batches=trials)
    else:
        measured: dict = {}

        def memory(trainer, pl_module):
            # After the hook's warm-up trial (batch 1): the address space less the model
            # states live now (the plan counts those) is what is not the step's tensors.
            vm, own = vm_bytes(), tensor_bytes(pl_module, trainer.optimizers)
            measured.update(vm_after_warmup=vm, model_state_bytes=own,
                            baseline=vm - own, room=limit - (vm - own))
            return str(limit - (vm - own))

        finder = HookFinder(memory=memory, steps_per_trial=STEPS_PER_TRIAL,
                            **oomprobe_flags(spec))
        finder._early_exit = True
        trainer_for(finder).fit(module)
        br = finder.bracket
        out.update(measured, predicted=finder.predicted, fallback=finder.fallback_reason)
        if br is not None:
            out.update(batch=br.batch, first_fail=br.first_fail,
                       trials=finder.warmup_trials + br.real_steps,
                       warmup_trials=finder.warmup_trials,
                       trial_batches=[[b, ok] for b, ok in br.steps])
        out["oomprobe_version"] = oomprobe.version()
    out["seconds"] = round(time.time() - t0, 1)
    return out


def fit_at(model_name: str, batch: int, steps: int) -> dict:
    """A real training run at one batch, from a fresh process: `steps` optimizer steps."""
    import torch
    from lightning.pytorch.utilities.memory import is_oom_error

    torch.set_num_threads(THREADS)
    module, _ = build(model_name)
    module.batch_size = batch
    try:
        trainer_for(None, max_steps=steps).fit(module)
    except RuntimeError as e:
        if not is_oom_error(e):
            raise
        return {"batch": batch, "fits": False}
    return {"batch": batch, "fits": True}


def overhead(model_name: str, batch: int) -> dict:
    """A fresh Lightning fit of 3 steps, no cap, no profiler: the address space's peak over its
    size at fit start, beside the plan's tensors (what the host allocator adds on top)."""
    import torch

    sys.path.insert(0, str(REPO / "python"))
    import oomprobe

    torch.set_num_threads(THREADS)
    module, spec = build(model_name)
    module.batch_size = batch
    start = vm_bytes()
    trainer_for(None, max_steps=3).fit(module)
    vm_peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status")
                   if l.startswith("VmPeak:"))
    plan = oomprobe.estimate(config=module.config, batch=batch, **oomprobe_flags(spec))
    # The plan's peak counts the parameters, which are mapped before fit start.
    tensors = plan["breakdown"]["total"] - plan["breakdown"]["params"]
    return {"model": model_name, "batch": batch, "vm_at_fit_start": start, "vm_peak": vm_peak,
            "plan_tensors_after_params": tensors, "beyond_tensors": vm_peak - start - tensors}


def _count_trials(trials: list) -> None:
    """Records each batch Lightning's finder runs (its one loop run per trial)."""
    from lightning.pytorch.tuner import batch_size_scaling as bs

    real = bs._try_loop_run

    def counted(trainer, params):
        # The batch, and the address space the process holds as the trial begins (what the
        # trials before it left behind).
        trials.append([trainer.lightning_module.batch_size, vm_bytes()])
        return real(trainer, params)

    bs._try_loop_run = counted


# ---------------------------------------------------------------------------------------------
# Step peaks without a cap: the plan against PyTorch's allocator, Lightning's order


def peak(model_name: str, batch: int) -> dict:
    """A real Lightning fit of 3 steps under the profiler: the live bytes' peak over the run
    (params included), against the plan's peak for the same step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(REPO / "python"))
    import oomprobe

    torch.set_num_threads(THREADS)
    module, spec = build(model_name)
    module.batch_size = batch
    trainer = trainer_for(None, max_steps=3)
    base = tensor_bytes(module)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.fit(module)
    # The allocator's own events (as validation/measure.py reads them): bytes in and out.
    allocs, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        n = stack.pop()
        if str(n.tag).endswith("Allocation"):
            allocs.append(n)
        stack.extend(n.children)
    live, top = 0, 0
    for n in sorted(allocs, key=lambda n: n.start_time_ns):
        live += n.extra_fields.alloc_size
        top = max(top, live)
    plan = oomprobe.estimate(config=module.config, batch=batch, **oomprobe_flags(spec))
    return {"model": model_name, "batch": batch, "measured_peak": base + top,
            "plan_peak": plan["breakdown"]["total"],
            "plan_peak_phase": plan["timeline"]["peak_phase"]}


# ---------------------------------------------------------------------------------------------
# The parent


def run_child(args: list[str], limit: int | None, allocator: str = "glibc") -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore", **ALLOCATORS[allocator])
    if "OOMPROBE" not in env:
        for build in ("release", "debug"):
            exe = REPO / "target" / build / "oomprobe"
            if exe.exists():
                env["OOMPROBE"] = str(exe)
                break
    cmd = [sys.executable, __file__, *args]
    if limit is not None:
        cmd = ["prlimit", f"--as={limit}", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def fresh_edge(r: dict, start: int) -> dict:
    """The largest batch a fresh training run gets under the cap (TRUTH_STEPS steps), each
    probe its own process: what the user's real run gets, free of any search's history."""
    sys.path.insert(0, str(REPO / "python"))
    from oomprobe.verify import bracket

    def step(b: int) -> None:
        out = run_child(["child", "--mode", "fit", "--model", r["model"], "--batch", str(b)],
                        r["limit"], r["allocator"])
        if not out["fits"]:
            raise MemoryError(b)

    br = bracket(max(1, start), step)
    return {"batch": br.batch, "first_fail": br.first_fail, "probes": br.real_steps,
            "probe_batches": [[b, ok] for b, ok in br.steps]}


def report(fixture: dict) -> str:
    """The fixture as docs/validation.md's table (no torch needed)."""
    out = ["| row | allocator | fresh run | Lightning binsearch (trials) | predicted | hook (trials) |",
           "|---|---|---|---|---|---|"]
    for r in fixture["rows"]:
        lt, hk, fr = r["lightning"], r["hook"], r["fresh"]
        name = f"{r['model']} {r['limit'] / GiB:g} GiB" + (" (held out)" if r["holdout"] else "")
        out.append(f"| {name} | {r['allocator']} | {fr['batch']} | {lt['batch']} ({lt['trials']}) "
                   f"| {hk['predicted']} | {hk['batch']} ({hk['trials']}) |")
    return "\n".join(out)


def versions() -> dict:
    import importlib.metadata as m

    return {p: m.version(p) for p in ("torch", "lightning", "transformers")} | {
        "python": platform.python_version()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", default="table",
                    choices=["table", "peak", "child", "configs", "report"])
    ap.add_argument("--rows", help="comma-separated row ids (default: all but the held-out)")
    ap.add_argument("--holdout", action="store_true", help="run the held-out rows")
    ap.add_argument("--mode"), ap.add_argument("--model"), ap.add_argument("--limit", type=int)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default=str(FIXTURE))
    ap.add_argument("--again", action="store_true", help="measure rows the fixture holds too")
    a = ap.parse_args()
    if a.what == "child":
        if a.mode == "peak":
            print(json.dumps(peak(a.model, a.batch)))
        elif a.mode == "overhead":
            print(json.dumps(overhead(a.model, a.batch)))
        elif a.mode == "fit":
            print(json.dumps(fit_at(a.model, a.batch, TRUTH_STEPS)))
        else:
            print(json.dumps(child(a.mode, a.model, a.limit)))
        return
    if a.what == "report":
        print(report(json.loads(Path(a.out).read_text())))
        return
    if a.what == "configs":
        # Each model's config.json, as the hook hands it to oomprobe: what CI re-predicts from.
        for m in MODELS:
            module, _ = build(m)
            path = CONFIGS / f"{m}.json"
            path.write_text(module.config.to_json_string(use_diff=False))
            print(path)
        return
    if a.what == "peak":
        # Step peaks of a real Lightning fit (3 steps, no cap) against the plan, at two batches:
        # tests/fixtures/batch_finder/peaks.json.
        peaks = []
        for m in MODELS:
            for b in (8, 16):
                r = run_child(["child", "--mode", "peak", "--model", m, "--batch", str(b)], None)
                r["error_pct"] = round(100 * (r["plan_peak"] / r["measured_peak"] - 1), 3)
                r["flags"] = oomprobe_flags(MODELS[m])
                print(json.dumps(r), flush=True)
                peaks.append(r)
        # What each host allocator maps beyond the tensors, by batch (no profiler, no cap).
        beyond = []
        for alloc in ALLOCATORS:
            for m in MODELS:
                for b in (8, 24, 40):
                    r = run_child(["child", "--mode", "overhead", "--model", m, "--batch",
                                   str(b)], None, alloc)
                    r["allocator"] = alloc
                    print(json.dumps(r), flush=True)
                    beyond.append(r)
        (CONFIGS / "peaks.json").write_text(json.dumps(
            {"what": "live-byte peak of a Lightning fit (3 steps, the CPU allocator's events "
                     "in torch.profiler, params included) against the plan; and the address "
                     "space a fit maps beyond the plan's tensors, by host allocator",
             "versions": versions(), "threads": THREADS, "rows": peaks,
             "beyond_tensors": beyond}, indent=1) + "\n")
        return
    todo = rows(a.holdout)
    if a.rows:
        want = set(a.rows.split(","))
        todo = [r for r in rows(False) + rows(True) if r["id"] in want]
    fixture = json.loads(Path(a.out).read_text()) if Path(a.out).exists() else {"rows": []}
    done = {r["id"]: r for r in fixture["rows"]}
    for r in todo:
        if r["id"] in done and not a.rows and not a.again:
            continue  # measured already (--again measures it anew)
        row = dict(r, model_spec=MODELS[r["model"]], steps_per_trial=STEPS_PER_TRIAL,
                   truth_steps=TRUTH_STEPS, oomprobe_flags=oomprobe_flags(MODELS[r["model"]]))
        for mode in ("lightning", "hook"):
            row[mode] = run_child(["child", "--mode", mode, "--model", r["model"],
                                   "--limit", str(r["limit"])], r["limit"], r["allocator"])
            print(r["id"], mode, json.dumps(row[mode]), flush=True)
        row["fresh"] = fresh_edge(r, start=row["lightning"]["batch"])
        print(r["id"], "fresh", json.dumps(row["fresh"]), flush=True)
        lt, hk, fr = row["lightning"]["batch"], row["hook"], row["fresh"]["batch"]
        row["agree"] = {"lightning_hook": abs(lt - hk["batch"]) <= 1,
                        "lightning_predicted": abs(lt - hk["predicted"]) <= 1,
                        "fresh_predicted": abs(fr - hk["predicted"]) <= 1,
                        "fresh_lightning": abs(fr - lt) <= 1}
        done[r["id"]] = row
        fixture = {"what": __doc__.split("\n\n")[0], "versions": versions(), "threads": THREADS,
                   "rows": sorted(done.values(), key=lambda x: (x["holdout"], x["id"]))}
        Path(a.out).write_text(json.dumps(fixture, indent=1) + "\n")
    for row in fixture["rows"]:
        lt, hk, fr = row["lightning"], row["hook"], row["fresh"]
        print(f"{row['id']:>20}: fresh runs {fr['batch']}, lightning {lt['batch']} in "
              f"{lt['trials']} trials, predicted {hk['predicted']}, hook {hk['batch']} in "
              f"{hk['trials']} trials")


if __name__ == "__main__":
    main()

"""Fuzzing the Python API (issue 48): estimate, diagnose, diagnose_oom and max_batch called with
random wrong types and values (seeded `random`, no hypothesis). Each call returns or raises
ValueError or TypeError, never AttributeError, OSError, OomprobeError (the binary crashed) or
anything else.

A short pass makes OOMPROBE_FUZZ_CALLS calls (default 100); set it higher for a long pass
(docs/src/testing.md)."""

import math
import os
import random
import unicodedata
from pathlib import Path

import oomprobe

CALLS = int(os.environ.get("OOMPROBE_FUZZ_CALLS", "100"))
SEED = int(os.environ.get("OOMPROBE_FUZZ_SEED", "48"))


class Weird:
    """An object that is no config, path, number or string."""

    def __repr__(self):
        return "Weird()"


class BadConfig:
    """Looks like a PretrainedConfig, but its to_dict fails."""

    def to_dict(self):
        raise ValueError("no dict for you")


VALUES = [
    None, True, False, 0, 1, -1, 4, 2**63, 2**64, 10**30, 1.5, -0.0, math.nan, math.inf,
    "", " ", "gpt2", "llama3-8b", "24GiB", "80GB", "-1GiB", "1e30 GiB", "all", "list",
    "on", "off", "a\nb", "\x1b[31mred\x1b[0m", "\r", "\0", "\ud800", "ключ", "x" * 20_000,
    b"bytes", bytearray(b"1"), [1, 2], (4,), [], {}, {"a": 1}, set(), Weird(),
    Path("/nonexistent/config.json"), Path("/dev/null"), 1j,
]

KEYS = [
    "batch", "seq", "memory", "gpu", "gpus", "tp", "pp", "dp", "microbatches", "schedule",
    "ddp", "zero", "fsdp", "dropout", "sequence_parallel", "precision", "optimizer",
    "checkpoint", "lora", "lora_targets", "quant", "alloc_conf", "non_pytorch", "layers",
    "not_a_flag", "batch_of", "snapshot", "help", "oom",
]

MODELS = [None, "gpt2", "tiny-gpt", "", "no-such-model", 7, b"gpt2", Weird(), "\x1b]0;t\x07"]

CONFIGS = [
    None, None, None, {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2},
    {"model_type": 5}, {}, 123, Weird(), BadConfig(), "/nonexistent.json", Path("/dev/zero"),
]

TEXTS = [
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a "
    "total capacity of 23.64 GiB of which 1.06 MiB is free.",
    b"\xff\xfe" + "CUDA out of memory. Tried to allocate 2.00 GiB".encode("utf-16-le"),
    "\x1b[31mCUDA out of memory\x1b[0m\r" * 50, "", b"", 123, None, ["a"], Path("log.txt"),
    memoryview(b"out of memory"), "x" * 200_000,
]


# Values that fit some flag, so that a call with a few wrong ones still reaches the binary.
GOOD = {"batch": 2, "seq": 128, "memory": "24GiB", "gpu": "rtx4090", "gpus": 2, "tp": 2,
        "pp": 2, "dp": 2, "microbatches": 4, "schedule": "gpipe", "ddp": True, "zero": 2,
        "fsdp": "full", "dropout": False, "precision": "bf16", "checkpoint": "full",
        "lora": 8, "quant": "nf4", "alloc_conf": "expandable_segments:True"}


def pick(rng, wrong, right):
    """Mostly `right` (a working call), else one of `wrong`."""
    return rng.choice(wrong) if rng.random() < 0.3 else right


def one_call(rng):
    """A random call: mostly a working one with a few flags made wrong. Its description and a
    thunk."""
    fn = rng.choice(["estimate", "diagnose", "diagnose_oom", "max_batch"])
    flags = {} if fn in ("estimate", "diagnose_oom") or rng.random() < 0.2 \
        else {"memory": "24GiB"}
    for k in rng.sample(KEYS, rng.randint(0, 3)):
        flags[k] = rng.choice(VALUES) if rng.random() < 0.6 or k not in GOOD else GOOD[k]
    model = pick(rng, MODELS, rng.choice(["tiny-gpt", "gpt2"]))
    config = pick(rng, CONFIGS, None)
    if config is not None and model is not None and rng.random() < 0.8:
        model = None
    if fn == "diagnose_oom":
        text = pick(rng, TEXTS, TEXTS[0])
        return (f"diagnose_oom({text!r:.60}, model={model!r}, config={config!r}, {flags!r:.200})",
                lambda: oomprobe.diagnose_oom(text, model=model, config=config, **flags))
    f = getattr(oomprobe, fn)
    return (f"{fn}(model={model!r}, config={config!r}, {flags!r:.200})",
            lambda: f(model=model, config=config, **flags))


def test_random_calls_return_or_raise_value_or_type_errors():
    rng = random.Random(SEED)
    outcomes = {"returned": 0, "ValueError": 0, "TypeError": 0}
    bad = []
    for _ in range(CALLS):
        what, call = one_call(rng)
        try:
            call()
            outcomes["returned"] += 1
        except (ValueError, TypeError) as e:
            outcomes["ValueError" if isinstance(e, ValueError) else "TypeError"] += 1
            # The CLI's refusal is one line, whole (issue 48: a newline cut it short), with no
            # raw control character (an escape sequence from the input would reach a terminal).
            assert not any(unicodedata.category(c) == "Cc" for c in str(e)), \
                f"{what}: a control character in the message: {e!r}"
        except Exception as e:  # noqa: BLE001 - any other type is the finding
            bad.append(f"{what}: {type(e).__name__}: {e}")
    assert not bad, "\n".join(bad[:10])
    # The generator reaches all three outcomes.
    assert all(n > 0 for n in outcomes.values()), outcomes

"""oomprobe from Python: the CLI's estimate, diagnose and max batch, as dicts, over its JSON.

No torch is needed to import it. Flags are keyword arguments with the CLI's names
(`lora=16, lora_targets="all-linear"` is `--lora 16 --lora-targets all-linear`), their types
checked before the binary runs (TypeError naming the parameter); the CLI's refusals raise
ValueError with its whole line.

    >>> import oomprobe
    >>> oomprobe.max_batch(model="llama3-8b", seq=1024, memory="24GiB", lora=16,
    ...                    lora_targets="all-linear", quant="nf4", checkpoint="full")
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Union

from ._cli import OomprobeError, binary, flag_args, run, run_json

__all__ = [
    "OomprobeError",
    "binary",
    "estimate",
    "diagnose",
    "diagnose_oom",
    "max_batch",
    "version",
]

#: A config: a path to config.json, a dict of its keys, or a transformers PretrainedConfig
#: (anything with `to_json_string` or `to_dict`).
Config = Union[str, "os.PathLike[str]", Dict[str, Any], Any]


def _config_json(config: Any) -> str:
    if isinstance(config, dict):
        return json.dumps(config)
    to_json = getattr(config, "to_json_string", None)
    if callable(to_json):
        # use_diff=False: every key, not just those that differ from the class defaults.
        return str(to_json(use_diff=False))
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return json.dumps(to_dict(), default=str)
    raise ValueError(
        f"config must be a path, a dict or a PretrainedConfig, not {type(config).__name__}"
    )


def _run(caller: str, command: list, model: Optional[str], config: Optional[Config],
         flags: Dict[str, Any], reserved: Iterable[str] = (),
         stdin: Union[str, bytes, None] = None) -> Any:
    """Every entry point's run: the workload's flags checked by `flag_args` before the binary
    runs (a dict or PretrainedConfig config written to a temporary config.json), then the
    command's JSON."""
    with contextlib.ExitStack() as stack:
        path: Any = config
        if config is not None and not isinstance(config, (str, os.PathLike)):
            text = _config_json(config)
            d = stack.enter_context(tempfile.TemporaryDirectory(prefix="oomprobe-"))
            path = Path(d) / "config.json"
            path.write_text(text)
        args = flag_args({"model": model, "config": path, **flags}, caller, reserved)
        return run_json([*command, *args], stdin=stdin)


def estimate(model: Optional[str] = None, config: Optional[Config] = None, **flags: Any) -> Dict[str, Any]:
    """`oomprobe estimate --json`: the step's plan, its peak and, with `memory=` or `gpu=`, the
    predicted boundaries."""
    return _run("estimate", ["estimate"], model, config, flags)


def diagnose(model: Optional[str] = None, config: Optional[Config] = None, **flags: Any) -> Dict[str, Any]:
    """`oomprobe diagnose --json`: why a workload runs out of memory and what each remedy buys."""
    return _run("diagnose", ["diagnose"], model, config, flags)


def diagnose_oom(
    text: Union[str, bytes], model: Optional[str] = None, config: Optional[Config] = None,
    **flags: Any
) -> Dict[str, Any]:
    """`oomprobe diagnose --oom -`: the OOM messages in `text` (a log, a traceback), each read
    and judged; with a workload, checked against it. `text` goes through stdin, however long:
    a str as UTF-8, bytes as they are (the CLI reads UTF-8, invalid bytes replaced)."""
    if not isinstance(text, (str, bytes, bytearray, memoryview)):
        hint = " (read the file first, e.g. Path(...).read_bytes())" \
            if isinstance(text, os.PathLike) else ""
        raise TypeError(f"diagnose_oom(): text= takes a str or bytes, not "
                        f"{type(text).__name__}{hint}")
    data = text if isinstance(text, str) else bytes(text)
    return _run("diagnose_oom", ["diagnose", "--oom", "-"], model, config, flags,
                reserved=("oom",), stdin=data)


def _batch_boundary(report: Any) -> Dict[str, Any]:
    bounds = report.get("boundaries") if isinstance(report, dict) else None
    for b in sorted(bounds or [], key=lambda b: b.get("scenario") != "batch"):
        if b.get("dimension") == "batch":
            return b
    raise ValueError("this workload has no batch boundary in that memory")


def max_batch(
    model: Optional[str] = None,
    config: Optional[Config] = None,
    *,
    tensors_only: bool = False,
    **flags: Any,
) -> int:
    """The largest batch that fits: what PyTorch's caching allocator gets on the card
    (`max_reserved`), or with `tensors_only=True` what the tensors alone need (`max`; right
    where no caching allocator sits between the tensors and the memory, as on a CPU).

    Needs `memory=` (e.g. "24GiB", with `non_pytorch=` for what lives outside PyTorch) or
    `gpu=` (one card from the table; `estimate(gpu="all")["cards"]` has the max on each).
    Raises ValueError when not even batch 1 fits.
    """
    if flags.get("memory") is None and flags.get("gpu") is None:
        raise ValueError("max_batch needs memory= (e.g. '24GiB') or gpu= (e.g. 'rtx4090')")
    gpu = flags.get("gpu")
    if gpu in ("list", "all"):
        raise ValueError(
            f"max_batch(): gpu={gpu!r} is no card: max_batch takes one card "
            "(e.g. 'rtx4090'); estimate(gpu='list') lists them, "
            "estimate(gpu='all')['cards'] has the boundaries on each"
        )
    b = _batch_boundary(_run("max_batch", ["estimate"], model, config, flags))
    value = b.get("max" if tensors_only else "max_reserved")
    if value is None:
        raise ValueError("not even batch 1 fits in that memory" + _way_out(model, config, flags))
    return int(value)


def _way_out(model: Optional[str], config: Optional[Config], flags: Dict[str, Any]) -> str:
    """The fastest way out `diagnose` finds for a step that does not fit, as the end of an
    error message (empty when it finds none or cannot say)."""
    try:
        ways = diagnose(model, config, **flags).get("ways") or {}
    except (ValueError, TypeError, RuntimeError, OSError):
        return ""
    best = (ways.get("ways") or [None])[0]
    if not best:
        return ""
    return (f"; the fastest way out oomprobe finds: {' '.join(best['changes'])} "
            f"({best['gpus']} GPU(s), micro-batch {best['micro_batch']}; "
            f"oomprobe.diagnose(...)['ways'] lists them all)")


def version() -> str:
    """The binary's version, e.g. '0.1.0'."""
    out = run(["--version"]).stdout.strip()
    return out.split()[-1] if out else out

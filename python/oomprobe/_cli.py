"""Finding the `oomprobe` binary and running it: its JSON on stdout, its one-line errors as ValueError."""

from __future__ import annotations

import json
import numbers
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, Union

__all__ = ["OomprobeError", "binary", "run", "run_json", "flag_args"]

_EXE = "oomprobe.exe" if os.name == "nt" else "oomprobe"


class OomprobeError(RuntimeError):
    """The binary failed for a reason other than bad input (exit code other than 0 and 2)."""

    def __init__(self, returncode: int, stderr: str) -> None:
        self.returncode = returncode
        self.stderr = stderr
        first = stderr.strip().splitlines()[0] if stderr.strip() else "(no message)"
        super().__init__(f"oomprobe exited {returncode}: {first}")


def binary() -> str:
    """The binary this package runs: $OOMPROBE when set, else the one the wheel installed beside
    this Python (its scripts directory), else the first `oomprobe` on PATH."""
    env = os.environ.get("OOMPROBE")
    if env:
        return env
    scripts = sysconfig.get_path("scripts")
    for d in [scripts, str(Path(sys.executable).parent)]:
        if d:
            p = Path(d) / _EXE
            if p.is_file() and os.access(p, os.X_OK):
                return str(p)
    found = shutil.which("oomprobe")
    if found:
        return found
    raise FileNotFoundError(
        "no oomprobe binary: install the wheel (pip install oomprobe), put oomprobe on PATH, "
        "or set OOMPROBE to its path"
    )


# Keyword arguments that are no flag of the API: the CLI's meta flags, and --json, which the API
# adds itself.
_META = frozenset({"help", "version", "json"})
# The flags that read on | off: True is "on", False is "off".
ON_OFF = frozenset({"dropout", "kv_cache", "optimizer_in_backward", "double_quant", "kbit_prep",
                    "quant_head", "attention_mask", "reshard_after_forward", "offload",
                    "bucket_view", "sequence_parallel"})
# The flags whose value may be left out (`--ddp` is DDP's default buckets): True is the bare
# flag, False leaves it out.
BARE = frozenset({"ddp"})
# The flags that take no value at all (`--lenient`): True is the flag, False leaves it out.
SWITCHES = frozenset({"lenient"})
# The flags the CLI takes once per value (`--snapshot a --snapshot b`): a list is the flag
# repeated, not its values joined with commas (a file name may hold a comma).
REPEATED = frozenset({"snapshot"})
# A value longer than this is no name, size, count or path the CLI takes (PATH_MAX is 4096);
# with it every command line stays well under the kernel's limit (E2BIG).
MAX_VALUE_BYTES = 16 * 1024


def _value(caller: str, key: str, value: Any) -> str:
    """One value as the CLI's text: a str, a number or a path; TypeError for anything else
    (a bool included: it is no size or count), ValueError for what no command line can carry."""
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Real, os.PathLike)):
        raise TypeError(f"{caller}(): {key}= takes a str, a number or a path, not "
                        f"{type(value).__name__} ({value!r:.60})")
    text = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    if not isinstance(text, str):
        raise TypeError(f"{caller}(): {key}= takes a str path, not a bytes one")
    if "\0" in text:
        raise ValueError(f"{caller}(): {key}= holds a NUL character")
    try:
        size = len(os.fsencode(text))  # as subprocess encodes an argument
    except UnicodeEncodeError as e:
        raise ValueError(f"{caller}(): {key}= cannot be a command-line argument ({e.reason})") \
            from None
    if size > MAX_VALUE_BYTES:
        raise ValueError(f"{caller}(): {key}= is {size} bytes long; no value the CLI takes is "
                         f"over {MAX_VALUE_BYTES} (a long text goes to diagnose_oom(), a "
                         "config to config=)")
    return text


def flag_args(flags: Mapping[str, Any], caller: str = "oomprobe",
              reserved: Iterable[str] = ()) -> list[str]:
    """Keyword arguments as the CLI's flags, their types checked before the binary runs:
    `lora_targets="all-linear"` is `--lora-targets all-linear`; a str, number or path is the
    value, a list or tuple of them joined with commas (`snapshot=[a, b]`: the flag once per file); None leaves the flag out; True/False is
    "on"/"off" for an on|off flag and the bare flag / nothing for `ddp` and `lenient`, and a TypeError
    elsewhere. The meta flags (help, version, json) and `reserved` ones raise TypeError."""
    out: list[str] = []
    taken = _META | frozenset(reserved)
    for key, value in flags.items():
        if key in taken:
            raise TypeError(f"{caller}() got an unexpected keyword argument {key!r} "
                            "(the API sets it, or it is the CLI's own)")
        if value is None:
            continue
        name = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if key in ON_OFF:
                out += [name, "on" if value else "off"]
            elif key in BARE or key in SWITCHES:
                out += [name] if value else []
            else:
                raise TypeError(f"{caller}(): {key}= takes a value, not {value} (True/False "
                                f"only for the on|off flags and ddp)")
            continue
        if isinstance(value, (list, tuple)) and key in REPEATED:
            for v in value:
                out += [name, _value(caller, key, v)]
        elif isinstance(value, (list, tuple)):
            out += [name, ",".join(_value(caller, key, v) for v in value)]
        else:
            out += [name, _value(caller, key, value)]
    return out


def _refusal(stderr: str) -> str:
    """The CLI's refusal: its last stderr line (warnings come before it)."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "oomprobe: bad input"


def run(args: Sequence[str], stdin: Union[str, bytes, None] = None) -> subprocess.CompletedProcess[str]:
    """Runs `oomprobe ARGS`, `stdin` (text as UTF-8, or bytes as they are) on its standard
    input. Exit 2 (bad input) raises ValueError with the CLI's whole refusal line; any other
    failure raises OomprobeError."""
    data = stdin.encode("utf-8", "surrogatepass") if isinstance(stdin, str) else stdin
    proc = subprocess.run(
        [binary(), *args],
        input=data,
        stdin=None if data is not None else subprocess.DEVNULL,
        capture_output=True,
    )
    done = subprocess.CompletedProcess(
        proc.args, proc.returncode,
        proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace"))
    if done.returncode == 2:
        raise ValueError(_refusal(done.stderr))
    if done.returncode != 0:
        raise OomprobeError(done.returncode, done.stderr)
    return done


def run_json(args: Sequence[str], stdin: Union[str, bytes, None] = None) -> Any:
    """`run` with `--json`, its stdout decoded."""
    proc = run([*args, "--json"], stdin=stdin)
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        raise OomprobeError(0, f"output is not JSON ({e}): {proc.stdout[:200]!r}") from e

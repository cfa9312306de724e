"""Finding the `oomprobe` binary and running it: its JSON on stdout, its one-line errors as ValueError."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

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


def flag_args(flags: Mapping[str, Any]) -> list[str]:
    """Keyword arguments as the CLI's flags: `lora_targets="all-linear"` is
    `--lora-targets all-linear`, `True` a bare flag, `False`/`None` left out, a list or tuple
    joined with commas."""
    out: list[str] = []
    for key, value in flags.items():
        if value is None or value is False:
            continue
        name = "--" + key.replace("_", "-")
        if value is True:
            out.append(name)
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        out += [name, str(value)]
    return out


def run(args: Sequence[str], stdin: Optional[str] = None) -> subprocess.CompletedProcess[str]:
    """Runs `oomprobe ARGS`. Exit 2 (bad input) raises ValueError with the CLI's first stderr
    line; any other failure raises OomprobeError."""
    proc = subprocess.run(
        [binary(), *args],
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
    )
    if proc.returncode == 2:
        lines = proc.stderr.strip().splitlines()
        raise ValueError(lines[0] if lines else "oomprobe: bad input")
    if proc.returncode != 0:
        raise OomprobeError(proc.returncode, proc.stderr)
    return proc


def run_json(args: Sequence[str], stdin: Optional[str] = None) -> Any:
    """`run` with `--json`, its stdout decoded."""
    proc = run([*args, "--json"], stdin=stdin)
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        raise OomprobeError(0, f"output is not JSON ({e}): {proc.stdout[:200]!r}") from e

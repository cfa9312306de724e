"""Checking a predicted max batch with real steps: one at the prediction, one above it, and a
walk by one (then by doubling strides and bisection) until a fitting batch sits next to a failing one.

The framework hooks (`oomprobe.lightning`, `oomprobe.transformers`) hand this a `step(batch)`
that runs one real training step and raises the framework's OOM; `bracket` counts the steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

__all__ = ["Bracket", "bracket", "is_oom"]

# The messages PyTorch raises when an allocation fails, on CUDA, on the CPU and elsewhere
# (the ones Lightning's and Accelerate's finders look for, plus the CPU allocator's).
_OOM_MESSAGES = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",
    "MPS backend out of memory",
    "XPU out of memory",
)


def is_oom(exc: BaseException) -> bool:
    """Whether `exc` is an out-of-memory failure: torch's OutOfMemoryError (by name, so no torch
    import), MemoryError, or a RuntimeError carrying one of PyTorch's OOM messages."""
    if type(exc).__name__ == "OutOfMemoryError" or isinstance(exc, MemoryError):
        return True
    if isinstance(exc, RuntimeError) and exc.args:
        text = str(exc.args[0])
        return any(m in text for m in _OOM_MESSAGES)
    return False


@dataclass
class Bracket:
    """The verified edge: `batch` fit and `first_fail` (batch + 1) did not, unless the search
    met `limit` (then first_fail is None) or nothing fit (batch 0)."""

    batch: int
    first_fail: Optional[int]
    predicted: int
    #: Every real step, in order: (batch, fitted).
    steps: List[Tuple[int, bool]] = field(default_factory=list)

    @property
    def real_steps(self) -> int:
        return len(self.steps)


def _stride(walked: int) -> int:
    """The n-th step away from the prediction: by one twice, then doubling (1, 1, 2, 4, ...)."""
    return 1 if walked < 2 else 2 ** (walked - 1)


def bracket(
    predicted: int,
    step: Callable[[int], None],
    *,
    limit: Optional[int] = None,
    max_steps: int = 32,
    oom: Callable[[BaseException], bool] = is_oom,
) -> Bracket:
    """Finds the edge next to `predicted` with real steps. `step(b)` runs one training step at
    batch b and raises on OOM (an exception `oom` accepts); any other exception propagates.

    A right prediction costs 2 steps (b fits, b + 1 fails); one off by one costs 3 (too low) or
    2 (too high). Further off, after two steps by one the stride doubles away from the
    prediction and bisection closes the gap: a prediction off by d costs about 2·log2(d) + 3.
    """
    if predicted < 1:
        raise ValueError(f"predicted must be at least 1, not {predicted}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")
    result = Bracket(batch=0, first_fail=None, predicted=predicted)
    known: dict = {}

    def fits(b: int) -> bool:
        if b in known:
            return known[b]
        if len(result.steps) >= max_steps:
            raise RuntimeError(f"no edge found within {max_steps} real steps")
        try:
            step(b)
            ok = True
        except BaseException as e:  # noqa: BLE001 - only OOM is an outcome; the rest re-raised
            if not oom(e):
                raise
            ok = False
        known[b] = ok
        result.steps.append((b, ok))
        return ok

    start = min(predicted, limit) if limit is not None else predicted
    if fits(start):
        lo, hi = start, None
        walked = 0
        while hi is None:
            nxt = lo + _stride(walked)
            walked += 1
            if limit is not None and nxt > limit:
                nxt = limit
                if nxt == lo:  # lo is the limit: nothing above to try
                    result.batch = lo
                    return result
            if fits(nxt):
                lo = nxt
            else:
                hi = nxt
    else:
        hi, lo = start, None
        walked = 0
        while lo is None:
            nxt = hi - _stride(walked)
            walked += 1
            if nxt < 1:
                nxt = 1
            if fits(nxt):
                lo = nxt
            elif nxt == 1:
                result.first_fail = 1
                return result
            else:
                hi = nxt
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    result.batch, result.first_fail = lo, hi
    return result

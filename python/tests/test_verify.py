"""The bracket against a stub trainer whose steps raise OOM above a set batch."""

import math

import pytest

from oomprobe.verify import bracket, is_oom


class Stub:
    """One 'training step' per call: fits at batch <= edge, raises PyTorch's CPU OOM above."""

    def __init__(self, edge, exc=None):
        self.edge = edge
        self.calls = []
        self.exc = exc or (lambda b: RuntimeError(
            f"[enforce fail at alloc_cpu.cpp:119] data. DefaultCPUAllocator: can't allocate "
            f"memory: you tried to allocate {b * 2**20} bytes. Error code 12 (Cannot allocate memory)"))

    def __call__(self, b):
        self.calls.append(b)
        if b > self.edge:
            raise self.exc(b)


@pytest.mark.parametrize("edge", [1, 2, 7, 64, 409, 1000])
@pytest.mark.parametrize("off", [-37, -5, -1, 0, 1, 5, 37])
def test_finds_the_edge_from_any_prediction(edge, off):
    predicted = max(1, edge + off)
    stub = Stub(edge)
    r = bracket(predicted, stub)
    assert (r.batch, r.first_fail) == (edge, edge + 1)
    assert r.steps == [(b, b <= edge) for b in stub.calls]
    assert len(set(stub.calls)) == len(stub.calls), "a batch was run twice"


def test_a_right_prediction_costs_two_steps():
    stub = Stub(409)
    r = bracket(409, stub)
    assert r.real_steps == 2 and stub.calls == [409, 410]


@pytest.mark.parametrize("predicted,calls", [(408, [408, 409, 410]), (410, [410, 409])])
def test_off_by_one_costs_three_steps_or_fewer(predicted, calls):
    stub = Stub(409)
    r = bracket(predicted, stub)
    assert stub.calls == calls and r.batch == 409


def test_far_off_is_logarithmic():
    stub = Stub(1000)
    r = bracket(10, stub)
    assert r.batch == 1000 and r.real_steps <= 2 * math.ceil(math.log2(990)) + 3


def test_nothing_fits():
    r = bracket(8, Stub(0))
    assert (r.batch, r.first_fail) == (0, 1)


def test_limit_caps_the_search():
    stub = Stub(10_000)
    r = bracket(40, stub, limit=64)
    assert (r.batch, r.first_fail) == (64, None)
    assert max(stub.calls) == 64


def test_other_exceptions_propagate():
    def step(b):
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape mismatch"):
        bracket(4, step)


def test_max_steps_bounds_a_runaway():
    with pytest.raises(RuntimeError, match="within 3 real steps"):
        bracket(1, Stub(10**9), max_steps=3)


def test_bad_prediction_is_refused():
    with pytest.raises(ValueError):
        bracket(0, Stub(3))


def test_is_oom():
    class OutOfMemoryError(RuntimeError):
        pass

    assert is_oom(OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8"))
    assert is_oom(MemoryError())
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_oom(ValueError("CUDA out of memory"))

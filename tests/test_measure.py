"""Tests for fxmem.measure: the peak-memory rule every fxmem claim relies on."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from fxmem.measure import Measurement, _running_totals, live_tensor_bytes, measure

MiB = 1024 * 1024
TOL = 64 * 1024  # allocator alignment / small bookkeeping tensors


def _bytes(n: int, device: str = "cpu") -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, device=device)


def _pattern(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    a = _bytes(64 * MiB, device)
    b = _bytes(32 * MiB, device)
    del a
    c = _bytes(16 * MiB, device)
    return b, c


def test_allocation_pattern_peak() -> None:
    m = measure(_pattern)
    assert isinstance(m, Measurement)
    assert m.device == torch.device("cpu")
    rise = m.peak_bytes - m.entry_bytes
    assert rise >= 96 * MiB
    assert rise - 96 * MiB <= TOL


def test_entry_bytes_counts_tensors_kept_alive() -> None:
    before = measure(lambda: None).entry_bytes
    held = _bytes(40 * MiB)
    after = measure(lambda: None).entry_bytes
    assert abs((after - before) - 40 * MiB) <= TOL
    del held
    assert abs(measure(lambda: None).entry_bytes - before) <= TOL


def test_live_tensor_bytes_dedupes_views_and_skips_fake() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    base = live_tensor_bytes("cpu")
    x = _bytes(8 * MiB)
    views = [x[:MiB], x.view(2, -1), x[::2]]
    with FakeTensorMode():
        fake = torch.empty(32 * MiB, dtype=torch.uint8)
    assert abs(live_tensor_bytes("cpu") - base - 8 * MiB) <= TOL
    del x, views, fake


def test_linear_training_step() -> None:
    model = nn.Linear(512, 512)
    x = torch.randn(128, 512)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    input_bytes = x.numel() * x.element_size()
    marker = object()

    def step(inp: torch.Tensor) -> tuple[object, torch.Tensor]:
        loss = model(inp).square().mean()
        loss.backward()
        return marker, loss.detach()

    m = measure(step, x)
    assert m.result[0] is marker
    assert m.result[1].ndim == 0
    assert m.seconds > 0
    assert m.entry_bytes >= param_bytes + input_bytes
    assert m.peak_bytes >= param_bytes + input_bytes
    # the activation (128x512 fp32) and the new gradients are allocated during the step
    assert m.peak_bytes - m.entry_bytes >= param_bytes + input_bytes
    # gradients created in C++ by backward are counted at the next entry
    m2 = measure(model, x)
    assert m2.entry_bytes - m.entry_bytes >= param_bytes - TOL


def _clear_then_allocate(lst: list[torch.Tensor]) -> torch.Tensor:
    lst.clear()
    return _bytes(16 * MiB)


def test_freeing_entry_tensor_is_not_double_counted() -> None:
    # allocated while memory profiling is on, so torch reports its free later
    holder = measure(lambda: [_bytes(64 * MiB)]).result
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = measure(_clear_then_allocate, holder)
    assert m.entry_bytes >= 64 * MiB
    assert m.peak_bytes == m.entry_bytes


def test_unreported_free_of_entry_tensor_warns_and_is_an_upper_bound() -> None:
    # memory torch's allocator did not make: torch never reports its free
    holder = [torch.frombuffer(bytearray(64 * MiB), dtype=torch.uint8)]
    with pytest.warns(UserWarning, match=r"64\.0 MiB of tensors alive at entry"):
        m = measure(_clear_then_allocate, holder)
    assert m.entry_bytes >= 64 * MiB
    assert m.peak_bytes == m.entry_bytes + 16 * MiB


def test_entry_tensor_allocated_unprofiled_is_exact_or_warned() -> None:
    # torch reports this free only if it kept a record for the address from an earlier
    # block there (allocated under a profiler, freed outside one); make such a record likely
    measure(lambda: [_bytes(64 * MiB)])  # its result is dropped at once, unprofiled
    holder = [_bytes(64 * MiB)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = measure(_clear_then_allocate, holder)
    warned = [w for w in caught if "alive at entry" in str(w.message)]
    assert m.peak_bytes == m.entry_bytes + (16 * MiB if warned else 0)


def test_a_free_of_an_entry_block_counts_the_bytes_the_entry_scan_saw() -> None:
    # the size on a free event is the allocator's record for the address, which can be an
    # earlier block's
    entry = {0x1000: 64 * MiB}
    events = [(1, 0x1000, -100 * MiB), (2, 0x9000, 16 * MiB), (3, 0x1000, -64 * MiB)]
    freed: set[int] = set()
    totals = [running for running, _ in _running_totals(events, entry, freed)]
    assert totals == [-64 * MiB, -48 * MiB, -48 * MiB]  # the second free is not counted again
    assert freed == {0x1000}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_allocations_are_seen(backend: str) -> None:
    torch._dynamo.reset()

    @torch.compile(backend=backend)
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sin() + 1

    x = torch.randn(4 * MiB)  # 16 MiB
    f(x)  # compile outside the measurement
    m = measure(f, x)
    out = m.result
    assert m.peak_bytes - m.entry_bytes >= out.numel() * out.element_size()


def test_nested_profiler_is_refused() -> None:
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with (
        torch.profiler.profile(activities=cpu),
        pytest.raises(RuntimeError, match="profiler"),
    ):
        measure(lambda: None)


def test_str_and_kwargs_go_to_fn() -> None:
    m = measure(lambda *, n: _bytes(n), n=MiB)
    assert m.result.numel() == MiB
    text = str(m)
    assert text.startswith("peak ") and "MiB (entry " in text and text.endswith(" s on cpu")
    assert "result" not in repr(m)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_matches_max_memory_allocated() -> None:
    anchor = torch.ones(1, device="cuda")  # makes measure pick the CUDA device

    def f(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _pattern(str(t.device))

    m = measure(f, anchor)
    assert m.device.type == "cuda"
    assert m.peak_bytes == torch.cuda.max_memory_allocated(m.device)
    assert m.entry_bytes >= anchor.untyped_storage().nbytes()
    assert m.peak_bytes - m.entry_bytes == 96 * MiB
    model = nn.Linear(8, 8).cuda()
    assert measure(model, anchor.expand(2, 8)).device.type == "cuda"

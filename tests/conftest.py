"""Helpers shared by fxmem's tests: one training step, gradient comparison, a clean slate."""

from __future__ import annotations

import gc
import os
import sys
import warnings

import pytest
import torch

import fxmem
from fxmem import partition
from fxmem.cost import measure_rates
from fxmem.measure import _storage as storage_counted
from fxmem.testing import GPT, GPTConfig, gpt_batch

# The repository root: tests build the benchmarks' models (`benchmarks.*`) rather than copies.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Small enough for a 2-core CPU, with attention activations large enough that remat matters.
SMALL_GPT = GPTConfig(vocab_size=512, block_size=256, n_layer=4, n_head=4, n_embd=64)
GPT_BATCH = (4, 256)

# Under pytest-xdist the workers share the cores: each takes its share of torch's threads.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))

# Most of the suite's time is g++ compiling inductor's C++ kernels, and scalar kernels compile in
# half the time of vectorized ones. The tests check memory and gradients, which do not depend
# on it: inductor chooses the same buffers, fusions and kernels either way (the vector width
# changes only the code inside a loop; test_simulate.py checks it). FXMEM_TEST_VECTORIZED=1
# runs them vectorized, as a user's step runs; the tests that run a script in a process of its
# own run it vectorized.
if os.environ.get("FXMEM_TEST_VECTORIZED") != "1":
    torch._inductor.config.cpp.simdlen = 1


def _collect_and_freeze() -> None:
    """Collect, then move what survives out of the collector's reach (`gc.freeze`) when no
    tensor with memory is among it.

    Each test's clean slate, each `measure` and each plan runs `gc.collect()` and scans
    `gc.get_objects()`. Over the modules, caches and code that imports and compilations leave
    in a worker (over half a million objects once it has compiled a model) that took 0.3-0.7 s
    a call; frozen, they are skipped. No tensor with memory is ever frozen: `measure` finds
    the tensors alive at its entry through `gc.get_objects()`, which does not list frozen
    objects. (A cycle of frozen objects is not collected: these live as long as the worker
    does.)"""
    gc.collect()
    with warnings.catch_warnings():  # isinstance can poke deprecated lazy objects
        warnings.simplefilter("ignore")
        if any(_holds_memory(o) for o in gc.get_objects() if isinstance(o, torch.Tensor)):
            return
    gc.freeze()


def _holds_memory(t: torch.Tensor) -> bool:
    """Whether `measure` would count t's storage (fake and meta tensors, which compiling keeps
    in its shape environments past `torch._dynamo.reset()`, it does not)."""
    try:
        device = t.device
    except Exception:  # noqa: BLE001 - tensor subclasses that refuse: counted as holding memory
        return True
    return storage_counted(t, device) is not None


@pytest.fixture(autouse=True, scope="session")
def _survivors_frozen():
    _collect_and_freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True, scope="session")
def _rates_timed():
    """The CPU's cost rates timed in full (or read) before any test plans: a test's first plan
    at a tight budget would otherwise time them on smaller tensors, for that plan alone, and
    plans would depend on which test a worker ran first."""
    measure_rates("cpu")


@pytest.fixture
def one_thread():
    """torch on one thread through the test, whatever the machine and the number of workers:
    a CPU attention's workspace holds a block of scores per thread, so a floor set beside an
    attention moves with the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # the last test's teardown has collected what it left
    yield
    torch._dynamo.reset()
    _collect_and_freeze()


def step(model, *args, **kwargs):
    """Forward and backward; returns the loss (detached)."""
    out = model(*args, **kwargs)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward()
    return loss.detach()


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def floor_plan(model, batch, **options) -> tuple[int, fxmem.Plan]:
    """fxmem's floor for this step and its plan there, from the BudgetError of an impossible
    budget: planned, nothing compiled. `batch` is the example inputs (a tuple, or a dict of
    keyword arguments). The error itself is dropped: its traceback holds the planning frames'
    tensors, which would count as live at the next planning."""
    try:
        fxmem.optimize(model, 1e-6, example_inputs=batch, **options)
    except fxmem.BudgetError as err:
        found = err.floor_bytes, err.plan
    else:
        raise AssertionError("a 1 KiB budget was accepted")
    gc.collect()
    return found


def zero_grads(model) -> None:
    for p in model.parameters():
        p.grad = None


def max_rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], zero: float = 1e-12) -> float:
    """The worst error of a gradient in `a` relative to its reference in `b`. `zero`: a reference
    whose norm is below it stands for a gradient that is 0 in exact arithmetic (a key
    projection's bias: softmax is the same for every shift of a query's scores); its rounding
    noise is compared to `zero`, not to itself."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    errs = [((a[k] - b[k]).norm() / b[k].norm().clamp_min(zero)).item() for k in a]
    return max(errs)


def small_gpt(seed: int = 0, cfg: GPTConfig = SMALL_GPT):
    torch.manual_seed(seed)
    return GPT(cfg), gpt_batch(cfg, *GPT_BATCH)


def spy_on_partition(monkeypatch, name: str = "emit_graphs") -> list:
    """The first two arguments of each call to `partition.<name>` (the joint graph, and the
    choice or trajectory); the calls go on as before."""
    seen = []
    original = getattr(partition, name)

    def spy(jg, second, *rest):
        seen.append((jg, second))
        return original(jg, second, *rest)

    monkeypatch.setattr(partition, name, spy)
    return seen


def dropout_blocks_runs(monkeypatch, device: str = "cpu"):
    """Two identical Linear-ReLU-Dropout blocks under fxmem (inductor), one step each with the
    same seed: with inductor's seeds read from buffers, then read by index as inductor writes
    them. Returns, per run, the output, the gradients and inductor's generated code."""
    import copy

    from torch._inductor.utils import run_and_get_code

    from fxmem import partition

    torch.manual_seed(0)
    block = [torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5)]
    model = torch.nn.Sequential(*block, *copy.deepcopy(block), torch.nn.Linear(32, 32)).to(device)
    x = torch.randn(16, 32, device=device)

    def run():
        torch._dynamo.reset()
        zero_grads(model)
        m = fxmem.optimize(model, budget_gb=1.0)
        torch.manual_seed(1)

        def stepped():
            out = m(x)
            out.sum().backward()
            return out.detach()

        out, codes = run_and_get_code(stepped)
        return out, list(grads_of(model).values()), "\n".join(codes)

    runs = [run()]
    monkeypatch.setattr(partition, "seeds_from_buffers", lambda gm: 0)
    runs.append(run())
    return runs


def assert_same_step(a, b) -> None:
    """Two runs of `dropout_blocks_runs` drew the same numbers: equal outputs and gradients."""
    assert torch.equal(a[0], b[0])
    assert len(a[1]) == len(b[1]) and all(torch.equal(g, r) for g, r in zip(a[1], b[1], strict=True))

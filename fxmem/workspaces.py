"""CUDA memory no tensor holds, which every measured peak counts: cuBLAS's workspaces.

cuBLAS keeps a workspace per handle and stream that ran a matmul, and cuBLASLt (a linear with
bias) one more: for the thread that runs the forward, and for autograd's thread for the device,
which runs the backward (32 + 1 MiB each on Hopper). They are allocated through the caching
allocator on first use and never freed, so `torch.cuda.max_memory_allocated` counts them while
a scan of live tensors does not. The backend makes them exist (`create_workspaces`) before it
counts what is alive as a step starts, and counts them (`allocated_outside_tensors`) beside
the tensors.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from fxmem import _torch_private as tp
from fxmem.plan import format_bytes

__all__ = ["OUTSIDE_TENSORS", "allocated_outside_tensors", "create_workspaces", "run_small_matmuls"]

log = logging.getLogger("fxmem")

OUTSIDE_TENSORS = "CUDA allocations outside tensors"  # the plan's category for them
# More than cuBLAS's workspaces of two threads (2 x 33 MiB on Hopper) and rounding: worth a word.
_OUTSIDE_NOTABLE = 128 * 2**20


def create_workspaces(device: torch.device) -> None:
    """Run the matmuls that make cuBLAS's workspaces for `device` exist; a failure is logged
    (what already exists is still counted)."""
    try:
        run_small_matmuls(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - counting goes on without them
        log.warning("fxmem: could not run a matmul on %s before counting its workspaces: %s", device, e)


def allocated_outside_tensors(device: torch.device, live_bytes: int) -> int:
    """CUDA: bytes the caching allocator has handed out beyond `live_bytes`, the bytes of every
    live tensor's storage on `device` (0 elsewhere). Tensors only C++ holds (an autograd graph
    still alive) are counted with the workspaces; a warning names the total when it is large."""
    if device.type != "cuda":
        return 0
    outside = max(0, torch.cuda.memory_allocated(device) - live_bytes)
    if outside > _OUTSIDE_NOTABLE:
        log.warning(
            "fxmem: %s allocated on %s outside live tensors (cuBLAS workspaces; tensors only C++ holds, "
            "such as a live autograd graph): counted in the budget",
            format_bytes(outside),
            device,
        )
    return outside


class _MatmulsInBackward(torch.autograd.Function):
    """The identity, whose backward runs the matmuls on autograd's thread for the device. It
    saves nothing, so saved-tensor hooks the caller has set (offloading, checkpointing) see
    nothing of it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _matmuls(grad)
        return grad


def _matmuls(x: torch.Tensor) -> None:
    with torch.no_grad():
        torch.nn.functional.linear(x, x, x[0])  # with a bias: cuBLASLt
        torch.mm(x, x)  # cuBLAS


def run_small_matmuls(device: torch.device) -> bool:
    """A matmul and a linear with bias on real tensors of `device`, on this thread and, through
    a backward, on autograd's thread for the device; nothing they make outlives the call. Also
    inside a Dynamo compile or a fake-tensor mode. The backward is left out where it cannot
    run plainly (inference mode, compiled autograd, a CUDA graph being captured): returns
    whether it ran."""
    with tp.real_tensors():
        x = torch.ones(16, 16, device=device)
        _matmuls(x)
        if not tp.is_real_tensor(x):
            raise RuntimeError(f"the matmuls ran on {type(x).__name__}, not on real tensors")
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if torch.is_inference_mode_enabled() or tp.compiled_autograd_enabled() or capturing:
            return False
        with torch.enable_grad():
            y = _MatmulsInBackward.apply(x.requires_grad_())
        torch.autograd.backward(y, torch.ones_like(y))
        return True

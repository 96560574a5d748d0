"""Helpers for the rule-pass tests: capture Dynamo's torch-level graph, run it, compare with eager.

`capture` hands back what fxmem's backend receives — the graph Dynamo records and its example
inputs (parameters included, as the real tensors) — so a test can run a pass on it directly,
then call the rewritten graph on the same inputs and compare with the eager module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxmem import _torch_private as tp
from fxmem.outputs import with_output_hooks

__all__ = ["calls", "capture", "compare_with_eager", "compile_with_pass", "grad_err", "run_graph"]


def capture(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[fx.GraphModule, list[Any]]:
    """Dynamo's graph of `fn(*args, **kwargs)` (one graph: fullgraph=True) and its example inputs,
    traced as fxmem traces (calls to loggers skipped)."""
    graphs = []

    def be(gm, ex):
        graphs.append((gm, ex))
        return gm.forward

    with tp.logging_calls_skipped():
        torch.compile(fn, backend=be, fullgraph=True, dynamic=False)(*args, **kwargs)
    assert len(graphs) == 1, f"{len(graphs)} graphs captured"
    return graphs[0]


def compile_with_pass(pass_fn: Callable, fn: Callable[..., Any]) -> tuple[Callable[..., Any], list]:
    """`fn` compiled (one graph) with `pass_fn` run on Dynamo's graph and nothing else; returns
    the compiled function (it returns what `fn` returns: a ModelOutput stays one) and a list
    that receives (graph after the pass, times fired) when it compiles."""
    seen = []

    def be(gm, ex):
        gm, fired = pass_fn(gm, ex)
        gm.graph.lint()
        seen.append((gm, fired))
        return with_output_hooks(gm.forward, gm)  # as the backend hands the step to Dynamo

    compiled = torch.compile(fn, backend=be, fullgraph=True, dynamic=False)

    def run(*args: Any, **kwargs: Any) -> Any:
        with tp.logging_calls_skipped():  # as fxmem traces
            return compiled(*args, **kwargs)

    return run, seen


def run_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
    """Call a captured graph the way Dynamo's compiled code does (outputs come back as a tuple)."""
    out = gm(*example_inputs)
    return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out


def calls(gm: fx.GraphModule, target: Any) -> list[fx.Node]:
    """The nodes calling `target` (a function, or a Tensor method by name)."""
    if isinstance(target, str):
        return [n for n in gm.graph.nodes if n.op == "call_method" and n.target == target]
    targets = {target}
    if target is F.scaled_dot_product_attention:
        targets.add(torch._C._nn.scaled_dot_product_attention)
    if target is F.linear:
        targets.add(torch._C._nn.linear)
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def assert_dropped_attention_weights(
    y: torch.Tensor, q: torch.Tensor, k: torch.Tensor, p: float, band: float, scale: float, cap: float = 0.0
) -> None:
    """With v = I an attention output *is* its dropped-out weights: every entry is 0 or the
    softmax weight / (1 - p), and the fraction of zeros is within `band` of p. `cap`: scores
    capped as tanh(s / cap) * cap."""
    scores = q @ k.transpose(-2, -1) * scale
    weights = F.softmax(torch.tanh(scores / cap) * cap if cap else scores, dim=-1)
    kept = y != 0
    assert torch.allclose(y[kept] * (1 - p), weights[kept], rtol=1e-5, atol=1e-7)
    dropped = (~kept).float().mean().item()
    assert abs(dropped - p) < band, dropped


def grad_err(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Worst relative error over gradients, each measured against at least 1e-6 of the largest.

    Some gradients are zero in exact arithmetic and rounding noise in practice — a key bias's,
    since softmax ignores a shift shared by a row of scores — so their plain relative error
    compares noise with noise. Every other gradient is held to plain relative error.
    """
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
    floor = 1e-6 * max(g.norm().item() for g in ref.values())
    return max(((got[k] - ref[k]).norm() / max(ref[k].norm().item(), floor)).item() for k in ref)


def _loss_of(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out if out.ndim == 0 else out.float().square().mean()
    if isinstance(out, (tuple, list)):
        return sum(_loss_of(o) for o in out if isinstance(o, torch.Tensor) and o.is_floating_point())
    return out.loss


def compare_with_eager(
    eager_fn: Callable[[], Any], graph_fn: Callable[[], Any], leaves: list[torch.Tensor], loss=_loss_of
) -> tuple[float, float]:
    """Forward and backward of both; returns (relative error of the loss, worst over leaves' grads)."""

    def run(fn):
        for t in leaves:
            t.grad = None
        out = fn()
        value = loss(out)
        value.backward()
        grads = [t.grad.detach().clone() for t in leaves]
        return value.detach(), grads

    ref_loss, ref_grads = run(eager_fn)
    got_loss, got_grads = run(graph_fn)
    assert all(g is not None for g in ref_grads)
    loss_err = ((got_loss - ref_loss).abs() / ref_loss.abs().clamp_min(1e-12)).item()
    worst = grad_err(dict(enumerate(got_grads)), dict(enumerate(ref_grads)))
    return loss_err, worst

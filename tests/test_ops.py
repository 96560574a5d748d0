"""fxmem.ops.written_in_place against what eager changes: each graph's call that writes an
input in place names it, and a call that writes nothing names nothing."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from _graphs import capture

from fxmem.ops import written_in_place


@torch.library.custom_op("fxmem_test::bump", mutates_args={"x"})
def _bump(x: torch.Tensor, y: torch.Tensor) -> None:
    x.add_(y)


@_bump.register_fake
def _(x, y):
    return None


def _update_scale(x, w, stats):
    torch.ops.aten._amp_update_scale_(stats[0, :1], torch.zeros(1, dtype=torch.int32), torch.zeros(1), 2.0, 0.5, 1)
    return x + 1


CASES = {
    # call, the arguments (of x, w, stats) eager changes
    "sort": (lambda x, w, stats: torch.sort(x, -1)[0], set()),
    "sort-method": (lambda x, w, stats: x.sort()[0], set()),
    "embedding-bag-max-norm": (
        lambda x, w, stats: F.embedding_bag(torch.tensor([[0, 1]]), w, max_norm=1.0),
        {"w"},
    ),
    "embedding-max-norm": (lambda x, w, stats: F.embedding(torch.tensor([0, 1]), w, max_norm=1.0), {"w"}),
    "embedding": (lambda x, w, stats: F.embedding(torch.tensor([0, 1]), w), set()),
    "operator-packet": (_update_scale, {"stats"}),
    "custom-op-packet": (lambda x, w, stats: (torch.ops.fxmem_test.bump(stats, x[0, :4]), x + 1)[1], {"stats"}),
    "batch-norm-training": (lambda x, w, stats: F.batch_norm(x, stats[0], stats[1], training=True), {"stats"}),
    "batch-norm-eval": (lambda x, w, stats: F.batch_norm(x, stats[0], stats[1], training=False), set()),
    "index-put-method": (lambda x, w, stats: stats.index_put_((torch.tensor([0]),), torch.ones(4)) * 2, {"stats"}),
}


@pytest.mark.parametrize("case", CASES)
def test_written_in_place_names_what_eager_changes(case):
    fn, changed = CASES[case]
    g = torch.Generator().manual_seed(0)
    inputs = {"x": torch.randn(8, 4, generator=g), "w": 3 * torch.randn(6, 4, generator=g), "stats": torch.rand(2, 4)}
    before = {k: v.clone() for k, v in inputs.items()}
    copies = {k: v.clone() for k, v in inputs.items()}
    fn(**copies)
    assert {k for k in inputs if not torch.equal(copies[k], before[k])} == changed
    gm, _ = capture(fn, *[v.clone() for v in inputs.values()])
    placeholders = {n: n.name.removeprefix("l_").removesuffix("_") for n in gm.graph.nodes if n.op == "placeholder"}
    written = set()  # the inputs written, directly or through a view; not the graph's own tensors
    for node in gm.graph.nodes:
        for t in written_in_place(node):
            while isinstance(t, fx.Node) and t not in placeholders and t.op == "call_function" and t.args:
                t = t.args[0]
            if t in placeholders:
                written.add(placeholders[t])
    assert written == changed

"""The rule matcher (fxmem/rules.py) and the pass pipeline (fxmem/pipeline.py), on Dynamo graphs.

Patterns are plain torch functions; these tests write small ones and check each promise of the
matcher's docstring: spellings of one op meet, arguments compare by name with defaults, dims
compare negative, `*`/`+` commute, no-op nodes are stepped over, optional ops bind their
`absent` values, escaping intermediates refuse the match, guards refuse with a reason, and
`may_escape` values are rewired. Each rewrite is then run and compared with the original.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from _graphs import calls, capture, run_graph

from fxmem.modes import modes_at
from fxmem.pipeline import PASSES, default_passes, run_passes
from fxmem.rules import Match, Refusal, Rule, RulePass, call_leaf, erase_unused, insert_call, match


def _q():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, 4, 5, generator=g), torch.randn(2, 3, 4, 5, generator=g)


def _matches(rule, fn, *args):
    """Every match (or refusal) of `rule` over the graph of fn(*args)."""
    gm, _ = capture(fn, *args)
    found = [match(rule, n) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    return [f for f in found if f is not None]


# --- spellings --------------------------------------------------------------------------------


def scores_pattern(a, b):
    return torch.matmul(a, b.transpose(-2, -1))


def scores_replacement(a, b):
    return torch.einsum("...id,...jd->...ij", a, b)


SCORES = Rule("scores", scores_pattern, scores_replacement)


@pytest.mark.parametrize(
    "fn",
    [
        lambda a, b: a @ b.transpose(-2, -1),
        lambda a, b: torch.matmul(a, b.transpose(2, 3)),  # dims compare negative
        lambda a, b: a.matmul(b.transpose(3, 2)),  # and in either order
        lambda a, b: a @ torch.transpose(b, -1, -2),
    ],
    ids=["operator", "torch.matmul", "method", "torch.transpose"],
)
def test_one_op_many_spellings(fn):
    (m,) = _matches(SCORES, fn, *_q())
    assert isinstance(m, Match) and set(m.bindings) == {"a", "b"}
    assert len(m.nodes) == 2 and m.output is m.nodes[-1]


def test_other_dims_do_not_match():
    a, b = torch.randn(2, 4, 4, 4), torch.randn(2, 4, 4, 4)
    assert _matches(SCORES, lambda a, b: a.transpose(-2, -1) @ b, a, b) == []
    assert _matches(SCORES, lambda a, b: a @ b.transpose(1, 3), a, b) == []


def test_rule_pass_rewrites_runs_and_lints():
    fn = lambda a, b: torch.softmax(a @ b.transpose(2, 3), -1) + (b @ a.transpose(-1, -2)).sum()  # noqa: E731
    gm, ex = capture(fn, *_q())
    p = RulePass("scores", [SCORES])
    gm, fired = p(gm, ex)
    gm.graph.lint()
    assert fired == 2
    assert len(calls(gm, torch.einsum)) == 2 and not calls(gm, "transpose") and not calls(gm, torch.matmul)
    assert torch.allclose(run_graph(gm, ex), fn(*_q()), rtol=1e-5, atol=1e-6)
    # the new nodes carry example values, as the later passes and AOTAutograd expect
    for n in calls(gm, torch.einsum):
        assert n.meta["example_value"].shape == (2, 3, 4, 4)


def test_no_match_no_change():
    gm, ex = capture(lambda a, b: a + b, *_q())
    before = gm.code
    gm, fired = RulePass("scores", [SCORES])(gm, ex)
    assert fired == 0 and gm.code == before


# --- arguments ----------------------------------------------------------------------------------


def scale_pattern(x, s):
    return x * s


def scale_replacement(x, s):
    return torch.mul(x, s * 2) / 2


@pytest.mark.parametrize("fn", [lambda x: x * 0.5, lambda x: 0.5 * x, lambda x: torch.mul(x, 0.5)])
def test_scalars_bind_numbers_and_mul_commutes(fn):
    rule = Rule("scale", scale_pattern, scale_replacement, scalars=("s",))
    (m,) = _matches(rule, fn, torch.randn(3))
    assert m["s"] == 0.5 and m.val("x").shape == (3,)


def test_a_node_does_not_bind_a_scalar_placeholder_unless_named():
    rule = Rule("scale", scale_pattern, scale_replacement)  # s not in scalars: must be a node
    assert _matches(rule, lambda x: x * 0.5, torch.randn(3)) == []
    (m,) = _matches(rule, lambda x, y: x * y, torch.randn(3), torch.randn(3))
    assert isinstance(m["s"], fx.Node)


def test_one_placeholder_binds_one_value():
    rule = Rule("square", lambda x: x * x, lambda x: x.square())
    assert len(_matches(rule, lambda x: x * x, torch.randn(3))) == 1
    assert _matches(rule, lambda x, y: x * y, torch.randn(3), torch.randn(3)) == []


def test_one_scalar_placeholder_binds_one_number_exactly():
    rule = Rule("cap", lambda x, c: torch.tanh(x / c) * c, lambda x, c: c * torch.tanh(x / c), scalars=("c",))
    (m,) = _matches(rule, lambda x: torch.tanh(x / 30.0) * 30.0, torch.randn(3))
    assert m["c"] == 30.0
    # two numbers the replacement would fold into one: not a match however close they are
    assert _matches(rule, lambda x: torch.tanh(x / 30.0) * 30.00001, torch.randn(3)) == []
    assert _matches(rule, lambda x: torch.tanh(x / 30.0) * 30, torch.randn(3)) == []


def drop_pattern(x, p, training):
    return F.dropout(F.softmax(x, dim=-1), p=p, training=training)


def drop_replacement(x, p, training):
    return F.dropout(torch.softmax(x, -1), p, training)


@pytest.mark.parametrize(
    "fn, p, absent",
    [
        (lambda x: F.dropout(F.softmax(x, dim=-1), 0.25, True), 0.25, False),  # positional meets keywords
        (lambda x: F.dropout(x.softmax(-1), p=0.25), 0.25, False),  # training=True by default
        (lambda x: F.softmax(x, -1), 0.0, True),  # optional dropout absent: p binds 0.0
        (lambda x: F.dropout(F.softmax(x, -1), 0.0, True), 0.0, False),  # p=0 present binds its own 0
    ],
    ids=["positional", "default", "absent", "p0"],
)
def test_arguments_by_name_defaults_and_optional_ops(fn, p, absent):
    rule = Rule(
        "drop", drop_pattern, drop_replacement, scalars=("p", "training"),
        optional=("dropout",), absent={"p": 0.0, "training": False},
    )  # fmt: skip
    m = _matches(rule, fn, torch.randn(2, 4))[-1]  # at the output (the softmax alone matches too)
    assert m["p"] == p
    assert ("dropout" in m.optional_absent) == absent


def test_no_op_nodes_are_stepped_over():
    (m,) = _matches(SCORES, lambda a, b: a.contiguous() @ b.transpose(-2, -1).contiguous().float(), *_q())
    assert len(m.nodes) == 4  # matmul, transpose and the two no-ops between them
    # but a real cast is an op of its own
    assert _matches(SCORES, lambda a, b: a @ b.transpose(-2, -1).half().float(), *_q()) == []


# --- refusals ---------------------------------------------------------------------------------


def test_intermediate_used_outside_refuses():
    fn = lambda a, b: (a @ (bt := b.transpose(-2, -1)), bt.sum())  # noqa: E731
    (r,) = _matches(SCORES, fn, *_q())
    assert isinstance(r, Refusal) and not r and "also used outside" in str(r)
    gm, ex = capture(fn, *_q())
    p = RulePass("scores", [SCORES])
    gm, fired = p(gm, ex)
    assert fired == 0 and len(p.refusals) == 1 and p.refusals[0][0] == "scores"


def softmax_of_product_pattern(a, b):
    return torch.softmax(a @ b, -1)


def softmax_of_product_replacement(a, b):
    return F.softmax(torch.matmul(a, b), dim=-1)


SOFTMAX_OF_PRODUCT = Rule("softmax_of_product", softmax_of_product_pattern, softmax_of_product_replacement)


def _product_then(between):
    """softmax(a @ b) with `between(a, b)` run after the product, before the softmax."""

    def fn(a, b):
        t = a @ b
        between(a, b)
        return torch.softmax(t, -1)

    return fn


def _product_then_autocast(a, b):
    t = a @ b  # in fp32: moved under the autocast below, it would run in bf16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return torch.softmax(t, -1)


def _product_then_no_grad(a, b):
    t = a @ b
    with torch.no_grad():
        return torch.softmax(t, -1)


def _product_then_inference_mode(a, b):
    t = a @ b
    with torch.inference_mode():
        return torch.softmax(t, -1)


def _sum_in_no_grad(a, b):
    with torch.no_grad():
        return a.sum()


def _product_then_two_dtypes(a, b):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        t = a @ b  # in bf16; the second setter does not put bf16 back
        torch.set_autocast_dtype("cpu", torch.float16)
        torch.set_autocast_dtype("cpu", torch.float32)
        return torch.softmax(t, -1)


def _product_then_grad_off_in_autocast(a, b):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        t = a @ b
        torch.set_grad_enabled(False)  # outlives the autocast region
    return torch.softmax(t, -1)


def _product_then_setter_across_autocast(a, b):
    t = a @ b  # autocast off: fp32
    torch.set_autocast_enabled("cpu", True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.set_autocast_enabled("cpu", False)  # undone by the exit, not undoing the setter before
    s = torch.softmax(t, -1)  # autocast on
    torch.set_autocast_enabled("cpu", False)
    return s


def _product_then_redundant_setter(a, b):
    t = a @ b
    torch.set_autocast_enabled("cpu", False)  # already off: Dynamo records it all the same
    torch.set_autocast_enabled("cpu", True)
    s = torch.softmax(t, -1)
    torch.set_autocast_enabled("cpu", False)
    return s


def _grad_back_on_inside_inference_mode(a, b):
    torch.set_grad_enabled(False)
    with torch.inference_mode():
        torch.set_grad_enabled(True)  # the exit restores grad off
    s = torch.softmax(a @ b, -1)
    torch.set_grad_enabled(True)
    return s


# torch 2.11's Dynamo cannot trace `torch.set_autocast_enabled` / `set_autocast_dtype` (a graph
# break on a skipped builtin); later versions record them as nodes of the graph.
_SETTERS_TRACED = pytest.mark.skipif(
    torch.torch_version.TorchVersion(torch.__version__) < (2, 12),
    reason="torch 2.11's Dynamo does not trace torch.set_autocast_* calls",
)


def _update_scale(a, b):
    torch._amp_update_scale_(b[0, :1], torch.zeros(1, dtype=torch.int32), torch.zeros(1), 2.0, 0.5, 1)


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        (_product_then_autocast, "autocast or grad mode"),
        pytest.param(_product_then_two_dtypes, "autocast or grad mode", marks=_SETTERS_TRACED),
        (_product_then_grad_off_in_autocast, "autocast or grad mode"),
        pytest.param(_product_then_setter_across_autocast, "autocast or grad mode", marks=_SETTERS_TRACED),
        pytest.param(_product_then_redundant_setter, "autocast or grad mode", marks=_SETTERS_TRACED),
        (_product_then_no_grad, "autocast or grad mode"),
        (_product_then_inference_mode, "autocast or grad mode"),
        # moved past any of these, the product would read what they wrote
        (_product_then(lambda a, b: b.fill_(0)), "in place"),
        (_product_then(lambda a, b: b.__setitem__(0, 0.0)), "in place"),
        (_product_then(lambda a, b: F.relu(b, True)), "in place"),  # inplace passed by position
        (_product_then(lambda a, b: torch.ops.aten.relu_.default(b)), "in place"),
        (_product_then(lambda a, b: torch._foreach_zero_([b])), "in place"),
        (_product_then(lambda a, b: torch.mul(a, 2, out=b)), "in place"),
        (_product_then(_update_scale), "in place"),  # a private builtin, its schema says what it writes
        (_product_then(lambda a, b: F.batch_norm(a, b[0], b[1], training=True)), "in place"),  # running stats
    ],
    ids=[
        "autocast",
        "two-dtype-setters",
        "grad-off-in-autocast",
        "setter-across-autocast",
        "redundant-setter",
        "no_grad",
        "inference_mode",
        "fill_",
        "setitem",
        "relu-inplace",
        "aten-overload",
        "foreach",
        "out",
        "private-builtin",
        "batch-norm-statistics",
    ],
)
def test_a_match_interleaved_with_what_changes_its_meaning_refuses(fn, reason):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 32, generator=g), torch.randn(32, 32, generator=g)
    try:
        refusals = [r for r in _matches(SOFTMAX_OF_PRODUCT, fn, a, b.clone()) if not r]
        assert len(refusals) == 1 and reason in str(refusals[0])
        gm, ex = capture(fn, a, b.clone())
        gm, fired = RulePass("softmax_of_product", [SOFTMAX_OF_PRODUCT])(gm, ex)
        assert fired == 0
        got = run_graph(gm, [a, b.clone()])
        want = fn(a, b.clone())
    finally:
        torch.set_grad_enabled(True)  # a graph or function that leaves grad off
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize(
    ("fn", "grad", "autocast", "dtype"),
    [
        pytest.param(_product_then_two_dtypes, True, True, torch.float32, marks=_SETTERS_TRACED),
        (_product_then_grad_off_in_autocast, False, False, None),
        (_product_then(_sum_in_no_grad), True, False, None),
        pytest.param(_product_then_setter_across_autocast, True, True, None, marks=_SETTERS_TRACED),
        (_grad_back_on_inside_inference_mode, False, False, None),
    ],
    ids=["two-dtype-setters", "grad-off-in-autocast", "balanced-no_grad", "setter-across-autocast", "inference-exit"],
)
def test_modes_at_a_node_are_those_the_switches_before_it_leave(fn, grad, autocast, dtype):
    g = torch.Generator().manual_seed(0)
    try:
        gm, _ = capture(fn, torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g))
    finally:
        torch.set_grad_enabled(True)
    (softmax,) = [n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "softmax"]
    before = (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    with modes_at(softmax):
        assert torch.is_grad_enabled() is grad and torch.is_autocast_enabled("cpu") is autocast
        if dtype is not None:
            assert torch.get_autocast_dtype("cpu") == dtype
    assert (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")) == before


def _dtype_set_by_keyword(a, b):
    torch.set_autocast_dtype("cpu", dtype=torch.float16)
    s = torch.softmax(a @ b, -1)
    torch.set_autocast_dtype("cpu", torch.bfloat16)
    return s


def _product_masked_after_a_write(a, b, c):
    t = a @ b
    c.zero_()  # c is first read after this, by the match and by its replacement alike
    return torch.softmax(t + c, -1)


@pytest.mark.parametrize(
    ("fn", "rule", "args"),
    [
        # a region entered and left between two matched ops, with none of them in it
        (_product_then(_sum_in_no_grad), SOFTMAX_OF_PRODUCT, 2),
        (_product_then(lambda a, b: (a > 0) & (b > 0)), SOFTMAX_OF_PRODUCT, 2),  # `&` writes nothing
        (_product_then(lambda a, b: a.clone().add_(1)), SOFTMAX_OF_PRODUCT, 2),  # a write to another tensor
        (_product_then(lambda a, b: torch.sort(b, -1)), SOFTMAX_OF_PRODUCT, 2),  # aten's list sort writes a list
        (_product_then(lambda a, b: b.sort()), SOFTMAX_OF_PRODUCT, 2),
        pytest.param(_dtype_set_by_keyword, SOFTMAX_OF_PRODUCT, 2, marks=_SETTERS_TRACED),  # modes from keywords
        (
            _product_masked_after_a_write,
            Rule("masked", lambda a, b, c: torch.softmax(a @ b + c, -1), lambda a, b, c: F.softmax(c + a @ b, dim=-1)),
            3,
        ),
        # a one-op match with modes switched and inputs written around it
        (
            lambda a, b: (
                _sum_in_no_grad(a, b),
                b.add_(1),
                torch.softmax(a, -1),
                b.mul_(2),
                _product_then_autocast(a, b),
            ),
            Rule("softmax", lambda x: torch.softmax(x, -1), lambda x: F.softmax(x, dim=-1)),
            2,
        ),
    ],
    ids=[
        "balanced-no_grad",
        "and",
        "other-tensor",
        "sort",
        "sort-method",
        "dtype-keyword",
        "input-written-before-read",
        "one-op",
    ],
)
def test_a_match_interleaved_with_what_leaves_its_meaning_is_rewritten(fn, rule, args):
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(32, 32, generator=g) for _ in range(args)]
    gm, ex = capture(fn, *[x.clone() for x in inputs])
    p = RulePass(rule.name, [rule])
    gm, fired = p(gm, ex)
    assert fired >= 1, p.refusals
    got, want = run_graph(gm, [x.clone() for x in inputs]), fn(*[x.clone() for x in inputs])
    for x, y in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want], strict=True):
        assert x.dtype == y.dtype and torch.allclose(x, y, rtol=1e-6, atol=1e-7)


def test_guard_refuses_with_a_reason():
    def guard(m: Match):
        if m.val("a").shape[-1] != 8:
            return Refusal(f"head_dim {m.val('a').shape[-1]} is not 8")
        return None

    rule = Rule("scores8", scores_pattern, scores_replacement, guard=guard)
    (r,) = _matches(rule, lambda a, b: a @ b.transpose(-2, -1), *_q())
    assert not r and "head_dim 5 is not 8" in repr(r)
    gm, ex = capture(lambda a, b: a @ b.transpose(-2, -1), *_q())
    p = RulePass("scores8", [rule])
    assert p(gm, ex)[1] == 0 and "head_dim 5" in p.refusals[0][2]


def test_refusal_is_falsy_and_says_why():
    r = Refusal("because")
    assert not r and bool(r) is False and "because" in str(r) and "because" in repr(r)


# --- rewiring ----------------------------------------------------------------------------------


def logits_pattern(h, w, y):
    return F.cross_entropy(F.linear(h, w), y)


def logits_replacement(h, w, y):
    logits = F.linear(h, w)
    return F.cross_entropy(logits * 1.0, y), logits  # (output, new value of "linear")


def test_may_escape_rewires_the_escaped_value():
    rule = Rule("ce", logits_pattern, logits_replacement, may_escape=("linear",))
    h, w, y = torch.randn(6, 4), torch.randn(8, 4), torch.randint(0, 8, (6,))

    def fn(h, w, y):
        logits = F.linear(h, w)
        return F.cross_entropy(logits, y), logits.square().sum()  # logits used after the loss

    gm, ex = capture(fn, h, w, y)
    gm, fired = RulePass("ce", [rule])(gm, ex)
    gm.graph.lint()
    assert fired == 1 and len(calls(gm, F.linear)) == 1
    assert calls(gm, F.linear)[0].name != "logits"  # the new linear; the old one is erased
    got, ref = run_graph(gm, ex), fn(h, w, y)
    assert all(torch.allclose(a, b) for a, b in zip(got, ref, strict=True))


def test_escape_not_listed_in_may_escape_refuses():
    rule = Rule("ce", logits_pattern, lambda h, w, y: F.cross_entropy(F.linear(h, w), y))
    fn = lambda h, w, y: (F.cross_entropy(lg := F.linear(h, w), y), lg)  # noqa: E731
    (r,) = _matches(rule, fn, torch.randn(6, 4), torch.randn(8, 4), torch.randint(0, 8, (6,)))
    assert not r


def test_larger_patterns_first():
    small = Rule("small", lambda a, b: torch.matmul(a, b), lambda a, b: a @ b)
    assert SCORES.benefit == 2 and small.benefit == 1
    assert [r.name for r in RulePass("p", [small, SCORES]).rules] == ["scores", "small"]


def test_replaced_random_ops_are_erased():
    # A replacement that draws its own dropout: the matched dropout (impure in general) must go too,
    # or it keeps the tensor it drops alive and computed.
    rule = Rule(
        "drop", drop_pattern, lambda x, p, training: F.dropout(x, p, training).softmax(-1), scalars=("p", "training")
    )
    gm, ex = capture(lambda x: F.dropout(F.softmax(x, -1), 0.5, True) * 2, torch.randn(2, 4))
    gm, fired = RulePass("drop", [rule])(gm, ex)
    assert fired == 1
    assert len(calls(gm, F.dropout)) == 1 and calls(gm, F.dropout)[0].args[0].op == "placeholder", gm.code


def test_what_only_the_replaced_nodes_used_is_erased():
    # `mask == 0` spelled as a method call (torch 2.11's Dynamo records `__eq__`): pure, so it
    # goes with the match that used it; in-place calls, however spelled, stay.
    g = fx.Graph()
    x, mask = g.placeholder("x"), g.placeholder("mask")
    eq = g.call_method("__eq__", (mask, 0))
    filled = g.call_method("masked_fill", (x, eq, 0.0))
    writes = [g.call_method(m, (mask, 1)) for m in ("add_", "__iadd__", "__imul__")]
    writes += [g.call_function(operator.iadd, (mask, 1)), g.call_method("__setitem__", (mask, 0, 1))]
    g.output(x)
    erase_unused([filled, *writes])
    assert [n.target for n in g.nodes if n.op in ("call_method", "call_function")] == [w.target for w in writes]


def test_insert_call_and_call_leaf():
    gm, ex = capture(lambda x: x.sin() + 1, torch.randn(3))
    sin = calls(gm, "sin")[0]

    def leaf(x):
        return x.cos()

    new = insert_call(lambda x: call_leaf(leaf, x * 2), {"x": sin.args[0]}, before=sin, like=sin)
    assert new.target is leaf and new.meta["example_value"].shape == (3,)
    sin.replace_all_uses_with(new)
    gm.graph.erase_node(sin)
    gm.graph.lint()
    gm.recompile()
    x = ex[0]
    assert torch.allclose(run_graph(gm, ex), (x * 2).cos() + 1)


# --- the pipeline ---------------------------------------------------------------------------------


def test_pipeline_order_and_defaults():
    exact = ["index_as_slice", "swap_sdpa", "fuse_projections", "chunked_attention", "chunked_lm_loss", "detach_caches"]
    assert list(PASSES)[:6] == exact
    assert default_passes() == exact
    assert "bf16_regions" in PASSES and "bf16_regions" not in default_passes()


def test_run_passes_names_and_counts():
    gm, ex = capture(lambda a, b: a + b, *_q())
    assert run_passes(gm, ex, None)[1] == dict.fromkeys(default_passes(), 0)
    assert run_passes(gm, ex, ())[1] == {}
    # pipeline order, whatever order they are named in
    assert list(run_passes(gm, ex, ["chunked_lm_loss", "swap_sdpa"])[1]) == ["swap_sdpa", "chunked_lm_loss"]
    with pytest.raises(ValueError, match="no_such_pass"):
        run_passes(gm, ex, ["no_such_pass"])

"""The rule matcher: patterns written as plain torch functions, matched on Dynamo's graph.

A `Rule` pairs a pattern function with a replacement function of the same arguments. The
pattern is traced with `torch.fx.symbolic_trace`; matching walks it backwards from its
output against a node of the captured torch-level graph, so the spellings Dynamo records
and the spellings a model author writes meet in the middle:

- one op, several spellings: `a @ b`, `torch.matmul(a, b)` and `a.matmul(b)` are one op;
  `x.softmax(-1)` and `F.softmax(x, dim=-1)` too (fxmem.ops);
- arguments are compared by parameter name with defaults filled in, so
  `F.dropout(x, 0.1, True)` meets `F.dropout(x, p=0.1, training=True)`;
- dimensions are compared negative (`transpose(2, 3)` of a 4-D tensor is `transpose(-2, -1)`):
  patterns write them negative;
- `*` and `+` match in either operand order;
- target nodes that compute nothing (`contiguous()`, a cast to the dtype a tensor already
  has, dropout with p=0 or not training) are stepped over;
- pattern ops a rule lists as `optional` may be absent from the target (their scalar
  arguments then bind to the rule's `absent` values, e.g. dropout p=0).

A pattern argument named in `scalars` binds a Python number or a node; every other argument
binds a node. A match whose inner values are also used outside it (attention weights returned
to the caller, say) is refused: the rewrite would have to keep them anyway. So is a match
that other ops interleave with where moving it to its output would change what it computes:
an autocast region or grad mode entered or left inside it, or an input written in place
between its first op and its output (the replacement runs at the output). A guard next to a
rule may refuse a match with a reason (`Refusal` is falsy and says why when printed).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from fxmem.constants import capture_inputs
from fxmem.modes import after_switch, modes_at, switches_mode
from fxmem.ops import (
    COMMUTATIVE,
    canonical_args,
    example_value,
    is_identity,
    op_key,
    storage_of,
    writes_in_place,
    written_in_place,
)

__all__ = [
    "Match",
    "Refusal",
    "Rule",
    "RulePass",
    "call_leaf",
    "erase_unused",
    "insert_call",
    "match",
    "propagate_meta",
]

log = logging.getLogger("fxmem.rules")


class Refusal:
    """Why a rule did not fire. Falsy, so a guard's result reads as a condition."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"Refusal({self.reason!r})"

    __str__ = __repr__


@dataclass
class Match:
    """What a pattern bound: argument name -> node or number, and the target nodes it covers."""

    bindings: dict[str, Any]
    nodes: list[fx.Node]  # covered target nodes, the output last
    optional_absent: set[str] = field(default_factory=set)
    # may_escape name -> the target nodes holding its value (it, or identities of it) used outside
    escaped: dict[str, list[fx.Node]] = field(default_factory=dict)

    @property
    def output(self) -> fx.Node:
        return self.nodes[-1]

    def __getitem__(self, name: str) -> Any:
        return self.bindings[name]

    def val(self, name: str) -> Any:
        return example_value(self.bindings[name])


Guard = Callable[[Match], "Refusal | None"]


@dataclass
class Rule:
    """One pattern and its replacement. `optional` names pattern ops (by alias, e.g. "dropout")
    that may be missing in the target; `absent` gives the scalars they would have bound."""

    name: str
    pattern: Callable[..., Any]
    replacement: Callable[..., Any]
    guard: Guard | None = None
    scalars: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    absent: dict[str, Any] = field(default_factory=dict)
    # Pattern nodes (by their traced names, e.g. "linear") whose values may also be used
    # outside the match; the replacement then returns (output, new value for each, in order).
    may_escape: tuple[str, ...] = ()
    _graph: fx.Graph | None = field(default=None, init=False, repr=False)

    @property
    def graph(self) -> fx.Graph:
        if self._graph is None:
            self._graph = fx.symbolic_trace(self.pattern).graph
        return self._graph

    @property
    def benefit(self) -> int:
        return sum(n.op in ("call_function", "call_method") for n in self.graph.nodes)


def _same_literal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, (int, float)):
        return a == b or (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_literal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b if not isinstance(a, fx.Node) else False


class _Matcher:
    def __init__(self, rule: Rule):
        self.rule = rule
        self.bindings: dict[str, Any] = {}
        self.covered: dict[fx.Node, None] = {}
        self.matched: dict[str, fx.Node] = {}  # pattern node name -> target node
        self.absent: set[str] = set()

    def match_value(self, p: Any, t: Any) -> bool:
        if isinstance(p, fx.Node):
            return self.match_node(p, t)
        if isinstance(p, (tuple, list)):
            return (
                isinstance(t, (tuple, list))
                and len(p) == len(t)
                and all(self.match_value(a, b) for a, b in zip(p, t, strict=True))
            )
        return _same_literal(p, t)

    def match_node(self, p: fx.Node, t: Any) -> bool:
        if p.op == "placeholder":
            if not isinstance(t, fx.Node) and p.target not in self.rule.scalars:
                return False
            if p.target in self.bindings:  # one value twice: the replacement uses it for both
                bound = self.bindings[p.target]
                return bound is t or (not isinstance(t, fx.Node) and type(bound) is type(t) and bound == t)
            self.bindings[p.target] = t
            return True
        if p.op == "get_attr" or not isinstance(t, fx.Node):
            return False
        pkey = op_key(p)
        while op_key(t) != pkey and is_identity(t):
            self.covered[t] = None
            t = t.args[0]
        if op_key(t) != pkey:
            if pkey in self.rule.optional:
                self._bind_absent(p)
                return self.match_node(p.args[0], t)
            return False
        pa, ta = canonical_args(p), canonical_args(t)
        if set(pa) != set(ta):
            return False
        snapshot = (dict(self.bindings), dict(self.covered))
        candidates = [ta]
        if pkey in COMMUTATIVE:
            candidates.append(dict(ta, input=ta["other"], other=ta["input"]))
        for args in candidates:
            self.bindings, self.covered = dict(snapshot[0]), dict(snapshot[1])
            if all(self.match_value(pa[k], args[k]) for k in pa):
                self.covered[t] = None
                self.matched[p.name] = t
                return True
        self.bindings, self.covered = snapshot
        return False

    def _bind_absent(self, p: fx.Node) -> None:
        self.absent.add(op_key(p) or "")
        for a in (*p.args[1:], *p.kwargs.values()):
            if isinstance(a, fx.Node) and a.op == "placeholder":
                self.bindings.setdefault(a.target, self.rule.absent.get(a.target))


def _escapes(covered: list[fx.Node], output: fx.Node) -> list[fx.Node]:
    inside = set(covered)
    return [n for n in covered if n is not output and any(u not in inside for u in n.users)]


def _interleaved(covered: list[fx.Node], rule: Rule) -> Refusal | None:
    """Refuse a match that other ops interleave with so that moving it to its output changes
    what it computes: the replacement runs there, under the output's autocast and grad mode,
    reading its inputs as they are there. So no covered node may run in another mode than
    the first (a region entered and left between two of them is no matter), and nothing may
    write in place what a covered node has read before the output."""
    inside = set(covered)
    read_nodes: set[fx.Node] = set()
    read: set[int] = set()  # storages
    entered: tuple[fx.Node, ...] = ()  # mode switches since the first covered node, in force
    n = covered[0]
    while True:
        if n in inside:
            if entered:
                return Refusal(f"the matched {rule.name} spans {entered[-1].name} (autocast or grad mode changes)")
            for x in (n, *n.all_input_nodes):
                read_nodes.add(x)
                read.add(storage_of(x))
        elif switches_mode(n):
            entered = after_switch(entered, n)
        else:
            for written in written_in_place(n):
                if written in read_nodes or storage_of(written) in read - {None}:
                    return Refusal(f"{n.name} writes {written.name} in place inside the matched {rule.name}")
        if n is covered[-1]:
            return None
        n = n.next


def match(rule: Rule, node: fx.Node) -> Match | Refusal | None:
    """Match `rule` with its output at `node`: a Match, a Refusal saying why not, or None."""
    pattern_out = next(n for n in rule.graph.nodes if n.op == "output").args[0]
    m = _Matcher(rule)
    if not m.match_node(pattern_out, node):
        return None
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    covered = sorted(m.covered, key=order.__getitem__)
    interleaved = _interleaved(covered, rule)
    if interleaved is not None:
        return interleaved
    allowed = {m.matched[name]: name for name in rule.may_escape if name in m.matched}
    matched = set(m.matched.values())
    escaped: dict[str, list[fx.Node]] = {}
    for leak in _escapes(covered, node):
        source = leak
        while source not in matched and source in m.covered and is_identity(source):
            source = source.args[0]  # an identity the match skipped carries its input's value
        if source not in allowed:
            return Refusal(f"{leak.name} is also used outside the matched {rule.name}")
        if any(order[u] < order[node] for u in leak.users if u not in m.covered):
            return Refusal(f"{leak.name} is used outside the match before its end")
        escaped.setdefault(allowed[source], []).append(leak)
    found = Match(bindings=m.bindings, nodes=covered, optional_absent=m.absent, escaped=escaped)
    if rule.guard is not None:
        verdict = rule.guard(found)
        if verdict is not None and not verdict:
            return verdict
    return found


# --- rewriting ----------------------------------------------------------------------------


def _fake_mode(graph: fx.Graph):
    for n in graph.nodes:
        v = example_value(n)
        if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode"):
            return v.fake_mode
    return None


def propagate_meta(node: fx.Node, like: fx.Node | None = None, *, in_modes: bool = False) -> None:
    """Give a new node an example value (run under the graph's fake mode) and `like`'s source.
    `in_modes`: the caller has already put the graph's modes at `node` in force."""
    if like is not None:
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
    if node.op not in ("call_function", "call_method"):
        return
    fake_mode = _fake_mode(node.graph)
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), example_value)
    if fake_mode is None:
        return
    modes = contextlib.nullcontext() if in_modes else modes_at(node)
    with fake_mode, modes:  # autocast picks dtypes, grad mode sets requires_grad
        if node.op == "call_method":
            value = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            value = node.target(*args, **kwargs)
    node.meta["example_value"] = value


def insert_call(fn: Callable[..., Any], kwargs: dict[str, Any], before: fx.Node, like: fx.Node) -> Any:
    """Run `fn(**kwargs)` with proxies for the node arguments, recording its ops into
    `before`'s graph just before it; returns its result as node(s). Number arguments stay
    numbers, so a replacement may branch on them (never on a node's value)."""
    graph = before.graph
    tracer = fx.proxy.GraphAppendingTracer(graph)
    existing = set(graph.nodes)
    wrapped = {k: _wrap(v, tracer) for k, v in kwargs.items()}
    with graph.inserting_before(before):
        result = fn(**wrapped)
    with modes_at(before):  # once for all the new nodes: they share `before`'s modes
        for n in graph.nodes:
            if n not in existing:
                propagate_meta(n, like, in_modes=True)
    return _unwrap(result)


def call_leaf(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Inside a replacement: record `fn(...)` as one graph node instead of tracing into it
    (for functions that proxies cannot run, such as `autograd.Function.apply`)."""
    proxies = [a for a in (*args, *kwargs.values()) if isinstance(a, fx.Proxy)]
    if not proxies:
        return fn(*args, **kwargs)
    return proxies[0].tracer.create_proxy("call_function", fn, args, kwargs)


def _wrap(value: Any, tracer: fx.Tracer) -> Any:
    if isinstance(value, fx.Node):
        return fx.Proxy(value, tracer)
    if isinstance(value, (tuple, list)):
        return type(value)(_wrap(v, tracer) for v in value)
    return value


def _unwrap(value: Any) -> Any:
    if isinstance(value, fx.Proxy):
        return value.node
    if isinstance(value, (tuple, list)):
        return type(value)(_unwrap(v) for v in value)
    return value


def replacement_kwargs(fn: Callable[..., Any], bindings: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    missing = [p for p in params if p not in bindings and params[p].default is inspect.Parameter.empty]
    if missing:
        raise KeyError(f"replacement {fn.__name__} needs {missing}, which the match did not bind")
    return {p: bindings[p] for p in params if p in bindings}


class RulePass:
    """Apply a list of rules over a graph until none fires; counts firings."""

    def __init__(self, name: str, rules: Sequence[Rule]):
        self.name = name
        self.rules = sorted(rules, key=lambda r: -r.benefit)
        self.refusals: list[tuple[str, str, str]] = []  # (rule, node, reason)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any] = ()) -> tuple[fx.GraphModule, int]:
        with capture_inputs(gm, example_inputs):  # rules may fold buffer-made values
            fired = self._run(gm)
        if fired:
            gm.graph.lint()
            gm.recompile()
        return gm, fired

    def _run(self, gm: fx.GraphModule) -> int:
        fired = 0
        for node in reversed(list(gm.graph.nodes)):
            if getattr(node, "_erased", False) or node.op not in ("call_function", "call_method"):
                continue
            for rule in self.rules:
                found = match(rule, node)
                if found is None:
                    continue
                if not found:
                    self.refusals.append((rule.name, node.name, found.reason))
                    log.debug("%s: %s refused at %s: %s", self.name, rule.name, node.name, found.reason)
                    continue
                self.apply(found, rule)
                fired += 1
                break
        return fired

    @staticmethod
    def apply(found: Match, rule: Rule) -> None:
        out = found.output
        kwargs = replacement_kwargs(rule.replacement, found.bindings)
        new = insert_call(rule.replacement, kwargs, before=out, like=out)
        if rule.may_escape:
            new, *values = new  # (output, escaped values...)
            for name, value in zip(rule.may_escape, values, strict=False):
                for leak in found.escaped.get(name, ()):
                    leak.replace_all_uses_with(value)
        out.replace_all_uses_with(new)
        inputs = [b for b in found.bindings.values() if isinstance(b, fx.Node)]
        # The covered nodes are replaced, random ones included: a dropout the replacement draws
        # itself (SDPA's dropout_p) must go, or it keeps the weights it drops computed.
        erase_unused([*reversed(found.nodes), *inputs], replaced=set(found.nodes))


def _pure(node: fx.Node) -> bool:
    if node.op not in ("call_function", "call_method"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return not writes_in_place(name) and op_key(node) != "dropout" and not node.is_impure()


def erase_unused(nodes: Sequence[fx.Node], replaced: set[fx.Node] = frozenset()) -> None:
    """Erase these nodes, and what only they used, once nothing uses them (pure ops only, and
    the `replaced` nodes of a match, which its replacement computes instead)."""
    work = list(nodes)
    while work:
        n = work.pop(0)
        if getattr(n, "_erased", False) or n.users or not (n in replaced or _pure(n)):
            continue
        inputs = [a for a in n.all_input_nodes]
        n.graph.erase_node(n)
        work.extend(inputs)

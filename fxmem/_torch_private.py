"""Every private torch import fxmem uses, in one place.

A torch release that moves one of these breaks this file and nothing else. Each name is
used as a plain function; fxmem keeps its own logic outside.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import (
    _extract_fwd_bwd_modules,
    _is_primal,
    _is_tangent,
    _must_be_in_backward,
)
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import is_sym_node
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices
from torch.utils._pytree import tree_leaves

__all__ = [
    "RECOMPILE_LIMIT_ERRORS",
    "FakeTensor",
    "aot_autograd",
    "boxed_graph_function",
    "compiled_autograd_enabled",
    "extract_fwd_bwd",
    "carried_context",
    "fake_rerun",
    "foreach_default_devices",
    "is_aten_op",
    "inductor_compile",
    "inductor_max_accumulated_reads",
    "is_module_buffer",
    "is_primal",
    "is_real_tensor",
    "is_sym_node",
    "is_tangent",
    "logging_calls_skipped",
    "meta_for",
    "must_be_in_backward",
    "real_tensors",
    "register_log_name",
    "sdpa_backend",
    "trace_artifact",
    "tree_leaves",
]

# What a fullgraph torch.compile raises when a new input needs one recompilation more than
# `torch._dynamo.config.recompile_limit` allows.
RECOMPILE_LIMIT_ERRORS: tuple[type[BaseException], ...] = tuple(
    e for e in (getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", None),) if e is not None
)

is_primal = _is_primal
is_tangent = _is_tangent
must_be_in_backward = _must_be_in_backward


def is_real_tensor(t: torch.Tensor) -> bool:
    """A tensor with data behind it (not a fake or functional wrapper, not on the meta device)."""
    plain = type(t) in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer) and not isinstance(t, FakeTensor)
    return plain and t.device.type != "meta"


def foreach_default_devices() -> list[str]:
    """Device types whose parameters torch.optim updates with its multi-tensor kernels by default."""
    return _get_foreach_kernels_supported_devices()


def is_module_buffer(placeholder: torch.fx.Node) -> bool:
    """Whether Dynamo lifted this graph input from a module's registered buffers."""
    arg = placeholder.meta.get("grapharg")
    source = getattr(arg, "source", None)
    name = getattr(source, "name", "")
    name = name() if callable(name) else name
    return "._buffers[" in str(name)


def compiled_autograd_enabled() -> bool:
    """Whether backward passes are being compiled (torch._dynamo.compiled_autograd)."""
    from torch._dynamo import compiled_autograd

    return bool(getattr(compiled_autograd, "compiled_autograd_enabled", False))


def real_tensors() -> Any:
    """A context where tensors are real again, even inside a compiler's fake-tensor tracing
    (partition functions run under it: there, `torch.randn` makes a FakeTensor)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def carried_context() -> Callable[[], contextlib.AbstractContextManager]:
    """The torch state this thread runs a partition function in that each thread keeps for
    itself, to enter on another: grad mode, Dynamo's tracing and compile contexts (under a
    tracing context, dead-code elimination drops unused random ops), the active fake mode,
    the Python dispatcher (AOTAutograd enables it: ops with kernels written in Python run
    those) and the current CUDA device (a fake tensor made for a bare "cuda" takes its index)."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._guards import CompileContext, TracingContext

    grad = torch.is_grad_enabled()
    traced, compiled = TracingContext.try_get(), CompileContext.try_get()
    fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    python_dispatcher = torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher)
    cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    @contextlib.contextmanager
    def entered() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(grad))
            if cuda_device is not None:
                stack.enter_context(torch.cuda.device(cuda_device))
            if python_dispatcher:
                stack.enter_context(enable_python_dispatcher())
            stack.enter_context(_guards_set("compile_context", compiled))
            stack.enter_context(_guards_set("tracing_context", traced))
            if fake is not None:
                stack.enter_context(fake)
            yield

    return entered


@contextlib.contextmanager
def _guards_set(name: str, value: object) -> Iterator[None]:
    """`torch._guards`' thread-local `name` set to `value` for the block, as its `tracing()`
    does but without that one's clean-up on exit (it drops the tracing context's shape
    environment's records, which belong to the thread that made it)."""
    from torch._guards import _TLS

    old = getattr(_TLS, name, None)
    setattr(_TLS, name, value)
    try:
        yield
    finally:
        setattr(_TLS, name, old)


def sdpa_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> Any:
    """The kernel `F.scaled_dot_product_attention(query, key, value, **kwargs)` dispatches these
    real tensors to (a `torch.nn.attention.SDPBackend`), as torch itself chooses it."""
    from torch.nn.attention import SDPBackend

    return SDPBackend(torch._fused_sdp_choice(query, key, value, **kwargs))


def boxed_graph_function(gm: torch.fx.GraphModule) -> Any:
    """Run `gm` with the boxed calling convention: it takes the argument list and clears it,
    so each input is freed after its last use rather than when the call returns."""
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()

    def run(args: list) -> Any:
        return gm.forward(args)

    run._boxed_call = True
    return run


def is_aten_op(target: Any) -> bool:
    """Whether an fx node's target is an op overload (aten, prims, a custom op), as opposed to a
    higher-order op or a Python function."""
    return isinstance(target, torch._ops.OpOverload)


def fake_rerun(node: torch.fx.Node, value_of: Callable[[torch.fx.Node], Any] | None = None) -> Any:
    """`node`'s op run again on its inputs' fake values (or on `value_of(input)`, fake values of
    other layouts): a value like `node.meta["val"]` in a storage of its own (views of a tensor
    so made share its storage)."""
    from torch._guards import detect_fake_mode

    value_of = value_of or (lambda a: a.meta["val"])
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value_of)
    mode = detect_fake_mode([a.meta["val"] for a in node.all_input_nodes])
    with mode:
        return node.target(*args, **kwargs)


# node.meta of the op that made it: the fake inputs a custom op was traced with, which inductor
# matches against that op's schema when it lowers the node.
_OP_META = ("eager_input_vals",)

# The compiled backward of torch 2.11 and 2.12 takes the gradients of the forward's outputs as
# the arguments of one call, which hold them until it returns: the zeros autograd makes for an
# output the loss does not depend on (logits beside a loss computed in the model, the hidden
# state `chunked_lm_loss` returns, a cache) live to the backward's end. 2.13 passes them in a
# list the backward empties, and each is freed at its last use. Counted in `JointGraph.kept_to_end`.
_BEFORE_2_13 = tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13)
TANGENTS_HELD_THROUGH_BACKWARD = _BEFORE_2_13
# Inductor before 2.13 runs convolution backward as a library call on the strides its inputs
# have in the traced graph (its `constrain_to_fx_strides`); 2.13 lowers it on its own and, with
# its layout optimisation, asks for channels-last inputs. Traced contiguous, the gradient and
# a value computed again for it are written so and copied channels-last inside the call:
# fxmem pins them channels-last (`force_stride_order`) where the forward runs so.
CONV_BACKWARD_TAKES_TRACED_STRIDES = _BEFORE_2_13
# Ops whose value inductor stores, rather than computing it again inside every reader's
# kernel, when several kernels read it, on CPU (its `should_realize_on_reuse`): exp and sigmoid
# before 2.13, the logarithms and tanh too since (GPT-2's GELU: its tanh computed again in the
# backward was counted stored on 2.11, 1 MiB a layer that inductor computes in each reader).
HEAVY_ON_CPU = frozenset(
    {"exp", "sigmoid"} if _BEFORE_2_13 else {"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"}
)


def force_stride_order() -> Any:
    """Inductor's op asking for a value with the given strides: a no-op on a value it has not
    laid out yet, which it writes so, a copy otherwise."""
    from torch._inductor import inductor_prims

    return inductor_prims.force_stride_order


def meta_for(new: torch.fx.Node, like: torch.fx.Node) -> dict[str, Any]:
    """Meta for `new`, a node inserted to stand for `like` (its source, module, ...): `like`'s,
    without what belongs to `like`'s op, with `new`'s own fake value."""
    meta = {k: v for k, v in like.meta.items() if k not in _OP_META}
    meta["val"] = fake_rerun(new)
    return meta


def extract_fwd_bwd(
    joint: torch.fx.GraphModule,
    saved_values: list[torch.fx.Node],
    saved_sym_nodes: list[torch.fx.Node],
    num_fwd_outputs: int,
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Forward and backward modules whose boundary is exactly `saved_values`.

    Anything the backward needs that is not saved is copied into the backward graph, i.e.
    recomputed there.
    """
    return _extract_fwd_bwd_modules(
        joint, saved_values, saved_sym_nodes=saved_sym_nodes, num_fwd_outputs=num_fwd_outputs
    )


def inductor_compile(gm: torch.fx.GraphModule, example_inputs: Any, partition_fn: Any) -> Any:
    """Inductor's whole pipeline (joint-graph passes, lowering, codegen) with our partitioner."""
    import torch._functorch.config as functorch_config
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx

    if not hasattr(config, "custom_partitioner_fn"):
        raise RuntimeError(
            f"torch {torch.__version__} has no inductor custom_partitioner_fn; "
            "use options={'compiler': 'eager'} or a newer torch"
        )
    # AOTAutograd's cache would hand back a partition made for another budget; inductor's own
    # cache is keyed by the partitioned graphs and stays on.
    with (
        config.patch(custom_partitioner_fn=_partitioner_class()(partition_fn)),
        functorch_config.patch(enable_autograd_cache=False),
    ):
        # Patched through compile_fx, which also reaches the backward it compiles later. Buffer
        # reuse off: inductor's wrapper otherwise keeps a dead buffer alive until a later one of
        # the same size takes it over, whenever its own loose peak estimate allows; such kept
        # buffers put the measured peak up to 18% above the plan (a handover saves only an
        # allocator call). Its peak-memory reordering off: it reorders by that same estimate,
        # while the plan has already ordered the backward and predicted that order.
        # Horizontal fusion across library calls off (see _fusion_choices): the handler is set
        # around each inner compile (inductor makes its default one once per thread); the
        # config entry puts its uuid in inductor's cache key. The backward lays out its
        # convolutions as the forward does: inductor decides each graph's layout on its own, and
        # a backward without a convolution would run convolution backward in the traced
        # (contiguous) layout, copying every channels-last value it reads into it and its
        # input gradient back (a conv-BN-SiLU stack's backward wrote each such gradient twice,
        # 16% over its plan); the plan counts one buffer per value, in the forward's layout.
        choices = _fusion_choices()
        patches = {**_INDUCTOR_PATCHES, "inductor_choices_class": choices}
        forward_layout_opt: list[bool] = []

        def inner_compile(gm: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
            from torch._inductor.compile_fx import compile_fx_inner
            from torch._inductor.virtualized import V

            if not kwargs.get("is_backward"):
                forward_layout_opt[:] = [inductor_layout_optimization(gm)]
            same_layout = kwargs.get("is_backward") and forward_layout_opt == [True]
            with (
                V.set_choices_handler(choices()),
                config.patch(force_layout_optimization=True) if same_layout else contextlib.nullcontext(),
            ):
                return compile_fx_inner(gm, *args, **kwargs)

        return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)


# Inductor also writes out an element-wise value whose code counts more ops than its
# `realize_opcount_threshold` (30 on GPUs and before torch 2.13, 50 on CPU since), where several
# kernels read it or it loads more than one buffer; the plan does not count ops, and such
# values, which the plan computes in each reader, took new buffers, laid out apart (at a
# threshold of 12, ConvNeXt's LayerNorm and GELU chains: 49.4 MiB measured at a budget of 38.5
# at its floor). At 100 only what inductor writes out anyway is left: code so long that
# lowering it inline risks deep recursion.
_INDUCTOR_PATCHES = {"allow_buffer_reuse": False, "reorder_for_peak_memory": False, "realize_opcount_threshold": 100}


def _fusion_choices() -> type:
    """Inductor's fusion heuristics, less two: two kernels that do not depend on each other
    are not fused when a library call (a matmul, attention) runs between them, and neither is
    a kernel with a reader that runs after one. Fusing unrelated kernels moves the earlier
    one's work past the call, so what it reads stays alive across it (a LayerNorm's
    weight-gradient reduction fused with the next LayerNorm's holds two activations over an
    attention backward; a bias gradient summed over chunks of rows, each chunk's sum fused into
    the final add, holds every chunk's gradient); the plan counted them freed. Fusing a reader
    into its producer's kernel moves the reader's work before the calls in between, so what it
    writes is alive across them (DINOv2's backward computed the residual stream's values for
    both layers in its first kernel); the plan counted them made where they are read."""
    # A class defined at a module's top level: inductor pickles it into its cache key (torch
    # 2.11 bypasses the cache, with a warning, for a class it cannot pickle by name).
    from fxmem._inductor_choices import FxmemChoices3

    return FxmemChoices3


def _partitioner_class() -> type:
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class FxmemPartitioner(CustomPartitionerFn):
        def __init__(self, fn: Any):
            self.fn = fn

        def __call__(self, gm, joint_inputs, **kwargs):
            kwargs.pop("compiler", None)
            return self.fn(gm, joint_inputs, **kwargs)

        def uuid(self) -> None:
            return None  # plans depend on the budget: never reuse a cached partition

        def __reduce__(self):  # config snapshots pickle it; the plan itself is never cached
            return (str, ("fxmem-partitioner",))

    return FxmemPartitioner


@functools.cache
def own_recompiles() -> dict[str, Any]:
    """torch.compile keyword arguments that give one compiled module its own count of
    recompilations: by default every torch.compile of a function shares one, and each fxmem
    module's backend is its own, so a process's ninth optimized module of a class (the same
    forward) would hit `recompile_limit` (FailOnRecompileLimitHit under fullgraph), the
    modules before it dead or alive. Empty where torch has no such option (before 2.12)."""
    import inspect

    return {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}


def inductor_layout_optimization(gm: torch.fx.GraphModule) -> bool:
    """Whether inductor will run this graph's convolutions channels-last (its own heuristic:
    on CPU with mkldnn, whenever there is one)."""
    from torch._inductor.graph import GraphLowering

    try:
        return bool(GraphLowering.decide_layout_opt(gm, is_inference=False))
    except Exception:  # noqa: BLE001 -- a heuristic of torch's: no answer means no copies
        return False


def inductor_max_accumulated_reads(device_type: str) -> int:
    """How many buffers an element-wise value inductor computes inline may read, through the
    values it computes inline behind it, before inductor writes it out (its
    `realize_acc_reads_threshold`; when unset, a larger one for CPU code)."""
    from torch._inductor import config

    if config.realize_acc_reads_threshold is not None:
        return int(config.realize_acc_reads_threshold)
    if device_type == "cpu" and hasattr(config, "realize_cpu_acc_reads_threshold"):
        return int(config.realize_cpu_acc_reads_threshold)
    return int(getattr(config, "_realize_acc_reads_threshold_default", 8))


def register_log_name() -> None:
    """Make `TORCH_LOGS=+fxmem` and `torch._logging.set_logs(fxmem=logging.DEBUG)` control the
    `fxmem` logger, whether or not torch found the package when it parsed TORCH_LOGS."""
    from torch._logging import _internal

    if not _internal.log_registry.is_log("fxmem"):
        _internal.register_log("fxmem", "fxmem")


def trace_artifact(name: str, payload_fn: Any) -> None:
    """Emit a tlparse artifact (a no-op unless TORCH_TRACE is set)."""
    from torch._logging import trace_structured

    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "json"},
        payload_fn=payload_fn,
    )


# The methods of `logging.Logger` a forward may call (libraries add their own, such as
# transformers' `warning_once`); each returns None.
_LOGGER_METHODS = ("debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log")


@contextlib.contextmanager
def logging_calls_skipped() -> Iterator[None]:
    """Dynamo tracing in which the forward's calls to `logging.Logger`'s methods are no-ops.

    One graph cannot hold a logging call: without this, Dynamo breaks the graph at each one
    (transformers' models call `logger.warning_once` from their forward). Its config is read
    while tracing, so this wraps every call of a compiled module."""
    methods = {getattr(logging.Logger, name) for name in _LOGGER_METHODS}
    methods |= {v for name, v in vars(logging.Logger).items() if name.endswith("_once") and callable(v)}
    config = torch._dynamo.config
    with config.patch(ignore_logging_functions=config.ignore_logging_functions | methods):
        if _config_logging_fails():
            with _config_sorting_error_dropped():
                yield
        else:
            yield


@functools.cache
def _config_logging_fails() -> bool:
    """Whether Dynamo's compilation metrics fail to serialise the patched config (torch before
    2.13 sorts the set of functions, which do not compare, and logs the TypeError as an error).
    Asked once: the answer is the torch release's."""
    from torch._dynamo import utils

    try:
        utils._get_dynamo_config_for_logging()
    except TypeError:
        return True
    except Exception:  # noqa: BLE001 -- any other failure is torch's own to report
        return False
    return False


class _ConfigSortingError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or record.exc_info[0] is not TypeError:
            return True
        tb = record.exc_info[2]
        while tb is not None:
            if tb.tb_frame.f_code.co_name == "_get_dynamo_config_for_logging":
                return False
            tb = tb.tb_next
        return True


@contextlib.contextmanager
def _config_sorting_error_dropped() -> Iterator[None]:
    logger = logging.getLogger("torch._dynamo.metrics_context")
    drop = _ConfigSortingError()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)

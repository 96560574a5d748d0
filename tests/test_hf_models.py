"""Hugging Face transformers models, built from small configs (nothing is downloaded).

The same checks as test_api's GPT test, on models fxmem did not write: at 60% of eager's
measured peak the measured peak of a step stays within the budget, the plan's prediction is
within 15% of it, and the gradients are eager's.

Dropout is switched off (GPT-2's three dropout probabilities are 0; Llama's attention dropout
is 0 by default) so that eager and fxmem run the same arithmetic and can be compared exactly:
fxmem draws dropout masks as `rand_like(x) > p` (see backend._EAGER_DECOMPOSITIONS), which
consumes the generator differently from eager's `native_dropout`, so even with one seed the
masks would differ. Reproducing dropout under recomputation is tested in test_api.
"""

from __future__ import annotations

import pytest
import torch
from conftest import floor_plan, grads_of, max_rel_err, spy_on_partition, step, zero_grads
from fxmem.passes.chunked_attention import _runs_math

import fxmem
from benchmarks._harness import holding_step, train_step  # train_step: the loss alone kept (keep_outputs=False)
from fxmem.again import COPY_OF
from fxmem.nodes import aliased_input
from fxmem.pipeline import default_passes

transformers = pytest.importorskip("transformers")

MiB = 2**20
VOCAB = 512
BATCH = (4, 256)  # as conftest's GPT_BATCH: the attention scores dominate the step


def _gpt2(n_layer: int = 4):
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=BATCH[1],
        n_embd=64,
        n_layer=n_layer,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    # GPT2LMHeadModel's class name maps to no loss type, so its `loss_function` logs a
    # warning_once on every call: fxmem traces it as one graph all the same (the call is
    # skipped in the compiled step).
    return transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")


def _llama(n_layer: int = 4, config=None, model=None, attention: str = "eager", **extra):
    """A Llama-shaped decoder; `config`/`model` classes of another of that shape (Mistral);
    `attention`: transformers' attention implementation; `extra`: more of the config."""
    cfg = (config or transformers.LlamaConfig)(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=n_layer,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=BATCH[1],
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
        **{"intermediate_size": 176, **extra},
    )
    return (model or transformers.LlamaForCausalLM)._from_config(cfg, attn_implementation=attention)


MODELS = {"gpt2": _gpt2, "llama": _llama}


def _mistral(n_layer: int = 4):
    # a window under BATCH's 256 tokens: its cache layers keep a slice of their first update
    return _llama(n_layer, transformers.MistralConfig, transformers.MistralForCausalLM, sliding_window=64)


# From transformers 5.25 Falcon runs the shared attention functions, SDPA by default: its one
# key and value head is repeated over the query heads (`repeat_kv`: with one head, a view)
# before the attention; before, its heads were split with list indices and SDPA broadcast
# the one key head.
FALCON_REPEATS_KV = not hasattr(transformers.models.falcon.modeling_falcon.FalconAttention, "_split_heads")


def _falcon(n_layer: int = 4):
    """Falcon's defaults: multi-query attention (one key and value for all heads), rotary."""
    cfg = transformers.FalconConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=n_layer,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.FalconForCausalLM._from_config(cfg)


def _build(name: str, n_layer: int = 4, batch: tuple[int, int] = BATCH):
    torch.manual_seed(0)
    model = {**MODELS, "mistral": _mistral}[name](n_layer)
    model.train()
    assert model.config._attn_implementation == "eager"
    ids = torch.randint(0, VOCAB, batch)
    return model, {"input_ids": ids, "labels": ids}


def _eager_reference(model, kwargs):
    """Measured eager peak, loss and gradients of one step; leaves no gradients behind."""
    step(model, **kwargs)  # warm-up: lazy allocations, profiler bookkeeping
    zero_grads(model)
    m = fxmem.measure(step, model, **kwargs)
    ref = grads_of(model)
    zero_grads(model)
    return m, ref


@pytest.mark.parametrize("name", sorted(MODELS))
def test_budget_held_and_gradients_exact(name):
    model, kwargs = _build(name)
    eager, ref = _eager_reference(model, kwargs)
    budget = 0.6 * eager.peak_bytes
    m = fxmem.optimize(model, budget / 2**30, compiler="eager")
    step(m, **kwargs)  # plans and compiles
    zero_grads(model)
    got = fxmem.measure(step, m, **kwargs)
    plan = m.plan
    assert len(m.plans) == 1, "one graph, planned once"
    assert got.peak_bytes <= budget, (
        f"measured {got.peak_bytes / MiB:.2f} MiB > budget {budget / MiB:.2f} MiB "
        f"(predicted {plan.predicted_peak_bytes / MiB:.2f} MiB)"
    )
    assert abs(plan.predicted_peak_bytes - got.peak_bytes) <= 0.15 * got.peak_bytes, (
        f"predicted {plan.predicted_peak_bytes / MiB:.2f} MiB, measured {got.peak_bytes / MiB:.2f} MiB"
    )
    assert plan.recomputed, "a budget this tight needs recomputation"
    assert plan.rewrites["swap_sdpa"] == 4  # every layer's eager attention
    # Llama: q/k/v and gate/up per layer; GPT-2's c_attn is already one matmul for q/k/v
    assert plan.rewrites["fuse_projections"] == (8 if name == "llama" else 0)
    assert max_rel_err(grads_of(model), ref) < 1e-4
    assert torch.allclose(got.result, eager.result, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_output_logits_match_eager(name):
    # Smaller than above (this checks values), but still planned tight enough to recompute.
    model, kwargs = _build(name, n_layer=2, batch=(4, 128))
    eager, _ = _eager_reference(model, kwargs)
    m = fxmem.optimize(model, 0.8 * eager.peak_bytes / 2**30, compiler="eager")
    out = m(**kwargs)
    assert m.plan.recomputed
    with torch.no_grad():  # eager's output, in train mode, after fxmem's (so not in its budget)
        ref = model(**kwargs)
    assert type(out) is type(ref)
    assert out.keys() == ref.keys()
    assert out.logits.shape == ref.logits.shape == (*kwargs["input_ids"].shape, VOCAB)
    assert out.logits.requires_grad
    assert torch.allclose(out.logits, ref.logits, rtol=1e-5, atol=1e-6)
    assert torch.allclose(out.loss, ref.loss, rtol=1e-5)


def test_floor_below_where_the_walks_stall(monkeypatch):
    """Llama's residual after attention, recomputed for its MLP's backward, holds the
    attention's output and projection alive through that peak; saving it raises the peak
    elsewhere first, which no step of the planner's walks accepts. The search from where they
    stall (`kicks.kicked`) reaches below, and the budget at that floor holds, exactly."""
    import fxmem.planner

    model, kwargs = _build("llama", n_layer=3)
    eager, ref = _eager_reference(model, kwargs)  # alive from here on: in every floor below
    floor = _floor_mib(model, kwargs, "eager")
    with monkeypatch.context() as walks_only:
        walks_only.setattr(fxmem.planner, "kicked", lambda *args: [])
        stalled = _floor_mib(model, kwargs, "eager")
    assert floor < 0.98 * stalled, f"floor {floor:.3f} MiB, the walks alone {stalled:.3f} MiB"

    m = fxmem.optimize(model, floor / 1024, example_inputs=kwargs, compiler="eager")
    zero_grads(model)
    got = fxmem.measure(step, m, **kwargs)
    assert got.peak_bytes <= floor * MiB, f"measured {got.peak_bytes / MiB:.3f} MiB at a {floor:.3f} MiB budget"
    assert max_rel_err(grads_of(model), ref) < 1e-4
    assert torch.allclose(got.result, eager.result, rtol=1e-5)


def _floor_mib(model, kwargs, compiler: str, keep_outputs: bool = True) -> float:
    return floor_plan(model, kwargs, compiler=compiler, keep_outputs=keep_outputs)[0] / MiB


def _zoo_at_fixed_rates(monkeypatch, name: str):
    """A model of the HF zoo (`benchmarks/hf_zoo.py`) in train mode, its batch and eager's
    gradients, with the cost model's rates fixed for the rest of the test: the planner's search
    follows them, so a floor found at measured rates moves from machine to machine."""
    import fxmem.partition
    from benchmarks.hf_zoo import _models
    from fxmem.cost import DeviceRates

    monkeypatch.setattr(fxmem.partition, "measure_rates", lambda device, room_bytes=None: DeviceRates(1e11, 2**32))
    torch.manual_seed(0)
    model, kwargs = _models()[name]()
    model.train()
    _, ref = _eager_reference(model, kwargs)
    return model, kwargs, ref


def test_floor_below_a_swap_of_saved_residuals(monkeypatch):
    """Under inductor, the walks from ConvNeXt's plans end saving its first stage's residual
    and recomputing a later stage's; saving the later one instead lets the backward rebuild
    the first where it reads it, after the peak. Each half of that swap alone raises the peak,
    so neither the walks nor a kick take it; `kicks._swapped` does, and the floor is 5%
    lower (asserted: at least 2%). The cost model's rates are fixed here, since the walks'
    order depends on them (found so at flop rates from 5e10 to 1e12 per second and copy rates
    from 2e9 to 1e10 bytes per second). So does the convolutions' scratch space, which the plan
    measures and oneDNN sizes by the CPU's vector instructions: found so with AVX-512; with
    AVX2 the walks reach the same floor (38.48 MiB) without the swap, and it is asked to be no
    higher with it. The budget at that floor holds, as planned."""
    import fxmem.kicks

    model, kwargs, ref = _zoo_at_fixed_rates(monkeypatch, "convnext")  # 32 images of 128 x 128
    floor = _floor_mib(model, kwargs, "inductor")
    with monkeypatch.context() as no_swaps:
        no_swaps.setattr(fxmem.kicks, "_swapped", lambda *args: None)
        stalled = _floor_mib(model, kwargs, "inductor")
    lower = 0.98 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 1.0
    assert floor <= lower * stalled, f"floor {floor:.3f} MiB, without swaps {stalled:.3f} MiB"

    _held_as_predicted(model, kwargs, floor, "inductor", ref, within=0.005)


def test_long_element_wise_code_computed_as_planned(monkeypatch):
    """Inductor writes out an element-wise value whose code counts more ops than its
    `realize_opcount_threshold` where several kernels read it or it loads more than one
    buffer (30 ops on GPUs); the plan counts no ops, and fxmem compiles its graphs with that
    threshold at 100. Here the user's is 12: ConvNeXt's LayerNorm and GELU chains, written out
    and laid out apart, measured 28% over the budget at its floor without that (49.4 MiB
    against 38.5). Now that budget holds, as planned, gradients eager's."""
    model, kwargs, ref = _zoo_at_fixed_rates(monkeypatch, "convnext")
    with torch._inductor.config.patch(realize_opcount_threshold=12):
        floor = _floor_mib(model, kwargs, "inductor")
        _held_as_predicted(model, kwargs, floor, "inductor", ref, within=0.005)


def test_floor_kicked_at_the_backwards_high_point(monkeypatch):
    """Gemma 2's walks, for the step keeping only the loss (rates fixed as above), end with the
    peak in the forward, at its last chunk of logits, saving five values of 1 MiB where three
    would do: each unsave raises the backward's highest point above that peak. The kicks'
    values, those reading a recomputed value alive at the peak, are none there (the forward
    recomputes nothing); tried at the backward's highest step (`kicks._backward_high`), the
    floor is 7% lower (asserted: at least 2%). The budget at that floor holds, as planned."""
    import fxmem.kicks

    model, kwargs, ref = _zoo_at_fixed_rates(monkeypatch, "gemma2")
    floor = _floor_mib(model, kwargs, "eager", keep_outputs=False)
    with monkeypatch.context() as at_the_peak:
        at_the_peak.setattr(fxmem.kicks, "_backward_high", lambda tl: tl.peak_pos)
        stalled = _floor_mib(model, kwargs, "eager", keep_outputs=False)
    assert floor < 0.98 * stalled, f"floor {floor:.3f} MiB, kicked at the peak alone {stalled:.3f} MiB"

    _held_as_predicted(model, kwargs, floor, "eager", ref, within=0.005, keep_outputs=False)


def _held_as_predicted(
    model, kwargs, budget_mib: float, compiler: str, ref, within: float, keep_outputs: bool = True
) -> None:
    """A step of `model` optimized at `budget_mib` measures within the budget and within
    `within` (a share) of the plan's prediction, and its gradients are `ref`. The step holds
    the model's outputs through the backward, or (`keep_outputs=False`) keeps the loss alone."""
    m = fxmem.optimize(model, budget_mib / 1024, compiler=compiler, keep_outputs=keep_outputs)
    run = holding_step if keep_outputs else train_step
    run(m, kwargs)  # plans and compiles
    zero_grads(model)
    got = fxmem.measure(run, m, kwargs)
    predicted = m.plan.predicted_peak_bytes
    assert got.peak_bytes <= budget_mib * MiB, f"measured {got.peak_bytes / MiB:.3f} MiB at {budget_mib:.3f} MiB"
    assert abs(got.peak_bytes - predicted) <= within * predicted, (got.peak_bytes / MiB, predicted / MiB)
    assert max_rel_err(grads_of(model), ref) < 1e-4


def _only_values_not_alive_at_the_peak():
    """`kicks._readers_to_save` without the values alive at the step it is asked about (the
    peak's, as before GPT-J's test)."""
    import fxmem.kicks
    from fxmem.walks import at_peak

    tries = fxmem.kicks._readers_to_save

    def not_alive_at_the_peak(jg, choice, at):
        alive = set(at_peak(choice.timeline, choice.timeline.recomputed_interval, at))
        return [u for u in tries(jg, choice, at) if jg.storage[u] not in alive]

    return not_alive_at_the_peak


def test_floor_below_a_recomputed_value_that_holds_its_input_through_the_peak(monkeypatch):
    """GPT-J's walks end recomputing its first block's LayerNorm output for the backward, which
    keeps the embedding it is made from alive through the peak beside it. Saving it raises the
    peak elsewhere first, so the walks never do; the kicks try it (`kicks._readers_to_save`: a
    recomputed value that reads one alive at the peak, alive then itself). Without such values
    among the kicks' tries the floor is 2% higher (asserted: at least 2%). Rates fixed as in
    the test above. The step holds the model's outputs through the backward, as the plan
    (`keep_outputs=True`) assumes, and its measured peak is the prediction. Planned without
    merging the values computed twice (`cleanup.merge_repeated_values`): GPT-J's layers each
    compute the same rotary tables, which the backward reads, and with one copy of them the
    walks reach this floor on their own (44.07 MiB either way, where without the merge the
    kicks' tries take 45.10 to 44.05)."""
    import fxmem.kicks
    from fxmem import partition

    monkeypatch.setattr(partition, "merge_repeated_values", lambda gm, num_fwd_outputs: {})
    model, kwargs, ref = _zoo_at_fixed_rates(monkeypatch, "gptj")
    floor = _floor_mib(model, kwargs, "eager")
    with monkeypatch.context() as fewer_tries:
        fewer_tries.setattr(fxmem.kicks, "_readers_to_save", _only_values_not_alive_at_the_peak())
        stalled = _floor_mib(model, kwargs, "eager")
    assert floor < 0.98 * stalled, f"floor {floor:.3f} MiB, trying only values not alive at the peak {stalled:.3f} MiB"

    _held_as_predicted(model, kwargs, floor, "eager", ref, within=0.001)


def test_kicks_try_values_alive_at_the_peak_after_the_others(monkeypatch):
    """The kicks take the first value whose walk ends lower. Tried in graph order, the values
    alive at the peak (the test above) came among the others, and Qwen3's floor for the step
    keeping only the loss, under inductor, ended 5% higher (20.99 against 19.95 MiB). Tried
    after the others, the search is the one without them until those are spent; here its
    floor is no higher than theirs (asserted)."""
    import fxmem.kicks

    model, kwargs, _ = _zoo_at_fixed_rates(monkeypatch, "qwen3")
    floor = _floor_mib(model, kwargs, "inductor", keep_outputs=False)
    with monkeypatch.context() as fewer_tries:
        fewer_tries.setattr(fxmem.kicks, "_readers_to_save", _only_values_not_alive_at_the_peak())
        without = _floor_mib(model, kwargs, "inductor", keep_outputs=False)
    assert floor <= without, f"floor {floor:.3f} MiB, trying only values not alive at the peak {without:.3f} MiB"


def test_a_backward_copy_read_through_a_view_is_a_storage_of_its_own(monkeypatch):
    """GPT-2's Conv1D gradients read each LayerNorm output through `permute(view(x))`: where
    the backward reads a copy of x (`again.add_backward_copies`), those views read the copy,
    and live in its storage, not x's. Counted in x's, x stayed alive until the copy's last
    reader, 1 MiB over the measured peak at the zoo GPT-2's floor. Under inductor, at the
    floor, the step holding its outputs measures the prediction."""
    seen = spy_on_partition(monkeypatch)
    model, kwargs = _build("gpt2", n_layer=2)
    _, ref = _eager_reference(model, kwargs)
    floor = _floor_mib(model, kwargs, "inductor")
    _held_as_predicted(model, kwargs, floor, "inductor", ref, within=0.005)
    jg, _ = seen[-1]
    index = {node.name: i for i, node in enumerate(jg.nodes)}
    copies = {i: index[node.meta[COPY_OF]] for i, node in enumerate(jg.nodes) if COPY_OF in node.meta}
    views = [u for i in copies for u in jg.users[i] if aliased_input(jg.nodes[u]) is jg.nodes[i]]
    assert views, "no copy read through a view"
    shared = [jg.nodes[i].name for i, x in copies.items() if jg.storage[i] == jg.storage[x]]
    assert not shared, shared


def test_a_gather_by_integer_indices_is_fused_into_the_kernel_beside_it(monkeypatch):
    """Mixtral's backward gathers its tokens in expert order (`aten.index` by integer indices)
    for an expert's gradient, in the same kernel as the concatenation of the other expert
    matmul's gradients: the gather's output is written while that kernel still holds what it
    reads. Counted as a library call of its own, the gather came after those were freed, and
    the step at the floor measured 4% over its prediction. Rates fixed as above."""
    model, kwargs, ref = _zoo_at_fixed_rates(monkeypatch, "mixtral")
    _held_as_predicted(model, kwargs, _floor_mib(model, kwargs, "inductor"), "inductor", ref, within=0.005)


def _planned_exactly_at_floor(model, ids: torch.Tensor, zero: float = 1e-12):
    """`fxmem.optimize` (inductor, keep_outputs=False) 3% above its floor for a step that keeps
    only the loss on `ids`: one measured step holds the budget and is within 0.5% of the plan's
    prediction, and the gradients are eager's (`zero`: as `max_rel_err`'s). The plan. The
    passes are named, so that fused projections stay fused at the floor (by default they are
    planned apart where that lowers it): what these plans follow is inductor's code for them."""
    passes = default_passes()
    kwargs = {"input_ids": ids, "labels": ids}

    _, ref = _eager_reference(model, kwargs)
    with pytest.raises(fxmem.BudgetError) as err:
        fxmem.optimize(model, 1e-6, example_inputs=kwargs, keep_outputs=False, passes=passes)
    floor = err.value.floor_bytes
    del err
    m = fxmem.optimize(model, floor * 1.03 / 2**30, keep_outputs=False, passes=passes)
    train_step(m, kwargs)  # plans and compiles
    zero_grads(model)
    got = fxmem.measure(train_step, m, kwargs)
    predicted = m.plan.predicted_peak_bytes
    assert got.peak_bytes <= m.plan.budget_bytes
    assert abs(got.peak_bytes - predicted) <= 0.005 * predicted, (got.peak_bytes / MiB, predicted / MiB)
    assert max_rel_err(grads_of(model), ref, zero) < 1e-4
    return m.plan


def test_attention_inputs_copied_per_call_are_planned_exactly_under_inductor():
    """Llama's values, a slice of the fused projection made contiguous, are stored by no
    kernel of inductor's: each attention call that reads them (the forward's, computed again
    in the backward, and the attention's backward) copies them into its own layout, and the
    whole projection lives from the one call to the other. Counted so, the prediction at the
    floor (the step keeping only the loss) is the measured peak (+0.02%). Counted as one stored
    copy it was 3% under when this was written; the floor's plan has changed since, and that
    count now puts the prediction 0.23% over, inside this test's 0.5%: the rule's own tests are
    in test_simulate (a cross-attention's copies, the shared mask's)."""
    torch.manual_seed(0)
    model = _llama(n_layer=2, attention="sdpa", intermediate_size=128)
    ids = torch.randint(0, VOCAB, (8, BATCH[1]))
    plan = _planned_exactly_at_floor(model, ids)
    assert plan.rewrites["fuse_projections"] == 4  # per layer: q, k, v; gate, up


def test_opt_is_planned_exactly_under_inductor():
    """Two things of inductor's the plan follows in OPT, each a part of the measured peak.
    OPT scales its queries before viewing them per head and transposing them for the
    attention; inductor stores the scaled queries nowhere: like Llama's values, each attention
    call copies them (through the views) into its own layout, and the fused projection they
    are a slice of lives from the attention computed again in the backward to the attention's
    backward. Counted as one stored value, the prediction was 8% under the measured peak. And
    the chunked loss's gradients of its input, one matmul per chunk, are written into the
    buffer of their concatenation, made before the first: counted as buffers of their own and
    that one too, the prediction was 2.5% over."""
    model = _small_lm(
        transformers.OPTConfig,
        transformers.OPTForCausalLM,
        ffn_dim=128,
        word_embed_proj_dim=64,
        dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=0,
    )
    _planned_exactly_at_floor(model, torch.randint(0, VOCAB, BATCH), zero=1e-6)


def _small_lm(config, model, **extra):
    """A 2-layer causal LM of HF's `model` class, width 64 and 4 heads, with sdpa attention,
    in train mode (`extra`: its config's own names for the rest)."""
    torch.manual_seed(0)
    cfg = config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=BATCH[1],
        bos_token_id=0,
        eos_token_id=0,
        **extra,
    )
    m = model._from_config(cfg, attn_implementation="sdpa")
    m.train()
    return m


def test_gpt_neox_is_planned_exactly_under_inductor():
    """GPT-NeoX's parallel residual (the attention's and the feed-forward's outputs added to
    the layer's input), computed again in the backward, reads the saved layer input there as
    a buffer. Read by two kernels, the sum is computed in each from its three buffers, not
    stored: judged on the joint graph, where the layer input was code computed inline, it
    read six, and the plan counted it stored where inductor held the two outputs. The
    prediction was then 3.9% under the measured peak. (Its rotary embedding's gradient, placed
    into zeros, is element-wise code too: see test_simulate's value placed into a larger one.)"""
    model = _small_lm(
        transformers.GPTNeoXConfig,
        transformers.GPTNeoXForCausalLM,
        intermediate_size=128,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    _planned_exactly_at_floor(model, torch.randint(0, VOCAB, BATCH))


def test_shared_keys_and_a_causal_mask_are_planned_exactly_under_inductor():
    """Falcon's attention, sliced by fxmem, reads one key per chunk shared by all its heads.
    Three things of inductor's the plan now follows, each a part of the measured peak: saved
    for the backward, the keys' batched view (expanded over the heads) was returned as a
    four-head copy where the plan counted the one-head keys (fxmem now saves the keys and
    takes the view again in the backward); the keys' gradients, summed over the heads, are
    computed where the gradients of all chunks are concatenated, each chunk's product of all
    heads alive until then; and the causal mask, cheap index arithmetic, is computed in each
    of its readers and never stored. Before, the prediction was 6.6% under the measured peak,
    which was 4.4% higher. Falcon from transformers 5.25 repeats its one key and value head
    over the query heads by a view, which inductor copies densely for each attention call, the
    forward's and the backward's (`cleanup.copy_expanded_attention_inputs`); counted as the
    one-head keys, the prediction was 12% under the measured peak."""
    torch.manual_seed(0)
    model = _falcon(n_layer=2)
    model.train()
    ids = torch.randint(0, VOCAB, BATCH)
    plan = _planned_exactly_at_floor(model, ids)
    # Split where SDPA runs its math form for one key head read by four query heads (torch
    # 2.13); torch 2.15 runs its fused CPU kernel there, which keeps no weights to split. Keys
    # repeated over the heads, it runs its fused kernel.
    kv_heads = 4 if FALCON_REPEATS_KV else 1
    q, kv = torch.zeros(1, 4, 8, 16, requires_grad=True), torch.zeros(1, kv_heads, 8, 16, requires_grad=True)
    mask = torch.zeros(1, 1, 8, 8, dtype=torch.bool)
    split = _runs_math(q, kv, kv, mask, p=0.0, causal=False, scale=None, gqa=False)
    assert plan.rewrites["chunked_attention"] == (2 if split else 0)


def test_below_the_floor_with_fused_projections_they_are_planned_apart(tmp_path):
    """Fused, a group's output lives until its last part is read and the backward concatenates
    the parts' gradients: under inductor Llama's floor is 19% higher with its projections
    fused (asked: 10%; 6% on torch 2.11, whose kernels differ, asked 5% there). By default a
    budget below that floor is planned with them apart: it holds, the gradients are eager's,
    and a plan saved so is applied so. Named, the passes run as named."""
    torch.manual_seed(0)
    model = _llama(n_layer=2, attention="sdpa", intermediate_size=128)
    ids = torch.randint(0, VOCAB, (8, BATCH[1]))
    kwargs = {"input_ids": ids, "labels": ids}
    _, ref = _eager_reference(model, kwargs)
    fused, fused_plan = floor_plan(model, kwargs, keep_outputs=False, passes=default_passes())
    floor, plan = floor_plan(model, kwargs, keep_outputs=False)
    assert fused_plan.rewrites["fuse_projections"] == 4 and plan.rewrites["fuse_projections"] == 0
    lower = 0.95 if torch.torch_version.TorchVersion(torch.__version__) < (2, 12) else 0.9
    assert floor < lower * fused, (floor / MiB, fused / MiB)

    m = fxmem.optimize(model, floor * 1.03 / 2**30, keep_outputs=False)
    train_step(m, kwargs)  # plans and compiles
    zero_grads(model)
    got = fxmem.measure(train_step, m, kwargs)
    assert m.plan.rewrites["fuse_projections"] == 0
    assert got.peak_bytes <= m.plan.budget_bytes, (got.peak_bytes / MiB, m.plan.budget_bytes / MiB)
    predicted = m.plan.predicted_peak_bytes
    assert abs(got.peak_bytes - predicted) <= 0.005 * predicted, (got.peak_bytes / MiB, predicted / MiB)
    assert max_rel_err(grads_of(model), ref) < 1e-4

    m.plan.save(tmp_path, files=False)
    zero_grads(model)
    reused = fxmem.optimize(model, floor * 1.03 / 2**30, keep_outputs=False, plan=tmp_path)
    train_step(reused, kwargs)
    assert reused.plan.rewrites["fuse_projections"] == 0
    assert reused.plan.saved_nodes == m.plan.saved_nodes
    assert max_rel_err(grads_of(model), ref) < 1e-4


def _gemma2():
    cfg = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.Gemma2ForCausalLM._from_config(cfg, attn_implementation="eager")


def _bloom():
    cfg = transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.BloomForCausalLM._from_config(cfg)


@pytest.mark.parametrize("build", [_gemma2, _bloom], ids=["gemma2", "bloom"])
def test_attention_sdpa_cannot_run_runs_in_groups_below_the_floor_without_them(build):
    """Gemma 2 caps its attention scores with tanh, BLOOM adds a bias per head (ALiBi) with
    baddbmm: no SDPA rewrite applies, so their (T, T) weights are made, saved and
    differentiated whole. chunked_attention splits them into groups of heads and sequences:
    the floor drops to a fraction, the budget holds there and the gradients are eager's."""
    torch.manual_seed(0)
    model = build().train()
    ids = torch.randint(0, VOCAB, (4, 512))  # the weights grow with T squared, the rest with T
    kwargs = {"input_ids": ids, "labels": ids}
    _, ref = _eager_reference(model, kwargs)
    options = dict(keep_outputs=False, compiler="eager")
    without = [p for p in default_passes() if p != "chunked_attention"]
    whole, _ = floor_plan(model, kwargs, passes=without, **options)
    floor, plan = floor_plan(model, kwargs, **options)
    assert plan.rewrites["chunked_attention"] == 2  # both layers
    assert floor < 0.6 * whole, (floor / MiB, whole / MiB)

    m = fxmem.optimize(model, floor * 1.05 / 2**30, **options)
    train_step(m, kwargs)  # plans and compiles
    zero_grads(model)
    got = fxmem.measure(train_step, m, kwargs)
    assert got.peak_bytes <= m.plan.budget_bytes, (got.peak_bytes / MiB, m.plan.budget_bytes / MiB)
    assert max_rel_err(grads_of(model), ref) < 1e-4

"""Hugging Face architectures, built from small configs, through `fxmem.optimize` as users call it.

    python benchmarks/hf_zoo.py [--models gpt2,llama,...] [--compiler eager|inductor]
        [--budget 0.5|floor] [--keep-outputs true|false] [--hold-outputs] [--padded]
        [--attention eager|sdpa]

Each model is built with transformers' defaults (its default attention implementation, its
own loss from `labels`), dropout off so that eager and fxmem compute the same thing, and one
step is measured eagerly, then under `fxmem.optimize` at a fraction of eager's measured peak or
at fxmem's floor (read from the BudgetError of an impossible budget). Per model: eager's peak,
the budget, the measured and predicted peaks, whether the budget held (a BudgetError at a
fraction is reported as such: the floor is above it), the gradients' relative error against
eager's (all parameters together) and, under inductor, plain `torch.compile`'s beside it, the
passes that fired, and the first call's seconds (planning and compilation). The step keeps
only the loss; fxmem plans with `keep_outputs` as given (default true, as `fxmem.optimize`:
the returned logits counted through the backward). With `--hold-outputs` the measured steps,
eager's and fxmem's, hold what the model returns until the backward has run: the step a
`keep_outputs=True` plan is made for, which it measures at its prediction. Language models train on 8 x 512 tokens of a 512-word vocabulary
(with `--padded`, the last four sequences left-padded by 64 tokens in their attention mask),
vision models on 32 images of 128 px. Needs transformers. Exit status 1 when a budget that was
accepted did not hold, gradients differ by more than 1e-4 (under inductor: and by more than
ten times plain torch.compile's own difference, as batch norm's ill-conditioned gradients do),
or a model failed otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import fxmem  # noqa: E402
from benchmarks._harness import (  # noqa: E402
    compiled_err,
    eager_at,
    floor_of,
    free_memory,
    fxmem_at,
    holding_step,
    train_step,
)
from benchmarks._records import MiB, machine_line  # noqa: E402

__all__ = ["main"]

GRAD_TOL = 1e-4
GRAD_FACTOR = 10  # under inductor, times plain torch.compile's own gradient difference
VOCAB, BATCH, SEQ = 512, 8, 512
_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)  # every transformer's
# Dropout off: BERT-style configs name it one way, GPT-NeoX/BLOOM/Falcon-style ones another.
_NO_DROPOUT = dict(hidden_dropout_prob=0, attention_probs_dropout_prob=0)
_NO_DROPOUT_NEOX = dict(hidden_dropout=0, attention_dropout=0)
_DECODER = dict(
    _SHAPE,
    vocab_size=VOCAB,
    intermediate_size=128,
    max_position_embeddings=SEQ,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
_GQA = dict(_DECODER, num_key_value_heads=2)  # two key-value heads for four query heads


def _tokens(padded: bool = False) -> dict[str, torch.Tensor]:
    """With `padded`, an attention mask that pads the second half of the batch on the left by an
    eighth of the sequence: under a causal mask those rows attend to nothing. Every token keeps
    its label, so what those rows compute reaches the loss."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    batch = {"input_ids": ids, "labels": ids}
    if padded:
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[BATCH // 2 :, : SEQ // 8] = 0
        batch["attention_mask"] = mask
    return batch


def _images() -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(32, 3, 128, 128), "labels": torch.randint(0, 10, (32,))}


def _models(
    padded: bool = False, attention: str | None = None
) -> dict[str, Callable[[], tuple[torch.nn.Module, dict[str, torch.Tensor]]]]:
    """`attention`: the language models' `attn_implementation` (None: transformers' default)."""
    import transformers as T

    def lm(cls: Any, cfg: Any) -> Callable[[], tuple[torch.nn.Module, dict[str, torch.Tensor]]]:
        kw = {} if attention is None else {"attn_implementation": attention}
        return lambda: (cls._from_config(cfg, **kw), _tokens(padded))

    def vision(cls: Any, cfg: Any) -> Callable[[], tuple[torch.nn.Module, dict[str, torch.Tensor]]]:
        return lambda: (cls._from_config(cfg), _images())

    return {
        "gpt2": lm(
            T.GPT2LMHeadModel,
            T.GPT2Config(
                vocab_size=VOCAB,
                n_positions=SEQ,
                n_embd=64,
                n_layer=2,
                n_head=4,
                resid_pdrop=0,
                embd_pdrop=0,
                attn_pdrop=0,
            ),
        ),
        "llama": lm(T.LlamaForCausalLM, T.LlamaConfig(**_GQA)),
        "mistral": lm(T.MistralForCausalLM, T.MistralConfig(**_GQA)),
        "qwen2": lm(T.Qwen2ForCausalLM, T.Qwen2Config(**_GQA)),
        "qwen3": lm(T.Qwen3ForCausalLM, T.Qwen3Config(**_GQA, head_dim=16)),
        "gemma": lm(T.GemmaForCausalLM, T.GemmaConfig(**_GQA, head_dim=16)),
        "phi3": lm(T.Phi3ForCausalLM, T.Phi3Config(**_GQA)),
        "gpt-neox": lm(T.GPTNeoXForCausalLM, T.GPTNeoXConfig(**_DECODER, **_NO_DROPOUT_NEOX)),
        "opt": lm(
            T.OPTForCausalLM,
            T.OPTConfig(
                **_SHAPE,
                vocab_size=VOCAB,
                ffn_dim=128,
                max_position_embeddings=SEQ,
                dropout=0,
                attention_dropout=0,
                word_embed_proj_dim=64,
            ),
        ),
        "bert": lm(T.BertForMaskedLM, T.BertConfig(**_DECODER, **_NO_DROPOUT)),
        "t5": lm(
            T.T5ForConditionalGeneration,
            T.T5Config(
                vocab_size=VOCAB,
                d_model=64,
                d_kv=16,
                d_ff=128,
                num_layers=2,
                num_heads=4,
                dropout_rate=0,
                decoder_start_token_id=0,
            ),
        ),
        "vit": vision(
            T.ViTForImageClassification,
            T.ViTConfig(
                **_SHAPE,
                intermediate_size=128,
                image_size=128,
                patch_size=8,
                num_labels=10,
                **_NO_DROPOUT,
            ),
        ),
        "resnet": vision(
            T.ResNetForImageClassification,
            T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1], num_labels=10),
        ),
        "convnext": vision(
            T.ConvNextForImageClassification,
            T.ConvNextConfig(hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1], num_labels=10),
        ),
        **_more_models(T, lm, vision),
    }


def _more_models(T: Any, lm: Callable, vision: Callable) -> dict[str, Callable]:
    """Nineteen more: vision transformers and CNNs of other kinds, encoders, decoders with ALiBi,
    parallel attention, rotary embeddings, a mixture of experts, heads that scale, cap or bias
    their logits."""
    stages = dict(hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1], num_labels=10)
    vit = dict(
        _SHAPE,
        image_size=128,
        patch_size=8,
        num_labels=10,
        **_NO_DROPOUT,
    )
    neox_style = dict(_NO_DROPOUT_NEOX, vocab_size=VOCAB, hidden_size=64, bos_token_id=0, eos_token_id=0)
    return {
        "swin": vision(
            T.SwinForImageClassification,
            T.SwinConfig(
                image_size=128,
                patch_size=4,
                embed_dim=16,
                depths=[1, 1, 1, 1],
                num_heads=[1, 2, 4, 4],
                window_size=4,
                num_labels=10,
                **_NO_DROPOUT,
                drop_path_rate=0,
            ),
        ),
        "deit": vision(T.DeiTForImageClassification, T.DeiTConfig(**vit, intermediate_size=128)),
        "beit": vision(
            T.BeitForImageClassification,
            T.BeitConfig(**vit, intermediate_size=128, use_relative_position_bias=True, drop_path_rate=0),
        ),
        "dinov2": vision(T.Dinov2ForImageClassification, T.Dinov2Config(**vit)),
        "segformer": vision(
            T.SegformerForImageClassification,
            T.SegformerConfig(
                **stages,
                **_NO_DROPOUT,
                classifier_dropout_prob=0,
                drop_path_rate=0,
            ),
        ),
        "convnextv2": vision(T.ConvNextV2ForImageClassification, T.ConvNextV2Config(**stages)),
        "poolformer": vision(T.PoolFormerForImageClassification, T.PoolFormerConfig(**stages, drop_path_rate=0)),
        "regnet": vision(T.RegNetForImageClassification, T.RegNetConfig(**stages, embedding_size=16, groups_width=8)),
        "mobilenetv2": vision(
            T.MobileNetV2ForImageClassification,
            T.MobileNetV2Config(image_size=128, depth_multiplier=0.35, num_labels=10, classifier_dropout_prob=0),
        ),
        "mobilevit": vision(
            T.MobileViTForImageClassification,
            T.MobileViTConfig(
                image_size=128,
                hidden_sizes=[32, 48, 64],
                neck_hidden_sizes=[8, 16, 24, 32, 40, 48, 160],
                num_labels=10,
                **_NO_DROPOUT,
                classifier_dropout_prob=0,
            ),
        ),
        "roberta": lm(
            T.RobertaForMaskedLM,
            T.RobertaConfig(**dict(_DECODER, max_position_embeddings=SEQ + 2), **_NO_DROPOUT),
        ),
        "bloom": lm(T.BloomForCausalLM, T.BloomConfig(**neox_style, n_layer=2, n_head=4)),
        "falcon": lm(T.FalconForCausalLM, T.FalconConfig(**neox_style, num_hidden_layers=2, num_attention_heads=4)),
        "gptj": lm(
            T.GPTJForCausalLM,
            T.GPTJConfig(
                vocab_size=VOCAB,
                n_positions=SEQ,
                n_embd=64,
                n_layer=2,
                n_head=4,
                rotary_dim=8,
                resid_pdrop=0,
                embd_pdrop=0,
                attn_pdrop=0,
                bos_token_id=0,
                eos_token_id=0,
            ),
        ),
        "mixtral": lm(
            T.MixtralForCausalLM,
            T.MixtralConfig(**_DECODER, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        ),
        # logits times 0.0625; divided by 8; capped softly (and the attention's scores too)
        "cohere": lm(T.CohereForCausalLM, T.CohereConfig(**_GQA)),
        "granite": lm(T.GraniteForCausalLM, T.GraniteConfig(**_GQA, logits_scaling=8.0)),
        "gemma2": lm(T.Gemma2ForCausalLM, T.Gemma2Config(**_GQA, head_dim=16, sliding_window=128)),
        "bart": lm(  # a bias buffer added to the logits
            T.BartForConditionalGeneration,
            T.BartConfig(
                vocab_size=VOCAB,
                d_model=64,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=128,
                decoder_ffn_dim=128,
                max_position_embeddings=SEQ,
                dropout=0,
                attention_dropout=0,
                activation_dropout=0,
                pad_token_id=0,
                bos_token_id=0,
                eos_token_id=0,
                decoder_start_token_id=0,
            ),
        ),
    }


def run(name: str, build: Callable, compiler: str, budget: str, keep_outputs: bool = True, hold: bool = False) -> dict:
    """One model; its buffers (batch norm's statistics) are put back before every step. What
    an earlier model left to the cycle collector is collected first, so that no measurement
    counts it."""
    free_memory("cpu")
    torch.manual_seed(0)
    model, batch = build()
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    step = holding_step if hold else train_step
    eager, ref = eager_at(model, batch, state, step)
    row: dict[str, Any] = {"model": name, "eager": eager.peak_bytes}
    row["compiled_err"] = compiled_err(model, batch, state, ref) if compiler == "inductor" else None
    if budget == "floor":
        budget_bytes, why = floor_of(model, batch, None, compiler=compiler, keep_outputs=keep_outputs)
        if budget_bytes is None:
            return {**row, "error": why}
        model.load_state_dict(state)
    else:
        budget_bytes = int(float(budget) * eager.peak_bytes)
    row["budget"] = budget_bytes
    try:
        module, first_s, grad_err, got = fxmem_at(model, batch, state, budget_bytes, compiler, ref, keep_outputs, step)
    except fxmem.BudgetError as e:
        return {**row, "refused": e.floor_bytes}
    plan = module.plan
    fired = ", ".join(f"{k} x{v}" for k, v in plan.rewrites.items() if v)
    return {
        **row,
        "first_s": first_s,
        "grad_err": grad_err,
        "measured": got.peak_bytes,
        "predicted": plan.predicted_peak_bytes,
        "fired": fired,
    }


def _line(r: dict) -> str:
    head = f"| {r['model']} | {r['eager'] / MiB:.2f} | "
    if "error" in r:
        return head + f"— | — | — | | {r['error']} | | | |"
    if "refused" in r:
        return head + f"{r['budget'] / MiB:.2f} | — | — | refused: floor {r['refused'] / MiB:.2f} | | | | |"
    held = "yes" if r["measured"] <= r["budget"] else "**no**"
    return head + (
        f"{r['budget'] / MiB:.2f} | {r['measured'] / MiB:.2f} | {r['predicted'] / MiB:.2f} | {held} | "
        f"{r['grad_err']:.1e} | {_err(r['compiled_err'])} | {r['fired'] or '—'} | {r['first_s']:.1f} |"
    )


def _err(err: float | None) -> str:
    return "—" if err is None else f"{err:.1e}"


def _allowed_err(row: dict) -> float:
    """How far fxmem's gradients may be from eager's: GRAD_TOL, or under inductor GRAD_FACTOR
    times plain torch.compile's own distance, whichever is larger."""
    return max(GRAD_TOL, GRAD_FACTOR * (row["compiled_err"] or 0.0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="")
    ap.add_argument("--compiler", default="eager", choices=["eager", "inductor"])
    ap.add_argument("--budget", default="0.5", help="a fraction of eager's measured peak, or 'floor'")
    ap.add_argument(
        "--keep-outputs",
        default="true",
        choices=["true", "false"],
        help="fxmem.optimize's keep_outputs (false: plan for this step, which keeps only the loss)",
    )
    ap.add_argument(
        "--hold-outputs",
        action="store_true",
        help="measure steps that hold what the model returns through the backward (needs --keep-outputs true)",
    )
    ap.add_argument(
        "--padded",
        action="store_true",
        help="language models get an attention mask padding half the batch on the left (see _tokens)",
    )
    ap.add_argument(
        "--attention",
        default=None,
        choices=["eager", "sdpa"],
        help="the language models' attn_implementation (default: transformers' own)",
    )
    args = ap.parse_args(argv)
    if args.hold_outputs and args.keep_outputs == "false":
        ap.error("--hold-outputs measures the step keep_outputs=True plans for; drop --keep-outputs false")
    if args.budget != "floor":
        try:
            if not 0 < float(args.budget) <= 1:
                raise ValueError
        except ValueError:
            ap.error(f"--budget must be a fraction in (0, 1] or 'floor', got {args.budget!r}")
    models = _models(args.padded, args.attention)
    names = [m for m in args.models.split(",") if m] or list(models)
    unknown = sorted(set(names) - set(models))
    if unknown:
        ap.error(f"unknown model(s) {unknown}; available: {sorted(models)}")
    keep = args.keep_outputs == "true"
    print(
        f"# HF architectures, compiler={args.compiler}, budget {args.budget}, keep_outputs={keep}"
        f"{', outputs held through the backward' if args.hold_outputs else ''}"
        f"{', half the batch left-padded' if args.padded else ''}"
        f"{f', attn_implementation={args.attention!r}' if args.attention else ''}\n\n"
        f"{machine_line('cpu')}\n"
    )
    print(
        "| model | eager MiB | budget MiB | measured MiB | predicted MiB | held | grad rel err "
        "| torch.compile's | passes fired | first call s |"
    )
    print("|---|---:|---:|---:|---:|:-:|---:|---:|---|---:|")
    failed = 0
    for name in names:
        try:
            r = run(name, models[name], args.compiler, args.budget, keep, args.hold_outputs)
        except Exception as e:  # noqa: BLE001 -- a model that fails is a row of the table
            r = {"model": name, "eager": 0, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        print(_line(r), flush=True)
        failed += "error" in r or ("measured" in r and (r["measured"] > r["budget"] or r["grad_err"] > _allowed_err(r)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

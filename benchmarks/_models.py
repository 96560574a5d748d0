"""The benchmarked models: one small registry entry each.

An entry says how to build the model and one batch at a size (CPU, GPU, quick), and how to
turn on checkpointing of every block the way its users would (`torch.utils.checkpoint` around
each block for our own models, `gradient_checkpointing_enable()` for Hugging Face ones).
Nothing is downloaded: Hugging Face models are built from configs with random weights.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint

from fxmem.testing import GPT, GPTConfig, ViT, ViTConfig, gpt_batch, vit_batch

__all__ = ["MODELS", "ModelSpec", "Size"]

Batch = tuple[torch.Tensor, ...] | dict[str, torch.Tensor]


@dataclass(frozen=True)
class Size:
    """One size of a model: what to build and the batch it trains on."""

    label: str  # shown in the report, e.g. "4 layers, d192, batch 4 x 256"
    build: Callable[[], tuple[nn.Module, Batch]]  # seeded by the caller


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    checkpoint: Callable[[nn.Module], None]  # turn on per-block checkpointing in place
    sizes: dict[str, Size]  # "cpu", "cuda", "quick" (missing: not run on that device)
    random_ops: bool = False  # dropout: gradients compare within one RNG stream only
    remat_only: bool = True  # also measure fxmem with passes=() (the passes' effect)
    sliced: bool = True  # also fxmem with compiler="eager" + microbatch_blocks at its floor


def _checkpoint_blocks(blocks_of: Callable[[nn.Module], list[nn.Module]]) -> Callable[[nn.Module], None]:
    """torch.utils.checkpoint (non-reentrant) around the forward of every block."""

    def enable(model: nn.Module) -> None:
        for block in blocks_of(model):
            plain = type(block).forward

            def forward(self, *args: Any, _plain=plain, **kwargs: Any) -> Any:
                return torch.utils.checkpoint.checkpoint(_plain, self, *args, use_reentrant=False, **kwargs)

            block.forward = types.MethodType(forward, block)

    return enable


def _hf_checkpoint(model: nn.Module) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


# -- our GPT (hand-written attention: the T x T weights are materialised) -------------------------
def _gpt(cfg: GPTConfig, batch: int, seq: int) -> Size:
    label = (
        f"{cfg.n_layer} layers, {cfg.n_head} heads, d{cfg.n_embd}, vocab {cfg.vocab_size}, "
        f"dropout {cfg.dropout}; batch {batch} x {seq} tokens, fp32"
    )
    return Size(label, lambda: (GPT(cfg), gpt_batch(cfg, batch, seq)))


_GPT_CPU = GPTConfig(vocab_size=8192, block_size=384, n_layer=4, n_head=4, n_embd=192)
_GPT_QUICK = GPTConfig(vocab_size=2048, block_size=128, n_layer=2, n_head=4, n_embd=128)
_GPT_CUDA = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)  # GPT-2 small shape


def _with_dropout(cfg: GPTConfig, p: float = 0.1) -> GPTConfig:
    return GPTConfig(cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd, dropout=p)


# -- ViT (timm-style: attention already goes through F.scaled_dot_product_attention) -------------
def _vit(cfg: ViTConfig, batch: int) -> Size:
    label = (
        f"{cfg.n_layer} layers, {cfg.n_head} heads, d{cfg.n_embd}, {cfg.image_size}px / patch {cfg.patch_size}, "
        f"{cfg.classes} classes; batch {batch}, fp32"
    )
    return Size(label, lambda: (ViT(cfg), vit_batch(cfg, batch)))


# -- Hugging Face models from configs --------------------------------------------------------------
def _hf_batch(vocab: int, batch: int, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _gpt2(n_layer: int, n_embd: int, n_head: int, vocab: int, batch: int, seq: int) -> Size:
    def build() -> tuple[nn.Module, Batch]:
        import transformers

        cfg = transformers.GPT2Config(
            vocab_size=vocab, n_positions=seq, n_embd=n_embd, n_layer=n_layer, n_head=n_head, bos_token_id=0
        )
        model = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")
        # GPT2LMHeadModel's class name maps to no loss type, so `loss_function` logs a
        # warning_once on every call, where torch.compile breaks the graph (fxmem skips the call).
        # Naming the loss it falls back to anyway avoids the call: the torch.compile anchors
        # trace the whole step as one graph too.
        model.loss_type = "ForCausalLM"
        return model, _hf_batch(vocab, batch, seq)

    label = (
        f"GPT2LMHeadModel, eager attention, {n_layer} layers, d{n_embd}, vocab {vocab}, dropout 0.1 "
        f"(HF default); batch {batch} x {seq} tokens, fp32"
    )
    return Size(label, build)


def _llama(hidden: int, inter: int, n_layer: int, heads: int, kv: int, vocab: int, batch: int, seq: int) -> Size:
    def build() -> tuple[nn.Module, Batch]:
        import transformers

        cfg = transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=n_layer,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            max_position_embeddings=seq,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=None,
        )
        return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager"), _hf_batch(
            vocab, batch, seq
        )

    n_params = n_layer * (4 * hidden * hidden * (heads + kv) // (2 * heads) + 3 * hidden * inter) + 2 * vocab * hidden
    label = (
        f"LlamaForCausalLM, eager attention, {n_layer} layers, d{hidden}, ffn {inter}, {heads} heads / {kv} kv, "
        f"vocab {vocab} (~{n_params / 1e9:.1f}B params); batch {batch} x {seq} tokens, fp32"
    )
    return Size(label, build)


def _blocks(attr: str) -> Callable[[nn.Module], list[nn.Module]]:
    return lambda model: list(functools.reduce(getattr, attr.split("."), model))


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            "gpt",
            "nanoGPT-style GPT with hand-written attention (fxmem.testing.GPT)",
            _checkpoint_blocks(_blocks("h")),
            {
                "cpu": _gpt(_GPT_CPU, 4, 384),
                "quick": _gpt(_GPT_QUICK, 2, 128),
                "cuda": _gpt(_GPT_CUDA, 8, 1024),
            },
            # Its blocks over 4 slices measured 43.2 MiB at the floor against 44.3 whole
            # (2026-11-25 run): not worth a minute of every run.
            sliced=False,
        ),
        ModelSpec(
            "gpt-dropout",
            "the same GPT with dropout 0.1 on embeddings, attention weights and residuals",
            _checkpoint_blocks(_blocks("h")),
            {
                # two layers on CPU: the run stays within 15 minutes, compilation being most of it
                "cpu": _gpt(_with_dropout(dataclasses.replace(_GPT_CPU, n_layer=2)), 4, 384),
                "quick": _gpt(_with_dropout(_GPT_QUICK), 2, 128),
                "cuda": _gpt(_with_dropout(_GPT_CUDA), 8, 1024),
            },
            random_ops=True,
            remat_only=False,  # the passes' effect is measured on the gpt model
        ),
        ModelSpec(
            "vit",
            "ViT-style classifier, timm-like, attention through F.scaled_dot_product_attention (fxmem.testing.ViT)",
            _checkpoint_blocks(_blocks("blocks")),
            {
                "cpu": _vit(ViTConfig(image_size=64, patch_size=8, n_layer=4, n_head=3, n_embd=192), 48),
                "quick": _vit(ViTConfig(image_size=32, patch_size=8, n_layer=2, n_head=2, n_embd=64), 16),
                "cuda": _vit(
                    ViTConfig(image_size=224, patch_size=16, n_layer=12, n_head=12, n_embd=768, classes=1000), 64
                ),  # ViT-B/16
            },
        ),
        ModelSpec(
            "hf-gpt2",
            "Hugging Face GPT-2 small (124M) from its config, eager attention",
            _hf_checkpoint,
            {"cuda": _gpt2(12, 768, 12, 50257, 8, 1024)},
            random_ops=True,
        ),
        ModelSpec(
            "hf-llama-1b",
            "Llama-style ~1B (TinyLlama-1.1B shape) from a LlamaConfig, eager attention",
            _hf_checkpoint,
            {"cuda": _llama(2048, 5632, 22, 32, 4, 32000, 2, 1024)},
        ),
    ]
}

DEFAULT_MODELS = {
    "cpu": ["gpt", "gpt-dropout", "vit"],
    "cuda": ["gpt", "gpt-dropout", "vit", "hf-gpt2", "hf-llama-1b"],
}

"""Factories for `fxmem` CLI tests: each returns (model, example_inputs), small and quick."""

from __future__ import annotations

import torch

from fxmem.testing import GPT, ConvNet, GPTConfig, gpt_batch

TINY_GPT = GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=2, n_embd=32)


def tiny_gpt():
    torch.manual_seed(0)
    return GPT(TINY_GPT), gpt_batch(TINY_GPT, 2, 64)


def tiny_gpt_kwargs():
    model, (idx, targets) = tiny_gpt()
    return model, {"idx": idx, "targets": targets}


def convnet():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    return ConvNet(channels=16, blocks=2), (
        torch.randn(4, 3, 32, 32, generator=g),
        torch.randint(0, 10, (4,), generator=g),
    )


def not_a_pair():
    return torch.nn.Linear(2, 2)


def raises():
    raise RuntimeError("the dataset is missing")


NOT_CALLABLE = 3


def hf_gpt2(**inputs):
    """HF GPT-2 from a config (transformers, a test extra), with `inputs` added to its call."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 128, (2, 32))
    return GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids, **inputs}


def hf_gpt2_cached():
    return hf_gpt2()


def hf_gpt2_uncached():
    return hf_gpt2(use_cache=False)


class _PrintsInForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 1)

    def forward(self, x):
        h = self.a(x)
        print("a graph break")
        return self.b(h).mean()


def graph_break():
    return _PrintsInForward(), (torch.randn(4, 16),)


def frozen_linear():
    return torch.nn.Linear(4, 4).requires_grad_(False), (torch.randn(2, 4),)

"""Small real models for fxmem's tests, examples and benchmarks.

`GPT` is nanoGPT-shaped with hand-written attention (the T x T weights are materialised, as
in most research code). `ConvNet` is a ResNet-style CNN with BatchNorm. `ViT` is a reduced
timm-style vision transformer whose attention already calls `F.scaled_dot_product_attention`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ConvNet", "GPT", "GPTConfig", "UNet", "ViT", "ViTConfig", "gpt_batch", "vit_batch"]


@dataclass
class GPTConfig:
    vocab_size: int = 8192
    block_size: int = 512
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head = cfg.n_head
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size))
        self.register_buffer("bias", mask.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt_batch(cfg: GPTConfig, batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    return idx, targets


class ConvNet(nn.Module):
    """ResNet-style: conv-BN-ReLU stem, residual blocks, pooled linear head."""

    def __init__(self, channels: int = 32, blocks: int = 3, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(channels, channels, 3, padding=1),
                nn.BatchNorm2d(channels),
                nn.ReLU(),
                nn.Conv2d(channels, channels, 3, padding=1),
                nn.BatchNorm2d(channels),
            )
            for _ in range(blocks)
        )
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = F.relu(x + block(x))
        return F.cross_entropy(self.head(x.mean((2, 3))), y)


class UNet(nn.Module):
    """Encoder-decoder: GroupNorm, a strided and a transposed convolution, upsampling, a skip;
    the loss is the mean squared error against a target image."""

    def __init__(self):
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.SiLU())
        self.down2 = nn.Sequential(nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.GroupNorm(8, 64), nn.SiLU())
        self.up = nn.ConvTranspose2d(64, 32, 2, stride=2)
        self.out = nn.Conv2d(64, 3, 3, padding=1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        a = self.down1(x)
        b = self.down2(a)
        up = self.up(b) + F.interpolate(b, scale_factor=2, mode="nearest")[:, :32]
        return F.mse_loss(self.out(torch.cat([a, up], 1)), target)


@dataclass
class ViTConfig:
    image_size: int = 64
    patch_size: int = 8
    channels: int = 3
    n_layer: int = 4
    n_head: int = 3
    n_embd: int = 192
    mlp_ratio: int = 4
    classes: int = 100
    dropout: float = 0.0


class ViTBlock(nn.Module):
    """Pre-LN transformer block as timm's ViT writes it: fused qkv, `F.scaled_dot_product_attention`."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.norm1 = nn.LayerNorm(cfg.n_embd, eps=1e-6)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.norm2 = nn.LayerNorm(cfg.n_embd, eps=1e-6)
        self.fc1 = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(self.norm1(x)).view(B, N, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, nh, N, hs)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p).transpose(1, 2).reshape(B, N, C)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm2(x)))))


class ViT(nn.Module):
    """ViT-style classifier (timm's VisionTransformer, reduced): patch conv, class token, blocks.

    `forward(images, labels)` returns the cross-entropy loss of the class-token head.
    """

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.cfg = cfg
        n_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.patch_embed = nn.Conv2d(cfg.channels, cfg.n_embd, cfg.patch_size, stride=cfg.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.n_embd))
        self.pos_embed = nn.Parameter(torch.randn(1, n_patches + 1, cfg.n_embd) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.n_embd, eps=1e-6)
        self.head = nn.Linear(cfg.n_embd, cfg.classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, N, C)
        x = torch.cat([self.cls_token.expand(x.size(0), -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)[:, 0]), labels)


def vit_batch(cfg: ViTConfig, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, cfg.channels, cfg.image_size, cfg.image_size, generator=g)
    labels = torch.randint(0, cfg.classes, (batch,), generator=g)
    return images, labels

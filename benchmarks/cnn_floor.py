"""Convolutional networks at fxmem's floor, under each compiler: does the measured peak hold?

    python benchmarks/cnn_floor.py [--models convnet,hf-resnet,hf-convnext,hf-regnet,hf-mobilenetv2,silu-stack,unet] [--compilers eager,inductor]

The smallest budget fxmem plans a CNN's step for is where its memory model is tested hardest:
nothing is left over between the plan's predicted peak and the budget but the head-room every
plan keeps (3% and 2 MiB). Per model and compiler, on CPU: eager's measured peak, the floor
(read from the BudgetError of an impossible budget), the peak `fxmem.measure` reads of a step
planned at that floor, the plan's prediction, whether the budget held, and the gradients'
relative error against fp64's (all parameters together), fxmem's beside eager's own and, under
inductor, plain `torch.compile`'s (batch-norm gradients are ill-conditioned in fp32). The models:

- convnet: fxmem.testing.ConvNet (conv-BN-ReLU stem, residual blocks), 32 channels, 2 blocks,
  16 images of 64 px;
- hf-resnet: transformers' ResNetForImageClassification from a config (a 7x7 stem, max pooling,
  4 stages of depth 1, 16 to 64 channels), 32 images of 128 px (needs transformers);
- hf-convnext: transformers' ConvNextForImageClassification from a config (4 stages of depth 1,
  16 to 64 channels: depthwise 7x7 convolutions, LayerNorm and the MLP over (N, H, W, C)
  values between them), 32 images of 128 px (needs transformers);
- hf-regnet: transformers' RegNetForImageClassification from a config (RegNetY: grouped
  convolutions, squeeze-and-excitation; 4 stages of depth 1, 16 to 64 channels), 32 images of
  128 px (needs transformers);
- hf-mobilenetv2: transformers' MobileNetV2ForImageClassification from a config (width 0.35:
  inverted residual blocks of depthwise convolutions over TensorFlow-style padded inputs, batch
  norm and ReLU6), 16 images of 96 px (needs transformers);
- silu-stack: residual conv-BN-SiLU blocks (3x3 convolutions without bias, as RegNet's and
  MobileViT's convolutional stages have): a stem and 3 blocks of 32 channels, 16 images of
  64 px;
- unet: a small encoder-decoder with GroupNorm, a strided convolution, a transposed
  convolution, nearest upsampling and a skip concatenation, 8 images of 96 px.

Prints a Markdown table; exit status 1 when a budget did not hold or fxmem's gradients are
more than ten times further from fp64's than eager's are (under inductor: than eager's or plain
torch.compile's, whichever is further).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Callable

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._harness import (  # noqa: E402
    compiled_err,
    eager_at,
    floor_of,
    fxmem_at,
    grads_of,
    overall_rel_err,
    train_step,
)
from benchmarks._models import Batch  # noqa: E402
from benchmarks._records import MiB, machine_line  # noqa: E402
from fxmem.testing import ConvNet, UNet  # noqa: E402

__all__ = ["main", "mobilenetv2"]

GRAD_FACTOR = 10  # fxmem's gradient error against fp64's, at most this many times eager's


class _HFVision(nn.Module):
    """A transformers image classifier built from its config, called as (pixels, labels) -> loss."""

    def __init__(self, kind: str, **config):
        super().__init__()
        import transformers

        cfg = getattr(transformers, f"{kind}Config")(num_labels=10, **config)
        self.net = getattr(transformers, f"{kind}ForImageClassification")._from_config(cfg)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.net(pixel_values=pixels, labels=labels).loss


def _images(n: int = 32, px: int = 128) -> Batch:
    return torch.randn(n, 3, px, px), torch.randint(0, 10, (n,))


class _SiLUStack(nn.Module):
    """Residual conv-BN-SiLU blocks; the loss is a linear head's over the pooled features."""

    def __init__(self, channels: int = 32, blocks: int = 3, classes: int = 10):
        super().__init__()

        def block(cin: int) -> nn.Module:
            conv = nn.Conv2d(cin, channels, 3, padding=1, bias=False)
            return nn.Sequential(conv, nn.BatchNorm2d(channels), nn.SiLU())

        self.stem = block(3)
        self.blocks = nn.ModuleList(block(channels) for _ in range(blocks))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = x + b(x)
        return F.cross_entropy(self.head(x.mean((2, 3))), labels)


def mobilenetv2(blocks: int = 16) -> tuple[nn.Module, Batch]:
    """hf-mobilenetv2 with the first `blocks` of its 16 inverted residual blocks; its last 1x1
    convolution reads the last block kept."""
    model = _HFVision("MobileNetV2", image_size=96, depth_multiplier=0.35, classifier_dropout_prob=0.0)
    body = model.net.mobilenet_v2
    if blocks < len(body.layer):
        body.layer = body.layer[:blocks]
        last = body.conv_1x1
        body.conv_1x1 = type(last)(
            model.net.config,
            in_channels=body.layer[-1].reduce_1x1.convolution.out_channels,
            out_channels=last.convolution.out_channels,
            kernel_size=1,
        )
    return model, _images(16, 96)


_STAGES = {"hidden_sizes": [16, 32, 64, 64], "depths": [1, 1, 1, 1]}


MODELS: dict[str, Callable[[], tuple[nn.Module, Batch]]] = {
    "convnet": lambda: (
        ConvNet(channels=32, blocks=2),
        (torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))),
    ),
    "hf-resnet": lambda: (_HFVision("ResNet", embedding_size=16, **_STAGES), _images()),
    "hf-convnext": lambda: (_HFVision("ConvNext", **_STAGES), _images()),
    "hf-regnet": lambda: (_HFVision("RegNet", embedding_size=16, groups_width=8, **_STAGES), _images()),
    "hf-mobilenetv2": mobilenetv2,
    "silu-stack": lambda: (_SiLUStack(), (torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,)))),
    "unet": lambda: (UNet(), (torch.randn(8, 3, 96, 96), torch.randn(8, 3, 96, 96))),
}


def run(name: str, compiler: str) -> dict:
    """One model under one compiler at its floor; the model's buffers (batch norm's running
    statistics) are put back before every step, so each starts from the same state."""
    torch.manual_seed(0)
    model, batch = MODELS[name]()
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    wide = copy.deepcopy(model).double()
    train_step(wide, tuple(t.double() if t.is_floating_point() else t for t in batch))
    ref64 = {k: g.float() for k, g in grads_of(wide).items()}
    del wide
    eager, eager_grads = eager_at(model, batch, state)
    eager_err = overall_rel_err(eager_grads, ref64)
    del eager_grads  # not alive while fxmem plans and is measured
    floor, why = floor_of(model, batch, None, compiler=compiler)
    row = {"model": name, "compiler": compiler, "eager": eager.peak_bytes, "floor": floor, "why": why}
    row["eager_err"] = eager_err
    row["compiled_err"] = compiled_err(model, batch, state, ref64) if compiler == "inductor" else None
    if floor is None:
        return row
    model.load_state_dict(state)
    module, _, grad_err, got = fxmem_at(model, batch, state, floor, compiler, ref64)
    row.update(grad_err=grad_err, measured=got.peak_bytes, predicted=module.plan.predicted_peak_bytes)
    return row


def _allowed_err(row: dict) -> float:
    """fxmem's gradients may be GRAD_FACTOR times further from fp64's than eager's are, or than
    plain torch.compile's under inductor."""
    return GRAD_FACTOR * max(row["eager_err"], row["compiled_err"] or 0.0) + 1e-6


def _table(rows: list[dict]) -> str:
    lines = [
        "| model | compiler | eager MiB | floor (budget) MiB | measured MiB | predicted MiB | held "
        "| grad err vs fp64: fxmem | eager | torch.compile |",
        "|---|---|---:|---:|---:|---:|:-:|---:|---:|---:|",
    ]
    for r in rows:
        if r.get("measured") is None:
            lines.append(f"| {r['model']} | {r['compiler']} | {r['eager'] / MiB:.2f} | — | — | — | | {r['why']} | | |")
            continue
        compiled = "—" if r["compiled_err"] is None else f"{r['compiled_err']:.1e}"
        held = "yes" if r["measured"] <= r["floor"] else "**no**"
        lines.append(
            f"| {r['model']} | {r['compiler']} | {r['eager'] / MiB:.2f} | {r['floor'] / MiB:.2f} | "
            f"{r['measured'] / MiB:.2f} | {r['predicted'] / MiB:.2f} | {held} | {r['grad_err']:.1e} | {r['eager_err']:.1e} | {compiled} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--compilers", default="eager,inductor")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    compilers = [c for c in args.compilers.split(",") if c]
    unknown = sorted(set(models) - set(MODELS)) + sorted(set(compilers) - {"eager", "inductor"})
    if unknown:
        ap.error(f"unknown model(s) or compiler(s): {unknown}")
    print(f"# CNNs at fxmem's floor\n\n{machine_line('cpu')}\n")
    rows = [run(m, c) for m in models for c in compilers]
    print(_table(rows))
    failed = [
        r for r in rows if r.get("measured") is None or r["measured"] > r["floor"] or r["grad_err"] > _allowed_err(r)
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

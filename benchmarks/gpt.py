"""The GPT benchmark alone: `benchmarks/run.py --models gpt`, with the same options.

    python benchmarks/gpt.py [--device cpu|cuda] [--quick] [--steps N] [--out-dir DIR]

Writes to benchmarks/results/gpt-<device>/ unless --out-dir says otherwise; everything else
lives in run.py and the harness.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run import main  # noqa: E402 - after the path entry that finds it

if __name__ == "__main__":
    argv = sys.argv[1:]
    if any(a == "--models" or a.startswith("--models=") for a in argv):
        sys.exit("gpt.py runs the gpt model only; use benchmarks/run.py --models ... for others")
    if not any(a == "--out-dir" or a.startswith("--out-dir=") for a in argv):
        device = next((argv[k + 1] for k, a in enumerate(argv[:-1]) if a == "--device"), "cpu")
        argv += ["--out-dir", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"gpt-{device}")]
    sys.exit(main(["--models", "gpt", *argv]))

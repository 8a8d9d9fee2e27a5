"""Whole-model benchmarks: `python benchmarks/bench_model.py [flags]`.

The train step and greedy decoding of the reference decoder, optionally
beside the same model in Hugging Face transformers (`--peer PYTHON`); see
`linen_moe_cli/bench_model.py` for what is measured and how.
"""

import sys

from linen_moe_cli.bench_model import main

if __name__ == "__main__":
  sys.exit(main())

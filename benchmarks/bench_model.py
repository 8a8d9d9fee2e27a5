"""Whole-model benchmarks: `python benchmarks/bench_model.py [flags]`.

The train step and greedy decoding of the reference decoder, optionally
beside the same model in Hugging Face transformers (`--peer PYTHON`); see
`linen_moe_cli/bench_model.py` for what is measured and how. With
LINEN_MOE_REUSE_HOST_MEMORY=1 it restarts itself first with host memory that
compiled programs reuse (`linen_moe_cli/host_memory.py`), and the peer runs
with the same.
"""

import sys

from linen_moe_cli import host_memory

if __name__ == "__main__":
  host_memory.reexec_with_reused_memory()
  from linen_moe_cli.bench_model import main  # noqa: PLC0415

  sys.exit(main())

"""Layer benchmarks: `python benchmarks/bench_moe.py [linen-moe bench flags]`.

Same as `linen-moe bench`; see `linen_moe_cli/bench.py` for what is measured.
"""

import sys

from linen_moe_cli.main import main

if __name__ == "__main__":
  sys.exit(main(["bench", *sys.argv[1:]]))

"""`linen-moe train` whose steps take at least a given time: for a stop that
comes from outside at a moment the test cannot choose (a Slurm time limit, a
requeue), so that it lands within a few dozen steps.

`python -m tests.cli_slurm_worker PAUSE_S train [train flags]` sleeps
PAUSE_S seconds before each step's data phase (the run's `Watchdog.phase`
hook, outside any watched phase), then runs the command as `linen-moe`
does and exits with its status. The pause changes no number the run
computes. The library reads nothing of it.
"""

from __future__ import annotations

import sys
import time
from unittest import mock

from linen_moe._src.run import watchdog
from linen_moe_cli import main as cli_main


def main(argv: list[str]) -> int:
  pause_s = float(argv[0])
  original = watchdog.Watchdog.phase

  def phase(watch, name, step):
    if name == "data":
      time.sleep(pause_s)
    return original(watch, name, step)

  with mock.patch.object(watchdog.Watchdog, "phase", phase):
    return cli_main.main(argv[1:])


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

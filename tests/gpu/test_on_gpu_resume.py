"""On the GPU: a checkpoint saved on the GPU resumes on the CPU to equal
losses, and one saved on the CPU resumes on the GPU.

One process, one machine (it has a CPU backend too): this process trains
tiny_mixtral (one layer) on the GPU, saves step `STOP` and trains on to
`STEPS`; a child process with JAX_PLATFORMS=cpu (tests/gpu_resume_worker)
restores step `STOP` (every leaf bit for bit what was saved), trains the
same steps on the CPU and saves step `MID`; this process restores that on
the GPU (bit for bit again) and trains `MID` .. `STEPS`. The three runs'
losses over the same steps agree to `RTOL` (the GPU and the CPU sum in
other orders; both at the highest matmul precision, no TF32), in both
front ends. The largest relative difference is recorded.

Skipped at collection without a GPU (tests/gpu_checks.py); rehearsed on a
CPU with LINEN_MOE_GPU_CHECKS_ON_CPU=1 (then both sides are the CPU).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from tests import gpu_checks

gpu_checks.skip_unless_asked()

from absl.testing import absltest  # noqa: E402
from absl.testing import parameterized  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from tests import gpu_resume_worker as worker  # noqa: E402

STOP, MID, STEPS = 2, 4, 6
RTOL = 1e-4
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _on_cpu(job: dict) -> dict:
  """Runs `job` in tests.gpu_resume_worker on the CPU; its JSON line."""
  path = [str(ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
  done = subprocess.run(
      [sys.executable, "-m", "tests.gpu_resume_worker", json.dumps(job)],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
      check=False,
  )
  if done.returncode:
    raise AssertionError(f"the CPU side failed:\n{done.stderr[-4000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


class ResumeOnGpuTest(parameterized.TestCase):

  @parameterized.named_parameters(("linen", "linen"), ("nnx", "nnx"))
  def test_on_gpu_checkpoint_resumes_on_cpu_and_back(self, frontend):
    quantization, path = "none", "sparse"
    folder = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, folder, ignore_errors=True)
    here, there = (pathlib.Path(folder, d) for d in ("gpu", "cpu"))
    run = worker.Run(frontend, quantization, path)
    _, losses = run.train(run.init(), 0, STEPS, here, STOP)
    cpu = _on_cpu({
        "frontend": frontend,
        "quantization": quantization,
        "path": path,
        "restore": str(here),
        "start": STOP,
        "save": str(there),
        "save_at": MID,
        "stop": STEPS,
    })
    state, back_equal = run.restore(there, MID)
    _, back = run.train(state, MID, STEPS)

    gpu_part = np.asarray(losses[STOP:])
    diff = lambda a, b: float(np.max(np.abs(np.asarray(a) / b - 1)))  # noqa: E731
    gpu_checks.record(
        "resume",
        frontend,
        {
            "backends": [jax.default_backend(), cpu["backend"]],
            "losses": losses,
            "cpu_losses": cpu["losses"],
            "back_losses": back,
            "cpu_vs_gpu": diff(cpu["losses"], gpu_part),
            "back_vs_gpu": diff(back, gpu_part[MID - STOP :]),
        },
    )
    self.assertEqual(cpu["backend"], "cpu")
    self.assertTrue(cpu["restored_equal"], "GPU -> CPU: the leaves differ")
    self.assertTrue(back_equal, "CPU -> GPU: the leaves differ")
    np.testing.assert_allclose(cpu["losses"], gpu_part, rtol=RTOL)
    np.testing.assert_allclose(back, gpu_part[MID - STOP :], rtol=RTOL)
    np.testing.assert_allclose(back, cpu["losses"][MID - STOP :], rtol=RTOL)
    self.assertLess(np.mean(losses[STOP:]), np.mean(losses[:STOP]), "trains")


if __name__ == "__main__":
  absltest.main()

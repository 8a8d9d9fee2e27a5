"""On the GPU: the tiny Hugging Face fixtures of all eight families give our
logits and transformers' on torch, on the same GPU.

One fixture per family (tests/fixtures/hf); transformers runs in a
process of its own (tests/gpu_torch_worker.py: torch and JAX each load
their own CUDA libraries), on the same GPU. float32 with TF32 off on both
sides (`torch.backends.cuda.matmul.allow_tf32 = False`, cuDNN's too;
`jax.default_matmul_precision("highest")`): our logits equal
transformers' to `ATOL` (the fixtures' own bound, ours on a CPU against
theirs on a CPU), and greedy decoding over the KV cache gives the tokens
transformers' `generate` gives. bfloat16 (both loaded in bf16): ours is
within bf16's tolerance of transformers' float32 logits, which is measured,
not guessed: in root mean square at most twice as far as transformers' own
bf16 logits are from its float32 ones, or 2^-7 of the logits' largest
magnitude (a near tie in the routing flips an expert in bf16 on either
side, moving one token's logits by far more than rounding: measured on
this CPU, ours in bf16 against the fixtures' float32 logits, largest
differences 0.02-0.45 on logits of magnitude 1.8-3.1). Each family's
largest differences and RMS are recorded.

Skipped at collection without a GPU (tests/gpu_checks.py); per test where
torch or transformers is not importable, where torch sees no GPU on a GPU
machine, or where transformers does not know the family. With
LINEN_MOE_GPU_CHECKS_ON_CPU=1 it rehearses on the CPU (torch on its CPU)
where both import.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from tests import gpu_checks

gpu_checks.skip_unless_asked()

from absl.testing import absltest  # noqa: E402
from absl.testing import parameterized  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from tests import hf_helpers  # noqa: E402

FAMILIES = {
    "mixtral": "mixtral_gqa_swa",
    "qwen3_moe": "qwen3_moe_dense0_norm",
    "deepseek_v3": "deepseek_v3_plain_nogroup",
    "gemma4_text": "gemma4_text_moe_keqv",
    "gpt_oss": "gpt_oss_sinks_swa_yarn",
    "glm4_moe": "glm4_moe_partial_qknorm_groups",
    "minimax_m2": "minimax_m2_partial_qknorm",
    "llama4_text": "llama4_text_nope_chunked",
}
ATOL = hf_helpers.ATOL
NEW_TOKENS = 8  # as tests.gpu_torch_worker
ROOT = pathlib.Path(__file__).resolve().parents[2]


@functools.cache
def _peer() -> tuple[pathlib.Path | None, dict]:
  """transformers' outputs of every fixture, computed once, in
  tests.gpu_torch_worker on this machine's GPU (its CPU in a rehearsal):
  (the folder of its FIXTURE.npz files, its report), or (None, why not)."""
  for module in ("torch", "transformers"):
    if importlib.util.find_spec(module) is None:
      return None, {"why": f"{module} is not importable here"}
  out = pathlib.Path(tempfile.mkdtemp(prefix="gpu_torch_"))
  path = [str(ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
  device = "cuda" if gpu_checks.ON_GPU else "cpu"
  done = subprocess.run(
      [
          sys.executable,
          "-m",
          "tests.gpu_torch_worker",
          str(out),
          device,
          *FAMILIES.values(),
      ],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=900,
      check=False,
  )
  if done.returncode:
    raise AssertionError(f"transformers' side failed:\n{done.stderr[-4000:]}")
  return out, json.loads(done.stdout.strip().splitlines()[-1])


def _ours(fixture: str, dtype: str, ids, prompt):
  config, variables = hf_helpers.load(fixture, True, dtype=dtype)
  with jax.default_matmul_precision("highest"):
    logits = hf_helpers.logits(config, variables, "linen", ids)
    tokens = (
        hf_helpers.generate(config, variables, "linen", prompt, NEW_TOKENS)
        if dtype == "float32"
        else None
    )
  return np.asarray(logits, np.float32), tokens


class FamiliesOnGpuTest(parameterized.TestCase):

  @parameterized.named_parameters(*FAMILIES.items())
  def test_on_gpu_logits_equal_transformers(self, fixture):
    folder, report = _peer()
    why = report.get("why") or report["fixtures"][fixture]
    if why != "ok":
      gpu_checks.record("families", fixture, {"skipped": why})
      self.skipTest(why)
    with np.load(folder / f"{fixture}.npz") as peer:
      theirs, theirs16 = peer["logits"], peer["logits_bf16"]
      their_tokens = peer["tokens"]
    ids, _, _, prompt_len = hf_helpers.fixture(fixture)
    ours, our_tokens = _ours(fixture, "float32", ids, ids[:, :prompt_len])
    ours16, _ = _ours(fixture, "bfloat16", ids, None)
    rms = lambda a: float(np.sqrt(np.mean(np.square(a))))  # noqa: E731
    scale = max(1.0, float(np.abs(theirs).max()))
    their_bf16 = rms(theirs16 - theirs)
    our_bf16 = rms(ours16 - theirs)
    bf16_bound = max(2 * their_bf16, scale * 2**-7)
    float32 = float(np.abs(ours - theirs).max())
    gpu_checks.record(
        "families",
        fixture,
        {
            "peer": {k: v for k, v in report.items() if k != "fixtures"},
            "float32_max_abs": float32,
            "greedy_equal": bool(np.array_equal(our_tokens, their_tokens)),
            "bf16_rms_ours_vs_their_f32": our_bf16,
            "bf16_rms_theirs_vs_their_f32": their_bf16,
            "bf16_max_abs_ours_vs_their_f32": float(
                np.abs(ours16 - theirs).max()
            ),
            "bf16_max_abs_theirs_vs_their_f32": float(
                np.abs(theirs16 - theirs).max()
            ),
        },
    )
    np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)
    np.testing.assert_array_equal(our_tokens, their_tokens)
    self.assertLessEqual(our_bf16, bf16_bound, "bfloat16")


if __name__ == "__main__":
  absltest.main()

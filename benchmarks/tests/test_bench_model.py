"""The whole-model benchmark: the same model on both sides, counted flops,
the peer protocol, and a whole run against a stand-in peer (slow).

transformers is not installed here: the peer is a small stand-in script
that speaks `peer_transformers.py`'s protocol.
"""

import json
import os
import sys
import tempfile
import textwrap

from absl.testing import absltest
import bench_model
import jax
import jax.numpy as jnp

from linen_moe import Decoder
from linen_moe import load_model_config
from linen_moe import testing

from common import machine
from common import whole_model
import peer_client


def _stand_in_peer(directory: str, params: int) -> str:
  """A peer script that answers every request with fixed figures and says it
  holds `params` parameters; "fail" fails, "exit" exits."""
  path = os.path.join(directory, "peer.py")
  with open(path, "w", encoding="utf-8") as f:
    f.write(textwrap.dedent(f"""
        import json, sys
        for line in sys.stdin:
          request = json.loads(line)
          op = request["op"]
          if op == "quit":
            break
          if op == "exit":
            print("dying", file=sys.stderr)
            sys.exit(3)
          reply = {{
              "setup": {{"params": {params}, "versions": {{"torch": "t",
                  "transformers": "x", "python": "p"}},
                  "attn_implementation": "eager",
                  "experts_implementation": "eager", "threads": 2}},
              "train": {{"step_s": [2.0]}},
              "generate": {{"generate_s": [3.0], "prefill_s": [0.5]}},
          }}.get(op, {{"error": "no " + op}})
          print(json.dumps(reply), flush=True)
        """))
  return path


class ShapeTest(absltest.TestCase):

  def test_the_issue_model_has_its_parameter_count(self):
    cfg = whole_model.model_config(whole_model.MIXTRAL_SHAPE)
    shapes = jax.eval_shape(
        Decoder(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32)
    )
    self.assertEqual(whole_model.param_count(shapes["params"]), 56_644_096)

  def test_peer_model_is_the_same_mixtral(self):
    cfg = whole_model.model_config(whole_model.MIXTRAL_SHAPE)
    peer = peer_client.peer_model(cfg)
    self.assertEqual(peer["model_type"], "mixtral")
    expected = {
        "vocab_size": 4096,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": True,
        "router_aux_loss_coef": 0.01,
    }
    self.assertEqual({k: peer[k] for k in expected}, expected)

  def test_no_peer_for_what_mixtral_cannot_express(self):
    with self.assertRaisesRegex(ValueError, "shared_experts=1"):
      peer_client.peer_model(load_model_config("tiny_gemma4_26b"))
    with self.assertRaisesRegex(ValueError, "routing='sigmoid_then_topk'"):
      peer_client.peer_model(load_model_config("tiny_deepseek_v3"))

  def test_train_flops_counted_by_hand(self):
    cfg = whole_model.model_config(whole_model.MIXTRAL_SHAPE)
    # Per token: 2 experts x 3 matmuls of 512 x 1024, 4 projections of
    # 512 x 512 and the router (512 x 8), in 4 layers; the tied logits
    # 512 x 4096; QK^T and PV over 256 positions of 512 per layer.
    per_token = (
        4 * (2 * 3 * 512 * 1024 + 4 * 512 * 512 + 512 * 8)
        + 512 * 4096
        + 4 * 2 * 256 * 512
    )
    self.assertEqual(
        whole_model.train_flops(cfg, 8, 256), 3 * 2 * 8 * 256 * per_token
    )

  def test_vector_isa_is_the_widest_flag_of_the_first_processor(self):
    zen3 = "processor\t: 0\nflags\t\t: fpu sse2 avx fma avx2 bmi2\n"
    # A later processor's flags do not count: the first one's are read.
    later = "\nprocessor\t: 1\nflags\t\t: avx512f avx2\n"
    self.assertEqual(machine.vector_isa(zen3 + later), "avx2")
    self.assertEqual(
        machine.vector_isa("flags : sse2 avx512f avx2 avx\n"), "avx512f"
    )
    self.assertEqual(
        machine.vector_isa("Features\t: fp asimd evtstrm sve\n"), "sve"
    )
    self.assertEqual(machine.vector_isa("flags : fpu vme\n"), "unknown")
    self.assertEqual(machine.vector_isa("model name : x\n"), "unknown")


class PeerTest(absltest.TestCase):

  def test_request_reply_error_and_exit(self):
    with tempfile.TemporaryDirectory() as d:
      peer = peer_client.Peer(sys.executable, _stand_in_peer(d, 7))
      try:
        self.assertEqual(peer.request("setup", model={})["params"], 7)
        self.assertEqual(peer.request("train", steps=1)["step_s"], [2.0])
        with self.assertRaisesRegex(RuntimeError, "peer nope: no nope"):
          peer.request("nope")
        with self.assertRaisesRegex(RuntimeError, r"exited \(3\).*dying"):
          peer.request("exit")
      finally:
        peer.close()


@testing.slow
class WholeRunTest(absltest.TestCase):

  def test_tiny_run_beside_a_stand_in_peer(self):
    cfg = load_model_config("tiny_mixtral")
    shapes = jax.eval_shape(
        Decoder(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32)
    )
    params = whole_model.param_count(shapes["params"])
    with tempfile.TemporaryDirectory() as d:
      out = os.path.join(d, "model.json")
      with absltest.mock.patch.object(
          peer_client, "PEER_SCRIPT", _stand_in_peer(d, params)
      ):
        status = bench_model.main([
            "--model=tiny_mixtral",
            "--batch=2",
            "--seq=8",
            "--decode-batch",
            "2",
            "--prompt=3",
            "--new=3",
            "--rounds=2",
            "--steps=1",
            f"--peer={sys.executable}",
            f"--out={out}",
        ])
      self.assertEqual(status, 0)
      with open(out, encoding="utf-8") as f:
        results = json.load(f)
      with open(out[: -len(".json")] + ".txt", encoding="utf-8") as f:
        text = f.read()
    (r,) = results["models"]
    self.assertEqual(r["params"], params)
    self.assertLen(r["samples"]["train_step_s"], 2)
    self.assertAlmostEqual(r["train_speedup"], 2.0 / r["train_step_s"])
    self.assertAlmostEqual(r["b2_generate_speedup"], 3.0 / r["b2_generate_s"])
    self.assertAlmostEqual(r["peer_b2_generate_tokens_per_s"], 2 * 3 / 3.0)
    self.assertAlmostEqual(r["b2_read_limit_tokens_per_s"], 2 / r["read_s"])
    for figure in ("first_generate_s", "prefill_compile_s", "decode_step_s"):
      self.assertGreater(r[f"b2_{figure}"], 0)
    self.assertIn("train step >= 1.3x transformers", text)
    self.assertIn(f"{params:,} parameters", text)


if __name__ == "__main__":
  absltest.main()

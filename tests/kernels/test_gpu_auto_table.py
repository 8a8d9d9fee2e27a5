"""What `grouped_matmul="auto"` runs on a GPU (`gpu/auto_table`): the
route a measured table found fastest for the nearest shape, never one it
found dense; "blocked" where nothing was measured (the table ships empty:
no GPU has run it yet)."""

from __future__ import annotations

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax.numpy as jnp

from linen_moe._src.kernels import registry
from linen_moe._src.kernels.gpu import auto_table

H200 = "NVIDIA H200"
ROUTES = ("xla_ragged_dot", "tokamax", "tokamax_mosaic", "tokamax_triton")


def _entry(m, routes, device_kind=H200, dtype="bfloat16", k=2048, n=768):
  return {
      "device_kind": device_kind,
      "dtype": dtype,
      "m": m,
      "k": k,
      "n": n,
      "groups": 128,
      "routes": {
          name: {"seconds": s, "dense": d} for name, (s, d) in routes.items()
      },
  }


# xla_ragged_dot measured fastest but dense at 8192 rows; not dense (cuDNN's
# grouped matmul) and fastest at 65536.
TABLE = auto_table.check_table(
    {
        "format": 1,
        "entries": [
            _entry(
                8192,
                {
                    "xla_ragged_dot": (1e-3, True),
                    "tokamax_mosaic": (2e-3, False),
                    "blocked": (3e-3, False),
                },
            ),
            _entry(
                65536,
                {
                    "xla_ragged_dot": (4e-3, False),
                    "tokamax_mosaic": (5e-3, False),
                },
            ),
        ],
    },
    ROUTES,
)


class ChooseTest(parameterized.TestCase):

  def test_the_shipped_table_is_empty_and_loads(self):
    self.assertEqual(auto_table.load_table(), ())

  @parameterized.named_parameters(
      (
          "nearest_m_skips_dense",
          (10000, 2048, 768, 128),
          ROUTES,
          "tokamax_mosaic",
      ),
      ("large_m_not_dense", (50000, 2048, 768, 128), ROUTES, "xla_ragged_dot"),
      (
          "route_unusable",
          (10000, 2048, 768, 128),
          ("xla_ragged_dot",),
          "blocked",
      ),
      ("other_k", (10000, 1024, 768, 128), ROUTES, "blocked"),
      ("unknown_shape", None, ROUTES, "blocked"),
  )
  def test_choose(self, shape, usable, want):
    got = auto_table.choose(shape, jnp.bfloat16, usable, H200, TABLE)
    self.assertEqual(got, want)

  def test_unmeasured_is_blocked(self):
    shape = (8192, 2048, 768, 128)
    self.assertEqual(
        auto_table.choose(shape, jnp.bfloat16, ROUTES, H200, ()), "blocked"
    )
    for kind, dtype in (("NVIDIA H100", jnp.bfloat16), (H200, jnp.float32)):
      got = auto_table.choose(shape, dtype, ROUTES, kind, TABLE)
      self.assertEqual(got, "blocked", (kind, dtype))

  def test_registry_runs_the_measured_route(self):
    shape = (50000, 2048, 768, 128)
    dtypes = (jnp.bfloat16, jnp.bfloat16)
    self.assertEqual(registry.auto("gpu", shape, dtypes), ("blocked", None))
    with (
        mock.patch.object(auto_table, "load_table", lambda: TABLE),
        mock.patch.object(auto_table, "current_device_kind", lambda: H200),
    ):
      impl, entry = registry.auto("gpu", shape, dtypes)
      self.assertEqual((impl, entry.key), ("kernel", "gpu/xla_ragged_dot"))
      # int8 operands: no GPU route takes them.
      got = registry.auto("gpu", shape, (jnp.int8, jnp.int8))
      self.assertEqual(got, ("blocked", None))


class CheckTableTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("format", {"format": 2, "entries": []}, "format must be 1"),
      ("entries", {"format": 1, "entries": {}}, "entries must be a list"),
      (
          "route",
          {"format": 1, "entries": [_entry(8, {"magic": (1.0, False)})]},
          "route 'magic' unknown; allowed",
      ),
      (
          "seconds",
          {"format": 1, "entries": [_entry(8, {"tokamax": (0.0, False)})]},
          "entry 0: tokamax needs seconds > 0",
      ),
      (
          "m",
          {"format": 1, "entries": [_entry(0, {"tokamax": (1.0, False)})]},
          "entry 0: m must be a positive int; got 0",
      ),
  )
  def test_bad_tables(self, table, message):
    with self.assertRaisesRegex(ValueError, message):
      auto_table.check_table(table, ROUTES)

  def test_dense_must_be_said(self):
    table = {"format": 1, "entries": [_entry(8, {"tokamax": (1.0, False)})]}
    del table["entries"][0]["routes"]["tokamax"]["dense"]
    with self.assertRaisesRegex(ValueError, "dense true/false"):
      auto_table.check_table(table, ROUTES)


if __name__ == "__main__":
  absltest.main()

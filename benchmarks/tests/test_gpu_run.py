"""benchmarks/gpu: the offline GPU run's steps, record, carried set and
xprof stand-in, and its CPU dry run of the quick steps (env, tests,
kernels) through one_gpu.sh."""

import json
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile

from absl.testing import absltest

GPU = pathlib.Path(__file__).resolve().parents[1] / "gpu"
sys.path.insert(0, str(GPU))

import gpu_env  # noqa: E402
import gpu_run  # noqa: E402
import gpu_wheels  # noqa: E402

MIB = 1 << 20


def _has(module: str) -> bool:
  return gpu_run.has_module(module)


class StepsTest(absltest.TestCase):

  def test_every_step_runs_files_that_exist(self):
    root = gpu_run.ROOT
    for dry in (False, True):
      for name, step in gpu_run.STEPS.items():
        ctx = gpu_run.Context("python3", root / "o", dry, step.budget_s, True)
        commands = step.commands(ctx)
        self.assertNotEmpty(commands, name)
        for argv in commands:
          named = [a for a in argv if a.endswith(".py")]
          self.assertNotEmpty(named, (name, argv))
          for path in named:
            self.assertTrue((root / path).is_file(), (name, dry, path))

  def test_the_default_calls_fit_a_device_call(self):
    # The device tool ends a call at 600 s; the wheels' install and the
    # interpreter's start come first.
    self.assertLess(gpu_run.DEFAULT_BUDGET_S, 600)
    for call in gpu_run.CALLS:
      total = sum(gpu_run.STEPS[s].budget_s for s in call)
      self.assertLessEqual(total, gpu_run.DEFAULT_BUDGET_S, call)
    every = {s for call in gpu_run.CALLS for s in call}
    self.assertEqual(every, set(gpu_run.STEPS))

  def test_the_torch_peer_only_where_torch_imports(self):
    step = gpu_run.STEPS["vs_torch"]
    for has_torch in (False, True):
      ctx = gpu_run.Context("py", pathlib.Path("o"), True, 100, has_torch)
      (argv,) = step.commands(ctx)
      self.assertEqual("--peer" in argv, has_torch)
    self.assertIn(("LINEN_MOE_PEER_DEVICE", "cuda"), step.env)

  def test_a_step_past_its_limit_is_killed(self):
    with tempfile.TemporaryFile("w+") as log:
      status = gpu_run.run_command(
          [sys.executable, "-c", "import time; time.sleep(60)"], log, {}, 1
      )
      log.seek(0)
      self.assertEqual(status, 124)
      self.assertIn("killed after 1 s", log.read())

  def test_steps_past_the_calls_budget_are_skipped(self):
    with tempfile.TemporaryDirectory() as out:
      status = gpu_run.main(["--out", out, "--budget-s", "5", "env", "mfu"])
      record = json.loads(pathlib.Path(out, "gpu_run.json").read_text())
    self.assertEqual(status, 1)
    self.assertEqual(
        [(s["step"], s["status"]) for s in record["steps"]],
        [("env", "skipped"), ("mfu", "skipped")],
    )

  def test_the_tests_step_runs_the_gpu_chip_checks(self):
    step = gpu_run.STEPS["tests"]
    for dry in (False, True):
      ctx = gpu_run.Context("py", pathlib.Path("o"), dry, 100, False)
      (argv,) = step.commands(ctx)
      for path in gpu_run.ON_GPU_TEST_FILES:
        self.assertIn(path, argv)
        self.assertTrue((gpu_run.ROOT / path).is_file(), path)
    # A dry run rehearses them on the CPU unless told not to.
    saved = os.environ.pop(gpu_run.ON_CPU_ENV, None)
    try:
      self.assertEqual(gpu_run.child_env(True)[gpu_run.ON_CPU_ENV], "1")
      self.assertNotIn(gpu_run.ON_CPU_ENV, gpu_run.child_env(False))
      os.environ[gpu_run.ON_CPU_ENV] = "0"
      self.assertEqual(gpu_run.child_env(True)[gpu_run.ON_CPU_ENV], "0")
    finally:
      os.environ.pop(gpu_run.ON_CPU_ENV, None)
      if saved is not None:
        os.environ[gpu_run.ON_CPU_ENV] = saved

  def test_unknown_step(self):
    with self.assertRaises(SystemExit):
      gpu_run.main(["nothing"])

  def test_junit_counts(self):
    xml = (
        '<testsuites><testsuite name="pytest" errors="1" failures="2"'
        ' skipped="3" tests="10"></testsuite></testsuites>'
    )
    with tempfile.TemporaryDirectory() as d:
      path = pathlib.Path(d, "t.xml")
      path.write_text(xml)
      self.assertEqual(
          gpu_run.junit_counts(path),
          {"passed": 4, "failed": 2, "errors": 1, "skipped": 3},
      )

  def test_only_the_wheels_the_machine_lacks_install(self):
    with tempfile.TemporaryDirectory() as d:
      for name in (
          "absl_py-2.5.1-py3-none-any.whl",  # installed with flax
          "no_such_distribution_here-1.0-py3-none-any.whl",
      ):
        pathlib.Path(d, name).touch()
      missing = gpu_run.missing_wheels(pathlib.Path(d))
    self.assertEqual(
        [pathlib.Path(p).name for p in missing],
        ["no_such_distribution_here-1.0-py3-none-any.whl"],
    )


class CarriedTest(absltest.TestCase):

  def test_size_report(self):
    wheels = {"a.whl": 10 * MIB, "b.whl": 20 * MIB}
    text, fits = gpu_wheels.size_report(wheels, 30 * MIB, limit_mib=64)
    self.assertTrue(fits)
    self.assertIn("60.00 fits", text)
    _, fits = gpu_wheels.size_report(wheels, 30 * MIB, limit_mib=59)
    self.assertFalse(fits)

  def test_the_carried_set_is_pinned(self):
    pins = gpu_wheels.pins()
    self.assertIn("tokamax==0.0.17", pins)
    self.assertNotIn("xprof", " ".join(pins))  # the stand-in's place
    with tempfile.TemporaryDirectory() as d:
      path = pathlib.Path(d, "c.txt")
      path.write_text("# a comment\nflax>=0.12\n")
      with self.assertRaisesRegex(ValueError, r"c.txt:2: 'flax>=0.12'"):
        gpu_wheels.pins(path)

  def test_pyproject_admits_the_carried_requirements(self):
    ranges = gpu_env.requirement_ranges(gpu_run.ROOT / "pyproject.toml")
    for pin in gpu_wheels.pins():
      name, version = pin.split("==")
      if name in ranges:
        self.assertTrue(gpu_env.admitted(version, ranges[name]), pin)
    # The GPU machine's jax, the oldest supported.
    self.assertTrue(gpu_env.admitted("0.11.2", ranges["jax"]))
    self.assertFalse(gpu_env.admitted("0.11.1", ranges["jax"]))


class StandinTest(absltest.TestCase):

  def test_tokamax_imports_with_the_xprof_standin(self):
    if not _has("tokamax"):
      self.skipTest("no tokamax here (the test extra installs it)")
    script = (
        "import tokamax, xprof\n"
        "from xprof.cli.tools import get_kernel_stats_tool as t\n"
        "assert xprof.STANDIN, xprof.__file__\n"
        "try:\n"
        "  t.compute_kernel_stats()\n"
        "except RuntimeError as e:\n"
        "  print('raises:', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(GPU / "standin")}
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertIn("raises: xprof is not installed", done.stdout)


class DryRunTest(absltest.TestCase):

  def test_the_quick_steps_rehearse_on_the_cpu(self):
    import jax  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as out:
      env = {**os.environ, "OUT": out, "PYTHON": sys.executable}
      env["WHEELS"] = os.path.join(out, "no-wheels")
      # The GPU chip checks' rehearsal is minutes of compiles: not here.
      env[gpu_run.ON_CPU_ENV] = "0"
      done = subprocess.run(
          [str(GPU / "one_gpu.sh"), "--cpu-dry-run", "env", "tests", "kernels"],
          env=env,
          capture_output=True,
          text=True,
          timeout=600,
          check=False,
      )
      self.assertEqual(done.returncode, 0, done.stdout[-3000:])
      record = json.loads(pathlib.Path(out, "gpu_run.json").read_text())
      table = pathlib.Path(out, "gpu_run.txt").read_text()
      with tarfile.open(pathlib.Path(out, "gpu_run.tar.gz")) as tar:
        names = set(tar.getnames())
    self.assertEqual(record["mode"], "cpu-dry-run")
    steps = {s["step"]: s for s in record["steps"]}
    self.assertEqual(list(steps), ["env", "tests", "kernels"])
    for name, step in steps.items():
      self.assertEqual(step["status"], "ok", (name, step["tail"]))
      self.assertLessEqual(step["seconds"], step["budget_s"])
      self.assertIn(f"gpu_run/{name}/log.txt", names)
    machine = steps["env"]["results"]["env.json"]
    self.assertEqual(machine["packages"]["jax"]["version"], jax.__version__)
    self.assertEqual(machine["devices"]["backend"], "cpu")
    self.assertEqual(machine["outside_range"], [])
    if _has("tokamax"):
      self.assertTrue(machine["packages"]["xprof"].get("standin"))
      self.assertNotIn("import_error", machine["packages"]["tokamax"])
    counts = steps["tests"]["results"]["tests"]
    self.assertGreaterEqual(counts["passed"], 2)
    self.assertEqual(counts["failed"] + counts["errors"], 0)
    self.assertIn("blocked fwd+bwd", steps["kernels"]["tail"])
    self.assertRegex(table, r"tests\s+ok")


if __name__ == "__main__":
  absltest.main()

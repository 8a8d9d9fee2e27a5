"""The wheels that carry MaxText 0.2.5's MoE layer to the chip, for
`one_chip.sh maxtext` (bench_maxtext_layer.py).

The chip (Python 3.11, jax 0.10.2, no network) installs this project's
requirements from .whl-tpu/ and what its own package index holds by name
(`INDEX`, with their requirements); .whl-maxtext/ carries the rest
(`CARRIED`): the packages MaxText's layer imports that neither has, pinned
to versions that import under Python 3.11 and jax 0.10.2. MaxText's wheel
goes without its tokenizer assets (10.8 of its 13.6 MB packed), which
the layer never reads.

  python benchmarks/device/maxtext_wheels.py          # fills .whl-maxtext/
  python benchmarks/device/maxtext_wheels.py --index  # prints INDEX

Run it in the repository root of the checkout the device call sends (the
main one); .whl-maxtext/ is git-ignored there through .git/info/exclude.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

# name==version: what MaxText's layer (`maxtext.layers.moe`, its config
# `maxtext.configs.pyconfig`, `maxtext.utils.maxtext_utils`) imports that
# .whl-tpu/ and the chip's index lack.
CARRIED = (
    "maxtext==0.2.5",  # needs Python 3.12 by its metadata; runs on 3.11
    "tokamax==0.0.12",  # later ones need Python 3.12
    "typeguard==2.13.3",  # tokamax's pin
    "qwix==0.1.8",
    "pathwaysutils==0.1.13",
    "fastapi==0.165.0",  # pathwaysutils'
    "starlette==1.10.0",
    "uvicorn==0.55.0",
    "annotated-doc==0.0.7",
    "opentelemetry-api==1.45.3",
    "pydantic==2.14.4",  # MaxText's config
    "pydantic-core==2.50.5",
    "typing-inspection==0.4.5",
    "annotated-types==0.8.0",
    "omegaconf==2.4.0",
    "drjax==0.2.1",
    "einshape==1.0",
    "immutabledict==4.3.1",
)
# Installed on the chip from its own index by name, with their
# requirements (jaxtyping brings wadler-lindig; requests its own).
INDEX = ("jaxtyping", "pillow", "requests")
# Dropped from MaxText's wheel: folders, and files by suffix.
DROP = ("maxtext/assets/", "dependencies/")
DROP_SUFFIXES = (".ipynb",)
PLATFORMS = (
    "manylinux2014_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
)


def dropped(name: str) -> bool:
  """Whether a wheel member is left out of the trimmed MaxText wheel."""
  return name.startswith(DROP) or name.endswith(DROP_SUFFIXES)


def trim_wheel(source: pathlib.Path, target: pathlib.Path) -> int:
  """Writes `source` without its `dropped` members to `target` (its
  RECORD without their lines); returns how many were dropped."""
  count = 0
  with (
      zipfile.ZipFile(source) as src,
      zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst,
  ):
    for info in src.infolist():
      if dropped(info.filename):
        count += 1
        continue
      data = src.read(info)
      if info.filename.endswith(".dist-info/RECORD"):
        lines = data.decode().splitlines(keepends=True)
        data = "".join(
            line for line in lines if not dropped(line.split(",", 1)[0])
        ).encode()
      dst.writestr(info, data)
  return count


def download(specs, dest: pathlib.Path) -> None:
  """`pip download`s `specs` (no requirements) as Python 3.11 x86-64
  wheels into `dest`."""
  cmd = [
      sys.executable,
      "-m",
      "pip",
      "download",
      "-q",
      "--no-deps",
      "--only-binary=:all:",
      "--ignore-requires-python",
      "--python-version",
      "3.11",
      "--implementation",
      "cp",
      *(f"--platform={p}" for p in PLATFORMS),
      "-d",
      str(dest),
      *specs,
  ]
  subprocess.run(cmd, check=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--dest", default=".whl-maxtext")
  parser.add_argument(
      "--index", action="store_true", help="print INDEX and stop"
  )
  args = parser.parse_args(argv)
  if args.index:
    print(" ".join(INDEX))
    return 0
  dest = pathlib.Path(args.dest)
  dest.mkdir(exist_ok=True)
  for old in dest.glob("*.whl"):  # one version of each
    old.unlink()
  with tempfile.TemporaryDirectory() as tmp:
    download(CARRIED, pathlib.Path(tmp))
    for wheel in sorted(pathlib.Path(tmp).glob("*.whl")):
      if wheel.name.startswith("maxtext-"):
        n = trim_wheel(wheel, dest / wheel.name)
        print(f"{wheel.name}: {n} files dropped")
      else:
        shutil.move(wheel, dest / wheel.name)
  total = sum(f.stat().st_size for f in dest.glob("*.whl"))
  print(
      f"{dest}: {len(list(dest.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())

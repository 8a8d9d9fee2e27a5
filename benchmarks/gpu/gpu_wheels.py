"""Builds the wheels the GPU run carries, and checks they can travel.

The GPU machine (benchmarks/gpu/README.md) has no package index: what this
project needs beyond the machine's own packages travels with the working
tree as wheels, at most 64 MiB a call together with it. This writes into
DIR (default `.whl-gpu/`, kept out of git by `.git/info/exclude`):

- this project's own wheel (`pip wheel --no-deps .`);
- each pinned line of `benchmarks/gpu/carried.txt`, for the machine's
  Python 3.12 on x86-64 Linux (`pip download --no-deps --only-binary`),

then prints each wheel's size, their total and the working tree's (the
tracked and untracked, not ignored files that travel with every call), and
exits 1 when the two together pass the limit.

  python benchmarks/gpu/gpu_wheels.py                # build .whl-gpu/, check
  python benchmarks/gpu/gpu_wheels.py --check-only     # check what is there
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
CARRIED = ROOT / "benchmarks" / "gpu" / "carried.txt"
MIB = 1 << 20
# The device tool's limit on what travels in one call: the working tree and
# the carried paths together.
LIMIT_MIB = 64
# The machine's Python (3.12.3) on x86-64 Linux (Ubuntu 24.04: glibc 2.39);
# pip takes the best wheel among these tags.
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def pins(path: pathlib.Path = CARRIED) -> list[str]:
  """The `NAME==VERSION` lines of a carried-set file, comments dropped.

  Raises:
    ValueError: a line that is not an exact pin (the carried set is pinned).
  """
  out = []
  for number, raw in enumerate(path.read_text().splitlines(), 1):
    line = raw.split("#", 1)[0].strip()
    if not line:
      continue
    name, sep, version = line.partition("==")
    if not sep or not name.strip() or not version.strip():
      raise ValueError(
          f"{path.name}:{number}: {line!r} is not NAME==VERSION (the carried"
          " set is pinned)"
      )
    out.append(line)
  return out


def working_tree_bytes(root: pathlib.Path = ROOT) -> int:
  """Bytes of the files that travel with every call: tracked, and untracked
  but not ignored (`git ls-files -co --exclude-standard`)."""
  listed = subprocess.run(
      ["git", "ls-files", "-co", "--exclude-standard", "-z"],
      cwd=root,
      capture_output=True,
      check=True,
  ).stdout.split(b"\0")
  total = 0
  for name in filter(None, listed):
    path = root / name.decode()
    if path.is_file() and not path.is_symlink():
      total += path.stat().st_size
  return total


def size_report(
    wheels: dict[str, int], tree_bytes: int, limit_mib: float = LIMIT_MIB
) -> tuple[str, bool]:
  """A table of the wheels' sizes and whether all of it fits the limit.

  Args:
    wheels: file name -> bytes.
    tree_bytes: the working tree's bytes.
    limit_mib: what one call may carry, MiB.

  Returns:
    (the table's text, whether wheels plus tree <= limit).
  """
  lines = [f"{'wheel':60s} {'MiB':>7s}"]
  for name, size in sorted(wheels.items(), key=lambda kv: -kv[1]):
    lines.append(f"{name:60s} {size / MIB:7.2f}")
  carried = sum(wheels.values())
  total = carried + tree_bytes
  fits = total <= limit_mib * MIB
  lines += [
      f"{'wheels (' + str(len(wheels)) + ')':60s} {carried / MIB:7.2f}",
      f"{'working tree':60s} {tree_bytes / MIB:7.2f}",
      (
          f"{'together (limit ' + str(limit_mib) + ' MiB)':60s}"
          f" {total / MIB:7.2f} {'fits' if fits else 'OVER THE LIMIT'}"
      ),
  ]
  return "\n".join(lines), fits


def exclude(folder: str) -> None:
  """Adds `/folder/` to this clone's .git/info/exclude (once): the device
  tool carries only ignored paths that `carry` names."""
  path = pathlib.Path(
      subprocess.run(
          ["git", "rev-parse", "--git-path", "info/exclude"],
          cwd=ROOT,
          capture_output=True,
          text=True,
          check=True,
      ).stdout.strip()
  )
  path = path if path.is_absolute() else ROOT / path
  line = f"/{folder}/"
  text = path.read_text() if path.exists() else ""
  if line not in text.splitlines():
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + ("" if text.endswith("\n") or not text else "\n"))
    with path.open("a") as f:
      f.write(line + "\n")


def build(out: pathlib.Path) -> None:
  """Empties `out`, then fills it: the project's wheel and the pinned set."""
  if out.exists():
    shutil.rmtree(out)
  out.mkdir(parents=True)
  pip = [sys.executable, "-m", "pip"]
  subprocess.run(
      [*pip, "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)], check=True
  )
  platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
  subprocess.run(
      [
          *pip,
          "download",
          "-q",
          "--no-deps",
          "--only-binary=:all:",
          "--python-version",
          "3.12",
          "--implementation",
          "cp",
          "--abi",
          "cp312",
          "--abi",
          "abi3",
          "--abi",
          "none",
          *platforms,
          "-d",
          str(out),
          *pins(),
      ],
      check=True,
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=".whl-gpu", help="the wheel folder")
  parser.add_argument(
      "--check-only", action="store_true", help="size what is there"
  )
  parser.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
  args = parser.parse_args(argv)
  out = (ROOT / args.out).resolve()
  if not args.check_only:
    exclude(out.relative_to(ROOT).as_posix())
    build(out)
  if not out.is_dir():
    print(f"gpu_wheels: no {out} (run without --check-only)", file=sys.stderr)
    return 1
  wheels = {p.name: p.stat().st_size for p in out.glob("*.whl")}
  text, fits = size_report(wheels, working_tree_bytes(), args.limit_mib)
  print(text)
  return 0 if fits else 1


if __name__ == "__main__":
  sys.exit(main())

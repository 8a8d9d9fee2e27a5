"""A tiny real corpus that is always there: the license texts that ship with
installed packages (this library's dependencies), for tests and examples
that need English text without a download. Imports no jax."""

from __future__ import annotations

from collections.abc import Sequence
import hashlib
import importlib.metadata

# Dependencies whose distributions carry license texts; the many identical
# Apache-2.0 texts among them count once.
PACKAGES = ("numpy", "jax", "pyyaml", "tqdm", "ml_dtypes", "tensorstore")
_NAMES = ("LICENSE", "LICENCE", "COPYING")


def license_texts(packages: Sequence[str] = PACKAGES) -> list[str]:
  """The license files of installed packages, one per distinct text.

  Args:
    packages: distribution names; those not installed are passed over.

  Returns:
    Their paths, sorted (about 160 KB of English for the default ones).

  Raises:
    ValueError: none of them is installed with a license file.
  """
  seen, paths = set(), []
  for name in packages:
    try:
      files = importlib.metadata.distribution(name).files or []
    except importlib.metadata.PackageNotFoundError:
      continue
    for file in files:
      if not any(n in file.name.upper() for n in _NAMES):
        continue
      path = str(file.locate())
      try:
        with open(path, "rb") as f:
          digest = hashlib.sha256(f.read()).hexdigest()
      except OSError:
        continue
      if digest not in seen:
        seen.add(digest)
        paths.append(path)
  if not paths:
    raise ValueError(f"license_texts: no license file among {packages}.")
  return sorted(paths)

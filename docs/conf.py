"""Sphinx configuration: MyST pages, an API reference from the docstrings.

The API pages (docs/api/*.md but index.md) are not in the source tree:
`api_pages` writes them when the site is built, one per public face, each
rendering its module's docstring and every name of its `__all__`.
"""

import os

import linen_moe

project = "linen_moe"
author = "The linen_moe authors"
release = linen_moe.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown"}
myst_enable_extensions = ["colon_fence"]
exclude_patterns = ["_build"]

autodoc_default_options = {"members": True, "undoc-members": True}
autodoc_typehints = "none"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# Dataclass fields are documented once, from the "Attributes:" section.
napoleon_use_ivar = True

html_theme = "sphinx_book_theme"
html_title = f"linen_moe {release}"


def _example_usage(app, what, name, obj, options, lines):
  """Renders a docstring's "Example usage:" block (STYLE.md) as Python code."""
  del app, what, name, obj, options
  out, i = [], 0
  while i < len(lines):
    if lines[i].strip() == "Example usage:":
      indent = len(lines[i]) - len(lines[i].lstrip())
      out += [" " * indent + ".. rubric:: Example usage", ""]
      out += [" " * indent + ".. code-block:: python", ""]
      i += 1
      while i < len(lines) and (
          not lines[i].strip()
          or len(lines[i]) - len(lines[i].lstrip()) > indent
      ):
        out.append(lines[i])
        i += 1
      out.append("")
    else:
      out.append(lines[i])
      i += 1
  lines[:] = out


_HERE = os.path.dirname(os.path.abspath(__file__))


def _api_faces() -> tuple[str, ...]:
  """The public faces, as docs/api/index.md's table of contents lists
  their pages (`hf` is `linen_moe.hf`)."""
  with open(os.path.join(_HERE, "api", "index.md"), encoding="utf-8") as f:
    toc = f.read().split("```{toctree}")[1].split("```")[0].splitlines()
  pages = [n for n in toc if n and not n.startswith(":")]
  return tuple(
      n if n in ("linen_moe", "nnx_adapter") else f"linen_moe.{n}"
      for n in pages
  )


API_FACES = _api_faces()
# Words a page says before its module's docstring.
_INTROS = {
    "linen_moe": (
        "The layer (`RoutedMoE`, `RoutedAndSharedMoE`, `SharedExpert`, "
        "`MoEAux`), its configs (`MoEConfig`, `ModelConfig`, the shipped YAML "
        "files, `MATMUL_PATHS`) and the reference `Decoder`. Everything else "
        "lives in a public module of its own: "
        + ", ".join(
            f"`{face.split('.')[1]}`"
            for face in API_FACES
            if face.startswith("linen_moe.") and face != "linen_moe.frontend"
        )
        + ", and `frontend` (the contract of a second front end, "
        "`nnx_adapter`).\n\n"
    ),
    "linen_moe.planning": (
        "A guide: [Planning a run](../guides/planning.md).\n\n"
    ),
}


def api_pages() -> dict[str, str]:
  """{file name under docs/api: its MyST text}, a page per public face."""
  return {
      f"{face.split('.')[-1]}.md": (
          f"# {face}\n\n{_INTROS.get(face, '')}"
          f"```{{eval-rst}}\n.. automodule:: {face}\n```\n"
      )
      for face in API_FACES
  }


def write_api_pages(directory: str) -> list[str]:
  """Writes `api_pages` into `directory`; returns the files it changed."""
  changed = []
  for name, text in api_pages().items():
    path = os.path.join(directory, name)
    if os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        if f.read() == text:
          continue
    with open(path, "w", encoding="utf-8") as f:
      f.write(text)
    changed.append(name)
  return changed


def _write_api_pages(app):
  """Writes the API pages into the source tree before Sphinx reads it."""
  write_api_pages(os.path.join(app.srcdir, "api"))


def setup(app):
  app.connect("builder-inited", _write_api_pages)
  # Before napoleon (priority 500), which would read the block as prose.
  app.connect("autodoc-process-docstring", _example_usage, priority=400)

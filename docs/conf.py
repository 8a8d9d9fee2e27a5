"""Sphinx configuration: MyST pages, an API reference from the docstrings."""

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


def setup(app):
  # Before napoleon (priority 500), which would read the block as prose.
  app.connect("autodoc-process-docstring", _example_usage, priority=400)

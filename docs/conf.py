"""Sphinx configuration of horovod_ray's documentation, built by ``make docs``."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

from horovod_ray.__version__ import __version__  # noqa: E402 - after the path is set

project = "horovod_ray"
author = "the horovod_ray authors"
copyright = "2026, the horovod_ray authors"  # noqa: A001 - Sphinx's name for it
version = release = __version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinxarg.ext"]
# The API reference documents what the code says: signatures, docstrings, in source order.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

exclude_patterns = ["_build"]
html_theme = "alabaster"
html_theme_options = {"description": "Horovod training on a Ray cluster", "fixed_sidebar": True}
html_static_path: list[str] = []

"""Sphinx configuration of the jax_data documentation.

Build: ``sphinx-build -W --keep-going -b html docs docs/_build/html``
(``tox -e docs``). The code examples in the ``.rst`` pages are doctests that
pytest runs (``pytest docs``); Sphinx only renders them.
"""

import os
import sys

# Document the checkout beside this folder, installed or not.
sys.path.insert(0, os.path.abspath(".."))
# Importing jax_data imports JAX; keep TensorFlow quiet if a page pulls it in.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax_data

project = "jax_data"
author = "the jax_data developers"
copyright = "the jax_data developers"
release = jax_data.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

# Google-style docstrings only.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# "Attributes:" as a field list, so NamedTuple fields are not described twice.
napoleon_use_ivar = True

autodoc_member_order = "bysource"
autodoc_typehints = "signature"

exclude_patterns = ["_build", "benchmarks.md"]
source_suffix = {".rst": "restructuredtext"}
root_doc = "index"

html_theme = "alabaster"
html_title = f"jax_data {release}"
html_theme_options = {
    "description": "Host data for jit-compiled JAX loops",
    "fixed_sidebar": True,
}

"""Sphinx configuration of the documentation site (``make docs``: build/docs/html)."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).parent / "_ext")]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

project = "horovod_dgc"
author = "horovod_dgc developers"
copyright = "horovod_dgc developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx-mathjax-offline",  # MathJax from the package, not a CDN: the pages read offline
    "configfields",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "data", "requirements.txt", "Thumbs.db", ".DS_Store"]

# MyST: $...$ and $$...$$ maths, \begin{align} blocks, anchors for the headings that the
# pages link to as [text](page.md#heading), tables and definition lists.
myst_enable_extensions = ["dollarmath", "amsmath", "deflist", "colon_fence"]
myst_heading_anchors = 3
myst_dmath_double_inline = True

html_theme = "furo"
html_title = "horovod_dgc"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_show_sourcelink = False
html_copy_source = False

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True

# Only internal links are checked (make test runs -b linkcheck offline): every http(s) link
# is ignored, so the check needs no network.
linkcheck_ignore = [r"https?://.*"]
linkcheck_anchors = True

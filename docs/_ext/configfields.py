"""Every field of a config dataclass as one table row: name, type, default, unit, meaning.

autodoc renders a dataclass's ``Attributes:`` section without the defaults, and only the
fields that class declares. For the classes in :data:`TABLED` this extension takes the
section out of the docstring before napoleon reads it, and appends a table of *every* field
(inherited ones included, as ``dataclasses.fields`` lists them) with its default, its unit
(:data:`UNITS`) and the description found in the nearest class of the MRO that describes it.
A field without a description or without a unit is a build warning, so ``make docs`` (``-W``)
fails when an option is added or renamed without its documentation.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Dict, List

from sphinx.util import logging

logger = logging.getLogger(__name__)

# The unit of every numeric field; booleans and strings have none (their meaning says what
# they choose).
UNITS: Dict[str, str] = {
    "min_numel": "elements",
    "density": "fraction of a tensor's elements, per step",
    "small_density": "fraction of a tensor's elements, per step",
    "warmup_epochs": "epochs",
    "warmup_factor": "ratio between successive epochs' densities",
    "warmup_densities": "fraction of elements, one per warm-up epoch",
    "steps_per_epoch": "optimizer steps",
    "momentum": "coefficient in [0, 1)",
    "weight_decay": "L2 coefficient, per step",
    "clip_norm": "L2 norm, in gradient units",
    "sample_ratio": "fraction of a tensor's elements",
    "max_retries": "times",
    "retry_factor": "factor in (0, 1)",
    "beta": "coefficient in (0, 1]",
    "chunks": "slices per tensor",
    "block_size": "elements",
    # CompressionStats
    "steps": "optimizer steps",
    "bytes_sent": "bytes",
    "dense_bytes": "bytes",
    "network_bytes": "bytes",
    "dense_network_bytes": "bytes",
    "elements_sent": "elements",
    "elements_compressed": "elements",
    "selection_time_s": "seconds",
    "buckets": "one line of text per bucket",
    # Adaptive
    "recheck_steps": "optimizer steps",
    "first_decision_step": "optimizer step (0-based)",
    "sample_steps": "optimizer steps",
    "margin": "fraction of the current mode's predicted time",
    "link_bytes_per_s": "bytes per second each worker sends",
    "latency_s": "seconds per collective",
    "watch_steps": "optimizer steps",
    "rescale": "factor > 1",
}

# The dataclasses documented as a table of fields.
TABLED = ("horovod_dgc.core.config.", "horovod_dgc.core.dgc.", "horovod_dgc.core.topk.",
          "horovod_dgc.core.gaussiank.", "horovod_dgc.core.scalecom.",
          "horovod_dgc.core.blocksign.", "horovod_dgc.core.stats.", "horovod_dgc.core.adaptive.Adaptive")


def is_tabled(obj) -> bool:
    return (inspect.isclass(obj) and dataclasses.is_dataclass(obj)
            and (obj.__module__ + "." + obj.__qualname__).startswith(TABLED))


def split_attributes(doc: str):
    """``doc`` (cleaned) without its ``Attributes:`` section, and that section as
    {name: description}."""
    lines = doc.splitlines()
    kept: List[str] = []
    found: Dict[str, str] = {}
    i = 0
    while i < len(lines):
        if lines[i].strip() == "Attributes:":
            base = len(lines[i]) - len(lines[i].lstrip())
            i += 1
            name = None
            entry_indent = None
            while i < len(lines) and (not lines[i].strip()
                                      or len(lines[i]) - len(lines[i].lstrip()) > base):
                line = lines[i]
                indent = len(line) - len(line.lstrip())
                match = re.match(r"\s*(\w+)(?:\s*\(.*?\))?:\s*(.*)$", line)
                if match and (entry_indent is None or indent == entry_indent):
                    entry_indent = indent
                    name = match.group(1)
                    found[name] = match.group(2)
                elif name is not None and line.strip():
                    found[name] += " " + line.strip()
                i += 1
            continue
        kept.append(lines[i])
        i += 1
    return kept, found


def descriptions(cls) -> Dict[str, str]:
    """Each field's description, from the nearest class of the MRO that gives one."""
    out: Dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass.__doc__:
            out.update(split_attributes(inspect.cleandoc(klass.__doc__))[1])
    return out


def type_name(field: dataclasses.Field) -> str:
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    return kind.replace("typing.", "")


def default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return repr(field.default_factory())  # type: ignore[misc]
    return "(required)"


def unit_of(field: dataclasses.Field) -> str:
    kind = type_name(field)
    if field.name in UNITS:
        return UNITS[field.name]
    if kind in ("bool", "str", "Optional[str]"):
        return "none"
    return ""


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def field_table(cls, where: str) -> List[str]:
    described = descriptions(cls)
    rows = []
    for field in dataclasses.fields(cls):
        text = described.get(field.name)
        if not text:
            logger.warning(f"{cls.__qualname__}.{field.name} has no description in any "
                           f"Attributes section of its classes", location=where)
            text = ""
        unit = unit_of(field)
        if not unit:
            logger.warning(f"{cls.__qualname__}.{field.name} has no unit: add it to UNITS in "
                           f"docs/_ext/configfields.py", location=where)
        rows.append((field.name, type_name(field), default_text(field), unit, text))
    out = ["", ".. list-table:: Fields (inherited ones included)", "   :header-rows: 1",
           "   :widths: 20 14 10 13 43", "   :class: config-fields", "",
           "   * - field", "     - type", "     - default", "     - unit", "     - meaning"]
    for name, kind, default, unit, text in rows:
        out += [f"   * - ``{name}``", f"     - ``{kind}``", f"     - ``{default}``",
                f"     - {cell(unit)}", f"     - {text}"]
    return out + [""]


def process_docstring(app, what, name, obj, options, lines):
    if what != "class" or not is_tabled(obj):
        return
    kept, _ = split_attributes("\n".join(lines))
    lines[:] = kept + field_table(obj, name)


def process_signature(app, what, name, obj, options, signature, return_annotation):
    if what == "class" and is_tabled(obj):
        return "", return_annotation  # the table lists the fields the signature would
    return None


def setup(app):
    app.connect("autodoc-process-docstring", process_docstring, priority=400)
    app.connect("autodoc-process-signature", process_signature)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

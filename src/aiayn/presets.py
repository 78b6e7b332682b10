"""The paper's model presets by name (base, big, every Table 3 row), shipped with the package.

``presets.yaml`` beside this module is their one copy. A config names them in ``models:`` without
repeating them, and its own ``presets:`` merge over them key by key (``presets: {base: {steps:
50000}}``); a preset's ``paper`` numbers are replaced whole, as they belong to one row of a table. A
preset written from scratch takes every key its ``inherit`` chain leaves out from the schema's
defaults (``$defs.preset``); the few with no sensible default (the model's size, its schedule) must
be set or inherited, and the message names the paper's presets to inherit from.
"""

from __future__ import annotations

import copy
import functools
from importlib import resources
from typing import Any

PRESETS_FILE = resources.files("aiayn") / "presets.yaml"


@functools.lru_cache(maxsize=1)
def _paper_file() -> dict:
    import yaml

    return yaml.safe_load(PRESETS_FILE.read_text(encoding="utf-8"))


def paper_presets() -> dict:
    """The paper's presets as written in presets.yaml (unresolved: ``inherit`` kept)."""
    return copy.deepcopy(_paper_file()["presets"])


def paper_vocab_size() -> int:
    """The paper's shared BPE vocabulary, for parameter counts without a config."""
    return int(_paper_file()["vocab_size"])


def with_paper_presets(config: dict) -> dict:
    """``config`` with the paper's presets under its own: a preset the config also names merges over
    the paper's key by key (its ``paper`` numbers, when given, replace the paper's whole)."""
    presets = paper_presets()
    own = config.get("presets")
    if not isinstance(own, dict):  # not a mapping: the schema's message names it
        return config if own is not None else {**config, "presets": presets}
    for name, preset in own.items():
        if isinstance(preset, dict) and isinstance(presets.get(name), dict):
            presets[name] = {**presets[name], **copy.deepcopy(preset)}
        else:
            presets[name] = copy.deepcopy(preset)
    return {**config, "presets": presets}


def preset_defaults(schema: dict) -> dict:
    """The schema's default of every preset key that has one, except those marked ``x-fill: false``
    (read where they are used: ``budget_intervals``)."""
    properties = schema["$defs"]["preset"]["properties"]
    return {key: copy.deepcopy(child["default"]) for key, child in properties.items()
            if "default" in child and child.get("x-fill", True)}


def fill_defaults(preset: dict, schema: dict) -> dict:
    """A resolved preset with every key it leaves out at the schema's default (after ``inherit``)."""
    return {**preset_defaults(schema), **preset}


def inherit_hint() -> str:
    """Which preset to inherit from, for a message about keys that have no default."""
    names = list(_paper_file()["presets"])
    return (f"or start from one of the paper's presets, e.g. `inherit: base` ({', '.join(names[:4])}, ... "
            "`aiayn params` lists them all)")


def known_text(presets: dict) -> str:
    """The presets a config can name, its own first: ``demo_base, ...; the paper's: base, big, ...``."""
    papers = list(_paper_file()["presets"])
    own = sorted(name for name in presets if name not in papers)
    return "; ".join(filter(None, [", ".join(own), "the paper's: " + ", ".join(papers)]))

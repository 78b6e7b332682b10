"""The config schema: its defaults and its one validator.

``config.schema.yaml`` (package data beside this module, which the Snakefile reads too) is the one home of
every default. This module reads it once a process and checks values against it with one validator, JSON
Schema's draft 2020-12 with two rules of ours (an integer written as one, a finite number). Merging config
files, naming the file that set a value and resolving presets are ``aiayn.config``'s; this module is the
floor under it, which the search (``aiayn.search``) also reads its defaults from.

yaml and jsonschema are imported where they are used: a module that imports this one imports with torch alone.
"""

from __future__ import annotations

import copy
import functools
import math
from importlib import resources
from typing import Any, Callable, Iterable, Sequence

from aiayn.errors import UserError

# package data: the one copy of the schema, for the installed command and the workflow alike
SCHEMA_PATH = resources.files("aiayn") / "config.schema.yaml"


@functools.lru_cache(maxsize=1)
def parsed() -> dict:
    """The schema as parsed, once a process (every preset's resolution asks for it). Not to be changed:
    ``schema()`` hands out copies."""
    import yaml

    return yaml.safe_load(SCHEMA_PATH.read_text(encoding="utf-8"))


def schema() -> dict:
    """A copy of the schema, so that no caller can change what the next one reads."""
    return copy.deepcopy(parsed())


def default(key: str) -> Any:
    """The schema's default for a dotted key (``"bpe.vocab_size"``), for code that needs one outside a
    config (a command-line option, a function's keyword): the schema stays the one place it is written."""
    node = parsed()
    for part in key.split("."):
        node = node["properties"][part]
    return copy.deepcopy(node["default"])


def preset_default(key: str) -> Any:
    """The schema's default for an optional preset key (``budget_intervals``), which a preset left
    without it takes where it is read (filled into presets, it would change every finished run's params)."""
    return copy.deepcopy(parsed()["$defs"]["preset"]["properties"][key]["default"])


def section_schema(section: str) -> dict:
    """The schema of one top-level section (``data``, ``bpe``, ``train``, ...), standing on its own."""
    whole = schema()
    return {"$defs": whole.get("$defs", {}), **whole["properties"][section]}


def section_defaults(section: str) -> dict:
    """A section with nothing set: every key at the schema's default (the defaults are valid as written;
    test_config holds them to the schema's rules)."""
    values: dict = {}
    fill_defaults(section_schema(section), values)
    return values


def fill_defaults(node: dict, values: dict) -> None:
    """Every key of ``node``'s properties that ``values`` leaves out, at its default, nested sections too
    (what Snakemake's ``validate(set_default=True)`` fills; presets are filled after ``inherit``)."""
    for key, child in node.get("properties", {}).items():
        if key not in values and "default" in child:
            values[key] = copy.deepcopy(child["default"])
        if isinstance(values.get(key), dict):
            fill_defaults(child, values[key])


def validator(node: dict):
    """The one validator: JSON Schema's draft 2020-12, except that an integer is written as one (the
    standard counts 32.0 as the integer 32, which a layer size or a step count then takes as a float,
    failing later or not at all) and a number is finite (YAML's .nan and .inf pass the standard's type
    and every bound). Every check of a value against the schema goes through here."""
    import jsonschema

    base = jsonschema.Draft202012Validator
    checker = base.TYPE_CHECKER.redefine_many({
        "integer": lambda _, value: isinstance(value, int) and not isinstance(value, bool),
        "number": lambda _, value: (isinstance(value, (int, float)) and not isinstance(value, bool)
                                    and math.isfinite(value))})
    return jsonschema.validators.extend(base, type_checker=checker)(node)


def first_error(node: dict, values: Any, prefix: Sequence[Any] = ()):
    """The error to show of ``values`` against ``node`` (the shallowest, then JSON Schema's best match),
    its path starting with ``prefix``; None when they are valid."""
    import jsonschema

    errors = sorted(validator(node).iter_errors(values), key=lambda e: (len(e.absolute_path), str(e.absolute_path)))
    if not errors:
        return None
    error = jsonschema.exceptions.best_match(errors)
    top = error  # best_match may pick an error of an anyOf's branch, whose path is its parent's and its own
    while top.parent is not None:
        top = top.parent
    top.path.extendleft(reversed(list(prefix)))
    return error


def key_text(path: Iterable[Any]) -> str:
    """A key's path as config/README.md writes it: ``data.local.train``, ``seeds[0]``."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def error_message(error, where: Callable[[list], str], required_note: str = "") -> str:
    """A schema error as one line a user can act on: ``where(key path)`` names who set the value (a file,
    an option); ``required_note`` is added where a top-level key is missing."""
    path = list(error.absolute_path)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed)) if isinstance(error.instance, dict) else []
        hint = f"allowed keys here: {', '.join(allowed)}" if allowed else "no keys are allowed here"
        return f"{where(path + extra[:1])}: unknown key {key_text(path + extra[:1])} ({hint}; see config/README.md)"
    at, key = where(path), key_text(path)
    if error.validator == "enum":
        allowed = ", ".join(str(v) for v in error.validator_value)
        return f"{at}: {key} = {error.instance!r} is not allowed (allowed values: {allowed})"
    if error.validator == "required":
        return f"{at}: {error.message} at {key} (see config/README.md{'' if path else required_note})"
    if error.validator == "type" and isinstance(error.instance, float) and not math.isfinite(error.instance):
        return f"{at}: {key} = {error.instance!r} is not a finite number"
    if error.validator == "type" and isinstance(error.instance, float) and "integer" in error.validator_value:
        whole = f"write {int(error.instance)}" if error.instance.is_integer() else "a whole number is needed"
        return f"{at}: {key} = {error.instance!r} is not a whole number as written ({whole}, without a decimal point)"
    description = error.schema.get("description")
    extra = f" ({description})" if description else ""
    return f"{at}: {key} = {error.instance!r}: {error.message}{extra}"


def check_values(section: str, values: Any, source: str) -> None:
    """Values of one section that did not come through a config file (the Python API's keywords:
    ``SearchConfig(beam_size=0)``), checked by the schema's rules for their keys, ``source`` named."""
    error = first_error(section_schema(section), values, [section])
    if error is not None:
        raise UserError(error_message(error, lambda path: source))

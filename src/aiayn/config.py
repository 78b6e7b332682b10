"""Config files: merge, validate against the schema (Snakemake's ``validate``), resolve presets.

Config flows one way: YAML files (the ``--configfile``s, or the demo's config/config.yaml when
none is given, then ``--config`` overrides) are merged key by key as Snakemake does, checked
against the schema (``config.schema.yaml``, package data beside this module, which the Snakefile
reads too) with a message that names the file and the key, filled with the schema's defaults, and
then each model preset is resolved through its ``inherit`` chain into one flat dict that the stages
receive as JSON. Under a user's files lie only the schema's defaults and the paper's presets
(aiayn/presets.py), which a config names instead of copying.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Sequence

from aiayn import presets as paper
from aiayn.config_files import check_command_line_configfiles, check_config_files, load_yaml  # noqa: F401
from aiayn.errors import UserError

# package data: the one copy of the schema, for the installed command and the workflow alike
SCHEMA_PATH = resources.files("aiayn") / "config.schema.yaml"

# Keys every resolved preset must have (after following `inherit`).
PRESET_KEYS = (
    "n_layers", "d_model", "d_ff", "n_heads", "d_head", "d_value", "dropout", "label_smoothing",
    "positional", "max_positions", "steps", "warmup_steps", "lr_scale", "average_last",
    "keep_checkpoints", "checkpoint_minutes", "checkpoint_steps", "gpus", "runtime_minutes",
)
MODEL_KEYS = ("n_layers", "d_model", "d_ff", "n_heads", "d_head", "d_value", "dropout", "positional", "max_positions")


class ConfigOverrides(str):
    """Values given on the command line (Snakemake's ``--config KEY=VALUE``) as one of the config's
    sources: it reads ``--config`` where sources are listed, and holds the values, so that a wrong
    value set there is blamed on the override that set it, not on a file that the override replaced."""

    values: dict

    def __new__(cls, values: dict) -> "ConfigOverrides":
        source = super().__new__(cls, "--config")
        source.values = dict(values)
        return source

    def blame(self, key_path: Sequence[Any]) -> str:
        """``--config KEY=VALUE`` for the override that sets ``key_path``, as it could have been typed."""
        import yaml

        key = key_path[0]
        text = yaml.safe_dump(self.values[key], default_flow_style=True, width=10**6).strip()
        text = text.removesuffix("...").strip()
        return f"--config {key}={text if len(text) <= 60 else text[:57] + '...'}"


def _source_values(source: str) -> Any:
    """What one source sets: an override's values, a file's mapping (None where it cannot be read)."""
    if isinstance(source, ConfigOverrides):
        return source.values
    if source == "--config":
        return None
    try:
        return load_yaml(source)
    except UserError:
        return None


def _blame(source: str, key_path: Sequence[Any]) -> str:
    return source.blame(key_path) if isinstance(source, ConfigOverrides) else source


def merge(base: dict, update: dict) -> dict:
    """Merge ``update`` into a copy of ``base`` key by key (dicts recursively), as Snakemake does."""
    merged = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def load_config(paths: Sequence[str | Path], overrides: dict | None = None) -> dict:
    """Merge config files (first is the base), apply overrides, validate and fill defaults."""
    config: dict = {}
    sources = [str(p) for p in paths]
    for path in paths:
        config = merge(config, load_yaml(path))
    if overrides:
        config = merge(config, overrides)
        sources.append(ConfigOverrides(overrides))
    return check_config(config, sources)


def _key_text(path: Iterable[Any]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _defined_in(key_path: Sequence[Any], sources: Sequence[str]) -> str:
    """The last source that sets ``key_path`` (the one whose value won the merge)."""
    for source in reversed(sources):
        node = _source_values(source)
        if node is None or (isinstance(source, ConfigOverrides) and not key_path):
            continue
        for part in key_path:
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and isinstance(part, int) and part < len(node):
                node = node[part]
            else:
                break
        else:
            return _blame(source, key_path)
    return sources[-1] if sources else "config"


def _schema_error_message(error, sources: Sequence[str]) -> str:
    path = list(error.absolute_path)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed)) if isinstance(error.instance, dict) else []
        key = _key_text(path + extra[:1])
        where = _defined_in(path + extra[:1], sources)
        hint = f"allowed keys here: {', '.join(allowed)}" if allowed else "no keys are allowed here"
        return f"{where}: unknown key {key} ({hint}; see config/README.md)"
    where = _defined_in(path, sources)
    key = _key_text(path)
    if error.validator == "enum":
        allowed = ", ".join(str(v) for v in error.validator_value)
        return f"{where}: {key} = {error.instance!r} is not allowed (allowed values: {allowed})"
    if error.validator == "required":
        demo = "" if path or any(Path(source).name == "config.yaml" for source in sources) else (
            "; the demo's config/config.yaml is not read under yours: to build on it, name it first, "
            "--configfile config/config.yaml " + str(sources[-1] if sources else "yours.yaml"))
        return f"{where}: {error.message} at {key} (see config/README.md{demo})"
    if error.validator == "type" and isinstance(error.instance, float) and not math.isfinite(error.instance):
        return f"{where}: {key} = {error.instance!r} is not a finite number"
    if error.validator == "type" and isinstance(error.instance, float) and "integer" in error.validator_value:
        whole = f"write {int(error.instance)}" if error.instance.is_integer() else "a whole number is needed"
        return f"{where}: {key} = {error.instance!r} is not a whole number as written ({whole}, without a decimal point)"
    description = error.schema.get("description")
    extra = f" ({description})" if description else ""
    return f"{where}: {key} = {error.instance!r}: {error.message}{extra}"


def _validator(schema: dict):
    """JSON Schema's draft 2020-12, except that an integer is written as one (the standard counts 32.0 as
    the integer 32, which a layer size or a step count then takes as a float, failing later or not at all)
    and a number is finite (YAML's .nan and .inf pass the standard's type and every bound)."""
    import jsonschema

    base = jsonschema.Draft202012Validator
    checker = base.TYPE_CHECKER.redefine_many({
        "integer": lambda _, value: isinstance(value, int) and not isinstance(value, bool),
        "number": lambda _, value: (isinstance(value, (int, float)) and not isinstance(value, bool)
                                    and math.isfinite(value))})
    return jsonschema.validators.extend(base, type_checker=checker)(schema)


def check_config(config: dict, sources: Sequence[str]) -> dict:
    """Validate against the schema with Snakemake's ``validate`` (filling defaults), then check presets.

    Returns the config with defaults filled in. Raises UserError naming the file and key.
    """
    import jsonschema
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    schema = _schema()
    config = paper.with_paper_presets(config)
    validator = _validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: (len(e.absolute_path), str(e.absolute_path)))
    if errors:
        raise UserError(_schema_error_message(jsonschema.exceptions.best_match(errors), sources))
    _check_data_source(config.get("data", {}), lambda key: _defined_in(["data", key], sources))
    config = copy.deepcopy(config)
    presets = config.pop("presets")  # their defaults are filled after `inherit` (resolve_preset), not here
    try:
        validate(config, str(SCHEMA_PATH), set_default=True)
    except WorkflowError as error:  # our own pass above should have caught it first
        raise UserError(f"{', '.join(sources)}: {error}") from None
    config["presets"] = presets
    for name in config["models"]:
        resolve_preset(config, name, sources)
    return config


def _check_data_source(data: dict, where) -> None:
    """Refuse data.local or data.hub set with data.source left out: the source's default, the demo, would
    then train on 30,000 generated pairs in place of the data the user named. ``where(key)``: who set it."""
    if "source" in data:
        return
    named = [key for key, is_set in (("local", any((data.get("local") or {}).values())),  # a split's files
                                      ("hub", bool(data.get("hub")))) if is_set]
    if named:
        raise UserError(
            f"{where(named[0])}: data.{named[0]} is set but data.source is not, so the demo's generated corpus "
            f"would be used (data.source defaults to demo), not your data; set data.source: {named[0]} (or remove "
            f"data.{named[0]} to train on the demo)")


def resolve_preset(config: dict, name: str, sources: Sequence[str] = ("config",)) -> dict:
    """Follow ``inherit`` and return the preset as one flat dict (without ``inherit``)."""
    presets = config["presets"]
    if name not in presets:
        where = _defined_in(["models"], sources)
        raise UserError(
            f"{where}: models lists unknown preset {name!r} (known presets: {paper.known_text(presets)})"
        )
    chain = [name]
    while "inherit" in presets[chain[-1]]:
        parent = presets[chain[-1]]["inherit"]
        if parent not in presets:
            where = _defined_in(["presets", chain[-1], "inherit"], sources)
            raise UserError(
                f"{where}: presets.{chain[-1]}.inherit = {parent!r} is not a preset "
                f"(known presets: {paper.known_text(presets)})"
            )
        if parent in chain:
            raise UserError(f"{sources[-1]}: presets inherit in a circle: {' -> '.join(chain + [parent])}")
        chain.append(parent)
    resolved: dict = {}
    for preset_name in reversed(chain):
        resolved = merge(resolved, {k: v for k, v in presets[preset_name].items() if k not in ("inherit", "paper")})
    # the paper's numbers belong to one row of a table; they are never inherited
    resolved["paper"] = copy.deepcopy(presets[name].get("paper", {}))
    resolved = paper.fill_defaults(resolved, _schema())
    missing = [key for key in PRESET_KEYS if key not in resolved]
    if missing:
        where = _defined_in(["presets", chain[-1]], sources)
        raise UserError(
            f"{where}: preset {name!r} (via {' -> '.join(chain)}) does not set {', '.join(missing)}, which have "
            f"no default; set them in presets.{chain[-1]}, {paper.inherit_hint()}"
        )
    _check_heads(name, chain, resolved, sources)
    resolved["name"] = name
    return resolved


def resolve_presets(config: dict, sources: Sequence[str] = ("config",)) -> dict:
    """Every model's preset of a checked config, resolved, by name in the order of ``models``."""
    return {name: resolve_preset(config, name, sources) for name in config["models"]}


def _check_heads(name: str, chain: Sequence[str], preset: dict, sources: Sequence[str]) -> None:
    try:
        check_heads(preset["n_heads"], preset["d_model"], preset["d_head"], f"presets.{name}.n_heads")
    except UserError as error:
        raise UserError(f"{_heads_set_in(chain, sources)}: {error}") from None


def _heads_set_in(chain: Sequence[str], sources: Sequence[str]) -> str:
    """The file to blame for heads that do not divide d_model: the last file that sets n_heads, d_model or
    d_head in the most specific preset of the `inherit` chain that sets any of them."""
    for preset_name in chain:
        for source in reversed(sources):
            values = _source_values(source)
            presets = values.get("presets") if isinstance(values, dict) else None
            preset = presets.get(preset_name) if isinstance(presets, dict) else None
            if isinstance(preset, dict) and {"n_heads", "d_model", "d_head"} & set(preset):
                return _blame(source, ["presets"])
    return sources[-1] if sources else "config"


def check_heads(n_heads: int, d_model: int, d_head: int | None, setting: str = "n_heads") -> None:
    """Section 3.2.2's d_k = d_model / h: without an explicit d_head, n_heads must divide d_model.

    The one check for presets and ``ModelConfig`` alike; `setting` names the value in the message.
    """
    if d_head is None and d_model % n_heads:
        divisors = [n for n in range(1, d_model + 1) if d_model % n == 0]
        choices = ", ".join(str(n) for n in divisors[:5]) + (", ..." if len(divisors) > 5 else "")
        raise UserError(
            f"{setting} = {n_heads} does not divide d_model = {d_model} "
            f"(set d_head explicitly, or choose n_heads in {choices})"
        )


def check_resolved_preset(preset: Any, source: str) -> None:
    """A resolved preset given on its own (``--preset-json``) must set every key a preset needs."""
    if not isinstance(preset, dict):
        raise UserError(f"{source}: a preset is a mapping of keys to values, got {type(preset).__name__}")
    missing = [key for key in PRESET_KEYS if key not in preset]
    if missing:
        raise UserError(f"{source}: the preset does not set {', '.join(missing)} (pass a resolved preset, as the "
                        "Snakefile does: every key of config/README.md's preset table)")


def model_fields(preset: dict) -> dict:
    """The ModelConfig fields of a resolved preset (the vocabulary size comes from the BPE stage).

    ``init`` is optional (ModelConfig's default, "t2t", where a preset leaves it out), so that presets
    written before it existed resolve to the same JSON and their finished runs stay up to date.
    """
    return {key: preset[key] for key in MODEL_KEYS} | ({"init": preset["init"]} if "init" in preset else {})


def to_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def add_config_arguments(parser, section: str) -> None:
    """Stages take their config section as JSON (from the Snakefile) or read it from config files."""
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--config", nargs="+", metavar="FILE", help="config files, merged in order and validated")
    group.add_argument(f"--{section}-json", dest="section_json", metavar="JSON",
                       help=f"the `{section}` section as JSON (what the Snakefile passes)")


def parse_with_config(parser, argv, defaults) -> tuple[Any, dict | None]:
    """``parser``'s options, where a stage takes ``--config FILE...`` beside options the Snakefile passes
    one by one: the merged, validated config (or None) and the options parsed with their defaults taken
    from it (``defaults(config, args)``: option dest -> value), so that an option given on the command
    line wins over the files."""
    args = parser.parse_args(argv)
    if not getattr(args, "config", None):
        return args, None
    config = load_config(args.config)
    parser.set_defaults(**defaults(config, args))
    return parser.parse_args(argv), config


@functools.lru_cache(maxsize=1)
def _parsed_schema() -> dict:
    import yaml

    return yaml.safe_load(SCHEMA_PATH.read_text(encoding="utf-8"))


def _schema() -> dict:
    """The schema, read and parsed once a process (every preset's resolution asks for it); a copy, so that
    no caller can change what the next one reads."""
    return copy.deepcopy(_parsed_schema())


def schema_default(key: str) -> Any:
    """The schema's default for a dotted key (``"bpe.vocab_size"``), for code that needs one outside a
    config (a command-line option, a function's keyword): the schema stays the one place it is written."""
    node = _schema()
    for part in key.split("."):
        node = node["properties"][part]
    return copy.deepcopy(node["default"])


def preset_default(key: str) -> Any:
    """The schema's default for an optional preset key (``budget_intervals``), which a preset left
    without it takes where it is read (filled into presets, it would change every finished run's params)."""
    return copy.deepcopy(_schema()["$defs"]["preset"]["properties"][key]["default"])


def section_schema(section: str) -> dict:
    """The schema of one top-level section (``data``, ``bpe``, ``train``, ...), standing on its own."""
    schema = _schema()
    return {"$defs": schema.get("$defs", {}), **schema["properties"][section]}


def section_defaults(section: str) -> dict:
    """A section with nothing set: every key at the schema's default (the one place defaults are written)."""
    return check_section(section, {}, "defaults")


def _fill_defaults(schema: dict, values: dict) -> None:
    for key, child in schema.get("properties", {}).items():
        if key not in values and "default" in child:
            values[key] = copy.deepcopy(child["default"])
        if isinstance(values.get(key), dict):
            _fill_defaults(child, values[key])


def check_section(section: str, values: Any, source: str) -> dict:
    """One section given on its own (``--<section>-json``, what the Snakefile passes, or by hand):
    checked against its part of the schema and filled with the schema's defaults, as a whole config is."""
    import jsonschema

    validator = _validator(section_schema(section))
    errors = sorted(validator.iter_errors(values), key=lambda e: (len(e.absolute_path), str(e.absolute_path)))
    if errors:
        error = jsonschema.exceptions.best_match(errors)
        error.path.appendleft(section)
        raise UserError(_schema_error_message(error, [source]))
    if section == "data":
        _check_data_source(values, lambda key: source)
    values = copy.deepcopy(values)
    _fill_defaults(section_schema(section), values)
    return values


def check_value(section: str, key: str, value: Any, source: str) -> Any:
    """One value of a section, given apart (a command-line option: ``--workers``): checked by the schema's
    rule for it, with ``source`` named in the message."""
    check_section(section, {key: value}, source)
    return value


def with_options(section: str, values: dict, options: dict | None) -> dict:
    """A checked section with the command-line options given beside it in place of their keys: ``options``
    maps key -> (option, value), value None for an option not given; each given value is checked alone,
    by the schema's rule for its key, with the option named."""
    for key, (option, value) in (options or {}).items():
        if value is not None:
            values[key] = check_value(section, key, value, option)
    return values


def section_from_arguments(args, section: str, overrides: dict | None = None) -> dict:
    """The section from --<section>-json (checked, defaults filled) or from --config files, each value
    checked once, with ``overrides`` in place of their keys (``with_options``)."""
    if args.section_json is not None:
        try:
            values = json.loads(args.section_json)
        except json.JSONDecodeError as error:
            raise UserError(f"--{section}-json is not valid JSON ({error})") from None
        values = check_section(section, values, f"--{section}-json")
    else:
        values = load_config(args.config)[section]
    return with_options(section, values, overrides)

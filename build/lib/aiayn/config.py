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
import json
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Sequence

from aiayn import presets as paper
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


def load_yaml(path: str | Path) -> dict:
    import yaml

    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: config file not found")
    if path.is_dir():
        raise UserError(f"{path}: a folder, not a config file (a YAML file of keys and values)")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise UserError(yaml_error_message(path, error)) from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text (a config file is YAML: keys and values)") from None
    except OSError as error:
        raise UserError(f"{path}: cannot read the config file ({error.strerror})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: a config file must be a mapping of keys to values, got {type(data).__name__}")
    return data


def yaml_error_message(path: str | Path, error) -> str:
    """A YAML syntax error as one line that names the file, line and column (YAML's marks count from 0)."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
    problem = getattr(error, "problem", None) or str(error)
    context, context_mark = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context and context_mark and context_mark is not mark:
        problem += f" ({context} at line {context_mark.line + 1}, column {context_mark.column + 1})"
    return f"{where}: not valid YAML: {problem}"


def check_command_line_configfiles(argv: Sequence[str]) -> None:
    """Snakemake reads its --configfile files before the Snakefile, and a syntax error there ends it
    with "Config file is not valid JSON or YAML", no file named, exit status 1. The workflow's default
    profile (profiles/default/config.yaml), which Snakemake reads before that, calls this with the
    command line: a file that is missing or not YAML prints `error: <file>, line, column: ...` and
    exits with status 2, as every other config error does."""
    import sys

    files, reading = [], False
    for argument in argv:
        if argument in ("--configfile", "--configfiles"):
            reading = True
        elif argument.startswith(("--configfile=", "--configfiles=")):
            files.append(argument.split("=", 1)[1])
            reading = False
        elif argument.startswith("-"):
            reading = False
        elif reading:
            files.append(argument)
    for file in files:
        try:
            load_yaml(file)
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(2) from None


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
        sources.append("--config")
    return check_config(config, sources)


def _key_text(path: Iterable[Any]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _defined_in(key_path: Sequence[Any], sources: Sequence[str]) -> str:
    """The last source that sets ``key_path`` (the one whose value won the merge)."""
    for source in reversed(sources):
        if source == "--config":
            continue
        try:
            node: Any = load_yaml(source)
        except UserError:
            continue
        for part in key_path:
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and isinstance(part, int) and part < len(node):
                node = node[part]
            else:
                break
        else:
            return source
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
    description = error.schema.get("description")
    extra = f" ({description})" if description else ""
    return f"{where}: {key} = {error.instance!r}: {error.message}{extra}"


def check_config(config: dict, sources: Sequence[str]) -> dict:
    """Validate against the schema with Snakemake's ``validate`` (filling defaults), then check presets.

    Returns the config with defaults filled in. Raises UserError naming the file and key.
    """
    import jsonschema
    import yaml
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    schema = yaml.safe_load(SCHEMA_PATH.read_text(encoding="utf-8"))
    config = paper.with_paper_presets(config)
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: (len(e.absolute_path), str(e.absolute_path)))
    if errors:
        raise UserError(_schema_error_message(jsonschema.exceptions.best_match(errors), sources))
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
            if source == "--config":
                continue
            try:
                preset = load_yaml(source).get("presets", {}).get(preset_name)
            except (UserError, AttributeError):
                continue
            if isinstance(preset, dict) and {"n_heads", "d_model", "d_head"} & set(preset):
                return source
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
                       help=f"the already validated `{section}` section as JSON (what the Snakefile passes)")


def _schema() -> dict:
    import yaml

    return yaml.safe_load(SCHEMA_PATH.read_text(encoding="utf-8"))


def schema_default(key: str) -> Any:
    """The schema's default for a dotted key (``"bpe.vocab_size"``), for code that needs one outside a
    config (a command-line option, a function's keyword): the schema stays the one place it is written."""
    node = _schema()
    for part in key.split("."):
        node = node["properties"][part]
    return copy.deepcopy(node["default"])


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

    validator = jsonschema.Draft202012Validator(section_schema(section))
    errors = sorted(validator.iter_errors(values), key=lambda e: (len(e.absolute_path), str(e.absolute_path)))
    if errors:
        error = jsonschema.exceptions.best_match(errors)
        error.path.appendleft(section)
        raise UserError(_schema_error_message(error, [source]))
    values = copy.deepcopy(values)
    _fill_defaults(section_schema(section), values)
    return values


def section_from_arguments(args, section: str) -> dict:
    """The section from --<section>-json (checked, defaults filled) or from --config files."""
    if args.section_json is not None:
        try:
            values = json.loads(args.section_json)
        except json.JSONDecodeError as error:
            raise UserError(f"--{section}-json is not valid JSON ({error})") from None
        return check_section(section, values, f"--{section}-json")
    return load_config(args.config)[section]

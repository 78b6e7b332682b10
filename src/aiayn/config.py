"""Config files: merge, validate against the schema, resolve presets; ``read_config``, the one door.

Config flows one way: YAML files (the ``--configfile``s, or the demo's config/config.yaml when
none is given, then ``--config`` overrides, then a command's options given beside them) are merged
key by key as Snakemake does, checked once by the schema's one validator (``aiayn.schema``) with a
message that names the file, override or option that set the key, filled with the schema's defaults,
and then each model preset is resolved through its ``inherit`` chain into one flat dict. Every stage
and the Snakefile read their settings through ``read_config``; the Snakefile writes the config it read,
resolved, for its jobs (``write_resolved``). Under a user's files lie only the schema's defaults and
the paper's presets (aiayn/presets.py), which a config names instead of copying.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Sequence

from aiayn import presets as paper
from aiayn import schema
from aiayn.config_files import check_command_line_configfiles, check_config_files, load_yaml  # noqa: F401
from aiayn.errors import UserError
from aiayn.schema import SCHEMA_PATH, preset_default, section_defaults  # noqa: F401 (read here by the stages)
from aiayn.schema import default as schema_default  # noqa: F401
from aiayn.writing import write_text_atomic

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


class GivenOptions(ConfigOverrides):
    """A command's options given beside its config files (``--workers 2``), as the last of the config's
    sources: ``options`` maps a dotted key (``decode.workers``) to (the option, its value, None when not
    given), and a wrong value is blamed on the option that set it."""

    def __new__(cls, options: dict) -> "GivenOptions":
        given = {key: pair for key, pair in options.items() if pair[1] is not None}
        values: dict = {}
        for key, (_, value) in given.items():
            *sections, last = key.split(".")
            node = values
            for part in sections:
                node = node.setdefault(part, {})
            node[last] = value
        source = str.__new__(cls, ", ".join(option for option, _ in given.values()) or "options")
        source.values = values
        source.names = {tuple(key.split(".")): option for key, (option, _) in given.items()}
        return source

    def blame(self, key_path: Sequence[Any]) -> str:
        for length in range(len(key_path), 0, -1):
            if tuple(key_path[:length]) in self.names:
                return self.names[tuple(key_path[:length])]
        return str(self)


def _source_values(source: str) -> Any:
    """What one source sets: an override's values, a file's mapping (None where it cannot be read)."""
    if isinstance(source, ConfigOverrides):
        return source.values
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


def load_config(paths: Sequence[str | Path]) -> dict:
    """The whole config of these files, through the door (``read_config``)."""
    return read_config(paths)


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
    """A schema error naming the source that set the value (the last file, or an option, that sets it)."""
    demo = "" if any(Path(source).name == "config.yaml" for source in sources) else (
        "; the demo's config/config.yaml is not read under yours: to build on it, name it first, "
        "--configfile config/config.yaml " + str(sources[-1] if sources else "yours.yaml"))
    return schema.error_message(error, lambda path: _defined_in(path, sources), demo)


def check_config(config: dict, sources: Sequence[str]) -> dict:
    """Validate against the schema once (its one validator), fill the schema's defaults, then check presets.

    Returns the config with defaults filled in. Raises UserError naming the file and key.
    """
    config = paper.with_paper_presets(config)
    error = schema.first_error(schema.parsed(), config)
    if error is not None:
        raise UserError(_schema_error_message(error, sources))
    _check_data_source(config.get("data", {}), lambda key: _defined_in(["data", key], sources))
    config = copy.deepcopy(config)
    presets = config.pop("presets")  # their defaults are filled after `inherit` (resolve_preset), not here
    schema.fill_defaults(schema.parsed(), config)
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
    resolved = paper.fill_defaults(resolved, schema.parsed())
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

    A config's presets, held to the model's own rule (``aiayn.model.check_heads``, which this module does
    not import: the model imports torch) with the same message (tests/test_imports.py holds the two equal).
    """
    if d_head is None and d_model % n_heads:
        divisors = [n for n in range(1, d_model + 1) if d_model % n == 0]
        choices = ", ".join(str(n) for n in divisors[:5]) + (", ..." if len(divisors) > 5 else "")
        raise UserError(
            f"{setting} = {n_heads} does not divide d_model = {d_model} "
            f"(set d_head explicitly, or choose n_heads in {choices})"
        )


def model_fields(preset: dict) -> dict:
    """The ModelConfig fields of a resolved preset (the vocabulary size comes from the BPE stage).

    ``init`` is optional (ModelConfig's default, "t2t", where a preset leaves it out), so that presets
    written before it existed resolve to the same JSON and their finished runs stay up to date.
    """
    return {key: preset[key] for key in MODEL_KEYS} | ({"init": preset["init"]} if "init" in preset else {})


def to_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def add_config_arguments(parser, section: str) -> None:
    """A stage's settings: config files (what the Snakefile passes, the resolved config), else the schema's
    defaults; an option the stage also takes for a key of theirs wins over both (``section_from_arguments``)."""
    parser.add_argument("--config", nargs="+", metavar="FILE",
                        help=f"config files, merged in order and validated: their `{section}` section "
                             "(default: the schema's)")


def read_config(files: Sequence[str | Path] | None = None, section: str | None = None,
                options: dict | None = None, *, merged: dict | None = None,
                sources: Sequence[str] | None = None) -> dict:
    """The one door through which every stage, and the Snakefile, reads its settings.

    Merges the config ``files`` in order (or takes the config Snakemake ``merged`` from ``sources``), puts
    the ``options`` given beside them in place of their keys (dotted key -> (option, value); see
    ``GivenOptions``), validates the whole once with the schema's one validator, fills the schema's
    defaults, resolves the presets, and returns ``section`` of it (the whole config without one). Without
    files, ``section`` stands on the schema's defaults, with the options given for it: it is validated
    alone, as it would be in a config; the whole config is then every key that has a default, each read
    so. A message names the file, override or option that set the wrong value.
    """
    given = GivenOptions(options or {})
    if merged is None and not files:
        if section is None:
            return {key: read_config(None, key, options) for key, node in schema.parsed()["properties"].items()
                    if "default" in node}
        values = copy.deepcopy(given.values.get(section, schema.default(section)))
        named = [given] if section in given.values else ["defaults"]
        error = schema.first_error(schema.section_schema(section), values, [section])
        if error is not None:
            raise UserError(_schema_error_message(error, named))
        if section == "data":
            _check_data_source(values, lambda key: _defined_in(["data", key], named))
        schema.fill_defaults(schema.section_schema(section), values)
        return values
    config, sources = (merged, list(sources or [])) if merged is not None else ({}, [str(path) for path in files])
    if merged is None:
        for path in files:
            config = merge(config, load_yaml(path))
    if given.values:
        config = merge(config, given.values)
        sources.append(given)
    config = check_config(config, sources)
    return config if section is None else config[section]


def config_from_arguments(args, keys: dict) -> dict:
    """The whole config a command reads, through the door: its --config files (else the schema's defaults),
    each option of ``keys`` (dest -> (option, dotted key)) that the command line gives in place of its key."""
    return read_config(args.config, None, {key: (option, getattr(args, dest)) for dest, (option, key) in keys.items()})


def write_resolved(config: dict, path: str | Path) -> str:
    """A checked config written as YAML to ``path`` (atomically, and only when its text changes, so its
    timestamp moves only with a new config): what the Snakefile hands its jobs, which read it through
    ``read_config``."""
    import yaml

    text = yaml.safe_dump(config, sort_keys=True, default_flow_style=False, width=10**6)
    path = Path(path)
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        write_text_atomic(path, text)
    return str(path)


def section_from_arguments(args, section: str, options: dict | None = None) -> dict:
    """The section a stage reads, through the door: --config's files' (else the schema's defaults), with the
    ``options`` given beside them (key in the section -> (option, value)) in place of their keys."""
    return read_config(args.config, section, {f"{section}.{key}": pair for key, pair in (options or {}).items()})

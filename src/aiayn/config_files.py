"""Config files as read from disk: YAML whose every error names the file and line.

Snakemake reads ``--configfile`` files with PyYAML before the Snakefile runs: it names no file for a
syntax error or an empty file, and keeps the last of a key given twice without a word. These readers
refuse each of those, one message naming the file (and line), for ``aiayn --config`` and, through the
workflow's default profile and common.smk, for ``snakemake --configfile``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Iterable, Sequence

from aiayn.errors import UserError


@functools.cache
def _unique_key_loader():
    """PyYAML's SafeLoader, except that a key given twice in one mapping is an error: YAML forbids it,
    and PyYAML (and Snakemake, which reads config files with it) keeps the last value, silently losing
    the first. A ``<<`` merge may still be overridden: that is what it is for."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen: dict = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    if isinstance(key, (list, dict)):
                        continue  # not a valid key at all: PyYAML's own error follows
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"the key {key!r} is given twice in one mapping (first at line "
                            f"{seen[key].line + 1}); YAML keeps only the last one, so remove one of them",
                            key_node.start_mark)
                    seen[key] = key_node.start_mark
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def load_yaml(path: str | Path) -> dict:
    """A config file as a dict; anything that is not one YAML mapping (a syntax error, a key given
    twice, another encoding, a folder) is a UserError naming the file and, where there is one, the line."""
    import yaml

    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: config file not found")
    if path.is_dir():
        raise UserError(f"{path}: a folder, not a config file (a YAML file of keys and values)")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_unique_key_loader())
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


def check_config_files(files: Iterable[str | Path]) -> None:
    """Each file one YAML mapping (load_yaml) that sets at least one key. Snakemake's own reader names no
    file for a syntax error or an empty file, and keeps the last of a key given twice without a word."""
    for file in files:
        if not load_yaml(file):
            raise UserError(f"{file}: the config file is empty (it sets no key); a config sets at least its data "
                            "and models (the paper's presets by name: README, \"Your own language pair\"), or names "
                            f"the demo's first to build on it: --configfile config/config.yaml {file}")


def check_command_line_configfiles(argv: Sequence[str]) -> None:
    """Snakemake reads its --configfile files before the Snakefile, and a syntax error there ends it
    with "Config file is not valid JSON or YAML", no file named, exit status 1. The workflow's default
    profile (profiles/default/config.yaml), which Snakemake reads before that, calls this with the
    command line: a file that is missing, not YAML, empty or with a key given twice prints
    `error: <file>, line, column: ...` and exits with status 2, as every other config error does."""
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
    try:
        check_config_files(files)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None

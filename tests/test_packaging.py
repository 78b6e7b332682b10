"""The environment is pinned in one place and the package is usable on a bare GPU image."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tomllib

import yaml
from conftest import REPO

from aiayn.cli import COMMANDS


def pyproject_pins() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["test"]
    pins = {}
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9][^\s;]*)", requirement)
        assert match, f"pyproject.toml: {requirement!r} is not an exact pin"
        pins[match.group(1).lower()] = match.group(2)
    return pins


def test_the_conda_environment_pins_equal_the_package_pins():
    environment = yaml.safe_load((REPO / "envs" / "aiayn.yaml").read_text())
    pip_section = next(item["pip"] for item in environment["dependencies"] if isinstance(item, dict))
    conda_pins = {}
    for requirement in pip_section:
        if requirement.startswith("-e"):
            continue
        name, version = requirement.split("==")
        conda_pins[name.lower()] = version
    assert conda_pins == pyproject_pins()


def test_the_lock_file_agrees_with_the_direct_pins():
    lock = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        if "==" in line:
            name, version = line.split("==")
            lock[name.lower().replace("_", "-")] = version
    for name, version in pyproject_pins().items():
        assert lock.get(name) == version, name


def test_every_cli_command_has_a_main():
    for command, (module_name, _) in COMMANDS.items():
        assert callable(importlib.import_module(module_name).main), command


def test_model_and_training_import_with_torch_alone():
    blocked = ["mlflow", "snakemake", "datasets", "pandas", "sacrebleu", "yaml", "matplotlib"]
    code = (
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None  # any import of these now fails\n"
        "import aiayn.model, aiayn.train.launch, aiayn.batching, aiayn.search, aiayn.checkpoint, aiayn.average\n"
        "import aiayn.speed.packed, aiayn.speed.incremental, aiayn.decode\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                            env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"

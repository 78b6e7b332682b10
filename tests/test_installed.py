"""The package stands alone: its wheel, installed (not editable) into a fresh virtual environment with
the pinned dependencies, runs every command from a folder outside the clone.

pip installs from its cache and the machine's local wheels where it finds them (the pins of
requirements.lock), without compiling every module to bytecode first, so the cost is mostly unpacking
torch (docs/development.md, "Tests", says what it costs). The environment has no access to this clone's sources: no
PYTHONPATH, no system site-packages, so `aiayn.__file__` must lie inside it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from conftest import REPO, write_text_corpus

INSTALL_TIMEOUT = 1800
TIMEOUT = 300

CONFIG = """\
experiment: mine
data:
  source: local
  src_lang: en
  tgt_lang: de
  local:
    train: {src: raw/train.en, tgt: raw/train.de}
    dev: {src: raw/dev.en, tgt: raw/dev.de}
    test: {src: raw/test.en, tgt: raw/test.de}
bpe: {vocab_size: 100, input_sentence_size: 0}
train: {tokens_per_step: 600, device_tokens: 600, log_every: 1, dev_every: 0, precision: fp32, device: cpu}
decode: {beam_size: 2, max_len_b: 10}
models: [tiny]
presets:
  tiny: {inherit: base, n_layers: 1, d_model: 16, d_ff: 32, n_heads: 2, steps: 4, warmup_steps: 2,
         checkpoint_steps: 2, average_last: 2, checkpoint_minutes: null, gpus: 0}
"""


def readme_wheel_commands() -> list[str]:
    """The two commands of docs/elsewhere.md, "Installing the package elsewhere", as written (their comments left out)."""
    import re

    text = (REPO / "docs" / "elsewhere.md").read_text(encoding="utf-8")
    section = text[text.index("## Installing the package elsewhere"):]
    block = section[section.index("```bash\n") + len("```bash\n"):section.index("```", section.index("```bash") + 3)]
    commands = [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines() if line.strip()]
    assert [command.split()[:2] for command in commands] == [["pip", "wheel"], ["pip", "install"]], commands
    return commands


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh virtual environment holding the wheel built from this clone and its pinned dependencies, by the
    commands of docs/elsewhere.md as written: the build in a fresh copy of the clone's package files, the install
    in a fresh folder that holds only the wheel and requirements.lock (what that page says to take along)."""
    build_command, install_command = readme_wheel_commands()
    root = tmp_path_factory.mktemp("installed")
    source, elsewhere = root / "source", root / "elsewhere"  # a copy: the build's egg-info stays out of the clone
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    environment = root / "venv"
    venv.create(environment, with_pip=True)  # not --system-site-packages: the editable aiayn stays out
    # `pip` is the venv's; the environment, not the commands, asks for no bytecode (--no-compile) and quiet
    env = {**clean_environment(environment), "PIP_COMPILE": "0", "PIP_QUIET": "1"}
    build = subprocess.run(build_command, shell=True, cwd=source, capture_output=True, text=True, timeout=TIMEOUT,
                           env=env)
    assert build.returncode == 0, f"$ {build_command}\n{build.stdout}{build.stderr}"
    (wheel,) = (source / "dist").glob("aiayn-*.whl")
    elsewhere.mkdir()
    shutil.copy(wheel, elsewhere)
    shutil.copy(REPO / "requirements.lock", elsewhere)
    assert wheel.name in install_command, (wheel.name, install_command)
    install = subprocess.run(install_command, shell=True, cwd=elsewhere, capture_output=True, text=True,
                             timeout=INSTALL_TIMEOUT, env=env)
    assert install.returncode == 0, f"$ {install_command}\n{install.stdout}{install.stderr}"
    return environment


def clean_environment(environment: Path | None = None) -> dict[str, str]:
    """This process's environment without what would reach the clone's sources (PYTHONPATH, a venv)."""
    env = {key: value for key, value in os.environ.items() if key not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    path = [entry for entry in env.get("PATH", "").split(os.pathsep) if not entry.startswith(str(REPO))]
    if environment is not None:
        path.insert(0, str(environment / "bin"))
    return {**env, "PATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": "",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def work(installed, tmp_path_factory) -> Path:
    """A folder outside the clone (and outside any git repository) with a tiny corpus and a config."""
    folder = tmp_path_factory.mktemp("outside")
    assert not folder.resolve().is_relative_to(REPO)
    write_text_corpus(folder / "raw", (("train", 200), ("dev", 10), ("test", 10)))
    (folder / "config.yaml").write_text(CONFIG)
    return folder


def aiayn(installed: Path, work: Path, *args: str, stdin: str | None = None) -> str:
    result = subprocess.run([str(installed / "bin" / "aiayn"), *args], cwd=work, input=stdin, capture_output=True,
                            text=True, timeout=TIMEOUT, env=clean_environment(installed))
    assert result.returncode == 0, f"aiayn {' '.join(args)}:\n{result.stdout}{result.stderr}"
    print(f"$ aiayn {' '.join(args)}\n{result.stdout}")
    return result.stdout


def installed_python(installed: Path, work: Path, code: str) -> str:
    result = subprocess.run([str(installed / "bin" / "python"), "-c", code], cwd=work, capture_output=True, text=True,
                            timeout=TIMEOUT, env=clean_environment(installed))
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_installed_files_are_what_runs(installed, work):
    where = Path(installed_python(installed, work, "import aiayn; print(aiayn.__file__)"))
    assert where.is_relative_to(installed)
    assert not where.is_relative_to(REPO)


def test_help_and_the_papers_presets_by_name(installed, work):
    assert "commands:" in aiayn(installed, work, "--help")
    table = aiayn(installed, work, "params", "base")
    assert "base" in table and "63,082,496" in table  # at the paper's vocabulary of 37000


def test_every_stage_runs_from_the_wheel_outside_the_clone(installed, work):
    stage = lambda *args, **kwargs: aiayn(installed, work, *args, **kwargs)  # noqa: E731
    stage("download", "--config", "config.yaml", "--out-dir", "data")
    stage("bpe", "--config", "config.yaml", "--out-dir", "bpe", "--threads", "1", "data/train.en", "data/train.de")
    for split in ("train", "dev"):
        stage("binarize", "--config", "config.yaml", "--split", split, "--src", f"data/{split}.en",
              "--tgt", f"data/{split}.de", "--spm-model", "bpe/spm.model", "--out-dir", f"bin/{split}", "--workers", "1")
    # the preset resolved by the installed package, as the train stage reads it
    preset = installed_python(installed, work, (
        "from aiayn.config import load_config, resolve_preset, to_json; "
        "print(to_json(resolve_preset(load_config(['config.yaml']), 'tiny')))"))
    assert json.loads(preset)["dropout"] == 0.1  # inherited from the paper's base
    stage("train", "--config", "config.yaml", "--preset", "tiny", "--seed", "1", "--train-data", "bin/train",
          "--dev-data", "bin/dev", "--spm-model", "bpe/spm.model", "--run-dir", "run", "--no-tracking",
          "--device", "cpu", "--threads", "1")
    stage("average", "--last", "2", "--checkpoint-dir", "run/checkpoints", "--output", "average/model.pt")
    stage("decode", "--config", "config.yaml", "--model", "average/model.pt", "--spm-model", "bpe/spm.model",
          "--input", "data/test.en", "--output", "decode/test.de", "--threads", "1", "--device", "cpu")
    assert len((work / "decode" / "test.de").read_text(encoding="utf-8").splitlines()) == 10
    translation = stage("translate", "--model", "average/model.pt", "--spm-model", "bpe/spm.model", "--device", "cpu",
                        "--threads", "1", "--beam", "2", "--max-len-b", "10", stdin="the man sees the dog .\n")
    assert len(translation.splitlines()) == 1
    score = json.loads(stage("score", "--hyp", "decode/test.de", "--ref", "data/test.de", "--lang", "de", "--json"))
    assert "bleu" in json.dumps(score).lower()
    stage("export", "--model", "average/model.pt", "--spm-model", "bpe/spm.model", "--format", "ctranslate2",
          "--out", "export/ctranslate2")
    assert (work / "export" / "ctranslate2" / "model.bin").is_file()

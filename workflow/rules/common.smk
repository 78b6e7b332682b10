# Helpers, paths and target lists shared by the rules (no rules here).
import sys
from pathlib import Path

sys.path.insert(0, str(Path(workflow.basedir) / "src"))

from aiayn.config import check_config, resolve_preset, to_json
from aiayn.errors import UserError
from aiayn.joblog import print_job_messages, snapshot_logs


def config_sources():
    """The files whose merge is `config`, in order, for error messages that name the file."""
    def shown(path):
        path = Path(path).resolve()
        return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)

    sources = [shown(Path(workflow.basedir) / "config" / "config.yaml")]
    sources += [shown(path) for path in workflow.overwrite_configfiles]
    if workflow.config_settings.config:
        sources.append("--config")
    return sources


# Validate once, before any job: one message naming the file and key, exit status 2.
try:
    _validated = check_config(config, config_sources())
except UserError as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)
config.clear()
config.update(_validated)

RESULTS = f"results/{config['experiment']}"
SRC = config["data"]["src_lang"]
TGT = config["data"]["tgt_lang"]
SPLITS = ["train", "dev", "test"]
PRESETS = {name: resolve_preset(config, name) for name in config["models"]}
# The logs as they were before any job ran: what changed was written by this run's jobs.
LOGS_AT_START = snapshot_logs(f"{RESULTS}/logs")


wildcard_constraints:
    model="|".join(sorted(PRESETS)),
    seed=r"\d+",
    split="train|dev|test",


def attempt_number(wildcards, attempt):
    """Snakemake's attempt of a job (1, then 2, ... on retries), as a resource so that a rule's shell
    command can pass it on: `aiayn --log {log} --attempt {resources.attempt} <stage> ...` does not run a
    retry of a command whose last attempt ended with a user error (aiayn/joblog.py)."""
    return attempt


def show_job_messages(failed):
    """At the end of a run, every error and warning paragraph of the logs this run's jobs wrote, once
    each: a SLURM job's output never reaches this terminal, and a local job's is in its log."""
    print_job_messages(f"{RESULTS}/logs", LOGS_AT_START, failed)


def preset(wildcards):
    return PRESETS[wildcards.model]


def run_dir(wildcards):
    return f"{RESULTS}/train/{wildcards.model}/seed{wildcards.seed}"


def runs():
    """Every (model, seed) pair the config asks for."""
    return [(model, seed) for model in config["models"] for seed in config["seeds"]]


def score_outputs():
    return [
        f"{RESULTS}/score/{model}/seed{seed}/{split}.json"
        for model, seed in runs()
        for split in ("dev", "test")
    ]


def report_outputs():
    tables = [f"{RESULTS}/report/{table}.{ext}" for table in ("table2", "table3") for ext in ("csv", "md")]
    figures = ["dev_ppl", "table3_bleu", "attention_long_distance", "attention_anaphora"]
    return tables + [f"{RESULTS}/report/{figure}.png" for figure in figures]

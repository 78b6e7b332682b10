# Helpers, paths and target lists shared by the rules (no rules here).
import os
import subprocess
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake_interface_executor_plugins.settings import ExecMode

from aiayn import layout
from aiayn.config import (ConfigOverrides, check_config_files, read_config, resolve_presets,
                          schema_default, to_json, write_resolved)
from aiayn.errors import UserError
from aiayn.joblog import print_job_messages, print_reported_models, snapshot_logs
from aiayn.costs import CHECKPOINT_BYTES_PER_PARAMETER, parameters
from aiayn.train.rendezvous import nodes_of


def config_files():
    """The files whose merge is `config`, in order: the --configfile files, or the demo's
    config/config.yaml when none is given (the Snakefile)."""
    def shown(path):
        path = Path(path).resolve()
        return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)

    files = workflow.overwrite_configfiles or workflow.configfiles or [DEMO_CONFIG]
    return [shown(path) for path in files]


def config_sources():
    """The config files, then any --config overrides, for error messages that name where a value was set."""
    overrides = workflow.config_settings.config
    return config_files() + ([ConfigOverrides(overrides)] if overrides else [])


def all_cores():
    """The cores Snakemake was given (--cores), for a rule that uses them all; 1 where it has none, as for
    --unlock, --summary and --report, which run no job (a run without --cores is refused by Snakemake)."""
    try:
        return workflow.cores
    except WorkflowError:
        return 1


# The jobs run the `aiayn` of the Python that runs Snakemake (.venv/bin/snakemake works without an
# activated environment; a cluster job runs Snakemake again, which does the same): its bin folder first.
os.environ.update(PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


# Validate once, before any job, through the one door every stage reads its settings by (read_config): one
# message naming the file and key, exit status 2. The files first, as Snakemake's reader keeps the last of
# a key given twice without a word; then the schema's defaults fill every key the config files leave out.
try:
    check_config_files(config_files())
    _validated = read_config(merged=config, sources=config_sources())
except UserError as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)
config.clear()
config.update(_validated)

RESULTS = f"results/{config['experiment']}"
SRC = config["data"]["src_lang"]
TGT = config["data"]["tgt_lang"]
PRESETS = resolve_presets(config)
# The config as read, resolved, for the jobs: each reads its settings from it through the same door
# (`--config {SETTINGS}`). One fixed path, which each rule's command names when the file is parsed (a
# module's shell cannot see this workflow's names): the commands' text stays the same whatever the config
# holds, so a setting that changes no output (RUNTIME_ONLY) changes neither a rule's code nor its params,
# and its jobs rerun only for what their params hold.
SETTINGS = f"{RESULTS}/config/resolved.yaml"
# Written (where its text changes) by the process that plans the jobs, before any job, on any executor: a
# cluster job reads it on its node. Never in a dry run (-n writes nothing), nor in a job's own Snakemake
# process, which parses this file again on its node. Not in onstart: Snakemake runs no onstart of a module
# (README, "Use the workflow from your own repository") nor any under --no-hooks, where the jobs would read a
# stale file.
if not workflow.output_settings.dryrun and workflow.exec_mode == ExecMode.DEFAULT:
    write_resolved(config, SETTINGS)
# The logs as they were before any job ran: what changed was written by this run's jobs.
LOGS_AT_START = snapshot_logs(f"{RESULTS}/logs")


wildcard_constraints:
    model="|".join(sorted(PRESETS)),
    seed=r"\d+",
    split="|".join(layout.SPLITS),
    format="ctranslate2|huggingface",


# Every path is written once: the rule that makes a file names it with these helpers, and the rules
# that read it take it from that rule's output (rules.<name>.output), never spell it again. The names
# of the files inside a stage's folder are aiayn.layout's, which the stage itself writes and reads.
def data_text(split="{split}", lang="{lang}"):
    """A split's plain text, one sentence a line (the download stage's output)."""
    return f"{RESULTS}/data/{layout.text_name(split, lang)}"


def run_file(name):
    """A file of one training run, results/<experiment>/train/<model>/seed<seed>/<name>."""
    return f"{RESULTS}/train/{{model}}/seed{{seed}}/{name}"


def log_file(*parts):
    """A job's log: results/<experiment>/logs/<parts joined by />.log (one per stage, or per run and split)."""
    return f"{RESULTS}/logs/{'/'.join(parts)}.log"


RUN_LOG = ("{model}", "seed{seed}")  # the log parts of a per-run job


def for_run(template, wildcards):
    """A rule's output template with the wildcards of a job (or a dict of them) filled in."""
    return template.format(**dict(wildcards.items()))


def export_dir(engine="{format}"):
    """A run's averaged model in another engine's format (aiayn export), a folder."""
    return f"{RESULTS}/export/{{model}}/seed{{seed}}/{engine}"


def decode_model(wildcards):
    """The paper's protocol: Table 3 (dev) without averaging, Table 2 (test) with it: the average stage's
    model, which is the last checkpoint where the average was worse on dev (average.choose: dev)."""
    made_by = rules.train.output.model if wildcards.split == "dev" else rules.average.output.model
    return for_run(made_by, wildcards)


# Settings that change how a job runs but none of its outputs. A rule passes them as resources,
# which rerun nothing when they change; its params, which Snakemake compares with the last run's,
# hold the rest of the section (output_settings), so a change there reruns the job and what follows.
# The train job reads dev BLEU's, the divergence rules' and the reference's keys from the resolved config
# (SETTINGS): they add metrics and a comparison and can stop a run that diverged, but change no checkpoint
# of one that does not.
RUNTIME_ONLY = {"train": ("log_every", "threads", "share_gpus", "dev_bleu_sentences", "dev_bleu_beam", "spike_window",
                          "spike_sigmas", "reference", "off_course", "off_course_margin",
                          "off_course_evaluations"), "binarize": ("workers",),
                "decode": ("workers", "max_source_tokens")}


# Settings added after runs were made: left out of a rule's params while at the schema's default, so that
# an upgrade does not rerun a job finished before they existed (the job reads the default all the same).
ADDED_SETTINGS = {"train": ("shape_buckets", "attention")}


def output_settings(section):
    """A config section as a rule's params: its settings that can change an output, as JSON."""
    added = ADDED_SETTINGS.get(section, ())
    return to_json({key: value for key, value in config[section].items() if key not in RUNTIME_ONLY[section]
                    and not (key in added and value == schema_default(f"{section}.{key}"))})


def local_inputs():
    """The user's own files under data.source local (their edits rerun the download and what follows)."""
    if config["data"]["source"] != "local":
        return []
    splits = config["data"]["local"].values()
    return [path for split in splits if split for path in split.values()]


def attempt_number(wildcards, attempt):
    """Snakemake's attempt of a job (1, then 2, ... on retries), as a resource so that a rule's shell
    command can pass it on: `aiayn --log {log} --attempt {resources.attempt} <stage> ...` does not run a
    retry of a command whose last attempt ended with a user error (aiayn/joblog.py)."""
    return attempt


def show_job_messages(failed):
    """At the end of a run, every error and warning paragraph of the logs this run's jobs wrote, once
    each: a SLURM job's output never reaches this terminal, and a local job's is in its log."""
    print_job_messages(f"{RESULTS}/logs", LOGS_AT_START, failed)


def preflight():
    """`aiayn preflight` (the disk, time and traps of the workflow) before the first job of one whose presets ask
    for GPUs, run by the Snakefile's onstart: in the process that plans the jobs, neither in a dry run (-n) nor
    in a job, nor when nothing is to be done. Its refusal stops the workflow with its status, before any job."""
    if not any(preset["gpus"] for preset in PRESETS.values()):
        return
    command = [sys.executable, "-m", "aiayn.cli", "preflight", "--config", SETTINGS, "--results", RESULTS]
    status = subprocess.run(command).returncode
    if status:
        sys.exit(status)


def show_reported_models():
    """At the end of a run that succeeded, one line a run: the model its Table 2 row reports (the average of its
    last checkpoints, or its last checkpoint, and the dev figures that chose it), from its average.json."""
    names = [f"{model} seed {seed}" for model, seed in runs()]
    print_reported_models(dict(zip(names, for_every_run(rules.average.output.summary))))


def show_report_folder():
    """Where a finished run's tables and figures are, as the last line a user sees."""
    folder = Path(rules.report.output.table2_md).parent
    if folder.is_dir():
        print(f"The report (Table 2, Table 3, figures): {folder}/ (e.g. {rules.report.output.table2_md})")


def preset(wildcards):
    return PRESETS[wildcards.model]


def cluster_request(wildcards):
    """What a training job asks the cluster for, as snakemake-executor-plugin-slurm's resources (the slurm
    profile says what each becomes). One node, as ever: `gpu` (--gpus=N) and `cpus_per_gpu`. Several (the
    preset's `nodes`): --nodes=N and one task a node (`tasks`, under `mpi`, with which the plugin runs the
    job's command as it is: its own srun starts a torchrun agent on each node, aiayn/train/rendezvous.py);
    the GPUs as GRES, which is per node (--gpus=N would be the job's total, spread as SLURM likes), with
    `tasks_per_gpu: 0` so that `tasks` is not read as tasks per GPU; 8 CPUs a GPU for each node's task.
    What a job does not ask for is None, which Snakemake drops."""
    gpus, nodes = preset(wildcards)["gpus"], nodes_of(preset(wildcards))
    if nodes == 1:
        return {"nodes": 1, "gpu": gpus, "cpus_per_gpu": 8 if gpus else 0}
    return {"nodes": nodes, "tasks": nodes, "mpi": "srun", "gres": f"gpu:{gpus}" if gpus else None,
            "tasks_per_gpu": 0 if gpus else None, "cpus_per_task": 8 * gpus if gpus else None}


def cluster_resource(name):
    """One resource of cluster_request, for a rule's `resources:`."""
    return lambda wildcards: cluster_request(wildcards).get(name)


# What the jobs after training ask the cluster for, from the run's model: its parameters (as `aiayn params`
# counts them) and, for average, the checkpoints it reads. docs/cluster.md ("Jobs sized by the model") gives
# where each figure comes from and the measurement of big's average job. Each estimate of minutes is doubled
# and rounded up, so that a slow file system or a busy node does not meet the time limit.
AVERAGE_SECONDS_PER_GB = 20          # a checkpoint read from a slow shared file system, loaded and summed
AVERAGE_BYTES_PER_PARAMETER = 32     # average's peak host memory: the float64 sum, one checkpoint, two models
HOST_MB = 4000                       # a job's Python, torch and CUDA libraries
EVAL_SENTENCES = 3003                # newstest2014, the largest split the paper's configs evaluate
CPU_FLOPS_PER_CORE = 1e10            # a forward pass on one core, well below a core's matmul peak
CPU_DECODE_SECONDS = 0.0067          # one WMT sentence, beam 4, on decode's 2 cores, per million parameters


def model_parameters(wildcards):
    """The parameters of a run's model, counted from its preset as `aiayn params` counts them."""
    return parameters(preset(wildcards), config["bpe"]["vocab_size"])


def _rounded_up(value, step):
    return int(-(-value // step) * step)


def average_request(wildcards):
    """An average job: one GPU for its dev evaluation where the preset trained on GPUs (`gpus` >= 1; a
    minute or less there) and 4 cores to read and sum the checkpoints; else a core for every 25M parameters
    (up to 8), for two forward passes of up to EVAL_SENTENCES pairs of about 60 tokens (2 FLOPs a parameter
    a token). Minutes for its start, for its `average_last` checkpoints and for that evaluation."""
    parameters, on_gpu = model_parameters(wildcards), preset(wildcards)["gpus"] >= 1
    threads = 4 if on_gpu else min(8, 1 + parameters // 25_000_000)
    read_gb = preset(wildcards)["average_last"] * CHECKPOINT_BYTES_PER_PARAMETER * parameters / 1e9
    dev_minutes = 5 if on_gpu else 2 * EVAL_SENTENCES * 60 * 2 * parameters / (CPU_FLOPS_PER_CORE * threads) / 60
    minutes = 5 + read_gb * AVERAGE_SECONDS_PER_GB / 60 + dev_minutes
    return {"gpu": int(on_gpu), "threads": threads, "runtime": _rounded_up(2 * minutes, 10),
            "mem_mb": _rounded_up(HOST_MB + AVERAGE_BYTES_PER_PARAMETER * parameters / 1e6, 1000)}


def decode_request(wildcards):
    """A decode job: one GPU where the preset trained on GPUs, on which newstest2014 takes minutes for every
    paper preset; on the CPU, CPU_DECODE_SECONDS a sentence per million parameters. Its host memory holds the
    model twice (file and network, 8 bytes a parameter): 16 GB does for any model under 1.5 billion."""
    parameters, on_gpu = model_parameters(wildcards), preset(wildcards)["gpus"] >= 1
    minutes = 30 if on_gpu else EVAL_SENTENCES * CPU_DECODE_SECONDS * parameters / 1e6 / 60
    return {"gpu": int(on_gpu), "runtime": max(60, _rounded_up(2 * minutes, 10)),
            "mem_mb": max(16000, _rounded_up(HOST_MB + 8 * parameters / 1e6, 1000))}


def request_resource(request, name):
    """One value of average_request or decode_request, for a rule's `threads:` or `resources:`."""
    return lambda wildcards: request(wildcards)[name]


def runs():
    """Every (model, seed) pair the config asks for, in config order."""
    return [(model, seed) for model in config["models"] for seed in config["seeds"]]


def for_every_run(template, **wildcards):
    """A per-run template for every run of runs(), in that order (more wildcards, e.g. split, fixed)."""
    return [template.format(model=model, seed=seed, **wildcards) for model, seed in runs()]

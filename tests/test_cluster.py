"""The SLURM profile against a real SLURM of two nodes on this host: jobs go through sbatch, a training job
that SLURM stops is resumed by Snakemake's retry, the results equal those of a local run, and a preset of
two nodes trains as one job with a torchrun agent on each node.

The cluster (tests/slurm_cluster.py) is installed with apt-get when missing and we are root, and
started on localhost; elsewhere these tests skip, except under CI (``CI`` set), where they fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from conftest import REPO, write_text_corpus
from slurm_cluster import PARTITION, ClusterUnavailable, LocalCluster

pytestmark = pytest.mark.workflow

# The demo shrunk to one model, so that a run through SLURM takes a minute or two.
OVERRIDE = """
data: {demo: {seed: 3, train: 1500, dev: 40, test: 40}}
bpe: {vocab_size: 400}
train: {tokens_per_step: 1500, device_tokens: 1500, log_every: 5, dev_every: 10, threads: 1}
decode: {beam_size: 2, tokens_per_batch: 2000, max_len_b: 10}
models: [demo_base]
presets:
  demo_base: {steps: 20, warmup_steps: 5, checkpoint_steps: 5, d_model: 64, d_ff: 128, n_layers: 1}
"""
RULES = ("download", "bpe", "binarize", "train", "average", "decode", "score", "report")
# The short stages before and after training go as one SLURM job each: every SLURM job costs
# two Snakemake start-ups and the plugin's status polling (10 s more at each poll that finds
# nothing finished), which for eleven jobs in a row would be minutes. Training is a job of its own.
GROUPS = ["--groups", *(f"{rule}=prepare" for rule in ("download", "bpe", "binarize")),
          *(f"{rule}=evaluate" for rule in ("average", "decode", "score", "report"))]
RUN = Path("results/demo/train/demo_base/seed1")


def copy_workflow(workdir: Path) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    for name in ("Snakefile", "workflow", "config"):
        source = REPO / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, workdir / name)
    # the profiles a test names; the workflow profile, profiles/default, stays out (tests/test_config.py runs it)
    shutil.copytree(REPO / "profiles", workdir / "profiles", ignore=shutil.ignore_patterns("default"))
    (workdir / "override.yaml").write_text(OVERRIDE)
    return workdir


def snakemake_command(*args) -> list[str]:
    return [sys.executable, "-m", "snakemake", *args]


def environment() -> dict[str, str]:
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def cluster_profile(workdir: Path, cluster: LocalCluster) -> Path:
    """profiles/slurm with what this one small node needs, and nothing else changed."""
    profile = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    profile["default-resources"]["slurm_partition"] = PARTITION
    # the rules ask for a GPU node's memory (64 GB to train); this node has less
    profile["set-resources"] = {rule: {"mem_mb": 500} for rule in RULES}
    profile["cores"] = cluster.cpus
    # a job here takes seconds, not hours: the plugin's first look at the queue comes 6 s after
    # a submission, not 40 (each look that finds nothing finished waits 10 s longer than the last)
    profile["slurm-init-seconds-before-status-checks"] = 6
    profile["seconds-between-status-checks"] = 6
    profile["latency-wait"] = 5
    folder = workdir / "test-profile"
    folder.mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump(profile))
    return folder


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        cluster = LocalCluster(tmp_path_factory.mktemp("slurm"), nodes=2).start()
    except ClusterUnavailable as reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the SLURM tests: {reason}")
        pytest.skip(f"no local SLURM cluster: {reason}")
    yield cluster
    cluster.stop()


def running_job(comment: str) -> str | None:
    """The SLURM id of the running job whose comment (the plugin writes rule and wildcards) matches."""
    queue = subprocess.run(["squeue", "--noheader", "--states=RUNNING", "--format=%i|%k"],
                           capture_output=True, text=True, timeout=10).stdout
    for line in queue.splitlines():
        job_id, _, job_comment = line.partition("|")
        if job_comment.strip() == comment:
            return job_id.strip()
    return None


def preempt_training(workdir: Path, slurm: subprocess.Popen, timeout: float = 240) -> str:
    """SIGTERM to the training job's step, as SLURM sends at a time limit or a preemption,
    once it has logged progress; returns the SLURM id of the job that was stopped."""
    metrics = workdir / RUN / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and slurm.poll() is None:
        if metrics.exists() and metrics.read_text().strip():
            job_id = running_job("rule_train_wildcards_demo_base_1")
            if job_id:
                subprocess.run(["scancel", "--signal=TERM", job_id], check=True, timeout=30)
                return job_id
        time.sleep(0.2)
    raise AssertionError("the training job never logged progress:\n"
                         + (workdir / "snakemake.out").read_text()[-6000:])


def start_snakemake(workdir: Path, *args: str) -> subprocess.Popen:
    """Snakemake in the background, its output in <workdir>/snakemake.out (a pipe could fill up)."""
    with open(workdir / "snakemake.out", "w") as output:
        return subprocess.Popen(snakemake_command(*args), cwd=workdir, env=environment(), stdout=output,
                                stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    """The same DAG run twice at once: locally (the local profile) and through SLURM."""
    local_dir = copy_workflow(tmp_path_factory.mktemp("local"))
    slurm_dir = copy_workflow(tmp_path_factory.mktemp("slurm-run"))
    profile = cluster_profile(slurm_dir, cluster)
    started = time.monotonic()
    # the same cores for both: the BPE job takes them all as its threads
    local = start_snakemake(local_dir, "--profile", "profiles/local", "--cores", str(cluster.cpus),
                            "--configfile", "config/config.yaml", "override.yaml")
    slurm = start_snakemake(slurm_dir, "--profile", str(profile), "--configfile", "config/config.yaml", "override.yaml",
                            *GROUPS)
    try:
        preempted = preempt_training(slurm_dir, slurm)
        slurm.wait(timeout=900)  # bounds for a loaded machine, not expectations
        local.wait(timeout=600)
    finally:
        for process in (slurm, local):
            if process.poll() is None:
                process.kill()
                process.wait()
    print(f"local and SLURM runs took {time.monotonic() - started:.0f} s")
    local_log = (local_dir / "snakemake.out").read_text()
    slurm_log = (slurm_dir / "snakemake.out").read_text()
    assert local.returncode == 0, local_log[-4000:]
    assert slurm.returncode == 0, slurm_log[-6000:] + "\n" + cluster.log("slurmctld")[-2000:]
    return {"local": local_dir, "slurm": slurm_dir, "slurm_log": slurm_log, "preempted": preempted,
            "jobs": cluster.completed_jobs(),
            "records": {job_id: cluster.job_record(job_id) for job_id, _ in submitted(slurm_log)}}


def submitted(log: str) -> list[tuple[str, str]]:
    """(rule or group, SLURM job id) of every submission the plugin reported."""
    return re.findall(r"has been submitted with SLURM jobid (\d+) \(log: \S*/slurm_logs/(?:rule|group)_([a-z]+)", log)


def test_every_job_went_through_sbatch_and_slurm_ran_it(runs):
    jobs = submitted(runs["slurm_log"])
    assert sorted({name for _, name in jobs}) == ["evaluate", "prepare", "train"], jobs
    finished = {job["JobId"]: job for job in runs["jobs"]}
    for job_id, name in jobs:
        assert job_id in finished, f"{name} (SLURM job {job_id}) is not in slurmctld's completion log"
        assert finished[job_id]["WorkDir"] == str(runs["slurm"])
        if job_id != runs["preempted"]:
            assert finished[job_id]["JobState"] == "COMPLETED", finished[job_id]


def test_slurm_received_the_training_jobs_resources_from_the_profile(runs):
    """What slurmctld recorded for the training job: the rule's and the profile's resources."""
    train = next(job_id for job_id, name in submitted(runs["slurm_log"]) if name == "train")
    record = runs["records"][train]
    assert record["Comment"] == "rule_train_wildcards_demo_base_1"
    assert record["Partition"] == PARTITION
    assert record["TimeLimit"] == "00:30:00"     # runtime: the preset's runtime_minutes
    assert record["MinMemoryNode"] == "500M"     # mem_mb
    assert record["NumNodes"] == "1"             # nodes, from the profile's default-resources
    assert record["NumCPUs"] == "1"              # threads (train.threads in the override)
    assert record["Requeue"] == "1"              # slurm-requeue
    assert "gres/gpu" not in record["TRES"]      # the demo presets ask for no GPU


def test_a_training_job_stopped_by_slurm_is_retried_and_resumes(runs):
    trains = [job_id for job_id, name in submitted(runs["slurm_log"]) if name == "train"]
    assert len(trains) == 2 and trains[0] == runs["preempted"], trains
    stopped = next(job for job in runs["jobs"] if job["JobId"] == runs["preempted"])
    assert stopped["JobState"] == "FAILED"  # training stopped, so the job failed, and Snakemake retried it
    log = (runs["slurm"] / "results/demo/logs/train/demo_base/seed1.log").read_text()
    assert re.search(r"resuming from \S+(step|safety)_\d+\.pt \(step \d+\)", log), log[-2000:]


def test_slurm_and_local_runs_give_the_same_results(runs):
    local, slurm = runs["local"] / "results/demo", runs["slurm"] / "results/demo"
    compared = [path.relative_to(local) for pattern in ("data/*", "bin/*/*.npy", "bin/*/meta.json", "bpe/bpe.json",
                                                        "bpe/spm.vocab", "decode/*/*/*", "score/*/*/*")
                for path in sorted(local.glob(pattern))]
    assert len(compared) > 20
    for path in compared:
        assert (slurm / path).read_bytes() == (local / path).read_bytes(), path
    # training on the CPU with the same thread count is bitwise deterministic, across a resume too
    weights = [torch.load(root / "train/demo_base/seed1/final.pt", weights_only=True)["model"]
               for root in (local, slurm)]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name
    steps = [json.loads((root / "train/demo_base/seed1/final.json").read_text())["step"] for root in (local, slurm)]
    assert steps == [20, 20]
    for table, columns in (("table2", ["preset", "test_bleu_tok", "test_sacrebleu"]),
                           ("table3", ["preset", "dev_ppl", "dev_bleu_tok", "dev_sacrebleu"])):
        frames = [pd.read_csv(root / "report" / f"{table}.csv")[columns] for root in (local, slurm)]
        pd.testing.assert_frame_equal(frames[0], frames[1])


# the sbatch options of a paper preset on one node (base: 8 GPUs) and on two (8 GPUs each, one task a node)
SBATCH_OF = {"base": ("--gpus=8", "--cpus-per-gpu=8", "--mem 64000", "-t 1440", "--nodes=1", "-p local"),
             "base_2x8": ("--gres=gpu:8", "--cpus-per-task=64", "--ntasks=2", "--mem 64000", "-t 1440",
                          "--nodes=2", "-p local")}


@pytest.mark.parametrize("model", ["base", "base_2x8"])
def test_the_paper_training_job_asks_sbatch_for_the_presets_gpus(cluster, tmp_path, model):
    """The real submission of `base` (8 GPUs), or of `base` on 2 nodes, inputs stubbed and only `train`
    allowed to run: this GPU-less cluster makes sbatch refuse it, and Snakemake's error shows the sbatch
    call that a GPU cluster would have accepted. Only the partition is added to the profile's defaults."""
    workdir = copy_workflow(tmp_path)
    (workdir / "two_nodes.yaml").write_text("models: [base, base_2x8]\n"
                                            "presets: {base_2x8: {inherit: base, nodes: 2}}\n")
    results = workdir / "results" / "wmt14_en_de"
    for folder in ("bin/train", "bin/dev", "bpe"):
        (results / folder).mkdir(parents=True)
    (results / "bpe" / "spm.model").write_bytes(b"")
    command = snakemake_command("--profile", "profiles/slurm", "--configfile", "config/wmt14_en_de.yaml",
                                "two_nodes.yaml", "--allowed-rules", "train", "--retries", "0",
                                "--no-hooks",  # the preflight would refuse this workflow's stubbed inputs
                                "--cores", str(cluster.cpus), "--slurm-init-seconds-before-status-checks", "1",
                                "--seconds-between-status-checks", "1",
                                "--default-resources", f"slurm_partition={PARTITION}", "mem_mb=4000", "runtime=60",
                                "nodes=1", "--", f"results/wmt14_en_de/train/{model}/seed1/final.json")
    result = subprocess.run(command, cwd=workdir, env=environment(), capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    call = re.search(r"sbatch call:\s*\n\s*(sbatch .*)", output)
    assert call, output[-4000:]
    for option in SBATCH_OF[model]:
        assert f" {option} " in f" {call.group(1)} ", (option, call.group(1))
    unwanted = ("--cpus-per-task",) if model == "base" else ("--gpus=", "--cpus-per-gpu", "--ntasks-per-gpu")
    assert not any(option in call.group(1) for option in unwanted), call.group(1)
    assert "Requested node configuration is not available" in output or "Invalid generic resource" in output


def test_a_preset_of_two_nodes_is_one_slurm_job_with_a_torchrun_agent_on_each_node(runs, cluster):
    """The demo's data as the SLURM run left it, and its model on 2 nodes of the CPU (gloo): one sbatch job
    of 2 nodes and 2 tasks, whose command starts one srun task a node, each a torchrun agent, meeting at the
    first node. (Both nodes are this host, so it shows the shape of the job, not what 2 hosts would do.)"""
    workdir = runs["slurm"]
    (workdir / "two_nodes.yaml").write_text("models: [demo_2_nodes]\n"
                                            "presets: {demo_2_nodes: {inherit: demo_base, nodes: 2}}\n")
    result = subprocess.run(snakemake_command("--profile", "test-profile", "--configfile", "config/config.yaml",
                                              "override.yaml", "two_nodes.yaml", "--allowed-rules", "train",
                                              "--", "results/demo/train/demo_2_nodes/seed1/final.json"),
                            cwd=workdir, env=environment(), capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    log = workdir / "results/demo/logs/train/demo_2_nodes/seed1.log"
    assert result.returncode == 0, output[-4000:] + (log.read_text()[-4000:] if log.exists() else "")
    (job_id, name), = submitted(output)
    record = cluster.job_record(job_id)
    assert (name, record["NumNodes"], record["NumTasks"], record["NodeList"]) == ("train", "2", "2", "127.0.0.[1-2]")
    step = re.search(r"training on 2 nodes, 1 process each: (srun .*)", log.read_text())
    assert step, log.read_text()[-3000:]
    assert step.group(1).startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 "
                                    "--cpus-per-task=1 "), step.group(1)
    for option in ("--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=127.0.0.1:{10000 + int(job_id) % 10000}", f"--rdzv-id=aiayn-{job_id}"):
        assert f" {option} " in step.group(1), option
    summary = json.loads((workdir / "results/demo/train/demo_2_nodes/seed1/final.json").read_text())
    assert (summary["world_size"], summary["step"]) == (2, 20)


def dry_run_jobs(workdir: Path, *configfiles: str) -> dict[tuple[str, str], dict[str, str]]:
    """`snakemake -n` with the SLURM profile: (rule, wildcards) -> the resources each job shows, and its threads.
    The plugin prints no sbatch line in a dry run (Snakemake swaps in its dry-run executor), so these are
    what each job asks."""
    result = subprocess.run(snakemake_command("-n", "--profile", "profiles/slurm", "--configfile", *configfiles),
                            cwd=workdir, env=environment(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = {}
    for block in re.split(r"\n(?=rule \w+:)", result.stdout + result.stderr):
        rule = re.match(r"rule (\w+):", block)
        wildcards = re.search(r"wildcards: (.*)", block)
        threads = re.search(r"threads: (\d+)", block)
        resources = re.search(r"resources: (.*)", block)
        if rule and resources:
            jobs[rule.group(1), wildcards.group(1) if wildcards else ""] = dict(
                (item.split("=", 1) for item in resources.group(1).split(", ") if "=" in item),
                threads=threads.group(1) if threads else "1")
    return jobs


def test_a_dry_run_of_the_paper_shows_each_jobs_cluster_request(tmp_path):
    jobs = dry_run_jobs(copy_workflow(tmp_path), "config/wmt14_en_de.yaml")
    base, big = jobs["train", "model=base, seed=1"], jobs["train", "model=big, seed=1"]
    assert (base["gpu"], base["cpus_per_gpu"], base["runtime"], base["mem_mb"]) == ("8", "8", "1440", "64000")
    assert (big["gpu"], big["runtime"]) == ("8", "5760")
    assert sum(rule == "train" for rule, _ in jobs) == 20
    # every paper preset trains on GPUs, so its average (the dev evaluation) and decode jobs get one each
    assert all(fields["gpu"] == "1" for (rule, _), fields in jobs.items() if rule in ("average", "decode"))
    assert sum(rule == "average" for rule, _ in jobs) == 20
    light = [fields for (rule, _), fields in jobs.items() if rule not in ("train", "average", "decode", "all")]
    assert len(light) == 1 + 1 + 2 + 40 + 1  # download, bpe, binarize, score, report
    assert all("gpu" not in fields and fields["nodes"] == "1" for fields in light)


def test_the_demo_asks_for_no_gpu_and_small_jobs(tmp_path):
    """The demo's presets train on the CPU (gpus: 0): its average and decode jobs ask for cores, not a GPU,
    and average asks for little (its checkpoints are megabytes)."""
    jobs = dry_run_jobs(copy_workflow(tmp_path), "config/config.yaml")
    evaluation = {key: fields for key, fields in jobs.items() if key[0] in ("average", "decode")}
    assert len(evaluation) == 4 + 8
    assert all(fields["gpu"] == "0" for fields in evaluation.values())
    average = jobs["average", "model=demo_base, seed=1"]
    assert (average["threads"], average["mem_mb"], average["runtime"]) == ("1", "5000", "20")


class JobResources(dict):
    """A job's resources as the plugin reads them: ``.get(name)`` and ``.name``."""

    __getattr__ = dict.__getitem__


def sbatch_call(rule: str, shown: dict[str, str]) -> str:
    """The sbatch call snakemake-executor-plugin-slurm makes for a job that a dry run showed, rendered by the
    plugin's own code (the partition and account, which the profile leaves to the site, left empty)."""
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    resources = JobResources({key: int(value) if value.isdigit() else value for key, value in shown.items()
                              if "TBD" not in value and key in ("runtime", "mem_mb", "nodes", "tasks", "mpi", "gres",
                                                                "tasks_per_gpu", "cpus_per_task", "cpus_per_gpu",
                                                                "gpu")})
    job = types.SimpleNamespace(resources=resources, threads=int(shown["threads"]))
    return get_submit_command(job, {"run_uuid": "u", "slurm_logfile": "log", "comment_str": f"rule_{rule}",
                                    "account": "", "partition": "", "workdir": "."}) + set_gres_string(job)


def test_a_dry_run_shows_the_sbatch_call_of_a_preset_of_two_nodes_without_a_cluster(tmp_path):
    """The resources a dry run of base on 2 nodes shows, rendered by the plugin's own code into the sbatch
    call it would make (where test_the_paper_training_job_asks_sbatch_for_the_presets_gpus has no SLURM)."""
    workdir = copy_workflow(tmp_path)
    (workdir / "two_nodes.yaml").write_text("models: [base_2x8]\npresets: {base_2x8: {inherit: base, nodes: 2}}\n")
    shown = dry_run_jobs(workdir, "config/wmt14_en_de.yaml", "two_nodes.yaml")["train", "model=base_2x8, seed=1"]
    assert shown["mpi"] == "srun"  # the job step runs the command itself (its srun reaches both nodes)
    call = sbatch_call("train", shown)
    for option in SBATCH_OF["base_2x8"][:-1]:  # all but the partition, which the profile leaves to the site
        assert f" {option} " in f" {call} ", (option, call)
    assert not any(option in call for option in ("--gpus=", "--cpus-per-gpu", "--ntasks-per-gpu")), call


def test_a_user_error_in_a_slurm_job_is_shown_once_and_not_retried(cluster, tmp_path):
    """A BPE job that refuses its settings, through sbatch: its message reaches the login node's terminal
    (a SLURM job's own output never does), and the retry (one here, to be quick) ends at once. (Download,
    before it, runs where Snakemake runs.)"""
    workdir = copy_workflow(tmp_path)
    profile = cluster_profile(workdir, cluster)
    (workdir / "broken.yaml").write_text(json.dumps({"bpe": {"vocab_size": 100000}}))
    result = subprocess.run(snakemake_command("--profile", str(profile),
                                              "--configfile", "config/config.yaml", "override.yaml", "broken.yaml",
                                              "--retries", "1"),
                            cwd=workdir, env=environment(), capture_output=True, text=True, timeout=600)
    terminal = result.stdout + result.stderr
    assert result.returncode != 0
    assert [name for _, name in submitted(terminal)] == ["bpe", "bpe"], terminal[-4000:]
    assert terminal.count("error: bpe.vocab_size = 100000 is more than the training data") == 1, terminal[-4000:]
    log = (workdir / "results/demo/logs/bpe.log").read_text()
    assert log.count("error: ") == 1 and "attempt 2 of this command not run: attempt 1 ended with a user error" in log


def test_download_runs_where_snakemake_runs_under_the_slurm_profile(tmp_path):
    """The one job that reaches the internet is a local rule: under the SLURM profile it runs in Snakemake's
    own process (the login node), never through sbatch, where compute nodes may have no internet. No SLURM
    is needed to see it: a job sent to sbatch here would fail."""
    workdir = copy_workflow(tmp_path)
    result = subprocess.run(snakemake_command("--profile", "profiles/slurm", "--configfile", "config/config.yaml",
                                              "override.yaml", "--slurm-init-seconds-before-status-checks", "1",
                                              "--", "results/demo/data/stats.json"),
                            cwd=workdir, env=environment(), capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "localrule download:" in output and not submitted(output), output[-4000:]
    assert json.loads((workdir / "results/demo/data/stats.json").read_text())["splits"]["dev"]["pairs_written"] == 40


def stated_sbatch_rows() -> dict[str, str]:
    """docs/cluster.md, "Jobs sized by the model": the table of what each job after training asks sbatch for."""
    section = (REPO / "docs" / "cluster.md").read_text().split("## Jobs sized by the model", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^ *\| (\w+), (\w+) \| `(sbatch [^`]*)` \|", section, re.M)
    return {f"{rule} {model}": call for rule, model, call in rows}


def test_big_and_base_evaluation_jobs_ask_sbatch_for_what_the_cluster_page_states(tmp_path):
    """The average, decode and score jobs of base and big, from a dry run of the paper's config rendered by
    the plugin's own code into their sbatch calls: every option docs/cluster.md's table states is there, and
    score asks for no GPU."""
    stated = stated_sbatch_rows()
    assert set(stated) == {f"{rule} {model}" for rule in ("average", "decode", "score") for model in ("base", "big")}
    jobs = dry_run_jobs(copy_workflow(tmp_path), "config/wmt14_en_de.yaml")
    for name, options in stated.items():
        rule, model = name.split()
        wildcards = f"model={model}, seed=1" + ("" if rule == "average" else ", split=test")
        call = sbatch_call(rule, jobs[rule, wildcards])
        for option in re.findall(r"-\S+(?: (?!-)\S+)?", options.removeprefix("sbatch ")):
            assert f" {option} " in f" {call} ", (name, option, call)
        assert ("--gpus=" in call) == (rule != "score"), (name, call)


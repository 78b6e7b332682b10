"""bench/gpu.sh, the check of a GPU node, run end to end at toy sizes on the CPU, so that a cluster's GPU
time is never spent on a typo; and the wheel set that it installs where the node's Python lacks it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

from bench.gpu import wheels as gpu_wheels
from bench.train import gpu as train_gpu

pytestmark = pytest.mark.workflow

# in the order they run: the compiled steps last, with the time the others leave
PARTS = ["1. bf16 matmul ceiling", "2. demo DAG on cpu", "3. DDP", "4a. training steps, eager",
         "5. beam-search decoding", "6. the Multi30k recipe end to end on cpu", "4b. training steps, compiled"]


@pytest.fixture(scope="module")
def cpu_check(tmp_path_factory):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_WORK": str(tmp_path_factory.mktemp("gpu_check")),
           "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    for name in ("MLFLOW_TRACKING_URI", "GPU_CHECK_PARTS", "GPU_CHECK_SECONDS"):
        env.pop(name, None)
    result = subprocess.run(["bash", str(REPO / "bench" / "gpu.sh"), "--device", "cpu"], env=env,
                            capture_output=True, text=True, timeout=900)
    return result


def test_every_part_runs_in_order_and_none_fails(cpu_check):
    assert cpu_check.returncode == 0, cpu_check.stdout[-6000:] + cpu_check.stderr[-2000:]
    starts = [cpu_check.stdout.find(f"== {part}") for part in PARTS]
    assert -1 not in starts and starts == sorted(starts)
    assert "0 part(s) failed" in cpu_check.stdout


def test_the_matmul_ceiling_is_printed(cpu_check):
    assert re.search(r"bf16 matmul ceiling: [\d.]+ TFLOP/s", cpu_check.stdout)


def test_the_dag_trains_decodes_tracks_and_ends_in_the_report_tables(cpu_check):
    out = cpu_check.stdout.split("== 2. demo DAG")[1].split("== 3. DDP")[0]
    assert re.search(r"gpu_base seed 1: 6 of 6 steps \(stopped by steps\) on cpu in [\d.]+ s of training", out)
    assert len(re.findall(r"decoded \d+ sentences .* on cpu", out)) == 2  # dev and test
    assert re.search(r"mlflow \(mlflow.db\): experiment gpu_check: \d+ runs FINISHED", out)
    for table in ("table2", "table3"):
        assert f"== results/gpu_check/report/{table}.md" in out
    tables = out.split("== results/gpu_check/report/table2.md")[1]
    assert "gpu_base" in tables and "|" in tables


def test_ddp_sees_the_same_real_tokens_per_step_as_one_process_and_every_process_exits(cpu_check):
    out = cpu_check.stdout
    for world in (1, 2):
        assert re.search(rf"^{world} process\(es\) on cpu: 3 steps.*; every process exited, [\d.]+ s after its "
                         r"final.json$", out, re.MULTILINE)
    assert "DDP: the same real tokens per step in 1 and 2 processes" in out


STEP_LINE = (r"tiny {step}, attention {attention}, {batches} batches: first step [\d.]+ s; cold [\d.]+ s/step "
             r"\(1 steps on new shapes\), warm [\d.]+ s/step \(the same, 1x\): \d+ -> \d+ tok/s; "
             r"warm step/floor [\d.]+")


def test_training_steps_are_timed_cold_and_warm_on_the_trainers_batches_eager_then_compiled(cpu_check):
    out = cpu_check.stdout
    assert re.search(r"real batches: 3000 pairs of log-normal lengths \(median 24, sigma 0.6\), cut on "
                     r"(bucketed|exact) lengths.*: \d+ steps, \d+ distinct micro-batch shapes in the epoch", out)
    lines = [re.search(STEP_LINE.format(step=step, attention="auto", batches=batches), out)
             for step, batches in (("eager", "real"), ("eager", "synthetic"), (r"compiled \(eager\)", "real"))]
    assert all(lines) and lines[0].start() < lines[1].start() < lines[2].start()


def test_each_attention_choice_is_timed(cpu_check):
    out = cpu_check.stdout
    for choice in ("cudnn", "flash", "efficient"):
        assert re.search(STEP_LINE.format(step="eager", attention=choice, batches="real"), out)
    assert re.search(r"train.attention, tiny on real batches: fastest warm step \w+ \([\d.]+ s; auto [\d.]+, "
                     r"cudnn [\d.]+, flash [\d.]+, efficient [\d.]+\)", out)


def test_the_steps_end_in_one_table(cpu_check):
    out = cpu_check.stdout
    table = out.split("== training steps (parts 4a and 4b)")[1].split("== gpu check done")[0]
    rows = [line for line in table.splitlines() if line.startswith("| tiny |")]
    assert any("| compiled (eager) | auto | real |" in row for row in rows)
    assert any("| eager | auto | synthetic |" in row for row in rows)


def test_the_multi30k_recipe_runs_end_to_end_on_its_files(cpu_check):
    out = cpu_check.stdout.split("== 6. the Multi30k recipe")[1].split("== 4b.")[0]
    assert re.search(r"m30k_base seed 1: 6 of 6 steps \(stopped by steps\) on cpu in [\d.]+ s of training", out)
    assert len(re.findall(r"decoded \d+ sentences .* on cpu", out)) == 2  # dev and test
    assert re.search(r"multi30k m30k_base seed 1: 6 of 6 steps in [\d.]+ s of training, test sacreBLEU [\d.]+ "
                     r"\(dev [\d.]+\)", out)


def test_decoding_speed_is_printed(cpu_check):
    assert re.search(r"decode: [\d.]+ sentences/s, \d+ target tokens/s", cpu_check.stdout)


def test_the_wheels_carry_what_the_gpu_image_lacks_and_nothing_it_has():
    carried = gpu_wheels.carried()
    assert {"snakemake", "mlflow-skinny", "mlflow-tracing", "sqlalchemy", "alembic", "sacremoses"} <= set(carried)
    assert not {"torch", "pandas", "numpy", "sentencepiece", "sacrebleu", "pulp", "mlflow"} & set(carried)
    lock = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        name, version = line.split("==")
        lock[gpu_wheels.normalise(name)] = version
    assert all(lock[name] == version for name, version in carried.items())


def test_a_compile_is_skipped_or_stopped_when_its_time_is_short_and_the_table_says_so(tmp_path, capsys):
    results = tmp_path / "steps.jsonl"
    common = ["measure", "--device", "cpu", "--presets", "tiny", "--batches", "real", "--compile", "--results",
              str(results)]
    assert train_gpu.main([*common, "--seconds", "30", "--min-seconds", "60"]) == 0  # under its minimum: no child
    assert train_gpu.main([*common, "--seconds", "1", "--min-seconds", "0"]) == 0  # a child, stopped after 1 s
    out = capsys.readouterr().out
    assert "tiny compiled (inductor): skipped, 30 s left of this part, under the 60 s a compile is given" in out
    assert "tiny compiled (inductor): not done after 1 s, stopped: no compiled figure" in out
    assert train_gpu.main(["table", "--results", str(results)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert "| tiny | compiled (inductor) | | | skipped: 30 s left |" in rows[2]
    assert "| tiny | compiled (inductor) | | | not done after 1 s |" in rows[3]


# What a GPU check's reader types: commands on their own node, through SLURM or its shell, nothing else.
USERS_COMMANDS = ("srun ", "sbatch ", "bash ", "export ", "env ", ".venv/bin/", "make ", "pip ", "python ")


def test_the_projects_text_describes_the_gpu_check_as_a_command_on_the_users_own_node():
    blocks = (REPO / "docs" / "gpu-check.md").read_text().split("```")[1::2]
    typed = [line.strip() for block in blocks for line in block.splitlines()[1:]
             if line.strip() and not line.startswith((" ", "#"))]
    assert typed and [line for line in typed if not line.startswith(USERS_COMMANDS)] == []
    check = (REPO / "docs" / "gpu-check.md").read_text()
    assert "srun --gres=gpu:1" in check and "#SBATCH" in check and "bash bench/gpu.sh" in check
    assert "torch.version.cuda, torch.cuda.is_available()" in check

"""bench/gpu.sh, the prepared check for a lent GPU, run end to end at toy sizes on the CPU, so that the
GPU's few minutes are never spent on a typo; and the wheel set that it installs there."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import gpu_wheels  # noqa: E402
import train_gpu  # noqa: E402

pytestmark = pytest.mark.workflow

PARTS = ["1. bf16 matmul ceiling", "2. demo DAG on cpu", "3. DDP", "4a. training throughput, base",
         "4b. training throughput, big", "5. beam-search decoding"]


@pytest.fixture(scope="module")
def cpu_check(tmp_path_factory):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_WORK": str(tmp_path_factory.mktemp("gpu_check")),
           "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    result = subprocess.run(["bash", str(REPO / "bench" / "gpu.sh"), "--device", "cpu"], env=env,
                            capture_output=True, text=True, timeout=900)
    return result


def test_every_part_runs_and_none_fails(cpu_check):
    assert cpu_check.returncode == 0, cpu_check.stdout[-6000:] + cpu_check.stderr[-2000:]
    for part in PARTS:
        assert f"== {part}" in cpu_check.stdout
    assert "0 part(s) failed" in cpu_check.stdout


def test_the_matmul_ceiling_is_printed(cpu_check):
    assert re.search(r"bf16 matmul ceiling: [\d.]+ TFLOP/s", cpu_check.stdout)


def test_the_dag_trains_decodes_tracks_and_ends_in_the_report_tables(cpu_check):
    out = cpu_check.stdout
    assert re.search(r"gpu_base seed 1: 6 steps on cpu", out)
    assert len(re.findall(r"decoded \d+ sentences .* on cpu", out)) == 2  # dev and test
    assert re.search(r"mlflow \(mlflow.db\): experiment gpu_check: \d+ runs FINISHED", out)
    for table in ("table2", "table3"):
        assert f"== results/gpu_check/report/{table}.md" in out
    tables = out.split("== results/gpu_check/report/table2.md")[1]
    assert "gpu_base" in tables and "|" in tables


def test_ddp_sees_the_same_real_tokens_per_step_as_one_process(cpu_check):
    out = cpu_check.stdout
    assert re.search(r"^1 process\(es\) on cpu: 3 steps", out, re.MULTILINE)
    assert re.search(r"^2 process\(es\) on cpu: 3 steps", out, re.MULTILINE)
    assert "DDP: the same real tokens per step in 1 and 2 processes" in out


def test_training_throughput_prints_eager_before_compiled_with_projected_hours(cpu_check):
    out = cpu_check.stdout
    for steps in (100000, 300000):
        eager = re.search(rf"bf16: ours \d+ tok/s \([\d.]+ s/step\), {steps} steps = [\d.]+ h", out)
        compiled = re.search(rf"bf16: ours compiled \(eager\) \d+ tok/s .*{steps} steps = ", out)
        assert eager and compiled and eager.start() < compiled.start()
    assert len(re.findall(r"would take [\d.]+ s: ours( compiled)? step/floor [\d.]+", out)) == 2  # base and big


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

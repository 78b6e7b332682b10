"""Tests for aiayn.average: the streaming float64 mean of checkpoints and its refusals."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from aiayn.average import average_checkpoints, last_checkpoints, load_checkpoint, main, save_model
from aiayn.errors import UserError

MODEL_CONFIG = {"vocab_size": 11, "n_layers": 1, "d_model": 4, "d_ff": 8, "n_heads": 2, "d_head": 2,
                "dropout": 0.1, "positional": "sinusoidal"}


def make_state(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    embedding = torch.randn(11, 4, generator=generator)
    return {
        "embedding.weight": embedding,
        "generator.weight": embedding,  # tied, as in the paper
        "layer.linear.weight": torch.randn(4, 4, generator=generator),
        "layer.linear.bias": torch.randn(4, generator=generator).to(torch.bfloat16),
        "step_counter": torch.tensor(7),
    }


def write_checkpoint(path, step, state=None, **overrides):
    state = make_state(step) if state is None else state
    checkpoint = {
        "format": "aiayn-checkpoint-v1",
        "step": step,
        "model_config": dict(MODEL_CONFIG),
        "model": state,
        "optimizer": {"state": {0: {"exp_avg": torch.zeros(4, 4)}}, "param_groups": [{"lr": 1e-3}]},
        "scheduler": {"last_epoch": step},
        "rng": {"torch": torch.get_rng_state()},
        "config": {"seed": 1},
        "vocab_fingerprint": "vocab-aaaa",
        "data_fingerprint": "data-bbbb",
    }
    checkpoint.update(overrides)
    torch.save(checkpoint, path)
    return path


@pytest.fixture
def two_checkpoints(tmp_path):
    return [write_checkpoint(tmp_path / "step_00000100.pt", 100), write_checkpoint(tmp_path / "step_00000200.pt", 200)]


def test_average_of_two_checkpoints_is_their_elementwise_mean(two_checkpoints):
    first, second = make_state(100), make_state(200)
    averaged = average_checkpoints(two_checkpoints)["model"]
    for key in ("embedding.weight", "layer.linear.weight", "layer.linear.bias"):
        expected = ((first[key].double() + second[key].double()) / 2).to(first[key].dtype)
        assert averaged[key].dtype == first[key].dtype
        assert torch.equal(averaged[key], expected)


def test_float32_mean_is_accumulated_in_float64(tmp_path):
    # In float32 the sum of two values near the float32 maximum overflows to inf.
    big = torch.full((3,), 3.0e38, dtype=torch.float32)
    paths = [write_checkpoint(tmp_path / f"step_{step:08d}.pt", step, state={"w": big.clone()}) for step in (1, 2)]
    assert torch.isinf(big + big).all()
    averaged = average_checkpoints(paths)["model"]["w"]
    assert averaged.dtype == torch.float32
    assert torch.equal(averaged, big)


def test_integer_tensors_are_taken_from_the_last_checkpoint(tmp_path):
    paths = []
    for step, count in ((1, 3), (2, 5)):
        state = {"w": torch.ones(2), "count": torch.tensor([count])}
        paths.append(write_checkpoint(tmp_path / f"step_{step:08d}.pt", step, state=state))
    averaged = average_checkpoints(paths)["model"]["count"]
    assert averaged.dtype == torch.int64 and averaged.tolist() == [5]


def test_result_loads_with_weights_only_and_has_no_optimizer_state(two_checkpoints, tmp_path):
    output = tmp_path / "average" / "model.pt"
    save_model(average_checkpoints(two_checkpoints), output)
    model = torch.load(output, map_location="cpu", weights_only=True)
    assert model["format"] == "aiayn-model-v1"
    assert not {"optimizer", "scheduler", "rng"} & set(model)
    assert model["averaged_steps"] == [100, 200]
    assert model["averaged_from"] == ["step_00000100.pt", "step_00000200.pt"]
    assert model["model_config"] == MODEL_CONFIG
    assert model["vocab_fingerprint"] == "vocab-aaaa" and model["data_fingerprint"] == "data-bbbb"


def test_tied_weights_stay_tied_after_averaging(two_checkpoints, tmp_path):
    output = tmp_path / "model.pt"
    save_model(average_checkpoints(two_checkpoints), output)
    state = torch.load(output, map_location="cpu", weights_only=True)["model"]
    assert state["embedding.weight"].untyped_storage().data_ptr() == state["generator.weight"].untyped_storage().data_ptr()


def test_averaged_models_can_be_averaged_again(two_checkpoints, tmp_path):
    model_path = tmp_path / "model.pt"
    save_model(average_checkpoints(two_checkpoints), model_path)
    third = write_checkpoint(tmp_path / "step_00000300.pt", 300)
    again = average_checkpoints([model_path, third])
    once = average_checkpoints(two_checkpoints)["model"]["layer.linear.weight"].double()
    expected = ((once + make_state(300)["layer.linear.weight"].double()) / 2).float()
    assert torch.equal(again["model"]["layer.linear.weight"], expected)
    assert again["averaged_steps"] == [100, 200, 300]


def test_different_architectures_are_refused_naming_the_key(tmp_path):
    first = write_checkpoint(tmp_path / "step_00000001.pt", 1)
    config = dict(MODEL_CONFIG, n_layers=2)
    second = write_checkpoint(tmp_path / "step_00000002.pt", 2, model_config=config)
    with pytest.raises(UserError) as raised:
        average_checkpoints([first, second])
    message = str(raised.value)
    assert "n_layers" in message and str(first) in message and str(second) in message


def test_different_vocabularies_are_refused(tmp_path):
    first = write_checkpoint(tmp_path / "step_00000001.pt", 1)
    second = write_checkpoint(tmp_path / "step_00000002.pt", 2, vocab_fingerprint="vocab-zzzz")
    with pytest.raises(UserError, match="vocab_fingerprint"):
        average_checkpoints([first, second])


def test_different_parameter_shapes_are_refused_naming_the_key(tmp_path):
    first = write_checkpoint(tmp_path / "step_00000001.pt", 1)
    state = make_state(2)
    state["layer.linear.weight"] = torch.zeros(4, 5)
    second = write_checkpoint(tmp_path / "step_00000002.pt", 2, state=state)
    with pytest.raises(UserError, match="layer.linear.weight"):
        average_checkpoints([first, second])


def test_missing_parameter_is_refused_naming_the_key(tmp_path):
    first = write_checkpoint(tmp_path / "step_00000001.pt", 1)
    state = make_state(2)
    del state["layer.linear.bias"]
    second = write_checkpoint(tmp_path / "step_00000002.pt", 2, state=state)
    with pytest.raises(UserError, match="layer.linear.bias"):
        average_checkpoints([first, second])


def test_file_without_format_is_not_an_aiayn_checkpoint(tmp_path):
    path = tmp_path / "foreign.pt"
    torch.save({"model": {"w": torch.ones(1)}}, path)
    with pytest.raises(UserError, match="not an aiayn checkpoint"):
        load_checkpoint(path)


def test_truncated_file_is_refused_naming_the_file(tmp_path):
    path = write_checkpoint(tmp_path / "step_00000001.pt", 1)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError) as raised:
        average_checkpoints([path])
    assert str(path) in str(raised.value) and "truncated" in str(raised.value)


def test_no_inputs_are_refused():
    with pytest.raises(UserError, match="no checkpoints"):
        average_checkpoints([])


def test_cli_writes_the_average(two_checkpoints, tmp_path, capsys):
    output = tmp_path / "model.pt"
    assert main(["--output", str(output), *map(str, two_checkpoints)]) == 0
    assert torch.load(output, map_location="cpu", weights_only=True)["averaged_steps"] == [100, 200]
    assert "averaged 2 files" in capsys.readouterr().out


def test_cli_averages_the_last_k_of_a_directory(tmp_path):
    for step in (100, 200, 300):
        write_checkpoint(tmp_path / f"step_{step:08d}.pt", step)
    output = tmp_path / "model.pt"
    assert main(["--output", str(output), "--last", "2", "--checkpoint-dir", str(tmp_path)]) == 0
    assert torch.load(output, map_location="cpu", weights_only=True)["averaged_steps"] == [200, 300]


def test_cli_exits_2_and_writes_nothing_when_averaging_fails(tmp_path, capsys):
    first = write_checkpoint(tmp_path / "step_00000001.pt", 1)
    second = write_checkpoint(tmp_path / "step_00000002.pt", 2, vocab_fingerprint="vocab-zzzz")
    output = tmp_path / "out" / "model.pt"
    assert main(["--output", str(output), str(first), str(second)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert not output.exists()


def test_interrupted_save_leaves_no_file_behind(tmp_path):
    output = tmp_path / "model.pt"
    with pytest.raises(Exception):
        save_model({"unpicklable": lambda: None}, output)
    assert list(tmp_path.iterdir()) == []


def test_last_checkpoints_are_ordered_by_step_not_by_name(tmp_path):
    # Names written without zero padding would sort 1000 before 200 as text.
    for name in ("step_00000200.pt", "step_1000.pt", "step_00000300.pt", "step_00000100.pt", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    assert [path.name for path in last_checkpoints(tmp_path, 3)] == [
        "step_00000200.pt", "step_00000300.pt", "step_1000.pt"]


def test_fewer_window_checkpoints_than_k_average_those_that_exist_and_none_is_refused(tmp_path):
    (tmp_path / "safety_00000250.pt").write_bytes(b"")  # never averaged
    with pytest.raises(UserError, match="no window checkpoints"):
        last_checkpoints(tmp_path, 5)
    for step in (100, 200):
        (tmp_path / f"step_{step:08d}.pt").write_bytes(b"")
    assert [path.name for path in last_checkpoints(tmp_path, 5)] == ["step_00000100.pt", "step_00000200.pt"]


# --- what averaging gave: the averaged model against the last checkpoint on dev ---------------------

def test_the_paired_difference_counts_as_noise_what_its_chunks_scatter():
    import numpy as np

    from aiayn.average_dev import paired_difference

    last = np.array([[100.0, 50], [80.0, 40], [120.0, 60], [60.0, 30]])
    steady = last + np.array([[5.0, 0], [4.0, 0], [6.0, 0], [3.0, 0]])  # +0.1 NLL a token in every chunk
    difference, noise = paired_difference(steady, last)
    assert difference == pytest.approx(0.1) and noise == pytest.approx(0.0, abs=1e-9)
    scattered = last + np.array([[20.0, 0], [-14.0, 0], [-3.0, 0], [15.0, 0]])  # +0.1 on average, by chance
    difference, noise = paired_difference(scattered, last)
    assert difference == pytest.approx(0.1) and noise > difference


@pytest.fixture(scope="module")
def trained_run(prepared, tmp_path_factory):
    """A tiny run, tracked in a sqlite MLflow store, and its window checkpoints."""
    from conftest import tiny_preset

    from aiayn.config import section_defaults
    from aiayn.train.trainer import TrainJob, train

    root = tmp_path_factory.mktemp("averaged")
    uri = f"sqlite:///{root}/mlflow.db"
    section = {**section_defaults("train"), "tokens_per_step": 600, "device_tokens": 600, "dev_every": 0,
               "precision": "fp32", "device": "cpu"}
    saved = os.environ.pop("MLFLOW_TRACKING_URI", None)  # Tracker.start exports its URI into os.environ
    try:
        train(TrainJob(tiny_preset(steps=6, checkpoint_steps=2, average_last=2), section, 1,
                       prepared / "bin" / "train", prepared / "bin" / "dev", prepared / "bpe" / "spm.model",
                       root / "run", "tests", uri, True, "cpu", None, False))
    finally:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        if saved is not None:
            os.environ["MLFLOW_TRACKING_URI"] = saved
    return root / "run", uri


def average_command(*args) -> list[str]:
    return [sys.executable, "-m", "aiayn.cli", "average", *map(str, args)]


def run(command, cwd):
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"},
                               "OMP_NUM_THREADS": "1"})


def test_the_dev_evaluation_of_the_averaged_model_and_the_last_is_recorded(trained_run, prepared, tmp_path):
    from aiayn.tracking import open_client

    run_dir, uri = trained_run
    output = tmp_path / "average" / "model.pt"
    done = run(average_command("--last", 2, "--checkpoint-dir", run_dir / "checkpoints", "--output", output,
                               "--dev-data", prepared / "bin" / "dev", "--summary", output.parent / "average.json",
                               "--log-to-run", run_dir / "final.json", "--tracking-uri", uri), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((output.parent / "average.json").read_text())
    final = json.loads((run_dir / "final.json").read_text())
    assert summary["averaged_steps"] == [4, 6] and summary["last_steps"] == [6]
    # the last checkpoint is the run's last step: the trainer's own final dev perplexity
    assert summary["dev_ppl_last"] == pytest.approx(final["dev_ppl"], rel=1e-4)
    assert summary["dev_ppl_averaged"] > 1 and summary["dev_nll_noise"] > 0
    assert summary["averaged_worse"] == (summary["dev_nll_difference"] > summary["dev_nll_noise"])
    assert f"averaged {summary['dev_ppl_averaged']:.3f}, last checkpoint {summary['dev_ppl_last']:.3f}" in done.stdout
    logged = open_client(uri).get_run(final["mlflow_run_id"]).data
    assert logged.metrics["dev_ppl_last"] == pytest.approx(summary["dev_ppl_last"])
    assert logged.metrics["dev_ppl_averaged"] == pytest.approx(summary["dev_ppl_averaged"])
    assert logged.tags["averaged_worse_than_last"] == str(summary["averaged_worse"]).lower()
    assert logged.tags["averaged_steps"] == "4, 6"
    assert logged.params["reported_model"] == logged.tags["reported_model"] == summary["reported_model"]
    assert summary["reported_model"].startswith("averaged, steps 4-6" if not summary["averaged_worse"] else
                                                "last checkpoint, step 6: the average (steps 4-6) was worse on dev")


def perturbed(checkpoint_path, step, scale, seed, folder):
    """A copy of a checkpoint with every weight moved by Gaussian noise of ``scale``, as step ``step``."""
    checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    generator = torch.Generator().manual_seed(seed)
    checkpoint["model"] = {key: tensor + scale * torch.randn(tensor.shape, generator=generator) for key, tensor
                           in checkpoint["model"].items()}
    checkpoint["step"] = step
    torch.save(checkpoint, folder / f"step_{step:08d}.pt")
    return folder / f"step_{step:08d}.pt"


def average_on_dev(prepared, folder, *checkpoints, options=()):
    """`aiayn average` of the files with the dev comparison, as the DAG runs it; its summary and output."""
    output = folder / "model.pt"
    done = run(average_command("--output", output, "--dev-data", prepared / "bin" / "dev", "--summary",
                               folder / "average.json", *checkpoints, *options), folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((folder / "average.json").read_text()), torch.load(output, map_location="cpu", weights_only=True), done


@pytest.fixture(scope="module")
def worse_average(trained_run, prepared, tmp_path_factory):
    """A short run's window whose first checkpoint is far from the last (as early in a budgeted run, while
    the learning rate still rises): the average is worse on dev by far more than noise."""
    run_dir, _ = trained_run
    folder = tmp_path_factory.mktemp("worse")
    return folder, [perturbed(run_dir / "checkpoints" / "step_00000006.pt", 0, 1.0, 0, folder),
                    run_dir / "checkpoints" / "step_00000006.pt"]


def test_an_average_worse_on_dev_gives_way_to_the_last_checkpoint_in_one_line(worse_average, prepared):
    folder, checkpoints = worse_average
    summary, written, done = average_on_dev(prepared, folder, *checkpoints)
    assert summary["averaged_worse"] and summary["dev_ppl_averaged"] > summary["dev_ppl_last"]
    last = torch.load(checkpoints[-1], map_location="cpu", weights_only=True)
    # model.pt, the decode stage's input, is the last checkpoint: its weights, without optimizer state
    assert written["format"] == "aiayn-model-v1" and "optimizer" not in written
    assert written["averaged_steps"] == [6] and written["averaged_from"] == ["step_00000006.pt"]
    assert all(torch.equal(written["model"][key], last["model"][key]) for key in last["model"])
    assert summary["choose"] == "dev" and summary["reported"] == "last"
    assert summary["reported_model"].startswith("last checkpoint, step 6: the average (steps 0-6) was worse on dev by ")
    assert f"({summary['dev_ppl_averaged']:.2f} against {summary['dev_ppl_last']:.2f})" in summary["reported_model"]
    messages = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(messages) == 1 and messages[0].startswith("note: "), done.stderr
    assert f"{folder / 'model.pt'} is the last checkpoint" in messages[0]
    assert f"{summary['dev_ppl_averaged']:.2f}" in messages[0] and f"{summary['dev_ppl_last']:.2f}" in messages[0]


def test_the_papers_choice_keeps_a_worse_average_and_warns_in_one_line(worse_average, prepared, tmp_path):
    folder, checkpoints = worse_average
    summary, written, done = average_on_dev(prepared, tmp_path, *checkpoints, options=("--choose", "paper"))
    assert summary["averaged_worse"] and summary["reported"] == "averaged"
    assert summary["reported_model"] == "averaged, steps 0-6 (worse on dev than the last checkpoint; average.choose: paper)"
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1
    assert f"{summary['dev_ppl_averaged']:.2f}" in warnings[0] and f"{summary['dev_ppl_last']:.2f}" in warnings[0]
    assert written["averaged_steps"] == [0, 6]  # not swapped


def test_the_choice_is_the_configs_average_choose_checked_by_the_schema(worse_average, prepared, tmp_path):
    folder, checkpoints = worse_average
    (tmp_path / "paper.yaml").write_text("models: [base]\naverage: {choose: paper}\n")
    summary, written, _ = average_on_dev(prepared, tmp_path, *checkpoints, options=("--config", tmp_path / "paper.yaml"))
    assert summary["choose"] == "paper" and written["averaged_steps"] == [0, 6]
    refused = run(average_command("--output", tmp_path / "other.pt", "--choose", "best", *checkpoints), tmp_path)
    assert refused.returncode == 2 and refused.stderr.startswith("error: --choose: average.choose = 'best'")
    assert "dev, paper" in refused.stderr and not (tmp_path / "other.pt").exists()


def test_an_average_better_on_dev_is_the_model_written(trained_run, prepared, tmp_path):
    """Three checkpoints scattered around the run's last weights: their average is nearer than the last one."""
    run_dir, _ = trained_run
    checkpoints = [perturbed(run_dir / "checkpoints" / "step_00000006.pt", step, 0.15, step, tmp_path)
                   for step in (7, 8, 9)]
    summary, written, done = average_on_dev(prepared, tmp_path, *checkpoints)
    assert summary["dev_nll_difference"] < -summary["dev_nll_noise"] and not summary["averaged_worse"]
    assert summary["reported"] == "averaged" and summary["reported_model"] == "averaged, steps 7-9"
    assert written["averaged_steps"] == [7, 8, 9] and written["averaged_from"] == [path.name for path in checkpoints]
    averaged = average_checkpoints(checkpoints)["model"]
    assert all(torch.equal(written["model"][key], averaged[key]) for key in averaged)
    assert "note:" not in done.stderr and "warning:" not in done.stderr and "into" in done.stdout


def test_a_rerun_that_chooses_anew_keeps_the_first_param_and_tags_the_new_choice(worse_average, prepared, tmp_path):
    """MLflow never changes a param: a second average of the run (here with average.choose changed) says so in
    one warning line and leaves its choice in the tag."""
    from aiayn.tracking import open_client

    folder, checkpoints = worse_average
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = open_client(uri)
    run_id = client.create_run(client.create_experiment("reruns")).info.run_id
    (tmp_path / "final.json").write_text(json.dumps({"mlflow_run_id": run_id, "step": 6}))
    tracked = ("--log-to-run", tmp_path / "final.json", "--tracking-uri", uri)
    first, _, _ = average_on_dev(prepared, tmp_path, *checkpoints, options=tracked)
    second, _, done = average_on_dev(prepared, tmp_path, *checkpoints, options=(*tracked, "--choose", "paper"))
    logged = client.get_run(run_id).data
    assert logged.params["reported_model"] == first["reported_model"] != second["reported_model"]
    assert logged.tags["reported_model"] == second["reported_model"]
    warnings = [line for line in done.stderr.splitlines() if "keeps its param reported_model" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: "), done.stderr


def test_the_choice_reads_the_dev_split_and_no_test_file(worse_average, prepared, tmp_path):
    """Every file the average stage opens, recorded by an audit hook: the dev split's, never a test split's
    (a binarized one and its text lie beside dev, as in the DAG's results)."""
    folder, checkpoints = worse_average
    (tmp_path / "data").mkdir()
    for split in ("dev", "test"):
        shutil.copytree(prepared / "bin" / "dev", tmp_path / "bin" / split)
        for side in ("en", "de"):
            shutil.copy(prepared / "data" / f"dev.{side}", tmp_path / "data" / f"{split}.{side}")
    test_files = [str(tmp_path / "bin" / "test"), str(tmp_path / "data" / "test.")]
    record = tmp_path / "opened.txt"
    code = ("import os, sys\n"
            f"opened = open({str(record)!r}, 'w')\n"
            "sys.addaudithook(lambda event, args: event == 'open' and isinstance(args[0], (str, bytes)) and "
            "opened.write(os.path.abspath(os.fsdecode(args[0])) + '\\n'))\n"
            "from aiayn.average import main\n"
            f"status = main({[str(path) for path in checkpoints]!r} + ['--output', 'out/model.pt', '--dev-data', "
            "'bin/dev', '--summary', 'out/average.json'])\n"
            "opened.close()\n"
            "sys.exit(status)\n")
    done = run([sys.executable, "-c", code], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "average.json").read_text())["reported"] == "last"
    opened = set(record.read_text().splitlines())
    assert any(path.startswith(str(tmp_path / "bin" / "dev")) for path in opened), sorted(opened)
    assert not [path for path in opened if path.startswith(tuple(test_files))], sorted(opened)


def test_a_summary_without_dev_data_is_refused_before_any_work(two_checkpoints, tmp_path, capsys):
    output = tmp_path / "out" / "model.pt"
    assert main(["--output", str(output), "--summary", str(tmp_path / "average.json"),
                 *map(str, two_checkpoints)]) == 2
    assert "--dev-data" in capsys.readouterr().err
    assert not output.exists() and not (tmp_path / "average.json").exists()


def test_dev_tokens_auto_evaluates_in_the_trainers_batches_for_the_device(trained_run, prepared, tmp_path, monkeypatch):
    import aiayn.average_dev
    from aiayn.average import main

    run_dir, _ = trained_run
    real, sizes = aiayn.average_dev.compare_on_dev, []
    monkeypatch.setattr(aiayn.average_dev, "compare_on_dev", lambda *args: sizes.append(args[-1]) or real(*args))
    assert main(["--last", "2", "--checkpoint-dir", str(run_dir / "checkpoints"), "--output", str(tmp_path / "m.pt"),
                 "--dev-data", str(prepared / "bin" / "dev"), "--device", "cpu", "--dev-tokens", "auto"]) == 0
    assert sizes == [25000]  # train.device_tokens: auto on the CPU

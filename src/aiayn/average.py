"""The average stage: the elementwise mean of the last checkpoints' weights (paper, section 6.1).

The paper's base model averages the last 5 checkpoints, the big model the last 20; docs/PAPER.md's
pitfall 3 puts this at up to 1 BLEU. ``--last K`` takes the last K *window* checkpoints
(``step_*.pt``, at the paper's step interval); safety checkpoints (``safety_*.pt``) never count. The result is a model file without optimizer state:
``{"format": "aiayn-model-v1", "model_config", "model", "vocab_fingerprint",
"data_fingerprint", "averaged_steps", "averaged_from"}``. Averaged models are accepted as
inputs too; each input file then counts once, whatever it was averaged from. With ``--dev-data`` the
averaged model and the last checkpoint are compared on the dev split (``aiayn.average_dev``), printed,
logged to MLflow and written to ``--summary`` (the DAG's ``average.json`` beside the model); with
``--choose dev`` (``average.choose``, the schema's default) the output is then the last checkpoint (as a
model file) where the average is worse on dev by more than noise, with ``--choose paper`` the average
always. Only the dev split is read for that choice, never test.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from aiayn.checkpoint import (CHECKPOINT_FORMAT, MODEL_FORMAT, last_checkpoints, list_checkpoints, load_checkpoint,
                              save_model)
from aiayn.config import schema_default
from aiayn.errors import UserError, cli
from aiayn.memory import tokens_argument
from aiayn.writing import prepare_output, refuse_overwriting_inputs, write_json_atomic
from aiayn.layout import AVERAGE_SUMMARY

def _steps_of(checkpoint: dict) -> list[int]:
    if checkpoint["format"] == CHECKPOINT_FORMAT:
        return [int(checkpoint["step"])]
    return [int(step) for step in checkpoint["averaged_steps"]]


def _check_compatible(first: dict, first_path: Path, other: dict, other_path: Path) -> None:
    """Refuse to average models that are not the same network over the same vocabulary."""
    first_config, other_config = first["model_config"], other["model_config"]
    for key in sorted(set(first_config) | set(other_config)):
        if first_config.get(key) != other_config.get(key):
            raise UserError(
                f"different architectures: model_config.{key} is {first_config.get(key)!r} in {first_path} "
                f"but {other_config.get(key)!r} in {other_path}; average only checkpoints of one training run"
            )
    for key, what in (("vocab_fingerprint", "vocabularies"), ("data_fingerprint", "training data")):
        if first[key] != other[key]:
            raise UserError(
                f"different {what}: {key} is {first[key]!r} in {first_path} but {other[key]!r} in {other_path}; "
                "average only checkpoints of one training run"
            )
    first_state, other_state = first["model"], other["model"]
    for key in sorted(set(first_state) ^ set(other_state)):
        holder, lacking = (first_path, other_path) if key in first_state else (other_path, first_path)
        raise UserError(f"parameter {key!r} is in {holder} but not in {lacking}; these are different models")
    for key, tensor in first_state.items():
        other_tensor = other_state[key]
        if tensor.shape != other_tensor.shape or tensor.dtype != other_tensor.dtype:
            raise UserError(
                f"parameter {key!r} is {tuple(tensor.shape)} {tensor.dtype} in {first_path} but "
                f"{tuple(other_tensor.shape)} {other_tensor.dtype} in {other_path}; these are different models"
            )


def _storage_aliases(state: dict) -> dict[str, str]:
    """Map each key whose tensor is a view of an earlier key's tensor (tied weights) to that key."""
    seen: dict[tuple, str] = {}
    aliases = {}
    for key, tensor in state.items():
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride(),
                    tensor.dtype)
        if identity in seen:
            aliases[key] = seen[identity]
        else:
            seen[identity] = key
    return aliases


def average_checkpoints(paths: list[str | os.PathLike]) -> dict:
    """The elementwise mean of the inputs' weights, as an ``aiayn-model-v1`` dict.

    Streams: only the float64 running sum and one loaded file are held at a time. Floating
    tensors are summed in float64 and cast back to their dtype at the end, so the mean of
    float32 weights is the correctly rounded float32 of the exact mean. Integer and bool
    tensors are not averaged: they are taken from the last file (they are equal in
    checkpoints of one run). Tensors that shared storage in the first file (tied embeddings)
    share it again in the result.
    """
    if not paths:
        raise UserError("no checkpoints to average; name at least one file, or use --last K --checkpoint-dir DIR")
    paths = [Path(path) for path in paths]
    first: dict | None = None
    aliases: dict[str, str] = {}
    sums: dict[str, torch.Tensor] = {}
    steps: list[int] = []
    for path in paths:
        checkpoint = load_checkpoint(path)
        if first is None:
            # Keep only the small metadata of the first file, not its tensors.
            first = {key: checkpoint[key] for key in ("model_config", "vocab_fingerprint", "data_fingerprint")}
            first["model"] = {key: torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
                              for key, tensor in checkpoint["model"].items()}
            aliases = _storage_aliases(checkpoint["model"])
        _check_compatible(first, paths[0], checkpoint, path)
        for key, tensor in checkpoint["model"].items():
            if tensor.is_floating_point():
                if key in sums:
                    sums[key] += tensor.to(torch.float64)
                else:
                    sums[key] = tensor.to(torch.float64, copy=True)
            else:
                sums[key] = tensor.clone()
        steps += _steps_of(checkpoint)
        del checkpoint  # before loading the next one, so two are never held at once

    averaged = {}
    for key, meta in first["model"].items():
        total = sums.pop(key)
        averaged[key] = (total / len(paths)).to(meta.dtype) if meta.is_floating_point() else total
    for key, target in aliases.items():
        if torch.equal(averaged[key], averaged[target]):
            averaged[key] = averaged[target]
    return {
        "format": MODEL_FORMAT,
        "model_config": first["model_config"],
        "model": averaged,
        "vocab_fingerprint": first["vocab_fingerprint"],
        "data_fingerprint": first["data_fingerprint"],
        "averaged_steps": steps,
        "averaged_from": [path.name for path in paths],
    }


@dataclass(frozen=True)
class AverageSettings:
    """What the stage reads of a config, built once: the window to average, how the dev comparison runs
    (as training evaluates dev batches), the model it writes, and where the run is tracked."""

    last: int | None  # the last K window checkpoints of --checkpoint-dir (None: the files listed)
    choose: str  # average.choose
    precision: str  # train.precision, of the dev evaluation
    dev_tokens: int | str  # train.device_tokens, a side of one dev batch
    tracking_uri: str

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> AverageSettings:
        """Through the door: --config's files (else the schema's defaults), with the options given beside them
        in place of their keys; --last, else with --checkpoint-dir the run's preset's average_last (--preset,
        or the config's one model)."""
        from aiayn.config import read_config, resolve_preset

        options = {key: (option, getattr(args, dest)) for dest, (option, key) in OPTION_KEYS.items()}
        if args.config is None and args.precision is None:  # no run's precision to follow: the exact evaluation
            options["train.precision"] = ("--precision", "fp32")
        config = read_config(args.config, None, options)
        if args.preset is not None and args.config is None:
            raise UserError("--preset names a preset of --config's files; give --config FILE... too")
        last, listed = args.last, args.checkpoint_dir is None  # listed files are averaged as they are
        name = args.preset or (config["models"][0] if args.config and len(config["models"]) == 1 else None)
        if name is not None:
            average_last = resolve_preset(config, name, args.config)["average_last"]  # which checks the name, too
            last = average_last if last is None and not listed else last
        elif args.config and last is None and not listed:
            raise UserError(f"--config: the config has {len(config['models'])} models; name the run's with --preset "
                            f"(one of {', '.join(config['models'])}), or give --last K")
        return cls(last=last, choose=config["average"]["choose"], precision=config["train"]["precision"],
                   dev_tokens=config["train"]["device_tokens"], tracking_uri=config["tracking_uri"])


# the options that set a config key (dest -> option, key): checked by the schema's rule for it, winning over --config
OPTION_KEYS = {"precision": ("--precision", "train.precision"), "dev_tokens": ("--dev-tokens", "train.device_tokens"),
               "choose": ("--choose", "average.choose"), "tracking_uri": ("--tracking-uri", "tracking_uri")}


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiayn average", description=__doc__.splitlines()[0])
    parser.add_argument("--config", nargs="+", metavar="FILE",
                        help="config files (merged in order, validated once; default: the schema's defaults): --last "
                             "is --preset's average_last, --precision and --dev-tokens the `train` section's, --choose "
                             "average.choose; an option given here wins")
    parser.add_argument("--preset", help="with --config: the run's preset (default: the config's model, if one)")
    parser.add_argument("--output", required=True, type=Path,
                        help="the model file to write: the average, or the last checkpoint (see --choose)")
    parser.add_argument("--last", type=int, metavar="K", help="average the last K checkpoints of --checkpoint-dir")
    parser.add_argument("--checkpoint-dir", type=Path, help="directory of step_*.pt checkpoints (with --last)")
    parser.add_argument("--log-to-run", type=Path, metavar="FINAL_JSON",
                        help="tag the training run that final.json names with the averaged steps (MLflow)")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default: tracking_uri's)")
    parser.add_argument("--dev-data", type=Path, metavar="DIR",
                        help="a binarized dev split: compare the averaged model with the last checkpoint on it")
    parser.add_argument("--summary", type=Path, help=f"a JSON file for that comparison (the DAG writes "
                        f"{AVERAGE_SUMMARY} beside the model)")
    parser.add_argument("--device", default="auto", help="auto (a GPU where torch sees one), cpu or cuda")
    parser.add_argument("--precision", metavar="fp32|bf16|fp16|auto",
                        help="of the dev evaluation (default: --config's train.precision; without --config, fp32)")
    parser.add_argument("--dev-tokens", type=tokens_argument, metavar="N|auto",
                        help=f"tokens a side in one dev batch (default: train.device_tokens', "
                             f"{schema_default('train.device_tokens')})")
    parser.add_argument("--choose", metavar="dev|paper",
                        help="with --dev-data, the model written: dev, the last checkpoint where the average is worse "
                             "on dev by more than noise, else the average; paper, the average always (default: "
                             f"average.choose's, {schema_default('average.choose')})")
    parser.add_argument("checkpoints", nargs="*", type=Path, help="checkpoint or model files to average")
    return parser


def _checkpoints_to_average(args: argparse.Namespace, settings: AverageSettings) -> list[Path]:
    """The files to average: the last K of --checkpoint-dir, or the files listed (one way, not both)."""
    if (settings.last is None) != (args.checkpoint_dir is None):
        raise UserError("--last K and --checkpoint-dir DIR go together; give both, or list checkpoint files instead")
    if settings.last is not None and args.checkpoints:
        raise UserError("give either --last K --checkpoint-dir DIR or a list of checkpoint files, not both")
    return last_checkpoints(args.checkpoint_dir, settings.last) if settings.last is not None else args.checkpoints


@cli
def main(argv=None):
    args = arguments().parse_args(argv)
    settings = AverageSettings.from_arguments(args)
    paths = _checkpoints_to_average(args, settings)
    # every checkpoint of --checkpoint-dir, not only the last K: replacing any would break the run's resume
    run_checkpoints = ([path for _, path in list_checkpoints(args.checkpoint_dir, safety=True)]
                       if settings.last is not None else [])
    outputs = {"--output": args.output, **({"--summary": args.summary} if args.summary else {})}
    refuse_overwriting_inputs(outputs, {"checkpoint": paths, "--checkpoint-dir": run_checkpoints,
                                        "--log-to-run": args.log_to_run, "--dev-data": args.dev_data,
                                        "--config": args.config})
    if args.summary and not args.dev_data:
        raise UserError("--summary is where the dev comparison goes: give --dev-data too, or leave --summary out")
    if args.log_to_run is not None:  # read before the work: a wrong path costs nothing and leaves nothing
        from aiayn.tracking import read_run_file

        read_run_file(args.log_to_run)
    # before the work: a folder named as the output, say, is refused at once; its folder is made only
    # when the model is written, so that a failed average leaves none
    prepare_output(args.output, create=False)
    if settings.last is not None and len(paths) < settings.last:
        print(f"note: {args.checkpoint_dir} has {len(paths)} window checkpoints, not {settings.last} (the run ended "
              "early, e.g. at train.max_minutes); averaging those", file=sys.stderr)
    model = average_checkpoints(paths)
    steps = ", ".join(str(step) for step in model["averaged_steps"])
    comparison = dev_comparison(model, paths[-1], args, settings) if args.dev_data else None
    last_chosen = comparison is not None and comparison["reported"] == "last"
    if last_chosen:
        model = model_file(paths[-1])
    save_model(model, args.output)
    print(f"averaged {len(paths)} files (steps {steps})" + ("" if last_chosen else f" into {args.output}"))
    if comparison is not None and args.summary:
        write_json_atomic(args.summary, comparison)
    if args.log_to_run:
        _log_to_run(args.log_to_run, settings.tracking_uri, len(paths), steps, comparison)


def _log_to_run(final_json: Path, tracking_uri: str, averaged: int, steps: str, comparison: dict | None) -> None:
    """The averaged steps, and the dev comparison where there is one, on the training run's MLflow run."""
    from aiayn.tracking import log_to_existing_run

    metrics, tags, params = {"averaged_checkpoints": averaged}, {"averaged_steps": steps}, {}
    if comparison is not None:
        metrics.update({key: comparison[key] for key in DEV_METRICS})
        tags["averaged_worse_than_last"] = str(comparison["averaged_worse"]).lower()
        # a param, as asked of MLflow's runs view; the tag keeps the latest where a rerun chose anew
        params["reported_model"] = tags["reported_model"] = comparison["reported_model"]
    log_to_existing_run(final_json, tracking_uri, metrics=metrics, params=params, tags=tags)


DEV_METRICS = ("dev_ppl_last", "dev_ppl_averaged", "dev_nll_last", "dev_nll_averaged", "dev_nll_difference",
               "dev_nll_noise")


def dev_comparison(model: dict, last_path: Path, args: argparse.Namespace, settings: AverageSettings) -> dict:
    """The averaged model against the last file averaged (with --last, the run's last step) on the dev
    split, and the model --choose takes (``reported``, ``reported_model``): printed, with one line where
    that is the last checkpoint, or a warning where the average is worse but kept (--choose paper)."""
    from aiayn.average_dev import chosen, compare_on_dev, last_chosen_line, reported_model, worse_warning
    from aiayn.device import choose_device
    from aiayn.memory import CPU_DEVICE_TOKENS, resolve_device_tokens
    from aiayn.model import ModelConfig

    device = choose_device(args.device)
    dev_tokens = resolve_device_tokens(settings.dev_tokens, device, ModelConfig.from_dict(model["model_config"]),
                                       settings.precision, ceiling=CPU_DEVICE_TOKENS)
    comparison = compare_on_dev(model, last_path, args.dev_data, device, settings.precision, dev_tokens)
    reported = chosen(comparison, settings.choose)
    comparison.update(choose=settings.choose, reported=reported, reported_model=reported_model(comparison, reported))
    print(f"dev perplexity: averaged {comparison['dev_ppl_averaged']:.3f}, last checkpoint "
          f"{comparison['dev_ppl_last']:.3f} ({last_path.name})")
    if reported == "last":
        print(last_chosen_line(comparison, args.output), file=sys.stderr)
    elif comparison["averaged_worse"]:
        print(worse_warning(comparison), file=sys.stderr)
    return comparison


def model_file(path: Path) -> dict:
    """The checkpoint or model file at ``path`` as a model file (``aiayn-model-v1``, no optimizer state), as
    the trainer writes final.pt: what the stage writes when it reports the last checkpoint."""
    checkpoint = load_checkpoint(path)
    if checkpoint["format"] == MODEL_FORMAT:
        return checkpoint
    return {"format": MODEL_FORMAT, "model_config": checkpoint["model_config"], "model": checkpoint["model"],
            "vocab_fingerprint": checkpoint["vocab_fingerprint"], "data_fingerprint": checkpoint["data_fingerprint"],
            "averaged_steps": _steps_of(checkpoint), "averaged_from": [path.name]}


if __name__ == "__main__":
    raise SystemExit(main())

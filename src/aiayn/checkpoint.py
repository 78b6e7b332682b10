"""Checkpoint and model files: their formats, atomic saving, safe loading and listing.

A training checkpoint (``aiayn-checkpoint-v1``) holds the model, optimizer, schedule, data
position, RNG states and resolved config. Window checkpoints, ``<run_dir>/checkpoints/step_<8-digit
step>.pt``, are the ones the paper averaged (every ``checkpoint_steps`` steps counted back from the
last step); safety checkpoints, ``safety_<step>.pt``, are written on a time interval or a signal
only so that a killed job can resume, and never enter an average. A model
file (``aiayn-model-v1``: written by averaging and at the end of training) holds only what
decoding needs. Both contain tensors and plain values alone, so they load with
``torch.load(weights_only=True)``: no pickled code runs when a file is opened. ``load_model`` is
the one way the stages load a trained model from either.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from aiayn.errors import UserError
from aiayn.reading import input_exists, open_input
from aiayn.writing import atomic_path
from aiayn.layout import AVERAGED_MODEL, CHECKPOINT_NAME, CHECKPOINTS, FINAL_MODEL, checkpoint_name
from aiayn.model import ModelConfig, Transformer

CHECKPOINT_FORMAT = "aiayn-checkpoint-v1"
MODEL_FORMAT = "aiayn-model-v1"


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Load an aiayn checkpoint or model file on the CPU, refusing anything else with a UserError."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a directory, but a checkpoint or model file is expected (for the last K "
                        f"checkpoints of a run use --last K --checkpoint-dir {path})")
    if not input_exists(path) or not path.is_file():
        raise UserError(f"{path}: no such checkpoint file (check the path or the checkpoint directory)")
    open_input(path).close()  # a file this user may not read is named so, not called corrupt
    try:
        with warnings.catch_warnings():  # a pickle of another protocol warns before it is refused below
            warnings.simplefilter("ignore")
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch reports damage as RuntimeError, EOFError, UnpicklingError, ...
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        with open(path, "rb") as handle:
            head = handle.read(8)
        # First what the file is: text read as a pickle fails torch's weights-only check too (its first
        # byte taken for an opcode), and that is not code.
        if not head.startswith((b"PK\x03\x04", b"\x80")):  # neither torch's zip format nor a pickle
            what = ("an empty file, not a checkpoint" if not head else
                    f"text, not a checkpoint (its first line: {_first_line(path)!r})" if _looks_like_text(path)
                    else f"not a checkpoint (its first bytes are {head!r})")
            raise UserError(
                f"{path}: {what}; give a checkpoint or model file written by `aiayn train` "
                "(step_*.pt, final.pt) or `aiayn average` (model.pt)"
            ) from None
        if "Weights only load failed" in reason:
            raise UserError(
                f"{path}: a checkpoint holding code (pickled Python objects, not only tensors and plain values), "
                "which is not loaded for safety: loading it would run that code; give a checkpoint or model file "
                "written by `aiayn train` or `aiayn average`"
            ) from None
        raise UserError(
            f"{path}: cannot be loaded, the file is corrupt or truncated (perhaps written by a job "
            f"that was killed) [{reason}]; delete it, or average other checkpoints"
        ) from None
    if not isinstance(checkpoint, dict) or "format" not in checkpoint:
        raise UserError(
            f"{path}: not an aiayn checkpoint (it has no 'format' entry); average only files "
            "written by `aiayn train` (step_*.pt) or by `aiayn average`"
        )
    if checkpoint["format"] not in (CHECKPOINT_FORMAT, MODEL_FORMAT):
        raise UserError(
            f"{path}: unknown format {checkpoint['format']!r}; this version of aiayn reads "
            f"{CHECKPOINT_FORMAT!r} and {MODEL_FORMAT!r}"
        )
    steps_key = "step" if checkpoint["format"] == CHECKPOINT_FORMAT else "averaged_steps"
    for key in ("model_config", "model", "vocab_fingerprint", "data_fingerprint", steps_key):
        if key not in checkpoint:
            raise UserError(f"{path}: a {checkpoint['format']} file without its {key!r} entry; the file is damaged")
    return checkpoint


def _first_line(path: Path, shown: int = 60) -> str:
    """The start of a text file's first line, for a message that helps tell which file was given."""
    with open(path, "rb") as handle:
        line = handle.readline(4 * shown).decode("utf-8", errors="replace").rstrip("\r\n")
    return line if len(line) <= shown else line[:shown] + "..."


def _looks_like_text(path: Path) -> bool:
    with open(path, "rb") as handle:
        head = handle.read(4096)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as error:
        return error.start > len(head) - 4  # a character cut at the end of what was read
    return b"\x00" not in head


def load_model(
    path: str | os.PathLike, device: torch.device | str = "cpu", spm_model: str | os.PathLike | None = None,
) -> Transformer:
    """A trained Transformer from a checkpoint or model file, in eval mode on `device`.

    With `spm_model`, a model trained with another vocabulary is refused: decoded or drawn with the
    wrong one, it gives fluent-looking nonsense.
    """
    if Path(path).is_dir():
        raise UserError(f"{path} is a directory, but a checkpoint or model file is expected{_model_files_in(path)}")
    checkpoint = load_checkpoint(path)
    config = ModelConfig.from_dict(checkpoint["model_config"])
    if spm_model is not None:
        _check_vocabulary(path, checkpoint, config, spm_model)
    model = Transformer(config)
    try:
        model.load_state_dict(checkpoint["model"], strict=True)
    except RuntimeError as error:
        first = str(error).strip().splitlines()
        detail = " ".join(line.strip() for line in first[:3])
        raise UserError(
            f"{path}: its weights do not fit its own model_config ({detail}); the file was written by "
            "another version of aiayn or is damaged"
        ) from None
    return model.to(device).eval()


def _model_files_in(folder: str | os.PathLike) -> str:
    """What to give instead of ``folder``: the model files in it (an average's model.pt, a run's final.pt
    and its last checkpoint), or where those are written."""
    folder = Path(folder)
    found = [folder / name for name in (AVERAGED_MODEL, FINAL_MODEL) if (folder / name).is_file()]
    for checkpoints in (folder, folder / CHECKPOINTS):
        found += [path for _, path in list_checkpoints(checkpoints)[-1:]]
    found = found or sorted(folder.glob("*.pt"))[:3]
    if found:
        return f" (one file: did you mean {' or '.join(str(path) for path in found)}?)"
    return (" (one file: an averaged results/average/<model>/model.pt, a run's final.pt, or a checkpoint "
            "checkpoints/step_*.pt)")


def _check_vocabulary(path: str | os.PathLike, checkpoint: dict, config: ModelConfig,
                      spm_model: str | os.PathLike) -> None:
    from aiayn.bpe import load_processor, vocab_fingerprint

    pieces = load_processor(spm_model).get_piece_size()
    if pieces != config.vocab_size:
        raise UserError(
            f"{spm_model} has {pieces} pieces but the model was trained with vocab_size = "
            f"{config.vocab_size}; use the SentencePiece model of the model's own run"
        )
    if checkpoint["vocab_fingerprint"] != vocab_fingerprint(spm_model):
        raise UserError(f"{path} was trained with another vocabulary than {spm_model}; "
                        "use the SentencePiece model of the model's own run")


def save_model(obj: dict, path: str | os.PathLike) -> None:
    """Write ``obj`` with torch.save so that ``path`` either holds the whole file or is untouched."""
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def last_checkpoints(checkpoint_dir: str | os.PathLike, k: int) -> list[Path]:
    """The last ``k`` window checkpoints ``step_*.pt`` of ``checkpoint_dir`` that exist, oldest first.

    Fewer than ``k`` when the run has fewer (it ended early, by ``train.max_minutes``); none is an error.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if k < 1:
        raise UserError(f"cannot average the last {k} checkpoints; K must be at least 1")
    if checkpoint_dir.is_file():
        raise UserError(f"{checkpoint_dir} is a file, but --checkpoint-dir names the folder of a run's step_*.pt "
                        "(or list checkpoint files without --last)")
    if not checkpoint_dir.is_dir():
        raise UserError(f"{checkpoint_dir}: no such checkpoint directory (has training started?)")
    found = list_checkpoints(checkpoint_dir)
    if not found:
        raise UserError(
            f"{checkpoint_dir}: no window checkpoints (step_*.pt) to average; has the training run finished?"
        )
    return [path for _, path in found[-k:]]


def checkpoint_path(checkpoint_dir: str | os.PathLike, step: int, window: bool = True) -> Path:
    return Path(checkpoint_dir) / checkpoint_name(step, window)


def window_steps(last_step: int, interval: int, count: int) -> list[int]:
    """The steps of the last ``count`` window checkpoints of a run ending at ``last_step``, oldest first."""
    return [step for step in range(last_step - (count - 1) * interval, last_step + 1, interval) if step > 0]


def is_window_step(step: int, last_step: int, interval: int) -> bool:
    return (last_step - step) % interval == 0


def list_checkpoints(checkpoint_dir: str | os.PathLike, safety: bool = False) -> list[tuple[int, Path]]:
    """``(step, path)`` of the window checkpoints in ``checkpoint_dir``, oldest first (none if it is missing).

    With ``safety``, the safety checkpoints too (a window checkpoint first where both have one step).
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    found = []
    for path in checkpoint_dir.glob("*.pt"):
        match = CHECKPOINT_NAME.fullmatch(path.name)
        if match and (safety or match.group(1) == "step"):
            found.append((int(match.group(2)), match.group(1) == "safety", path))
    return [(step, path) for step, _, path in sorted(found)]

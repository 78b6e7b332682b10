"""Which device a stage runs on: the one rule for ``auto``, for training and decoding alike.

A job that asks for GPUs never falls back to the CPU: on a cluster that would train a ``gpus: 8`` preset on
a CPU until the job's time limit, and its retry would do it again.
"""

from __future__ import annotations

import os

import torch

from aiayn.errors import UserError


def cuda_diagnosis() -> str:
    """What torch sees of CUDA where it sees no device, in words: a CPU build, or a CUDA build with no
    visible device (CUDA_VISIBLE_DEVICES and the driver's own error, where torch gives one)."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU build: torch.version.cuda is None"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "unset" if visible is None else repr(visible)
    reason = ""
    try:
        torch.cuda.init()  # raises with the driver's reason where there is one
    except Exception as error:  # noqa: BLE001 (whatever the driver says is the diagnosis)
        reason = f"; the driver says: {str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}"
    return (f"this torch ({torch.__version__}) is built for CUDA {torch.version.cuda} but sees no GPU "
            f"(CUDA_VISIBLE_DEVICES is {shown}){reason}")


def no_gpu_error(what: str) -> UserError:
    return UserError(
        f"{what}, but torch sees no CUDA device here: {cuda_diagnosis()}. Nothing was run. To train on the GPU, "
        "install torch's CUDA build (docs/gpu-check.md) and check it with "
        "python -c \"import torch; print(torch.version.cuda, torch.cuda.is_available())\" on the GPU node; "
        "to train on the CPU on purpose, set train.device: cpu (or the preset's gpus: 0)")


def choose_device(requested: str = "auto", gpus: int | None = None, local_rank: int = 0,
                  share_gpus: bool = False) -> torch.device:
    """The device of this process.

    ``auto`` with ``gpus`` None (decoding, averaging): a GPU when torch sees one, else the CPU. ``auto``
    with ``gpus`` 0: the CPU. ``auto`` with ``gpus`` >= 1 (a training preset that asks for GPUs) and
    ``cuda``: a GPU, and a user error where torch sees none. More processes on this node (torchrun's
    LOCAL_WORLD_SIZE) than visible GPUs is refused unless ``share_gpus`` (train.share_gpus) allows it.
    """
    if requested == "cpu" or (requested == "auto" and gpus == 0):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if requested == "auto" and gpus is None:
            return torch.device("cpu")
        asked = (f"device {requested} (--device or train.device)" if requested == "cuda"
                 else f"the preset asks for gpus: {gpus} with train.device: auto")
        raise no_gpu_error(asked)
    count = torch.cuda.device_count()
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if processes > count and not share_gpus:
        raise UserError(
            f"{processes} training processes on this node but torch sees {count} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES is {os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): they would share GPUs, "
            "each step at a fraction of the speed. Run one process a GPU (--processes, or the preset's gpus), "
            "ask the scheduler for as many GPUs as the preset's gpus, or set train.share_gpus: true to share on "
            "purpose")
    index = local_rank % count
    torch.cuda.set_device(index)
    return torch.device("cuda", index)

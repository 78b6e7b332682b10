"""Which device a stage runs on: the one rule for ``auto``, for training and decoding alike."""

from __future__ import annotations

import torch

from aiayn.errors import UserError


def choose_device(requested: str = "auto", gpus: int = 1, local_rank: int = 0) -> torch.device:
    """``auto``: a GPU when torch sees one and the job asks for GPUs (``gpus`` > 0), else the CPU.

    ``cuda`` where torch sees no GPU is a user error. Processes that outnumber the GPUs share them
    (local rank modulo the GPU count).
    """
    if requested == "cpu" or (requested == "auto" and (gpus == 0 or not torch.cuda.is_available())):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(f"device {requested} (--device or train.device), but torch sees no CUDA device here; "
                        "use auto or cpu, or run the job where a GPU is visible")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)

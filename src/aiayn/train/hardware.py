"""How training runs on this machine: its processes, fused Adam, compile and peak FLOPs.

Nothing here changes what is learned (the paper's step is in ``aiayn.train.trainer``); it decides how fast
a step runs on a given CPU or GPU (which device: ``aiayn.device``; in which precision: ``aiayn.speed.precision``),
and what its peak FLOPs are for the model FLOPs utilisation.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from aiayn.model import ModelConfig, Transformer
from aiayn.speed.cpu_attention import cpu_attention
from aiayn.speed.dropout import cpu_dropout

# Dense peaks (FLOP/s, without sparsity) from the vendors' datasheets, per precision a run multiplies in:
# the tensor cores for bf16 and fp16, the CUDA cores for fp32 (torch leaves TF32 off for matrix products).
# A precision a chip lacks has no entry (bf16 before compute capability 8.0); the figure is then unknown,
# not another precision's. A plain chip name has the SXM module's figures (the P100's: its PCIe card's);
# a form named in the key has its own.
_TENSOR_16 = {"H200": 989e12, "H100": 989e12, "H100 PCIe": 756e12, "A100": 312e12, "L40S": 362e12, "L40": 181e12,
              "L4": 121e12, "A10G": 70e12, "A10": 125e12}
PEAK_FLOPS = {
    "bf16": _TENSOR_16,
    "fp16": {**_TENSOR_16, "V100": 125e12, "V100-PCIE": 112e12, "V100S": 130e12, "T4": 65e12,
             "P100": 18.7e12, "P100-SXM2": 21.2e12},  # P100 has no tensor cores: fp16 at twice its fp32 rate
    "fp32": {"H200": 67e12, "H100": 67e12, "H100 PCIe": 51e12, "A100": 19.5e12, "L40S": 91.6e12, "L40": 90.5e12,
             "L4": 30.3e12, "A10": 31.2e12, "V100": 15.7e12, "V100-PCIE": 14e12, "V100S": 16.4e12, "T4": 8.1e12,
             "P100": 9.3e12, "P100-SXM2": 10.6e12},
}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak for ``precision`` (as ``resolved_precision`` gives it), for the model FLOPs
    utilisation: AIAYN_PEAK_FLOPS where set, else ``PEAK_FLOPS``'s entry for the chip whose name torch's
    device name holds as a word (an "L40S" is no "L4", an "A100" no "A10"; of several, the longest: "H100
    PCIe" before "H100"); None on a CPU and for a chip or precision not in the table."""
    if "AIAYN_PEAK_FLOPS" in os.environ:
        return float(os.environ["AIAYN_PEAK_FLOPS"])
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peaks = PEAK_FLOPS.get(precision, {})
    chips = [chip for chip in peaks if re.search(rf"\b{re.escape(chip)}\b", name)]
    return peaks[max(chips, key=len)] if chips else None


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environment(cls) -> "Distributed":
        """torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; a plain process is rank 0 of 1."""
        return cls(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
                   int(os.environ.get("LOCAL_RANK", "0")))

    def init(self, device: torch.device) -> None:
        """Join the process group: NCCL when each process has a GPU of its own, gloo otherwise."""
        if self.world_size == 1:
            return
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        own_gpu = device.type == "cuda" and local_world <= torch.cuda.device_count()
        torch.distributed.init_process_group("nccl" if own_gpu else "gloo")


def loss_chunk_tokens(device: torch.device, vocab_size: int, tokens: int) -> int | None:
    """Target tokens per chunk of the output projection and loss (aiayn.loss): on a GPU the micro-batch's
    ``tokens`` in one chunk where an eighth of the free device memory holds their fp32 log-probabilities
    twice over (fewer, larger products and no loop), else as many as it holds; on the CPU the loss's
    own default (None)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(tokens, free // 8 // (8 * vocab_size)))


def model_for_training(config: ModelConfig, device: torch.device) -> Transformer:
    """The model as training runs it on ``device``: on the CPU with its dropout masks cheaper to draw
    (aiayn.speed.dropout) and its attention in bf16 under bf16 autocast (aiayn.speed.cpu_attention), the paper's
    modules otherwise."""
    model = Transformer(config).to(device)
    cpu_dropout(model, device)
    cpu_attention(model, device)
    return model


def adam(parameters, device: torch.device, *, lr: float, betas: tuple[float, float], eps: float) -> torch.optim.Adam:
    """The paper's Adam, fused (one pass over each parameter, its gradient and moments per step)
    where torch has the kernel, the CPU and CUDA; torch's default for-loop elsewhere."""
    return torch.optim.Adam(parameters, lr=lr, betas=betas, eps=eps, fused=device.type in ("cpu", "cuda") or None)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """``optimizer.load_state_dict`` keeping this optimizer's implementation choice (``fused``,
    ``foreach``): a saved state dict carries the saver's, which would otherwise replace it (a run
    resumed from a checkpoint of the for-loop Adam would stay on the for-loop)."""
    groups = [dict(saved, fused=current["fused"], foreach=current["foreach"])
              for saved, current in zip(state["param_groups"], optimizer.param_groups)]
    optimizer.load_state_dict({**state, "param_groups": groups})


# Under train.compile, micro-batches are padded to multiples of this (rows and lengths).
COMPILE_MULTIPLE = 8
COMPILE_BACKEND = "inductor"


def compiled(objective, backend: str | None = None):
    """torch.compile for training, where every micro-batch has another shape: sizes are symbolic
    from the first call (no graph per shape), and batches padded to ``COMPILE_MULTIPLE`` never have
    a size of 1, which would be specialised to a graph of its own."""
    from torch.fx.experimental import _config as shape_config

    # Without this, sizes that happen to be equal in the first batch (rows and a length, say) become
    # one symbol, and the first batch where they differ compiles the graph again.
    shape_config.use_duck_shape = False
    return torch.compile(objective, backend=backend or COMPILE_BACKEND, dynamic=True)

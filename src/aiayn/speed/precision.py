"""The precision each device computes in, and the autocast and attention kernels that give it.

Shared by training, decoding and the averaging stage's dev evaluation (and the sizes of ``aiayn.memory``), so it
lives below them all: ``resolved_precision`` (train.precision's ``auto``: a GPU by its compute capability, a CPU by
its bf16 units), ``inference_precision`` (decoding's), ``autocast_context`` and ``attention_kernels``.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def cpu_has_bf16_matrix_units() -> bool:
    """Whether this CPU has bf16 dot-product instructions, as torch's cpuinfo reports: Intel AMX tiles
    (``amx_bf16``) or AVX512-BF16 (``avx512_bf16``: Cooper Lake, AMD Zen 4 and later)."""
    capabilities = torch.cpu.get_capabilities()
    return bool(capabilities.get("amx_bf16") or capabilities.get("avx512_bf16"))


def resolved_precision(precision: str, device: torch.device) -> str:
    """train.precision on this device: ``fp32``, ``bf16`` and ``fp16`` as given; ``auto`` on a GPU by its
    compute capability: bf16 from 8.0 (A100 on), fp16 with loss scaling on 7.x (V100, T4: no bf16 units,
    ``aiayn.train.precision``), fp32 below (P100: no tensor cores); on a CPU, bf16 with AMX or
    AVX512-BF16, where a whole training step was measured faster in bf16 (BENCHMARKS.md: AMX on an Intel
    Xeon, AVX512-BF16 on an AMD EPYC), and fp32 on other CPUs."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return "bf16" if major >= 8 else "fp16" if major == 7 else "fp32"
    if device.type == "cpu" and cpu_has_bf16_matrix_units():
        return "bf16"
    return "fp32"


# train.attention: the CUDA kernels SDPA may use, in the order it tries them (bench/gpu.sh times each)
ATTENTION_KERNELS = {
    "cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "math": [SDPBackend.MATH],
}


def attention_kernels(name: str, device: torch.device | str = "cuda"):
    """A context in which SDPA on ``device`` chooses among train.attention's kernels: flash serves the
    unmasked causal self-attention and needs another for masked keys; ``auto`` and the CPU are left to
    torch (the CPU's own choice is ``autocast_context``'s)."""
    if name == "auto" or torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(ATTENTION_KERNELS[name], set_priority=True)


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def autocast_context(device: torch.device, precision: str, attention: str = "auto"):
    """bf16 or fp16 autocast where ``resolved_precision`` says so. On the CPU also SDPA's math kernel:
    torch's CPU flash-attention kernel is several times slower in bf16 than in fp32 (its backward above
    all), which would cost a training step more than bf16 matrix products win (BENCHMARKS.md). The
    trainer's own model attends in bf16 there without SDPA (aiayn.speed.cpu_attention); this serves any
    other model (bench/train/cpu.py's peer). On CUDA, SDPA's kernels are train.attention's
    (``attention_kernels``)."""
    kernels = attention_kernels(attention, device)
    dtype = AUTOCAST_DTYPES.get(resolved_precision(precision, device))
    if dtype is None:
        with kernels:
            yield
        return
    cpu_math = sdpa_kernel(SDPBackend.MATH) if device.type == "cpu" else contextlib.nullcontext()
    with torch.autocast(device_type=device.type, dtype=dtype), cpu_math, kernels:
        yield


def inference_precision(device: torch.device) -> str:
    """The precision decoding runs in: on a GPU what ``auto`` is for training there (bf16, fp16 or fp32 by
    its compute capability); on the CPU fp32, where the search has kernels of its own (aiayn.speed)."""
    return resolved_precision("auto", device) if device.type == "cuda" else "fp32"

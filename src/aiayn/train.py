"""The train stage: one model preset, trained the paper's way, resumable, tracked in MLflow.

docs/PAPER.md, Training: Adam(0.9, 0.98, 1e-9), ``lrate = d_model^-0.5 * min(step^-0.5,
step * warmup^-1.5)``, label smoothing, about 25000 source + 25000 target tokens a step (the same micro-batches on
any number of devices, see ``aiayn.batching.step_batches``), window checkpoints at the paper's
step interval for averaging. Runs as one process on a CPU or GPU, or as several under
``torchrun`` (DDP).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from aiayn.batching import (StepShape, collate, length_batches, padded_to_multiple, split_step,
                            step_batches)
from aiayn.binarize import load_split
from aiayn.bpe import PAD_ID
from aiayn.bpe import vocab_fingerprint as bpe_fingerprint
from aiayn.checkpoint import (CHECKPOINT_FORMAT, MODEL_FORMAT, checkpoint_path, choose_device, is_window_step,
                              list_checkpoints, load_checkpoint, save_model)
from aiayn.config import check_resolved_preset, check_section, schema_default
from aiayn.errors import UserError, cli
from aiayn.fileio import (missing_folders, refuse_overwriting_inputs, remove_empty_folders,
                          remove_stale_temporaries_in, write_json_atomic)
from aiayn.loss import TrainingObjective, teacher_forced_loss
from aiayn.model import ModelConfig, Transformer
from aiayn.speed.cpu_attention import cpu_attention
from aiayn.speed.dropout import cpu_dropout
from aiayn.speed.host_memory import keep_freed_memory

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again"; Snakemake's --retries (or a SLURM requeue) resumes

# Dense bf16 tensor-core peaks, for model FLOPs utilisation when the device is known.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "A10G": 70e12, "L4": 121e12,
                   "L40S": 362e12, "V100": 125e12, "P100": 18.7e12}


class TrainingDiverged(UserError):
    """The loss or the gradient norm became NaN or infinite."""


class Preempted(Exception):
    """Stopped on request (SIGTERM/SIGUSR1 or --stop-after-steps) after writing a checkpoint."""


# --- the paper's objective and schedule --------------------------------------------------

def learning_rate(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """docs/PAPER.md, Training: lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)."""
    step = max(step, 1)
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -1.5)


def forward_flops(config: ModelConfig, rows: int, src_len: int, tgt_len: int) -> float:
    """Multiply-add FLOPs (x2) of one forward pass over a padded batch, as the hardware does them."""
    d, h, dk, dv, ff, n = config.d_model, config.n_heads, config.head_dim, config.value_dim, config.d_ff, config.n_layers
    attention_proj = 2 * d * (2 * h * dk + h * dv) + 2 * h * dv * d  # q, k, v and output projections
    ffn = 4 * d * ff
    encoder = rows * src_len * (attention_proj + ffn) + rows * h * src_len * src_len * 2 * (dk + dv)
    decoder = (rows * tgt_len * (attention_proj + 2 * d * h * dk + 2 * h * dv * d + ffn)
               + rows * src_len * 2 * d * (h * dk + h * dv)
               + rows * h * tgt_len * (tgt_len + src_len) * 2 * (dk + dv))
    output = rows * tgt_len * 2 * d * config.vocab_size
    return float(n * (encoder + decoder) + output)


def peak_flops(device: torch.device) -> float | None:
    if "AIAYN_PEAK_FLOPS" in os.environ:
        return float(os.environ["AIAYN_PEAK_FLOPS"])
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_FLOPS.items():
        if key in name:
            return value
    return None


# --- settings ----------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainSettings:
    """A resolved preset plus the shared `train` section (see config/README.md)."""

    steps: int
    warmup_steps: int
    lr_scale: float
    label_smoothing: float
    tokens_per_step: int
    device_tokens: int
    adam_betas: tuple[float, float]
    adam_eps: float
    keep_checkpoints: int
    checkpoint_steps: int
    checkpoint_minutes: float | None
    max_minutes: float | None
    layout: int
    log_every: int
    dev_every: int
    compile: bool
    precision: str
    seed: int

    @classmethod
    def from_config(cls, preset: dict, train: dict, seed: int) -> "TrainSettings":
        return cls(
            steps=preset["steps"], warmup_steps=preset["warmup_steps"], lr_scale=preset["lr_scale"],
            label_smoothing=preset["label_smoothing"], tokens_per_step=train["tokens_per_step"],
            device_tokens=train["device_tokens"], adam_betas=tuple(train["adam_betas"]), adam_eps=train["adam_eps"],
            # averaging needs the last K checkpoints on disk
            keep_checkpoints=max(preset["keep_checkpoints"], preset["average_last"]),
            checkpoint_steps=preset["checkpoint_steps"], checkpoint_minutes=preset["checkpoint_minutes"],
            layout=max(1, preset["gpus"]),
            # a preset's own budget wins over the train section's
            max_minutes=preset["max_minutes"] if "max_minutes" in preset else train["max_minutes"],
            log_every=train["log_every"], dev_every=train["dev_every"], compile=train["compile"],
            precision=train["precision"], seed=seed,
        )


    def batch_rule(self) -> dict:
        """What fixes the batches and their order: a resumed run must find the same."""
        return {"tokens_per_step": self.tokens_per_step, "device_tokens": self.device_tokens,
                "gpus": self.layout, "seed": self.seed}


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



def cpu_has_bf16_matrix_units() -> bool:
    """Whether this CPU has bf16 dot-product instructions, as torch's cpuinfo reports: Intel AMX tiles
    (``amx_bf16``) or AVX512-BF16 (``avx512_bf16``: Cooper Lake, AMD Zen 4 and later)."""
    capabilities = torch.cpu.get_capabilities()
    return bool(capabilities.get("amx_bf16") or capabilities.get("avx512_bf16"))


def resolved_precision(precision: str, device: torch.device) -> str:
    """train.precision on this device: ``fp32`` and ``bf16`` as given; ``auto`` is bf16 autocast on CUDA
    and on a CPU with AMX or AVX512-BF16, where a whole training step was measured faster in bf16
    (BENCHMARKS.md: AMX on an Intel Xeon, AVX512-BF16 on an AMD EPYC), and fp32 on other CPUs."""
    if precision != "auto":
        return precision
    if device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16_matrix_units()):
        return "bf16"
    return "fp32"


@contextlib.contextmanager
def autocast_context(device: torch.device, precision: str):
    """bf16 autocast where ``resolved_precision`` says bf16. On the CPU also SDPA's math kernel: torch's
    CPU flash-attention kernel is several times slower in bf16 than in fp32 (its backward above all),
    which would cost a training step more than bf16 matrix products win (BENCHMARKS.md). The trainer's
    own model attends in bf16 there without SDPA (aiayn.speed.cpu_attention); this serves any other model
    (bench/train_cpu.py's peer)."""
    if resolved_precision(precision, device) != "bf16":
        yield
        return
    attention = sdpa_kernel(SDPBackend.MATH) if device.type == "cpu" else contextlib.nullcontext()
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16), attention:
        yield


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


# --- training state ----------------------------------------------------------------------

@dataclass
class Progress:
    """Where training is: everything beyond the model and optimizer needed to resume exactly."""

    step: int = 0
    epoch: int = 0
    cursor: int = 0  # next batch of this epoch's batch list
    target_tokens: int = 0
    source_tokens: int = 0
    train_flops: float = 0.0
    elapsed_seconds: float = 0.0  # in training steps
    wall_seconds: float = 0.0     # the whole loop: steps, dev evaluations, checkpoints (for max_minutes)
    padded_source_tokens: int = 0
    padded_target_tokens: int = 0
    dev_history: list = field(default_factory=list)

    def per_step(self) -> dict[str, float]:
        """Mean tokens of one optimizer step so far: what the run really trained on."""
        steps = max(self.step, 1)
        return {"real_src_tokens_per_step": self.source_tokens / steps,
                "real_tgt_tokens_per_step": self.target_tokens / steps,
                "padded_src_tokens_per_step": self.padded_source_tokens / steps,
                "padded_tgt_tokens_per_step": self.padded_target_tokens / steps}


class StopFlag:
    """Set by SIGTERM or SIGUSR1 (what SLURM sends before a kill or requeue)."""

    def __init__(self):
        self.signal: int | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal = signum


def micro_batch_seed(seed: int, step: int, index: int) -> int:
    """Dropout seed of one micro-batch, from its place in the global step.

    Seeding by (step, micro-batch) instead of carrying one RNG stream makes resuming exact
    and makes N processes draw the same dropout masks as one process accumulating N.
    """
    return (seed * 1_000_003 + step * 4099 + index) % (2 ** 63 - 1)


class StepSource:
    """The micro-batches of each optimizer step, in order, from (seed, epoch, cursor) alone."""

    def __init__(self, split, settings: TrainSettings):
        self.src_lengths, self.tgt_lengths = split.src_lengths, split.tgt_lengths  # computed once
        self.settings = settings
        self._epoch, self._steps = None, []

    def steps_of(self, epoch: int) -> list[np.ndarray]:
        if epoch != self._epoch:
            self._epoch = epoch
            self._steps = step_batches(self.src_lengths, self.tgt_lengths, self.settings.tokens_per_step,
                                       self.settings.seed, epoch)
        return self._steps

    def next(self, progress: Progress) -> tuple[list[np.ndarray], StepShape]:
        """The next step's micro-batches (advancing ``progress``' epoch and cursor) and its sizes."""
        if progress.cursor >= len(self.steps_of(progress.epoch)):
            progress.epoch += 1
            progress.cursor = 0
        rows = self.steps_of(progress.epoch)[progress.cursor]
        progress.cursor += 1
        micro = split_step(self.src_lengths, self.tgt_lengths, rows, self.settings.device_tokens,
                           self.settings.layout)
        return micro, StepShape.of(self.src_lengths, self.tgt_lengths, micro)


def dev_rows(split, config: ModelConfig) -> np.ndarray:
    """The pairs of an evaluation split the model can read: all, except with a learned positional table
    (Table 3 row E) those longer than it (source + EOS or BOS + target), which are left out of the dev
    loss (and counted), where they would end the run at its first dev evaluation."""
    rows = np.arange(len(split))
    if config.positional != "learned":
        return rows
    return rows[np.maximum(split.src_lengths, split.tgt_lengths) + 1 <= config.max_positions]


def evaluate(model: Transformer, split, device: torch.device, precision: str, max_tokens: int,
             epsilon: float, rows: np.ndarray | None = None) -> dict[str, float]:
    """Dev loss (label-smoothed), NLL and per-token perplexity (Table 3's PPL) over a whole split
    (or its ``rows``: ``dev_rows``)."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, nll: read once, at the end
    tokens = 0
    rows = np.arange(len(split)) if rows is None else rows
    with torch.inference_mode():
        for batch_rows in length_batches(split.src_lengths[rows], split.tgt_lengths[rows], max_tokens):
            batch = collate(split, rows[batch_rows]).to(device)
            with autocast_context(device, precision):
                sums += torch.stack(teacher_forced_loss(model, batch.src, batch.tgt_in, batch.tgt_out, epsilon,
                                                        tgt_real=batch.tgt_real)).double()
            tokens += batch.tgt_tokens
    model.train(was_training)
    loss_total, nll_total = sums.tolist()
    nll = nll_total / max(tokens, 1)
    return {"dev_loss": loss_total / max(tokens, 1), "dev_nll": nll, "dev_ppl": math.exp(min(nll, 50.0))}


# --- the loop ----------------------------------------------------------------------------

@dataclass
class TrainJob:
    preset: dict
    train_section: dict
    seed: int
    train_data: Path
    dev_data: Path | None
    spm_model: Path
    run_dir: Path
    experiment: str = "default"
    tracking_uri: str | None = None
    track: bool = True
    device: str = "auto"
    stop_after_steps: int | None = None
    progress_bar: bool = True


@dataclass
class StepOutcome:
    """What every process agrees on after a step's one synchronisation."""

    loss_sum: float
    nll_sum: float
    grad_norm: float
    stopping: bool  # a signal or --stop-after-steps: checkpoint and exit 75
    last: bool      # the schedule's last step, or the time budget is spent: end normally


class LogWindow:
    """Sums over the steps since the last log line, turned into the logged means."""

    KEYS = ("loss", "nll", "tokens", "src_tokens", "padded", "real", "time", "flops", "steps")

    def __init__(self):
        self.sums = dict.fromkeys(self.KEYS, 0.0)

    def add(self, outcome: StepOutcome, shape: StepShape, seconds: float, flops: float) -> None:
        for key, value in (("loss", outcome.loss_sum), ("nll", outcome.nll_sum), ("tokens", shape.real_tgt),
                           ("src_tokens", shape.real_src), ("padded", shape.padded_src + shape.padded_tgt),
                           ("real", shape.real_src + shape.real_tgt), ("time", seconds), ("flops", flops),
                           ("steps", 1)):
            self.sums[key] += value

    def metrics(self, peak: float | None, world: int) -> dict[str, float]:
        window = self.sums
        self.sums = dict.fromkeys(self.KEYS, 0.0)
        nll = window["nll"] / window["tokens"]
        metrics = {
            "train_loss": window["loss"] / window["tokens"], "train_nll": nll,
            "train_ppl": math.exp(min(nll, 50.0)),
            "target_tokens_per_second": window["tokens"] / max(window["time"], 1e-9),
            "tokens_per_step": window["tokens"] / window["steps"],
            "real_src_tokens_per_step": window["src_tokens"] / window["steps"],
            "real_tgt_tokens_per_step": window["tokens"] / window["steps"],
            "padding_efficiency": window["real"] / max(window["padded"], 1),
        }
        if peak:
            metrics["mfu"] = window["flops"] / max(window["time"], 1e-9) / (peak * world)
        return metrics


class Trainer:
    """One run: set up (or resumed) once, then ``run`` repeats the named parts of a step."""

    def __init__(self, job: TrainJob):
        self.job = job
        self.dist = Distributed.from_environment()
        requested = job.device if job.device != "auto" else job.train_section["device"]
        self.device = choose_device(requested, job.preset["gpus"], self.dist.local_rank)
        self.dist.init(self.device)
        self.settings = TrainSettings.from_config(job.preset, job.train_section, job.seed)
        self.world = self.dist.world_size
        check_layout(self.world, job.preset)
        self.train_split = load_split(job.train_data)
        self.dev_split = load_split(job.dev_data) if job.dev_data else None
        self.vocab_fingerprint = self.train_split.meta["vocab_fingerprint"]
        if bpe_fingerprint(job.spm_model) != self.vocab_fingerprint:
            raise UserError(f"{job.train_data} was binarized with another vocabulary than {job.spm_model}; "
                            "rerun the binarize stage")
        self.data_fingerprint = self.train_split.meta["data_fingerprint"]
        self.checkpoint_dir = job.run_dir / "checkpoints"
        self.model_config = self._model_config()
        self.dev_rows = self._dev_rows() if self.dev_split is not None else None
        torch.manual_seed(self.settings.seed)
        self.model = model_for_training(self.model_config, self.device)
        self.optimizer = adam(self.model.parameters(), self.device, lr=0.0, betas=self.settings.adam_betas,
                              eps=self.settings.adam_eps)
        self.progress = Progress()
        self.resumed_from = self._resume()
        self.training_model = self._wrap()
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        self.precision = resolved_precision(self.settings.precision, self.device)  # what `auto` became here
        self.peak = peak_flops(self.device)
        self.source = StepSource(self.train_split, self.settings)
        if not self.source.steps_of(self.progress.epoch):  # before tracking starts: no run is left open
            raise UserError(f"{job.train_data}: no training pairs")
        self.tracker = self._start_tracking() if self.dist.is_main else None

    # --- set-up ---------------------------------------------------------------------------

    def _dev_rows(self) -> np.ndarray:
        """``dev_rows``, warned about (rank 0) where pairs are left out; none left is refused now."""
        rows, split = dev_rows(self.dev_split, self.model_config), self.dev_split
        if len(rows) < len(split):
            left_out = np.setdiff1d(np.arange(len(split)), rows)
            lines = ", ".join(str(int(split.lines[row]) + 1) for row in left_out[:5])
            more = ", ..." if len(left_out) > 5 else ""
            where = (f"{len(left_out)} of the {len(split)} dev pairs of {self.job.dev_data} (lines {lines}{more} of "
                     f"{split.meta.get('src_file', 'its text')}) are longer than the learned positional table "
                     f"(max_positions = {self.model_config.max_positions})")
            if not len(rows):
                raise UserError(f"{where}: all of them, so there is no dev loss to compute; raise max_positions "
                                "or give shorter dev text")
            if self.dist.is_main:
                print(f"warning: {where}; they are left out of the dev loss (counted in final.json as "
                      "dev_pairs_skipped); raise max_positions to include them", file=sys.stderr)
        return rows

    def _model_config(self) -> ModelConfig:
        from aiayn.config import model_fields

        # binarize read the vocabulary size from the vocabulary whose fingerprint was just checked
        return ModelConfig(vocab_size=self.train_split.meta["vocab_size"], pad_id=PAD_ID,
                           **model_fields(self.job.preset))

    def _resume(self) -> Path | None:
        """Load the newest checkpoint that loads (window or safety), after checking that it is this run's.

        A damaged newest file (a job killed while the file system was writing it) is skipped, saying so.
        """
        state = path = None
        for _, candidate in reversed(list_checkpoints(self.checkpoint_dir, safety=True)):
            try:
                state, path = load_checkpoint(candidate), candidate
                break
            except UserError as error:
                if self.dist.is_main:
                    print(f"warning: skipping {candidate.name}, which does not load ({error}); resuming from an "
                          "older checkpoint", file=sys.stderr)
        if state is None:
            return None
        if state.get("format") != CHECKPOINT_FORMAT:
            raise UserError(f"{path}: not a training checkpoint; move it out of {self.checkpoint_dir}")
        if state["model_config"] != self.model_config.to_dict():
            raise UserError(f"{path}: its model_config differs from preset {self.job.preset['name']!r}; "
                            f"the preset changed since this run started: delete {self.job.run_dir} to start afresh")
        rule = self.settings.batch_rule()
        saved_rule = state.get("batch_rule", rule)
        if saved_rule != rule:
            changed = ", ".join(f"{key} {saved_rule.get(key)} -> {value}" for key, value in rule.items()
                                if saved_rule.get(key) != value)
            raise UserError(
                f"{path}: this run's batches were drawn with other settings ({changed}); resuming would "
                f"change which sentences make a step. Put the settings back to resume exactly, or delete "
                f"{self.job.run_dir} to start afresh")
        self.model.load_state_dict(state["model"])
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.progress = Progress(**state["progress"])
        torch.set_rng_state(state["rng"]["torch"])
        return path

    def _wrap(self) -> torch.nn.Module:
        """The model and its loss (``TrainingObjective``), under DDP when there are several processes
        and compiled when train.compile is set: (src, tgt_in, tgt_out) -> (loss sum, NLL sum)."""
        objective: torch.nn.Module = TrainingObjective(self.model, self.settings.label_smoothing)
        if self.world > 1:
            # the sinusoid table is the only buffer and never changes: nothing to send each step
            # (torch 2.13 renamed the switch; the GPU image's torch has the old name only)
            ddp = torch.nn.parallel.DistributedDataParallel
            no_buffer_sync = ({"forward_sync_buffers": False}
                              if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters
                              else {"broadcast_buffers": False})
            objective = ddp(objective, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                            **no_buffer_sync)
        if self.settings.compile:
            objective = compiled(objective)
        return objective

    def _start_tracking(self):
        from aiayn.tracking import Tracker, flatten, forget_unresumed_attempt, git_commit, git_tags

        job = self.job
        if self.resumed_from is None:  # a fresh start: what an earlier attempt logged is not this run's
            forget_unresumed_attempt(job.run_dir)
        tracker = Tracker(job.run_dir, job.tracking_uri, job.experiment,
                          run_name=f"{job.preset['name']}-seed{job.seed}", enabled=job.track)
        params = flatten("", {"preset": job.preset, "train": job.train_section, "seed": job.seed}, {})
        params.update({"model.parameters": str(self.model.num_parameters()), "world_size": str(self.world)})
        commit = git_commit()
        tags = {"preset": job.preset["name"], "seed": str(job.seed), "git_commit": commit,
                "data_fingerprint": self.data_fingerprint, "vocab_fingerprint": self.vocab_fingerprint,
                "device": self.device_name, "precision": self.precision,
                "table": job.preset.get("paper", {}).get("table", ""), "stage": "train", **git_tags(commit)}
        datasets = [("train", self.data_fingerprint, str(job.train_data), "training")]
        if self.dev_split is not None:
            datasets.append(("dev", self.dev_split.meta.get("data_fingerprint", ""), str(job.dev_data), "validation"))
        tracker.start(params, tags, datasets)
        if self.resumed_from:
            print(f"resuming from {self.resumed_from} (step {self.progress.step}) on {self.world} process(es)",
                  file=sys.stderr)
        return tracker

    # --- one step, in its named parts -----------------------------------------------------

    def forward_backward(self, step: int, micro: list[np.ndarray], shape: StepShape) -> torch.Tensor:
        """This process's micro-batches (``index % world == rank``): gradients summed, loss sums returned."""
        world, settings = self.world, self.settings
        mine = [(index, rows) for index, rows in enumerate(micro) if index % world == self.dist.rank]
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss, nll
        for position, (index, rows) in enumerate(mine):
            batch = collate(self.train_split, rows)
            if settings.compile:
                batch = padded_to_multiple(batch, COMPILE_MULTIPLE)
            batch = batch.to(self.device)
            torch.manual_seed(micro_batch_seed(settings.seed, step, index))
            last = position == len(mine) - 1
            sync = contextlib.nullcontext() if (world == 1 or last) else self.training_model.no_sync()
            with sync:
                with autocast_context(self.device, settings.precision):
                    loss, nll = self.training_model(batch.src, batch.tgt_in, batch.tgt_out, batch.tgt_real)
                # DDP averages gradients over processes; scale so that the result is the sum
                # over the whole step's target tokens divided by their number.
                (loss * (world / shape.real_tgt)).backward()
            sums += torch.stack([loss.detach(), nll.detach()]).double()
        return sums

    def agree(self, step: int, sums: torch.Tensor, stop: StopFlag, start_step: int, loop_start: float,
              budget: float) -> StepOutcome:
        """The step's one host-device synchronisation: loss, gradient norm, and every process's
        vote to stop (a signal) or to end (the last step, the time budget)."""
        votes = torch.zeros(5, dtype=torch.float64, device=self.device)
        votes[:2] = sums
        # measured, not clipped (the paper does not clip, so no pass scales the gradients); the same on
        # every process after DDP
        gradients = [p.grad for p in self.model.parameters() if p.grad is not None]
        votes[2] = torch.nn.utils.get_total_norm(gradients).double() / self.world
        job = self.job
        votes[3] = float(stop.signal is not None or (job.stop_after_steps is not None
                                                     and step - start_step >= job.stop_after_steps))
        votes[4] = float(self.progress.wall_seconds + time.monotonic() - loop_start >= budget)
        if self.world > 1:
            torch.distributed.all_reduce(votes)
        loss_sum, nll_sum, grad_norm, stop_votes, budget_votes = votes.tolist()
        return StepOutcome(loss_sum, nll_sum, grad_norm, stopping=stop_votes > 0,
                           last=step == self.settings.steps or budget_votes > 0)

    def check_finite(self, step: int, outcome: StepOutcome) -> None:
        """A NaN or infinite loss or gradient norm ends the run before anything is written."""
        for what, value in (("training loss", outcome.loss_sum), ("gradient norm", outcome.grad_norm)):
            if not math.isfinite(value):
                raise TrainingDiverged(
                    f"the {what} became {value} at step {step} (preset {self.job.preset['name']}); the last "
                    f"good checkpoint is kept in {self.checkpoint_dir}. Lower lr_scale or raise warmup_steps, "
                    "then rerun to resume from it"
                )

    def optimizer_step(self, step: int) -> float:
        lr = learning_rate(step, self.model_config.d_model, self.settings.warmup_steps, self.settings.lr_scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr

    def account(self, step: int, shape: StepShape, flops: float, seconds: float) -> None:
        progress = self.progress
        progress.step = step
        progress.target_tokens += shape.real_tgt
        progress.source_tokens += shape.real_src
        progress.padded_target_tokens += shape.padded_tgt
        progress.padded_source_tokens += shape.padded_src
        progress.train_flops += flops
        progress.elapsed_seconds += seconds

    def evaluate_dev(self, step: int) -> None:
        dev = evaluate(self.model, self.dev_split, self.device, self.settings.precision, self.settings.device_tokens,
                       self.settings.label_smoothing, self.dev_rows)
        self.progress.dev_history.append({"step": step, **dev})
        self.tracker.log_metrics(dev, step)

    def save_checkpoint(self, window: bool) -> Path:
        """Write this step's checkpoint; keep the window checkpoints averaging needs, and a safety
        checkpoint only while it is the newest."""
        progress, settings = self.progress, self.settings
        path = checkpoint_path(self.checkpoint_dir, progress.step, window)
        save_model({
            "format": CHECKPOINT_FORMAT, "step": progress.step, "model_config": self.model_config.to_dict(),
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "schedule": {"kind": "inverse_sqrt_warmup", "d_model": self.model_config.d_model,
                         "warmup_steps": settings.warmup_steps, "scale": settings.lr_scale},
            "progress": vars(progress).copy(), "rng": {"torch": torch.get_rng_state()},
            "batch_rule": settings.batch_rule(), "window": window,
            "config": {"preset": self.job.preset, "train": self.job.train_section, "seed": self.job.seed},
            "vocab_fingerprint": self.vocab_fingerprint, "data_fingerprint": self.data_fingerprint,
        }, path)
        for _, old in list_checkpoints(self.checkpoint_dir)[:-settings.keep_checkpoints]:
            old.unlink(missing_ok=True)
        for _, old in list_checkpoints(self.checkpoint_dir, safety=True):
            if old.name.startswith("safety_") and old != path:
                old.unlink(missing_ok=True)
        return path

    # --- the loop and its end -------------------------------------------------------------

    def run(self) -> dict:
        """Train until the last step or the time budget; returns the summary written to ``final.json``."""
        from tqdm import tqdm

        settings, progress, main = self.settings, self.progress, self.dist.is_main
        stop = StopFlag()
        stop.install()
        bar = tqdm(total=settings.steps, initial=progress.step, desc=self.job.preset["name"], unit="step",
                   disable=not (main and self.job.progress_bar), mininterval=1.0, file=sys.stderr)
        window = LogWindow()
        start_step = progress.step
        budget = settings.max_minutes * 60 if settings.max_minutes else math.inf
        last_checkpoint_time = time.monotonic()
        status = "FAILED"
        try:
            self.training_model.train()
            # within the loop the budget ends a run only through the vote (outcome.last), so that every
            # process stops at the same step and that step is written as a window checkpoint
            spent_before = progress.wall_seconds >= budget  # a rerun of a run that spent its budget
            while progress.step < settings.steps and not spent_before:
                loop_start, step_start = time.monotonic(), time.perf_counter()
                step = progress.step + 1
                micro, shape = self.source.next(progress)
                # every process knows the whole step's sizes: no communication before the forward pass
                flops = 3.0 * sum(forward_flops(self.model_config, *dims) for dims in shape.shapes)  # backward ~ 2x
                sums = self.forward_backward(step, micro, shape)
                outcome = self.agree(step, sums, stop, start_step, loop_start, budget)
                self.check_finite(step, outcome)
                lr = self.optimizer_step(step)
                seconds = time.perf_counter() - step_start
                self.account(step, shape, flops, seconds)
                window.add(outcome, shape, seconds, flops)
                bar.update(1)
                if main and (step % settings.log_every == 0 or outcome.last):
                    metrics = window.metrics(self.peak, self.world)
                    metrics.update({"lr": lr, "grad_norm": outcome.grad_norm, "train_flops": progress.train_flops,
                                    "epoch": progress.epoch})
                    self.tracker.log_metrics(metrics, step)
                    bar.set_postfix(loss=f"{metrics['train_loss']:.3f}", lr=f"{lr:.2e}",
                                    tok_s=f"{metrics['target_tokens_per_second']:.0f}")
                if main and self.dev_split is not None and settings.dev_every and step % settings.dev_every == 0:
                    self.evaluate_dev(step)
                progress.wall_seconds += time.monotonic() - loop_start
                # a run that ends at its time budget ends normally: its last step joins the window
                in_window = is_window_step(step, settings.steps, settings.checkpoint_steps) or outcome.last
                due_time = settings.checkpoint_minutes and \
                    time.monotonic() - last_checkpoint_time >= settings.checkpoint_minutes * 60
                if main and (in_window or due_time or outcome.stopping):
                    self.save_checkpoint(window=in_window)
                    last_checkpoint_time = time.monotonic()
                if outcome.last:
                    break
                if outcome.stopping:
                    status = "KILLED"
                    raise Preempted(f"stopped at step {step}; checkpoint written to {self.checkpoint_dir}")
            bar.close()
            if main and not checkpoint_path(self.checkpoint_dir, progress.step).exists() and progress.step:
                self.save_checkpoint(window=True)  # the run's end is always in the averaging window
            summary = self.finish() if main else {}
            status = "FINISHED"
            return summary
        finally:
            bar.close()
            if self.tracker is not None:
                self.tracker.end(status)
            if self.world > 1 and torch.distributed.is_initialized():
                self.leave_process_group(everyone_here=status in ("FINISHED", "KILLED"))

    def leave_process_group(self, everyone_here: bool) -> None:
        """Take the process group down while every peer still holds its own. DDP's reducer keeps the
        group alive past ``destroy_process_group``; freed later, once a peer had exited, gloo's
        destructor waited for its threads for ever (seen as a hang at the end of a finished run)."""
        if everyone_here:  # the end and a preemption are agreed by a vote: all processes are here
            torch.distributed.barrier()
        self.training_model = None
        gc.collect()
        torch.distributed.destroy_process_group()

    def finish(self) -> dict:
        """The final dev evaluation, ``final.pt`` and ``final.json`` (rank 0)."""
        progress, settings, job = self.progress, self.settings, self.job
        final_dev = {}
        if self.dev_split is not None:
            final_dev = evaluate(self.model, self.dev_split, self.device, settings.precision, settings.device_tokens,
                                 settings.label_smoothing, self.dev_rows)
            if not progress.dev_history or progress.dev_history[-1]["step"] != progress.step:
                progress.dev_history.append({"step": progress.step, **final_dev})
                self.tracker.log_metrics(final_dev, progress.step)
        save_model({"format": MODEL_FORMAT, "model_config": self.model_config.to_dict(),
                    "model": self.model.state_dict(), "vocab_fingerprint": self.vocab_fingerprint,
                    "data_fingerprint": self.data_fingerprint, "averaged_steps": [progress.step],
                    "averaged_from": [checkpoint_path(self.checkpoint_dir, progress.step).name]},
                   job.run_dir / "final.pt")
        summary = {
            "preset": job.preset["name"], "seed": job.seed, "step": progress.step, "epochs": progress.epoch,
            "parameters": self.model.num_parameters(), "target_tokens": progress.target_tokens,
            "source_tokens": progress.source_tokens, **progress.per_step(), "train_flops": progress.train_flops,
            "train_hours": progress.elapsed_seconds / 3600, "wall_hours": progress.wall_seconds / 3600,
            "planned_steps": settings.steps,
            "stopped_by": "steps" if progress.step >= settings.steps else "max_minutes",
            "world_size": self.world, "device": self.device_name, "device_peak_flops": self.peak,
            "precision": self.precision,
            "mlflow_run_id": self.tracker.run_id, "tracking_uri": self.tracker.uri, "experiment": job.experiment,
            **final_dev, "dev_history": progress.dev_history, "vocab_fingerprint": self.vocab_fingerprint,
            "data_fingerprint": self.data_fingerprint,
        }
        if self.dev_split is not None:
            summary["dev_pairs_skipped"] = len(self.dev_split) - len(self.dev_rows)
        self.tracker.log_metrics({"train_hours": summary["train_hours"], "parameters": summary["parameters"],
                                  **progress.per_step()}, progress.step)
        write_json_atomic(job.run_dir / "final.json", summary)
        return summary


def train(job: TrainJob) -> dict:
    """Train (or resume) one run; returns the summary written to ``final.json`` (empty off rank 0)."""
    return Trainer(job).run()


def check_layout(processes: int, preset: dict) -> None:
    """A step is split into a multiple of the preset's gpus micro-batches: more processes would idle."""
    layout = max(1, preset["gpus"])
    if processes > layout:
        raise UserError(f"{processes} processes, but preset {preset.get('name')!r} is laid out for gpus: "
                        f"{layout}, so a step has too few micro-batches for every process; set the preset's "
                        f"gpus to {processes} (or run {layout} processes or fewer)")


def processes_to_launch(requested: int | None, device: str, gpus: int) -> int:
    """Processes for this node: ``--processes``, else one per GPU the preset asks for and the node has."""
    if os.environ.get("WORLD_SIZE"):
        return 1  # already one of torchrun's workers
    if requested:
        return requested
    if device == "cpu" or gpus <= 1 or not torch.cuda.is_available():
        return 1
    return min(gpus, torch.cuda.device_count())


def _relaunch_under_torchrun(processes: int, argv: list[str], run_dir: Path) -> int:
    """Re-run this command as ``processes`` workers under torchrun; returns the job's exit status.

    torchrun reports any failed worker as status 1, so rank 0 leaves its own status in a file
    and that is returned: a preempted run still exits 75 and is retried. SIGTERM and SIGUSR1
    (a time limit, a preemption) are passed on to torchrun, which passes them to the workers.
    """
    import subprocess
    import tempfile

    run_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=run_dir, prefix=".torchrun-") as scratch:
        status_file = Path(scratch) / "status"
        # all workers are on this node: meet on loopback, not at whatever the host name resolves to
        # (a name that does not resolve left the workers waiting for a rendezvous that never came)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
                   f"--nproc_per_node={processes}", "-m", "aiayn.train", *argv]
        print(f"training as {processes} processes: {' '.join(command)}", file=sys.stderr, flush=True)
        loopback = {"GLOO_SOCKET_IFNAME": "lo"} if sys.platform.startswith("linux") else {}  # gloo's own lookup too
        child = subprocess.Popen(command, env={**loopback, **os.environ, "AIAYN_STATUS_FILE": str(status_file)})
        forward = lambda signum, frame: child.send_signal(signum)  # noqa: E731
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
        try:
            returncode = child.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if status_file.exists():
            return int(status_file.read_text())
        return returncode


def hold_run_lock(run_dir: Path):
    """One trainer per run folder: an exclusive lock on ``<run_dir>/.lock`` for this process's life.

    A second trainer on the same folder (an orphan of a killed workflow still running, say) would
    interleave its checkpoints and metrics with the first one's, so it refuses, naming the holder.
    """
    import atexit
    import fcntl

    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--run-dir {run_dir} is a file, but a run folder is expected; give another path")
    created = ([] if run_dir.exists() else [run_dir]) + missing_folders(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock_path = run_dir / ".lock"
    while True:
        handle = open(lock_path, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            handle.close()
            raise UserError(f"{run_dir} is being trained by another process (pid {holder}, which holds "
                            f"{run_dir}/.lock); wait for it to end or stop it (kill -TERM writes a checkpoint), "
                            "then rerun") from None
        if _is_file_at(handle, lock_path):
            break
        handle.close()  # its last holder removed it after we opened it: lock the file now at that path
    atexit.register(_release_run_lock, handle, lock_path, created)
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    # the folder is ours now: what a killed trainer was writing (.tmp-*) goes
    for folder in (run_dir, run_dir / "checkpoints"):
        remove_stale_temporaries_in(folder)
    return handle  # the lock lasts while this stays open


def _is_file_at(handle, path: Path) -> bool:
    try:
        return os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _release_run_lock(handle, lock_path: Path, created: list[Path]) -> None:
    """At exit: remove the lock file while still holding it (a trainer that opened it meanwhile finds it
    gone and locks a new one), then the folders the run made if nothing is in them (it failed at once)."""
    lock_path.unlink(missing_ok=True)
    handle.close()
    remove_empty_folders(created)


def _report_status(status: int) -> int:
    """Rank 0 of a relaunched job leaves its exit status where the launching process reads it."""
    target = os.environ.get("AIAYN_STATUS_FILE")
    if target and os.environ.get("RANK", "0") == "0":
        Path(target).write_text(str(status))
    return status


@cli
def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="aiayn train", description=__doc__.splitlines()[0])
    parser.add_argument("--preset-json", required=True, help="the resolved preset (what the Snakefile passes)")
    parser.add_argument("--train-json", required=True, help="the config's `train` section")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--train-data", required=True, type=Path, help="binarized train split folder")
    parser.add_argument("--dev-data", type=Path, help="binarized dev split folder")
    parser.add_argument("--spm-model", required=True, type=Path)
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--experiment", default=schema_default("experiment"),
                        help="the MLflow experiment (default: %(default)s, the schema's)")
    parser.add_argument("--tracking-uri", default=None)
    parser.add_argument("--no-tracking", action="store_true", help="metrics.jsonl only, no MLflow")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: leave torch's default)")
    parser.add_argument("--log-every", type=int, default=None,
                        help="overrides train.log_every (the Snakefile passes it apart: it changes no output)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="overrides train.device (auto: a GPU when there is one and the preset has gpus > 0)")
    parser.add_argument("--processes", type=int, default=None,
                        help="data-parallel processes on this node under torchrun (default: one per GPU, "
                             "up to the preset's gpus; 1 on the CPU)")
    parser.add_argument("--stop-after-steps", type=int, default=None,
                        help="checkpoint and exit with status 75 after this many steps (resume by rerunning)")
    args = parser.parse_args(argv)
    try:
        preset = json.loads(args.preset_json)
        train_section = json.loads(args.train_json)
    except json.JSONDecodeError as error:
        raise UserError(f"--preset-json/--train-json is not valid JSON ({error})") from None
    if args.log_every is not None:
        if args.log_every < 1:
            raise UserError(f"--log-every {args.log_every} must be at least 1")
        train_section = {**train_section, "log_every": args.log_every}
    train_section = check_section("train", train_section, "--train-json")
    check_resolved_preset(preset, "--preset-json")
    if args.processes is not None and args.processes < 1:
        raise UserError(f"--processes {args.processes}: give 1 or more")
    refuse_overwriting_inputs({"--run-dir": [args.run_dir / "final.pt", args.run_dir / "final.json"]},
                              {"--train-data": args.train_data, "--dev-data": args.dev_data,
                               "--spm-model": args.spm_model}, {"--run-dir": args.run_dir / "checkpoints"})
    if not os.environ.get("AIAYN_STATUS_FILE") and os.environ.get("RANK", "0") == "0":
        lock = hold_run_lock(args.run_dir)  # noqa: F841 (held until the process ends); workers share the launcher's
    device = args.device if args.device != "auto" else train_section["device"]
    processes = processes_to_launch(args.processes, device, preset["gpus"])
    if processes > 1:
        check_layout(processes, preset)
        return _relaunch_under_torchrun(processes, argv, args.run_dir)
    threads = args.threads or train_section["threads"]
    if threads:
        torch.set_num_threads(threads)
    keep_freed_memory()  # the process that trains: each step reuses the last one's host memory
    job = TrainJob(preset, train_section, args.seed, args.train_data, args.dev_data, args.spm_model, args.run_dir,
                   args.experiment, args.tracking_uri, not args.no_tracking, args.device, args.stop_after_steps)
    try:
        summary = train(job)
    except Preempted as stopped:
        print(f"{stopped}; rerun the same command to resume", file=sys.stderr)
        return _report_status(EXIT_PREEMPTED)
    except UserError:
        _report_status(2)
        raise
    if summary:
        print(json.dumps({k: v for k, v in summary.items() if k != "dev_history"}, indent=2))
    return _report_status(0)


if __name__ == "__main__":
    raise SystemExit(main())

"""The train stage: one model preset, trained the paper's way, resumable, tracked in MLflow.

PAPER.md, Training: Adam(0.9, 0.98, 1e-9), ``lrate = d_model^-0.5 * min(step^-0.5,
step * warmup^-1.5)``, label smoothing, about 25000 source + 25000 target tokens a step
(reached on any number of devices by gradient accumulation), checkpoints every 10 minutes.
Runs as one process on a CPU or GPU, or as several under ``torchrun`` (DDP).
"""

from __future__ import annotations

import argparse
import contextlib
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
import torch.nn.functional as F

from aiayn.batching import Batch, collate, length_batches
from aiayn.binarize import load_split
from aiayn.bpe import PAD_ID
from aiayn.bpe import vocab_fingerprint as bpe_fingerprint
from aiayn.checkpoint import (CHECKPOINT_FORMAT, MODEL_FORMAT, checkpoint_path, list_checkpoints,
                              load_checkpoint, save_model)
from aiayn.errors import UserError, cli
from aiayn.fileio import write_json_atomic
from aiayn.model import ModelConfig, Transformer

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again"; Snakemake's --retries (or a SLURM requeue) resumes

# Dense bf16 tensor-core peaks, for model FLOPs utilisation when the device is known.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "A10G": 70e12, "L4": 121e12,
                   "L40S": 362e12, "V100": 125e12, "P100": 18.7e12}


class TrainingDiverged(UserError):
    """The loss became NaN or infinite."""


class Preempted(Exception):
    """Stopped on request (SIGTERM/SIGUSR1 or --stop-after-steps) after writing a checkpoint."""


# --- the paper's objective and schedule --------------------------------------------------

def learning_rate(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """PAPER.md, Training: lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)."""
    step = max(step, 1)
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -1.5)


def label_smoothed_loss(logits: torch.Tensor, target: torch.Tensor, epsilon: float,
                        pad_id: int = PAD_ID) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed label-smoothed cross-entropy and summed NLL over non-pad target tokens.

    The smoothed target puts 1 - eps on the reference and spreads eps uniformly over the
    vocabulary (as torch's ``label_smoothing``); one log-softmax serves both sums, and the
    gradient is the closed form of ``_SmoothedCrossEntropy`` (fewer passes over the logits than
    autograd's gather, mean and log-softmax backward).
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # fp32 even under autocast
    logits = logits.reshape(-1, logits.size(-1))  # (tokens, vocab)
    target = target.reshape(-1)
    keep = (target != pad_id).to(logits.dtype)
    return _SmoothedCrossEntropy.apply(logits, target, keep, float(epsilon))


class _SmoothedCrossEntropy(torch.autograd.Function):
    """(tokens, vocab) logits -> (sum of smoothed losses, sum of NLLs) over the tokens where keep is 1.

    Per token, with p = softmax(logits) and y the reference: loss = (1 - eps) * nll + eps * mean_v(-log p_v),
    so d loss / d logits = p - (1 - eps) * onehot(y) - eps / vocab, and d nll / d logits = p - onehot(y).
    """

    @staticmethod
    def forward(ctx, logits, target, keep, epsilon):
        log_probs = logits.log_softmax(dim=-1)
        nll = -log_probs.gather(1, target[:, None]).squeeze(1)
        smooth = -log_probs.mean(dim=-1)
        ctx.save_for_backward(log_probs, target, keep)
        ctx.epsilon = epsilon
        return ((1.0 - epsilon) * nll + epsilon * smooth).mul(keep).sum(), nll.mul(keep).sum()

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        log_probs, target, keep = ctx.saved_tensors
        epsilon, vocab = ctx.epsilon, log_probs.shape[1]
        # The saved log-probs are not needed after this, so the gradient is built in their memory.
        grad = log_probs.exp_().mul_((keep * (grad_loss + grad_nll))[:, None])
        grad.sub_((keep * (grad_loss * epsilon / vocab))[:, None])
        grad.scatter_add_(1, target[:, None], (-keep * (grad_loss * (1.0 - epsilon) + grad_nll))[:, None])
        return grad, None, None, None


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
    checkpoint_steps: int | None
    checkpoint_minutes: float | None
    log_every: int
    dev_every: int
    compile: bool
    precision: str
    seed: int

    @classmethod
    def from_config(cls, preset: dict, train: dict, seed: int) -> "TrainSettings":
        return cls(
            steps=preset["steps"], warmup_steps=preset["warmup_steps"], lr_scale=preset.get("lr_scale", 1.0),
            label_smoothing=preset["label_smoothing"], tokens_per_step=train["tokens_per_step"],
            device_tokens=train["device_tokens"], adam_betas=tuple(train["adam_betas"]), adam_eps=train["adam_eps"],
            # averaging needs the last K checkpoints on disk
            keep_checkpoints=max(preset["keep_checkpoints"], preset["average_last"]),
            checkpoint_steps=preset["checkpoint_steps"], checkpoint_minutes=preset["checkpoint_minutes"],
            log_every=train["log_every"], dev_every=train["dev_every"], compile=train["compile"],
            precision=train["precision"], seed=seed,
        )


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
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend)
        return cls(torch.distributed.get_rank(), world, int(os.environ.get("LOCAL_RANK", "0")))

    def all_sum(self, values: list[float], device) -> list[float]:
        if self.world_size == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        torch.distributed.all_reduce(tensor)
        return tensor.tolist()


def choose_device(dist: Distributed, requested: str = "auto") -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but torch sees no CUDA device")
    torch.cuda.set_device(dist.local_rank)
    return torch.device("cuda", dist.local_rank)


def autocast_context(device: torch.device, precision: str):
    use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    if use_bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


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
    elapsed_seconds: float = 0.0
    dev_history: list = field(default_factory=list)


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


def accumulation_steps(tokens_per_step: int, device_tokens: int, world_size: int) -> int:
    """Micro-batches per device per step so that the effective batch stays the paper's."""
    return max(1, math.ceil(tokens_per_step / (device_tokens * world_size)))


def evaluate(model: Transformer, split, device: torch.device, precision: str, max_tokens: int,
             epsilon: float) -> dict[str, float]:
    """Dev loss (label-smoothed), NLL and per-token perplexity (Table 3's PPL) over a whole split."""
    was_training = model.training
    model.eval()
    loss_total = nll_total = tokens = 0.0
    with torch.inference_mode():
        for rows in length_batches(split.src_lengths, split.tgt_lengths, max_tokens):
            batch = collate(split, rows).to(device)
            with autocast_context(device, precision):
                logits = model(batch.src, batch.tgt_in)
            loss_sum, nll_sum = label_smoothed_loss(logits, batch.tgt_out, epsilon)
            loss_total += loss_sum.item()
            nll_total += nll_sum.item()
            tokens += batch.tgt_tokens
    model.train(was_training)
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


def _unwrap(model: torch.nn.Module) -> Transformer:
    model = getattr(model, "module", model)  # DDP
    return getattr(model, "_orig_mod", model)  # torch.compile


def train(job: TrainJob) -> dict:
    """Train (or resume) one run; returns the summary written to ``final.json``."""
    from aiayn.config import model_fields

    dist = Distributed.from_environment()
    device = choose_device(dist, job.device)
    settings = TrainSettings.from_config(job.preset, job.train_section, job.seed)
    train_split = load_split(job.train_data)
    dev_split = load_split(job.dev_data) if job.dev_data else None
    vocab_size = train_split.meta["vocab_size"]  # binarise read it from the vocabulary checked below
    vocab_fingerprint = train_split.meta["vocab_fingerprint"]
    if bpe_fingerprint(job.spm_model) != vocab_fingerprint:
        raise UserError(f"{job.train_data} was binarised with another vocabulary than {job.spm_model}; "
                        "rerun the binarise stage")
    data_fingerprint = train_split.meta["data_fingerprint"]
    model_config = ModelConfig(vocab_size=vocab_size, pad_id=PAD_ID, **model_fields(job.preset))
    checkpoint_dir = job.run_dir / "checkpoints"

    torch.manual_seed(settings.seed)
    model = Transformer(model_config).to(device)
    fused = device.type == "cuda"
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0, betas=settings.adam_betas, eps=settings.adam_eps,
                                 fused=fused or None)
    progress = Progress()
    resumed_from = None
    existing = list_checkpoints(checkpoint_dir)
    if existing:
        resumed_from = existing[-1][1]
        state = load_checkpoint(resumed_from)
        if state.get("format") != CHECKPOINT_FORMAT:
            raise UserError(f"{resumed_from}: not a training checkpoint; move it out of {checkpoint_dir}")
        if state["model_config"] != model_config.to_dict():
            raise UserError(f"{resumed_from}: its model_config differs from preset {job.preset['name']!r}; "
                            f"the preset changed since this run started: delete {job.run_dir} to start afresh")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        progress = Progress(**state["progress"])
        torch.set_rng_state(state["rng"]["torch"])

    world = dist.world_size
    accumulation = accumulation_steps(settings.tokens_per_step, settings.device_tokens, world)
    training_model: torch.nn.Module = model
    if world > 1:
        training_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    if settings.compile:
        training_model = torch.compile(training_model)

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tracker = None
    if dist.is_main:
        from aiayn.tracking import Tracker, flatten, git_commit

        tracker = Tracker(job.run_dir, job.tracking_uri, job.experiment,
                          run_name=f"{job.preset['name']}-seed{job.seed}", enabled=job.track)
        params = flatten("", {"preset": job.preset, "train": job.train_section, "seed": job.seed}, {})
        params.update({"model.parameters": str(model.num_parameters()), "world_size": str(world),
                       "accumulation": str(accumulation)})
        tags = {"preset": job.preset["name"], "seed": str(job.seed), "git_commit": git_commit(),
                "data_fingerprint": data_fingerprint, "vocab_fingerprint": vocab_fingerprint, "device": device_name,
                "table": job.preset.get("paper", {}).get("table", ""), "stage": "train"}
        tracker.start(params, tags)
        if resumed_from:
            print(f"resuming from {resumed_from} (step {progress.step})", file=sys.stderr)

    stop = StopFlag()
    stop.install()
    peak = peak_flops(device)
    last_checkpoint_time = time.monotonic()
    batches = length_batches(train_split.src_lengths, train_split.tgt_lengths, settings.device_tokens,
                             seed=settings.seed, epoch=progress.epoch)
    if not batches:
        raise UserError(f"{job.train_data}: no training pairs")

    def save(step_progress: Progress) -> Path:
        path = checkpoint_path(checkpoint_dir, step_progress.step)
        save_model({
            "format": CHECKPOINT_FORMAT, "step": step_progress.step, "model_config": model_config.to_dict(),
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "schedule": {"kind": "inverse_sqrt_warmup", "d_model": model_config.d_model,
                         "warmup_steps": settings.warmup_steps, "scale": settings.lr_scale},
            "progress": vars(step_progress).copy(), "rng": {"torch": torch.get_rng_state()},
            "config": {"preset": job.preset, "train": job.train_section, "seed": job.seed},
            "vocab_fingerprint": vocab_fingerprint, "data_fingerprint": data_fingerprint,
        }, path)
        for _, old in list_checkpoints(checkpoint_dir)[:-settings.keep_checkpoints]:
            old.unlink(missing_ok=True)
        return path

    from tqdm import tqdm

    bar = tqdm(total=settings.steps, initial=progress.step, desc=job.preset["name"], unit="step",
               disable=not (dist.is_main and job.progress_bar), mininterval=1.0, file=sys.stderr)
    window = {"loss": 0.0, "nll": 0.0, "tokens": 0, "src_tokens": 0, "padded": 0, "real": 0, "time": 0.0,
              "flops": 0.0, "steps": 0}
    start_step = progress.step
    status = "FAILED"
    try:
        training_model.train()
        while progress.step < settings.steps:
            step_start = time.perf_counter()
            step = progress.step + 1
            group = []
            while len(group) < accumulation * world:
                if progress.cursor >= len(batches):
                    progress.epoch += 1
                    progress.cursor = 0
                    batches = length_batches(train_split.src_lengths, train_split.tgt_lengths,
                                             settings.device_tokens, seed=settings.seed, epoch=progress.epoch)
                group.append(batches[progress.cursor])
                progress.cursor += 1
            mine = [(index, rows) for index, rows in enumerate(group) if index % world == dist.rank]
            micro = [(index, collate(train_split, rows)) for index, rows in mine]
            local = [sum(b.tgt_tokens for _, b in micro), sum(b.src_tokens for _, b in micro),
                     sum(b.padded_tokens for _, b in micro), sum(b.tgt_tokens + b.src_tokens for _, b in micro),
                     sum(forward_flops(model_config, b.src.size(0), b.src.size(1), b.tgt_in.size(1)) for _, b in micro)]
            step_tokens, step_src_tokens, padded, real, flops = dist.all_sum(local, device)
            lr = learning_rate(step, model_config.d_model, settings.warmup_steps, settings.lr_scale)
            for group_params in optimizer.param_groups:
                group_params["lr"] = lr
            sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, nll: one sync per step, not per batch
            for position, (index, batch) in enumerate(micro):
                batch = batch.to(device)
                torch.manual_seed(micro_batch_seed(settings.seed, step, index))
                last = position == len(micro) - 1
                sync = contextlib.nullcontext() if (world == 1 or last) else training_model.no_sync()
                with sync:
                    with autocast_context(device, settings.precision):
                        logits = training_model(batch.src, batch.tgt_in)
                    loss, nll = label_smoothed_loss(logits, batch.tgt_out, settings.label_smoothing)
                    # DDP averages gradients over processes; scale so that the result is the sum
                    # over the whole step's target tokens divided by their number.
                    (loss * (world / step_tokens)).backward()
                sums += torch.stack([loss.detach(), nll.detach()]).double()
            if world > 1:
                torch.distributed.all_reduce(sums)
            loss_sum, nll_sum = sums.tolist()
            if not math.isfinite(loss_sum):
                raise TrainingDiverged(
                    f"the training loss became {loss_sum} at step {step} (preset {job.preset['name']}); the last "
                    f"good checkpoint is kept in {checkpoint_dir}. Lower lr_scale or raise warmup_steps, "
                    "then rerun to resume from it"
                )
            # measured, not clipped (the paper does not clip); read only when logged, to avoid a sync
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            progress.step = step
            progress.target_tokens += int(step_tokens)
            progress.source_tokens += int(step_src_tokens)
            progress.train_flops += 3.0 * flops  # backward is about twice the forward
            elapsed = time.perf_counter() - step_start
            progress.elapsed_seconds += elapsed
            for key, value in (("loss", loss_sum), ("nll", nll_sum), ("tokens", step_tokens),
                               ("src_tokens", step_src_tokens), ("padded", padded), ("real", real),
                               ("time", elapsed), ("flops", 3.0 * flops), ("steps", 1)):
                window[key] += value
            bar.update(1)
            if dist.is_main and (step % settings.log_every == 0 or step == settings.steps):
                tokens_per_second = window["tokens"] / max(window["time"], 1e-9)
                metrics = {
                    "train_loss": window["loss"] / window["tokens"], "train_nll": window["nll"] / window["tokens"],
                    "train_ppl": math.exp(min(window["nll"] / window["tokens"], 50.0)), "lr": lr,
                    "grad_norm": grad_norm.item(), "target_tokens_per_second": tokens_per_second,
                    "tokens_per_step": window["tokens"] / window["steps"],
                    "padding_efficiency": window["real"] / max(window["padded"], 1),
                    "train_flops": progress.train_flops, "epoch": progress.epoch,
                }
                if peak:
                    metrics["mfu"] = window["flops"] / max(window["time"], 1e-9) / (peak * world)
                tracker.log_metrics(metrics, step)
                bar.set_postfix(loss=f"{metrics['train_loss']:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_second:.0f}")
                window = dict.fromkeys(window, 0.0)
            if dist.is_main and dev_split is not None and settings.dev_every and step % settings.dev_every == 0:
                dev = evaluate(model, dev_split, device, settings.precision, settings.device_tokens,
                               settings.label_smoothing)
                progress.dev_history.append({"step": step, **dev})
                tracker.log_metrics(dev, step)
            due_steps = settings.checkpoint_steps and step % settings.checkpoint_steps == 0
            due_time = settings.checkpoint_minutes and \
                time.monotonic() - last_checkpoint_time >= settings.checkpoint_minutes * 60
            stopping = stop.signal is not None or (job.stop_after_steps is not None
                                                   and step - start_step >= job.stop_after_steps)
            # every rank must agree to stop, or the others wait forever in the next all-reduce
            stopping = bool(dist.all_sum([float(stopping)], device)[0])
            if dist.is_main and (due_steps or due_time or step == settings.steps or stopping):
                save(progress)
                last_checkpoint_time = time.monotonic()
            if stopping and step < settings.steps:
                status = "KILLED"
                raise Preempted(f"stopped at step {step}; checkpoint written to {checkpoint_dir}")
        bar.close()
        summary = {}
        if dist.is_main:
            final_dev = evaluate(model, dev_split, device, settings.precision, settings.device_tokens,
                                 settings.label_smoothing) if dev_split is not None else {}
            if final_dev and (not progress.dev_history or progress.dev_history[-1]["step"] != progress.step):
                progress.dev_history.append({"step": progress.step, **final_dev})
                tracker.log_metrics(final_dev, progress.step)
            save_model({"format": MODEL_FORMAT, "model_config": model_config.to_dict(), "model": model.state_dict(),
                        "vocab_fingerprint": vocab_fingerprint, "data_fingerprint": data_fingerprint,
                        "averaged_steps": [progress.step], "averaged_from": [checkpoint_path(checkpoint_dir, progress.step).name]},
                       job.run_dir / "final.pt")
            summary = {
                "preset": job.preset["name"], "seed": job.seed, "step": progress.step, "epochs": progress.epoch,
                "parameters": model.num_parameters(), "target_tokens": progress.target_tokens,
                "source_tokens": progress.source_tokens, "train_flops": progress.train_flops,
                "train_hours": progress.elapsed_seconds / 3600, "world_size": world,
                "device": device_name, "mlflow_run_id": tracker.run_id,
                "tracking_uri": tracker.uri, "experiment": job.experiment, **{k: v for k, v in final_dev.items()},
                "dev_history": progress.dev_history, "vocab_fingerprint": vocab_fingerprint,
                "data_fingerprint": data_fingerprint,
            }
            tracker.log_metrics({"train_hours": summary["train_hours"], "parameters": summary["parameters"]},
                                progress.step)
            write_json_atomic(job.run_dir / "final.json", summary)
        status = "FINISHED"
        return summary
    finally:
        bar.close()
        if tracker is not None:
            tracker.end(status)
        if world > 1:
            torch.distributed.destroy_process_group()


def _relaunch_under_torchrun(gpus: int, argv: list[str]) -> int | None:
    """With several GPUs asked for and present, re-run this command as one process per GPU."""
    if os.environ.get("WORLD_SIZE") or gpus <= 1 or not torch.cuda.is_available():
        return None
    count = min(gpus, torch.cuda.device_count())
    if count <= 1:
        return None
    import subprocess

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={count}",
               "-m", "aiayn.train", *argv]
    print(f"training on {count} GPUs: {' '.join(command)}", file=sys.stderr)
    return subprocess.call(command)


@cli
def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="aiayn train", description=__doc__.splitlines()[0])
    parser.add_argument("--preset-json", required=True, help="the resolved preset (what the Snakefile passes)")
    parser.add_argument("--train-json", required=True, help="the config's `train` section")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--train-data", required=True, type=Path, help="binarised train split folder")
    parser.add_argument("--dev-data", type=Path, help="binarised dev split folder")
    parser.add_argument("--spm-model", required=True, type=Path)
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--experiment", default="default")
    parser.add_argument("--tracking-uri", default=None)
    parser.add_argument("--no-tracking", action="store_true", help="metrics.jsonl only, no MLflow")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: leave torch's default)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--stop-after-steps", type=int, default=None,
                        help="checkpoint and exit with status 75 after this many steps (resume by rerunning)")
    args = parser.parse_args(argv)
    try:
        preset = json.loads(args.preset_json)
        train_section = json.loads(args.train_json)
    except json.JSONDecodeError as error:
        raise UserError(f"--preset-json/--train-json is not valid JSON ({error})") from None
    relaunched = _relaunch_under_torchrun(int(preset.get("gpus", 0)), argv)
    if relaunched is not None:
        return relaunched
    threads = args.threads or train_section.get("threads", 0)
    if threads:
        torch.set_num_threads(threads)
    job = TrainJob(preset, train_section, args.seed, args.train_data, args.dev_data, args.spm_model, args.run_dir,
                   args.experiment, args.tracking_uri, not args.no_tracking, args.device, args.stop_after_steps)
    try:
        summary = train(job)
    except Preempted as stopped:
        print(f"{stopped}; rerun the same command to resume", file=sys.stderr)
        return EXIT_PREEMPTED
    if summary:
        print(json.dumps({k: v for k, v in summary.items() if k != "dev_history"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

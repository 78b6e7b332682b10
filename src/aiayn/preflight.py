"""``aiayn preflight``: a workflow's disk and time, and its traps, before any job is queued.

One table, in seconds: every planned preset (parameters, checkpoint size, checkpoints kept, the disk of its
runs, a wall-clock estimate), the data stages' disk, the total against the free space under the results
folder, the GPUs torch sees here with the precision and sizes they will run with, torch's CUDA and NCCL,
and whether the data's source answers. What would fail later is refused now (a UserError: one paragraph,
exit status 2): a disk too small, data that cannot be had. The Snakefile runs it once before the jobs of a
workflow whose presets ask for GPUs. Costs come from ``aiayn.costs``; with ``--measure``, the time of a few
warm training steps of each preset on this machine's GPU, by the trainer's own parts.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from aiayn import costs
from aiayn.config import read_config, resolve_presets
from aiayn.memory import resolve_device_tokens, tokens_per_batch_for_device
from aiayn.search import SearchConfig
from aiayn.errors import UserError, cli
from aiayn.layout import DATA_STATS, SPLITS, text_name
from aiayn.train.hardware import peak_flops
from aiayn.speed.precision import resolved_precision
from aiayn.train.rendezvous import devices

HUB_TIMEOUT_SECONDS = 3.0
MEASURED_STEPS = 3  # timed warm steps of --measure, after WARM_UP_STEPS untimed ones
WARM_UP_STEPS = 2


@dataclass
class Row:
    """One line of the table, as numbers (bytes, hours); a run's columns are None on other lines."""

    item: str
    parameters: int | None = None
    checkpoint: int | None = None  # bytes of one training checkpoint
    kept: int | None = None  # checkpoints kept (costs.EXTRA_CHECKPOINTS more at most, for a moment)
    disk: int | None = None  # bytes
    hours: float | None = None
    time: str = ""  # the hours as shown ("no measurement" where there are none)
    note: str = ""

    def cells(self) -> tuple[str, ...]:
        def text(value, shown):
            return "" if value is None else shown(value)

        return (self.item, text(self.parameters, "{:,}".format), text(self.checkpoint, human),
                text(self.kept, lambda kept: f"{kept} + {costs.EXTRA_CHECKPOINTS}"), text(self.disk, human),
                self.time, self.note)


COLUMNS = ("item", "parameters", "checkpoint", "kept", "disk", "time", "note")


def planned_sizes(config: dict, preset: dict, device: torch.device) -> dict:
    """The micro-batch (train.device_tokens) and decode batch (decode.tokens_per_batch) a preset's jobs will
    use on ``device``: the one place the preflight asks what they are."""
    train, model = config["train"], costs.model_config(preset, config["bpe"]["vocab_size"])
    return {"device_tokens": resolve_device_tokens(train["device_tokens"], device, model, train["precision"],
                                                   ceiling=train["tokens_per_step"]),
            "decode_tokens_per_batch": tokens_per_batch_for_device(
                config["decode"]["tokens_per_batch"], device, model, SearchConfig.from_section(config["decode"]),
                "auto")}


def visible_gpus() -> list[dict]:
    """The CUDA devices torch sees here: index, name, memory in bytes, compute capability."""
    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        gpus.append({"index": index, "name": properties.name, "memory": properties.total_memory,
                     "capability": f"{properties.major}.{properties.minor}"})
    return gpus


def torch_versions() -> str:
    """torch's version, the CUDA it was built for (none for a CPU build) and its NCCL, for the table."""
    try:
        nccl = torch.cuda.nccl.version()
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:  # a CPU build has no NCCL; a broken install raises its own types
        nccl = "none"
    cuda = torch.version.cuda or "none (a CPU build of torch)"
    return f"{torch.__version__}, CUDA {cuda}, NCCL {nccl}"


def free_bytes(path: str | os.PathLike) -> int:
    """Free space on the file system that holds ``path`` (its nearest existing folder)."""
    return shutil.disk_usage(existing_folder(path)).free


def existing_folder(path: str | os.PathLike) -> Path:
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def present_bytes(path: str | os.PathLike) -> int:
    """What is already written under ``path``: a rerun needs only the rest."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:  # removed while counting
                pass
    return total


def truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def hub_reachable(timeout: float = HUB_TIMEOUT_SECONDS) -> bool:
    """Whether the hub's endpoint answers an HTTP HEAD within ``timeout`` seconds (any answer but a proxy's
    refusal). The request runs in a thread waited for that long: a socket's timeout does not bound the
    name lookup, which can hang on a node without DNS."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    answers = []

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
        except urllib.error.HTTPError as error:
            if error.code in (403, 407):  # a proxy's refusal, not the hub's answer
                return
        except (OSError, ValueError):  # no route, a timeout, a refused connection, a malformed endpoint
            return
        answers.append(True)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answers)


def hub_cache_folder() -> Path:
    """Where huggingface_hub keeps downloaded files (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub),
    read from the environment as it stands now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def hub_cached_files(hub: dict) -> dict[str, list[str]]:
    """The cached parquet files of each of the config's hub splits at its revision (a split not cached: [])."""
    repo = hub_cache_folder() / f"datasets--{hub['path'].replace('/', '--')}"
    ref = repo / "refs" / hub["revision"]
    commit = ref.read_text().strip() if ref.is_file() else hub["revision"]
    folder = repo / "snapshots" / commit / (hub["name"] or "**")
    return {split: glob.glob(str(folder / f"{name}-*"), recursive=True) for split, name in hub["splits"].items()}


def is_downloaded(data: dict, downloaded: Path) -> bool:
    """Whether the download stage has written its files into ``downloaded``: then no source is needed."""
    languages = (data["src_lang"], data["tgt_lang"])
    return (downloaded / DATA_STATS).is_file() and all(
        (downloaded / text_name(split, lang)).is_file() for split in SPLITS for lang in languages)


def source_status(data: dict, downloaded: Path) -> tuple[str, str | None]:
    """Whether the data can be had: (what the table says, a reason to refuse or None). Text the download
    stage has already written needs no source; the hub is probed only where it is not offline on purpose."""
    if is_downloaded(data, downloaded):
        return f"present: {downloaded} (downloaded)", None
    if data["source"] == "demo":
        return "the demo's generated corpus (no source to reach)", None
    if data["source"] == "local":
        missing = []
        for split in SPLITS:
            spec = data["local"].get(split) or {}
            if not spec:
                missing.append(f"data.local.{split} is not set")
            elif "parquet" in spec:
                pattern = os.path.expanduser(spec["parquet"])
                if not (glob.glob(pattern) if glob.has_magic(pattern) else os.path.isfile(pattern)):
                    missing.append(f"data.local.{split}.parquet: no file matches {spec['parquet']}")
            else:
                missing += [f"data.local.{split}.{side}: {spec.get(side)} does not exist" for side in ("src", "tgt")
                            if not spec.get(side) or not os.path.isfile(os.path.expanduser(spec[side]))]
        if missing:
            return "local files: missing", "; ".join(missing)
        return "local files: present", None
    hub = data["hub"]
    named = f"{hub['path']} ({hub['name']}, revision {hub['revision']})"
    cached = all(hub_cached_files(hub).values())
    in_cache = f"in the cache ({hub_cache_folder()})" if cached else "not in the cache"
    offline = [name for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if truthy(name)]
    if offline:
        reach = f"offline by {offline[0]}={os.environ[offline[0]]}"
    else:
        reach = "reachable" if hub_reachable() else "not reachable"
    text = f"hub {named}: {reach}, {in_cache}"
    if reach == "reachable" or cached:
        return text, None
    return text, (f"the hub dataset {named} cannot be downloaded here ({reach}) and is not in the cache "
                  f"{hub_cache_folder()}, so the download would fail; run it where the hub can be reached, or "
                  "download the dataset's parquet files on such a machine and set data.source: local "
                  "(config/README.md, data sources)")


def measure_step_seconds(preset: dict, config: dict, device: torch.device, vocab_size: int) -> float:
    """Seconds of one warm training step of ``preset`` on ``device``: this device's share of a step
    (train.tokens_per_step over the run's devices, in micro-batches of at most train.device_tokens) through
    the trainer's model, objective, precision and fused Adam, on random ids of typical length."""
    from aiayn.batching import real_positions
    from aiayn.loss import TrainingObjective
    from aiayn.train.hardware import adam, loss_chunk_tokens, model_for_training
    from aiayn.speed.precision import autocast_context
    from aiayn.train.schedule import learning_rate

    train = config["train"]
    model_config = costs.model_config(preset, vocab_size)
    device_tokens = resolve_device_tokens(train["device_tokens"], device, model_config, train["precision"],
                                          ceiling=train["tokens_per_step"])
    length = round(costs.TYPICAL_TOKENS) + 1
    share = max(length, train["tokens_per_step"] // devices(preset))
    rows = max(1, min(share, device_tokens) // length)
    micro_batches = max(1, round(share / (rows * length)))
    torch.manual_seed(0)
    model = model_for_training(model_config, device)
    objective = TrainingObjective(model, preset["label_smoothing"],
                                  loss_chunk_tokens(device, vocab_size, 2 * device_tokens))
    optimizer = adam(model.parameters(), device, lr=0.0, betas=tuple(train["adam_betas"]), eps=train["adam_eps"])
    ids = [torch.randint(4, vocab_size, (rows, length), device=device) for _ in range(3)]
    tgt_real = real_positions(ids[2])

    def step(number: int) -> None:
        for _ in range(micro_batches):
            with autocast_context(device, train["precision"], train["attention"]):
                loss, _ = objective(ids[0], ids[1], ids[2], tgt_real)
            (loss / (micro_batches * rows * length)).backward()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(number, model_config.d_model, preset["warmup_steps"], preset["lr_scale"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    model.train()
    for number in range(1, WARM_UP_STEPS + 1):
        step(number)
    synchronize()
    start = time.perf_counter()
    for number in range(WARM_UP_STEPS + 1, WARM_UP_STEPS + MEASURED_STEPS + 1):
        step(number)
    synchronize()
    return (time.perf_counter() - start) / MEASURED_STEPS


def max_minutes(preset: dict, train: dict) -> float | None:
    """The run's time budget: a preset's own wins over the train section's (TrainSettings' rule)."""
    return preset["max_minutes"] if "max_minutes" in preset else train["max_minutes"]


def time_estimate(preset: dict, config: dict, params: int, gpu: dict | None,
                  measure: bool) -> tuple[float | None, str, str]:
    """A run's wall-clock hours on ``gpu`` (GPU 0 here), as shown, and how they were reached."""
    if not preset["gpus"] or config["train"]["device"] == "cpu":
        return None, "no measurement", "trains on the CPU (gpus: 0 or train.device: cpu)"
    if gpu is None:
        return None, "no measurement", "no GPU visible here"
    device = torch.device("cuda", gpu["index"])
    precision = resolved_precision(config["train"]["precision"], device)
    model_config = costs.model_config(preset, config["bpe"]["vocab_size"])
    share = config["train"]["tokens_per_step"] / devices(preset)
    bound = ""
    if measure:
        try:
            seconds = measure_step_seconds(preset, config, device, config["bpe"]["vocab_size"])
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            tokens = config["train"]["device_tokens"]
            return None, "no measurement", f"out of memory in a micro-batch of {tokens} tokens"
        hours = preset["steps"] * seconds / 3600
        how = f"measured here: {seconds * 1000:.1f} ms a step of {share:.0f} tokens a GPU in {precision}"
    else:
        peak, measured = peak_flops(device, precision), costs.measured_mfu(gpu["name"], precision, params)
        if peak is None or measured is None:
            what = "peak FLOPs" if peak is None else "utilisation"
            return None, "no measurement", f"no {what} known for {gpu['name']} in {precision}"
        mfu, source = measured
        hours = costs.training_hours(preset, model_config, config["train"]["tokens_per_step"], peak, mfu)
        how = f"MFU {mfu:.0%} ({source})"
        if share < costs.MEASURED_TOKENS_PER_GPU / 2:
            bound = ">= "  # smaller micro-batches use a GPU less well than the measured ones
            how += (f" at {costs.MEASURED_TOKENS_PER_GPU} tokens a GPU; this run's {share:.0f} a GPU are slower "
                    "(--measure)")
    budget = max_minutes(preset, config["train"])
    if budget is not None and hours > budget / 60:
        hours, bound, how = budget / 60, "", how + "; its time budget (max_minutes) ends it"
    return hours, bound + duration(hours), f"{devices(preset)} GPUs, {how}"


def duration(hours: float) -> str:
    return f"{hours * 60:.0f} min" if hours < 1 else f"{hours:.1f} h"


def human(size: float) -> str:
    """Bytes in decimal units, as `df -H` shows them."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(size) < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def preflight(config: dict, presets: dict, results: Path, measure: bool = False) -> tuple[list[Row], list[str]]:
    """The table's rows for a checked config and its resolved presets by name (``resolve_presets``), and the
    reasons to refuse (none: the workflow may start)."""
    vocab_size, seeds = config["bpe"]["vocab_size"], config["seeds"]
    downloaded = results / "data"  # the download stage's folder (common.smk's data_text)
    gpus = visible_gpus()
    gpu = gpus[0] if gpus else None
    rows, problems, runs_disk = [], [], 0
    data = costs.data_bytes(config["data"], vocab_size)
    for name, preset in presets.items():
        params = costs.parameters(preset, vocab_size)
        disk = costs.run_bytes(params, preset, data.decode) * len(seeds)
        runs_disk += disk
        hours, time_text, note = time_estimate(preset, config, params, gpu, measure)
        runs = f" x {len(seeds)} seeds" if len(seeds) > 1 else ""
        rows.append(Row(name + runs, params, costs.checkpoint_bytes(params), costs.kept_checkpoints(preset), disk,
                        hours, time_text, note))
    rows.append(Row("data: text", disk=data.text, note="the download's text files"
                    if data.known else "unknown: no stated size for this hub dataset"))
    rows.append(Row("data: BPE", disk=data.bpe))
    rows.append(Row("data: binarized", disk=data.binarized, note="train, dev and test as token ids"))
    # (folder, disk planned there, disk already written there), checked by the file system each is on
    places = [(results, runs_disk + data.text + data.bpe + data.binarized, present_bytes(results))]
    if data.hub_cache is not None and not is_downloaded(config["data"], downloaded):
        cached = hub_cached_files(config["data"]["hub"])
        have = sum(os.path.getsize(path) for files in cached.values() for path in files)
        rows.append(Row("data: hub cache", disk=data.hub_cache, note=f"{hub_cache_folder()}"))
        places.append((hub_cache_folder(), data.hub_cache, have))
    by_device: dict[int, list[tuple]] = {}
    for place in places:
        by_device.setdefault(existing_folder(place[0]).stat().st_dev, []).append(place)
    notes = []
    for group in by_device.values():
        to_write = max(0, sum(need for _, need, _ in group) - sum(have for _, _, have in group))
        free = free_bytes(group[0][0])
        where = " and ".join(str(folder) for folder, _, _ in group)
        notes.append(f"{where}: {human(to_write)} still to write, {human(free)} free")
        if to_write > free:
            problems.append(f"the workflow needs {human(to_write)} more on the file system of {where}, which has "
                            f"{human(free)} free; free space there, or train fewer presets or seeds at a time")
    rows.append(Row("total", disk=sum(need for _, need, _ in places), note="; ".join(notes)))
    rows += gpu_rows(gpus, config, presets)
    status, problem = source_status(config["data"], downloaded)
    rows.append(Row("data source", note=status))
    if problem:
        problems.append(problem)
    return rows, problems


def gpu_rows(gpus: list[dict], config: dict, presets: dict) -> list[Row]:
    """A row for each GPU torch sees here, with the precision and sizes the presets will use on it; then
    torch's versions."""
    rows = []
    for gpu in gpus:
        device = torch.device("cuda", gpu["index"])
        sizes = [planned_sizes(config, preset, device) for preset in presets.values()]
        shown = {key: sorted({size[key] for size in sizes}) for key in ("device_tokens", "decode_tokens_per_batch")}
        span = {key: "-".join(str(value) for value in values[:1] + values[1:][-1:]) for key, values in shown.items()}
        rows.append(Row(f"GPU {gpu['index']}", note=(
            f"{gpu['name']}, {gpu['memory'] / 2**30:.1f} GiB, compute capability {gpu['capability']}, precision "
            f"{resolved_precision(config['train']['precision'], device)}, micro-batch {span['device_tokens']} "
            f"tokens, decode batch {span['decode_tokens_per_batch']} tokens")))
    if not gpus:
        rows.append(Row("GPUs", note="none visible here (the jobs run where the cluster puts them: run `aiayn "
                                     "preflight` on a GPU node for its figures)"))
    rows.append(Row("torch", note=torch_versions()))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """Plain text: names and notes flush left, numbers flush right, the note column last; rows that are
    a note alone (the GPUs, torch, the data source) below, their note beside the name."""
    facts = [row for row in rows if row.disk is None and not row.time]
    cells = [COLUMNS] + [row.cells() for row in rows if row not in facts]
    widths = [max(len(line[column]) for line in cells) for column in range(len(COLUMNS) - 1)]
    lines = []
    for line in cells:
        padded = [line[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(line[1:-1], widths[1:])]
        lines.append("  ".join(padded + [line[-1]]).rstrip())
    lines += [""] + [f"{row.item.ljust(widths[0])}  {row.note}" for row in facts]
    return "\n".join(lines)


@cli
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aiayn preflight", description=__doc__.splitlines()[0])
    parser.add_argument("--config", nargs="+", required=True, metavar="FILE", help="config files, merged in order")
    parser.add_argument("--results", metavar="DIR",
                        help="the workflow's results folder (default: results/<experiment>)")
    parser.add_argument("--measure", action="store_true",
                        help="time a few warm training steps of each preset on this machine's GPU")
    args = parser.parse_args(argv)
    config = read_config(args.config)
    results = Path(args.results or f"results/{config['experiment']}")
    rows, problems = preflight(config, resolve_presets(config, args.config), results, args.measure)
    print(f"preflight: {' '.join(args.config)} (experiment {config['experiment']}: {len(config['models'])} "
          f"preset(s) x {len(config['seeds'])} seed(s))")
    print(format_table(rows), flush=True)
    if problems:
        raise UserError("preflight: " + "; and ".join(problems))
    return 0


if __name__ == "__main__":
    sys.exit(main())

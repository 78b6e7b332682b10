"""The download stage: a parallel corpus as one plain UTF-8 text file per split and language.

Sources (``data.source``): ``hub`` loads the Hugging Face dataset named in the config
(``wmt/wmt14``, ``de-en``), ``local`` reads text or parquet files that were downloaded
beforehand (clusters without internet), ``demo`` generates the embedded synthetic corpus.
Every source ends in the same files, ``<split>.<lang>``, plus ``stats.json``.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import os
import re
import shutil
import socket
import sys
import tempfile
import urllib.parse
from pathlib import Path
from typing import Iterable, Iterator

from aiayn.errors import UserError, cli
from aiayn.reading import count_lines, iter_lines
from aiayn.folders import missing_folders, remove_empty_folders
from aiayn.writing import prepare_output, refuse_overwriting_inputs, temporary_prefix, write_json_atomic
from aiayn.data_checks import SplitSource, SplitStats, held_out_notes, warnings
from aiayn.layout import DATA_STATS, SPLITS, text_name

BATCH_PAIRS = 10_000  # pairs read, cleaned and written at a time: the stage's memory is a few batches


# What Moses' tokenizer leaves in text: its XML escapes and its split hyphens, commas and points.
# (&amp;, &lt; and &gt; are left out: raw web text has them too.)
MOSES_MARKS = re.compile(r"&(?:apos|quot|#124|#91|#93);| @[-,.]@ ")


def clean_pairs(src: list[str], tgt: list[str], split: str, max_chars: int | None, stats: SplitStats,
                max_length_ratio: float | None = None) -> tuple[list[str], list[str]]:
    """Make every segment one line, and filter training pairs (never dev or test); counts go to ``stats``.

    A segment with an embedded line break would shift every later line of its file, so
    breaks become spaces (counted). Training pairs with an empty side, a side longer than
    ``max_chars``, or (if set) one side more than ``max_length_ratio`` times as many words as
    the other are dropped and counted; evaluation splits keep every pair, since dropping test
    sentences would change what BLEU is computed on.
    """
    first = stats.pairs_read + 1
    stats.pairs_read += len(src)
    kept_src: list[str] = []
    kept_tgt: list[str] = []
    for pair, (source, target) in enumerate(zip(src, tgt), start=first):
        if "\n" in source or "\r" in source or "\n" in target or "\r" in target:
            stats.newlines_replaced += 1
            source = " ".join(source.splitlines())
            target = " ".join(target.splitlines())
        stripped_source, stripped_target = source.strip(), target.strip()
        if (stripped_source, stripped_target) != (source, target):
            stats.count("whitespace_trimmed", pair)
        source, target = stripped_source, stripped_target
        if MOSES_MARKS.search(source) or MOSES_MARKS.search(target):
            stats.count("moses_escaped", pair)
        if source == target:
            stats.count("identical_sides", pair)
        src_words, tgt_words = len(source.split()), len(target.split())
        if split != "train" and (not source or not target):
            stats.count("empty_side_kept", pair)
        if split == "train":
            if not source or not target:
                stats.dropped_empty += 1
                continue
            if max_chars is not None and (len(source) > max_chars or len(target) > max_chars):
                stats.dropped_long += 1
                continue
            longer, shorter = max(src_words, tgt_words), min(src_words, tgt_words)
            if max_length_ratio is not None and longer > max_length_ratio * shorter:
                stats.dropped_ratio += 1
                continue
        kept_src.append(source)
        kept_tgt.append(target)
        stats.src_words += src_words
        stats.tgt_words += tgt_words
    stats.pairs_written += len(kept_src)
    return kept_src, kept_tgt


# --- sources -----------------------------------------------------------------------------

def language_columns(schema, src_lang: str, tgt_lang: str, origin: str) -> str | None:
    """Which layout a table has: ``"translation"`` (the hub's struct column, WMT) or ``None`` for one
    column per language (e.g. Multi30k); anything else is a UserError naming what is there."""
    names = schema.names
    if "translation" not in names and {src_lang, tgt_lang} <= set(names):
        return None
    if "translation" not in names:
        raise UserError(
            f"{origin}: no `translation` column (columns: {', '.join(names)}); "
            "expected the Hugging Face translation layout, one struct column `translation` "
            f"with fields {src_lang!r} and {tgt_lang!r} (or one column per language)"
        )
    column = schema.field("translation").type
    fields = [column.field(i).name for i in range(column.num_fields)]
    for lang in (src_lang, tgt_lang):
        if lang not in fields:
            raise UserError(
                f"{origin}: the `translation` column has no language {lang!r} (it has {', '.join(fields)}); "
                "check data.src_lang and data.tgt_lang"
            )
    return "translation"


def pairs_from_arrow(tables: Iterable, src_lang: str, tgt_lang: str, origin: str) -> Iterator[tuple[list, list]]:
    """Source and target lists of each Arrow table or record batch in ``tables`` (one layout for all).

    Rows without one of the languages are counted over the whole split and reported once it
    has been read, with the first one's row number.
    """
    import pyarrow.compute as pc

    layout, row, missing, first_missing = "unchecked", 0, 0, None
    for table in tables:
        if layout == "unchecked":
            layout = language_columns(table.schema, src_lang, tgt_lang, origin)
        if layout is None:
            src, tgt = table.column(src_lang).to_pylist(), table.column(tgt_lang).to_pylist()
        else:
            column = table.column("translation")
            src, tgt = pc.struct_field(column, src_lang).to_pylist(), pc.struct_field(column, tgt_lang).to_pylist()
        holes = [i for i, (s, t) in enumerate(zip(src, tgt)) if s is None or t is None]
        if holes:
            first_missing = row + holes[0] if first_missing is None else first_missing
            missing += len(holes)
            complete = [i for i in range(len(src)) if src[i] is not None and tgt[i] is not None]
            src, tgt = [src[i] for i in complete], [tgt[i] for i in complete]
        row += table.num_rows
        yield src, tgt
    if missing:
        raise UserError(f"{origin}: row {first_missing} has no {src_lang!r} or {tgt_lang!r} text ({missing} such rows)")


def _batched(lines: Iterator[str]) -> Iterator[list[str]]:
    while batch := list(itertools.islice(lines, BATCH_PAIRS)):
        yield batch


def parquet_split(files: list[str], origin: list[str], src_lang: str, tgt_lang: str) -> SplitSource:
    """Parquet files in either layout, checked (readable, columns) from their footers, read a row group at a time.

    A row group at a time: pyarrow's ``iter_batches`` pre-buffers by default and held a file's
    buffers until the end of the file, so memory grew with the file.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    named = ", ".join(origin)
    rows = 0
    for path in files:
        try:
            metadata = pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as error:
            raise UserError(f"{path}: cannot read as parquet ({error})") from None
        language_columns(metadata.schema_arrow, src_lang, tgt_lang, named)
        rows += metadata.metadata.num_rows

    def record_batches():
        for path in files:
            try:
                parquet = pq.ParquetFile(path)
                for group in range(parquet.num_row_groups):
                    yield from parquet.read_row_group(group).to_batches(max_chunksize=BATCH_PAIRS)
            except (pa.ArrowInvalid, OSError) as error:
                raise UserError(f"{path}: cannot read as parquet ({error})") from None

    return SplitSource(origin, lambda: pairs_from_arrow(record_batches(), src_lang, tgt_lang, named), rows)


def open_local_split(spec: dict | None, split: str, src_lang: str, tgt_lang: str) -> SplitSource:
    """Check a ``data.local`` split (files exist, parquet schemas, text line counts) without reading it."""
    if not spec:
        raise UserError(
            f"data.source is local but data.local.{split} is not set; give either "
            f"{{src: FILE.{src_lang}, tgt: FILE.{tgt_lang}}} or {{parquet: FILES}} in the hub's translation layout"
        )
    if "parquet" in spec:
        if "src" in spec or "tgt" in spec:
            raise UserError(f"data.local.{split}: give either parquet or src/tgt, not both")
        pattern = os.path.expanduser(spec["parquet"])
        files = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not files or not all(os.path.exists(f) for f in files):
            raise UserError(f"data.local.{split}.parquet: no file matches {spec['parquet']!r} (check the path)")
        for path in files:
            if os.path.isdir(path):
                raise UserError(f"data.local.{split}.parquet: {path} is a directory; give its files, "
                                f"e.g. {os.path.join(path, '*.parquet')}")
        return parquet_split(files, files, src_lang, tgt_lang)
    if "src" not in spec or "tgt" not in spec:
        raise UserError(f"data.local.{split}: needs both src and tgt (or parquet)")
    src_path, tgt_path = os.path.expanduser(spec["src"]), os.path.expanduser(spec["tgt"])
    counts = []
    for side, path in (("src", src_path), ("tgt", tgt_path)):
        try:
            counts.append(count_lines(path))  # and every check of aiayn.reading: directories, encodings, ...
        except UserError as error:
            raise UserError(f"data.local.{split}.{side}: {error}") from None
    src_lines, tgt_lines = counts
    if src_lines != tgt_lines:
        raise UserError(
            f"{src_path} has {src_lines} lines but {tgt_path} has {tgt_lines}: source and target files of a "
            "parallel corpus must have one line per sentence pair, in the same order"
        )
    return SplitSource([src_path, tgt_path],
                       lambda: zip(_batched(iter_lines(src_path)), _batched(iter_lines(tgt_path))), src_lines)


def _hub_reachable(timeout: float = 3.0) -> bool:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    parsed = urllib.parse.urlparse(endpoint)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _hub_parquet_files(hub: dict, split_name: str) -> list[str] | None:
    """The local paths of a parquet hub dataset's split, downloaded into ``datasets``' cache by the
    dataset's builder; None for a dataset in another format (or without that split's data files)."""
    import datasets
    from datasets.packaged_modules.parquet.parquet import Parquet

    builder = datasets.load_dataset_builder(hub["path"], hub["name"], revision=hub["revision"])
    data_files = builder.config.data_files or {}
    if not isinstance(builder, Parquet) or split_name not in data_files:
        return None
    manager = datasets.DownloadManager(
        dataset_name=builder.dataset_name,
        download_config=datasets.DownloadConfig(cache_dir=datasets.config.DOWNLOADED_DATASETS_PATH,
                                                token=builder.token, storage_options=builder.storage_options))
    return manager.download(list(data_files[split_name]))


def open_hub_split(hub: dict, split: str, src_lang: str, tgt_lang: str) -> SplitSource:
    """One split from the Hugging Face hub, failing within seconds (never hanging) without a network.

    ``datasets`` retries an unreachable hub for about 20 s per request; we probe it once with a
    short timeout and, if it does not answer, switch the libraries to offline mode before they
    are imported, so that a filled cache still works and an empty one fails at once.
    A dataset stored as parquet (wmt/wmt14 is) is resolved by ``datasets`` (its builder's data
    files, downloaded into its cache) and read a row group at a time, as local parquet is: its
    Arrow conversion (``load_dataset``) grew in memory with the file and wrote a second copy of
    the corpus to disk. Any other format goes through ``load_dataset`` and its memory-mapped cache.
    """
    if not (_truthy("HF_HUB_OFFLINE") or _truthy("HF_DATASETS_OFFLINE")) and not _hub_reachable():
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets

    split_name = hub["splits"][split]
    origin = f"{hub['path']} ({hub['name']}, revision {hub['revision']}, split {split_name})"
    try:
        files = _hub_parquet_files(hub, split_name)
        dataset = None if files else datasets.load_dataset(hub["path"], hub["name"], revision=hub["revision"],
                                                           split=split_name)
    except Exception as error:  # datasets raises many types for one cause: the data is not reachable
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(
            f"could not load {origin} from the Hugging Face hub ({reason}). Without network access, download "
            f"the dataset's parquet files on a machine that has it (`hf download {hub['path']} --repo-type dataset "
            f"--include '{hub['name']}/*'`), copy them here, and set in your config: data.source: local and "
            f"data.local.{split}: {{parquet: /path/to/{hub['name']}/{split_name}-*.parquet}} for each split "
            "(or {src: FILE, tgt: FILE} for plain text)"
        ) from None
    if files:
        return parquet_split(files, [origin], src_lang, tgt_lang)
    language_columns(dataset.data.schema, src_lang, tgt_lang, origin)
    arrow = dataset.with_format("arrow")
    return SplitSource([origin], lambda: pairs_from_arrow(arrow.iter(batch_size=BATCH_PAIRS), src_lang, tgt_lang,
                                                          origin), len(dataset))


def open_demo_split(demo: dict, split: str) -> SplitSource:
    from aiayn.demo import generate_corpus

    def batches():  # the demo is small by design: generated whole, then handed out in batches
        pairs = generate_corpus(demo["seed"], {name: demo[name] for name in SPLITS})[split]
        for start in range(0, len(pairs), BATCH_PAIRS):
            chunk = pairs[start:start + BATCH_PAIRS]
            yield [s for s, _ in chunk], [t for _, t in chunk]

    return SplitSource([f"demo(seed={demo['seed']})"], batches, demo[split])


def download(data: dict, out_dir: str | Path) -> dict:
    """Write ``<split>.<lang>`` for train, dev and test and ``stats.json`` into ``out_dir``.

    Every split is opened and checked first (files, schemas, line counts), then streamed in
    batches through the cleaning into temporary files beside ``out_dir``; they are renamed into
    place only when all splits are complete, so a bad split leaves no partial output behind.
    """
    out_dir = Path(out_dir)
    src_lang, tgt_lang = data["src_lang"], data["tgt_lang"]
    sources = open_sources(data, out_dir)
    held_out = held_out_notes(data, sources)
    # what a failed download made is removed again: it leaves nothing behind
    created = [out_dir] * (not out_dir.exists()) + missing_folders(out_dir)
    prepare_output(out_dir, directory=True)
    tmp = Path(tempfile.mkdtemp(prefix=temporary_prefix(out_dir), dir=out_dir.parent))
    done = False
    try:
        split_stats = {split: clean_split(data, split, source, tmp) for split, source in sources.items()}
        summary = {"source": data["source"], "src_lang": src_lang, "tgt_lang": tgt_lang,
                   "splits": {split: stats.as_json() for split, stats in split_stats.items()}}
        notes = held_out + warnings(split_stats)
        if notes:
            summary["warnings"] = notes
        write_json_atomic(tmp / DATA_STATS, summary)
        out_dir.mkdir(exist_ok=True)
        for split in SPLITS:
            for lang in (src_lang, tgt_lang):
                os.replace(tmp / text_name(split, lang), out_dir / text_name(split, lang))
        os.replace(tmp / DATA_STATS, out_dir / DATA_STATS)
        done = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not done:
            remove_empty_folders([folder for folder in created if folder.exists()])
    for note in summary.get("warnings", []):
        print(f"warning: {note}", file=sys.stderr)
    return summary


def open_sources(data: dict, out_dir: Path) -> dict:
    """Each split's source (the demo's, local files or the hub's), opened and checked; refused where the
    languages are the same or a local file lies where its cleaned split would be written."""
    src_lang, tgt_lang = data["src_lang"], data["tgt_lang"]
    local = (data.get("local") or {}) if data["source"] == "local" else {}
    refuse_overwriting_inputs(  # a local text file where the cleaned split is written would be replaced by it
        {"--out-dir": [out_dir / text_name(split, lang) for split in SPLITS for lang in (src_lang, tgt_lang)]
         + [out_dir / DATA_STATS]},
        {f"data.local.{split}.{side}": os.path.expanduser(spec[side])
         for split, spec in local.items() if isinstance(spec, dict) for side in ("src", "tgt") if side in spec})
    if src_lang == tgt_lang:
        raise UserError(f"data.src_lang and data.tgt_lang are both {src_lang!r}; they must differ")
    if data["source"] == "demo":
        return {split: open_demo_split(data["demo"], split) for split in SPLITS}
    if data["source"] == "local":
        return {split: open_local_split(data["local"].get(split), split, src_lang, tgt_lang) for split in SPLITS}
    return {split: open_hub_split(data["hub"], split, src_lang, tgt_lang) for split in SPLITS}


def clean_split(data: dict, split: str, source: SplitSource, folder: Path) -> SplitStats:
    """Stream one split's pairs through the cleaning into ``<split>.<lang>`` in ``folder``; its stats. A split
    left empty, or (dev, test) with every source line blank, is refused."""
    from tqdm import tqdm

    src_lang, tgt_lang = data["src_lang"], data["tgt_lang"]
    max_length_ratio = data.get("max_length_ratio")
    stats = SplitStats(origin=source.origin, dropped_ratio=0 if max_length_ratio is not None else None)
    with open(folder / text_name(split, src_lang), "w", encoding="utf-8", newline="\n") as src_file, \
         open(folder / text_name(split, tgt_lang), "w", encoding="utf-8", newline="\n") as tgt_file, \
         tqdm(total=source.pairs, desc=f"download {split}", unit=" pairs", mininterval=2.0, disable=None) as progress:
        for src, tgt in source.batches():
            kept_src, kept_tgt = clean_pairs(src, tgt, split, data.get("max_chars"), stats, max_length_ratio)
            src_file.writelines(line + "\n" for line in kept_src)
            tgt_file.writelines(line + "\n" for line in kept_tgt)
            progress.update(len(src))
    if not stats.pairs_written:
        ratio = f", {stats.dropped_ratio} over data.max_length_ratio" if stats.dropped_ratio else ""
        raise UserError(
            f"the {split} split is empty ({', '.join(source.origin)} gave {stats.pairs_read} pairs, "
            f"{stats.dropped_empty} empty and {stats.dropped_long} over data.max_chars{ratio} were dropped)"
        )
    if split != "train" and not stats.src_words:  # the train split's blank pairs are dropped, above
        key = f"data.local.{split}" if data["source"] == "local" else f"data.hub.splits.{split}"
        raise UserError(
            f"{', '.join(source.origin)}: every source line of the {split} split is blank ({stats.pairs_read} "
            f"pairs), so it has nothing to translate or score; give the {split} split's {src_lang} text "
            f"({key}), line for line with its {tgt_lang} translation"
        )
    return stats


@cli
def main(argv=None):
    from aiayn.config import add_config_arguments, section_from_arguments

    parser = argparse.ArgumentParser(prog="aiayn download", description=__doc__.splitlines()[0])
    add_config_arguments(parser, "data")
    parser.add_argument("--out-dir", required=True, help="folder for <split>.<lang> and stats.json")
    args = parser.parse_args(argv)
    summary = download(section_from_arguments(args, "data"), args.out_dir)
    for split, stats in summary["splits"].items():
        print(f"{split}: {stats['pairs_written']} pairs written ({stats['dropped_empty']} empty, "
              f"{stats['dropped_long']} over-long dropped), {stats['src_words']} + {stats['tgt_words']} words")


if __name__ == "__main__":
    raise SystemExit(main())

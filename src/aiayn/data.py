"""The download stage: a parallel corpus as one plain UTF-8 text file per split and language.

Sources (``data.source``): ``hub`` loads the Hugging Face dataset named in the config
(``wmt/wmt14``, ``de-en``), ``local`` reads text or parquet files that were downloaded
beforehand (clusters without internet), ``demo`` generates the embedded synthetic corpus.
Every source ends in the same files, ``<split>.<lang>``, plus ``stats.json``.
"""

from __future__ import annotations

import argparse
import glob
import os
import socket
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from aiayn.errors import UserError, cli
from aiayn.fileio import read_lines, write_json_atomic, write_lines_atomic

SPLITS = ("train", "dev", "test")


@dataclass
class SplitStats:
    pairs_read: int = 0
    pairs_written: int = 0
    dropped_empty: int = 0
    dropped_long: int = 0
    newlines_replaced: int = 0
    src_words: int = 0
    tgt_words: int = 0
    origin: list[str] = field(default_factory=list)


def clean_pairs(src: list[str], tgt: list[str], split: str, max_chars: int | None) -> tuple[list[str], list[str], SplitStats]:
    """Make every segment one line, and filter training pairs (never dev or test).

    A segment with an embedded line break would shift every later line of its file, so
    breaks become spaces (counted). Training pairs with an empty side or a side longer
    than ``max_chars`` are dropped and counted; evaluation splits keep every pair, since
    dropping test sentences would change what BLEU is computed on.
    """
    stats = SplitStats(pairs_read=len(src))
    kept_src: list[str] = []
    kept_tgt: list[str] = []
    for source, target in zip(src, tgt):
        if "\n" in source or "\r" in source or "\n" in target or "\r" in target:
            stats.newlines_replaced += 1
            source = " ".join(source.splitlines())
            target = " ".join(target.splitlines())
        source, target = source.strip(), target.strip()
        if split == "train":
            if not source or not target:
                stats.dropped_empty += 1
                continue
            if max_chars is not None and (len(source) > max_chars or len(target) > max_chars):
                stats.dropped_long += 1
                continue
        kept_src.append(source)
        kept_tgt.append(target)
        stats.src_words += len(source.split())
        stats.tgt_words += len(target.split())
    stats.pairs_written = len(kept_src)
    return kept_src, kept_tgt, stats


# --- sources -----------------------------------------------------------------------------

def pairs_from_arrow(table, src_lang: str, tgt_lang: str, origin: str) -> tuple[list[str], list[str]]:
    """Source and target columns of a table in the hub's ``translation`` layout (WMT), or with one
    column per language (e.g. Multi30k)."""
    import pyarrow.compute as pc

    if "translation" not in table.column_names and {src_lang, tgt_lang} <= set(table.column_names):
        src, tgt = table.column(src_lang).to_pylist(), table.column(tgt_lang).to_pylist()
        _check_complete(src, tgt, src_lang, tgt_lang, origin)
        return src, tgt
    if "translation" not in table.column_names:
        raise UserError(
            f"{origin}: no `translation` column (columns: {', '.join(table.column_names)}); "
            "expected the Hugging Face translation layout, one struct column `translation` "
            f"with fields {src_lang!r} and {tgt_lang!r} (or one column per language)"
        )
    column = table.column("translation")
    fields = [column.type.field(i).name for i in range(column.type.num_fields)]
    for lang in (src_lang, tgt_lang):
        if lang not in fields:
            raise UserError(
                f"{origin}: the `translation` column has no language {lang!r} (it has {', '.join(fields)}); "
                "check data.src_lang and data.tgt_lang"
            )
    src = pc.struct_field(column, src_lang).to_pylist()
    tgt = pc.struct_field(column, tgt_lang).to_pylist()
    _check_complete(src, tgt, src_lang, tgt_lang, origin)
    return src, tgt


def _check_complete(src: list, tgt: list, src_lang: str, tgt_lang: str, origin: str) -> None:
    missing = [i for i, (s, t) in enumerate(zip(src, tgt)) if s is None or t is None]
    if missing:
        raise UserError(f"{origin}: row {missing[0]} has no {src_lang!r} or {tgt_lang!r} text ({len(missing)} such rows)")


def read_local_split(spec: dict | None, split: str, src_lang: str, tgt_lang: str) -> tuple[list[str], list[str], list[str]]:
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
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pa.concat_tables(pq.read_table(f) for f in files)
        except (pa.ArrowInvalid, OSError) as error:
            raise UserError(f"{files[0]}: cannot read as parquet ({error})") from None
        src, tgt = pairs_from_arrow(table, src_lang, tgt_lang, ", ".join(files))
        return src, tgt, files
    if "src" not in spec or "tgt" not in spec:
        raise UserError(f"data.local.{split}: needs both src and tgt (or parquet)")
    src_path, tgt_path = os.path.expanduser(spec["src"]), os.path.expanduser(spec["tgt"])
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise UserError(
            f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}: source and target files of a "
            "parallel corpus must have one line per sentence pair, in the same order"
        )
    return src, tgt, [src_path, tgt_path]


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


def load_hub_split(hub: dict, split: str, src_lang: str, tgt_lang: str) -> tuple[list[str], list[str], list[str]]:
    """One split from the Hugging Face hub, failing within seconds (never hanging) without a network.

    ``datasets`` retries an unreachable hub for about 20 s per request; we probe it once with a
    short timeout and, if it does not answer, switch the libraries to offline mode before they
    are imported, so that a filled cache still works and an empty one fails at once.
    """
    if not (_truthy("HF_HUB_OFFLINE") or _truthy("HF_DATASETS_OFFLINE")) and not _hub_reachable():
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets

    split_name = hub["splits"][split]
    origin = f"{hub['path']} ({hub['name']}, revision {hub['revision']}, split {split_name})"
    try:
        dataset = datasets.load_dataset(hub["path"], hub["name"], revision=hub["revision"], split=split_name)
    except Exception as error:  # datasets raises many types for one cause: the data is not reachable
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(
            f"could not load {origin} from the Hugging Face hub ({reason}). Without network access, download "
            f"the dataset's parquet files on a machine that has it (`hf download {hub['path']} --repo-type dataset "
            f"--include '{hub['name']}/*'`), copy them here, and set in your config: data.source: local and "
            f"data.local.{split}: {{parquet: /path/to/{hub['name']}/{split_name}-*.parquet}} for each split "
            "(or {src: FILE, tgt: FILE} for plain text)"
        ) from None
    src, tgt = pairs_from_arrow(dataset.data.table, src_lang, tgt_lang, origin)
    return src, tgt, [origin]


def download(data: dict, out_dir: str | Path) -> dict:
    """Write ``<split>.<lang>`` for train, dev and test and ``stats.json`` into ``out_dir``.

    Everything is read and checked before anything is written, so a bad split leaves no
    partial output behind.
    """
    out_dir = Path(out_dir)
    src_lang, tgt_lang = data["src_lang"], data["tgt_lang"]
    if src_lang == tgt_lang:
        raise UserError(f"data.src_lang and data.tgt_lang are both {src_lang!r}; they must differ")
    corpus: dict[str, tuple[list[str], list[str], SplitStats]] = {}
    if data["source"] == "demo":
        from aiayn.demo import generate_corpus

        demo = data["demo"]
        generated = generate_corpus(demo["seed"], {split: demo[split] for split in SPLITS})
        raw = {split: ([s for s, _ in pairs], [t for _, t in pairs], [f"demo(seed={demo['seed']})"])
               for split, pairs in generated.items()}
    elif data["source"] == "local":
        raw = {split: read_local_split(data["local"].get(split), split, src_lang, tgt_lang) for split in SPLITS}
    else:
        raw = {split: load_hub_split(data["hub"], split, src_lang, tgt_lang) for split in SPLITS}
    for split in SPLITS:
        src, tgt, origin = raw[split]
        kept_src, kept_tgt, stats = clean_pairs(src, tgt, split, data.get("max_chars"))
        stats.origin = origin
        if not kept_src:
            raise UserError(
                f"the {split} split is empty ({', '.join(origin)} gave {stats.pairs_read} pairs, "
                f"{stats.dropped_empty} empty and {stats.dropped_long} over data.max_chars were dropped)"
            )
        corpus[split] = (kept_src, kept_tgt, stats)
    for split, (src, tgt, _) in corpus.items():
        write_lines_atomic(out_dir / f"{split}.{src_lang}", src)
        write_lines_atomic(out_dir / f"{split}.{tgt_lang}", tgt)
    summary = {
        "source": data["source"],
        "src_lang": src_lang,
        "tgt_lang": tgt_lang,
        "splits": {split: vars(stats) for split, (_, _, stats) in corpus.items()},
    }
    write_json_atomic(out_dir / "stats.json", summary)
    return summary


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

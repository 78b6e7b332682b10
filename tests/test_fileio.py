"""Atomic writes and their temporaries; reading text that is compressed or not text at all."""

from __future__ import annotations

import gzip
import os
import socket
import subprocess
import sys

import pytest

from aiayn.errors import UserError
from aiayn.reading import count_lines, iter_lines, read_lines
from aiayn.writing import (atomic_path, prepare_output, refuse_overwriting_inputs, remove_stale_temporaries_in, write_text_atomic)

HOST = socket.gethostname()


def dead_pid() -> int:
    """The pid of a process that has ended (a killed writer's)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_writer_removes_the_stale_temporaries_of_its_own_output_only(tmp_path):
    """A killed job leaves `.tmp-<output>-<pid>@<host>-*`; the next writer of that output removes it,
    but not a live writer's, one from another host, or another output's."""
    stale = tmp_path / f".tmp-table2.csv-{dead_pid()}@{HOST}-abc123"
    stale_folder = tmp_path / f".tmp-table2.csv-{dead_pid()}@{HOST}-def456"
    (stale_folder / "inner").mkdir(parents=True)
    live = tmp_path / f".tmp-table2.csv-{os.getpid()}@{HOST}-ghi789"
    elsewhere = tmp_path / f".tmp-table2.csv-{dead_pid()}@another-host-jkl012"
    other_output = tmp_path / f".tmp-table3.csv-{dead_pid()}@{HOST}-mno345"
    for path in (stale, live, elsewhere, other_output):
        path.write_text("partial")
    write_text_atomic(tmp_path / "table2.csv", "a,b\n")
    assert not stale.exists() and not stale_folder.exists()
    assert live.exists() and elsewhere.exists() and other_output.exists()
    assert (tmp_path / "table2.csv").read_text() == "a,b\n"


def test_a_stage_that_holds_a_folder_removes_every_stale_temporary_in_it(tmp_path):
    stale = [tmp_path / f".tmp-step_00000005.pt-{dead_pid()}@{HOST}-a1",
             tmp_path / f".tmp-safety_7.pt-{dead_pid()}@{HOST}-b2"]
    kept = [tmp_path / f".tmp-step_00000010.pt-{os.getpid()}@{HOST}-c3", tmp_path / ".tmp-old-style-name"]
    for path in stale + kept:
        path.write_text("partial")
    assert sorted(remove_stale_temporaries_in(tmp_path)) == sorted(stale)
    assert all(path.exists() for path in kept)


def test_a_temporary_is_named_for_its_output_process_and_host(tmp_path):
    with atomic_path(tmp_path / "model.pt") as tmp:
        assert tmp.name.startswith(f".tmp-model.pt-{os.getpid()}@{HOST}-")
        tmp.write_bytes(b"weights")
    assert (tmp_path / "model.pt").read_bytes() == b"weights"


def test_a_file_never_replaces_a_folder(tmp_path):
    (tmp_path / "out" / "keep.txt").parent.mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="out is a directory"):
        write_text_atomic(tmp_path / "out", "text")
    assert (tmp_path / "out" / "keep.txt").read_text() == "x"


def test_a_folder_replaces_a_folder_when_asked(tmp_path):
    (tmp_path / "split").mkdir()
    (tmp_path / "split" / "old.npy").write_text("old")
    with atomic_path(tmp_path / "split", directory=True) as tmp:
        tmp.mkdir()
        (tmp / "new.npy").write_text("new")
    assert [path.name for path in (tmp_path / "split").iterdir()] == ["new.npy"]


def test_gzip_text_reads_as_the_text_itself(tmp_path):
    text = "erste Zeile\r\nzweite\u2028Zeile\n\ndritte\n".encode("utf-8")
    (tmp_path / "plain.de").write_bytes(text)
    (tmp_path / "packed.de").write_bytes(gzip.compress(text))
    assert read_lines(tmp_path / "packed.de") == read_lines(tmp_path / "plain.de")
    assert list(iter_lines(tmp_path / "packed.de")) == read_lines(tmp_path / "plain.de")
    assert count_lines(tmp_path / "packed.de") == 4


@pytest.mark.parametrize("reader", [read_lines, lambda path: list(iter_lines(path)), count_lines])
@pytest.mark.parametrize("content, message", [
    ("a\rb\rc\r".encode(), "carriage return alone"),
    ("a b\n".encode("utf-16"), "UTF-16 text"),
    ("a b\n".encode("utf-32"), "UTF-32 text"),
    (b"caf\xc3\xa9\nna\xefve\n", r"line 2: bytes that are not UTF-8"),
    (b"\x00\x00\x00\x01binary", "NUL bytes"),
])
def test_every_reader_names_what_the_file_is_instead_of_text(tmp_path, reader, content, message):
    (tmp_path / "f.txt").write_bytes(content)
    with pytest.raises(UserError, match=message):
        reader(tmp_path / "f.txt")


def test_a_character_cut_by_a_block_boundary_is_not_an_error(tmp_path, monkeypatch):
    import aiayn.reading as reading

    monkeypatch.setattr(reading, "BLOCK", 7)  # "ü" and "ß" fall across boundaries
    (tmp_path / "f.de").write_text("grüße aus köln\nüber straßen\n", encoding="utf-8")
    assert count_lines(tmp_path / "f.de") == 2
    (tmp_path / "g.de").write_bytes("grüße\n".encode() + b"\xc3")  # but one cut by the end of the file is
    with pytest.raises(UserError, match="line 2: bytes that are not UTF-8"):
        count_lines(tmp_path / "g.de")


# --- an output that is an input ---------------------------------------------------------------------

@pytest.fixture
def source(tmp_path, monkeypatch):
    """An input file, named relative to the working folder as on a command line."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "test.en").write_text("a sentence\n")
    return "data/test.en"


@pytest.mark.parametrize("spelled", ["data/test.en", "./data/test.en", "data/../data/test.en", "{tmp}/data/test.en"])
def test_an_output_spelled_any_way_that_resolves_to_an_input_is_refused(source, tmp_path, spelled):
    output = spelled.format(tmp=tmp_path)
    with pytest.raises(UserError) as refused:
        refuse_overwriting_inputs({"--output": output}, {"--model": "model.pt", "--input": source})
    message = str(refused.value)
    assert message.startswith(f"--output {output} is the input --input data/test.en")
    assert "writing it would destroy that input; give --output a path of its own" in message
    if output != source:
        assert f"(both are {tmp_path.resolve() / 'data' / 'test.en'})" in message


def test_an_output_that_links_to_an_input_is_refused(source, tmp_path):
    (tmp_path / "soft.de").symlink_to(tmp_path / source)
    os.link(source, "hard.de")
    with pytest.raises(UserError, match=r"--output soft.de is the input --input data/test.en \(both are "):
        refuse_overwriting_inputs({"--output": "soft.de"}, {"--input": source})
    with pytest.raises(UserError, match=r"--output hard.de is the input --input data/test.en \(the same file under "
                                        r"another name: a hard link\)"):
        refuse_overwriting_inputs({"--output": "hard.de"}, {"--input": source})


def test_outputs_that_are_not_inputs_pass(source):
    refuse_overwriting_inputs({"--output": "data/test.de", "--csv": None, "--out-dir": ["out/a", "out/b"]},
                              {"--input": source, "--dev-data": None, "checkpoint": ["data/missing.pt", None]},
                              {"--out-dir": "out"})


def test_a_file_that_a_stage_writes_into_its_folder_is_refused_by_name(source):
    with pytest.raises(UserError, match=r"^--out-dir would write data/test.en, which is the input "
                                        r"data.local.test.src data/test.en: .* give --out-dir a folder of its own"):
        refuse_overwriting_inputs({"--out-dir": ["data/test.de", "data/test.en"]}, {"data.local.test.src": source})


def test_a_folder_replaced_as_a_whole_may_hold_no_input(source):
    with pytest.raises(UserError, match=r"^--out-dir data holds the input --src data/test.en, and this command "
                                        r"replaces that folder as a whole"):
        refuse_overwriting_inputs({}, {"--src": source}, {"--out-dir": "data"})
    with pytest.raises(UserError, match="--out-dir data/test.en holds the input"):
        refuse_overwriting_inputs({}, {"--src": source}, {"--out-dir": "data/test.en"})
    refuse_overwriting_inputs({}, {"--src": source}, {"--out-dir": "data/bin"})  # beside it, not above it


def test_a_stream_redirected_into_an_input_is_refused_but_a_pipe_is_not(source):
    with open(source, "a") as appended, pytest.raises(UserError, match=r"^stdout is redirected into the input "
                                                                       r"--model data/test.en: .* send stdout to"):
        refuse_overwriting_inputs({"stdout": appended}, {"--model": source})
    read_end, write_end = os.pipe()  # a pipe's two ends are one inode, but writing one destroys nothing
    with open(read_end, "rb") as reader, open(write_end, "wb") as writer:
        refuse_overwriting_inputs({"stdout": writer}, {"stdin": reader, "--model": source})


def test_a_failed_write_removes_the_folders_it_made_and_only_those(tmp_path):
    (tmp_path / "results").mkdir()
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "results" / "average" / "base" / "model.pt"):
            raise RuntimeError("the stage failed")
    assert list(tmp_path.iterdir()) == [tmp_path / "results"] and not any((tmp_path / "results").iterdir())
    write_text_atomic(tmp_path / "results" / "average" / "base" / "model.pt", "done")
    assert (tmp_path / "results" / "average" / "base" / "model.pt").read_text() == "done"


def test_an_output_checked_before_the_work_makes_no_folder_until_it_is_written(tmp_path):
    target = prepare_output(tmp_path / "new" / "deeper" / "out.txt", create=False)
    assert not (tmp_path / "new").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file, not a folder"):
        prepare_output(tmp_path / "file" / "out.txt", create=False)
    write_text_atomic(target, "x")
    assert target.read_text() == "x"


READERS = [read_lines, lambda path: list(iter_lines(path)), count_lines]


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("content, line", [
    (b"eins\nzwei\x00drei\nvier\n", 2),  # a stray NUL near the start: not UTF-16, and named by its line
    (b"".join(b"zeile %d\n" % i for i in range(40000)) + b"x\x00\n", 40001),  # past the first block
])
def test_every_reader_names_the_line_of_a_nul_byte(tmp_path, reader, content, line):
    (tmp_path / "f.txt").write_bytes(content)
    with pytest.raises(UserError, match=rf"f.txt, line {line}: a NUL byte"):
        reader(tmp_path / "f.txt")


@pytest.mark.parametrize("reader", READERS)
def test_a_loop_of_symbolic_links_is_named_as_a_loop_not_as_a_missing_file(tmp_path, reader):
    (tmp_path / "a.txt").symlink_to(tmp_path / "b.txt")
    (tmp_path / "b.txt").symlink_to(tmp_path / "a.txt")
    with pytest.raises(UserError, match=r"a loop of symbolic links \(.*a.txt -> .*b.txt -> .*a.txt\)"):
        reader(tmp_path / "a.txt")


def test_a_link_to_nothing_names_its_target(tmp_path):
    (tmp_path / "a.txt").symlink_to(tmp_path / "gone.txt")
    with pytest.raises(UserError, match="a symbolic link to .*gone.txt, which does not exist"):
        read_lines(tmp_path / "a.txt")


@pytest.mark.parametrize("name, packed, command", [
    ("train.txt", gzip.compress(b"x\n"), None),
    ("train.en.xz", b"\xfd7zXZ\x00rest", "xz -dc {d}/train.en.xz > {d}/train.en"),
    ("train.txt", b"\xfd7zXZ\x00rest", "xz -dc {d}/train.txt > {d}/train.plain.txt"),
    ("train.txt", b"\x28\xb5\x2f\xfdrest", "zstd -dc {d}/train.txt > {d}/train.plain.txt"),
])
def test_decompression_advice_works_on_a_name_without_the_compressors_suffix(tmp_path, name, packed, command):
    """gunzip -k, xz -dk and zstd -d refuse a name without their suffix: the advice writes with -c to a new name."""
    (tmp_path / name).write_bytes(packed)
    if command is None:  # gzip is read through
        assert read_lines(tmp_path / name) == ["x"]
        return
    with pytest.raises(UserError) as error:
        read_lines(tmp_path / name)
    assert command.format(d=tmp_path) in str(error.value)


def test_a_failed_write_removes_the_folders_made_for_it_and_keeps_the_others(tmp_path):
    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "kept" / "new" / "deeper" / "out.txt"):
            raise RuntimeError("the stage failed")
    assert [path.name for path in tmp_path.iterdir()] == ["kept"] and not any((tmp_path / "kept").iterdir())

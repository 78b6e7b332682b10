"""The training process keeps freed host memory for its next step instead of faulting in fresh pages."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import tiny_preset, train_settings

from aiayn.config import section_defaults

# Allocates, fills and frees a 64 MiB tensor (16384 pages of 4 KiB) sixteen times, counting each
# round's page faults. glibc's aligned allocations take a few rounds to settle into freed blocks.
REUSE = """
import resource, sys, torch
from aiayn.speed.host_memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for _ in range(16):
    before = faults()
    block = torch.ones(1 << 24)
    counts.append(faults() - before)
    del block
print(kept, *counts)
"""


def _reuse_faults(mode: str) -> tuple[str, list[int]]:
    done = subprocess.run([sys.executable, "-c", REUSE, mode], capture_output=True, text=True, check=True)
    kept, *faults = done.stdout.split()
    return kept, [int(count) for count in faults]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc on Linux")
def test_a_freed_block_is_reused_without_faulting_in_its_pages_again():
    kept, kept_faults = _reuse_faults("keep")
    if kept != "True":
        pytest.skip("this C library is not glibc")
    _, default_faults = _reuse_faults("default")
    assert max(kept_faults[-4:]) < 1000  # the last rounds reuse pages still mapped
    if min(default_faults) < 4096:
        pytest.skip(f"this kernel maps huge pages ({default_faults} faults a round): nothing to compare")
    assert min(default_faults[-4:]) > 10 * max(kept_faults[-4:]) + 1000


def test_the_training_command_keeps_freed_memory(prepared, tmp_path, monkeypatch):
    import aiayn.train.launch

    calls = []
    monkeypatch.setattr(aiayn.train.launch, "keep_freed_memory", lambda: calls.append("kept") or True)
    monkeypatch.setattr(aiayn.train.launch, "train", lambda job: {})
    train_section = {**section_defaults("train"), "device": "cpu"}
    status = aiayn.train.launch.main([
        *train_settings(tmp_path, tiny_preset(), train_section),
        "--train-data", str(prepared / "bin" / "train"), "--spm-model", str(prepared / "bpe" / "spm.model"),
        "--run-dir", str(tmp_path / "run"), "--no-tracking"])
    assert status == 0
    assert calls == ["kept"]

"""The converted-model cache (engine/model/convert_cache.py): keyed by the GGUF's content, so a
second clone's copy of the file reuses the first clone's folder; the content hashed once per
(path, size, mtime); one conversion when processes start together."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from engine.model import convert_cache, gguf_converter
from engine.model.gguf_converter import convert_gguf
from tests.unit.engine.model.test_gguf_converter import write_gguf

JOIN_TIMEOUT_S = 120.0


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def tiny_gguf(hf_checkpoints, tmp_path) -> Path:
    path = tmp_path / "clone-a" / "tiny.gguf"
    path.parent.mkdir()
    write_gguf(hf_checkpoints["llama"], "llama", path)
    return path


def _count_conversions(monkeypatch: pytest.MonkeyPatch, delay_s: float = 0.0) -> list[Path]:
    """Spy on write_hf_folder (the conversion itself); `delay_s` keeps it busy longer."""
    calls: list[Path] = []
    real = gguf_converter.write_hf_folder

    def counting(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path)
        time.sleep(delay_s)
        real(gguf_path, out_dir)

    monkeypatch.setattr(gguf_converter, "write_hf_folder", counting)
    return calls


def test_a_second_clones_copy_of_the_file_reuses_the_conversion(
    tiny_gguf, cache_dir, tmp_path, monkeypatch
):
    conversions = _count_conversions(monkeypatch)
    first = convert_gguf(tiny_gguf)
    copy = tmp_path / "clone-b" / "tiny.gguf"
    copy.parent.mkdir()
    shutil.copyfile(tiny_gguf, copy)  # another path, another mtime, the same bytes
    os.utime(copy, ns=(0, tiny_gguf.stat().st_mtime_ns + 5_000_000_000))
    assert convert_gguf(copy) == first
    assert conversions == [tiny_gguf.resolve()]
    assert [p.name for p in (cache_dir / "models").iterdir()] == [first.name]


def test_two_processes_starting_together_convert_once(tiny_gguf, cache_dir, monkeypatch):
    """Two converters at once (a prefill and a decode node starting together): one converts
    under the lock, the other waits for it and reads the same folder."""
    conversions = _count_conversions(monkeypatch, delay_s=0.5)
    start = threading.Barrier(2)
    results: list[Path | BaseException] = []

    def convert() -> None:
        start.wait(JOIN_TIMEOUT_S)
        try:
            results.append(convert_gguf(tiny_gguf))
        except BaseException as error:  # reported by the assertion below
            results.append(error)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT_S)
    assert len(results) == 2 and results[0] == results[1], results
    assert len(conversions) == 1
    assert (results[0] / "model.safetensors").is_file()
    assert [p.name for p in (cache_dir / "models").iterdir()] == [results[0].name]


def test_the_content_is_hashed_once_per_path_size_and_mtime(tiny_gguf, cache_dir, monkeypatch):
    hashed: list[Path] = []
    real = convert_cache.file_sha256

    def counting(path: Path) -> str:
        hashed.append(path)
        return real(path)

    monkeypatch.setattr(convert_cache, "file_sha256", counting)
    digest = convert_cache.cached_file_digest(tiny_gguf)
    assert convert_cache.cached_file_digest(tiny_gguf) == digest
    assert len(hashed) == 1  # the second start read the recorded digest
    file_stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(file_stat.st_atime_ns, file_stat.st_mtime_ns + 1_000_000))
    assert convert_cache.cached_file_digest(tiny_gguf) == digest
    assert len(hashed) == 2  # touched: hashed again, the same digest
    records = list((cache_dir / "digests").iterdir())
    assert len(records) == 1 and digest in records[0].read_text()


def test_a_lock_held_too_long_fails_with_a_message(cache_dir, tmp_path):
    folder = cache_dir / "models" / "tiny-0123456789ab"
    with convert_cache.conversion_lock(folder):
        outcome: list[BaseException] = []

        def wait_for_it() -> None:
            try:
                with convert_cache.conversion_lock(folder, timeout_s=1.5):
                    pass
            except TimeoutError as error:
                outcome.append(error)

        waiter = threading.Thread(target=wait_for_it)
        waiter.start()
        waiter.join(JOIN_TIMEOUT_S)
    assert len(outcome) == 1
    assert "another process has held the conversion lock" in str(outcome[0])
    assert folder.name in str(outcome[0])

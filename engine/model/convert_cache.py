"""The cache of converted models: keyed by the source file's content, filled under a lock.

```
<cache_dir>/models/<stem>-<hash of content sha256, converter version>/   the converted folder
<cache_dir>/digests/<hash of the path>.json   {path, size, mtime_ns, sha256}: a file's digest,
                                              reused while its size and mtime are unchanged
<cache_dir>/locks/<folder name>.lock          held (flock) while one process converts
```

Two copies of one file (two clones, each with its own installed copy of the default model)
share one converted folder. The digest is computed once per (path, size, mtime): a start reads
one small JSON file instead of hashing the model again. The lock is an OS file lock
(`filelock`, flock on Linux): released by the kernel when its holder dies, so a killed
converter never leaves a stale lock behind; a process that waits for it says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from pdserve import envs

logger = logging.getLogger(__name__)

LOCK_TIMEOUT_S = 3600.0  # a bound, not an expectation: an 8B model converts in minutes
_WAIT_NOTICE_S = 1.0  # how long a lock may be busy before the wait is logged
_CHUNK_BYTES = 1 << 22


def cached_file_digest(path: Path) -> str:
    """The sha256 of `path`'s content (hex), computed once per (path, size, mtime)."""
    path = path.resolve()
    stat = path.stat()
    record_path = envs.cache_dir() / "digests" / f"{_short_hash(str(path))}.json"
    key = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    try:
        record = json.loads(record_path.read_text())
        if {k: record.get(k) for k in key} == key and isinstance(record.get("sha256"), str):
            return record["sha256"]
    except (OSError, ValueError):
        pass  # absent or unreadable: hash the file
    digest = file_sha256(path)
    _write_atomically(record_path, json.dumps({**key, "sha256": digest}))
    return digest


def file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            sha.update(chunk)
    return sha.hexdigest()


def converted_folder(path: Path, converter_version: int) -> Path:
    """Where the conversion of `path` (by this converter version) lives in the cache."""
    key = f"{cached_file_digest(path)}:{converter_version}"
    return envs.cache_dir() / "models" / f"{path.stem}-{_short_hash(key)}"


@contextlib.contextmanager
def conversion_lock(folder: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Held while this process converts into `folder`; other processes wait (bounded)."""
    lock_path = envs.cache_dir() / "locks" / f"{folder.name}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(lock_path)
    try:
        lock.acquire(timeout=_WAIT_NOTICE_S)
    except Timeout:
        logger.info("waiting for another process converting into %s (lock %s)", folder, lock_path)
        try:
            lock.acquire(timeout=max(timeout_s - _WAIT_NOTICE_S, 0.0))
        except Timeout:
            raise TimeoutError(
                f"another process has held the conversion lock {lock_path} for over "
                f"{timeout_s:g} s (converting into {folder}): stop it, or wait and start again"
            ) from None
    try:
        yield
    finally:
        lock.release()


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

"""proto/generate.py: the committed modules are what the .proto files generate, and --check
names any generated file that is stale, missing or left over."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
PROTO_ROOT = REPO_ROOT / "proto"
PACKAGE_DIR = Path("pdserve") / "v1"  # generated modules, under the repository root


def _generate(proto_root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(proto_root / "generate.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_committed_modules_are_up_to_date() -> None:
    result = _generate(PROTO_ROOT, "--check")

    assert result.returncode == 0, result.stderr


def test_check_names_stale_and_leftover_files_and_generate_mends_them(tmp_path: Path) -> None:
    copy = tmp_path / "proto"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(PROTO_ROOT, copy, ignore=ignore)
    shutil.copytree(REPO_ROOT / PACKAGE_DIR, tmp_path / PACKAGE_DIR, ignore=ignore)
    package = tmp_path / PACKAGE_DIR
    (package / "node_pb2.py").write_text("# edited by hand\n")
    (package / "generation_pb2.pyi").unlink()
    (package / "removed_pb2.py").write_text("# from a deleted .proto\n")

    check = _generate(copy, "--check")

    assert check.returncode == 1
    stale = {line.split()[-1] for line in check.stderr.splitlines() if "out of date" in line}
    assert stale == {
        "pdserve/v1/node_pb2.py",
        "pdserve/v1/generation_pb2.pyi",
        "pdserve/v1/removed_pb2.py",
    }
    assert _generate(copy).returncode == 0
    assert _generate(copy, "--check").returncode == 0
    assert not (package / "removed_pb2.py").exists()
    for name in ("node_pb2.py", "generation_pb2.pyi"):
        assert (package / name).read_bytes() == (REPO_ROOT / PACKAGE_DIR / name).read_bytes()

"""Regenerate the Python modules of pdserve's wire schemas from proto/pdserve/v1/*.proto.

    python proto/generate.py            # rewrite pdserve/v1/*_pb2.py, *_pb2.pyi, *_pb2_grpc.py
    python proto/generate.py --check    # exit 1 naming every generated file that is out of date

Only a .proto that declares a service gets a *_pb2_grpc.py.

The generated files are committed in the top-level `pdserve/v1/` package (OUT_ROOT is the
repository root, beside proto/). They import each other as `pdserve.v1.*` because protoc runs
with proto/ as its include root. Their content depends on the grpcio-tools version, so --check
fails after an upgrade until they are regenerated.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
OUT_ROOT = PROTO_ROOT.parent  # generated modules land in OUT_ROOT/pdserve/v1
PACKAGE_DIR = Path("pdserve") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
SERVICE_RE = re.compile(r"^service\s+\w+", re.MULTILINE)


def proto_sources() -> list[Path]:
    """The .proto files, relative to PROTO_ROOT."""
    sources = sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    if not sources:
        raise FileNotFoundError(f"no .proto files under {PROTO_ROOT / PACKAGE_DIR}")
    return sources


def generated_files(root: Path) -> set[Path]:
    """Generated modules under root/pdserve/v1, relative to root."""
    return {
        p.relative_to(root)
        for p in (root / PACKAGE_DIR).iterdir()
        if p.name.endswith(GENERATED_SUFFIXES)
    }


def run_protoc(out_dir: Path) -> None:
    """Generate every module into out_dir (which mirrors PROTO_ROOT's layout)."""
    (out_dir / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    sources = proto_sources()
    with_services = [s for s in sources if SERVICE_RE.search((PROTO_ROOT / s).read_text())]
    protoc(f"--python_out={out_dir}", f"--pyi_out={out_dir}", *sources)
    if with_services:
        protoc(f"--grpc_python_out={out_dir}", *with_services)


def protoc(*args: str | Path) -> None:
    """Run grpc_tools' bundled protoc with proto/ as the include root."""
    command = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_ROOT}", *map(str, args)]
    result = subprocess.run(command, cwd=PROTO_ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"protoc failed ({' '.join(command)}):\n{result.stderr}")


def stale_files(fresh_root: Path) -> list[Path]:
    """Generated files that differ between fresh_root and OUT_ROOT, missing, or left over."""
    fresh = generated_files(fresh_root)
    committed = generated_files(OUT_ROOT)
    differing = {
        path
        for path in fresh & committed
        if (fresh_root / path).read_bytes() != (OUT_ROOT / path).read_bytes()
    }
    return sorted(differing | (fresh ^ committed))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a generated file is stale"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh_root = Path(tmp)
        run_protoc(fresh_root)
        stale = stale_files(fresh_root)
        if args.check:
            for path in stale:
                print(f"out of date: {path}", file=sys.stderr)
            if stale:
                print("regenerate with: python proto/generate.py", file=sys.stderr)
            return 1 if stale else 0
        for path in stale:
            if (fresh_root / path).exists():
                shutil.copyfile(fresh_root / path, OUT_ROOT / path)
                print(f"wrote {path}")
            else:
                (OUT_ROOT / path).unlink()
                print(f"removed {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

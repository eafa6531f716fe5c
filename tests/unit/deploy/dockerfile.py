"""A small reader of deploy/Dockerfile for the offline image checks: its instructions (line
continuations joined, comments dropped), the ARG defaults, and the files its COPY lines put
into the build folder."""

from __future__ import annotations

import shlex
import shutil
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = REPO_ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / "deploy" / "Dockerfile.dockerignore"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case, e.g. "COPY"
    arguments: str  # the rest of the (joined) line
    workdir: str  # the WORKDIR in effect


def instructions(path: Path = DOCKERFILE) -> list[Instruction]:
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue  # comments may sit between continuation lines
        pending += stripped.removesuffix("\\").strip() + " "
        if not stripped.endswith("\\"):
            lines.append(pending.strip())
            pending = ""
    assert not pending, f"{path} ends inside a continued line"
    out, workdir = [], "/"
    for line in lines:
        keyword, _, arguments = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "WORKDIR":
            workdir = arguments.strip()
        out.append(Instruction(keyword, arguments.strip(), workdir))
    return out


def arg_defaults(path: Path = DOCKERFILE) -> dict[str, str]:
    defaults = {}
    for instruction in instructions(path):
        if instruction.keyword == "ARG":
            name, _, value = instruction.arguments.partition("=")
            defaults[name] = value
    return defaults


def copies(path: Path = DOCKERFILE) -> list[tuple[list[str], str, str]]:
    """(sources, destination, workdir) of each COPY from the build context."""
    out = []
    for instruction in instructions(path):
        if instruction.keyword not in ("COPY", "ADD"):
            continue
        words = shlex.split(instruction.arguments)
        assert not any(w.startswith("--from") for w in words), "multi-stage COPY not handled"
        words = [w for w in words if not w.startswith("--")]
        out.append((words[:-1], words[-1], instruction.workdir))
    return out


def ignore_patterns(path: Path = DOCKERIGNORE) -> list[str]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [p.strip() for p in lines if p.strip() and not p.strip().startswith("#")]


def build_context_copy(destination: Path) -> str:
    """Copies what the Dockerfile's COPY lines take from the repository (minus the
    .dockerignore patterns) into `destination`, laid out as in the image's WORKDIR; returns
    that WORKDIR. Every COPY must target the same WORKDIR (the one `pip install .` runs in)."""
    patterns = ignore_patterns()
    workdirs = set()
    for sources, target, workdir in copies():
        workdirs.add(workdir)
        into_folder = target.endswith("/") or len(sources) > 1  # Docker's rule for COPY
        for source in sources:
            origin = REPO_ROOT / source
            assert origin.exists(), f"COPY {source}: no such path in the build context"
            dest = destination / target / origin.name if into_folder else destination / target
            dest.parent.mkdir(parents=True, exist_ok=True)
            if origin.is_dir():
                shutil.copytree(origin, dest, ignore=_ignorer(patterns))
            elif not ignored(source, patterns):
                shutil.copy2(origin, dest)
    assert len(workdirs) == 1, f"COPY lines target several WORKDIRs: {workdirs}"
    return workdirs.pop()


def ignored(relative: str, patterns: list[str]) -> bool:
    name = relative.rsplit("/", 1)[-1]
    return any(fnmatch(relative, p) or fnmatch(name, p.removeprefix("**/")) for p in patterns)


def _ignorer(patterns: list[str]):
    def ignore(folder: str, names: list[str]) -> list[str]:
        base = Path(folder).relative_to(REPO_ROOT).as_posix()
        return [n for n in names if ignored(f"{base}/{n}", patterns)]

    return ignore

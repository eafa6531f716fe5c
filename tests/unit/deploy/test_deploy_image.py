"""deploy/Dockerfile, checked without Docker: a wheel built from exactly the files its COPY
lines take holds every package pyproject.toml lists, and the image's defaults are the
documented ones (CPU torch, a non-root user, a health check)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile

import pytest

from tests.unit.deploy import dockerfile
from tests.unit.deploy.dockerfile import REPO_ROOT

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def _packages() -> list[str]:
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    return [pattern.removesuffix("*") for pattern in include]


def _tracked_python(package: str) -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", f"{package}/*.py"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    return listed


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    context = tmp_path_factory.mktemp("image-src")
    workdir = dockerfile.build_context_copy(context)
    runs = [
        i
        for i in dockerfile.instructions()
        if i.keyword == "RUN" and "pip install ." in i.arguments
    ]
    assert runs and runs[0].workdir == workdir, "`pip install .` must run where COPY put the source"
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(out), str(context)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, "the image's file set does not build:\n" + result.stderr[-3000:]
    (built,) = out.glob("pdserve-*.whl")
    return zipfile.ZipFile(built)


def test_every_package_of_pyproject_is_copied() -> None:
    copied = {source for sources, _, _ in dockerfile.copies() for source in sources}
    missing = [p for p in _packages() if p not in copied]
    assert not missing, f"deploy/Dockerfile does not COPY {missing} (pyproject.toml lists them)"


@pytest.mark.parametrize("package", _packages())
def test_wheel_from_the_image_files_holds_the_package(wheel, package) -> None:
    names = set(wheel.namelist())
    missing = [path for path in _tracked_python(package) if path not in names]
    assert f"{package}/__init__.py" in names, f"{package} is not in the wheel"
    assert not missing, f"the image's wheel lacks {missing}"


def test_wheel_has_every_console_script(wheel) -> None:
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(entry_points).decode()
    names = set(wheel.namelist())
    for script, target in PYPROJECT["project"]["scripts"].items():
        assert f"{script} = {target}" in text
        module = target.split(":")[0].replace(".", "/") + ".py"
        assert module in names, f"{script}'s module {module} is not in the wheel"


def test_torch_defaults_to_the_cpu_build_and_matches_the_pin() -> None:
    args = dockerfile.arg_defaults()
    assert args["TORCH_VARIANT"] == "cpu"
    pin = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    assert pin == f"torch=={args['TORCH_VERSION']}", "the image's torch must satisfy the pin"


def test_runs_as_a_non_root_user_with_a_health_check() -> None:
    steps = dockerfile.instructions()
    users = [i.arguments for i in steps if i.keyword == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image must not run as root"
    (check,) = [i.arguments for i in steps if i.keyword == "HEALTHCHECK"]
    assert "pdserve.health_check" in check
    assert (REPO_ROOT / "pdserve" / "health_check.py").is_file()
    assert steps[-1].keyword == "CMD"

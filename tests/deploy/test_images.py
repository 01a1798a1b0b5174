"""Dockerfiles: hadolint clean, non-root, pinned, and wired to the `k3` entrypoint and health command."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from services.runtime.ports import free_port
from tests.deploy.chart import REPO

DOCKER = REPO / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    pairs = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            pairs.append((keyword.upper(), rest.strip()))
    return pairs


def test_both_images_exist():
    assert {p.name for p in DOCKERFILES} == {"control-plane.Dockerfile", "gpu-worker.Dockerfile"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(hadolint, dockerfile):
    result = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_is_actually_checking(hadolint, tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\n")
    result = subprocess.run([hadolint, str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3007" in result.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_runs_non_root_through_tini_and_k3(dockerfile):
    steps = _instructions(dockerfile)
    users = [args for keyword, args in steps if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert [args for keyword, args in steps if keyword == "ENTRYPOINT"][-1] == '["tini", "--", "k3"]'
    health = [args for keyword, args in steps if keyword == "HEALTHCHECK"][-1]
    assert health.endswith('CMD ["k3", "health", "--address", "localhost:50051"]')


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_versions_are_pinned(dockerfile):
    steps = _instructions(dockerfile)
    images = [args.split("=", 1)[1] for keyword, args in steps if keyword == "ARG" and "_IMAGE=" in args]
    assert images
    for image in images:
        assert re.search(r":\d+\.\d+\.\d+", image), f"base image not pinned to a release: {image}"
    # Every stage starts from one of those pinned ARGs or an earlier stage.
    assert all(args.startswith("${") for keyword, args in steps if keyword == "FROM")
    runs = " ".join(args for keyword, args in steps if keyword == "RUN")
    assert re.search(r"torch==2\.13\.0", runs)
    assert "--constraint /tmp/constraints.txt" in runs


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copies_every_package_root(dockerfile):
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    includes = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    roots = {pattern.rstrip("*").rstrip(".") for pattern in includes}
    roots -= {"k3"}  # generated stubs live under protos/
    copied = {args.split()[0] for keyword, args in _instructions(dockerfile) if keyword == "COPY"}
    assert roots | {"protos"} <= copied, roots - copied


def test_constraints_pin_every_runtime_dependency():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    pins = {}
    for line in (DOCKER / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name] = version
    for spec in pyproject["project"]["dependencies"]:
        requirement = Requirement(spec)
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        if name == "torch":
            continue
        assert name in pins, f"{name} missing: run .venv/bin/python docker/lock_constraints.py"
        assert requirement.specifier.contains(pins[name], prereleases=True), (name, pins[name], spec)


def test_health_entrypoint_reports_a_dead_server():
    result = subprocess.run([sys.executable, "-m", "services.cli.main", "health", "--address",
                             f"127.0.0.1:{free_port()}", "--timeout", "0.5"], capture_output=True, text=True,
                            timeout=30, cwd=REPO)
    assert result.returncode == 1 and "UNREACHABLE" in result.stdout, result.stderr


def _build_stage_copies(dockerfile: Path) -> list[str]:
    """Sources the build stage copies from the context (up to the first runtime-stage FROM)."""
    sources, stage = [], 0
    for keyword, args in _instructions(dockerfile):
        if keyword == "FROM":
            stage += 1
        elif keyword == "COPY" and stage == 1 and not args.startswith("--from"):
            sources.extend(args.split()[:-1])
    return sources


def test_both_images_build_the_same_wheel_inputs():
    copies = {tuple(_build_stage_copies(dockerfile)) for dockerfile in DOCKERFILES}
    assert len(copies) == 1, copies


def test_build_stage_inputs_make_a_complete_wheel(tmp_path):
    """Runs the build stage's wheel step on exactly the files it copies: the wheel must carry the `k3` entry
    point, the generated stubs and every service."""
    context = tmp_path / "src"
    context.mkdir()
    for source in _build_stage_copies(DOCKERFILES[0]):
        origin = REPO / source
        if origin.is_dir():
            shutil.copytree(origin, context / source, ignore=shutil.ignore_patterns("__pycache__", "results"))
        else:
            shutil.copy(origin, context / source)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                             "--wheel-dir", str(tmp_path / "wheels"), str(context)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = (tmp_path / "wheels").glob("k3serve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "k3 = services.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    assert {"k3/v1/decode_pb2.py", "k3/v1/gateway_pb2_grpc.py", "services/cli/main.py"} <= names
    assert {n.split("/")[1] for n in names if n.startswith("services/") and n.count("/") > 1} >= {
        "gateway", "admission", "router", "kvtransfer", "runtime", "cli"}

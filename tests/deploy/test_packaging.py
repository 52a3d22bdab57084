"""The distribution as users get it (DESIGN.md "Layout"): a wheel of the repository installs one
top-level package, ``headrace``, with its data files; and ``python -m headrace`` works from any
directory through the (editable) install, not because the repository happens to be the cwd.

The wheel is built from a copy of the repository's source (what .gitignore does not exclude) in a
temporary directory: a build in the checkout itself would leave build/ there, and setuptools packs
stale files from an old build/lib into the next wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.procs import REPO

# .gitignore's entries, plus the git directory: what is not the repository's source
NOT_SOURCE = (".git", ".venv", ".venv-sglang", "__pycache__", "*.pyc", "*.egg-info", ".pytest_cache",
              ".hypothesis", "runs", "models", "build", "dist")


def build_wheel(out: Path) -> Path:
    """``pip wheel --no-deps`` of a copy of REPO into ``out``; the path of the one wheel built."""
    src = out / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    wheels = out / "wheels"
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(src)]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    # without build isolation the installed setuptools builds it (no network); if that fails (an
    # older setuptools than pyproject.toml asks for), pip fetches the build requirements
    r = subprocess.run([*cmd, "--no-build-isolation"], capture_output=True, text=True, env=env, timeout=300)
    if r.returncode != 0:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, f"pip wheel failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    built = sorted(wheels.glob("headrace-*.whl"))
    assert len(built) == 1, f"expected one headrace wheel, got {[p.name for p in wheels.iterdir()]}"
    return built[0]


def test_wheel_holds_only_the_headrace_package_and_its_data_files(tmp_path: Path) -> None:
    names = zipfile.ZipFile(build_wheel(tmp_path)).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert len(dist_info) == 1 and next(iter(dist_info)).startswith("headrace-"), sorted(tops)
    assert tops - dist_info == {"headrace"}, f"top-level names besides headrace: {sorted(tops - dist_info - {'headrace'})}"
    for required in ("headrace/__init__.py", "headrace/__main__.py", "headrace/shared/config.py"):
        assert required in names, f"{required} is missing from the wheel"
    configs = sorted(p.name for p in (REPO / "deploy" / "configs").glob("*.yaml"))
    assert configs, "the repository has no deploy/configs/*.yaml to ship"
    for name in configs:
        assert f"headrace/deploy/configs/{name}" in names, f"deploy/configs/{name} is missing from the wheel"


def test_python_m_headrace_help_works_outside_the_repository(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}    # only the install finds headrace
    r = subprocess.run([sys.executable, "-m", "headrace", "--help"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Usage:" in r.stdout, r.stdout
    for command in ("run", "train", "buffer", "rollout", "engine", "launch"):
        assert f" {command} " in r.stdout, f"`headrace --help` does not list {command}:\n{r.stdout}"
    # and the package it ran is this repository's, through the editable install
    r = subprocess.run([sys.executable, "-c", "import headrace.shared.config as m; print(m.__file__)"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert Path(r.stdout.strip()).resolve() == (REPO / "shared" / "config.py").resolve(), r.stdout

"""scripts/setup.sh, with a stand-in Python in .venv that records what it is asked to do:
a project venv, torch from PyTorch's CPU index without a GPU (the default index when that
fails), and no pip at all when nothing changed."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu --retries 0 --timeout 15"

# Records its arguments; `-c "import torch"` fails until torch is "installed", and a pip
# call with the CPU index fails when the file cpu_index_down exists.
FAKE_PYTHON = """#!/usr/bin/env bash
here="$(cd "$(dirname "$0")" && pwd)"
echo "$*" >> "$here/calls"
if [ "$1" = "-c" ]; then [ -e "$here/torch" ]; exit; fi
if [[ "$*" == *index-url* ]] && [ -e "$here/cpu_index_down" ]; then exit 1; fi
if [[ "$*" == *"install -q torch"* ]]; then touch "$here/torch"; fi
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    no_gpu = tmp_path / "no_gpu"
    no_gpu.mkdir()
    (no_gpu / "nvidia-smi").write_text("#!/bin/sh\nexit 1\n")
    (no_gpu / "nvidia-smi").chmod(0o755)
    return tmp_path


def setup(project: Path, *extras: str) -> list[str]:
    """Run setup.sh; returns the calls made to .venv's python this time."""
    calls = project / ".venv" / "bin" / "calls"
    before = calls.read_text().splitlines() if calls.exists() else []
    env = {"PATH": f"{project / 'no_gpu'}:/usr/bin:/bin", "HOME": str(project)}
    subprocess.run(["bash", str(project / "scripts" / "setup.sh"), *extras], check=True, env=env, timeout=60)
    return calls.read_text().splitlines()[len(before):] if calls.exists() else []


def test_cpu_torch_then_the_package_then_nothing_until_something_changes(project):
    assert setup(project, "test") == ["-c import torch", f"-m pip install -q torch==2.13.0 {CPU_INDEX}",
                                      "-m pip install -q -e .[test]"]
    assert setup(project, "test") == []  # nothing changed: no pip at all
    assert setup(project) == []  # fewer extras than installed
    assert setup(project, "serve,test") == ["-c import torch", "-m pip install -q -e .[serve,test]"]  # a new one
    assert setup(project, "test,serve") == setup(project, "serve") == []
    with open(project / "pyproject.toml", "a") as f:
        f.write("\n# a change\n")
    assert setup(project) == ["-c import torch", "-m pip install -q -e ."]
    assert setup(project, "serve") == ["-c import torch", "-m pip install -q -e .[serve]"]  # installed afresh since


def test_the_default_index_when_the_cpu_index_fails(project):
    (project / ".venv" / "bin" / "cpu_index_down").touch()
    assert setup(project) == ["-c import torch", f"-m pip install -q torch==2.13.0 {CPU_INDEX}",
                              "-m pip install -q torch==2.13.0", "-m pip install -q -e ."]

"""The code stays clean: ruff and codespell, with the configuration in
pyproject.toml and setup.cfg."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize('command', [
    [sys.executable, '-m', 'ruff', 'check', '.'],
    ['codespell'],
], ids=['ruff', 'codespell'])
def test_lint(command):
    if command[0] == 'codespell' and shutil.which('codespell') is None:
        pytest.skip('codespell is not installed')
    if 'ruff' in command and importlib.util.find_spec('ruff') is None:
        pytest.skip('ruff is not installed')  # requirements/floor.txt
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr

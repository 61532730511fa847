"""The import layering pyproject.toml states (import-linter contracts): each module imports only from layers below
its own, and no package's modules import one another in a cycle."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_imports_keep_the_layers_and_make_no_cycles():
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
         "--no-cache"],
        cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout

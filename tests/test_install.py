"""`pip install .` into a fresh environment installs one importable name, compiled_spec (the command, the passes and
the benchmarks inside it), and the compiled-spec script; nothing named cli, passes or benchmarks lands beside it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_pip_install_installs_only_compiled_spec_and_its_command(tmp_path):
    environment = tmp_path / "venv"
    # The environment sees this machine's packages (torch and the rest) but not the project: its editable install
    # lives in the system site-packages as a finder, so the fresh install is checked from its own files below.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(environment)], check=True)
    python = environment / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--disable-pip-version-check", str(ROOT)], check=True, timeout=600, cwd=tmp_path)
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    record = next(site.glob("compiled_spec-*.dist-info")) / "RECORD"
    installed = {line.split(",")[0] for line in record.read_text().splitlines()}
    top_level = {path.split("/")[0] for path in installed if not path.startswith("..")}
    assert top_level == {"compiled_spec", record.parent.name}, top_level
    assert {"compiled_spec/cli.py", "compiled_spec/passes/manager.py", "compiled_spec/benchmarks/sweep.py"} <= installed
    assert not any(path.endswith("/bin/cli") for path in installed)
    scripts = {Path(path).name for path in installed if path.startswith("..")}
    assert scripts == {"compiled-spec"}, scripts

    # The installed files are what the command imports, from anywhere (not the repository beside it).
    shown = subprocess.run([environment / "bin" / "compiled-spec", "--help"], capture_output=True, text=True,
                           cwd=tmp_path, timeout=120)
    assert shown.returncode == 0 and "MTP speculative decoding" in shown.stdout, shown.stderr
    where = subprocess.run([python, "-c", "import compiled_spec.cli, compiled_spec.passes; "
                            "print(compiled_spec.cli.__file__); print(compiled_spec.passes.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, check=True).stdout.split()
    assert all(Path(path).is_relative_to(site) for path in where), where

"""Faults in the compile cache of full on CPU: a stale pid file, a damaged package or constant, a compile child
killed by its pid. None of them may hang a start, load a damaged package, or leave processes behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir

from compiled_spec import LLM
from compiled_spec.config import GraphMode
from compiled_spec.compiler import weight_store
from compiled_spec.compiler.background_compile import failed_file
from compiled_spec.compiler.aot_packages import PACKAGE_FOLDER, discard_package, package_damage
from test_graph_modes import ENGINE
from test_tiered_start import decode
from test_hisparse import prompts_for

SMALL = dict(num_speculative_tokens=1, max_batch_size=2, max_seq_len=24, batch_buckets=(2,), prefill_buckets=(24,))


def pool_workers_of(pid: int) -> list[int]:
    """The spawned processes of pid's process pool (not multiprocessing's resource tracker)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and b"spawn_main" in (stat.parent / "cmdline").read_bytes():
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("holder", ["this process", "an unrelated process"])
def test_a_stale_pid_file_naming_a_live_process_that_does_not_compile_is_not_followed(
        tiny_checkpoint, tmp_path, monkeypatch, holder):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    llm = LLM(tiny_checkpoint("predictive").path, graph_mode="full", background_compile=True, compile_workers=1,
              show_progress=False, warm_up=False, **SMALL)
    engine = llm.engine
    paths = [engine.runner.package_path(*graph) for graph in engine.startup.warm_up_graphs()]
    other = subprocess.Popen(["sleep", "120"]) if holder == "an unrelated process" else None
    try:
        pid_file = failed_file(paths).with_suffix(".pid")  # the pid file a BackgroundCompile of these paths reads
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        pid_file.write_text(str(other.pid if other else os.getpid()))
        engine.startup.warm_up(show_progress=False)
        background = engine.startup.background
        assert background is not None and background.process is not None  # its own child, not the stale pid's
        assert background.pid != (other.pid if other else os.getpid())
        background.stop()
    finally:
        if other:
            other.kill()


def test_a_compile_child_killed_by_its_pid_takes_its_pool_workers_with_it(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    llm = LLM(tiny_checkpoint("predictive").path, graph_mode="full", background_compile=True, compile_workers=2,
              show_progress=False, **SMALL)
    child = llm.engine.startup.background.process
    deadline = time.monotonic() + 120
    while len(workers := pool_workers_of(child.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(workers) == 2, "the child should run two pool workers"
    time.sleep(8)  # the workers import torch and start building the engine
    os.kill(child.pid, signal.SIGKILL)  # not the whole session, as BackgroundCompile.stop() does: the pid alone
    child.wait()
    deadline = time.monotonic() + 20
    while any(alive(worker) for worker in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(worker) for worker in workers), "pool workers outlived the child that started them"
    llm.engine.startup.background.stop()


def copy_packages(names: list[str], folder: Path) -> None:
    """The packages `names` of this process's package folder, and their constants, into `folder`."""
    source = Path(cache_dir()) / PACKAGE_FOLDER
    (folder / weight_store.FOLDER).mkdir(parents=True)
    keys = set()
    for name in names:
        shutil.copy(source / name, folder / name)
        keys |= set(weight_store.read_manifest(source / name).values())
    for key in keys:
        shutil.copy(source / weight_store.FOLDER / f"{key}.pt", folder / weight_store.FOLDER / f"{key}.pt")


def damage_package(package: Path, damage: str) -> None:
    key = sorted(weight_store.read_manifest(package).values())[0]
    constant = package.parent / weight_store.FOLDER / f"{key}.pt"
    if damage == "truncated package":
        package.write_bytes(package.read_bytes()[: package.stat().st_size // 2])
    elif damage == "deleted constant":
        constant.unlink()
    else:
        tensor = torch.load(constant, weights_only=True).clone()
        tensor.view(-1)[0] += 1  # same name, same shape, other bytes
        torch.save(tensor, constant)


@pytest.fixture(scope="module")
def full_packages(tiny_checkpoint):
    """The names of the packages of test_graph_modes' full engine (loaded where that test compiled them)."""
    warm = LLM(tiny_checkpoint("predictive").path, graph_mode="full", show_progress=False, **ENGINE)
    compiled, loaded = warm.engine.runner.packages()
    return sorted(compiled + loaded)


@pytest.mark.slow
@pytest.mark.xdist_group("full_engine_packages")  # loads the packages test_graph_modes compiled on this worker
@pytest.mark.parametrize("damage", ["truncated package", "deleted constant", "altered constant"])
def test_a_damaged_package_or_constant_is_named_and_discarded(full_packages, tmp_path, damage):
    copy_packages(full_packages, tmp_path)
    package = tmp_path / full_packages[0]
    assert package_damage(package) is None and package_damage(tmp_path / full_packages[1]) is None
    damage_package(package, damage)
    found = package_damage(package)
    assert found is not None and {"truncated package": "unreadable", "deleted constant": "missing",
                                  "altered constant": "altered"}[damage] in found, found
    discard_package(package)
    assert not package.exists()
    constants = list((tmp_path / weight_store.FOLDER).glob("*.pt"))
    assert all(weight_store.damage(tmp_path, {"c": path.stem}) is None for path in constants)  # none left altered


@pytest.mark.slow
@pytest.mark.xdist_group("full_engine_packages")
def test_a_tiered_start_finding_a_damaged_package_serves_in_eager_while_it_compiles_again(
        tiny_checkpoint, full_packages, tmp_path, monkeypatch, caplog):
    path = tiny_checkpoint("predictive").path
    copy = tmp_path / "inductor" / PACKAGE_FOLDER
    copy_packages(full_packages, copy)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    prefill = next(name for name in full_packages if name.startswith("prefill"))  # the quicker of the compiles
    damage_package(copy / prefill, "truncated package")

    prompts = prompts_for((4, 9, 6), seed=5)
    reference = decode(LLM(path, graph_mode="eager", **ENGINE), prompts)
    with caplog.at_level("WARNING"):
        llm = LLM(path, graph_mode="full", background_compile=True, compile_workers=1, show_progress=False, **ENGINE)
    messages = [record.getMessage() for record in caplog.records if record.levelno >= 30]
    assert len(messages) == 1 and "damaged" in messages[0] and str(copy) in messages[0], messages
    engine = llm.engine
    assert engine.runner.mode == GraphMode.EAGER and engine.startup.background is not None  # serving while it compiles
    assert decode(llm, prompts) == reference
    background = engine.startup.background
    assert engine.startup.poll_background(wait=True, timeout=900) == "ready", background.log.read_text()[-3000:]
    assert engine.runner.mode == GraphMode.FULL
    assert decode(llm, prompts) == reference

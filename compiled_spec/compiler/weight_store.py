"""One copy of the frozen weights for every package: AOTInductor constants kept outside the packages.

Freezing folds each weight into the graph's constants (C++ GEMM templates pre-pack it), so each bucket's
package would carry its own copy. Packages are therefore compiled with their constants outside the shared
library, and each constant is stored once under the folder, named by the sha256 of its dtype, shape, strides
and bytes. A package keeps only the map from its constant names to those digests; loading binds the stored
tensors by pointer (user-managed). Buckets whose constants are equal share one file on disk and one tensor in
memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import weakref
import zipfile
from pathlib import Path

import torch

from ..loading.huge_pages import copies_on_huge_pages
from . import torch_patches

FOLDER = "constants"
MANIFEST_NAME = "compiled_spec_constants.json"  # inside the package, beside the shared library

# digest -> tensor, while some loaded package holds it: packages loaded in one process share each tensor.
_loaded: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


@contextlib.contextmanager
def left_out_of_the_library():
    """Collects {name: value} of the constants that the AOTInductor compiles inside this block leave out of their
    shared library (aot_inductor.package_constants_in_so=False), under the names the loader binds them by.

    torch's own list of them (package_constants_on_disk_format) is keyed by each constant's original name, and
    those repeat: one step graph here had three constants whose original name was constant29, so it
    kept one of the three and load_constants(check_full_update=True) failed."""
    constants: dict[str, torch.Tensor] = {}

    def collect(graph) -> None:
        constants.update({name: graph.get_original_value_of_constant(name) for name in graph.constants
                          if name not in graph.folded_constants})

    with torch_patches.before_each_aot_library(collect):
        yield constants


def digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape, strides and bytes: the key a constant is stored under, and what
    aot_packages.model_digest hashes each weight by."""
    hasher = hashlib.sha256(repr((tensor.dtype, tuple(tensor.shape), tensor.stride())).encode())
    hasher.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return hasher.hexdigest()


def store(folder: Path, constants: dict[str, torch.Tensor]) -> dict[str, str]:
    """Writes each constant not yet in the folder; returns {constant name: digest}."""
    (folder / FOLDER).mkdir(parents=True, exist_ok=True)
    manifest = {}
    for name, tensor in constants.items():
        if tensor.layout != torch.strided:
            raise NotImplementedError(f"constant {name} is a {tensor.layout} tensor; only strided constants can be "
                                      "stored outside a package")
        manifest[name] = key = digest(tensor)
        path = _path(folder, key)
        if not path.exists():
            owned = tensor.detach().clone() if _is_view(tensor) else tensor.detach()
            partial = path.with_name(f"{path.stem}.{os.getpid()}.partial")
            torch.save(owned, partial)
            os.replace(partial, path)
    return manifest


def load(folder: Path, manifest: dict[str, str], in_memory: dict[str, torch.Tensor] | None = None,
         ) -> dict[str, torch.Tensor]:
    """{constant name: tensor} for a manifest: the tensor in `in_memory` with the same digest (the model's own
    weight: one copy in memory, not two), else read from disk once per process into memory on huge pages
    (loading/huge_pages.py)."""
    held, read = {}, {}  # strong references: _loaded is weak
    for name, key in manifest.items():
        if key in held or key in read:
            continue
        tensor = (in_memory or {}).get(key)
        if tensor is None:
            tensor = _loaded.get(key)
        if tensor is not None:
            held[key] = tensor
            continue
        path = _path(folder, key)
        if not path.exists():
            raise FileNotFoundError(f"constant {name} of a package is missing from {path.parent} ({key})")
        read[key] = torch.load(path, weights_only=True, mmap=True)
    for key, tensor in zip(read, copies_on_huge_pages(list(read.values()))):
        held[key] = _loaded[key] = tensor
    return {name: held[key] for name, key in manifest.items()}


def damage(folder: Path, manifest: dict[str, str]) -> str | None:
    """What is wrong with the stored constants of a manifest (missing, or bytes that no longer match their digest),
    or None. Reads every file, loaded in this process or not: a compile child loads from the disk."""
    for key in sorted(set(manifest.values())):
        if (problem := _stored_damage(folder, key)) is not None:
            return problem
    return None


def discard_altered(folder: Path, manifest: dict[str, str]) -> None:
    """Removes the manifest's stored constants that are unreadable or altered."""
    for key in set(manifest.values()):
        path = _path(folder, key)
        if path.exists() and _stored_damage(folder, key) is not None:
            path.unlink()


def _stored_damage(folder: Path, key: str) -> str | None:
    path = _path(folder, key)
    try:
        tensor = torch.load(path, weights_only=True, mmap=True)
    except FileNotFoundError:
        return f"constant {path.name} is missing from {path.parent}"
    except Exception as error:
        return f"constant {path} is unreadable ({error})"
    if digest(tensor) != key:
        return f"constant {path} was altered (its bytes no longer match its name)"
    return None


def write_manifest(directory: Path, manifest: dict[str, str]) -> Path:
    path = directory / MANIFEST_NAME
    path.write_text(json.dumps(manifest, sort_keys=True))
    return path


def read_manifest(package: Path) -> dict[str, str]:
    with zipfile.ZipFile(package) as archive:
        name = next(n for n in archive.namelist() if n.endswith("/" + MANIFEST_NAME))
        return json.loads(archive.read(name))


def size(folder: Path, key: str) -> int:
    return _path(folder, key).stat().st_size


def _path(folder: Path, key: str) -> Path:
    return folder / FOLDER / f"{key}.pt"


def _is_view(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()

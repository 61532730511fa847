"""full on CPU: each bucket compiled ahead of time into an AOTInductor package, kept on disk by key.

torch.compile cannot start frozen CPU graphs quickly: Dynamo traces them again in every process, AOT autograd does
not cache a graph with freezing on, and inductor's FX graph cache skips frozen graphs (the MKL-packed weights among
their constants cannot be pickled), so a warm start through torch.compile recompiles every bucket
(docs/graph-modes.md, "full on CPU: ahead-of-time packages", has the figure). Here a bucket is exported
(torch.export: one graph or an error, like fullgraph=True), compiled by inductor with full's options (max-autotune,
freezing) and the same passes, and saved under the inductor cache dir; a process that needs the same bucket loads it
in milliseconds.

A package has no guards, so its key covers everything the compiled code depends on: the weights' bytes
(frozen into it), the constants, the state's layout, the bucket, the function and the code that shapes
graphs (graph_code_files), the passes, the options (torch's patches among them), torch and the CPU. The
frozen weights themselves are not in the package: they are stored once beside the packages and bound at
load (weight_store).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import os
import shutil
import subprocess
import tempfile
import weakref
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch._inductor.package import package_aoti
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch.export.graph_signature import InputKind

from ..model import cpu_kernels
from ..passes.graph_inputs import named_inputs
from ..speculative.state import DecodeState
from . import weight_store

PACKAGE_FOLDER = "compiled_spec_packages"
# Constants (the frozen, pre-packed weights) stay out of the shared library; weight_store stores them once.
CONSTANTS_OUTSIDE = {"aot_inductor.package": True, "aot_inductor.package_constants_in_so": False}
_PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class DynamicSize:
    """One dimension of one tensor argument that a single package takes at every size from low to high: the prompt
    length of prefill, or the batch of a step, so that one graph, compiled once, runs each at its own size. A call
    whose size lies outside the range gets a package of its own size."""

    arg: int  # index among the call's arguments (after model, state and constants)
    dim: int
    low: int
    high: int

    def covers(self, args: tuple) -> bool:
        return self.low <= args[self.arg].shape[self.dim] <= self.high

    def bucket(self, args: tuple) -> tuple:
        """The arguments' bucket (shapes and fixed values), with this dimension as the range it covers."""
        if not self.covers(args):
            return static_bucket(args)
        bucket = list(static_bucket(args))
        shape = list(bucket[self.arg])
        shape[self.dim] = f"{self.low}to{self.high}"
        bucket[self.arg] = tuple(shape)
        return tuple(bucket)


def static_bucket(args: tuple) -> tuple:
    return tuple(tuple(arg.shape) if isinstance(arg, torch.Tensor) else arg for arg in args)


class BucketProgram(torch.nn.Module):
    """function(model, state, constants, *args) for one bucket, over flat tensors: the state's tensors in
    tensors() order, then the tensor arguments. The other arguments (a batch size) are fixed."""

    def __init__(self, function, model, state: DecodeState, constants, args: tuple):
        super().__init__()
        self.model = model
        self.function, self.layout, self.constants, self.args = function, state, constants, args

    def forward(self, *tensors):
        count = len(self.layout.tensors())
        supplied = iter(tensors[count:])
        args = [next(supplied) if isinstance(arg, torch.Tensor) else arg for arg in self.args]
        return self.function(self.model, self.layout.with_tensors(tensors[:count]), self.constants, *args)


def package_damage(path: Path) -> str | None:
    """Why the package at `path` cannot be loaded as it is (a truncated archive, constants missing or altered), or
    None."""
    try:
        with zipfile.ZipFile(path) as archive:
            if (broken := archive.testzip()) is not None:
                return f"{broken} in {path.name} is corrupt"
        manifest = weight_store.read_manifest(path)
    except (OSError, zipfile.BadZipFile, StopIteration, ValueError) as error:
        return f"{path.name} is unreadable ({error or type(error).__name__})"
    return weight_store.damage(path.parent, manifest)


def discard_package(path: Path) -> None:
    """Removes a damaged package and those of its constants whose bytes no longer match their names (a compile
    stores a constant only where its file is missing)."""
    try:
        manifest = weight_store.read_manifest(path)
    except (OSError, zipfile.BadZipFile, StopIteration, ValueError):
        manifest = {}
    weight_store.discard_altered(path.parent, manifest)
    path.unlink(missing_ok=True)


class AheadOfTimeCompiled:
    """Stands in for torch.compile(function): the first call of each bucket (argument shapes and fixed
    values) loads its package, or exports, compiles and saves it when there is none."""

    def __init__(self, function, manager, options: dict, model_key: str, dynamic: DynamicSize | None = None):
        """model_key: model_digest(model, constants) of the model and constants every call passes. dynamic: a
        dimension one package covers at every size in its range (the rest of a bucket stays fixed)."""
        self.function, self.manager, self.options, self.model_key = function, manager, options, model_key
        self.dynamic = dynamic
        self.bucket = dynamic.bucket if dynamic else static_bucket
        self.folder = Path(cache_dir()) / PACKAGE_FOLDER
        self.packages: dict[tuple, object] = {}
        self.compiled: list[str] = []  # package files this object compiled; the rest it loaded
        self.loaded: list[str] = []
        # digest -> tensor of the constants the loaded packages point at (by pointer: this keeps them alive)
        self.bound_constants: dict[str, torch.Tensor] = {}
        self.export_traces = 0  # graphs Dynamo traced for export: the branches of torch.cond
        self._state, self._state_tensors = None, []  # the last state called with, flattened once

    def __call__(self, model, state: DecodeState, constants, *args):
        package = self.prepare(model, state, constants, *args)
        if state is not self._state:  # the runner passes the same captured state on every call
            self._state, self._state_tensors = state, state.tensors()
        return package(*self._state_tensors, *(arg for arg in args if isinstance(arg, torch.Tensor)))

    def prepare(self, model, state: DecodeState, constants, *args):
        """The loaded package for a call with these arguments: loaded, or compiled first when there is none."""
        bucket = self.bucket(args)
        package = self.packages.get(bucket)
        if package is None:
            package = self.packages[bucket] = self._package(model, state, constants, args)
        return package

    def package_path(self, state: DecodeState, args: tuple) -> Path:
        """Where the package for a call with these arguments is (or will be) kept."""
        bucket = self.bucket(args)
        options = self.options
        if state.seq_lens.device.type == "cpu":  # compiled attention calls the kernels where they build
            options = {**options, "decode_attention": cpu_kernels.expected()}  # named before they are built
        key = package_key(self.function, self.manager.uuid(), options, self.model_key, state, args, bucket)
        shape = "-".join(str(size) for size in torch.utils._pytree.tree_leaves(bucket))
        return self.folder / f"{self.function.__name__}-{shape}-{key[:24]}.pt2"

    def _package(self, model, state, constants, args):
        if state.seq_lens.device.type == "cpu":
            cpu_kernels.load()  # what the name expects; a failed build renames the package (expected() is False)
        path = self.package_path(state, args)
        if path.exists():
            self.loaded.append(path.name)
        else:
            self._compile(BucketProgram(self.function, model, state, constants, args), state, args, path)
            self.compiled.append(path.name)
        package = torch._inductor.aoti_load_package(str(path))
        manifest = weight_store.read_manifest(path)
        tensors = weight_store.load(self.folder, manifest, in_memory=_weights_by_digest.get(model, {}))
        # By the names the compiled code uses (load_constants takes original names, and those repeat).
        package.loader.update_constant_buffer(tensors, False, True, True)  # active buffer, all of them, by pointer
        self.bound_constants.update({manifest[name]: tensor for name, tensor in tensors.items()})
        return package

    def _compile(self, program: BucketProgram, state: DecodeState, args, path: Path) -> None:
        from .inductor_compile_time import probe_vector_isas_in_background

        probe_vector_isas_in_background()  # needed by lowering; the g++ checks run while export traces
        state_tensors = state.tensors()
        inputs = tuple(state_tensors) + tuple(arg for arg in args if isinstance(arg, torch.Tensor))
        traced_before = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            exported = torch.export.export(program, inputs, strict=False,
                                           dynamic_shapes=self._dynamic_shapes(len(state_tensors), args))
        self.export_traces += counters["stats"]["unique_graphs"] - traced_before
        # Lifted weights come first among the compiled graph's inputs (freezing then folds them away).
        weights = [spec.target for spec in exported.graph_signature.input_specs
                   if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER)]
        names = weights + [f"state.{name}" for name, _ in state.named_tensors()]
        names += [f"arg{i}" for i in range(len(inputs) - len(state_tensors))]
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")  # AOTInductor insists on .pt2
        options = {**self.options, **CONSTANTS_OUTSIDE, "post_grad_custom_post_pass": self.manager}
        module = exported.module(check_guards=False)
        _batched_weights_on_their_own_storage(module)
        with named_inputs(names), weight_store.left_out_of_the_library() as folded:
            files = torch._inductor.aot_compile(module, *exported.example_inputs, options=options)
        manifest = weight_store.store(self.folder, folded)
        with tempfile.TemporaryDirectory() as directory:
            # The loader needs the shared library and its metadata; the C++ sources would only add bytes.
            kept = [stripped(file, Path(directory)) if file.endswith(".so") else file
                    for file in files if not file.endswith(".cpp")]
            kept.append(str(weight_store.write_manifest(Path(directory), manifest)))
            package_aoti(str(partial), kept)
        os.replace(partial, path)  # atomic: a process that loads concurrently sees a whole package or none

    def _dynamic_shapes(self, state_count: int, args: tuple):
        """export's dynamic_shapes for BucketProgram(*state tensors, *tensor arguments), or None when all are static."""
        if self.dynamic is None or not self.dynamic.covers(args):
            return None
        shapes = [None] * state_count
        for index, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                dynamic = index == self.dynamic.arg
                shapes.append({self.dynamic.dim: torch.export.Dim(
                    f"arg{index}_dim{self.dynamic.dim}", min=self.dynamic.low, max=self.dynamic.high,
                )} if dynamic else None)
        return (tuple(shapes),)  # the program takes *tensors


def _batched_weights_on_their_own_storage(module: torch.nn.Module) -> None:
    """Gives each 3-D weight (an MoE's stacked experts) of the module to compile a copy at storage offset 0.

    The loader keeps the weights as views into one block (loading/huge_pages.py). Inductor's C++ BMM template
    (max-autotune CPP, the stacked experts' einsums) pre-packs a constant weight from W.as_strided(size, stride,
    offset) with the view's offset counted from W while as_strided counts from W's storage, so it packs the bytes
    at the start of the block, other weights (cpp_gemm_template.py, normalize_shapes, torch 2.13): GLM-4.5's `full`
    then differed from eager at the first token (tests/test_parity_matrix.py). 2-D weights were tested and are not
    affected. The copy lives while the package compiles; its digest (weight_store.digest) is the weight's, so the
    package's constant is bound back to the model's own memory at load."""
    with torch.no_grad():
        for submodule in module.modules():
            for tensors in (submodule._parameters, submodule._buffers):
                for name, tensor in tensors.items():
                    if tensor is not None and tensor.dim() >= 3 and tensor.storage_offset() != 0:
                        copy = tensor.detach().clone()
                        tensors[name] = (torch.nn.Parameter(copy, requires_grad=False)
                                         if isinstance(tensor, torch.nn.Parameter) else copy)


def stripped(library: str, directory: Path) -> str:
    """A copy of a shared library in `directory` without its symbol table and debug sections (what dlopen needs
    stays), a fraction of the library's size. The library itself where strip is missing."""
    if shutil.which("strip") is None:
        return library
    copy = directory / Path(library).name
    shutil.copyfile(library, copy)
    subprocess.run(["strip", "--strip-unneeded", str(copy)], check=True)
    return str(copy)


def package_key(function, passes_uuid: str, options: dict, model_key: str, state: DecodeState, args,
                bucket: tuple) -> str:
    """model_key: model_digest() of the model and constants the package is compiled over; bucket: the shapes (and
    ranges) and fixed values of the arguments the package takes."""
    digest = hashlib.sha256()

    def add(*values):
        for value in values:
            digest.update(repr(value).encode())
            digest.update(b"\0")

    add(torch.__version__, torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())
    add(code_digest(), function.__module__, function.__qualname__, inspect.getsource(inspect.getmodule(function)))
    add(passes_uuid, sorted(options.items()), model_key)
    add([(name, tensor.shape, tensor.dtype, tensor.device) for name, tensor in state.named_tensors()])
    add(bucket, [arg.dtype for arg in args if isinstance(arg, torch.Tensor)])
    return digest.hexdigest()


# model -> {digest: tensor} of its weights and step constants, recorded by model_digest: a package's constant with
# the same digest is bound to the model's own tensor instead of a second copy read from the disk.
_weights_by_digest: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_digest(model, constants) -> str:
    """The model's class, config and every weight's bytes, and the step constants: what freezing bakes in."""
    digest = hashlib.sha256(repr((type(model).__qualname__, getattr(model, "config", None))).encode())
    weights = {}
    for name, value in list(model.state_dict().items()) + list(constants._asdict().items()):
        digest.update(repr(name).encode() + b"\0")
        if isinstance(value, torch.Tensor):
            weights[key := weight_store.digest(value)] = value.detach()
            digest.update(key.encode())
        else:
            digest.update(repr(value).encode())
        digest.update(b"\0")
    _weights_by_digest[model] = weights
    return digest.hexdigest()


# Where the code that shapes compiled graphs starts: the model, the speculative step and state, HiSparse, the passes,
# and the compiler modules (compiler/) that build graphs, store their weights and install torch's patches.
# graph_code_files() adds what they import.
GRAPH_CODE = ("compiled_spec/model", "compiled_spec/speculative", "compiled_spec/hisparse", "compiled_spec/passes",
              "compiled_spec/compiler/step_runner.py", "compiled_spec/compiler/aot_packages.py",
              "compiled_spec/compiler/weight_store.py", "compiled_spec/compiler/torch_patches.py")
_PROJECT_PACKAGES = ("compiled_spec",)


def graph_code_files(root: Path = _PROJECT_ROOT) -> list[Path]:
    """The sources every package's key hashes: GRAPH_CODE, every module of this project they import (at any depth,
    with the packages around them), and the C++ sources beside those modules. Not the API, the engine's scheduling,
    the server, training, the CLI or the benchmarks: editing those keeps the compiled packages."""
    pending = [path for entry in GRAPH_CODE for path in
               ((root / entry).rglob("*.py") if (root / entry).is_dir() else [root / entry])]
    found: set[Path] = set()
    while pending:
        path = pending.pop()
        if path is None or path in found or not path.is_file():
            continue
        found.add(path)
        package = path.parent.relative_to(root).parts
        pending += [root.joinpath(*package[:depth], "__init__.py") for depth in range(1, len(package) + 1)]
        pending += [_module_file(root, name) for name in _imported_modules(path, package)]
    return sorted(found | {cpp for path in found for cpp in path.parent.glob("*.cpp")})


def _imported_modules(path: Path, package: tuple[str, ...]) -> list[str]:
    """Dotted names of this project's modules (or their attributes) that a source imports, at top level or inside
    a function."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] if node.level else ())
            module = ".".join(part for part in (base, node.module or "") if part)
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]  # an alias may be a module
    return [name for name in names if name.split(".")[0] in _PROJECT_PACKAGES]


def _module_file(root: Path, name: str) -> Path | None:
    folder = root.joinpath(*name.split("."))
    for path in (folder.with_suffix(".py"), folder / "__init__.py"):
        if path.is_file():
            return path
    return None


@functools.cache
def code_digest(root: Path = _PROJECT_ROOT) -> str:
    """sha256 of graph_code_files(root): their paths and text."""
    digest = hashlib.sha256()
    for source in graph_code_files(root):
        digest.update(str(source.relative_to(root)).encode() + source.read_bytes())
    return digest.hexdigest()

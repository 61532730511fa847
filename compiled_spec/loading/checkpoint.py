"""A Hugging Face checkpoint directory (config.json + safetensors) or a GGUF file -> CausalLM, without transformers'
model classes."""

from __future__ import annotations

import ctypes
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import ModelConfig
from ..errors import CompiledSpecError
from ..model import cpu_kernels
from ..model.causal_lm import CausalLM
from ..model.half_weight_linear import store_drafts_in_half
from ..model.layers import MoE
from .gguf_checkpoint import is_gguf, read_gguf
from .huge_pages import copies_on_huge_pages
from .quantized_weights import PackedMatrix, pack, use_packed_weights

QUANTIZE_TYPES = ("q8_0", "q4_0")  # quantize= at load, with the gguf package's quantizers


@dataclass(frozen=True)
class MtpLayout:
    """How one family of checkpoints stores MTP module j. `pattern` captures `index` (optional) and `rest`."""

    name: str
    pattern: re.Pattern
    renames: dict = field(default_factory=dict)
    ignored: tuple = ()
    hidden_first: bool = False
    index_counts_from_num_layers: bool = False


_DEEPSEEK_NAMES = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head.norm": "post_norm"}

MTP_LAYOUTS = (
    # DeepSeek-V3 / GLM-4.5: model.layers.{num_hidden_layers + j}.*
    MtpLayout(
        "deepseek-v3",
        re.compile(r"^model\.layers\.(?P<index>\d+)\.(?P<rest>.+)$"),
        _DEEPSEEK_NAMES,
        ignored=("shared_head.head.", "embed_tokens."),
        index_counts_from_num_layers=True,
    ),
    # MiMo: model.mtp_layers.{j}.*, hidden state first in the projection input.
    MtpLayout(
        "mimo",
        re.compile(r"^model\.mtp_layers\.(?P<index>\d+)\.(?P<rest>.+)$"),
        {"token_layernorm": "enorm", "hidden_layernorm": "hnorm", "input_proj": "eh_proj", "final_layernorm": "post_norm"},
        hidden_first=True,
    ),
    # DeepSeek-V4 style: mtp.{j}.* or model.mtp.{j}.*
    MtpLayout(
        "mtp-indexed",
        re.compile(r"^(?:model\.)?mtp\.(?P<index>\d+)\.(?P<rest>.+)$"),
        {**_DEEPSEEK_NAMES, "norm": "post_norm"},
        ignored=("shared_head.head.", "embed_tokens.", "head."),
    ),
    # Qwen3-Next / Mellum: one module, mtp.fc, mtp.pre_fc_norm_*, mtp.norm, block under mtp.layers.0.
    MtpLayout(
        "mtp-flat",
        re.compile(r"^(?:model\.)?mtp\.(?:layers\.(?P<index>\d+)\.)?(?P<rest>.+)$"),
        {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "norm": "post_norm"},
    ),
)

MAIN_KEY = re.compile(r"^(?:model\.)?(embed_tokens\..+|norm\..+|layers\.(?P<layer>\d+)\..+)$")
_EXPERT_KEY = re.compile(r"^(?P<prefix>.+\.mlp)\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not path.is_dir():
        raise CompiledSpecError(f"model path {str(path)!r} is not a directory")
    if not config_file.is_file():
        raise CompiledSpecError(f"no config.json in {str(path)!r}; a model directory needs config.json and *.safetensors")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise CompiledSpecError(f"config.json in {str(path)!r} is not valid JSON: {error}") from None


def checkpoint_dtype(path: Path) -> str | None:
    """The dtype config.json says the weights are in (dtype, or torch_dtype in older files), if any; None for
    GGUF files, whose tensors may each have their own type."""
    if is_gguf(path):
        return None
    raw = read_config(path)
    return raw.get("dtype") or raw.get("torch_dtype")


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = dict(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise CompiledSpecError(f"{index} is not a valid safetensors index: {error}") from None
        names = sorted({str(name) for name in weight_map.values()})
        outside = [name for name in names if not name or Path(name).is_absolute()
                   or ".." in Path(name).parts or "\\" in name]
        if outside:
            raise CompiledSpecError(f"{index.name} names shards outside the checkpoint folder: "
                                    f"{', '.join(map(repr, outside))}; allowed: file names relative to {str(path)!r}")
        files = [path / name for name in names]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise CompiledSpecError(f"shards named in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CompiledSpecError(f"no *.safetensors files in {str(path)!r}")
    return files


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    tensors[key] = handle.get_tensor(key)
        except Exception as error:  # safetensors raises several types for truncated or corrupt files
            raise CompiledSpecError(f"cannot read {file.name}: the safetensors file is truncated or corrupt ({error})") from None
    return tensors


def _stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert projections (as checkpoints store them) -> stacked gate_up [E, 2I, H] and down [E, H, I]."""
    grouped: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for key, tensor in state.items():
        match = _EXPERT_KEY.match(key)
        if match:
            grouped.setdefault(match["prefix"], {}).setdefault(int(match["expert"]), {})[match["proj"]] = tensor
        elif key.endswith(".mlp.experts.gate_up_proj"):
            out[key.replace(".experts.gate_up_proj", ".experts_gate_up")] = tensor
        elif key.endswith(".mlp.experts.down_proj"):
            out[key.replace(".experts.down_proj", ".experts_down")] = tensor
        else:
            out[key] = tensor
    for prefix, experts in grouped.items():
        ordered = [experts[index] for index in sorted(experts)]
        out[f"{prefix}.experts_gate_up"] = torch.stack([torch.cat([e["gate_proj"], e["up_proj"]]) for e in ordered])
        out[f"{prefix}.experts_down"] = torch.stack([e["down_proj"] for e in ordered])
    return out


def mtp_target(key: str, num_layers: int) -> tuple[MtpLayout, int, str] | None:
    """(layout, module index, our name under mtp.{index}.) for an MTP key, '' to ignore it; None if not MTP."""
    for layout in MTP_LAYOUTS:
        match = layout.pattern.match(key)
        if not match:
            continue
        index = int(match["index"] or 0)
        if layout.index_counts_from_num_layers:
            if index < num_layers:
                continue
            index -= num_layers
        rest = match["rest"]
        if any(rest.startswith(prefix) for prefix in layout.ignored):
            return layout, index, ""
        for source, target in layout.renames.items():
            if rest.startswith(source + "."):
                return layout, index, target + rest[len(source):]
        return layout, index, "block." + rest
    return None


def split_weights(tensors: dict[str, torch.Tensor], num_layers: int) -> tuple[dict, int, bool]:
    """Checkpoint keys -> (state dict in CausalLM names, number of MTP modules, hidden-first projection)."""
    state: dict[str, torch.Tensor] = {}
    layouts_seen: dict[str, MtpLayout] = {}
    for key, tensor in tensors.items():
        main = MAIN_KEY.match(key)
        if key == "lm_head.weight":
            state[key] = tensor
        elif main and (main["layer"] is None or int(main["layer"]) < num_layers):
            state[main.group(1)] = tensor
        else:
            target = mtp_target(key, num_layers)
            if target is None or not target[2]:
                continue
            layout, index, name = target
            layouts_seen[layout.name] = layout
            state[f"mtp.{index}.{name}"] = tensor
    if len(layouts_seen) > 1:
        names = ", ".join(sorted(layouts_seen))
        raise CompiledSpecError(f"checkpoint mixes MTP layouts ({names}); expected one")
    mtp_indices = {int(key.split(".")[1]) for key in state if key.startswith("mtp.")}
    num_mtp = 0
    while num_mtp in mtp_indices:
        num_mtp += 1
    state = {k: v for k, v in state.items() if not k.startswith("mtp.") or int(k.split(".")[1]) < num_mtp}
    hidden_first = any(layout.hidden_first for layout in layouts_seen.values())
    return _stack_experts(state), num_mtp, hidden_first


def read_checkpoint(path: Path, dequantize: bool = True) -> tuple[dict, dict]:
    """(config.json dict, tensors under Hugging Face names) of a checkpoint directory or a .gguf file; a GGUF's
    quantized matrices are PackedMatrix unless dequantize."""
    if is_gguf(path):
        return read_gguf(path, dequantize)
    return read_config(path), read_tensors(path)


DRAFT_VOCAB_RANKING = "d2t"  # as EAGLE-3 names it: token ids, the most often drafted first
MTP_CONFIG_NAME = "mtp_config.json"
MTP_WEIGHTS_NAME = "mtp.safetensors"  # as train-mtp writes it; any *.safetensors in the directory is read


def read_mtp_directory(path: Path, num_layers: int) -> tuple[dict, int, bool, torch.Tensor | None]:
    """MTP modules stored apart from their base model (safetensors in any MTP layout): split_weights' result and
    the draft-vocabulary ranking when the directory has one."""
    if not path.is_dir():
        raise CompiledSpecError(f"MTP directory {str(path)!r} is not a directory")
    tensors = read_tensors(path)
    ranking = tensors.pop(DRAFT_VOCAB_RANKING, None)
    state, num_mtp, hidden_first = split_weights(tensors, num_layers)
    other = sorted(key for key in state if not key.startswith("mtp."))
    if other:
        raise CompiledSpecError(f"{str(path)!r} holds weights that are not MTP modules (e.g. {other[0]}); an MTP "
                                "directory holds only MTP modules")
    if num_mtp == 0:
        raise CompiledSpecError(f"no MTP modules in {str(path)!r}; expected keys like mtp.0.eh_proj.weight")
    return state, num_mtp, hidden_first, None if ranking is None else ranking.long()


def trained_draft_vocab_size(path: Path) -> int | None:
    """The draft vocabulary size the modules in `path` were trained with (mtp_config.json), if it says."""
    config_file = path / MTP_CONFIG_NAME
    if not config_file.is_file():
        return None
    return json.loads(config_file.read_text()).get("draft_vocab_size")


def draft_vocabulary(ranking: torch.Tensor | None, size: int | None, default_size: int | None,
                     vocab_size: int) -> torch.Tensor | None:
    """Token ids the drafts are sampled over (sorted), or None for the whole vocabulary.

    size: how many of the ranked tokens; None means the size the modules were trained with, and any size of at
    least vocab_size the whole vocabulary."""
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise CompiledSpecError(f"draft_vocab_size={size!r} is out of range; allowed 1..{vocab_size} "
                                "(the vocabulary size: the full head)", param="draft_vocab_size")
    size = default_size if size is None else size
    if size is None or size >= vocab_size:
        return None
    if ranking is None:
        raise CompiledSpecError(f"draft_vocab_size={size} needs MTP modules that ship a ranked draft vocabulary "
                                f"({DRAFT_VOCAB_RANKING!r}, as compiled-spec train-mtp writes); these have none",
                                param="draft_vocab_size")
    if ranking.shape != (vocab_size,) or not torch.equal(ranking.sort().values, torch.arange(vocab_size)):
        raise CompiledSpecError(f"the draft vocabulary ranking ({DRAFT_VOCAB_RANKING!r}) must list each of the "
                                f"{vocab_size} token ids once", param="draft_vocab_size")
    return ranking[:size].sort().values


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
               mtp: str | Path | None = None, draft_vocab_size: int | None = None,
               draft_dtype: torch.dtype | None = None, dequantize: bool = False,
               quantize: str | None = None) -> CausalLM:
    """The model at `path`; with `mtp`, the MTP modules come from that directory instead of the checkpoint.

    draft_vocab_size: drafts sample over that many of the MTP directory's ranked tokens (see draft_vocabulary).
    draft_dtype: torch.float16 stores the drafts' weights in float16 (model/half_weight_linear.py); None, in dtype.
    dequantize: a GGUF's quantized matrices are widened to dtype instead of kept packed (model/packed_linear.py).
    quantize: "q8_0" or "q4_0": a float checkpoint's main-model matrices are quantized to that GGUF type and kept
    packed, as if a GGUF file had stored them so (quantize_matrices)."""
    path = Path(path)
    quantize = quantize_type(quantize, dequantize)
    raw_config, tensors = read_checkpoint(path, dequantize)
    config = ModelConfig.from_hf(raw_config)
    state, num_mtp, hidden_first = split_weights(tensors, config.num_hidden_layers)
    ranking, trained_size = None, None
    if mtp is not None:
        mtp_state, num_mtp, hidden_first, ranking = read_mtp_directory(Path(mtp), config.num_hidden_layers)
        trained_size = trained_draft_vocab_size(Path(mtp))
        state = {**{k: v for k, v in state.items() if not k.startswith("mtp.")}, **mtp_state}
    draft_vocab = draft_vocabulary(ranking, draft_vocab_size, trained_size, config.vocab_size)
    config.num_mtp_modules = num_mtp
    with torch.device("meta"):
        model = CausalLM(config, mtp_hidden_first=hidden_first)
        half_drafts = draft_dtype == torch.float16 and dtype != torch.float16
        if half_drafts:
            store_drafts_in_half(model)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CompiledSpecError(f"checkpoint in {str(path)!r} is missing weights: {shown}")
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise CompiledSpecError(
                f"checkpoint tensor {name} has shape {tuple(state[name].shape)}, config.json implies {tuple(tensor.shape)}"
            )
    if quantize is not None:
        state = quantize_matrices(model, state, quantize, path)
    packed = any(isinstance(tensor, PackedMatrix) for tensor in state.values())
    if packed:
        state = use_packed_weights(model, state)
        expected = model.state_dict()
    keep_fp32 = ("e_score_correction_bias", "gate.weight", ".scales", ".mins")
    half_scales = (".scales", ".mins")  # a packed matrix's, where float16 holds them exactly (loading/quantized_weights.py)
    loaded = {
        name: state[name].to(device=device, dtype=torch.float16 if name.endswith(half_scales) and
                             tensor.dtype == torch.float16 else torch.float32 if name.endswith(keep_fp32) else
                             tensor.dtype if tensor.dtype in (torch.float16, torch.uint8, torch.int8) else dtype)
        for name, tensor in expected.items()
    }
    if packed and torch.device(device).type == "cpu":
        cpu_kernels.load_if_built()  # the kernel multiplies packed weights in eager passes too, once built
    if torch.device(device).type == "cpu":
        loaded = on_huge_pages(loaded)
    model.load_state_dict(loaded, assign=True, strict=True)
    del state, tensors, loaded
    if draft_vocab is not None:
        model.use_draft_vocab(draft_vocab.to(device), torch.float16 if half_drafts else None)
    if torch.device(device).type == "cpu":
        release_freed_memory()  # after the draft head too: it widens its rows of a packed head, 19 MB for SmolLM2
    return model.eval().requires_grad_(False)


def quantize_type(quantize: str | None, dequantize: bool) -> str | None:
    """quantize= checked: None, or the GGUF type name ("Q8_0", "Q4_0")."""
    if quantize is None:
        return None
    if not isinstance(quantize, str) or quantize.lower() not in QUANTIZE_TYPES:
        raise CompiledSpecError(f"quantize={quantize!r} is not a type weights can be quantized to at load; allowed: "
                                f"{', '.join(QUANTIZE_TYPES)}", param="quantize")
    if dequantize:
        raise CompiledSpecError(f"quantize={quantize!r} with dequantize=True: one quantizes float weights, the other "
                                "widens quantized ones; choose one", param="quantize")
    return quantize.upper()


def quantize_matrices(model: CausalLM, state: dict, type_name: str, path: Path) -> dict:
    """`state` with the main model's linear weights, its embedding and untied head (as a GGUF file has them) quantized
    to GGUF `type_name` blocks by the gguf package, then packed as a GGUF file's blocks are. MTP modules, the MoE
    router, stacked experts and matrices whose rows are not whole 32-value blocks stay float."""
    from gguf import GGMLQuantizationType, quants

    already = sorted({tensor.format for tensor in state.values() if isinstance(tensor, PackedMatrix)})
    if already:
        raise CompiledSpecError(f"{path.name} is already quantized ({'+'.join(already)}); quantize= applies to float "
                                "checkpoints (safetensors, or a GGUF of F32/F16/BF16 tensors)", param="quantize")
    modules = dict(model.named_modules())
    out = dict(state)
    for name, tensor in state.items():
        prefix = name.removesuffix(".weight")
        if name.startswith("mtp.") or prefix == name or tensor.dim() != 2 or tensor.shape[1] % 32:
            continue
        parent, _, child = prefix.rpartition(".")
        if type(modules.get(prefix)) not in (torch.nn.Linear, torch.nn.Embedding) or \
                (child == "gate" and isinstance(modules[parent], MoE)):
            continue  # not a module of this model (an untied head's copy in a tied one), or the MoE router
        blocks = quants.quantize(tensor.float().numpy(), getattr(GGMLQuantizationType, type_name))
        out[name] = pack(blocks, type_name)
    return out


def release_freed_memory() -> None:
    """Hands the heap the load freed (repack and dtype-cast temporaries) back to the system: glibc keeps it
    otherwise, and a packed model's resident memory would count it."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def on_huge_pages(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors copied into one block of huge pages; a tensor under two names (tied) stays one tensor."""
    unique = list({id(tensor): tensor for tensor in tensors.values()}.values())
    copies = {id(tensor): copy for tensor, copy in zip(unique, copies_on_huge_pages(unique))}
    return {name: copies[id(tensor)] for name, tensor in tensors.items()}

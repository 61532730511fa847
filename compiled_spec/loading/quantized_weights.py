"""GGUF's quantized blocks -> the packed layouts of model/packed_linear.py, once, at load.

Exact: each weight as packed_linear's dequantize_rows widens it equals gguf's dequantize bitwise (the scales and mins
are computed in float32 as gguf-py computes them, and scale * q is exact in float32 for these types, so a fused
multiply-add rounds as gguf's multiply-then-add does). Scales and mins are kept in float16 where every one of a
matrix's converts exactly (Q4_0, Q4_1 and Q8_0 store float16), else in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..model.packed_linear import PackedEmbedding, PackedLinear

PACKED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")


@dataclass
class PackedMatrix:
    """A [rows, columns] weight in packed_linear's layout; `format` is the GGUF type it came from."""

    format: str
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        rows, width = self.qweight.shape
        return rows, width * 2 if self.four_bit else width

    @property
    def four_bit(self) -> bool:
        return self.qweight.dtype == torch.uint8

    @property
    def group(self) -> int:
        return self.shape[1] // self.scales.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts().values())

    def parts(self) -> dict[str, torch.Tensor]:
        parts = {"qweight": self.qweight, "scales": self.scales}
        return parts if self.mins is None else {**parts, "mins": self.mins}

    def map_rows(self, fn) -> "PackedMatrix":
        """The same matrix with fn (a permutation of rows) applied to every part."""
        return PackedMatrix(self.format, *(None if part is None else fn(part) for part in
                                           (self.qweight, self.scales, self.mins)))

    def module(self, embedding: bool = False, bias: torch.Tensor | None = None) -> PackedLinear:
        """An empty (meta-device when made under torch.device("meta")) module this matrix's parts load into."""
        cls = PackedEmbedding if embedding else PackedLinear
        return cls(*self.shape, self.format, self.four_bit, self.group, bias, self.scales.dtype)


def _half(data: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(data).view(np.float16).astype(np.float32)[..., 0]


def _paired(blocks: np.ndarray) -> np.ndarray:
    """4-bit blocks [rows, B, 16] (byte j: value j low, value j + 16 high) -> packed_linear's bytes [rows, B * 16]:
    each pair of blocks interleaved byte by byte, a row's odd last block as it is."""
    rows, count = blocks.shape[:2]
    pairs = blocks[:, :count - count % 2].reshape(rows, -1, 2, 16).transpose(0, 1, 3, 2).reshape(rows, -1)
    return np.concatenate([pairs, blocks[:, count - count % 2:].reshape(rows, -1)], axis=1)


def _nibbles(values: np.ndarray) -> np.ndarray:
    """4-bit values [rows, K] (uint8) -> packed_linear's bytes [rows, K/2]."""
    blocks = values.reshape(values.shape[0], -1, 2, 16)
    return _paired(blocks[:, :, 0] | (blocks[:, :, 1] << np.uint8(4)))


def _compact(*parts: np.ndarray) -> list[np.ndarray]:
    """float32 scales (and mins) -> float16 where all convert exactly: fewer bytes for the kernel to stream."""
    halves = [part.astype(np.float16) for part in parts]
    exact = all(np.array_equal(half.astype(np.float32), part) for half, part in zip(halves, parts))
    return halves if exact else list(parts)


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array, copy=True, order="C"))  # owns its memory: the file's map can close


def pack(data: np.ndarray, type_name: str) -> PackedMatrix:
    """A GGUF tensor's raw blocks [rows, bytes per row] (uint8) -> PackedMatrix."""
    from gguf import QK_K, Q4_K

    rows = data.shape[0]
    if type_name in ("Q4_0", "Q4_1"):
        header = 2 if type_name == "Q4_0" else 4
        blocks = data.reshape(rows, -1, header + 16)
        scales = _half(blocks[..., 0:2])
        mins = -8 * scales if type_name == "Q4_0" else _half(blocks[..., 2:4])
        scales, mins = _compact(scales, mins)
        return PackedMatrix(type_name, _tensor(_paired(blocks[..., header:])), _tensor(scales), _tensor(mins))
    if type_name == "Q8_0":
        blocks = data.reshape(rows, -1, 34)
        scales, = _compact(_half(blocks[..., 0:2]))
        return PackedMatrix(type_name, _tensor(blocks[..., 2:].reshape(rows, -1).view(np.int8)), _tensor(scales), None)
    if type_name == "Q4_K":
        blocks = data.reshape(-1, 144)
        d, dmin = _half(blocks[:, 0:2])[:, None], _half(blocks[:, 2:4])[:, None]
        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
        scales = (d * sc.astype(np.float32)).reshape(rows, -1)
        mins = -(dmin * m.astype(np.float32)).reshape(rows, -1)
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        values = (qs & np.uint8(15)).reshape(rows, -1)  # sub-block 2c: chunk c's low nibbles, 2c + 1: its high
        scales, mins = _compact(scales, mins)
        return PackedMatrix(type_name, _tensor(_nibbles(values)), _tensor(scales), _tensor(mins))
    if type_name == "Q6_K":
        blocks = data.reshape(-1, 210)
        ql, qh = blocks[:, :QK_K // 2], blocks[:, QK_K // 2:QK_K // 2 + QK_K // 4]
        sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
        scales = (_half(blocks[:, 208:210])[:, None] * sc).reshape(rows, -1)
        ql = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)
        qh = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
        values = (ql.reshape(-1, 8, 32) | (qh.reshape(-1, 8, 32) << np.uint8(4))).astype(np.int8) - np.int8(32)
        scales, = _compact(scales)
        return PackedMatrix(type_name, _tensor(values.reshape(rows, -1)), _tensor(scales), None)
    raise ValueError(f"no packed layout for {type_name}")


def use_packed_weights(model, state: dict) -> dict:
    """Swaps each module whose weight is a PackedMatrix in `state` for a packed one (meta, to be loaded); returns
    the state with each such weight split into its parts under the module's buffer names."""
    out = {}
    for name, tensor in state.items():
        if not isinstance(tensor, PackedMatrix):
            out[name] = tensor
            continue
        prefix = name.removesuffix(".weight")
        parent_name, _, child = prefix.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        with torch.device("meta"):
            setattr(parent, child, tensor.module(embedding=isinstance(old, torch.nn.Embedding),
                                                 bias=getattr(old, "bias", None)))
        out.update({f"{prefix}.{part}": value for part, value in tensor.parts().items()})
    return out

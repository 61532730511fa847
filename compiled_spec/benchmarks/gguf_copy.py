"""A GGUF file rewritten with its tensors in another type, written once beside the original with the gguf package
(every metadata field copied): F32 (what a float engine computes in), or Q8_0 / Q4_0 requantized from the
dequantized values. Tensors a quantized type cannot hold (1-D norms, rows not a multiple of the block) stay F32,
as llama.cpp's own quantizer leaves them.

    python -m compiled_spec.benchmarks.gguf_copy ~/.cache/compiled_spec/models/smollm2-135m/*.gguf --type Q8_0
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

FILE_TYPES = {"F32": 0, "Q4_0": 2, "Q8_0": 7}  # general.file_type (llama.cpp's LLAMA_FTYPE_ALL_F32, MOSTLY_...)


def gguf_copy(path: Path, type_name: str) -> Path:
    """`path` with its tensors in `type_name` (F32, Q8_0 or Q4_0), at NAME.TYPE.gguf beside it (kept once made)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, dequantize
    from gguf.quants import quantize

    if type_name not in FILE_TYPES:
        raise ValueError(f"type {type_name!r} is not supported; choose one of {', '.join(FILE_TYPES)}")
    target = path.with_name(f"{path.stem}.{type_name}.gguf")
    if target.is_file():
        return target
    quant_type = GGMLQuantizationType[type_name]
    block = GGML_QUANT_SIZES[quant_type][0]
    reader = GGUFReader(str(path))
    architecture = reader.fields["general.architecture"].contents()
    partial = target.with_suffix(".partial")
    writer = GGUFWriter(str(partial), architecture)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by the writer itself
        value = FILE_TYPES[type_name] if name == "general.file_type" else field.contents()
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_key_value(name, value, kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, value, kind)
    if "general.file_type" not in reader.fields:
        writer.add_file_type(FILE_TYPES[type_name])
    for tensor in reader.tensors:
        values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if quant_type != GGMLQuantizationType.F32 and values.ndim == 2 and values.shape[-1] % block == 0:
            writer.add_tensor(tensor.name, quantize(values, quant_type), raw_dtype=quant_type)
        else:
            writer.add_tensor(tensor.name, values, raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, target)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--type", default="Q8_0", choices=sorted(FILE_TYPES))
    arguments = parser.parse_args(argv)
    print(gguf_copy(arguments.gguf, arguments.type))


if __name__ == "__main__":
    main()

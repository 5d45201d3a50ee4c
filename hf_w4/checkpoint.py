"""What the checkpoint files hold, read from their safetensors headers (no tensor data is read).

Used before loading to declare exactly the tensors that exist (bias, g_idx, input_scale, ...) and to
turn every mismatch between config and files into an error that names module, tensor, found and expected
— instead of letting transformers fill a missing tensor with ``torch.empty_like`` garbage.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Dict, Iterable, Optional

import torch

# safetensors dtype names -> torch dtypes
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class CheckpointError(ValueError):
    """The checkpoint files do not hold what the config says."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: Optional[torch.dtype]
    dtype_name: str
    shape: tuple
    file: str


def read_header(path: str) -> Dict[str, TensorInfo]:
    """Header of one .safetensors file; raises CheckpointError for a truncated or corrupt file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise CheckpointError(f"{path}: truncated safetensors file: header declares {n} bytes, file has {size}")
        try:
            meta = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
    out, end = {}, 0
    for name, d in meta.items():
        if name == "__metadata__":
            continue
        try:
            b, e = d["data_offsets"]
            out[name] = TensorInfo(DTYPES.get(d["dtype"]), d["dtype"], tuple(d["shape"]), path)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {name!r}: {d}") from None
        end = max(end, e)
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated safetensors file: header declares {8 + n + end} bytes of data, "
                              f"file has {size}")
    return out


def read_headers(files: Iterable[str]) -> Dict[str, TensorInfo]:
    out: Dict[str, TensorInfo] = {}
    for f in files or ():
        if str(f).endswith(".safetensors"):
            out.update(read_header(str(f)))
    return out


def module_tensors(headers: Dict[str, TensorInfo], module: str) -> Dict[str, TensorInfo]:
    """Tensors stored directly under ``module.`` (not deeper)."""
    p = module + "."
    return {k[len(p):]: v for k, v in headers.items() if k.startswith(p) and "." not in k[len(p):]}

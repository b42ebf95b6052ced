"""Zero-copy reading of safetensors files: `SafetensorsFile` (one file), `SafetensorsCheckpoint` (single or sharded by
`model.safetensors.index.json`) and `CheckpointError`. Tensors are numpy views over an mmap of the file, so reading
one tensor touches only its bytes; bf16 and fp8 (e4m3, e5m2) come back as their `ml_dtypes` types."""
from __future__ import annotations

import json
import mmap
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed or does not match the model; the message names the tensor."""


class SafetensorsFile:
    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            try:
                self.header = json.loads(f.read(n))
            except (ValueError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.path.getsize(path) > 8 + n else b""
        self.header.pop("__metadata__", None)
        self._data_start = 8 + n

    def keys(self):
        return self.header.keys()

    def dtype_name(self, name: str) -> str:
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"tensor {name!r} in {self.path}: dtype {info['dtype']} cannot be cast "
                                  f"(supported: {', '.join(_DTYPES)})")
        begin, end = info["data_offsets"]
        count = int(np.prod(info["shape"], dtype=np.int64))
        if end - begin != count * np.dtype(dtype).itemsize or self._data_start + end > len(self._mm):
            raise CheckpointError(f"tensor {name!r} in {self.path}: data size does not match shape "
                                  f"{info['shape']} and dtype {info['dtype']} (file truncated?)")
        arr = np.frombuffer(self._mm, dtype=dtype, count=count, offset=self._data_start + begin)
        return arr.reshape(info["shape"])


class SafetensorsCheckpoint:
    """All tensors of an HF model directory, by name, across one or many files."""

    def __init__(self, model_dir: str):
        index = os.path.join(model_dir, "model.safetensors.index.json")
        single = os.path.join(model_dir, "model.safetensors")
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            for name, fname in weight_map.items():
                if fname not in self._files:
                    p = os.path.join(model_dir, fname)
                    if not os.path.exists(p):
                        raise CheckpointError(f"index names shard {fname!r} (for tensor {name!r}) but {p} is missing")
                    self._files[fname] = SafetensorsFile(p)
                if name not in self._files[fname].header:
                    raise CheckpointError(f"index maps tensor {name!r} to {fname!r}, which does not contain it")
                self._where[name] = fname
        elif os.path.exists(single):
            self._files["model.safetensors"] = SafetensorsFile(single)
            self._where = {k: "model.safetensors" for k in self._files["model.safetensors"].keys()}
        else:
            raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {model_dir!r}")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files[self._where[name]].shape(name)

    def dtype_name(self, name: str) -> str:
        """The safetensors dtype of a tensor as stored ("BF16", "F8_E4M3", ...)."""
        return self._files[self._where[name]].dtype_name(name)

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
        return self._files[self._where[name]].get(name)

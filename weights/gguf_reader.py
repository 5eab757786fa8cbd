"""A GGUF file's metadata and tensor table, read straight into Python values; the tensors as views of one memory map.

`gguf`'s GGUFReader makes a numpy view for every element of every metadata array: a 262,144-token vocabulary
(Gemma 3) is three such arrays, and opening the file took 10-40 s on these machines, at every start. Here a
string array is one pass of `struct` over the bytes and a numeric array one `numpy.frombuffer`. The tensors
are what GGUFReader gives (name, type, shape fastest axis first, data shaped as it shapes it), so `gguf`'s
dequantization reads them unchanged.

The format (v2, v3; little-endian): magic "GGUF", version u32, tensor count u64, metadata count u64; each
metadata entry a key string, a value type u32 and the value; each tensor a name, n_dims u32, dims u64 each,
type u32, offset u64 from the data section, which starts at the next multiple of `general.alignment` (32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
STRING, ARRAY = 8, 9
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
ELEMENTS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
            7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
         GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
         GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}


class GGUFFormatError(ValueError):
    """Bytes that are not a GGUF file this reader understands; the message says where."""


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # dims, fastest axis first (as GGUF lists them)
    data: np.ndarray  # a view of the file: float types by element, block types as bytes per row


class Reader:
    """fields: metadata key -> Python value (arrays as lists); tensors: in file order."""

    def __init__(self, path: str | Path):
        self.data = np.memmap(path, mode="r")
        self.buffer = memoryview(self.data)
        self.offset = 0
        if bytes(self.buffer[:4]) != MAGIC:
            raise GGUFFormatError(f"{Path(path).name}: not a GGUF file (no GGUF magic)")
        self.offset = 4
        version, tensor_count, field_count = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version not in (2, 3):
            raise GGUFFormatError(f"{Path(path).name}: GGUF version {version} is not read (2 and 3 are)")
        self.fields: dict[str, Any] = {}
        for _ in range(field_count):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        table = [(self._string(), [self._unpack("<Q") for _ in range(self._unpack("<I"))], self._unpack("<I"),
                  self._unpack("<Q")) for _ in range(tensor_count)]
        alignment = int(self.fields.get("general.alignment", 32))
        start = -(-self.offset // alignment) * alignment
        self.tensors = [self._tensor(name, dims, kind, start + at) for name, dims, kind, at in table]

    def _unpack(self, form: str):
        (value,) = struct.unpack_from(form, self.buffer, self.offset)
        self.offset += struct.calcsize(form)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        text = bytes(self.buffer[self.offset:self.offset + length]).decode("utf-8", errors="replace")
        self.offset += length
        return text

    def _value(self, kind: int):
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            item, count = self._unpack("<I"), self._unpack("<Q")
            if item == STRING:
                return [self._string() for _ in range(count)]
            if item in ELEMENTS:
                dtype = np.dtype(ELEMENTS[item])
                values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.offset)
                self.offset += count * dtype.itemsize
                return values.tolist()
            return [self._value(item) for _ in range(count)]  # arrays of arrays
        if kind not in SCALARS:
            raise GGUFFormatError(f"metadata value type {kind} at byte {self.offset} is not a GGUF type")
        return self._unpack(SCALARS[kind])

    def _tensor(self, name: str, dims: list[int], kind: int, at: int) -> Tensor:
        qtype = GGMLQuantizationType(kind)
        elements = int(np.prod(dims))
        shape = tuple(reversed(dims))
        if qtype in PLAIN:
            data = np.frombuffer(self.buffer, dtype=PLAIN[qtype], count=elements, offset=at).reshape(shape)
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            data = np.frombuffer(self.buffer, dtype=np.uint8, count=elements * size // block, offset=at)
            data = data.reshape(quant_shape_to_byte_shape(shape, qtype))
        return Tensor(name, qtype, np.array(dims, dtype=np.uint64), data)

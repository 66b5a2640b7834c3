"""Independent, minimal GGUF (v2/v3) reader for the float64 reference.

Deliberately shares no code with cleave: numpy + struct only. Tensors are
dequantised exactly to float64 (every F16/BF16/Q8_0 value is representable in
float64, so no rounding happens here).
"""

import struct

import numpy as np

# GGUF metadata value types.
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32 = 0, 1, 2, 3, 4, 5
T_FLOAT32, T_BOOL, T_STRING, T_ARRAY = 6, 7, 8, 9
T_UINT64, T_INT64, T_FLOAT64 = 10, 11, 12

_SCALAR_FMT = {
    T_UINT8: "<B", T_INT8: "<b", T_UINT16: "<H", T_INT16: "<h",
    T_UINT32: "<I", T_INT32: "<i", T_FLOAT32: "<f", T_BOOL: "<?",
    T_UINT64: "<Q", T_INT64: "<q", T_FLOAT64: "<d",
}
_SCALAR_NP = {
    T_UINT8: "<u1", T_INT8: "<i1", T_UINT16: "<u2", T_INT16: "<i2",
    T_UINT32: "<u4", T_INT32: "<i4", T_FLOAT32: "<f4", T_BOOL: "<u1",
    T_UINT64: "<u8", T_INT64: "<i8", T_FLOAT64: "<f8",
}

# ggml tensor types this reader understands.
GGML_F32, GGML_F16, GGML_Q8_0, GGML_BF16 = 0, 1, 8, 30
GGML_TYPE_NAMES = {GGML_F32: "F32", GGML_F16: "F16", GGML_Q8_0: "Q8_0", GGML_BF16: "BF16"}
QK8_0 = 32


class GGUFError(Exception):
    pass


class _Cursor:
    def __init__(self, buf):
        self.buf = buf
        self.pos = 0

    def take(self, n):
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(f"truncated file: need {n} bytes at offset {self.pos}, "
                            f"file has {len(self.buf)}")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def unpack(self, fmt):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self):
        n = self.unpack("<Q")
        return bytes(self.take(n)).decode("utf-8", errors="replace")


def _read_value(cur, vtype):
    if vtype in _SCALAR_FMT:
        return cur.unpack(_SCALAR_FMT[vtype])
    if vtype == T_STRING:
        return cur.string()
    if vtype == T_ARRAY:
        etype = cur.unpack("<I")
        n = cur.unpack("<Q")
        if etype in _SCALAR_NP:
            dt = np.dtype(_SCALAR_NP[etype])
            return np.frombuffer(cur.take(n * dt.itemsize), dtype=dt).copy()
        return [_read_value(cur, etype) for _ in range(n)]
    raise GGUFError(f"unknown metadata value type {vtype}")


class TensorInfo:
    def __init__(self, name, ne, ggml_type, offset):
        self.name = name
        self.ne = ne            # innermost first, as stored
        self.ggml_type = ggml_type
        self.offset = offset    # relative to the data section

    @property
    def shape(self):
        """Row-major numpy shape (reverse of ne)."""
        return tuple(reversed(self.ne))

    @property
    def n_elements(self):
        n = 1
        for d in self.ne:
            n *= d
        return n

    def nbytes(self):
        n = self.n_elements
        if self.ggml_type == GGML_F32:
            return 4 * n
        if self.ggml_type in (GGML_F16, GGML_BF16):
            return 2 * n
        if self.ggml_type == GGML_Q8_0:
            if self.ne[0] % QK8_0:
                raise GGUFError(f"{self.name}: Q8_0 row length {self.ne[0]} not a multiple of 32")
            return n // QK8_0 * (2 + QK8_0)
        raise GGUFError(f"{self.name}: unsupported ggml type {self.ggml_type}")


class GGUFFile:
    def __init__(self, path):
        with open(path, "rb") as f:
            self.buf = memoryview(f.read())
        cur = _Cursor(self.buf)
        if bytes(cur.take(4)) != b"GGUF":
            raise GGUFError(f"{path}: bad magic")
        self.version = cur.unpack("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{path}: unsupported GGUF version {self.version}")
        n_tensors = cur.unpack("<Q")
        n_kv = cur.unpack("<Q")
        self.kv = {}
        for _ in range(n_kv):
            key = cur.string()
            vtype = cur.unpack("<I")
            self.kv[key] = _read_value(cur, vtype)
        self.tensors = {}
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            if n_dims > 4:
                raise GGUFError(f"{name}: n_dims {n_dims} > 4")
            ne = [cur.unpack("<Q") for _ in range(n_dims)]
            ggml_type = cur.unpack("<I")
            offset = cur.unpack("<Q")
            if name in self.tensors:
                raise GGUFError(f"duplicate tensor {name}")
            self.tensors[name] = TensorInfo(name, ne, ggml_type, offset)
        self.alignment = int(self.kv.get("general.alignment", 32))
        if self.alignment <= 0:
            raise GGUFError(f"bad general.alignment {self.alignment}")
        a = self.alignment
        self.data_start = (cur.pos + a - 1) // a * a
        for t in self.tensors.values():
            if t.offset % a:
                raise GGUFError(f"{t.name}: offset {t.offset} not aligned to {a}")
            end = self.data_start + t.offset + t.nbytes()
            if end > len(self.buf):
                raise GGUFError(f"{t.name}: data [{self.data_start + t.offset}, {end}) past end "
                                f"of file ({len(self.buf)} bytes)")

    def has(self, name):
        return name in self.tensors

    def raw(self, name):
        t = self.tensors[name]
        s = self.data_start + t.offset
        return self.buf[s:s + t.nbytes()]

    def tensor(self, name):
        """Dequantised float64 numpy array with the row-major shape."""
        if name not in self.tensors:
            raise GGUFError(f"missing tensor {name}")
        t = self.tensors[name]
        raw = self.raw(name)
        if t.ggml_type == GGML_F32:
            a = np.frombuffer(raw, dtype="<f4").astype(np.float64)
        elif t.ggml_type == GGML_F16:
            a = np.frombuffer(raw, dtype="<f2").astype(np.float64)
        elif t.ggml_type == GGML_BF16:
            u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            a = u.view(np.float32).astype(np.float64)
        elif t.ggml_type == GGML_Q8_0:
            blocks = np.frombuffer(raw, dtype=np.dtype([("d", "<f2"), ("q", "i1", (QK8_0,))]))
            a = (blocks["d"].astype(np.float64)[:, None] * blocks["q"].astype(np.float64)).reshape(-1)
        else:
            raise GGUFError(f"{name}: unsupported ggml type {t.ggml_type}")
        return a.reshape(t.shape)

    def type_name(self, name):
        t = self.tensors[name].ggml_type
        return GGML_TYPE_NAMES.get(t, str(t))

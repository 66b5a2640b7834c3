#!/usr/bin/env python3
"""Writes tokenizer.chat_template into GGUF files in place (replacing one
that is there): the shapes model carries its own template, which cleave
recognises by its text (server/chat_template.h, kShapesChatTemplateJinja).

  set_chat_template.py TEMPLATE_FILE MODEL.gguf...
"""
import struct
import sys

KEY = b"tokenizer.chat_template"
GGUF_STRING = 8
SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def read_value(buf, off, vtype):
    if vtype == GGUF_STRING:
        (n,) = struct.unpack_from("<Q", buf, off)
        return off + 8 + n
    if vtype == 9:  # array
        etype, count = struct.unpack_from("<IQ", buf, off)
        off += 12
        for _ in range(count):
            off = read_value(buf, off, etype)
        return off
    return off + SIZES[vtype]


def patch(path, template):
    buf = open(path, "rb").read()
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    assert magic == b"GGUF" and version == 3, f"{path}: not GGUF v3"
    off = 24
    kvs, alignment = [], 32
    for _ in range(n_kv):
        start = off
        (klen,) = struct.unpack_from("<Q", buf, off)
        key = buf[off + 8:off + 8 + klen]
        (vtype,) = struct.unpack_from("<I", buf, off + 8 + klen)
        off = read_value(buf, off + 12 + klen, vtype)
        if key == b"general.alignment":
            (alignment,) = struct.unpack_from("<I", buf, off - 4)
        if key != KEY:
            kvs.append(buf[start:off])
    tensors_start = off
    for _ in range(n_tensors):
        (nlen,) = struct.unpack_from("<Q", buf, off)
        off += 8 + nlen
        (ndims,) = struct.unpack_from("<I", buf, off)
        off += 4 + 8 * ndims + 4 + 8
    tensor_infos = buf[tensors_start:off]
    data_start = (off + alignment - 1) // alignment * alignment
    data = buf[data_start:]
    t = template.encode()
    kvs.append(struct.pack("<Q", len(KEY)) + KEY + struct.pack("<IQ", GGUF_STRING, len(t)) + t)
    head = struct.pack("<4sIQQ", b"GGUF", 3, n_tensors, len(kvs)) + b"".join(kvs) + tensor_infos
    pad = (-len(head)) % alignment
    open(path + ".tmp", "wb").write(head + b"\0" * pad + data)
    import os
    os.replace(path + ".tmp", path)


def main():
    template = open(sys.argv[1]).read()
    for path in sys.argv[2:]:
        patch(path, template)
        print(f"{path}: tokenizer.chat_template set ({len(template)} bytes)")


if __name__ == "__main__":
    main()

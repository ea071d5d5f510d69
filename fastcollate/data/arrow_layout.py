"""Where an Arrow IPC file's record batches and buffers lie: a digest of its message headers (the schema,
and each record batch's length and buffer offsets: the flatbuffer metadata before each message's body),
read without the bodies. Two files with the same digest hold their values at the same places, so a file
whose modification time changed (``touch``) but whose digest did not is read on, as pyarrow reads it.

Both formats: the stream (what Hugging Face datasets writes) and the file ("ARROW1", a stream, then a
footer), each read with ``os.pread`` from a descriptor, never through a mapping: a file truncated
meanwhile ends the walk (None) instead of killing the process.
"""

from __future__ import annotations

import hashlib
import os
import struct

__all__ = ["layout_digest"]

_MAGIC = b"ARROW1"
_CONTINUATION = -1  # 0xFFFFFFFF before a message's metadata length (Arrow >= 0.15)
# A message's metadata is read with its length prefix in one call: a record batch's is a few hundred
# bytes, a schema's a few KiB (Hugging Face keeps its features there); a longer one takes a second read.
_READ_AHEAD = 4096
# Message's fields (Message.fbs): version, the header union (type, then value), bodyLength.
_BODY_LENGTH_SLOT = 3


def layout_digest(descriptor: int, size: int) -> bytes | None:
    """A digest of the message headers of the Arrow IPC stream or file open at ``descriptor`` (``size``
    bytes), their positions included; None when it is neither (its layout cannot be told)."""
    digest = hashlib.blake2b(digest_size=16)
    try:
        start, end = 0, size
        if os.pread(descriptor, len(_MAGIC), 0) == _MAGIC:
            footer = _footer(descriptor, size)
            if footer is None:
                return None
            digest.update(footer)  # the record batches' blocks: what a reader of the file format seeks to
            start, end = 8, size - 10 - len(footer)
        if not _walk(descriptor, start, end, digest):
            return None
    except (OSError, struct.error):  # unreadable, or cut short while read
        return None
    return digest.digest()


def _walk(descriptor: int, position: int, end: int, digest: hashlib.blake2b) -> bool:
    """Adds every message header from ``position`` to the end of the stream (its end-of-stream marker, or
    ``end``) to ``digest``; False when the bytes there are not an Arrow stream (one message at least: its
    schema)."""
    messages = 0
    while position + 4 <= end:
        block = os.pread(descriptor, min(_READ_AHEAD, end - position), position)
        (length,) = struct.unpack_from("<i", block)
        prefix = 4
        if length == _CONTINUATION:
            if len(block) < 8:
                return False
            (length,) = struct.unpack_from("<i", block, 4)
            prefix = 8
        if length == 0:
            return messages > 0  # the end-of-stream marker
        if length < 0 or position + prefix + length > end:
            return False
        metadata = block[prefix : prefix + length]
        if len(metadata) < length:
            metadata = os.pread(descriptor, length, position + prefix)
        body = _body_length(metadata)
        if body is None or body < 0:
            return False
        digest.update(struct.pack("<qi", position, length))
        digest.update(metadata)
        position += prefix + length + body
        messages += 1
    return messages > 0 and position <= end


def _body_length(metadata: bytes) -> int | None:
    """The bodyLength of a flatbuffer ``Message``, or None when ``metadata`` is not one."""
    try:
        (table,) = struct.unpack_from("<I", metadata, 0)
        (back,) = struct.unpack_from("<i", metadata, table)
        vtable = table - back
        if vtable < 0:  # struct would read a negative offset from the end
            return None
        (vtable_size,) = struct.unpack_from("<H", metadata, vtable)
        slot = 4 + 2 * _BODY_LENGTH_SLOT
        if slot + 2 > vtable_size:
            return 0  # a field past the vtable's end takes its default: no body
        (field,) = struct.unpack_from("<H", metadata, vtable + slot)
        if field == 0:
            return 0
        (length,) = struct.unpack_from("<q", metadata, table + field)
        return length
    except struct.error:
        return None


def _footer(descriptor: int, size: int) -> bytes | None:
    """The footer of an IPC file: its flatbuffer, whose length and the magic end the file."""
    if size < 8 + 10:
        return None
    tail = os.pread(descriptor, 10, size - 10)
    (length,) = struct.unpack_from("<i", tail)
    if tail[4:] != _MAGIC or length <= 0 or 8 + length + 10 > size:
        return None
    footer = os.pread(descriptor, length, size - 10 - length)
    return footer if len(footer) == length else None

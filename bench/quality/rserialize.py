"""A reader of R's XDR serialization and of R lazy-load databases (`.rdb` / `.rdx`), standard library only.

It reads what `scripts/fetch_quality_models.sh` needs from Debian's `r-cran-janeaustenr` (the six novels as
character vectors in `data/Rdata.rdb`) and nothing more general: vectors (character, integer, logical, double,
list), pairlists, symbols and references, with attributes. Environments, closures, bytecode and ALTREP
objects are refused with the type code, so an unexpected file fails loudly instead of being misread.

Note [R serialization, the parts read here]
A stream starts `X\\n` (XDR, big-endian), then the format version (2 or 3), the writer's and the minimal
reader's R versions; version 3 adds the native encoding as a length-prefixed string. Each item is a 32-bit
`flags` word: the low 8 bits are the type, bit 8 "is object", bit 9 "has attributes", bit 10 "has tag", and
the bits from 12 up the "levels" (for a CHARSXP its encoding: 2 bytes, 4 latin1, 8 UTF-8, 64 ASCII).
- CHARSXP (9): a length (-1 = NA_character_) and that many bytes.
- STRSXP (16) / VECSXP (19) / EXPRSXP (20): a length, then that many items (CHARSXPs for a STRSXP).
- INTSXP (13), LGLSXP (10): a length and 32-bit ints (NA = -2^31); REALSXP (14): 64-bit doubles.
- LISTSXP (2) and the language types: [attributes] [tag] CAR CDR, the CDR being the next cell (iterated here).
- SYMSXP (1): a CHARSXP; each symbol read joins the reference table, and REFSXP (255) points back into it
  (index in the flags' upper 24 bits, or in the next word when those are 0).
- Vectors' attributes (a pairlist) follow their data when bit 9 is set.
A lazy-load database is a `.rdx` index (one gzip- or zlib-compressed serialized list with `variables`:
name -> c(offset, length) into the `.rdb`) and the `.rdb` itself: at each offset a 4-byte big-endian
uncompressed length and a zlib stream of one serialized object (the "type 1" compression R uses by default).
"""

from __future__ import annotations

import gzip
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

NILVALUE_SXP = 254
REFSXP = 255
SYMSXP, LISTSXP, LANGSXP = 1, 2, 6
CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP, EXPRSXP = 9, 10, 13, 14, 16, 19, 20
# Singletons that carry no payload: global / empty / base environments, unbound and missing markers.
_SINGLETONS = {
    253: "<GlobalEnv>",
    242: "<EmptyEnv>",
    241: "<BaseEnv>",
    252: "<unbound>",
    251: "<missing>",
    250: "<BaseNamespace>",
}
NA_INTEGER = -(2**31)
_HAS_ATTR, _HAS_TAG = 1 << 9, 1 << 10
_LATIN1, _BYTES = 1 << 2, 1 << 1


@dataclass
class RObject:
    """An R vector or pairlist: `value` is a Python list (None for NA), `attributes` a dict by name."""

    type: int
    value: list
    attributes: dict = field(default_factory=dict)
    tags: list | None = None  # pairlists: the tag (name) of each cell, None where a cell has no tag

    def names(self) -> list | None:
        names = self.attributes.get("names")
        return names.value if isinstance(names, RObject) else None


class RSerializationError(ValueError):
    pass


class _Reader:
    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0
        self.refs: list = []

    def _take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise RSerializationError(
                f"truncated stream: need {n} bytes at offset {self.pos}, have {len(self.data) - self.pos}"
            )
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def int(self) -> int:
        return struct.unpack(">i", self._take(4))[0]

    def header(self) -> None:
        magic = self._take(2)
        if magic != b"X\n":
            raise RSerializationError(f"not an XDR R serialization (starts {magic!r}; only format 'X' is read)")
        version = self.int()
        self.int()  # writer's R version
        self.int()  # minimal reader version
        if version == 3:
            self._take(self.int())  # native encoding, e.g. b"UTF-8"
        elif version != 2:
            raise RSerializationError(f"serialization format version {version} (only 2 and 3 are read)")

    def _charsxp(self, flags: int) -> str | None:
        length = self.int()
        if length == -1:
            return None
        raw = self._take(length)
        levels = flags >> 12
        if levels & _BYTES:
            return raw.decode("latin-1")
        return raw.decode("latin-1" if levels & _LATIN1 else "utf-8")

    def _length(self) -> int:
        length = self.int()
        if length == -1:  # long vector: two more words
            high, low = self.int(), self.int()
            length = (high << 32) + low
        return length

    def item(self):
        flags = self.int()
        kind = flags & 0xFF
        if kind == NILVALUE_SXP:
            return None
        if kind in _SINGLETONS:
            return _SINGLETONS[kind]
        if kind == REFSXP:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if kind == SYMSXP:
            name_flags = self.int()
            if name_flags & 0xFF != CHARSXP:
                raise RSerializationError(f"symbol without a CHARSXP name (type {name_flags & 0xFF})")
            name = self._charsxp(name_flags)
            self.refs.append(name)
            return name
        if kind == CHARSXP:
            return self._charsxp(flags)
        if kind in (LISTSXP, LANGSXP):
            return self._pairlist(flags, kind)
        if kind in (STRSXP, VECSXP, EXPRSXP, INTSXP, LGLSXP, REALSXP):
            length = self._length()
            if kind == STRSXP:
                values = []
                for _ in range(length):
                    char_flags = self.int()
                    if char_flags & 0xFF != CHARSXP:
                        raise RSerializationError(f"character vector element of type {char_flags & 0xFF}")
                    values.append(self._charsxp(char_flags))
            elif kind in (VECSXP, EXPRSXP):
                values = [self.item() for _ in range(length)]
            elif kind == REALSXP:
                values = list(struct.unpack(f">{length}d", self._take(8 * length)))
            else:
                values = [None if v == NA_INTEGER else v for v in struct.unpack(f">{length}i", self._take(4 * length))]
                if kind == LGLSXP:
                    values = [None if v is None else bool(v) for v in values]
            obj = RObject(kind, values)
            if flags & _HAS_ATTR:
                obj.attributes = self._attributes()
            return obj
        raise RSerializationError(f"R type {kind} at offset {self.pos - 4} is not read here (flags {flags:#x})")

    def _attributes(self) -> dict:
        attrs = self.item()
        if not isinstance(attrs, RObject) or attrs.type != LISTSXP:
            raise RSerializationError("attributes are not a pairlist")
        return dict(zip(attrs.tags, attrs.value))

    def _pairlist(self, flags: int, kind: int) -> RObject:
        values, tags, attributes = [], [], {}
        while True:
            if flags & _HAS_ATTR:
                attributes.update(self._attributes())
            tags.append(self.item() if flags & _HAS_TAG else None)
            values.append(self.item())
            flags = self.int()  # the CDR: the next cell, or the end
            if flags & 0xFF == NILVALUE_SXP:
                break
            if flags & 0xFF != kind:
                raise RSerializationError(f"pairlist CDR of type {flags & 0xFF}")
        return RObject(kind, values, attributes, tags)


def unserialize(data: bytes):
    """One R object from an uncompressed XDR serialization (what R's `serialize(x, NULL)` writes)."""
    reader = _Reader(data)
    reader.header()
    obj = reader.item()
    if reader.pos != len(data):
        raise RSerializationError(f"{len(data) - reader.pos} bytes left after the object")
    return obj


def _decompress(data: bytes) -> bytes:
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else zlib.decompress(data)


def read_lazyload_index(rdx: Path | str) -> dict[str, tuple[int, int]]:
    """Name -> (offset, length) of each variable in the matching `.rdb`."""
    index = unserialize(_decompress(Path(rdx).read_bytes()))
    if not isinstance(index, RObject) or index.type != VECSXP:
        raise RSerializationError(f"{rdx}: the index is not a list")
    parts = dict(zip(index.names() or [], index.value))
    variables = parts.get("variables")
    if not isinstance(variables, RObject):
        raise RSerializationError(f"{rdx}: the index has no `variables` (has {sorted(parts)})")
    return {name: (int(pos.value[0]), int(pos.value[1])) for name, pos in zip(variables.names(), variables.value)}


def read_lazyload_record(rdb: bytes, offset: int, length: int):
    """The object stored at `offset` in a `.rdb`: 4-byte big-endian uncompressed length, then zlib."""
    record = rdb[offset : offset + length]
    expected = struct.unpack(">I", record[:4])[0]
    data = zlib.decompress(record[4:])
    if len(data) != expected:
        raise RSerializationError(f"record at {offset}: {len(data)} bytes decompressed, header says {expected}")
    return unserialize(data)


def read_lazyload_db(base: Path | str) -> dict:
    """Every variable of a lazy-load database `base.rdb` / `base.rdx`, by name, in the index's order."""
    base = Path(base)
    rdb = base.with_suffix(".rdb").read_bytes()
    return {
        name: read_lazyload_record(rdb, offset, length)
        for name, (offset, length) in read_lazyload_index(base.with_suffix(".rdx")).items()
    }


# ---------------------------------------------------------------------------------------------------------
# A writer for the tests: small hand-made streams in the same format.


def serialize_character_vector(values: list, version: int = 3, names: list | None = None) -> bytes:
    """XDR serialization of a character vector (None = NA), optionally with a `names` attribute."""
    out = [b"X\n", struct.pack(">iii", version, 0x040201, 0x030500)]
    if version == 3:
        out.append(struct.pack(">i", 5) + b"UTF-8")

    def chars(strings):
        for s in strings:
            if s is None:
                out.append(struct.pack(">ii", CHARSXP, -1))
            else:
                raw = s.encode("utf-8")
                out.append(struct.pack(">ii", CHARSXP | (8 << 12), len(raw)) + raw)

    out.append(struct.pack(">ii", STRSXP | (_HAS_ATTR if names else 0), len(values)))
    chars(values)
    if names:
        out.append(struct.pack(">i", LISTSXP | _HAS_TAG))
        out.append(struct.pack(">ii", SYMSXP, CHARSXP | (64 << 12)) + struct.pack(">i", 5) + b"names")
        out.append(struct.pack(">ii", STRSXP, len(names)))
        chars(names)
        out.append(struct.pack(">i", NILVALUE_SXP))
    return b"".join(out)

"""The idx file format of MNIST and Fashion-MNIST (LeCun et al.,
http://yann.lecun.com/exdb/mnist/), read and written in pure Python + NumPy.

Layout: a 4-byte magic ``00 00 <type> <ndim>``, then ``ndim`` big-endian
uint32 dimension sizes, then the values in C order, big-endian.  Files may be
gzip-compressed (recognised by the gzip magic ``1f 8b``, not by the name).
"""
from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import numpy as np

from .._validate import check_bool

# type byte -> big-endian NumPy dtype (the format's table).
IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_CODES = {dt.newbyteorder("=").str[1:]: code for code, dt in IDX_DTYPES.items()}

GZIP_MAGIC = b"\x1f\x8b"


class IdxFormatError(ValueError):
    """The bytes are not a well-formed idx file (bad magic, truncated, trailing data)."""


def read_bytes(path) -> bytes:
    """The file's content, gunzipped when it is a gzip file (by its magic bytes)."""
    path = Path(path)
    data = path.read_bytes()
    if data[:2] == GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:  # truncated or corrupt gzip stream
            raise IdxFormatError(f"{path}: corrupt or truncated gzip data ({e})") from e
    return data


def parse_idx(data: bytes, name: str = "<bytes>") -> np.ndarray:
    """Parse the (uncompressed) bytes of an idx file into a native-endian array.

    Returns an array of shape given by the header and the header's dtype
    (uint8 for MNIST images and labels).  Raises :class:`IdxFormatError`
    naming ``name`` for a bad magic number, an unknown type code, a header or
    body shorter than the header announces, or trailing bytes.
    """
    if len(data) < 4:
        raise IdxFormatError(f"{name}: truncated idx file: {len(data)} bytes, expected at least "
                             "a 4-byte magic number")
    if data[0] != 0 or data[1] != 0:
        raise IdxFormatError(f"{name}: bad idx magic number {data[:4].hex()}: expected the first "
                             "two bytes to be 00 00 (is it gzip data that was not decompressed, "
                             "or not an idx file?)")
    code, ndim = data[2], data[3]
    if code not in IDX_DTYPES:
        raise IdxFormatError(f"{name}: bad idx magic number {data[:4].hex()}: unknown type code "
                             f"0x{code:02x}, expected one of "
                             f"{', '.join(f'0x{c:02x}' for c in IDX_DTYPES)}")
    if ndim == 0:
        raise IdxFormatError(f"{name}: bad idx magic number {data[:4].hex()}: 0 dimensions")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise IdxFormatError(f"{name}: truncated idx header: {len(data)} bytes, expected "
                             f"{header} for {ndim} dimensions")
    shape = tuple(int(s) for s in np.frombuffer(data, ">u4", count=ndim, offset=4))
    dtype = IDX_DTYPES[code]
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) < expected:
        raise IdxFormatError(f"{name}: truncated idx file: {len(data)} bytes, expected {expected} "
                             f"for shape {shape} of {dtype.newbyteorder('=').name}")
    if len(data) > expected:
        raise IdxFormatError(f"{name}: {len(data) - expected} trailing bytes after the "
                             f"{expected} bytes announced by the header (shape {shape})")
    arr = np.frombuffer(data, dtype, count=int(np.prod(shape, dtype=np.int64)),
                        offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def read_idx(path) -> np.ndarray:
    """Read an idx file (raw or gzip) into a native-endian array; see :func:`parse_idx`."""
    return parse_idx(read_bytes(path), name=str(path))


def write_idx(path, array, compress: bool | None = None) -> Path:
    """Write ``array`` (dtype uint8, int8, int16, int32, float32 or float64) as an idx
    file; gzip-compressed when ``compress`` is true (default: when the name ends in .gz)."""
    path = Path(path)
    arr = np.ascontiguousarray(array)
    key = arr.dtype.newbyteorder("=").str[1:]
    if key not in _CODES:
        raise ValueError(f"array: expected dtype one of uint8, int8, int16, int32, float32, "
                         f"float64, got {arr.dtype}")
    if arr.ndim == 0 or arr.ndim > 255:
        raise ValueError(f"array: expected 1 to 255 dimensions, got {arr.ndim}")
    code = _CODES[key]
    body = (bytes([0, 0, code, arr.ndim]) + np.asarray(arr.shape, ">u4").tobytes()
            + arr.astype(IDX_DTYPES[code], copy=False).tobytes())
    if check_bool(compress, "compress", none=True) is None:
        compress = path.suffix == ".gz"
    path.write_bytes(gzip.compress(body, mtime=0) if compress else body)
    return path


def md5_of(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


class ChecksumError(ValueError):
    """A downloaded file's MD5 differs from the one recorded for it."""


def verify_md5(data: bytes, expected: str, name: str) -> str:
    """Return the MD5 of ``data`` after checking it equals ``expected``; raise
    :class:`ChecksumError` naming the file otherwise."""
    got = md5_of(data)
    if got != expected:
        raise ChecksumError(f"{name}: MD5 mismatch: expected {expected}, got {got} (corrupt "
                            "download or a different release of the data set; delete it and "
                            "re-run `make data`)")
    return got

"""fsspec helpers: every input and output of flashdraft is a URL (local path by default).

Local paths and `s3://`, `gs://`, `memory://` ... all go through fsspec, so the same code
reads a JSONL shard from a laptop disk or a bucket. Compression is inferred from the
suffix (`.gz`, `.zst`). A UTF-8 byte-order mark at the start of a text file (Windows tools
write one) is not part of its first line. Reading bad JSON names the file.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import json
import os
import posixpath
import typing
import uuid
import zlib
from collections.abc import Iterable, Iterator
from typing import IO, Any

import fsspec
import zstandard
from fsspec.core import url_to_fs

DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".json.gz", ".json.zst")
BOM = b"\xef\xbb\xbf"  # the UTF-8 byte-order mark


class WriteFailed(OSError):
    """Writing `url` failed (disk full, no permission, a store refusing): one line naming the
    file and the reason. Callers that write several files say what the whole write was."""

    def __init__(self, url: str, error: OSError) -> None:
        super().__init__(error.errno, f"could not write {url}: {error.strerror or error}")
        self.url, self.error = url, error

    def __str__(self) -> str:
        return str(self.args[1])


def is_write_failure(error: OSError) -> bool:
    """A write that failed for want of room or rights (`WriteFailed`, or a full disk, quota or
    read-only file system met elsewhere): the user's to fix, worth one line, not a traceback."""
    return isinstance(error, WriteFailed) or error.errno in (
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EROFS,
    )


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem holding `url` and the path inside it."""
    fs, path = url_to_fs(url)
    return fs, path


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def join(url: str, *parts: str) -> str:
    if is_local(url):
        return os.path.join(url, *parts)
    return posixpath.join(url, *parts)


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return bool(fs.exists(path))


def makedirs(url: str) -> None:
    fs, path = filesystem(url)
    fs.makedirs(path, exist_ok=True)


def _compression(url: str) -> str | None:
    if url.endswith(".gz"):
        return "gzip"
    if url.endswith(".zst"):
        return "zstd"
    return None


def open_url(url: str, mode: str = "rb") -> Any:
    """An fsspec OpenFile (use as a context manager); compression inferred from the suffix."""
    return fsspec.open(url, mode, compression=_compression(url))


def decompress(raw: IO[bytes], url: str) -> IO[bytes]:
    """The decompressed bytes of an open raw stream, line-iterable; codec from `url`'s suffix.
    Data cut short or not in the codec's format is a `DamagedInput` at the point it breaks,
    after everything readable before it (zstandard's own reader stops at a cut without a word)."""
    compression = _compression(url)
    if compression is None:
        return raw
    return io.BufferedReader(_CheckedDecompress(raw, url, compression), 1 << 20)


class DamagedInput(ValueError):
    """A compressed input cut short or not in its suffix's format: one line naming the file,
    where it broke and what to do. A reader that counts lines fills in `lines`, the complete
    lines read before the damage."""

    def __init__(self, url: str, what: str, fix: str, lines: int | None = None) -> None:
        self.url, self.what, self.fix, self.lines = url, what, fix, lines
        super().__init__(str(self))

    def __str__(self) -> str:
        after = f", after line {self.lines:,}" if self.lines else ""
        return f"{self.url} {self.what}{after}; {self.fix}"


class _CheckedDecompress(io.RawIOBase):
    """gzip or zstd decoded frame after frame, with a `DamagedInput` where the data breaks."""

    def __init__(self, raw: IO[bytes], url: str, compression: str) -> None:
        self.raw, self.url, self.zstd = _Counted(raw), url, compression == "zstd"
        fileobj = typing.cast(IO[bytes], self.raw)
        self.stream: Any = None if self.zstd else gzip.GzipFile(fileobj=fileobj, mode="rb")
        self.frame: Any = None  # the zstd frame being decoded; None between frames
        self.out, self.at = b"", 0  # decoded and not yet returned

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if not self.zstd:
            try:
                return int(self.stream.readinto(buffer))
            except EOFError:
                raise self._cut("the gzip stream ends before its end marker") from None
            except (gzip.BadGzipFile, zlib.error) as err:
                raise self._not("gzip", err) from None
        while self.at == len(self.out):
            chunk = self.raw.read(1 << 16)  # small: a chunk may decode to 100x its size
            if not chunk:
                if self.frame is not None:
                    raise self._cut("the zstd stream ends inside a frame")
                return 0
            self.out, self.at = self._decode(chunk), 0
        n = min(len(buffer), len(self.out) - self.at)
        buffer[:n] = memoryview(self.out)[self.at : self.at + n]
        self.at += n
        return n

    def _decode(self, data: bytes) -> bytes:
        out = []
        while data:
            if self.frame is None:
                self.frame = zstandard.ZstdDecompressor().decompressobj()
            try:
                out.append(self.frame.decompress(data))
            except zstandard.ZstdError as err:
                raise self._not("zstd", err) from None
            if not self.frame.eof:
                break
            data, self.frame = self.frame.unused_data, None
        return b"".join(out)

    def _cut(self, how: str) -> DamagedInput:
        return DamagedInput(
            self.url,
            f"is cut short: {how} at byte {self.raw.bytes:,}",
            "the lines before it were read, the rest is missing: copy or download the file again",
        )

    def _not(self, codec: str, err: Exception) -> DamagedInput:
        suffix = ".zst" if codec == "zstd" else ".gz"
        return DamagedInput(
            self.url,
            f"is not {codec} data or is damaged ({err}; within its first {self.raw.bytes:,} bytes)",
            f"if it is plain JSONL, name it without {suffix}; else copy or download it again",
        )


class _Counted:
    """A raw stream's `read`, counting the bytes read (to say where a damaged input broke)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw, self.bytes = raw, 0

    def read(self, size: int = -1) -> bytes:
        chunk = self.raw.read(size)
        self.bytes += len(chunk)
        return chunk


def expand_inputs(inputs: Iterable[str], suffixes: tuple[str, ...] = DATA_SUFFIXES) -> list[str]:
    """Files named by `inputs`: plain files, globs and directories (searched recursively).

    Raises FileNotFoundError naming the input that matched nothing, so a typo is never
    silently an empty dataset.
    """
    found: list[str] = []
    for item in inputs:
        fs, path = filesystem(item)
        protocol = fs.protocol[0] if isinstance(fs.protocol, tuple) else fs.protocol
        prefix = "" if protocol in ("file", "local") else f"{protocol}://"
        if any(ch in path for ch in "*?["):
            matches = sorted(fs.glob(path))
        elif fs.isdir(path):
            matches = sorted(p for p in fs.find(path) if p.endswith(suffixes))
        elif fs.exists(path):
            matches = [path]
        else:
            raise FileNotFoundError(f"input {item!r} does not exist")
        matches = [m for m in matches if not fs.isdir(m)]
        if not matches:
            raise FileNotFoundError(
                f"input {item!r} matched no data files (looked for {', '.join(suffixes)})"
            )
        found.extend(prefix + m for m in matches)
    return found


def read_text(url: str) -> str:
    with open_url(url, "rt") as f:
        return str(f.read())


def read_json(url: str) -> Any:
    """A JSON file; a file that is not JSON is a ValueError naming it (and where it breaks)."""
    try:
        return json.loads(read_text(url).removeprefix("\ufeff"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{url} is not valid JSON (not UTF-8 at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{url} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})"
        ) from None


def json_bytes(obj: Any) -> bytes:
    """How flashdraft writes a JSON file: indented, keys in insertion order, newline-ended."""
    return (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()


def file_digest(url: str) -> tuple[str, int]:
    """(sha256 hex digest, size in bytes) of a file as stored, read in 8 MiB chunks."""
    digest, size = hashlib.sha256(), 0
    with fsspec.open(url, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def write_bytes_atomic(url: str, data: bytes) -> None:
    """Write so that readers see either the old file or the whole new one.

    Local: write a temporary sibling, fsync, then rename over. Object stores: a single PUT
    is already atomic.

    A write that fails (a full disk, a store refusing) raises `WriteFailed` naming the file
    and leaves nothing behind: no temporary file, the old file (if any) unchanged.
    """
    fs, path = filesystem(url)
    try:
        if is_local(url):
            _write_local(path, data)
        else:
            with fs.open(path, "wb") as f:
                f.write(data)
    except WriteFailed:
        raise
    except OSError as err:
        raise WriteFailed(url, err) from err


def _write_local(path: str, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_text_atomic(url: str, text: str) -> None:
    write_bytes_atomic(url, text.encode())


def write_json_atomic(url: str, obj: Any) -> None:
    write_bytes_atomic(url, json_bytes(obj))


def tensor_bytes(tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> bytes:
    """A dict of tensors serialised as one safetensors file (CPU copies, contiguous)."""
    from safetensors.torch import save

    cpu = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    return bytes(save(cpu, metadata=metadata))


def write_tensors(
    url: str, tensors: dict[str, Any], metadata: dict[str, str] | None = None
) -> None:
    """A dict of tensors as one safetensors file at any URL (atomically where local)."""
    write_bytes_atomic(url, tensor_bytes(tensors, metadata))


def read_tensors(url: str) -> dict[str, Any]:
    """A safetensors file from any URL (memory-mapped where local); never unpickles."""
    from safetensors.torch import load, load_file

    if is_local(url):
        return load_file(filesystem(url)[1])
    with open_url(url, "rb") as f:
        return load(f.read())


def iter_lines(url: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes without the newline) for every line of a text file;
    a byte-order mark at the start of the file is dropped.

    Bytes, not str: invalid UTF-8 is the caller's to report per line, not a crash here. A
    damaged compressed file is a `DamagedInput` naming its last complete line.
    """
    number = 0
    with fsspec.open(url, "rb") as f:
        try:
            for number, line in enumerate(decompress(f, url), start=1):
                yield number, clean_line(line, number)
        except DamagedInput as err:
            err.lines = number
            raise


def clean_line(line: bytes, number: int) -> bytes:
    """A raw line without its newline, and without the byte-order mark if it is line 1."""
    line = line.rstrip(b"\r\n")
    return line.removeprefix(BOM) if number == 1 else line

"""Files the library writes, replaced whole or not at all; files it reads, set aside when
they are not what it wrote.

``replacing(path)`` hands out a temporary name in the target's folder (unique per call,
so concurrent writers never share one); once the writer returns, the file is flushed to
disk (``fsync``) and renamed over the target (``os.replace``, atomic on one file
system). A write that fails halfway (a full disk, a size limit, an exception) leaves the
previous file as it was and no temporary behind. ``set_aside(path, why)`` renames a
corrupt or foreign-shaped file the library rebuilds (kernel choices, the tuner's
journal) with a ``.bad-<time>`` suffix and warns once, so it never fails every later run.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

__all__ = ["replacing", "set_aside", "write_bytes", "write_text"]


def _fsync_dir(folder: Path) -> None:
    # The rename itself must reach the disk too; not every platform opens folders.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path (same folder, same suffix) to write; on success it replaces
    ``path``, on any exception it is removed and ``path`` is left untouched."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # The suffix is kept: some writers (mx.save_safetensors) append theirs otherwise.
    tmp = target.with_name(f".{target.stem}.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp"
                           f"{target.suffix}")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(target.parent)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (see ``replacing``)."""
    with replacing(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all (see ``replacing``)."""
    write_bytes(path, text.encode("utf-8"))


def set_aside(path: str | os.PathLike, why: str) -> Path | None:
    """Rename an unusable ``path`` to ``<path>.bad-<time>`` with one warning naming it and
    why; the caller then rebuilds it. None when it could not be moved (then it is left)."""
    src = Path(path)
    dest = src.with_name(f"{src.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}-"
                         f"{uuid.uuid4().hex[:6]}")
    try:
        os.replace(src, dest)
    except OSError:
        warnings.warn(f"{str(src)!r} is unusable ({why}) and could not be moved aside; it "
                      "is ignored", RuntimeWarning, stacklevel=2)
        return None
    warnings.warn(f"{str(src)!r} is unusable ({why}); moved aside to {dest.name!r} and "
                  "rebuilt", RuntimeWarning, stacklevel=2)
    return dest

"""Writing output folders safely: never over someone's files, never half-written, readable by
others.

Every folder or file this package writes (exports, the embedded model, the prose corpus, greedy
corpora, files fetched from wheels, fit's checkpoints) goes through `atomic_dir` / `atomic_file`:

  - the content is written into a temporary sibling `.<name>.tmp-<hex>` (same filesystem), and
    swapped in only once complete. On Linux the swap is renameat2(RENAME_EXCHANGE): `dest` is at
    every instant either the complete old folder or the complete new one. Elsewhere the old one is
    renamed aside to `.<name>.old-<hex>`, the new one renamed in, then the old one deleted; a kill
    between the two renames leaves `dest` missing and the next run restores the old one.
  - leftovers of killed runs (`.<name>.tmp-*`, `.<name>.old-*`) are removed (or restored) by the
    next write to the same `dest`, with a warning naming them. A leftover still locked by a live
    process (each run holds a flock on its temporary) is left alone.
  - permissions follow the umask, like any ordinary write (not mkdtemp's 0700).

A full disk ends a write in one line (disk.py); an export's marker says what may be replaced
(marker.py). This module needs nothing but the standard library.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; leftovers are then always treated as abandoned
    fcntl = None


# --------------------------------------------------------------------------------------------
# The filesystem steps of a swap. Each is a separate function so that tests can kill the process
# (really, with SIGKILL) right before any one of them.
# --------------------------------------------------------------------------------------------


def _rename(src: Path, dst: Path) -> None:
    os.rename(src, dst)


def _replace(src: Path, dst: Path) -> None:
    os.replace(src, dst)


def _rmtree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


_renameat2 = None


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE). False where unsupported."""
    global _renameat2
    if not sys.platform.startswith("linux"):
        return False
    if _renameat2 is None:
        import ctypes

        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
        except (AttributeError, OSError):  # glibc < 2.28, or no such symbol (musl)
            _renameat2 = False
            return False
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        _renameat2 = fn
    if _renameat2 is False:
        return False
    import ctypes

    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    if _renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    # kernel or filesystem without it
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) {a} <-> {b}: {os.strerror(err)}")


# --------------------------------------------------------------------------------------------
# Temporary siblings, their locks, and leftovers.
# --------------------------------------------------------------------------------------------


def _leftover_re(dest: Path) -> re.Pattern:
    return re.compile(rf"^\.{re.escape(dest.name)}\.(tmp|old)-[0-9a-f]{{8}}$")


def leftovers(dest: str | os.PathLike) -> list[Path]:
    """Temporaries (`.<name>.tmp-*`) and set-aside old versions (`.<name>.old-*`) next to dest."""
    dest = Path(dest)
    if not dest.parent.is_dir():
        return []
    pattern = _leftover_re(dest)
    return sorted(p for p in dest.parent.iterdir() if pattern.match(p.name))


def _lock(path: Path, blocking: bool = True) -> int | None:
    """An open fd holding an exclusive flock on path (a file or a folder); None if another process
    holds it (non-blocking) or locks are unavailable. The kernel drops it when the process dies."""
    if fcntl is None:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:  # a filesystem without flock: carry on unlocked
        os.close(fd)
        return -1
    return fd


def _unlock(fd: int | None) -> None:
    if fd is not None and fd >= 0:
        os.close(fd)


def recover(dest: str | os.PathLike) -> list[Path]:
    """Clean up after killed runs writing dest: restore a set-aside old version if dest is missing,
    delete the other leftovers. Leftovers locked by a live process are skipped. Returns what it
    touched."""
    dest = Path(dest)
    touched = []
    # newest old first
    for path in sorted(leftovers(dest), key=lambda p: (".old-" not in p.name, -_mtime(p))):
        try:
            fd = _lock(path, blocking=False) if fcntl is not None else -1
        except FileNotFoundError:  # removed meanwhile by another cleaner
            continue
        except OSError as e:
            log.warning(
                "Cannot clean up %s, left behind by an interrupted write of %s: %s",
                path,
                dest.name,
                e,
            )
            continue
        if fd is None:
            log.debug("%s is in use by a running process; left alone", path)
            continue
        try:
            if ".old-" in path.name and not os.path.lexists(dest):
                log.warning(
                    "%s is missing but a complete earlier version %s was set aside by an "
                    "interrupted run: restoring it",
                    dest,
                    path.name,
                )
                _rename(path, dest)
            else:
                log.warning(
                    "Removing %s, left behind by an interrupted write of %s", path, dest.name
                )
                _rmtree(path)
            touched.append(path)
        finally:
            _unlock(fd)
    return touched


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except FileNotFoundError:
        return 0.0


def _umask() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # no /proc: read it the only portable way (and put it back at once)
    os.umask(mask)
    return mask


def walk(root: Path) -> list[Path]:
    """Everything under root (not root), symlinks listed but never followed."""
    found = []
    for folder, dirs, files in os.walk(root):
        found += [Path(folder) / name for name in dirs + files]
    return found


def _follow_umask(root: Path) -> None:
    """Modes as an ordinary write gives them (0666 / 0777 less the umask), whatever wrote the
    files."""
    mask = _umask()
    for p in [root, *walk(root)]:
        if p.is_symlink():
            continue
        executable = p.is_dir() or p.stat().st_mode & 0o111
        os.chmod(p, (0o777 if executable else 0o666) & ~mask)


@contextlib.contextmanager
def scratch_dir(dest: str | os.PathLike) -> Iterator[Path]:
    """A new, locked, empty folder `.<name>.tmp-<hex>` next to dest (same filesystem, so its
    contents rename into place); removed on exit, whatever happens."""
    dest = Path(dest)
    while True:
        tmp = dest.parent / f".{dest.name}.tmp-{secrets.token_hex(4)}"
        try:
            tmp.mkdir(mode=0o777)  # less the umask, unlike mkdtemp's 0700
            break
        except FileExistsError:
            continue
    fd = _lock(tmp)
    try:
        yield tmp
    finally:
        _unlock(fd)
        _rmtree(tmp)


def _swap_in(new: Path, dest: Path) -> None:
    """Put the complete folder `new` at dest; dest is never half-written and, on Linux, never
    missing."""
    if not os.path.lexists(dest):
        _rename(new, dest)
        return
    if _exchange(new, dest):
        _rmtree(new)  # the old version, now under the temporary name
        return
    # No exchange: set the old one aside first; `recover` restores it if we die before the next
    # rename.
    old = dest.parent / f".{dest.name}.old-{secrets.token_hex(4)}"
    fd = _lock(dest) if dest.is_dir() else None
    try:
        _rename(dest, old)
        _rename(new, dest)
    finally:
        _unlock(fd)
    _rmtree(old)


@contextlib.contextmanager
def atomic_dir(dest: str | os.PathLike) -> Iterator[Path]:
    """Write a folder atomically: `with atomic_dir(out) as tmp:` write into tmp; on success tmp
    replaces out (an existing out is replaced whole, so check first what may be replaced). On an
    exception inside the block, out is untouched and tmp removed. Leftovers of killed runs are
    cleaned up first."""
    dest = Path(dest).expanduser().absolute()
    dest.parent.mkdir(parents=True, exist_ok=True)
    recover(dest)
    with scratch_dir(dest) as tmp:
        yield tmp
        _follow_umask(tmp)
        _swap_in(tmp, dest)


@contextlib.contextmanager
def atomic_file(dest: str | os.PathLike) -> Iterator[Path]:
    """Write a file atomically: `with atomic_file(path) as tmp:` write tmp (a path inside a private
    `.<name>.tmp-*` folder next to dest); on success it replaces dest in one rename."""
    dest = Path(dest).expanduser().absolute()
    dest.parent.mkdir(parents=True, exist_ok=True)
    recover(dest)
    with scratch_dir(dest) as tmp:
        yield tmp / dest.name
        _follow_umask(tmp / dest.name)
        _replace(tmp / dest.name, dest)


def check_record_target(path: Path, overwrite: bool, fix: str) -> None:
    """Refuse, before any measuring, a record (bench, quality, serve JSON) that would replace an
    earlier one or a file of the user's: a record is minutes to an hour of measurement."""
    if path.is_dir():
        raise ValueError(f"{str(path)!r} is a folder; pass a JSON file name for the record.")
    if path.exists() and not overwrite:
        raise ValueError(f"the record {str(path)!r} exists; {fix}, or --overwrite to replace it.")

"""Writing output folders safely: never over someone's files, never half-written, readable by others.

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

Exports also carry a marker, `tidar_export.json`, listing every file they hold with its size and
sha256: a folder may be replaced by a new export only if it is an earlier export, every file still
as written, and nothing else (`check_export_target`).
This module needs nothing but the standard library.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

MARKER = "tidar_export.json"

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
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):  # kernel or filesystem without it
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
    delete the other leftovers. Leftovers locked by a live process are skipped. Returns what it touched."""
    dest = Path(dest)
    touched = []
    for path in sorted(leftovers(dest), key=lambda p: (".old-" not in p.name, -_mtime(p))):  # newest old first
        try:
            fd = _lock(path, blocking=False) if fcntl is not None else -1
        except FileNotFoundError:  # removed meanwhile by another cleaner
            continue
        except OSError as e:
            log.warning("Cannot clean up %s, left behind by an interrupted write of %s: %s", path, dest.name, e)
            continue
        if fd is None:
            log.debug("%s is in use by a running process; left alone", path)
            continue
        try:
            if ".old-" in path.name and not os.path.lexists(dest):
                log.warning("%s is missing but a complete earlier version %s was set aside by an interrupted run: restoring it", dest, path.name)
                _rename(path, dest)
            else:
                log.warning("Removing %s, left behind by an interrupted write of %s", path, dest.name)
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


def _walk(root: Path) -> list[Path]:
    """Everything under root (not root), symlinks listed but never followed."""
    found = []
    for folder, dirs, files in os.walk(root):
        found += [Path(folder) / name for name in dirs + files]
    return found


def _follow_umask(root: Path) -> None:
    """Modes as an ordinary write gives them (0666 / 0777 less the umask), whatever wrote the files."""
    mask = _umask()
    for p in [root, *_walk(root)]:
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
    """Put the complete folder `new` at dest; dest is never half-written and, on Linux, never missing."""
    if not os.path.lexists(dest):
        _rename(new, dest)
        return
    if _exchange(new, dest):
        _rmtree(new)  # the old version, now under the temporary name
        return
    # No exchange: set the old one aside first; `recover` restores it if we die before the next rename.
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


# --------------------------------------------------------------------------------------------
# A full disk: one line naming the folder and the space needed.
# --------------------------------------------------------------------------------------------


class DiskFull(OSError):
    """No space left where an output was being written; the message names the folder, the space
    needed and free, and what was left as it was."""

    def __init__(self, message: str):
        super().__init__(message)
        self.errno = errno.ENOSPC


def no_space(exc: BaseException) -> bool:
    """Whether exc, or an exception it was raised from or during, is a full disk (or quota): torch
    and safetensors report it as their own errors around the OSError, or in their message only."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if os.strerror(errno.ENOSPC) in str(exc) or "os error 28" in str(exc):  # safetensors: "... No space left on device (os error 28)"
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def size_text(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def disk_full(dest: str | os.PathLike, needed: int, what: str, fix: str) -> DiskFull:
    """The one-line error for `what` (e.g. "the checkpoint") at dest not fitting on its disk. Call it
    once the partial write is removed, so the free space it states is what there is to work with."""
    dest = Path(dest)
    folder = dest.parent
    free = shutil.disk_usage(folder).free
    kept = f"{dest.name} there is the earlier one, whole" if os.path.lexists(dest) else f"nothing was left at {dest.name}"
    room = f"free {size_text(needed - free)} or more there" if needed > free else "free space there"
    return DiskFull(
        f"no space left in {folder} for {what} {dest.name}: it needs about {size_text(needed)} and the disk has "
        f"{size_text(free)} free ({kept}). {room[0].upper()}{room[1:]}, or {fix}"
    )


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in a nested dict/list (a state dict, a checkpoint), each storage counted
    once (tied weights, views): about what torch.save or safetensors writes. Duck-typed: no torch import."""
    seen: set[int] = set()
    total = 0
    todo = [obj]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif hasattr(x, "untyped_storage"):
            try:
                storage = x.untyped_storage()
                key, n = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError, TypeError):  # meta or distributed tensors
                key, n = id(x), x.numel() * x.element_size()
            if key not in seen or key == 0:
                seen.add(key)
                total += n
    return total


def save_file_atomically(dest: str | os.PathLike, write, needed: int, what: str, fix: str) -> Path:
    """`write(f)` into a temporary file beside dest, flushed to disk, then renamed over dest: a full
    disk, a kill or a crash leaves dest as it was. A full disk is then DiskFull (see `disk_full`)."""
    dest = Path(dest).expanduser().absolute()
    try:
        with atomic_file(dest) as tmp, open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename: some filesystems report a full disk only here
    except Exception as e:
        if no_space(e):
            raise disk_full(dest, needed, what, fix) from e
        raise
    return dest


# --------------------------------------------------------------------------------------------
# Export folders: the marker, and what may be replaced.
# --------------------------------------------------------------------------------------------


def _tool_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tidar-convert")
    except PackageNotFoundError:
        return "unknown"


def file_record(path: str | os.PathLike) -> dict:
    """What a marker records of one path, to tell later whether it is still as written: a file's
    size and sha256, a symlink's target, or {"folder": True}."""
    path = Path(path)
    if path.is_symlink():
        return {"link": os.readlink(path)}
    if path.is_dir():
        return {"folder": True}
    return {"size": path.stat().st_size, "sha256": file_sha256(path)}


_digests: dict[tuple, str] = {}


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes. Remembered per (inode, size, mtime, ctime) for this process, so an
    export checked before loading and again before its swap is read once; any write to the file
    moves its ctime, which no one can set back, so a remembered digest is never stale."""
    st = os.stat(path)
    key = (os.fspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _digests:
        import hashlib

        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):  # hashlib.file_digest is Python 3.11+
                digest.update(chunk)
        _digests[key] = digest.hexdigest()
    return _digests[key]


def write_marker(folder: str | os.PathLike) -> Path:
    """Write tidar_export.json: every file now in folder with its size and sha256, what makes the
    folder replaceable later (`check_export_target`), as long as every one is still as written."""
    folder = Path(folder)
    paths = sorted((p for p in _walk(folder) if p.is_symlink() or not p.is_dir()), key=lambda p: p.relative_to(folder).as_posix())
    files = {p.relative_to(folder).as_posix(): file_record(p) for p in paths}
    files.pop(MARKER, None)
    marker = folder / MARKER
    marker.write_text(json.dumps({"tool": "tidar-convert", "version": _tool_version(), "files": files}, indent=1) + "\n")
    return marker


def marker_files(folder: str | os.PathLike) -> dict[str, dict | None] | None:
    """The files a folder's tidar_export.json lists, each with its record (None: a marker from before
    records were kept, a plain list of names); None if the folder has no valid marker."""
    try:
        listed = json.loads((Path(folder) / MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if isinstance(listed, list) and all(isinstance(name, str) for name in listed):
        return dict.fromkeys(listed)
    if isinstance(listed, dict) and all(isinstance(r, dict) for r in listed.values()):
        return listed
    return None


def record_file(folder: str | os.PathLike, name: str) -> None:
    """Record in folder's marker what `name` holds now: after this tool itself rewrote one of the
    export's files (the model card). Atomic; a marker without records is left as it is."""
    folder = Path(folder)
    data = json.loads((folder / MARKER).read_text())
    if not isinstance(data.get("files"), dict):
        return
    data["files"][name] = file_record(folder / name)
    with scratch_dir(folder) as tmp:
        (tmp / MARKER).write_text(json.dumps(data, indent=1) + "\n")
        os.chmod(tmp / MARKER, (folder / MARKER).stat().st_mode & 0o777)
        os.replace(tmp / MARKER, folder / MARKER)


def foreign_files(folder: str | os.PathLike) -> list[str] | None:
    """What in an existing folder is not part of an earlier export: None if it has no valid marker,
    else the paths (relative) that the marker does not list (empty: the folder is an export and only that)."""
    folder = Path(folder)
    listed = marker_files(folder)
    if listed is None:
        return None
    allowed = {MARKER, *listed}
    for name in listed:  # the folders holding listed files
        parts = Path(name).parts
        allowed.update(Path(*parts[:i]).as_posix() for i in range(1, len(parts)))
    foreign: list[str] = []
    for p in sorted(p.relative_to(folder).as_posix() for p in _walk(folder)):
        if p not in allowed and not any(p.startswith(f + "/") for f in foreign):  # a foreign folder, not each file in it
            foreign.append(p)
    return foreign


def changed_files(folder: str | os.PathLike) -> list[str] | None:
    """The files the marker lists that no longer hold what the export wrote (edited, or replaced by
    the user's own); a listed file that is gone is not among them (nothing of anyone's is lost by
    replacing it). None if the marker records no sizes and hashes (or there is no marker): then
    whether anything changed cannot be told."""
    folder = Path(folder)
    listed = marker_files(folder)
    if listed is None or any(record is None for record in listed.values()):
        return None
    changed = []
    for name, record in listed.items():
        path = folder / name
        if not os.path.lexists(path):
            continue
        if "size" in record and not path.is_symlink() and path.is_file() and path.stat().st_size != record["size"]:
            changed.append(name)  # cheap: no need to read it
        elif file_record(path) != record:
            changed.append(name)
    return changed


def is_export(folder: str | os.PathLike) -> bool:
    """An earlier export of this tool, as it wrote it, and nothing else (so it may be replaced with overwrite)."""
    return Path(folder).is_dir() and foreign_files(folder) == [] and changed_files(folder) == []


def _listing(names: list[str], n: int = 5) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def check_export_target(out: str | os.PathLike, overwrite: bool = False, cleanup: bool = True) -> Path:
    """Validate an export destination before any work; the absolute path to write.

    Fine: a new path (under a writable folder), an empty folder, or an earlier export when
    `overwrite`. Refused (ValueError, or PermissionError for an unwritable parent): an existing
    file, a non-empty folder that is not exactly an earlier export (whatever `overwrite` says), an
    export with a file changed since it was written (edited, or the user's own under a listed name),
    an export whose marker records no hashes (an older version's: nothing can be verified), an
    earlier export without `overwrite`, a mount point. `cleanup`: first `recover` leftovers of
    killed runs (a set-aside earlier export is put back, so it is checked like any other).
    """
    given = str(out)
    out = Path(out).expanduser().resolve()
    shown = repr(given) if given == str(out) else f"{given!r} ({out})"  # what was typed, and where it leads
    if cleanup:
        recover(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {shown} is an existing file, not a folder; choose a new folder name.")
    if out.is_dir():
        entries = list(out.iterdir())
        foreign = foreign_files(out) if entries else []
        here = " (the current directory)" if out == Path.cwd().resolve() else ""
        if foreign is None or foreign:
            what = f"it holds {_listing(sorted(p.name for p in entries))}" if foreign is None else f"besides an earlier export it holds {_listing(foreign)}"
            raise ValueError(
                f"--out {shown}{here} is not empty and not a tidar-convert export: {what}. "
                "Nothing was written or deleted. Choose a new or empty folder; --overwrite only replaces earlier exports."
            )
        listed = marker_files(out) if entries else {}
        if None in listed.values():
            raise ValueError(
                f"--out {shown}{here} holds an export by an older tidar-convert, whose {MARKER} records no sizes or hashes, so "
                "whether you changed any of its files cannot be told. Nothing was written or deleted. Check the folder and "
                "delete it yourself, or choose a new folder."
            )
        if entries and not overwrite:
            raise ValueError(f"--out {shown} holds an earlier export; pass --overwrite to replace it, or choose a new folder.")
        changed = changed_files(out) if entries else []  # reads every file: only once it would be replaced
        if changed:
            were = "was" if len(changed) == 1 else "were"
            raise ValueError(
                f"--out {shown}{here} holds an earlier export, but {_listing(changed)} {were} changed after the export wrote "
                f"{'it' if len(changed) == 1 else 'them'} (size or sha256 differ from {MARKER}). Nothing was written or deleted. "
                "Move what you want to keep out of the folder, or choose a new folder; --overwrite only replaces an export as it was written."
            )
        if os.path.ismount(out):
            raise ValueError(f"--out {shown} is a mount point, which cannot be replaced atomically; export into a folder inside it.")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--out {shown}: {parent} is a file, so no folder can be made under it; choose another path.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"--out {shown}: {parent} is not writable by this user; choose a folder you can write to.")
    return out

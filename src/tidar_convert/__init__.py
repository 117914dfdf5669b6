"""tidar-convert: turn a Hugging Face causal LM into a TiDAR model (arXiv 2511.08923).

    from tidar_convert import load
    model = load("out/")             # TiDAR generate(), no remote code needed
    model.generate(**inputs, max_new_tokens=64); model.tidar_stats

The folders, by role (docs/development.md maps them): runtime/ (what an export runs), models/,
exports/, data/, train/, bench/, and cli.py on top.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

try:
    __version__ = _version("tidar-convert")
except PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"

__all__ = ["__version__", "export", "generate", "load"]


def __getattr__(name: str):
    # Lazy, so that `tidar-convert --help` and `import tidar_convert.cli` do not pay for torch.
    if name == "generate":
        from tidar_convert.runtime.generate import generate

        return generate
    if name in ("export", "load"):
        from tidar_convert.exports import folder

        return getattr(folder, name)
    raise AttributeError(f"module 'tidar_convert' has no attribute {name!r}")

"""tidar-convert: turn a Hugging Face causal LM into a TiDAR model (arXiv 2511.08923).

    from tidar_convert import load
    model = load("out/")             # TiDAR generate(), no remote code needed
    model.generate(**inputs, max_new_tokens=64); model.tidar_stats

The pieces: layout (masks, positions, labels), loss, loading, data, module (Lightning), decode,
export, cli, bench.
"""

from .decode import generate
from .export import export, load

__all__ = ["export", "generate", "load"]

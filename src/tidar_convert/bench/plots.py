"""The bench's plots (matplotlib, Agg: no display needed)."""

from __future__ import annotations

from pathlib import Path

COLORS = ("#888888", "#4c72b0", "#dd8452", "#c44e52", "#8172b3", "#55a868", "#937860")
MARK_COLORS = ("#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")
MARKERS = ("D", "s", "^", "v", "o", "P", "X")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_tokens_per_s(summary: dict, path: Path, title: str) -> Path:
    plt = _pyplot()
    decoders = list(summary)
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(decoders)), 3.5))
    speeds = [summary[d]["tokens_per_s"] for d in decoders]
    bars = ax.bar(
        [d.replace("_", "\n") for d in decoders],
        speeds,
        color=[COLORS[i % len(COLORS)] for i in range(len(decoders))],
    )
    for bar, d in zip(bars, decoders):
        s = summary[d]
        ax.annotate(
            f"{s['tokens_per_s_vs_ar']:.2f}x\n{s['tokens_per_nfe']:.2f} T/NFE",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("tokens / s (batch 1, greedy)")
    ax.set_title(title, fontsize=9)
    ax.margins(y=0.25)
    return _save(fig, path)


def plot_accepted(histogram: dict[str, int], path: Path, title: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([int(j) for j in histogram], list(histogram.values()), color="#dd8452")
    ax.set_xlabel("tokens committed per TiDAR step (1 + drafts accepted)")
    ax.set_ylabel("steps")
    ax.set_title(title, fontsize=9)
    if not any(histogram.values()):  # e.g. every generation stopped at the prefill
        ax.text(0.5, 0.5, "no decode steps", transform=ax.transAxes, ha="center")
    return _save(fig, path)


def plot_slots(
    points: list[dict],
    path: Path,
    title: str,
    full_step: int | None = None,
    steps: dict | None = None,
    stock: list[dict] | None = None,
    packed: list[dict] | None = None,
) -> Path:
    """The latency curve; a dashed line at TiDAR's full step (k + k*k slots) and one labelled marker
    per decoder at its mean step (slots_per_step, latency on the curve: `slots.decoder_steps`).
    points: generate()'s default kernels; stock, packed: the same curve on PyTorch's stock CPU
    product and on packed weights alone (kernels.py), drawn faint beside it."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    slots = [p["slots"] for p in points]
    ax.plot(slots, [p["ms"] for p in points], marker="o", color="#4c72b0", label="one forward")
    if stock:
        ax.plot(
            [p["slots"] for p in stock],
            [p["ms"] for p in stock],
            marker=".",
            color="#999999",
            label="one forward, stock PyTorch product",
        )
    if packed:
        ax.plot(
            [p["slots"] for p in packed],
            [p["ms"] for p in packed],
            marker=".",
            linestyle=":",
            color="#999999",
            label="one forward, packed weights",
        )
    ax.set_xscale("log", base=2)
    # powers of 2: labels of 64 and 72 would overlap
    ticks = [n for n in slots if n & (n - 1) == 0 or n == full_step]
    ax.set_xticks(ticks, [str(n) for n in ticks])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("query slots in one forward")
    ax.set_ylabel("latency (ms)")
    if full_step:
        ax.axvline(
            full_step,
            color="#555555",
            linestyle="--",
            label=f"full TiDAR step: k + k*k = {full_step}",
        )
    # shapes differ too: decoders at one spot stay visible
    for i, (decoder, at) in enumerate((steps or {}).items()):
        ax.plot(
            [at["slots_per_step"]],
            [at["ms"]],
            marker=MARKERS[i % len(MARKERS)],
            markersize=8,
            fillstyle="none",
            mew=1.5,
            linestyle="none",
            color=MARK_COLORS[i % len(MARK_COLORS)],
            label=f"{decoder}: {at['slots_per_step']:.1f} slots/step",
        )
    if full_step or steps or stock or packed:
        ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


# The README's figure: the rows of its table, in its order, with its names.
FIGURE_ROWS = {
    "ar": "AR",
    "prompt_lookup": "transformers prompt lookup",
    "tidar": "TiDAR, defaults",
    "tidar_lookup": "TiDAR, lookup drafts",
    "tidar_chain": "TiDAR, chain (no siblings)",
    "tidar_diffusion": "TiDAR, diffusion drafts only",
}


def plot_against(summary: dict, path: Path, title: str) -> Path:
    """Tokens per forward and speed against AR for each decoder of a bench record, prompt
    lookup's speed marked: the two comparisons every figure of this project reports."""
    plt = _pyplot()
    rows = [d for d in FIGURE_ROWS if d in summary][::-1]  # top to bottom in the table's order
    labels = [FIGURE_ROWS[d] for d in rows]
    colors = ["#c44e52" if d == "tidar" else "#888888" for d in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 0.45 * len(rows) + 1.2), sharey=True)
    nfe = [summary[d]["tokens_per_nfe"] for d in rows]
    left.barh(labels, nfe, color=colors)
    left.set_xlabel("tokens per forward pass (T/NFE)")
    speed = [summary[d]["tokens_per_s_vs_ar"] for d in rows]
    right.barh(labels, speed, color=colors)
    right.axvline(1.0, color="black", linewidth=0.8)
    if "prompt_lookup" in summary:
        right.axvline(
            summary["prompt_lookup"]["tokens_per_s_vs_ar"],
            color="#4c72b0",
            linestyle="--",
            linewidth=0.8,
            label="prompt lookup",
        )
        right.legend(fontsize=7, loc="lower right")
    right.set_xlabel("tokens / s against AR")
    for ax, values, unit in ((left, nfe, ""), (right, speed, "x")):
        for y, value in enumerate(values):
            ax.annotate(f" {value:.2f}{unit}", (value, y), va="center", fontsize=7)
        ax.margins(x=0.2)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def figure_cmd(record: str, out: str) -> Path:
    """A bench record's figure (plot_against): python -m tidar_convert.bench.plots RECORD PNG"""
    import json

    data = json.loads(Path(record).read_text())
    machine = data["machine"]
    title = (
        f"{data['name']}: {data['prompts']} prompts, greedy, batch 1, {machine['dtype']}, "
        f"{machine['threads']} threads ({Path(record).name})"
    )
    return plot_against(data["summary"], Path(out), title)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


if __name__ == "__main__":
    import sys

    print(figure_cmd(*sys.argv[1:3]))

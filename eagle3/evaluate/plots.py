"""PNG plots of a run: the training loss, acceptance by draft position, and the served sweep's speedup.

matplotlib with its Agg backend (no display needed), imported lazily; each plot is
written atomically (temporary name in the same folder, then renamed).
"""

from __future__ import annotations

import os
from pathlib import Path

LOSS_PNG = "training_loss.png"
ACCEPTANCE_PNG = "acceptance_by_position.png"
SWEEP_PNG = "served_speedup.png"


def _pyplot():  # noqa: ANN202 - the matplotlib.pyplot module
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:  # noqa: ANN001 - a matplotlib Figure
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path


def plot_training_loss(entries: list[dict], evals: list[dict], path: Path, chosen: str = "") -> Path:
    """Loss per step (total and per TTT step) from losses.jsonl entries; held-out acceptance of
    each checkpoint (evals.jsonl: simulated and the walk) on a second axis when there is any, the
    `chosen` checkpoint (the one exported) starred."""
    if not entries:
        raise ValueError("no losses.jsonl entries to plot; was the train stage run?")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [e["step"] for e in entries]
    ax.plot(steps, [e["loss"] for e in entries], color="black", linewidth=1.5, label="loss (mean over TTT steps)")
    for j in range(len(entries[0].get("loss_per_ttt_step", []))):
        ax.plot(steps, [e["loss_per_ttt_step"][j] for e in entries], linewidth=0.8, alpha=0.7, label=f"TTT step {j + 1}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("KL(target || draft)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if evals:
        right = ax.twinx()
        right.plot([e["step"] for e in evals], [e["acceptance_length"] for e in evals], "o--", color="tab:red",
                   label="held-out acceptance, every position (checkpoints)")
        walked = [e for e in evals if "walk" in e]
        if walked:
            right.plot([e["step"] for e in walked], [e["walk"] for e in walked], "s-", color="tab:purple",
                       label="held-out walk (served positions)")
        picked = [e for e in evals if e.get("checkpoint") == chosen]
        if picked:
            right.plot([picked[0]["step"]], [picked[0].get("walk", picked[0]["acceptance_length"])], "*",
                       color="gold", markeredgecolor="black", markersize=16, label="exported checkpoint")
        right.set_ylabel("simulated acceptance length")
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, fontsize=8, loc="upper right")
    ax.set_title("Draft training")
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)


def plot_acceptance(simulated: list[float], served: list[float] | None, path: Path) -> Path:
    """Per-position acceptance (share of drafts with more than j tokens accepted), simulated vs served."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    positions = list(range(1, len(simulated) + 1))
    width = 0.38 if served is not None else 0.6
    ax.bar([p - (width / 2 if served is not None else 0) for p in positions], simulated, width,
           label="simulated (held-out states)")
    if served is not None:
        ax.bar([p + width / 2 for p in positions], served, width, label="served (vLLM's counters)")
    ax.set_xticks(positions)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted share of drafts")
    ax.set_ylim(0, 1)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Acceptance by draft position")
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)


def plot_served_sweep(rows: list[dict], path: Path) -> Path:
    """The served sweep's speedup (tokens/s with the draft over without) against concurrency, a line per k, with
    the break-even at 1.0: the plot of acceptance.md's "Speed per concurrency and k" table. `rows`: dicts with k,
    concurrency and speedup (SweepReport.to_dict()["rows"])."""
    if not rows:
        raise ValueError("no served sweep rows to plot; was eval.served_concurrency or eval.served_k set?")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for k in sorted({r["k"] for r in rows}):
        mine = sorted((r for r in rows if r["k"] == k), key=lambda r: r["concurrency"])
        ax.plot([r["concurrency"] for r in mine], [r["speedup"] for r in mine], "o-", label=f"k={k}")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="target alone")
    concurrencies = sorted({r["concurrency"] for r in rows})
    if len(concurrencies) > 1 and concurrencies[-1] / concurrencies[0] >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.set_xlabel("concurrency (requests decoding together)")
    ax.set_ylabel("speedup (tokens/s with draft / without)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Served speedup per concurrency and num_speculative_tokens")
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)

"""The benchmarks' figures (matplotlib, written as PNG without a display)."""

from __future__ import annotations

from pathlib import Path

COLOURS = {"clean": "tab:green", "undefended": "tab:red", "defended": "tab:blue"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(row: dict, title: str, path: Path) -> None:
    """Three panels over global steps: validation loss of the clean, undefended and defended runs; their difference
    to the clean run in percent (the curves overlap on the first panel); and the defended run's flags per step and
    the most strikes any honest sender or attacker held. The attack start and every ban are marked."""
    plt = _pyplot()
    fig, (loss_ax, diff_ax, flag_ax) = plt.subplots(
        3, 1, figsize=(7, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2, 2]}
    )
    curves = row["curves"]
    clean = dict(curves["clean"])
    for label, style in (("clean", "-"), ("undefended", "--"), ("defended", "-.")):
        steps, losses = zip(*curves[label], strict=True)
        loss_ax.plot(steps, losses, style, color=COLOURS[label], label=label)
        if label != "clean":
            diff = [(s, 100 * (v / clean[s] - 1)) for s, v in curves[label] if s in clean]
            diff_ax.plot(*zip(*diff, strict=True), style, marker=".", color=COLOURS[label], label=f"{label} - clean")
    loss_ax.set_yscale("log")
    loss_ax.set(title=title, ylabel="validation loss (log scale)")
    diff_ax.axhline(0, color="grey", lw=0.6)
    diff_ax.set(ylabel="vs clean (%)")

    timeline = row.get("timeline", [])
    if timeline:
        steps = [c["step"] + 1 for c in timeline]
        flag_ax.bar(steps, [c["flags_honest"] for c in timeline], width=1.0, color="tab:olive", label="flags, honest")
        flag_ax.bar(
            steps,
            [c["flags_attacker"] for c in timeline],
            width=1.0,
            bottom=[c["flags_honest"] for c in timeline],
            color="tab:purple",
            label="flags, attackers",
        )
        strike_ax = flag_ax.twinx()
        strike_ax.step(steps, [c["strikes_honest"] for c in timeline], where="post", color="tab:olive", ls=":")
        strike_ax.step(steps, [c["strikes_attacker"] for c in timeline], where="post", color="tab:purple", ls=":")
        strike_ax.set_ylabel("most strikes held (dotted)")
        strike_ax.set_ylim(bottom=0)
    flag_ax.set(xlabel="global step", ylabel="flags per step (defended)")

    start = row.get("attack_start")
    for ax in (loss_ax, diff_ax, flag_ax):
        if start is not None:
            ax.axvline(start, color="black", lw=0.9, ls="--")
        for ban in row.get("bans", {}).values():
            ax.axvline(ban["step"] + 1, color="tab:purple", lw=0.8, ls=":")
    if start is not None:
        loss_ax.annotate(
            "attack starts",
            (start, 1),
            xycoords=("data", "axes fraction"),
            xytext=(3, -12),
            textcoords="offset points",
            fontsize=8,
        )
    for i, (worker, ban) in enumerate(row.get("bans", {}).items()):
        loss_ax.annotate(
            f"{worker} banned",
            (ban["step"] + 1, 1),
            xycoords=("data", "axes fraction"),
            xytext=(3, -24 - 10 * i),
            textcoords="offset points",
            fontsize=8,
            color="tab:purple",
        )
    loss_ax.legend(fontsize=8, loc="lower left")
    diff_ax.legend(fontsize=8, loc="upper left")
    flag_ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_family(family: str, about: str, parameter: str, points: list[dict], path: Path) -> None:
    """F1 and damage against strength for one attack family, activations and gradients apart. Damage is the
    validation loss over the clean run's, in percent, undefended (dashed) and defended (solid)."""
    plt = _pyplot()
    fig, (f1_ax, damage_ax) = plt.subplots(2, 1, figsize=(6, 5.5), sharex=True)
    for target, marker in (("activation", "o"), ("gradient", "s")):
        mine = sorted((p for p in points if p["target"] == target), key=lambda p: p["strength"])
        if not mine:
            continue
        x = [p["strength"] for p in mine]
        f1_ax.plot(x, [p["f1"] for p in mine], marker=marker, label=f"{target}s")
        (line,) = damage_ax.plot(
            x, [p["damage"]["undefended"] for p in mine], "--", marker=marker, label=f"{target}s, undefended"
        )
        damage_ax.plot(
            x,
            [p["damage"]["defended"] for p in mine],
            "-",
            marker=marker,
            color=line.get_color(),
            label=f"{target}s, defended",
        )
    f1_ax.set(title=f"{family}: {about}", ylabel="F1 (bans)", ylim=(-0.05, 1.05))
    damage_ax.axhline(0.5, color="grey", lw=0.7, ls=":")
    damage_ax.axhline(0, color="grey", lw=0.6)
    damage_ax.set(xlabel=parameter, ylabel="val loss vs clean (%)")
    damage_ax.set_yscale("symlog", linthresh=1.0)
    f1_ax.legend(fontsize=8)
    damage_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

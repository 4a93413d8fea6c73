"""The soak's table (warm vs end figures per process) and its plot (RSS change and open files over time)."""

from pathlib import Path

from bench.soak.procstat import Sample


def markdown(result: dict) -> str:
    lines = [
        (
            "| process | RSS start (MB) | RSS warm (MB) | RSS end (MB) | growth (MB) | slope (MB/min) "
            "| files start | files warm (floor) | files end (floor) | files slope (/min) | flat |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, t in result["processes"].items():
        if "warm_rss_mb" not in t:
            lines.append(f"| {name} | | | | | | | | | | no: {t['why']} |")
            continue
        verdict = ("yes" if t["flat"] else f"**no**: {t['why']}") if not t.get("infra") else "(infra)"
        rss_slope, files_slope = t["rss_slope_mb_per_min"] or 0.0, t["open_files_slope_per_min"] or 0.0
        lines.append(
            f"| {name} | {t['start_rss_mb']:.0f} | {t['warm_rss_mb']:.1f} | {t['end_rss_mb']:.1f} "
            f"| {t['rss_growth_mb']:+.1f} | {rss_slope:+.3f} | {t['start_open_files']} "
            f"| {t['warm_open_files']:.0f} | {t['end_open_files']:.0f} | {files_slope:+.3f} | {verdict} |"
        )
    return "\n".join(lines)


def plot(samples: dict[str, list[Sample]], warmup_s: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rss, files) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, series in samples.items():
        minutes = [s.t_s / 60 for s in series]
        rss.plot(minutes, [s.rss_mb - series[0].rss_mb for s in series], label=f"{name} ({series[0].rss_mb:.0f} MB)")
        files.plot(minutes, [s.open_files for s in series], label=name)
    for ax, label in ((rss, "RSS change since the first sample (MB)"), (files, "open files")):
        ax.axvline(warmup_s / 60, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("minutes (dashed: end of warm-up)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    rss.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

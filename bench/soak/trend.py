"""Is a process's footprint flat after warm-up? Its figures at the end of warm-up and at the end of
the run, each over a window so one sample decides nothing: the median RSS, and the fewest open files
(connections of requests in flight come and go; a leak raises the floor). Slopes are least squares."""

import statistics
from dataclasses import dataclass

from bench.soak.procstat import Sample


@dataclass(frozen=True, slots=True)
class Tolerance:
    rss_mb: float = 20.0  # growth allowed after warm-up, MB...
    rss_pct: float = 2.0  # ...or this share of the warm figure, whichever is larger
    open_files: int = 4


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per minute; None under two distinct times."""
    if len({t for t, _ in points}) < 2:
        return None
    mean_t = statistics.fmean(t for t, _ in points)
    mean_v = statistics.fmean(v for _, v in points)
    num = sum((t - mean_t) * (v - mean_v) for t, v in points)
    den = sum((t - mean_t) ** 2 for t, _ in points)
    return num / den * 60


def _window(samples: list[Sample], begin_s: float, end_s: float) -> list[Sample]:
    inside = [s for s in samples if begin_s <= s.t_s <= end_s]
    return inside or samples[-1:]


def trend(
    samples: list[Sample], *, warmup_s: float, window_s: float, last_s: float, interval_s: float, tol: Tolerance
) -> dict:
    """Warm (just after warm-up) vs end figures, growth, slopes after warm-up, and the verdict ``flat``.

    ``last_s`` is when the run's last sample was taken: a process missing from it has exited, never flat."""
    after = [s for s in samples if s.t_s >= warmup_s]
    if not after:
        return {"samples": len(samples), "flat": False, "why": "no sample after warm-up (the process died?)"}
    warm = _window(after, warmup_s, warmup_s + window_s)
    end = _window(after, after[-1].t_s - window_s, after[-1].t_s)
    warm_rss, end_rss = statistics.median(s.rss_mb for s in warm), statistics.median(s.rss_mb for s in end)
    warm_files, end_files = min(s.open_files for s in warm), min(s.open_files for s in end)
    rss_growth, files_growth = end_rss - warm_rss, end_files - warm_files
    result = {
        "samples": len(samples),
        "start_rss_mb": samples[0].rss_mb,
        "warm_rss_mb": warm_rss,
        "end_rss_mb": end_rss,
        "max_rss_mb": max(s.rss_mb for s in samples),
        "rss_growth_mb": rss_growth,
        "rss_slope_mb_per_min": slope_per_min([(s.t_s, s.rss_mb) for s in after]),
        "start_open_files": samples[0].open_files,
        "warm_open_files": warm_files,
        "end_open_files": end_files,
        "max_open_files": max(s.open_files for s in samples),
        "open_files_growth": files_growth,
        "open_files_slope_per_min": slope_per_min([(s.t_s, float(s.open_files)) for s in after]),
    }
    rss_allowed = max(tol.rss_mb, warm_rss * tol.rss_pct / 100)
    problems = []
    if samples[-1].t_s < last_s - 1.5 * interval_s:
        problems.append(f"last sampled at {samples[-1].t_s:.0f} s of {last_s:.0f} s: it exited")
    if rss_growth > rss_allowed:
        problems.append(f"RSS grew {rss_growth:.1f} MB after warm-up (allowed {rss_allowed:.1f})")
    if files_growth > tol.open_files:
        problems.append(f"open files grew by {files_growth:.0f} (allowed {tol.open_files})")
    return result | {"flat": not problems, "why": "; ".join(problems)}

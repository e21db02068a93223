"""PNGs from pdbench sweep JSON files (matplotlib, Agg backend; imported only by `plot`).

attainment.png: SLO attainment vs request rate, one line per file, one panel per variant,
the goodput target as a dashed line. ttft_cdf.png / itl_cdf.png: the empirical CDF of
TTFT and of every inter-token gap (successful measured requests), one curve per file, at
the rate of each file closest to the chosen one.
"""

from __future__ import annotations

import json
from pathlib import Path

from .http_stream import PdbenchError
from .stats import LEGACY_SLO_VARIANTS, SLO_VARIANT_TEXT, SLO_VARIANTS, run_rate, staircase_drain_shares

# A staircase window whose requests spent more than this share of their lifetime after the last
# arrival (load only falling) is drawn hollow: its attainment is optimistic.
OPTIMISTIC_DRAIN_SHARE = 0.10



def _normalise(document: dict) -> None:
    """Files of the first format name two variants mean_itl / p99_itl and have no realised rate."""
    for run in document["runs"]:
        for old, new in LEGACY_SLO_VARIANTS.items():
            if old in run.get("slo", {}):
                run["slo"][new] = run["slo"].pop(old)


def load_sweep(path: Path) -> dict:
    try:
        document = json.loads(path.read_text())
    except OSError as error:
        raise PdbenchError(f"cannot read {path}: {error.strerror}") from None
    except ValueError as error:
        raise PdbenchError(f"{path} is not JSON: {error}") from None
    if not isinstance(document, dict) or "pdbench" not in document or not document.get("runs"):
        raise PdbenchError(f"{path} is not a pdbench result with runs")
    _normalise(document)
    return document


def _finite_runs(document: dict) -> list[dict]:
    return sorted((r for r in document["runs"] if r.get("request_rate") is not None), key=lambda r: r["request_rate"])


def _closest_run(document: dict, rate: float) -> dict:
    runs = _finite_runs(document)
    if not runs:
        raise PdbenchError(f"{document['_label']}: no run with a finite request rate")
    return min(runs, key=lambda r: abs(r["request_rate"] - rate))


def _measured_requests(run: dict, label: str) -> list[dict]:
    if "requests" not in run:
        raise PdbenchError(f"{label}: the JSON has no per-request data; rerun with --save-requests")
    return [r for r in run["requests"] if r["ok"] and not r["warmup"]]


def optimistic_rates(document: dict) -> set[float]:
    """Request rates of the staircase windows whose requests spent more than
    OPTIMISTIC_DRAIN_SHARE of their lifetime after the last arrival."""
    shares = staircase_drain_shares(document) or []
    return {r["request_rate"] for r, share in zip(document["runs"], shares)
            if share is not None and share > OPTIMISTIC_DRAIN_SHARE and r.get("request_rate") is not None}


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(values)
    count = len(ordered)
    return ordered, [(i + 1) / count for i in range(count)]


def plot_files(paths: list[Path], labels: list[str] | None, out_dir: Path, cdf_rate: float | None) -> list[Path]:
    if labels is not None and len(labels) != len(paths):
        raise PdbenchError(f"--labels names {len(labels)} configurations for {len(paths)} files")
    documents = [load_sweep(p) for p in paths]
    for index, (path, document) in enumerate(zip(paths, documents)):
        document["_label"] = labels[index] if labels else (document.get("label") or path.stem)
    if cdf_rate is None:
        first = _finite_runs(documents[0])
        if not first:
            raise PdbenchError(f"{paths[0]}: no run with a finite request rate; pass --cdf-rate")
        cdf_rate = first[len(first) // 2]["request_rate"]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    figure, axes = plt.subplots(1, len(SLO_VARIANTS), figsize=(6 * len(SLO_VARIANTS), 4.5), sharey=True)
    any_hollow = False
    for axis, variant in zip(axes, SLO_VARIANTS):
        for document in documents:
            optimistic = optimistic_rates(document)
            runs = sorted((r for r in _finite_runs(document) if variant in r.get("slo", {})), key=run_rate)
            if runs:
                xs = [run_rate(r) for r in runs]
                ys = [100.0 * r["slo"][variant]["attainment"] for r in runs]
                (line,) = axis.plot(xs, ys, label=document["_label"])
                for x, y, r in zip(xs, ys, runs):
                    hollow = r["request_rate"] in optimistic
                    any_hollow = any_hollow or hollow
                    axis.plot([x], [y], marker="o", color=line.get_color(),
                              markerfacecolor="none" if hollow else line.get_color())
                    interval = r["slo"][variant].get("interval")
                    if interval:  # the bootstrap 95 % interval as a vertical bar
                        axis.plot([x, x], [100.0 * interval[0], 100.0 * interval[1]], color=line.get_color(),
                                  linewidth=1)
        target = documents[0]["config"].get("goodput_target", 0.9)
        axis.axhline(100.0 * target, color="grey", linestyle="--", linewidth=1)
        axis.set_title(f"{SLO_VARIANT_TEXT[variant]} within SLO")
        axis.set_xlabel("realised request rate (req/s)")
        axis.set_ylim(-2, 102)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("requests within SLO (%)")
    slo = documents[0]["config"].get("slo", {})
    note = (f"\nhollow: a staircase window whose requests spent > {100 * OPTIMISTIC_DRAIN_SHARE:.0f} % of their "
            "lifetime after the last arrival (optimistic)") if any_hollow else ""
    figure.suptitle(f"SLO attainment (TTFT <= {slo.get('ttft_ms')} ms, ITL <= {slo.get('itl_ms')} ms){note}")
    axes[0].legend()
    figure.tight_layout()
    written.append(out_dir / "attainment.png")
    figure.savefig(written[-1], dpi=120)
    plt.close(figure)

    for metric, title, file_name in (("ttft_ms", "TTFT", "ttft_cdf.png"), ("itl_ms", "inter-token latency",
                                                                            "itl_cdf.png")):
        figure, axis = plt.subplots(figsize=(7, 4.5))
        for document in documents:
            run = _closest_run(document, cdf_rate)
            requests = _measured_requests(run, document["_label"])
            if metric == "itl_ms":
                values = [gap for r in requests for gap in r["itl_ms"]]
            else:
                values = [r["ttft_ms"] for r in requests if r["ttft_ms"] is not None]
            if values:
                xs, ys = _cdf(values)
                axis.step(xs, ys, where="post", label=f"{document['_label']} @ {run['request_rate']:g} req/s")
        limit = documents[0]["config"].get("slo", {}).get(metric)
        if limit:
            axis.axvline(limit, color="grey", linestyle="--", linewidth=1, label=f"SLO {limit:g} ms")
        axis.set_xscale("log", nonpositive="clip")  # a 0 ms gap (two chunks in one read) sits at the left edge
        axis.set_xlabel(f"{title} (ms, log scale)")
        axis.set_ylabel("fraction of " + ("requests" if metric == "ttft_ms" else "gaps"))
        axis.set_title(f"{title} CDF at ~{cdf_rate:g} req/s")
        axis.grid(alpha=0.3, which="both")
        axis.legend()
        figure.tight_layout()
        written.append(out_dir / file_name)
        figure.savefig(written[-1], dpi=120)
        plt.close(figure)
    return written

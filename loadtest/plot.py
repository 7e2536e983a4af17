"""Plot switchyard-bench compare results: TTFT CDF per router (every seed's requests pooled), and
median TTFT p90 vs load from the capacity search (the rates its bisection probed). Usage:
plot.py RESULTS.json OUT_DIR. Needs matplotlib (scripts/test.sh installs it into .venv); the
file names alone do not."""

import json
import pathlib
import sys


def cdf_name(workload: str, report: dict) -> str:
    """The CDF's file name. A capacity search's results are its closed-loop run, not a run at
    the compare's rate: their plot is named apart, so a search written next to an every-router
    run of the same workload (one results folder) does not replace that run's plot."""
    suffix = "-capacity" if report.get("capacity") else ""
    return f"ttft-cdf-{workload}{suffix}.png"


def main(results_path: str, out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads(pathlib.Path(results_path).read_text())
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for workload, report in results.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        # One entry per (seed, router) run: pool each router's seeds into one CDF.
        pooled: dict[str, list[float]] = {}
        for run in report["results"]:
            pooled.setdefault(run["router"], []).extend(run["ttfts"])
        for router, ttfts in pooled.items():
            if not ttfts:
                continue
            ttfts = sorted(ttfts)
            ys = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
            p50 = ttfts[max(0, (len(ttfts) + 1) // 2 - 1)]
            ax.step(ttfts, ys, where="post", label=f"{router} (p50 {p50:.2f}s)")
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (model seconds)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"TTFT CDF, {workload}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        cdf = out / cdf_name(workload, report)
        fig.savefig(cdf, dpi=120)
        plt.close(fig)
        print(cdf)

        capacity = report.get("capacity") or {}
        if capacity:
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for router, sweep in capacity.items():
                points = sweep["points"]
                ax.plot([p["rate"] for p in points], [p["ttft_p90"] for p in points], marker="o",
                        label=f'{router} (capacity {sweep["capacity"]:.2f}/s)')
            ax.set_xlabel("arrival rate (requests per model second)")
            ax.set_ylabel("TTFT p90, median over seeds (model seconds)")
            ax.set_yscale("log")
            ax.set_title(f"TTFT vs load, {workload}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
            fig.tight_layout()
            fig.savefig(out / f"ttft-vs-load-{workload}.png", dpi=120)
            plt.close(fig)
            print(out / f"ttft-vs-load-{workload}.png")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

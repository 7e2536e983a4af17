"""Markdown tables of switchyard-bench compare results, as the README shows them: one table per
workload (client TTFT medians over the seeds with their range, the workers' own TTFT, hit rate,
ratios against random), a line of switchyard over the best other router and over the oracle (and,
where every seed kept its requests' TTFTs, the same over all seeds' requests pooled), and the
capacity search when it ran; where the results keep each request's TTFT, a table of the
requests slower than a threshold. Several files are read as one run per seed: each workload's
per-seed results together, medians over all their seeds. Usage: tables.py RESULTS.json
[MORE.json ...] [--slow SECONDS] (default 0.2). Standard library only."""

import argparse
import json
import pathlib

from proxy_logs import quantile


def is_other(router: str) -> bool:
    """A router switchyard is measured against: not switchyard (one proxy or replicas), not the
    oracle (it reads the simulator's true state; no one can run it)."""
    return not router.startswith("switchyard") and router != "oracle"


def cell(spread: dict, seeds: int) -> str:
    if seeds > 1:
        return f"{spread['median']:.3f} ({spread['min']:.2f}–{spread['max']:.2f})"
    return f"{spread['median']:.3f}"


def ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs > 0 else "n/a"


def first_seen(names) -> list[str]:
    """Each name once, in the order it first appears."""
    return list(dict.fromkeys(names))


def seed_list(seeds: list[int]) -> str:
    """"1–3" for a run of seeds, else "1, 4, 5"."""
    seeds = sorted(seeds)
    if len(seeds) > 1 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}–{seeds[-1]}"
    return ", ".join(map(str, seeds))


def workload_table(name: str, report: dict) -> list[str]:
    summaries = report["summary"]
    seeds = max((len(s["seeds"]) for s in summaries), default=1)
    # Mean client TTFT: in results from 2026-12-04 on (older files have none).
    has_mean = all("ttft_mean" in s for s in summaries)
    mean_head, mean_rule = (" mean |", "---|") if has_mean else ("", "")
    lines = [
        f"| {name} | TTFT p50 | p90 | p99 |{mean_head} eng mean | eng p90 | hit rate | p50 x | p90 x |",
        f"|---|---|---|---|{mean_rule}---|---|---|---|---|",
    ]
    for s in summaries:
        router = f"**{s['router']}**" if s["router"] == "switchyard" else s["router"]
        if len(s["seeds"]) < seeds:
            router += f" (seeds {seed_list(s['seeds'])})"
        vs = [s.get("ttft_p50_vs_random"), s.get("ttft_p90_vs_random")]
        vs = [f"{v:.2f}" if isinstance(v, (int, float)) else "–" for v in vs]
        lines.append(
            f"| {router} | {cell(s['ttft_p50'], seeds)} | {cell(s['ttft_p90'], seeds)} "
            f"| {s['ttft_p99']['median']:.3f} "
            + (f"| {cell(s['ttft_mean'], seeds)} " if has_mean else "")
            + f"| {s['engine_ttft_mean']['median']:.3f} "
            f"| {s['engine_ttft_p90']['median']:.3f} | {s['cache_hit_rate']['median'] * 100:.1f}% "
            f"| {vs[0]} | {vs[1]} |"
        )
    by_router = {s["router"]: s for s in summaries}
    ours = by_router.get("switchyard")
    # Medians compared over the same seeds only (merged files may give some routers fewer).
    others = [s for s in summaries
              if is_other(s["router"]) and ours and s["seeds"] == ours["seeds"]]
    if ours and others:
        best50 = min(others, key=lambda s: s["ttft_p50"]["median"])
        best90 = min(others, key=lambda s: s["ttft_p90"]["median"])
        line = (
            f"\nswitchyard / best other router: p50 "
            f"{ratio(ours['ttft_p50']['median'], best50['ttft_p50']['median'])} ({best50['router']}), "
            f"p90 {ratio(ours['ttft_p90']['median'], best90['ttft_p90']['median'])} ({best90['router']})"
        )
        if has_mean:
            best_mean = min(others, key=lambda s: s["ttft_mean"]["median"])
            line += (
                f", mean {ratio(ours['ttft_mean']['median'], best_mean['ttft_mean']['median'])} "
                f"({best_mean['router']})"
            )
        oracle = by_router.get("oracle")
        if oracle:
            line += (
                f"; / oracle: p50 {ratio(ours['ttft_p50']['median'], oracle['ttft_p50']['median'])}, "
                f"p90 {ratio(ours['ttft_p90']['median'], oracle['ttft_p90']['median'])}"
            )
            if has_mean:
                line += f", mean {ratio(ours['ttft_mean']['median'], oracle['ttft_mean']['median'])}"
        replicas = by_router.get("switchyard-2")
        if replicas:
            line += (
                f"; 2 replicas / 1: p50 {ratio(replicas['ttft_p50']['median'], ours['ttft_p50']['median'])}, "
                f"p90 {ratio(replicas['ttft_p90']['median'], ours['ttft_p90']['median'])}"
            )
            if has_mean:
                line += f", mean {ratio(replicas['ttft_mean']['median'], ours['ttft_mean']['median'])}"
        # The same p90s over every seed's requests pooled: a seed's p90 on a bursty tail jumps
        # between runs of the same code; the pooled one much less.
        # (The bench writes null for a router whose clients saw no first token.)
        pooled = "ttft_p90_pooled"

        def has(summary) -> bool:
            return bool(summary) and isinstance(summary.get(pooled), (int, float))

        if all(has(s) for s in [ours] + others):
            best = min(others, key=lambda s: s[pooled])
            line += f"; pooled p90: {ratio(ours[pooled], best[pooled])} ({best['router']})"
            if has(oracle):
                line += f", / oracle {ratio(ours[pooled], oracle[pooled])}"
            if has(replicas):
                line += f", 2 replicas / 1 {ratio(replicas[pooled], ours[pooled])}"
        lines.append(line + ".")
    return lines


def capacity_table(results: dict) -> list[str]:
    rows = [(name, report["capacity"]) for name, report in results.items() if report.get("capacity")]
    if not rows:
        return []
    routers = first_seen(r for _, capacity in rows for r in capacity)
    lines = [
        "| workload | " + " | ".join(routers) + " | switchyard / best other |",
        "|---|" + "---|" * (len(routers) + 1),
    ]
    for name, capacity in rows:
        values = {r: c["capacity"] for r, c in capacity.items()}
        # Passing the highest rate probed only says the capacity is at least that.
        at_least = {r for r, c in capacity.items()
                    if c["capacity"] >= max((p["rate"] for p in c["points"]), default=0.0)}
        others = [v for r, v in values.items() if is_other(r)]
        best = max(others, default=0.0)
        ours = values.get("switchyard")
        lines.append(
            f"| {name} | "
            + " | ".join((("≥ " if r in at_least else "") + f"{values[r]:.2f}") if r in values else "–"
                         for r in routers)
            + f" | {('≥ ' if 'switchyard' in at_least else '') + ratio(ours, best) if ours is not None else 'n/a'} |"
        )
    return lines


def slow_table(results: dict, threshold: float) -> list[str]:
    """Per workload and router: the requests whose TTFT is over `threshold` model seconds, seed by
    seed (and their sum), and the sum of every TTFT over the seeds. Where a few cold prefills sit
    near the 90th percentile, a seed's p90 jumps with one request on either side of it; these
    counts say how many requests each router actually left slow."""
    rows: dict[str, dict[str, list[tuple[int, list[float]]]]] = {}
    for name, report in results.items():
        for r in report.get("results", []):
            if r.get("ttfts"):
                rows.setdefault(name, {}).setdefault(r["router"], []).append((r["seed"], r["ttfts"]))
    if not rows:
        return []
    routers = first_seen(r for by_router in rows.values() for r in by_router)
    lines = [
        f"Requests over {threshold:g} s per seed (sum); the sum of all TTFTs over the seeds:",
        "",
        "| workload | " + " | ".join(routers) + " |",
        "|---|" + "---|" * len(routers),
    ]
    for name, by_router in rows.items():
        cells = []
        for router in routers:
            runs = sorted(by_router.get(router, []))
            if not runs:
                cells.append("–")
                continue
            counts = [sum(1 for t in ttfts if t > threshold) for _, ttfts in runs]
            total = sum(sum(ttfts) for _, ttfts in runs)
            cells.append(", ".join(map(str, counts)) + f" ({sum(counts)}); {total:.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


# The order `--all-workloads` runs them in (the JSON's keys are sorted).
ORDER = ["shared-prefix", "multi-turn", "no-shared", "zipf-prefix", "hot-prefix", "bursty",
         "varied-output", "heterogeneous"]


def spread(values: list[float]) -> dict:
    """Median, min and max, as switchyard-bench's `Spread` (an even count's median is the mean
    of the middle two)."""
    values = sorted(values)
    n = len(values)
    median = values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
    return {"median": median, "min": values[0], "max": values[-1]}


# The summary's spreads, from each seed's result (as switchyard-bench's `summarize`).
SPREADS = {
    "ttft_p50": lambda r: r["ttft_p50"],
    "ttft_p90": lambda r: r["ttft_p90"],
    "ttft_p99": lambda r: r["ttft_p99"],
    "ttft_mean": lambda r: r["ttft_mean"],
    "engine_ttft_mean": lambda r: r["engine_ttft"]["mean"],
    "engine_ttft_p50": lambda r: r["engine_ttft"]["p50"],
    "engine_ttft_p90": lambda r: r["engine_ttft"]["p90"],
    "cache_hit_rate": lambda r: r["cache_hit_rate"],
}


def add_pooled(summary: dict, runs: list[dict]) -> None:
    """The p90 of every seed's requests together into `summary`, where each of its `runs` (the
    router's seeds) kept them."""
    if runs and all(r.get("ttfts") for r in runs):
        summary["ttft_p90_pooled"] = quantile(
            sorted(t for r in runs for t in r["ttfts"] if t is not None), 0.9)


def summarize(runs: list[dict]) -> list[dict]:
    """Per-router summaries of per-seed results, routers in the order they first appear."""
    summaries = []
    for router in first_seen(run["router"] for run in runs):
        mine = sorted((r for r in runs if r["router"] == router), key=lambda r: r["seed"])
        summary = {"router": router, "seeds": [r["seed"] for r in mine]}
        summary.update({field: spread([get(r) for r in mine]) for field, get in SPREADS.items()})
        add_pooled(summary, mine)
        summaries.append(summary)
    random = next((s for s in summaries if s["router"] == "random"), None)
    for summary in summaries:
        # Ratios of medians over the same seeds only.
        if not random or random["seeds"] != summary["seeds"]:
            continue
        for p in ("p50", "p90"):
            ours = summary[f"ttft_{p}"]["median"]
            if ours > 0:
                summary[f"ttft_{p}_vs_random"] = random[f"ttft_{p}"]["median"] / ours
    return summaries


def merge(files: list[dict]) -> dict:
    """Several results files as one: each workload's per-seed results together (a router's seed
    in a later file replaces the same in an earlier one), its summaries computed again."""
    merged: dict = {}
    for results in files:
        for name, report in results.items():
            into = merged.setdefault(name, {"results": [], "capacity": {}})
            runs = {(r["router"], r["seed"]): r for r in into["results"]}
            runs.update({(r["router"], r["seed"]): r for r in report.get("results", [])})
            into["results"] = list(runs.values())
            into["capacity"].update(report.get("capacity") or {})
    for report in merged.values():
        report["summary"] = summarize(report["results"])
    return merged


def main(paths: list[str], slow: float) -> None:
    files = [json.loads(pathlib.Path(path).read_text()) for path in paths]
    results = files[0] if len(files) == 1 else merge(files)
    # A file from before the bench pooled the p90s: pooled here from its requests' TTFTs.
    for report in results.values():
        for summary in report.get("summary", []):
            if "ttft_p90_pooled" not in summary:
                add_pooled(summary, [r for r in report.get("results", [])
                                     if r["router"] == summary["router"]])
    results = dict(sorted(results.items(), key=lambda item: (
        ORDER.index(item[0]) if item[0] in ORDER else len(ORDER), item[0])))
    out: list[str] = []
    for name, report in results.items():
        if report.get("summary"):
            out += workload_table(name, report) + [""]
    out += capacity_table(results)
    slow_lines = slow_table(results, slow)
    if slow_lines:
        out += ([""] if out and out[-1] else []) + slow_lines
    print("\n".join(out))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+",
                        help="switchyard-bench compare JSON files (several: merged by seed)")
    parser.add_argument("--slow", type=float, default=0.2,
                        help="the TTFT (model seconds) over which a request counts as slow")
    args = parser.parse_args()
    main(args.results, args.slow)

"""The gateway's own time per request, from the logs `switchyard-bench compare --proxy-log DIR`
writes: for each workload, seed and router (a router's replicas together), how many requests,
`routed_us` (from a request's head to its worker chosen: parsing, tokenizing, scoring) at p50,
p90, p99 and its largest, and how many took longer than a threshold. Times in model
milliseconds (wall divided by the bench's --time-scale). Usage: proxy_logs.py DIR
[--time-scale 0.2] [--over MS] (default 10 model ms). Standard library only."""

import argparse
import math
import pathlib
import re

# `<workload>-seed<N>-<router>-<replica>.log`, as the bench names them.
LOG_NAME = re.compile(r"^(?P<workload>.+)-seed(?P<seed>\d+)-(?P<router>.+)-(?P<replica>\d+)\.log$")
REQUEST_LINE = re.compile(r' endpoint="chat_completions" .* routed_us=(?P<us>\d+)')


def routed_us(lines) -> list[int]:
    """`routed_us` of every chat completion's request line (a request that never had a worker
    chosen has none)."""
    return [int(m.group("us")) for m in map(REQUEST_LINE.search, lines) if m]


def quantile(sorted_values: list[float], q: float) -> float:
    """The q-quantile by nearest rank, as the bench's own."""
    if not sorted_values:
        return 0.0
    rank = min(max(math.ceil(q * len(sorted_values)), 1), len(sorted_values))
    return sorted_values[rank - 1]


def collect(directory: pathlib.Path) -> dict:
    """{(workload, seed, router): [routed_us, ...]} over every replica's log."""
    runs: dict = {}
    for path in sorted(directory.glob("*.log")):
        name = LOG_NAME.match(path.name)
        if not name:
            continue
        key = (name.group("workload"), int(name.group("seed")), name.group("router"))
        with path.open(encoding="utf-8", errors="replace") as lines:
            runs.setdefault(key, []).extend(routed_us(lines))
    return runs


def table(runs: dict, time_scale: float, over_ms: float) -> list[str]:
    rows = [
        f"| workload | seed | router | requests | routed p50 | p90 | p99 | max | over {over_ms:g} ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (workload, seed, router), values in sorted(runs.items()):
        ms = sorted(us / 1000 / time_scale for us in values)
        over = sum(1 for v in ms if v > over_ms)
        cells = " | ".join(f"{quantile(ms, q):.2f}" for q in (0.5, 0.9, 0.99))
        top = f"{ms[-1]:.2f}" if ms else "–"
        rows.append(f"| {workload} | {seed} | {router} | {len(ms)} | {cells} | {top} | {over} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=pathlib.Path)
    parser.add_argument("--time-scale", type=float, default=0.2)
    parser.add_argument("--over", type=float, default=10.0, help="model milliseconds")
    args = parser.parse_args()
    print("\n".join(table(collect(args.directory), args.time_scale, args.over)))


if __name__ == "__main__":
    main()

"""The gateway's own time per request, from the logs `switchyard-bench compare --proxy-log DIR`
writes: for each workload, seed and router (a router's replicas together), how many requests,
`routed_us` (from a request's head to its worker chosen: parsing, tokenizing, scoring) at p50,
p90, p99 and its largest, and how many took longer than a threshold. Times in model
milliseconds (wall divided by the bench's --time-scale). Usage: proxy_logs.py DIR
[--time-scale 0.2] [--over MS] (default 10 model ms). Standard library only.

With --cold, instead: the cold prefills (requests whose prompt no worker held any of, outcome
NoCache in their routing decision), and how many of them went to a worker that already had its
fair share of a burst's cold prefills (a burst: requests that reached the gateway, any replica,
within --burst-gap-ms model ms of the one before; its fair share: its cold prefills over the
pool's workers, rounded up). One proxy prefills each shared prompt once; two replicas that
place a prompt each before hearing of the other's prefill it twice, or stack two on one worker."""

import argparse
import collections
import datetime
import math
import pathlib
import re

# `<workload>-seed<N>-<router>-<replica>.log`, as the bench names them.
LOG_NAME = re.compile(r"^(?P<workload>.+)-seed(?P<seed>\d+)-(?P<router>.+)-(?P<replica>\d+)\.log$")
REQUEST_LINE = re.compile(r' endpoint="chat_completions" .* routed_us=(?P<us>\d+)')
# The request line's id, end (the line's time) and duration; its routing decision's worker,
# outcome and the workers it scored.
TIMESTAMP = re.compile(r"^(?P<at>\S+?)Z? ")
ENDED = re.compile(r' request_id=(?P<id>\w+) endpoint="chat_completions" .* duration_ms=(?P<ms>\d+)')
DECISION = re.compile(r" routing decision request_id=(?P<id>\w+) route=policy=cache-aware; "
                      r"chosen=(?P<worker>[^;]+); outcome=(?P<outcome>\w+);(?P<scores>.*)")
SCORED = re.compile(r"; (\S+) matched_blocks=")


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


def collect(directory: pathlib.Path, read=None) -> dict:
    """{(workload, seed, router): [what `read` finds in a log's lines, ...]} over every replica's
    log (`read`: `routed_us` unless given)."""
    read = read or routed_us
    runs: dict = {}
    for path in sorted(directory.glob("*.log")):
        name = LOG_NAME.match(path.name)
        if not name:
            continue
        key = (name.group("workload"), int(name.group("seed")), name.group("router"))
        with path.open(encoding="utf-8", errors="replace") as lines:
            runs.setdefault(key, []).extend(read(lines))
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


def decisions(lines) -> list[tuple[float, str, str, int]]:
    """(start in wall seconds, worker, outcome, workers scored) of every chat completion whose
    request line and routing decision are both in `lines`: the start is the request line's time
    less its duration."""
    started, decided = {}, {}
    for line in lines:
        if (ended := ENDED.search(line)) and (at := TIMESTAMP.match(line)):
            end = datetime.datetime.fromisoformat(at.group("at")).timestamp()
            started[ended.group("id")] = end - int(ended.group("ms")) / 1000
        elif decision := DECISION.search(line):
            workers = len(SCORED.findall(decision.group("scores")))
            decided[decision.group("id")] = (decision.group("worker"), decision.group("outcome"), workers)
    return [(start, *decided[id]) for id, start in started.items() if id in decided]


def collect_decisions(directory: pathlib.Path) -> dict:
    """{(workload, seed, router): [decision, ...]} over every replica's log, in start order."""
    runs = collect(directory, decisions)
    for values in runs.values():
        values.sort()
    return runs


def cold(decided: list, gap_s: float) -> tuple[int, int, int]:
    """(bursts, cold prefills, those beyond a worker's fair share of its burst's) of one run's
    decisions in start order, bursts split where two starts are more than `gap_s` apart."""
    bursts: list[list] = []
    last = None
    for decision in decided:
        if last is None or decision[0] - last > gap_s:
            bursts.append([])
        bursts[-1].append(decision)
        last = decision[0]
    total = stacked = 0
    for burst in bursts:
        per_worker = collections.Counter(worker for _, worker, outcome, _ in burst if outcome == "NoCache")
        count = sum(per_worker.values())
        workers = max((scored for *_, scored in burst), default=1)
        fair = math.ceil(count / max(workers, 1))
        total += count
        stacked += sum(max(0, n - fair) for n in per_worker.values())
    return len(bursts), total, stacked


def cold_table(runs: dict, time_scale: float, gap_ms: float) -> list[str]:
    rows = [
        "| workload | seed | router | requests | bursts | cold prefills | beyond a fair share |",
        "|---|---|---|---|---|---|---|",
    ]
    sums: dict = {}
    for (workload, seed, router), decided in sorted(runs.items()):
        bursts, total, stacked = cold(decided, gap_ms / 1000 * time_scale)
        rows.append(f"| {workload} | {seed} | {router} | {len(decided)} | {bursts} | {total} | {stacked} |")
        into = sums.setdefault((workload, router), [0, 0, 0, 0])
        for i, value in enumerate((len(decided), bursts, total, stacked)):
            into[i] += value
    for (workload, router), (requests, bursts, total, stacked) in sorted(sums.items()):
        rows.append(f"| {workload} | all | {router} | {requests} | {bursts} | {total} | {stacked} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=pathlib.Path)
    parser.add_argument("--time-scale", type=float, default=0.2)
    parser.add_argument("--over", type=float, default=10.0, help="model milliseconds")
    parser.add_argument("--cold", action="store_true",
                        help="cold prefills per burst instead of the time to route")
    parser.add_argument("--burst-gap-ms", type=float, default=500.0, help="model milliseconds")
    args = parser.parse_args()
    if args.cold:
        rows = cold_table(collect_decisions(args.directory), args.time_scale, args.burst_gap_ms)
    else:
        rows = table(collect(args.directory), args.time_scale, args.over)
    print("\n".join(rows))


if __name__ == "__main__":
    main()

"""Tests of tables.py's reading of several results files as one run per seed. Run:
python3 -m unittest discover -s loadtest -p 'test_*.py' (scripts/test.sh does)."""

import json
import pathlib
import subprocess
import sys
import tempfile
import unittest

import tables


def run(router: str, seed: int, p90: float, ttfts: list[float]) -> dict:
    """One seed's result of one router, as switchyard-bench writes it."""
    return {
        "router": router, "seed": seed, "requests": len(ttfts), "errors": 0,
        "ttft_p50": p90 / 2, "ttft_p90": p90, "ttft_p99": p90 * 2, "ttft_mean": p90 / 2,
        "engine_ttft": {"count": len(ttfts), "mean": p90 / 3, "p50": p90 / 4, "p90": p90},
        "cache_hit_rate": 0.5, "ttfts": ttfts,
    }


def results(runs: list[dict]) -> dict:
    return {"shared-prefix": {"results": runs, "summary": tables.summarize(runs), "capacity": {}}}


class MergeTest(unittest.TestCase):
    def test_medians_span_every_seed_and_a_later_file_replaces_a_seed(self):
        first = results([run("switchyard", 1, 0.3, [0.1, 0.3]), run("vllm-router", 1, 0.2, [0.2]),
                         run("random", 1, 0.9, [0.9])])
        second = results([run("switchyard", 2, 0.1, [0.1]), run("switchyard", 3, 0.2, [0.25]),
                          run("vllm-router", 2, 0.4, [0.4]), run("vllm-router", 3, 0.5, [0.5]),
                          run("vllm-router", 1, 0.6, [0.6])])
        merged = tables.merge([first, second])["shared-prefix"]
        by_router = {s["router"]: s for s in merged["summary"]}
        self.assertEqual(by_router["switchyard"]["seeds"], [1, 2, 3])
        self.assertEqual(by_router["switchyard"]["ttft_p90"], {"median": 0.2, "min": 0.1, "max": 0.3})
        # vllm-router's seed 1 from the second file replaced the first's.
        self.assertEqual(by_router["vllm-router"]["ttft_p90"]["median"], 0.5)
        self.assertEqual(by_router["vllm-router"]["engine_ttft_mean"]["max"], 0.6 / 3)
        # Random ran seed 1 only: no ratio against it over other seeds, and it is labelled.
        self.assertNotIn("ttft_p90_vs_random", by_router["switchyard"])
        self.assertIn("ttft_p90_vs_random", by_router["random"])
        lines = "\n".join(tables.workload_table("shared-prefix", merged))
        self.assertIn("| random (seeds 1) |", lines)
        self.assertIn("| **switchyard** | 0.100 (0.05–0.15) | 0.200 (0.10–0.30) |", lines)
        # The best other router is taken among those that ran the same seeds.
        self.assertIn("p90 0.40x (vllm-router)", lines)
        # Over every seed's requests pooled: switchyard's 0.1, 0.1, 0.25, 0.3 and vllm-router's
        # 0.4, 0.5, 0.6 (the later file's seed 1).
        self.assertEqual(by_router["switchyard"]["ttft_p90_pooled"], 0.3)
        self.assertEqual(by_router["vllm-router"]["ttft_p90_pooled"], 0.6)
        self.assertIn("; pooled p90: 0.50x (vllm-router).", lines)

    def test_pooled_p90s_compare_replicas_and_need_every_seeds_requests(self):
        def tail(slow: float) -> list[float]:
            return [0.1] * 8 + [slow] * 2

        runs = [run("switchyard", seed, 0.2, tail(slow)) for seed, slow in ((1, 1.0), (2, 0.2))]
        runs += [run("switchyard-2", seed, 0.2, tail(slow)) for seed, slow in ((1, 0.9), (2, 0.3))]
        runs += [run("round-robin", seed, 0.5, [0.5] * 10) for seed in (1, 2)]
        summaries = {s["router"]: s for s in tables.summarize(runs)}
        # The 18th of 20: the smaller of the two seeds' tails.
        self.assertEqual(summaries["switchyard"]["ttft_p90_pooled"], 0.2)
        self.assertEqual(summaries["switchyard-2"]["ttft_p90_pooled"], 0.3)
        line = tables.workload_table("bursty", {"summary": list(summaries.values())})[-1]
        self.assertIn("; pooled p90: 0.40x (round-robin), 2 replicas / 1 1.50x.", line)
        # A seed without its requests' TTFTs (an older file): no pooled figure, no pooled line.
        runs[0] = dict(runs[0], ttfts=[])
        summaries = tables.summarize(runs)
        self.assertNotIn("ttft_p90_pooled", summaries[0])
        self.assertNotIn("pooled", tables.workload_table("bursty", {"summary": summaries})[-1])
        # Nor where the bench wrote null (a router whose clients saw no first token).
        summaries = tables.summarize(runs[1:])
        summaries[0]["ttft_p90_pooled"] = None
        self.assertNotIn("pooled", tables.workload_table("bursty", {"summary": summaries})[-1])

    def test_an_even_count_of_seeds_takes_the_middle_two(self):
        self.assertEqual(tables.spread([4.0, 1.0, 2.0, 3.0]), {"median": 2.5, "min": 1.0, "max": 4.0})

    def test_the_command_line_reads_several_files(self):
        with tempfile.TemporaryDirectory() as directory:
            paths = []
            for seed, p90 in ((1, 0.3), (2, 0.1)):
                path = pathlib.Path(directory) / f"seed{seed}.json"
                path.write_text(json.dumps(results([run("switchyard", seed, p90, [p90, 0.05])])))
                paths.append(str(path))
            out = subprocess.run(
                [sys.executable, str(pathlib.Path(tables.__file__)), *paths, "--slow", "0.2"],
                check=True, capture_output=True, text=True).stdout
        self.assertIn("| **switchyard** | 0.100 (0.05–0.15) | 0.200 (0.10–0.30) |", out)
        self.assertIn("| shared-prefix | 1, 0 (1); 0.5 |", out)

    def test_one_file_from_before_the_pooled_p90s_has_them_pooled_from_its_requests(self):
        older = results([run("switchyard", 1, 0.3, [0.1, 0.3]), run("vllm-router", 1, 0.2, [0.6])])
        for summary in older["shared-prefix"]["summary"]:
            del summary["ttft_p90_pooled"]
        with tempfile.TemporaryDirectory() as directory:
            path = pathlib.Path(directory) / "older.json"
            path.write_text(json.dumps(older))
            out = subprocess.run([sys.executable, str(pathlib.Path(tables.__file__)), str(path)],
                                 check=True, capture_output=True, text=True).stdout
        self.assertIn("; pooled p90: 0.50x (vllm-router).", out)


if __name__ == "__main__":
    unittest.main()

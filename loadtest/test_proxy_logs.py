"""Tests of proxy_logs.py's summary of the gateway's own time per request. Run:
python3 -m unittest discover -s loadtest -p 'test_*.py' (scripts/test.sh does)."""

import pathlib
import tempfile
import unittest

import proxy_logs


def request_line(us: int, endpoint: str = "chat_completions") -> str:
    """A request line as the proxy logs it (fields abridged)."""
    return (f'2026-12-07T12:00:00.000000Z  INFO switchyard_proxy::observe: request '
            f'request_id=abc endpoint="{endpoint}" model="m" worker="127.0.0.1:1" attempts=1 '
            f'status=200 ttft_ms=12 duration_ms=30 routed_us={us}\n')


class ProxyLogsTest(unittest.TestCase):
    def test_replicas_of_a_router_are_summed_and_times_scaled_to_model_time(self):
        with tempfile.TemporaryDirectory() as directory:
            root = pathlib.Path(directory)
            (root / "shared-prefix-seed4-switchyard-2-0.log").write_text(
                request_line(200) + request_line(400) + request_line(9, endpoint="ready"))
            (root / "shared-prefix-seed4-switchyard-2-1.log").write_text(
                request_line(6000) + "a line that is no request\n")
            (root / "shared-prefix-seed4-switchyard-0.log").write_text(request_line(300))
            (root / "notes.log").write_text(request_line(1))
            runs = proxy_logs.collect(root)
            self.assertEqual(runs[("shared-prefix", 4, "switchyard-2")], [200, 400, 6000])
            self.assertEqual(runs[("shared-prefix", 4, "switchyard")], [300])
            self.assertEqual(len(runs), 2)
            rows = proxy_logs.table(runs, time_scale=0.2, over_ms=10.0)
        # 200 µs of wall time at a time scale of 0.2 is 1 model millisecond.
        self.assertIn("| shared-prefix | 4 | switchyard | 1 | 1.50 | 1.50 | 1.50 | 1.50 | 0 |", rows)
        self.assertIn("| shared-prefix | 4 | switchyard-2 | 3 | 2.00 | 30.00 | 30.00 | 30.00 | 1 |", rows)

    def test_cold_prefills_beyond_a_workers_fair_share_of_a_burst_are_counted(self):
        def request(id: str, ended_ms: int, duration_ms: int, worker: str, outcome: str) -> str:
            """A request's routing decision and request line, as the proxy logs them (abridged):
            three workers scored."""
            at = f"2026-12-07T12:00:{ended_ms // 1000:02}.{ended_ms % 1000:03}000Z"
            scores = "".join(f"; 127.0.0.1:{w} matched_blocks=0 cached_tokens=0" for w in (1, 2, 3))
            return (f"{at} DEBUG switchyard_proxy::observe: routing decision request_id={id} "
                    f"route=policy=cache-aware; chosen=127.0.0.1:{worker}; outcome={outcome}; "
                    f"prompt_tokens=2000{scores}\n"
                    f'{at}  INFO switchyard_proxy::observe: request request_id={id} '
                    f'endpoint="chat_completions" model="m" worker="127.0.0.1:{worker}" '
                    f"attempts=1 status=200 ttft_ms=12 duration_ms={duration_ms} routed_us=100\n")
        with tempfile.TemporaryDirectory() as directory:
            root = pathlib.Path(directory)
            # A burst at 1.000 s (wall): replica 0 sends two cold prompts to workers 1 and 2,
            # replica 1 two to workers 1 and 1 and a hit to 3; a lone cold one at 5.000 s.
            (root / "bursty-seed1-switchyard-2-0.log").write_text(
                request("a", 3000, 2000, 1, "NoCache") + request("b", 3001, 2000, 2, "NoCache")
                + request("f", 6000, 1000, 2, "NoCache") + request_line(100))
            (root / "bursty-seed1-switchyard-2-1.log").write_text(
                request("c", 4002, 3000, 1, "NoCache") + request("d", 2003, 1000, 1, "NoCache")
                + request("e", 2004, 1000, 3, "CacheHit"))
            runs = proxy_logs.collect_decisions(root)
        decided = runs[("bursty", 1, "switchyard-2")]
        self.assertEqual([d[1][-1] for d in decided], ["1", "2", "1", "1", "3", "2"])
        self.assertEqual(decided[0][2:], ("NoCache", 3))
        # Four cold prefills in the first burst: two per worker is fair, worker 1 has three.
        self.assertEqual(proxy_logs.cold(decided, gap_s=0.1), (2, 5, 1))
        # Bursts split at every gap over a millisecond: each cold prefill its own.
        self.assertEqual(proxy_logs.cold(decided, gap_s=0.0005), (6, 5, 0))
        rows = proxy_logs.cold_table(runs, time_scale=0.2, gap_ms=500.0)
        self.assertIn("| bursty | 1 | switchyard-2 | 6 | 2 | 5 | 1 |", rows)
        self.assertIn("| bursty | all | switchyard-2 | 6 | 2 | 5 | 1 |", rows)

    def test_quantiles_take_the_nearest_rank(self):
        values = [float(v) for v in range(1, 11)]
        self.assertEqual(proxy_logs.quantile(values, 0.5), 5.0)
        self.assertEqual(proxy_logs.quantile(values, 0.9), 9.0)
        self.assertEqual(proxy_logs.quantile(values, 0.99), 10.0)
        self.assertEqual(proxy_logs.quantile([], 0.5), 0.0)


if __name__ == "__main__":
    unittest.main()

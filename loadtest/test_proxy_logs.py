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

    def test_quantiles_take_the_nearest_rank(self):
        values = [float(v) for v in range(1, 11)]
        self.assertEqual(proxy_logs.quantile(values, 0.5), 5.0)
        self.assertEqual(proxy_logs.quantile(values, 0.9), 9.0)
        self.assertEqual(proxy_logs.quantile(values, 0.99), 10.0)
        self.assertEqual(proxy_logs.quantile([], 0.5), 0.0)


if __name__ == "__main__":
    unittest.main()

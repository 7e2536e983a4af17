"""Tests of plot.py's file names (the names need no matplotlib). Run:
python3 -m unittest discover -s loadtest -p 'test_*.py' (scripts/test.sh does)."""

import unittest

import plot


class NamesTest(unittest.TestCase):
    def test_a_capacity_search_does_not_take_the_every_router_runs_plot_name(self):
        compare = {"results": [], "capacity": {}}
        search = {"results": [], "capacity": {"switchyard": {"capacity": 9.5, "points": []}}}
        self.assertEqual(plot.cdf_name("shared-prefix", compare), "ttft-cdf-shared-prefix.png")
        self.assertEqual(plot.cdf_name("shared-prefix", search),
                         "ttft-cdf-shared-prefix-capacity.png")
        # Files from before the bench wrote a capacity field.
        self.assertEqual(plot.cdf_name("mixed", {"results": []}), "ttft-cdf-mixed.png")


if __name__ == "__main__":
    unittest.main()

"""Parse a Prometheus text exposition with prometheus_client's parser.

Usage: parse_metrics.py URL. Prints {"family": {"type": t, "samples": [[name, labels, value], ...]}}.
"""

import json
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def main(url: str) -> None:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        out[family.name] = {
            "type": family.type,
            "samples": [[s.name, s.labels, s.value] for s in family.samples],
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])

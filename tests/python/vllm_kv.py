"""Load vLLM's own `vllm/distributed/kv_events.py` without importing torch.

`vllm/__init__.py` imports torch, so the parent packages are registered as empty modules and the
four small imports the module needs besides msgspec and zmq (a logger, the `@config` decorator,
network helpers used only for `tcp://*:0`, and the `ExternalBlockHash` alias) are stubbed. The
event classes, the msgpack encoding and the ZMQ publisher are vLLM's code, unchanged, read from
the wheel that scripts/test.sh unpacks into `.cache/vllm-<version>/` (or `VLLM_SRC`).
"""

import dataclasses
import importlib.util
import logging
import os
import pathlib
import sys
import types

VLLM_VERSION = "0.34.0"
ROOT = pathlib.Path(__file__).resolve().parents[2]


def vllm_source() -> pathlib.Path:
    path = pathlib.Path(os.environ.get("VLLM_SRC", ROOT / ".cache" / f"vllm-{VLLM_VERSION}"))
    if not (path / "vllm" / "distributed" / "kv_events.py").exists():
        raise SystemExit(f"vLLM sources missing under {path}: run scripts/test.sh")
    return path


def _package(name: str, src: pathlib.Path) -> None:
    module = types.ModuleType(name)
    module.__path__ = [str(src / name.replace(".", "/"))]
    sys.modules[name] = module


def _stub(name: str, **attrs) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


def _load(name: str, src: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, src / (name.replace(".", "/") + ".py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load():
    """Return vLLM's `vllm.distributed.kv_events` module."""
    if "vllm.distributed.kv_events" in sys.modules:
        return sys.modules["vllm.distributed.kv_events"]
    src = vllm_source()
    for name in ["vllm", "vllm.config", "vllm.distributed", "vllm.utils", "vllm.v1", "vllm.v1.core"]:
        _package(name, src)
    _stub("vllm.logger", init_logger=logging.getLogger)
    _stub("vllm.config.utils", config=dataclasses.dataclass)
    _stub(
        "vllm.utils.network_utils",
        get_ip=lambda: "127.0.0.1",
        get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
        is_valid_ipv6_address=lambda ip: ":" in ip,
        split_zmq_path=lambda path: tuple(path.replace("tcp://", "tcp:").split(":")),
    )
    _stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    _load("vllm.config.kv_events", src)
    return _load("vllm.distributed.kv_events", src)

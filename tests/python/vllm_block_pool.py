"""Replay a script of block-pool operations through vLLM's own BlockPool, one JSON line per op.

vLLM's `vllm/v1/core/block_pool.py` (BlockPool, FreeKVCacheBlockQueue, the request block hasher
in `kv_cache_utils.py`, `utils/hashing.py`'s sha256, `envs.py`, `gc_utils.py`, `math_utils.py`)
runs unchanged, read from the wheel that scripts/test.sh unpacks into `.cache/vllm-<version>/`
(or `VLLM_SRC`), on top of vllm_kv.py's torch-free loading of the event classes. Only modules
that would pull torch, PIL or pydantic are stubbed, none of them on the paths the ops take:
`VllmConfig`, the KV-cache specs and metrics (annotations only), multimodal windows and prompt
embeds (no request has them), `token_slice` (a plain list slice, as vLLM's own is for a list)
and the `Request` (the fields the pool and the hasher read).

stdin: {"num_blocks": N, "block_size": B, "requests": {"r1": [tokens...], ...}, "ops": [...]}
with ops
  {"op": "touch_hit", "req": r, "max_blocks": k}  longest cached prefix of r's block hashes (at
      most k blocks: get_cached_block until a miss), touched and made r's first blocks
  {"op": "get_new_blocks", "req": r, "n": n}      appended to r's blocks
  {"op": "cache_full_blocks", "req": r, "num_cached": c, "num_full": f}
  {"op": "free", "req": r}                         r's blocks, tail first; r then holds none
  {"op": "reset"}                                  reset_prefix_cache
stdout, after each op: {"events": [...], "blocks": {r: [ids]} (requests holding blocks),
"free_queue": [ids], "num_free": n, "usage": "0.250000", "hit": [ids] (touch_hit),
"reset": bool (reset)}. Events are canonical, with each hash named by a label "<req>:<index>"
(the first request, in the order of "requests", whose block hashes hold it), so that they
compare with the simulator's, whose hash function differs:
  BlockStored  -> ["stored", parent label or null, [labels], token_ids, block_size, group_idx]
  BlockRemoved -> ["removed", [labels], group_idx]
  AllBlocksCleared -> ["cleared"]
"""

import importlib
import json
import pathlib
import sys
import types

import vllm_kv


class Request:
    """The fields of `vllm.v1.request.Request` that BlockPool and the block hasher read."""

    def __init__(self, request_id, token_ids):
        self.request_id = request_id
        self._all_token_ids = list(token_ids)
        self.block_hashes = []
        self.mm_features = []
        self.lora_request = None
        self.cache_salt = None
        self.prompt_embeds = None
        self.session_id = None

    @property
    def all_token_ids(self):
        return self._all_token_ids

    @property
    def num_tokens(self):
        return len(self._all_token_ids)


BLOCK_POOL_FILES = [
    "vllm/v1/core/block_pool.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/utils/hashing.py",
    "vllm/utils/math_utils.py",
    "vllm/utils/gc_utils.py",
    "vllm/envs.py",
]


def load():
    """Return vLLM's `block_pool`, `kv_cache_utils` and `utils.hashing` modules."""
    vllm_kv.load()  # the real kv_events, with the parent packages registered
    src = vllm_kv.vllm_source()
    missing = [name for name in BLOCK_POOL_FILES if not (src / name).exists()]
    if missing:
        raise SystemExit(f"vLLM sources {missing} missing under {src}: run scripts/test.sh")
    for name in ["vllm.multimodal", "vllm.v1.metrics"]:
        vllm_kv._package(name, src)

    class Unused:  # names used only in annotations, or on paths no op takes
        pass

    sys.modules["vllm.config"].VllmConfig = Unused
    vllm_kv._stub("vllm.multimodal.utils", get_mm_features_in_window=None)
    vllm_kv._stub(
        "vllm.v1.kv_cache_interface",
        KVCacheConfig=Unused,
        KVCacheGroupSpec=Unused,
        KVCacheSpec=Unused,
        MambaSpec=Unused,
        UniformTypeKVCacheSpecs=Unused,
        iter_layer_specs=None,
    )
    vllm_kv._stub("vllm.v1.kv_cache_spec_registry", KVCacheSpecRegistry=Unused)
    vllm_kv._stub("vllm.v1.core.kv_cache_metrics", KVCacheMetricsCollector=Unused)
    vllm_kv._stub("vllm.v1.token_buffer", token_slice=lambda tokens, start, stop: tokens[start:stop])
    vllm_kv._stub("vllm.v1.utils", tensor_data=None)
    vllm_kv._stub("vllm.v1.request", Request=Request)
    # vllm_kv stubs kv_cache_utils with the one alias kv_events needs: the real one from here on.
    del sys.modules["vllm.v1.core.kv_cache_utils"]
    utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    block_pool = importlib.import_module("vllm.v1.core.block_pool")
    hashing = importlib.import_module("vllm.utils.hashing")
    for module in (utils, block_pool, hashing):
        assert pathlib.Path(module.__file__).is_relative_to(src), module.__file__
    return block_pool, utils, hashing


def main():
    script = json.load(sys.stdin)
    block_pool, utils, hashing = load()
    events_module = sys.modules["vllm.distributed.kv_events"]
    block_size = script["block_size"]
    utils.init_none_hash(hashing.sha256)
    hasher = utils.get_request_block_hasher(block_size, hashing.sha256)

    requests = {}
    labels = {}
    salts = script.get("salts", {})
    for name, tokens in script["requests"].items():
        request = Request(name, tokens)
        request.cache_salt = salts.get(name)
        request.block_hashes.extend(hasher(request))
        requests[name] = request
        for index, block_hash in enumerate(request.block_hashes):
            labels.setdefault(utils.maybe_convert_block_hash(block_hash), f"{name}:{index}")

    def label(block_hash):
        if block_hash is None:
            return None
        return labels.get(block_hash, f"unknown:{block_hash!r}")

    def render(event):
        if isinstance(event, events_module.BlockStored):
            return [
                "stored",
                label(event.parent_block_hash),
                [label(h) for h in event.block_hashes],
                list(event.token_ids),
                event.block_size,
                event.group_idx,
                [list(keys) if keys is not None else None for keys in event.extra_keys or []],
            ]
        if isinstance(event, events_module.BlockRemoved):
            return ["removed", [label(h) for h in event.block_hashes], event.group_idx]
        if isinstance(event, events_module.AllBlocksCleared):
            return ["cleared"]
        return ["unknown", type(event).__name__]

    pool = block_pool.BlockPool(
        num_gpu_blocks=script["num_blocks"],
        enable_caching=True,
        hash_block_size=block_size,
        enable_kv_cache_events=True,
    )
    held = {name: [] for name in requests}

    for op in script["ops"]:
        kind = op["op"]
        extra = {}
        if kind == "touch_hit":
            request = requests[op["req"]]
            assert not held[op["req"]], f"touch_hit on {op['req']}, which holds blocks"
            hit = []
            for block_hash in request.block_hashes[: op["max_blocks"]]:
                cached = pool.get_cached_block(block_hash, [0])
                if cached is None:
                    break
                hit.append(cached[0])
            pool.touch(hit)
            held[op["req"]] = hit
            extra["hit"] = [block.block_id for block in hit]
        elif kind == "get_new_blocks":
            held[op["req"]].extend(pool.get_new_blocks(op["n"]))
        elif kind == "cache_full_blocks":
            pool.cache_full_blocks(
                requests[op["req"]],
                held[op["req"]],
                op["num_cached"],
                op["num_full"],
                block_size,
                0,
            )
        elif kind == "free":
            pool.free_blocks(reversed(held[op["req"]]))
            held[op["req"]] = []
        elif kind == "reset":
            extra["reset"] = pool.reset_prefix_cache()
        else:
            raise SystemExit(f"unknown op {op!r}")
        line = {
            "events": [render(event) for event in pool.take_events()],
            "blocks": {
                name: [block.block_id for block in blocks] for name, blocks in held.items() if blocks
            },
            "free_queue": [block.block_id for block in pool.free_block_queue.get_all_free_blocks()],
            "num_free": pool.get_num_free_blocks(),
            "usage": f"{pool.get_usage():.6f}",
            **extra,
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()

"""KV-event batches built with vLLM's own classes; the Rust tests hold the same values."""


def batches(kv):
    return [
        # 0: int hashes, first blocks of a sequence.
        [kv.BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(32)), block_size=16,
                        lora_id=None, medium="GPU", lora_name=None)],
        # 1: a child block with the newer optional fields set.
        [kv.BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=list(range(32, 48)), block_size=16,
                        lora_id=None, medium="GPU", lora_name=None, extra_keys=[None], group_idx=0,
                        kv_cache_spec_kind="full_attention")],
        # 2: raw sha256-style byte hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), a full 64-bit value.
        [kv.BlockStored(block_hashes=[bytes(24) + (2**64 - 5).to_bytes(8, "big")], parent_block_hash=None,
                        token_ids=list(range(100, 116)), block_size=16, lora_id=None, medium="GPU", lora_name=None)],
        # 3: a LoRA block.
        [kv.BlockStored(block_hashes=[9], parent_block_hash=None, token_ids=list(range(16)), block_size=16,
                        lora_id=5, medium="GPU", lora_name="sql-adapter")],
        # 4: a removal and a store in one batch.
        [kv.BlockRemoved(block_hashes=[1, 2], medium="GPU"),
         kv.BlockStored(block_hashes=[2**63 + 10], parent_block_hash=None, token_ids=list(range(200, 216)),
                        block_size=16, lora_id=None, medium="GPU", lora_name=None)],
        # 5: reset.
        [kv.AllBlocksCleared()],
    ]

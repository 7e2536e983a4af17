//! GPU profiles: what vLLM would configure on a card, and the step costs of one ~27B dense
//! model on it, derived from the card's datasheet figures.
//!
//! Scheduler budgets follow `EngineArgs.get_batch_defaults` (vLLM 0.34, `engine/arg_utils.py`)
//! for the OpenAI API server: cards with ≥ 70 GiB that are not A100s (H100, H200) get
//! `max_num_batched_tokens` 8,192 and `max_num_seqs` 1,024; smaller ones (L40S) 2,048 and 256.
//! The block size is `CacheConfig.DEFAULT_BLOCK_SIZE` (64). KV blocks are what is left of
//! `gpu_memory_utilization` (0.92, `DEFAULT_GPU_MEMORY_UTILIZATION`) of the card after the weights
//! and an activation / CUDA-graph reserve, at the model's KV bytes per token.
//!
//! Step costs are a roofline: a forward pass reads every weight once (memory bound) or does
//! 2 × parameters FLOP per token (compute bound), whichever is longer; attention adds FLOP per
//! (query, key) pair; decode reads each sequence's KV. Efficiencies (50% of dense peak for
//! GEMMs and attention, 90% of memory bandwidth) are typical of vLLM on these cards, not
//! measurements: override the figures with `switchyard-sim` flags when you have your own.

use super::engine::{EngineConfig, LatencyModel};

/// The modelled network: a ~27B dense transformer, weights in FP8, KV cache in bf16.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelShape {
    pub parameters: f64,
    pub weight_bytes: f64,
    pub layers: f64,
    pub query_heads: f64,
    pub kv_heads: f64,
    pub head_dim: f64,
    pub kv_bytes_per_element: f64,
}

impl ModelShape {
    /// 27e9 parameters, 64 layers, 40 query and 8 KV heads of 128, FP8 weights, bf16 KV.
    pub const DENSE_27B: ModelShape = ModelShape {
        parameters: 27e9,
        weight_bytes: 27e9,
        layers: 64.0,
        query_heads: 40.0,
        kv_heads: 8.0,
        head_dim: 128.0,
        kv_bytes_per_element: 2.0,
    };

    /// K and V of one token across all layers (64 × 8 × 128 × 2 × 2 B = 256 KiB).
    pub fn kv_bytes_per_token(&self) -> f64 {
        self.layers * self.kv_heads * self.head_dim * 2.0 * self.kv_bytes_per_element
    }

    /// FLOP of one (query, key) pair: QKᵀ and the weighted sum of V, 2 FLOP per MAC each.
    pub fn attention_flop_per_pair(&self) -> f64 {
        4.0 * self.layers * self.query_heads * self.head_dim
    }
}

/// Datasheet figures of one card.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuSpec {
    pub name: &'static str,
    pub memory_bytes: f64,
    pub bandwidth_bytes_per_s: f64,
    /// Dense FP8 tensor FLOP/s (the weights' GEMMs).
    pub fp8_flops: f64,
    /// Dense bf16 tensor FLOP/s (attention).
    pub bf16_flops: f64,
    /// Memory vLLM keeps for activations and CUDA graphs besides weights and KV.
    pub reserve_bytes: f64,
}

/// The cards a `--gpu` flag can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GpuProfile {
    /// NVIDIA L40S: 48 GB GDDR6, 864 GB/s, 362 dense FP8 / 181 dense bf16 TFLOPS.
    #[value(name = "l40s-48gb")]
    L40s48gb,
    /// NVIDIA H100 SXM: 80 GB HBM3, 3.35 TB/s, 1,979 dense FP8 / 989 dense bf16 TFLOPS.
    #[value(name = "h100-80gb")]
    H100_80gb,
    /// NVIDIA H200: 141 GB HBM3e, 4.8 TB/s, the H100's compute.
    #[value(name = "h200-141gb")]
    H200_141gb,
}

/// vLLM's `DEFAULT_GPU_MEMORY_UTILIZATION`.
const GPU_MEMORY_UTILIZATION: f64 = 0.92;
/// vLLM's `CacheConfig.DEFAULT_BLOCK_SIZE`.
pub const DEFAULT_BLOCK_SIZE: usize = 64;
const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
/// Share of dense peak reached by prefill GEMMs and attention.
const COMPUTE_EFFICIENCY: f64 = 0.5;
/// Share of memory bandwidth reached by decode.
const BANDWIDTH_EFFICIENCY: f64 = 0.9;

impl GpuProfile {
    /// The `--gpu` value naming this card.
    pub fn flag(self) -> &'static str {
        match self {
            GpuProfile::L40s48gb => "l40s-48gb",
            GpuProfile::H100_80gb => "h100-80gb",
            GpuProfile::H200_141gb => "h200-141gb",
        }
    }

    pub fn spec(self) -> GpuSpec {
        match self {
            GpuProfile::L40s48gb => GpuSpec {
                name: "L40S-48GB",
                memory_bytes: 48e9,
                bandwidth_bytes_per_s: 864e9,
                fp8_flops: 362e12,
                bf16_flops: 181e12,
                reserve_bytes: 2e9,
            },
            GpuProfile::H100_80gb => GpuSpec {
                name: "H100-80GB",
                memory_bytes: 80e9,
                bandwidth_bytes_per_s: 3.35e12,
                fp8_flops: 1979e12,
                bf16_flops: 989e12,
                reserve_bytes: 3e9,
            },
            GpuProfile::H200_141gb => GpuSpec {
                name: "H200-141GB",
                memory_bytes: 141e9,
                bandwidth_bytes_per_s: 4.8e12,
                fp8_flops: 1979e12,
                bf16_flops: 989e12,
                reserve_bytes: 3e9,
            },
        }
    }

    /// `(max_num_batched_tokens, max_num_seqs)` vLLM's API server picks on this card.
    pub fn scheduler_budget(self) -> (usize, usize) {
        let spec = self.spec();
        if spec.memory_bytes >= 160.0 * GIB {
            (16_384, 1_024)
        } else if spec.memory_bytes >= 70.0 * GIB {
            (8_192, 1_024)
        } else {
            (2_048, 256)
        }
    }

    /// KV blocks of `block_size` tokens left for the cache, plus vLLM's null block.
    pub fn num_blocks(self, model: &ModelShape, block_size: usize) -> usize {
        let spec = self.spec();
        let kv_bytes =
            spec.memory_bytes * GPU_MEMORY_UTILIZATION - model.weight_bytes - spec.reserve_bytes;
        let tokens = (kv_bytes / model.kv_bytes_per_token()).max(0.0);
        (tokens / block_size.max(1) as f64) as usize + 1
    }

    pub fn latency(self, model: &ModelShape) -> LatencyModel {
        let spec = self.spec();
        let bandwidth = spec.bandwidth_bytes_per_s * BANDWIDTH_EFFICIENCY;
        LatencyModel {
            step_overhead_s: 0.003,
            prefill_s_per_token: 2.0 * model.parameters / (spec.fp8_flops * COMPUTE_EFFICIENCY),
            attention_s_per_token_pair: model.attention_flop_per_pair()
                / (spec.bf16_flops * COMPUTE_EFFICIENCY),
            decode_base_s: model.weight_bytes / bandwidth,
            decode_s_per_seq: 0.000_05,
            decode_s_per_context_token: model.kv_bytes_per_token() / bandwidth,
        }
    }

    /// The engine vLLM would run on this card, before any flag overrides it.
    pub fn engine_config(self) -> EngineConfig {
        self.engine_config_with_block_size(DEFAULT_BLOCK_SIZE)
    }

    /// The engine vLLM would run on this card with `--block-size block_size`: the same KV
    /// memory, cut into blocks of that size (vLLM sizes its pool in bytes, so 16-token blocks
    /// are four times as many as 64-token ones).
    pub fn engine_config_with_block_size(self, block_size: usize) -> EngineConfig {
        let model = ModelShape::DENSE_27B;
        let (max_num_batched_tokens, max_num_seqs) = self.scheduler_budget();
        EngineConfig {
            num_blocks: self.num_blocks(&model, block_size),
            block_size,
            max_num_seqs,
            max_num_batched_tokens,
            latency: self.latency(&model),
            time_scale: 1.0,
            hash_seed: 0,
            step_time_multiplier: 1.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_name_the_cards_as_clap_parses_them() {
        for gpu in [
            GpuProfile::L40s48gb,
            GpuProfile::H100_80gb,
            GpuProfile::H200_141gb,
        ] {
            assert_eq!(
                <GpuProfile as clap::ValueEnum>::from_str(gpu.flag(), false),
                Ok(gpu)
            );
        }
    }

    #[test]
    fn budgets_follow_vllms_defaults_by_card() {
        assert_eq!(GpuProfile::L40s48gb.scheduler_budget(), (2_048, 256));
        assert_eq!(GpuProfile::H100_80gb.scheduler_budget(), (8_192, 1_024));
        assert_eq!(GpuProfile::H200_141gb.scheduler_budget(), (8_192, 1_024));
    }

    #[test]
    fn derived_figures_match_the_datasheets() {
        let model = ModelShape::DENSE_27B;
        assert_eq!(model.kv_bytes_per_token(), 262_144.0);
        let l40s = GpuProfile::L40s48gb.latency(&model);
        // ~3,350 prompt tokens/s and a ~35 ms weight read on an L40S.
        assert!((l40s.prefill_s_per_token - 0.000_298).abs() < 0.000_001);
        assert!((l40s.decode_base_s - 0.0347).abs() < 0.0001);
        let h200 = GpuProfile::H200_141gb.latency(&model);
        assert!(h200.decode_base_s < GpuProfile::H100_80gb.latency(&model).decode_base_s);
        // KV capacity grows with memory: ~58k tokens on an L40S, ~380k on an H200.
        let blocks = |gpu: GpuProfile| gpu.num_blocks(&model, 64) * 64;
        assert!((55_000..60_000).contains(&blocks(GpuProfile::L40s48gb)));
        assert!((160_000..170_000).contains(&blocks(GpuProfile::H100_80gb)));
        assert!((375_000..385_000).contains(&blocks(GpuProfile::H200_141gb)));
    }

    #[test]
    fn a_smaller_block_size_cuts_the_same_memory_into_more_blocks() {
        let gpu = GpuProfile::L40s48gb;
        let tokens = |config: &EngineConfig| (config.num_blocks - 1) * config.block_size;
        let default = gpu.engine_config();
        let small = gpu.engine_config_with_block_size(16);
        assert_eq!(small.block_size, 16);
        assert!(
            small.num_blocks > 3 * default.num_blocks,
            "{small:?} {default:?}"
        );
        // The same tokens of KV, give or take the last partial block.
        assert!(tokens(&default).abs_diff(tokens(&small)) < default.block_size);
    }
}

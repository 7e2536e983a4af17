//! Switchyard's data plane: a Pingora proxy that routes OpenAI- and Anthropic-format LLM requests
//! to a pool of vLLM workers.
//!
//! The binary (`switchyard-proxy`) wires these together: a [`config::ConfigStore`] holds the live
//! routing table, a source (files today) feeds it snapshots, and [`gateway::Gateway`] serves
//! requests from whatever table is live when each request arrives.

pub mod accounting;
pub mod admit;
pub mod answer;
pub mod api;
pub mod assemble;
pub mod background;
pub mod calibration;
pub mod config;
pub mod connection;
pub mod control;
pub mod cors;
pub mod exchange;
pub mod feeds;
pub mod gateway;
pub mod headers;
pub mod history;
pub mod kv;
pub mod limits;
pub mod logging;
pub mod metrics;
pub mod multipart;
pub mod observe;
pub mod peers;
pub mod plan;
pub mod popularity;
pub mod prompt;
pub mod provider;
pub mod proxy;
pub mod request;
pub mod respond;
pub mod responses;
pub mod routing;
pub mod scorer;
pub mod telemetry;
pub mod tokenizer_check;
pub mod tokens;
pub mod translate;
pub mod translate_openai;
pub mod translate_request;
pub mod translate_responses;
pub mod wire;
pub mod worker;

/// Lock a mutex, taking the data even if a thread panicked while holding it: every mutex in the
/// proxy guards counters or caches that stay usable, and serving must not stop over one panic.
pub(crate) fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match mutex.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}

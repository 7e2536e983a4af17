//! Switchyard's end-to-end tests as one test binary (`e2e`), a module per area, so the harness
//! and its dependencies are compiled and linked once. Each module starts the real binaries on
//! 127.0.0.1 and drives them (tests/README.md lists the modules and what they need).
//!
//! Everything: `cargo test -p switchyard-e2e`. One module, by test path prefix:
//! `cargo test -p switchyard-e2e --test e2e chat::`.

mod anthropic;
mod audio;
mod bench_quick;
mod cache_routing;
mod calibration;
mod chat;
mod chat_templates;
mod connections;
mod control_cli;
mod control_socket;
mod cors;
mod dependencies;
mod docs;
mod errors;
mod fallback;
mod helm;
mod kubernetes;
mod ledger;
mod logs;
mod policies;
mod pooling;
mod providers;
mod proxy_sim;
mod reload_retry;
mod responses;
mod sdk_clients;
mod sdk_tenants;
mod tenants;
mod tokenizer_check;
mod traces;
mod vllm_block_pool;
mod vllm_compat;

//! Switchyard's load-testing kit: a vLLM simulator ([`sim`]) that users can keep as a fake vLLM
//! for their own CI, and the benchmark harness built on it.

pub mod compare;
pub mod overhead;
pub mod peers;
pub mod sim;
pub mod workload;

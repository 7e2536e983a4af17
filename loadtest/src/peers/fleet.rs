//! What the re-implemented peers observe of the workers from outside, as their originals do:
//! a prefix index fed by each worker's vLLM KV events (ZMQ), and each worker's vLLM gauges
//! scraped from `/metrics` on an interval.
//!
//! Every run starts a fresh simulator, so the subscribers connect before the first request and
//! replay is not needed; a sequence gap (never seen on loopback) is counted, not repaired.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use switchyard_kv::events::decode_frames;
use switchyard_kv::index::{Overlap, PrefixIndex, WorkerId};
use tokio::task::JoinHandle;
use zeromq::{Socket, SocketRecv};

/// A worker's gauges as vLLM exports them, summed over label sets (KV usage: the maximum).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Gauges {
    /// `vllm:num_requests_waiting`.
    pub waiting: f64,
    /// `vllm:num_requests_running`.
    pub running: f64,
    /// `vllm:kv_cache_usage_perc` (a fraction in [0, 1], despite the name).
    pub kv_usage: f64,
}

impl Gauges {
    /// Read the gauges from a Prometheus text exposition; `None` when none of them is there.
    pub fn parse(text: &str) -> Option<Gauges> {
        let mut gauges = Gauges::default();
        let mut found = false;
        for line in text.lines().filter(|line| !line.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            let Some(value) = line
                .rsplit(' ')
                .next()
                .and_then(|value| value.parse::<f64>().ok())
            else {
                continue;
            };
            match name {
                "vllm:num_requests_waiting" => gauges.waiting += value,
                "vllm:num_requests_running" => gauges.running += value,
                "vllm:kv_cache_usage_perc" => gauges.kv_usage = gauges.kv_usage.max(value),
                _ => continue,
            }
            found = true;
        }
        found.then_some(gauges)
    }
}

/// The observed state of every worker, by index in the worker list.
pub struct Fleet {
    pub index: PrefixIndex,
    gauges: Vec<Mutex<Gauges>>,
    /// KV-event messages lost to sequence gaps (diagnostics only).
    pub missed_event_messages: AtomicU64,
}

impl Fleet {
    pub fn new(workers: usize, block_size: usize) -> Fleet {
        Fleet {
            index: PrefixIndex::new(block_size),
            gauges: (0..workers)
                .map(|_| Mutex::new(Gauges::default()))
                .collect(),
            missed_event_messages: AtomicU64::new(0),
        }
    }

    pub fn workers(&self) -> usize {
        self.gauges.len()
    }

    /// How deep each worker holds `hashes`, as its KV events tell.
    pub fn overlap(&self, hashes: &[switchyard_kv::hash::SequenceHash]) -> Overlap {
        let mut overlap = Overlap::default();
        self.index
            .overlap_into(hashes, self.workers(), &mut overlap);
        overlap
    }

    /// The last scrape of `worker` (zeros before the first one).
    pub fn gauges(&self, worker: usize) -> Gauges {
        self.gauges.get(worker).map_or_else(Gauges::default, |g| {
            *g.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
        })
    }

    fn set_gauges(&self, worker: usize, gauges: Gauges) {
        if let Some(slot) = self.gauges.get(worker) {
            *slot
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = gauges;
        }
    }
}

/// Where one worker publishes.
#[derive(Debug, Clone)]
pub struct WorkerAddress {
    /// `host:port` of its HTTP server.
    pub http: String,
    /// Its KV-event PUB endpoint (`tcp://host:port`).
    pub kv_events: String,
}

/// Subscribe to every worker's KV events (connected and subscribed when this returns) and,
/// with `scrape_every`, scrape their gauges on that interval. The tasks run until aborted.
pub async fn start(
    fleet: &std::sync::Arc<Fleet>,
    workers: &[WorkerAddress],
    scrape_every: Option<Duration>,
) -> anyhow::Result<Vec<JoinHandle<()>>> {
    let mut tasks = Vec::new();
    for (slot, worker) in workers.iter().enumerate() {
        let mut socket = zeromq::SubSocket::new();
        socket
            .connect(&worker.kv_events)
            .await
            .with_context(|| format!("connecting to {}", worker.kv_events))?;
        socket.subscribe("").await?;
        let id = WorkerId(u16::try_from(slot).context("too many workers")?);
        let events_fleet = fleet.clone();
        tasks.push(tokio::spawn(async move {
            let fleet = events_fleet;
            let mut expected: Option<u64> = None;
            while let Ok(message) = socket.recv().await {
                let Ok(message) = decode_frames(&message.into_vec()) else {
                    continue;
                };
                if let Some(expected) = expected
                    && message.seq > expected
                {
                    fleet
                        .missed_event_messages
                        .fetch_add(message.seq - expected, Ordering::Relaxed);
                }
                expected = Some(message.seq + 1);
                fleet.index.apply_batch(id, &message.batch);
            }
        }));
        if let Some(interval) = scrape_every {
            let (fleet, url) = (fleet.clone(), format!("http://{}/metrics", worker.http));
            tasks.push(tokio::spawn(async move {
                let client = reqwest::Client::new();
                let mut ticker = tokio::time::interval(interval);
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    ticker.tick().await;
                    let Ok(response) = client.get(&url).send().await else {
                        continue;
                    };
                    if let Some(gauges) = response
                        .text()
                        .await
                        .ok()
                        .and_then(|text| Gauges::parse(&text))
                    {
                        fleet.set_gauges(slot, gauges);
                    }
                }
            }));
        }
    }
    // A PUB socket drops messages for a subscription it has not processed yet.
    tokio::time::sleep(Duration::from_millis(200)).await;
    Ok(tasks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gauges_sum_label_sets_and_take_the_highest_kv_usage() {
        let text = "# HELP vllm:num_requests_waiting x\n\
            vllm:num_requests_waiting{model_name=\"m\",engine=\"0\"} 3\n\
            vllm:num_requests_waiting{model_name=\"m\",engine=\"1\"} 2\n\
            vllm:num_requests_running{model_name=\"m\",engine=\"0\"} 4\n\
            vllm:kv_cache_usage_perc{model_name=\"m\",engine=\"0\"} 0.25\n\
            vllm:kv_cache_usage_perc{model_name=\"m\",engine=\"1\"} 0.5\n\
            vllm:num_requests_waiting_other 9\n";
        assert_eq!(
            Gauges::parse(text),
            Some(Gauges {
                waiting: 5.0,
                running: 4.0,
                kv_usage: 0.5
            })
        );
        assert_eq!(Gauges::parse("up 1\n"), None);
    }
}

//! The background feeds of worker state: one KV event subscriber and one metrics scraper per
//! worker of every cache-aware pool, started, changed and stopped as the live routing table
//! changes (a `watch` of the [`ConfigStore`], no polling).
//!
//! Event stream rules (vLLM's publisher numbers batches from 0 per process):
//! - the next batch has the next sequence number: apply it;
//! - a higher one is a gap: ask the replay socket for the missing batches; if that fails, drop
//!   the worker's entries (they may be wrong) and carry on from the new batch;
//! - a lower one means the publisher restarted (its cache is gone): drop the worker's entries,
//!   replay what the new process already published, carry on;
//! - the first batch after (re)connecting with a sequence above 0 is a gap from 0.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use switchyard_kv::events::{REPLAY_END_SEQ, decode_frames, decode_seq};
use switchyard_kv::index::WorkerId;
use switchyard_snapshot::PoolId;
use switchyard_snapshot::snapshot::LoadBalancing;
use tokio::task::JoinHandle;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::config::ConfigStore;
use crate::kv::{PoolKv, StreamStats, WorkerLoad};
use crate::routing::RoutingTable;

/// Everything a subscriber needs.
#[derive(Clone)]
struct StreamTarget {
    pool: Arc<PoolKv>,
    slot: WorkerId,
    address: String,
    events: String,
    replay: Option<String>,
    topic: String,
}

/// Apply one decoded message, handling gaps and restarts. Returns the next expected sequence.
async fn on_message(
    target: &StreamTarget,
    stats: &StreamStats,
    expected: Option<u64>,
    seq: u64,
    batch: &switchyard_kv::events::KvEventBatch,
) -> u64 {
    let index = &target.pool.index;
    match expected {
        Some(expected) if seq == expected => {}
        Some(expected) if seq > expected => fill_gap(target, stats, expected, seq).await,
        Some(_) => {
            // Sequence went back: a new publisher process, with a new (empty) cache.
            stats.publisher_restarts.fetch_add(1, Ordering::Relaxed);
            tracing::info!(worker = %target.address, seq, "KV event publisher restarted; clearing its entries");
            index.clear_worker(target.slot);
            if seq > 0 {
                fill_gap(target, stats, 0, seq).await;
            }
        }
        None if seq > 0 => fill_gap(target, stats, 0, seq).await,
        None => {}
    }
    index.apply_batch(target.slot, batch);
    stats.batch_applied();
    seq + 1
}

async fn fill_gap(target: &StreamTarget, stats: &StreamStats, from: u64, to: u64) {
    let replayed = match &target.replay {
        Some(replay) => replay_range(target, replay, from, to).await,
        None => Err("no replay endpoint".to_owned()),
    };
    match replayed {
        Ok(()) => {
            stats.gaps_replayed.fetch_add(1, Ordering::Relaxed);
        }
        Err(reason) => {
            stats.gaps_cleared.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(worker = %target.address, from, to, %reason, "KV event gap could not be filled; the worker's cache entries were dropped");
            target.pool.index.clear_worker(target.slot);
        }
    }
}

/// Fetch batches `from..to` from the replay socket and apply them in order.
async fn replay_range(
    target: &StreamTarget,
    endpoint: &str,
    from: u64,
    to: u64,
) -> Result<(), String> {
    let mut dealer = zeromq::DealerSocket::new();
    tokio::time::timeout(Duration::from_secs(2), dealer.connect(endpoint))
        .await
        .map_err(|_| "replay connect timed out".to_owned())?
        .map_err(|e| format!("replay connect: {e}"))?;
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&from.to_be_bytes()),
    ])
    .map_err(|e| e.to_string())?;
    dealer
        .send(request)
        .await
        .map_err(|e| format!("replay request: {e}"))?;
    let mut next = from;
    loop {
        let reply = tokio::time::timeout(Duration::from_secs(2), dealer.recv())
            .await
            .map_err(|_| "replay timed out".to_owned())?
            .map_err(|e| format!("replay receive: {e}"))?
            .into_vec();
        // Replies are [empty, topic, seq, payload] (vLLM ≥ 0.27) or [empty, seq, payload] before.
        let frames = reply.get(1..).unwrap_or_default();
        let seq_frame = if frames.len() >= 3 {
            frames.get(1)
        } else {
            frames.first()
        };
        let seq = seq_frame.ok_or("empty replay reply")?;
        if decode_seq(seq).map_err(|e| e.to_string())? == REPLAY_END_SEQ {
            break;
        }
        let frames: Vec<Bytes> = if frames.len() >= 3 {
            frames.to_vec()
        } else {
            std::iter::once(Bytes::from(target.topic.clone().into_bytes()))
                .chain(frames.iter().cloned())
                .collect()
        };
        let message = decode_frames(&frames).map_err(|e| e.to_string())?;
        if message.seq < next {
            continue;
        }
        if message.seq >= to {
            break;
        }
        if message.seq > next {
            return Err(format!(
                "replay buffer starts at {} but {next} is needed",
                message.seq
            ));
        }
        target.pool.index.apply_batch(target.slot, &message.batch);
        next = message.seq + 1;
    }
    if next < to {
        return Err(format!("replay ended at {next}, before {to}"));
    }
    Ok(())
}

/// The block size of a stored block in `batch` other than the pool's, if there is one.
fn other_block_size(batch: &switchyard_kv::events::KvEventBatch, pool: usize) -> Option<u32> {
    batch.events.iter().find_map(|event| match event {
        switchyard_kv::events::KvEvent::BlockStored(stored)
            if stored.block_size as usize != pool =>
        {
            Some(stored.block_size)
        }
        _ => None,
    })
}

/// Subscribe to one worker's events until cancelled, reconnecting with backoff.
async fn run_subscriber(target: StreamTarget) {
    let stats = target.pool.stream_stats(target.slot);
    let mut backoff = Duration::from_millis(100);
    // Said once per worker: every later event of another size is counted, not logged.
    let mut block_size_said = false;
    loop {
        let mut socket = zeromq::SubSocket::new();
        let connected = async {
            socket.connect(&target.events).await?;
            socket.subscribe(&target.topic).await
        }
        .await;
        if let Err(error) = connected {
            tracing::debug!(worker = %target.address, endpoint = %target.events, %error, "KV event subscribe failed; retrying");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
            continue;
        }
        backoff = Duration::from_millis(100);
        tracing::info!(worker = %target.address, endpoint = %target.events, "subscribed to KV events");
        let mut expected = None;
        loop {
            let message = match socket.recv().await {
                Ok(message) => message,
                Err(error) => {
                    tracing::warn!(worker = %target.address, %error, "KV event stream broke; resubscribing");
                    break;
                }
            };
            match decode_frames(&message.into_vec()) {
                Ok(message) => {
                    let pool_block_size = target.pool.index.block_size();
                    if !block_size_said
                        && let Some(theirs) = other_block_size(&message.batch, pool_block_size)
                    {
                        block_size_said = true;
                        tracing::warn!(
                            worker = %target.address,
                            worker_block_size = theirs,
                            pool_block_size,
                            "the worker's KV blocks are not the pool's size: their events cannot be indexed, so routing cannot see what it caches; set the pool's spec.blockSize to the worker's --block-size"
                        );
                    }
                    expected = Some(
                        on_message(&target, &stats, expected, message.seq, &message.batch).await,
                    );
                }
                Err(error) => {
                    stats.decode_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(worker = %target.address, %error, "undecodable KV event message skipped");
                }
            }
        }
    }
}

async fn run_scraper(url: String, load: Arc<WorkerLoad>, interval: Duration, started: Instant) {
    let client = reqwest::Client::builder()
        .timeout(interval.max(Duration::from_millis(500)) * 2)
        .build()
        .unwrap_or_default();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let text = match client.get(&url).send().await {
            Ok(response) if response.status().is_success() => response.text().await.ok(),
            _ => None,
        };
        match text {
            Some(text) => load.update_from_metrics(&text, started.elapsed().as_millis() as u64 + 1),
            None => load.scrape_failed(),
        }
    }
}

/// Keeps subscribers and scrapers in line with the live routing table.
pub struct KvService {
    pub store: Arc<ConfigStore>,
}

struct Running {
    key: String,
    task: JoinHandle<()>,
}

/// The running feeds, keyed by what they read: a changed key restarts a feed.
#[derive(Default)]
struct Feeds {
    subscribers: HashMap<(PoolId, String), Running>,
    scrapers: HashMap<String, Running>,
    /// Per pool, the check of its tokenizer against its workers' ([`crate::tokenizer_check`]),
    /// keyed by the tokenizer, served model and block size it checks.
    tokenizer_checks: HashMap<PoolId, Running>,
}

#[async_trait]
impl BackgroundService for KvService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let started = Instant::now();
        let mut feeds = Feeds::default();
        let mut tables = self.store.subscribe();
        loop {
            let table = tables.borrow_and_update().clone();
            if let Some(table) = table {
                feeds.follow(&table, started);
                feeds.check_tokenizers(&table, &self.store);
            }
            tokio::select! {
                changed = tables.changed() => if changed.is_err() { break },
                _ = shutdown.changed() => break,
            }
        }
        for running in feeds
            .subscribers
            .into_values()
            .chain(feeds.scrapers.into_values())
            .chain(feeds.tokenizer_checks.into_values())
        {
            running.task.abort();
        }
    }
}

impl Feeds {
    /// Check each cache-aware pool's tokenizer once per tokenizer, served model and block size
    /// it is given (a check still running for another is stopped).
    fn check_tokenizers(&mut self, table: &RoutingTable, store: &Arc<ConfigStore>) {
        let wanted: HashMap<PoolId, String> = table
            .pools()
            .filter(|pool| pool.tokenizer.is_some())
            .map(|pool| {
                // A new block size is a new KV state (and agreement) for the pool.
                let key = format!(
                    "{:?}|{}|{}",
                    pool.config.tokenizer, pool.config.served_model, pool.config.block_size
                );
                (pool.config.id.clone(), key)
            })
            .collect();
        self.tokenizer_checks.retain(|id, running| {
            let keep = wanted.get(id) == Some(&running.key);
            if !keep {
                running.task.abort();
            }
            keep
        });
        for (id, key) in wanted {
            self.tokenizer_checks
                .entry(id.clone())
                .or_insert_with(|| Running {
                    key,
                    task: tokio::spawn(crate::tokenizer_check::run(store.clone(), id)),
                });
        }
    }

    /// Start, restart and stop feeds so that every worker of `table`'s cache-aware pools has
    /// exactly the ones its configuration asks for.
    fn follow(&mut self, table: &RoutingTable, started: Instant) {
        let mut wanted_subscribers = HashMap::new();
        let mut wanted_scrapers = HashMap::new();
        for pool in table.pools() {
            if pool.config.load_balancing != LoadBalancing::CacheAware {
                continue;
            }
            for (position, worker) in pool.workers.iter().enumerate() {
                let endpoint = pool.config.endpoints.get(position);
                let url = format!("http://{}{}", worker.address, pool.config.metrics_path);
                wanted_scrapers.insert(
                    worker.address.clone(),
                    (
                        format!("{url}|{}", pool.config.scrape_interval_ms),
                        url,
                        Duration::from_millis(pool.config.scrape_interval_ms),
                        worker.load.clone(),
                    ),
                );
                if let Some(events) = endpoint.and_then(|e| e.kv_events.clone()) {
                    let replay = endpoint.and_then(|e| e.kv_replay.clone());
                    let key = format!(
                        "{events}|{}|{}|{}",
                        replay.as_deref().unwrap_or(""),
                        pool.config.kv_topic,
                        pool.kv.index.block_size()
                    );
                    let target = StreamTarget {
                        pool: pool.kv.clone(),
                        slot: pool.slots.get(position).copied().unwrap_or(WorkerId(0)),
                        address: worker.address.clone(),
                        events,
                        replay,
                        topic: pool.config.kv_topic.clone(),
                    };
                    wanted_subscribers.insert(
                        (pool.config.id.clone(), worker.address.clone()),
                        (key, target),
                    );
                }
            }
        }
        // Stop what is no longer wanted (or changed); workers that left the pool lose their slot
        // and every index entry in `release` below.
        self.subscribers.retain(|id, running| {
            let keep = wanted_subscribers
                .get(id)
                .is_some_and(|(key, _)| *key == running.key);
            if !keep {
                running.task.abort();
            }
            keep
        });
        for pool in table.pools() {
            let live: Vec<&str> = pool.workers.iter().map(|w| w.address.as_str()).collect();
            for (address, _) in pool.kv.workers() {
                if !live.contains(&address.as_str()) {
                    pool.kv.release(&address);
                }
            }
        }
        for (id, (key, target)) in wanted_subscribers {
            self.subscribers.entry(id).or_insert_with(|| {
                // Its events say what it holds from now on, not what it was assumed to.
                target.pool.predictions.history.forget(target.slot);
                Running {
                    key,
                    task: tokio::spawn(run_subscriber(target)),
                }
            });
        }
        self.scrapers.retain(|address, running| {
            let keep = wanted_scrapers
                .get(address)
                .is_some_and(|(key, ..)| *key == running.key);
            if !keep {
                running.task.abort();
            }
            keep
        });
        for (address, (key, url, interval, load)) in wanted_scrapers {
            self.scrapers.entry(address).or_insert_with(|| Running {
                key,
                task: tokio::spawn(run_scraper(url, load, interval, started)),
            });
        }
    }
}

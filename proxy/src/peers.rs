//! Other gateway replicas' ledgers ("shared hints"), pushed as they change.
//!
//! Several proxy replicas in front of the same workers each know their own requests exactly and
//! at once, and everyone else's only through the workers' gauges, a scrape late and as bare
//! counts: a request another replica is prefilling shows as one "running" request, not as the
//! thousands of prompt tokens ahead of the next one. So each replica sends its ledger (per
//! worker: pending prefills, their tokens and how long the worker has been on the oldest,
//! requests in flight, KV blocks reserved; per pool: its arrival rate) to the others whenever it
//! changes (a decision, a first token, an end) and at least every `--peer-interval-ms`, and
//! counts theirs like its own; the workers' gauges then only add what no replica explains.
//! Their arrival rates are added to this one's: the scorer's fleet charge ([`crate::scorer`]) is
//! about every request that will arrive behind a choice, not only those that come through this
//! replica. And the prompts each is having prefilled, as a sample of their block hashes per
//! worker: until the worker's KV events store a prompt's blocks (after its prefill) only the
//! replica that sent it knows where they will be, and a request sharing the prefix that arrives
//! at another replica meanwhile would be sent to prefill it a second time elsewhere (at a
//! worker without KV events, as long as the request runs, and then its end: such a worker's
//! cache is known only from what the replicas sent it, [`crate::history`]). And what
//! it learned from its answers ([`crate::calibration`]): how fast each worker answers, and its
//! latest answers themselves, which the others' pool models learn from once each; each replica
//! sees only its share of the answers, and alone would learn that much later. And the prompt
//! pieces it tokenized (`--peer-prompt-pieces`, on by default): token ids under a hash of their
//! text, which the others' tokenizers adopt, so a long prompt another replica routed first is
//! looked up rather than tokenized whole on the path of the first request for it here.
//!
//! Why pushed, and why datagrams: a ledger read every interval is an interval late, and two
//! replicas deciding within it both take the same best worker; one pushed at each change is
//! late by a datagram's trip. Each datagram is the sender's whole ledger (the workers it counts
//! anything against; the others count nothing), numbered, so a lost or reordered one is
//! repaired by the next and no acknowledgement is needed. They travel over UDP on the operator
//! listener's port (the same `host:port` the peers are named by; a Kubernetes headless Service
//! names every replica). A replica sends to the peers it resolves every interval and to every
//! replica it has heard from lately; it hears only hosts its peers resolve to (from any port),
//! and recognises its own datagrams by its instance id and skips them. A replica not heard from
//! for [`SILENT_INTERVALS`] of its intervals counts for nothing until it is heard again.
//!
//! Who may send one: with a key shared by the replicas (`--peers-key-file`, [`PeerKey`]) every
//! datagram carries an HMAC-SHA256 tag of its bytes and the time it was sent, and a receiver
//! drops one whose tag is not the key's (forged, or from a replica with another key) or that was
//! sent more than [`FRESH_FOR`] from its own clock (replayed, or the clocks are apart). Within
//! that time a replay of a replica still heard is older than its latest and dropped (as a late
//! one is), and one of a replica that stopped can make it count again for the rest of it.
//! Without a key a datagram is believed from any host the peers' names resolve to. Every
//! datagram received but this process's own is counted by what became of it
//! (`switchyard_peer_datagrams_total{outcome}`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use ring::hmac;
use serde::{Deserialize, Serialize};
use tokio::net::UdpSocket;

use switchyard_kv::hash::SequenceHash;
use switchyard_kv::index::WorkerId;
use switchyard_kv::tokenize::{Piece, PromptTokenizer};
use switchyard_snapshot::snapshot::PoolId;

use crate::calibration::{Coefficients, Observation, PrefillWork, Speed};
use crate::config::ConfigStore;
pub use crate::kv::PeerLedger;
use crate::kv::PeerPrefixes;
use crate::routing::RoutingTable;
use crate::worker::LEDGER_CHANGED;

/// This process's id among replicas (random, fixed for its life).
pub fn instance_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| format!("{:016x}", rand::random::<u64>()))
}

/// Whether this process sends its ledger to other replicas (its peer service runs).
static SHARING: AtomicBool = AtomicBool::new(false);

/// Whether this process shares its ledger with other replicas: then a prompt routed by its head
/// alone is tokenized whole at once, for the others to learn where its blocks will be.
pub fn sharing() -> bool {
    SHARING.load(Ordering::Relaxed)
}

/// Intervals (the sender's) without a datagram after which a replica counts for nothing (it
/// stopped, or the network between us did).
pub const SILENT_INTERVALS: u32 = 10;

/// Replicas remembered at most (a gateway runs tens); datagrams of more are ignored.
const MAX_REPLICAS: usize = 256;

/// Largest ledger sent in one datagram (a keyed one is its tag longer); a ledger longer than
/// this (well over a thousand busy workers) keeps its busiest workers and says so in the log.
const MAX_DATAGRAM: usize = 60_000;

/// Tokens of new prompt pieces sent in one datagram at most (about 6 bytes each as JSON); the
/// rest go in the next, sent at once.
const PIECE_TOKENS_PER_DATAGRAM: usize = 4_096;

/// Tokens of pieces heard and not yet adopted kept at most (the oldest go first).
const UNADOPTED_TOKENS: usize = 65_536;

/// The format's version: a datagram of another version is ignored.
const VERSION: u32 = 1;

/// How long after it was sent (by the sender's clock, read by the receiver's) a keyed datagram
/// is believed: replicas send every interval (100 ms by default), so anything older is a replay,
/// or the hosts' clocks are further apart than a cluster's should be.
pub const FRESH_FOR: Duration = Duration::from_secs(30);

/// The replicas' shared secret: every datagram is tagged with HMAC-SHA256 under it.
#[derive(Clone)]
pub struct PeerKey(hmac::Key);

impl std::fmt::Debug for PeerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.write_str("PeerKey(..)")
    }
}

impl PeerKey {
    /// Shortest secret accepted, in bytes.
    pub const MIN_BYTES: usize = 16;

    /// Bytes of the tag in front of every keyed datagram.
    const TAG: usize = 32;

    pub fn new(secret: &[u8]) -> PeerKey {
        PeerKey(hmac::Key::new(hmac::HMAC_SHA256, secret))
    }

    /// The key in the file at `path` (a mounted Secret): its bytes less leading and trailing
    /// whitespace (the newline an editor or `echo` leaves), at least [`PeerKey::MIN_BYTES`].
    pub fn from_file(path: &Path) -> Result<PeerKey, String> {
        let bytes = std::fs::read(path).map_err(|error| {
            format!(
                "cannot read the peers' key file {}: {error}",
                path.display()
            )
        })?;
        let secret = bytes.trim_ascii();
        if secret.len() < PeerKey::MIN_BYTES {
            return Err(format!(
                "the peers' key file {} holds {} bytes; at least {} are needed (for one: `head -c 32 /dev/urandom | base64 > FILE`)",
                path.display(),
                secret.len(),
                PeerKey::MIN_BYTES
            ));
        }
        Ok(PeerKey::new(secret))
    }

    /// `body` with its tag in front.
    fn seal(&self, body: &[u8]) -> Vec<u8> {
        let tag = hmac::sign(&self.0, body);
        let mut sealed = Vec::with_capacity(PeerKey::TAG + body.len());
        sealed.extend_from_slice(tag.as_ref());
        sealed.extend_from_slice(body);
        sealed
    }

    /// The body of a datagram sealed with this key (compared in constant time); `None` for
    /// any other.
    fn open<'a>(&self, sealed: &'a [u8]) -> Option<&'a [u8]> {
        let (tag, body) = sealed.split_at_checked(PeerKey::TAG)?;
        hmac::verify(&self.0, body, tag).ok()?;
        Some(body)
    }
}

/// Why a datagram received was not heard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refused {
    /// This process's own (the peers' names resolve to it too): skipped, not counted.
    Own,
    /// From a host the peers' names do not resolve to.
    UnknownHost,
    /// Its tag is not this replica's key's, or it has none (or has one and this replica none).
    Unauthenticated,
    /// Sent longer than [`FRESH_FOR`] ago, or that far in the future.
    Stale,
    /// Not a ledger of this version.
    Malformed,
    /// Its replica's latest heard is as late or later (a duplicate, reordered, replayed, or
    /// an old instance's at the address of its successor), or it is past [`MAX_REPLICAS`].
    Late,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct OutcomeLabels {
    outcome: &'static str,
}

/// Things the other replicas sent, by what became of them: a handle on a family `/metrics`
/// encodes ([`crate::metrics`]): their datagrams received
/// (`switchyard_peer_datagrams_total{outcome}`), the prompt pieces sent and heard
/// (`switchyard_peer_prompt_pieces_total{outcome}`).
#[derive(Debug, Clone, Default)]
pub struct PeerCounts(Family<OutcomeLabels, Counter>);

impl PeerCounts {
    /// The family, to register.
    pub(crate) fn family(&self) -> Family<OutcomeLabels, Counter> {
        self.0.clone()
    }

    fn count(&self, outcome: &'static str) {
        self.add(outcome, 1);
    }

    fn add(&self, outcome: &'static str, n: usize) {
        self.0
            .get_or_create(&OutcomeLabels { outcome })
            .inc_by(n as u64);
    }
}

impl Refused {
    /// Its `outcome` label in `switchyard_peer_datagrams_total` (none for this process's own).
    fn outcome(self) -> Option<&'static str> {
        match self {
            Refused::Own => None,
            Refused::UnknownHost => Some("unknown_host"),
            Refused::Unauthenticated => Some("unauthenticated"),
            Refused::Stale => Some("stale"),
            Refused::Malformed => Some("malformed"),
            Refused::Late => Some("late"),
        }
    }
}

/// Count one datagram received, and say once per kind why datagrams are being dropped.
fn count_received(counts: &PeerCounts, outcome: Result<(), Refused>) {
    static UNAUTHENTICATED: OnceLock<()> = OnceLock::new();
    static STALE: OnceLock<()> = OnceLock::new();
    match outcome {
        Err(Refused::Unauthenticated) => {
            UNAUTHENTICATED.get_or_init(|| {
                tracing::warn!(
                    "a datagram from a peer's host failed authentication and was dropped: do all replicas have the same --peers-key-file (or all none)? (warned once)"
                )
            });
        }
        Err(Refused::Stale) => {
            STALE.get_or_init(|| {
                tracing::warn!(
                    fresh_for_s = FRESH_FOR.as_secs(),
                    "a peer's datagram dated too far from this host's clock was dropped: a replay, or the hosts' clocks differ (warned once)"
                )
            });
        }
        _ => {}
    }
    match outcome {
        Ok(()) => counts.count("heard"),
        Err(refused) => {
            if let Some(outcome) = refused.outcome() {
                counts.count(outcome);
            }
        }
    }
}

/// Milliseconds since the Unix epoch by this host's clock.
fn unix_ms(now: SystemTime) -> u64 {
    now.duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as u64)
}

/// What one replica reports: its ledger per worker address, and its arrival rate per pool.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ReplicaLedger {
    pub workers: HashMap<String, PeerLedger>,
    /// Requests per second the replica routes into each pool (by pool id, `namespace/name`).
    pub arrival_rates: HashMap<String, f64>,
    /// The prompts the replica is having prefilled, per worker address: block hashes sampled
    /// from them ([`crate::kv::Predictions::prefilling`]).
    pub prefixes: HashMap<String, Vec<u64>>,
    /// How fast each worker answers against the TTFT formula, as the replica learned it from
    /// its own answers: `(ratio, observations)`, one per replica once summed.
    pub speeds: HashMap<String, Vec<(f64, u64)>>,
    /// The replica's latest answers as the pools' TTFT models learn from them, numbered, per
    /// pool id ([`PoolCalibration::recent`](crate::calibration::PoolCalibration::recent));
    /// taught once each when heard, never summed.
    pub observations: HashMap<String, Vec<(u64, Observation)>>,
    /// The replica's latest requests that ended at a worker without KV events, numbered, per
    /// pool id: the worker's address and the prompt's sampled blocks `(blocks up to, hash)`
    /// ([`crate::kv::Predictions::recent_frees`]); assumed held once each when heard, never
    /// summed.
    pub freed: HashMap<String, Vec<Freed>>,
    /// Prompt pieces the replica tokenized since its last datagram, by its tokenizers'
    /// [`fingerprint`](switchyard_kv::tokenize::PromptTokenizer::fingerprint): a replica with
    /// the same tokenizer adopts them ([`PromptTokenizer::adopt_pieces`]), and the first
    /// request it sees for a prompt another replica sent (a shared system prompt) is looked up
    /// instead of tokenized whole on its path. Sent once each, never summed; a lost datagram
    /// loses only that saving.
    ///
    /// [`PromptTokenizer::adopt_pieces`]: switchyard_kv::tokenize::PromptTokenizer::adopt_pieces
    pub pieces: HashMap<u64, Vec<Piece>>,
    /// Fingerprints of the replica's tokenizers that no longer cut text between words (one
    /// found a text tokenized word by word otherwise than whole): a replica's tokenizer of the
    /// same fingerprint stops too, and forgets the pieces it had, adopted ones with them.
    pub word_cuts_off: Vec<u64>,
}

/// One request that ended at a worker without KV events: its number, the worker's address,
/// and its prompt's sampled blocks.
pub type Freed = (u64, String, Sampled);

/// A prompt's sampled blocks: `(blocks up to, hash)`, increasing.
pub type Sampled = Vec<(usize, u64)>;

/// A [`Freed`] in a datagram: the pool's id first.
type PoolFreed = (String, u64, String, Sampled);

/// A [`Freed`] heard of, not yet assumed held: the pool's id, the worker's address, the samples.
type Unheld = (String, String, Sampled);

impl ReplicaLedger {
    fn add(&mut self, other: &ReplicaLedger) {
        for (worker, ledger) in &other.workers {
            self.workers.entry(worker.clone()).or_default().add(ledger);
        }
        for (pool, rate) in &other.arrival_rates {
            *self.arrival_rates.entry(pool.clone()).or_default() += rate;
        }
        for (worker, hashes) in &other.prefixes {
            self.prefixes
                .entry(worker.clone())
                .or_default()
                .extend_from_slice(hashes);
        }
        for (worker, speeds) in &other.speeds {
            self.speeds
                .entry(worker.clone())
                .or_default()
                .extend_from_slice(speeds);
        }
    }

    /// This replica's own ledger now: every worker of the table it counts anything against.
    pub fn own(table: &RoutingTable) -> ReplicaLedger {
        let mut own = ReplicaLedger::default();
        for pool in table.pools() {
            let (model, _, _) = crate::scorer::model(pool);
            let rate = pool.kv.own_arrival_rate();
            if rate.is_finite() && rate > 0.0 {
                own.arrival_rates.insert(pool.config.id.0.clone(), rate);
            }
            for worker in &pool.workers {
                let ledger = worker.ledger();
                if ledger != PeerLedger::default() {
                    own.workers.insert(worker.address.clone(), ledger);
                }
                // Once per worker, however many pools name it (it learns from every answer).
                let speed = worker.ttft.own(&model);
                if speed.observations > 0 && !own.speeds.contains_key(&worker.address) {
                    own.speeds.insert(
                        worker.address.clone(),
                        vec![(speed.ratio, speed.observations)],
                    );
                }
            }
            let recent = pool.kv.calibration.recent();
            if !recent.is_empty() {
                own.observations.insert(pool.config.id.0.clone(), recent);
            }
            let address = |slot: WorkerId| {
                let at = pool.slots.iter().position(|s| *s == slot)?;
                Some(pool.workers.get(at)?.address.clone())
            };
            let freed: Vec<Freed> = pool
                .kv
                .predictions
                .recent_frees()
                .into_iter()
                .filter_map(|(n, slot, samples)| {
                    let samples = samples.iter().map(|(upto, hash)| (*upto, hash.0)).collect();
                    Some((n, address(slot)?, samples))
                })
                .collect();
            if !freed.is_empty() {
                own.freed.insert(pool.config.id.0.clone(), freed);
            }
            let told: HashMap<_, _> = pool.kv.predictions.prefilling().into_iter().collect();
            for (worker, slot) in pool.workers.iter().zip(&pool.slots) {
                if let Some(hashes) = told.get(slot) {
                    own.prefixes
                        .entry(worker.address.clone())
                        .or_default()
                        .extend(hashes.iter().map(|h| h.0));
                }
            }
        }
        own
    }

    /// Take the prompt pieces this replica's tokenizers tokenized since the last call, up to
    /// [`PIECE_TOKENS_PER_DATAGRAM`] tokens of them, the tokenizers in turn from the
    /// `turn`th (none takes all of every datagram): whether more are left. And say which of
    /// them no longer cut between words.
    fn take_pieces(&mut self, table: &RoutingTable, turn: usize) -> bool {
        let mut budget = PIECE_TOKENS_PER_DATAGRAM;
        let mut more = false;
        let tokenizers = distinct_tokenizers(table);
        let start = turn % tokenizers.len().max(1);
        for tokenizer in tokenizers
            .iter()
            .skip(start)
            .chain(tokenizers.iter().take(start))
        {
            if !tokenizer.cuts_words() && !self.word_cuts_off.contains(&tokenizer.fingerprint()) {
                self.word_cuts_off.push(tokenizer.fingerprint());
            }
            let (pieces, left) = tokenizer.new_pieces(budget);
            more |= left;
            let tokens: usize = pieces.iter().map(|piece| piece.tokens.len()).sum();
            budget = budget.saturating_sub(tokens);
            if !pieces.is_empty() {
                self.pieces
                    .entry(tokenizer.fingerprint())
                    .or_default()
                    .extend(pieces);
            }
        }
        more
    }
}

/// One datagram: a replica's whole ledger, numbered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Datagram {
    v: u32,
    instance: String,
    seq: u64,
    /// The sender's `--peer-interval-ms`: it is forgotten after [`SILENT_INTERVALS`] of these.
    #[serde(default)]
    interval_ms: u64,
    /// When it was sent, in milliseconds since the Unix epoch by the sender's clock (keyed
    /// datagrams older than [`FRESH_FOR`] are replays).
    #[serde(default)]
    sent_ms: u64,
    /// `[address, prefills, prefill tokens, in flight, KV blocks, prefill elapsed µs]`.
    workers: Vec<(String, u64, u64, u64, u64, u64)>,
    arrival_rates: HashMap<String, f64>,
    /// `[address, sampled block hashes of the prompts being prefilled there]` (absent from
    /// replicas that predate it: they share none).
    #[serde(default)]
    prefixes: Vec<(String, Vec<u64>)>,
    /// `[address, speed ratio, observations]` of the workers the sender has learned.
    #[serde(default)]
    speeds: Vec<(String, f64, u64)>,
    /// `[pool, number, prefill tokens, running requests, seconds to the first token]` of the
    /// sender's latest answers.
    #[serde(default)]
    observations: Vec<(String, u64, f64, f64, f64)>,
    /// `[pool, number, attention pairs of the prefill tokens]` of the same answers, in the same
    /// order (absent from replicas that predate it: their answers are not learned from, the
    /// model's attention term would take them for answers without any).
    #[serde(default)]
    observation_pairs: Vec<(String, u64, f64)>,
    /// `[pool, number, address, [[blocks up to, hash], ...]]` of the sender's latest requests
    /// that ended at a worker without KV events.
    #[serde(default)]
    freed: Vec<PoolFreed>,
    /// `[tokenizer fingerprint, piece key, tokens]` of the prompt pieces the sender tokenized
    /// since its last datagram (each sent once).
    #[serde(default)]
    pieces: Vec<(u64, u64, Vec<u32>)>,
    /// Fingerprints of the sender's tokenizers that no longer cut between words.
    #[serde(default)]
    word_cuts_off: Vec<u64>,
}

impl Datagram {
    /// The ledger as one datagram's bytes.
    #[cfg(test)]
    fn encode(ledger: &ReplicaLedger, seq: u64, interval: Duration) -> Vec<u8> {
        Self::encode_counting(ledger, seq, interval).0
    }

    /// The ledger as one datagram's bytes, and how many of its prompt pieces they carry. When
    /// it must be cut, the pieces go first, then the ends at workers without KV events, the
    /// prompts' samples (their longest prefixes), the speeds and the answers (each half at a
    /// time), then the least busy workers.
    fn encode_counting(ledger: &ReplicaLedger, seq: u64, interval: Duration) -> (Vec<u8>, usize) {
        let mut workers: Vec<_> = ledger
            .workers
            .iter()
            .map(|(address, l)| {
                (
                    address.clone(),
                    l.prefills,
                    l.prefill_tokens,
                    l.in_flight,
                    l.kv_blocks,
                    l.prefill_elapsed_us,
                )
            })
            .collect();
        workers.sort_by(|a, b| (b.2, b.3, &a.0).cmp(&(a.2, a.3, &b.0)));
        let mut prefixes: Vec<(String, Vec<u64>)> = ledger
            .prefixes
            .iter()
            .filter(|(_, hashes)| !hashes.is_empty())
            .map(|(address, hashes)| (address.clone(), hashes.clone()))
            .collect();
        prefixes.sort();
        let mut speeds: Vec<(String, f64, u64)> = ledger
            .speeds
            .iter()
            .flat_map(|(address, learned)| {
                learned
                    .iter()
                    .map(|(ratio, observations)| (address.clone(), *ratio, *observations))
            })
            .collect();
        speeds.sort_by(|a, b| (b.2, &a.0).cmp(&(a.2, &b.0)));
        let mut answers: Vec<(&String, u64, &Observation)> = ledger
            .observations
            .iter()
            .flat_map(|(pool, recent)| recent.iter().map(move |(n, o)| (pool, *n, o)))
            .collect();
        // The latest first: those are what a cut keeps.
        answers.sort_by(|a, b| (b.1, a.0).cmp(&(a.1, b.0)));
        let observations: Vec<(String, u64, f64, f64, f64)> = answers
            .iter()
            .map(|(pool, n, o)| ((*pool).clone(), *n, o.prefill.tokens, o.running, o.ttft_s))
            .collect();
        let observation_pairs = answers
            .iter()
            .map(|(pool, n, o)| ((*pool).clone(), *n, o.prefill.pairs))
            .collect();
        // Each pool's latest first, pool by pool (numbers of different pools say nothing of
        // which is later): a cut keeps the latest of every pool.
        let mut ranked: Vec<(usize, PoolFreed)> = ledger
            .freed
            .iter()
            .flat_map(|(pool, recent)| {
                let mut recent: Vec<&Freed> = recent.iter().collect();
                recent.sort_by_key(|(n, _, _)| std::cmp::Reverse(*n));
                recent
                    .into_iter()
                    .enumerate()
                    .map(|(rank, (n, address, samples))| {
                        (rank, (pool.clone(), *n, address.clone(), samples.clone()))
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        ranked.sort_by(|(a, x), (b, y)| (a, &x.0).cmp(&(b, &y.0)));
        let freed: Vec<PoolFreed> = ranked.into_iter().map(|(_, end)| end).collect();
        let pieces = ledger
            .pieces
            .iter()
            .flat_map(|(fingerprint, pieces)| {
                pieces
                    .iter()
                    .map(|piece| (*fingerprint, piece.key, piece.tokens.to_vec()))
            })
            .collect();
        let mut datagram = Datagram {
            v: VERSION,
            instance: instance_id().to_owned(),
            seq,
            interval_ms: interval.as_millis() as u64,
            sent_ms: unix_ms(SystemTime::now()),
            workers,
            arrival_rates: ledger.arrival_rates.clone(),
            prefixes,
            speeds,
            observations,
            observation_pairs,
            freed,
            pieces,
            word_cuts_off: ledger.word_cuts_off.clone(),
        };
        loop {
            let bytes = serde_json::to_vec(&datagram).unwrap_or_default();
            if bytes.len() <= MAX_DATAGRAM {
                return (bytes, datagram.pieces.len());
            }
            if !datagram.pieces.is_empty() {
                // Only a saving: the receivers tokenize what they do not get.
                datagram.pieces.truncate(datagram.pieces.len() / 2);
                continue;
            }
            if !datagram.freed.is_empty() {
                // The oldest of each pool go first: earlier datagrams carried them as the latest.
                datagram.freed.truncate(datagram.freed.len() / 2);
                continue;
            }
            if !datagram.prefixes.is_empty() {
                for (_, hashes) in &mut datagram.prefixes {
                    hashes.truncate(hashes.len() / 2);
                }
                datagram.prefixes.retain(|(_, hashes)| !hashes.is_empty());
                continue;
            }
            if !datagram.speeds.is_empty() {
                // The workers learned from the fewest answers go first.
                datagram.speeds.truncate(datagram.speeds.len() / 2);
                continue;
            }
            if !datagram.observations.is_empty() {
                let keep = datagram.observations.len() / 2;
                datagram.observations.truncate(keep);
                datagram.observation_pairs.truncate(keep);
                continue;
            }
            if datagram.workers.is_empty() {
                return (bytes, 0);
            }
            static WARNED: OnceLock<()> = OnceLock::new();
            WARNED.get_or_init(|| {
                tracing::warn!(
                    workers = datagram.workers.len(),
                    "routing ledger too long for one datagram to the peers; the least busy workers are left out"
                )
            });
            let keep = datagram.workers.len() * MAX_DATAGRAM / bytes.len();
            datagram
                .workers
                .truncate(keep.min(datagram.workers.len() - 1));
        }
    }

    /// The bytes sent for `body` (an encoded datagram): tagged under `key`, when there is one.
    fn seal(body: Vec<u8>, key: Option<&PeerKey>) -> Vec<u8> {
        match key {
            Some(key) => key.seal(&body),
            None => body,
        }
    }

    /// The datagram in `bytes` received at `now`, if this replica believes it: with a `key`,
    /// tagged under it and sent within [`FRESH_FOR`] of `now`.
    fn open(bytes: &[u8], key: Option<&PeerKey>, now: SystemTime) -> Result<Datagram, Refused> {
        let body = match key {
            Some(key) => key.open(bytes).ok_or(Refused::Unauthenticated)?,
            None => bytes,
        };
        let datagram: Datagram = serde_json::from_slice(body).map_err(|_| {
            // A keyed datagram at a replica without a key is not JSON, but not garbage either.
            if key.is_none() && bytes.get(PeerKey::TAG) == Some(&b'{') {
                Refused::Unauthenticated
            } else {
                Refused::Malformed
            }
        })?;
        if datagram.v != VERSION {
            return Err(Refused::Malformed);
        }
        if datagram.instance == instance_id() {
            return Err(Refused::Own);
        }
        if key.is_some() {
            let sent = UNIX_EPOCH + Duration::from_millis(datagram.sent_ms);
            let apart = match now.duration_since(sent) {
                Ok(age) => age,
                Err(ahead) => ahead.duration(),
            };
            if apart > FRESH_FOR {
                return Err(Refused::Stale);
            }
        }
        Ok(datagram)
    }

    fn ledger(&self) -> ReplicaLedger {
        let workers = self
            .workers
            .iter()
            .map(
                |(address, prefills, tokens, in_flight, kv_blocks, elapsed)| {
                    let ledger = PeerLedger {
                        prefills: *prefills,
                        prefill_tokens: *tokens,
                        in_flight: *in_flight,
                        kv_blocks: *kv_blocks,
                        prefill_elapsed_us: *elapsed,
                    };
                    (address.clone(), ledger)
                },
            )
            .collect();
        let arrival_rates = self
            .arrival_rates
            .iter()
            .filter(|(_, rate)| rate.is_finite() && **rate > 0.0)
            .map(|(pool, rate)| (pool.clone(), *rate))
            .collect();
        let prefixes = self.prefixes.iter().cloned().collect();
        let mut speeds: HashMap<String, Vec<(f64, u64)>> = HashMap::new();
        for (address, ratio, observations) in &self.speeds {
            if ratio.is_finite() && *ratio > 0.0 && *observations > 0 {
                speeds
                    .entry(address.clone())
                    .or_default()
                    .push((*ratio, *observations));
            }
        }
        let mut observations: HashMap<String, Vec<(u64, Observation)>> = HashMap::new();
        let pairs: HashMap<(&str, u64), f64> = self
            .observation_pairs
            .iter()
            .map(|(pool, n, pairs)| ((pool.as_str(), *n), *pairs))
            .collect();
        for (pool, n, tokens, running, ttft_s) in &self.observations {
            let Some(pairs) = pairs.get(&(pool.as_str(), *n)) else {
                continue;
            };
            let observation = Observation {
                prefill: PrefillWork {
                    tokens: *tokens,
                    pairs: *pairs,
                },
                running: *running,
                ttft_s: *ttft_s,
            };
            observations
                .entry(pool.clone())
                .or_default()
                .push((*n, observation));
        }
        let mut freed: HashMap<String, Vec<Freed>> = HashMap::new();
        for (pool, n, address, samples) in &self.freed {
            freed
                .entry(pool.clone())
                .or_default()
                .push((*n, address.clone(), samples.clone()));
        }
        let mut pieces: HashMap<u64, Vec<Piece>> = HashMap::new();
        for (fingerprint, key, tokens) in &self.pieces {
            pieces.entry(*fingerprint).or_default().push(Piece {
                key: *key,
                tokens: tokens.as_slice().into(),
            });
        }
        ReplicaLedger {
            workers,
            arrival_rates,
            prefixes,
            speeds,
            observations,
            freed,
            pieces,
            word_cuts_off: self.word_cuts_off.clone(),
        }
    }
}

/// The latest ledger heard from one replica.
#[derive(Debug, Clone)]
struct Heard {
    seq: u64,
    /// When its latest datagram was sent, by its clock (ms since the Unix epoch).
    sent_ms: u64,
    at: Instant,
    /// How long it may stay silent.
    silence: Option<Duration>,
    from: SocketAddr,
    ledger: ReplicaLedger,
}

/// The replicas heard from, and what they told that this replica has not taken in yet.
#[derive(Debug, Default)]
struct Replicas {
    /// By instance id.
    heard: HashMap<String, Heard>,
    /// The answers they observed that this replica's pools have not learned from yet (pool id,
    /// observation).
    untaught: Vec<(String, Observation)>,
    /// Their requests that ended at a worker without KV events that this replica's pools do
    /// not assume held yet (pool id, worker address, sampled blocks).
    unheld: Vec<Unheld>,
    /// The latest end heard from each replica (instance id) for each pool (id): those numbered
    /// up to it are not taken again, whatever the datagrams in between carried.
    ends_heard: HashMap<(String, String), u64>,
    /// Prompt pieces they tokenized that this replica's tokenizers have not adopted yet (by
    /// tokenizer fingerprint), [`UNADOPTED_TOKENS`] tokens at most.
    unadopted: Vec<(u64, Piece)>,
    /// Fingerprints of tokenizers some replica no longer cuts between words.
    word_cuts_off: Vec<u64>,
}

impl Replicas {
    /// Keep a datagram unless an equal or later one of its replica is already here. A new
    /// instance at the address of another is that replica restarted: the old one's ledger ends.
    /// One sent before the latest of the replica at its address is an old instance's (late, or
    /// replayed): the one there stays.
    fn hear(&mut self, datagram: Datagram, from: SocketAddr, at: Instant) -> bool {
        match self.heard.get(&datagram.instance) {
            Some(heard) if heard.seq >= datagram.seq => return false,
            Some(_) => {}
            None => {
                let succeeded =
                    |heard: &Heard| heard.from == from && heard.sent_ms > datagram.sent_ms;
                if self.heard.values().any(succeeded) {
                    return false;
                }
                self.heard.retain(|_, heard| heard.from != from);
                self.forget_ends();
                if self.heard.len() >= MAX_REPLICAS {
                    return false;
                }
            }
        }
        let mut ledger = datagram.ledger();
        // Word cuts found inexact stay so (for every replica's tokenizer of that fingerprint);
        // pieces come once each: adopted, not kept with the ledger.
        for fingerprint in std::mem::take(&mut ledger.word_cuts_off) {
            if !self.word_cuts_off.contains(&fingerprint) {
                self.word_cuts_off.push(fingerprint);
            }
        }
        for (fingerprint, pieces) in std::mem::take(&mut ledger.pieces) {
            self.unadopted
                .extend(pieces.into_iter().map(|piece| (fingerprint, piece)));
        }
        let mut over = self
            .unadopted
            .iter()
            .map(|(_, piece)| piece.tokens.len())
            .sum::<usize>()
            .saturating_sub(UNADOPTED_TOKENS);
        self.unadopted.retain(|(_, piece)| {
            let drop = over > 0;
            over = over.saturating_sub(piece.tokens.len());
            !drop
        });
        // Each answer teaches once: those numbered past the last this replica heard.
        let taught = |pool: &str| {
            self.heard
                .get(&datagram.instance)
                .and_then(|heard| heard.ledger.observations.get(pool))
                .and_then(|recent| recent.iter().map(|(n, _)| *n).max())
                .unwrap_or(0)
        };
        let mut fresh = Vec::new();
        for (pool, recent) in &ledger.observations {
            let after = taught(pool);
            let mut new: Vec<&(u64, Observation)> =
                recent.iter().filter(|(n, _)| *n > after).collect();
            // In the order they were observed.
            new.sort_by_key(|(n, _)| *n);
            fresh.extend(new.into_iter().map(|(_, o)| (pool.clone(), *o)));
        }
        self.untaught.extend(fresh);
        // Each end is assumed held once too, in the order of the ends.
        for (pool, recent) in &ledger.freed {
            let key = (datagram.instance.clone(), pool.clone());
            let after = self.ends_heard.get(&key).copied().unwrap_or(0);
            let mut new: Vec<&Freed> = recent.iter().filter(|(n, _, _)| *n > after).collect();
            new.sort_by_key(|(n, _, _)| *n);
            if let Some((last, _, _)) = new.last() {
                self.ends_heard.insert(key, *last);
            }
            self.unheld.extend(
                new.into_iter()
                    .map(|(_, address, samples)| (pool.clone(), address.clone(), samples.clone())),
            );
        }
        let silence = (datagram.interval_ms > 0)
            .then(|| Duration::from_millis(datagram.interval_ms).saturating_mul(SILENT_INTERVALS));
        self.heard.insert(
            datagram.instance,
            Heard {
                seq: datagram.seq,
                sent_ms: datagram.sent_ms,
                at,
                silence,
                from,
                ledger,
            },
        );
        true
    }

    /// Forget replicas silent for longer than their own allowance (`silence` for those that
    /// do not say). An allowance longer than `silence` and [`FRESH_FOR`] is cut to them: a
    /// replica that says it sends once an hour (a long `--peer-interval-ms`, or a wrong one)
    /// would have its last ledger counted for hours after it stopped.
    fn forget_silent(&mut self, now: Instant, silence: Duration) {
        let longest = silence.max(FRESH_FOR);
        self.heard.retain(|_, heard| {
            let allowance = heard.silence.map_or(silence, |own| own.min(longest));
            now.saturating_duration_since(heard.at) <= allowance
        });
        self.forget_ends();
    }

    /// Forget the latest ends of replicas no longer heard (one heard again is taken anew).
    fn forget_ends(&mut self) {
        let heard = &self.heard;
        self.ends_heard
            .retain(|(instance, _), _| heard.contains_key(instance));
    }

    /// The answers heard of since the last call, to learn from once.
    fn untaught(&mut self) -> Vec<(String, Observation)> {
        std::mem::take(&mut self.untaught)
    }

    /// The requests heard of since the last call that ended at workers without KV events, to
    /// assume held once.
    fn unheld(&mut self) -> Vec<Unheld> {
        std::mem::take(&mut self.unheld)
    }

    /// The prompt pieces heard of since the last call, to adopt once, and the fingerprints of
    /// the tokenizers some replica no longer cuts between words.
    fn unadopted(&mut self) -> (Vec<(u64, Piece)>, Vec<u64>) {
        (
            std::mem::take(&mut self.unadopted),
            self.word_cuts_off.clone(),
        )
    }

    /// Every replica's ledger summed as of `now`: a worker's time on the oldest pending prefill
    /// grows by the time since its replica reported it (their observations are not summed).
    fn total(&self, now: Instant) -> ReplicaLedger {
        let mut total = ReplicaLedger::default();
        for heard in self.heard.values() {
            let since = now.saturating_duration_since(heard.at).as_micros() as u64;
            let mut ledger = heard.ledger.clone();
            for worker in ledger.workers.values_mut() {
                if worker.prefills > 0 {
                    worker.prefill_elapsed_us = worker.prefill_elapsed_us.saturating_add(since);
                }
            }
            total.add(&ledger);
        }
        total
    }

    fn addresses(&self) -> impl Iterator<Item = SocketAddr> + '_ {
        self.heard.values().map(|heard| heard.from)
    }
}

/// The tokenizers of `table`'s pools, each once (pools with the same tokenizer share one).
fn distinct_tokenizers(table: &RoutingTable) -> Vec<&Arc<PromptTokenizer>> {
    let mut tokenizers: Vec<&Arc<PromptTokenizer>> = Vec::new();
    for tokenizer in table.pools().filter_map(|pool| pool.tokenizer.as_ref()) {
        if !tokenizers.iter().any(|seen| Arc::ptr_eq(seen, tokenizer)) {
            tokenizers.push(tokenizer);
        }
    }
    tokenizers
}

/// Give every tokenizer of `table` the pieces heard of that were tokenized by one of its
/// fingerprint, and count them: `adopted` (new to one), `known` (every tokenizer of that
/// fingerprint held them, or refused them), `unused` (no tokenizer of theirs here).
fn adopt_pieces(table: &RoutingTable, heard: &[(u64, Piece)], counts: &PeerCounts) {
    if heard.is_empty() {
        return;
    }
    let mut used = 0;
    let mut adopted = 0;
    for tokenizer in distinct_tokenizers(table) {
        let fingerprint = tokenizer.fingerprint();
        let pieces: Vec<Piece> = heard
            .iter()
            .filter(|(of, _)| *of == fingerprint)
            .map(|(_, piece)| piece.clone())
            .collect();
        if !pieces.is_empty() {
            used += pieces.len();
            adopted += tokenizer.adopt_pieces(&pieces);
        }
    }
    // (Two pools with tokenizers of one fingerprint each count a piece.)
    counts.add("adopted", adopted);
    counts.add("known", used.saturating_sub(adopted));
    counts.add("unused", heard.len().saturating_sub(used));
}

/// Sends this replica's ledger to the peers and counts theirs in the live table's workers.
pub struct PeerService {
    pub store: Arc<ConfigStore>,
    /// `host:port` of the replicas' operator listeners (names resolve to every address).
    pub peers: Vec<String>,
    /// Where this replica receives the others' datagrams (its operator listener's address).
    pub bind: String,
    pub interval: Duration,
    /// The key every replica's datagrams are tagged with (`--peers-key-file`); `None`: they are
    /// believed from any host the peers resolve to.
    pub key: Option<PeerKey>,
    /// Whether prompt pieces are sent and adopted (`--peer-prompt-pieces`,
    /// [`ReplicaLedger::pieces`]).
    pub prompt_pieces: bool,
    /// Where the datagrams received are counted (`switchyard_peer_datagrams_total`).
    pub datagrams: PeerCounts,
    /// Where the prompt pieces sent and heard are counted
    /// (`switchyard_peer_prompt_pieces_total`).
    pub pieces: PeerCounts,
}

/// Sampled block hashes of prompts in prefill, by worker address.
type Prefixes = HashMap<String, Vec<u64>>;

/// What the send and receive halves share.
#[derive(Default)]
struct Shared {
    replicas: Mutex<Replicas>,
    /// The table and the other replicas' prompts in prefill last applied.
    applied: Mutex<Option<(usize, Prefixes)>>,
    /// The addresses the peers' names resolved to last: only their hosts are heard.
    resolved: Mutex<Vec<SocketAddr>>,
}

impl PeerService {
    /// Every address the peers' names resolve to now; the last answer when the names do not
    /// resolve within an interval (a slow DNS server must not stop the datagrams).
    async fn resolve(&self, shared: &Shared) {
        let lookups = async {
            let mut addresses = Vec::new();
            for peer in &self.peers {
                match tokio::net::lookup_host(peer.as_str()).await {
                    Ok(resolved) => addresses.extend(resolved),
                    Err(error) => {
                        tracing::debug!(peer = peer.as_str(), %error, "peer does not resolve")
                    }
                }
            }
            addresses
        };
        match tokio::time::timeout(self.interval, lookups).await {
            Ok(mut addresses) => {
                addresses.sort();
                addresses.dedup();
                *crate::lock(&shared.resolved) = addresses;
            }
            Err(_) => tracing::debug!("peers did not resolve within an interval"),
        }
    }

    fn apply(&self, shared: &Shared) {
        let (peers, untaught, unheld, unadopted) = {
            let mut replicas = crate::lock(&shared.replicas);
            let now = Instant::now();
            replicas.forget_silent(now, self.interval * SILENT_INTERVALS);
            (
                replicas.total(now),
                replicas.untaught(),
                replicas.unheld(),
                replicas.unadopted(),
            )
        };
        // (Before the first table the answers heard teach nothing, and are not kept.)
        let Some(table) = self.store.current() else {
            return;
        };
        if self.prompt_pieces {
            let (pieces, word_cuts_off) = unadopted;
            for tokenizer in distinct_tokenizers(&table) {
                if tokenizer.cuts_words() && word_cuts_off.contains(&tokenizer.fingerprint()) {
                    tracing::warn!(
                        "another replica found this pool tokenizer's cuts between words inexact: routing no longer cuts prompts between words"
                    );
                    tokenizer.distrust_word_cuts();
                }
            }
            adopt_pieces(&table, &pieces, &self.pieces);
        }
        // The other replicas' answers teach this replica's pool models too: each sees only
        // its share of them.
        for (id, observation) in &untaught {
            if let Some(pool) = table.pool(&PoolId(id.clone())) {
                let configured = Coefficients::configured(&pool.config.scoring);
                pool.kv.calibration.observe_peer(configured, observation);
            }
        }
        // What another replica had a worker without KV events prefill is in its cache as much
        // as what this one had it prefill (and pushes out as much).
        for (id, address, samples) in &unheld {
            let Some(pool) = table.pool(&PoolId(id.clone())) else {
                continue;
            };
            let Some(index) = pool.workers.iter().position(|w| w.address == *address) else {
                continue;
            };
            if let (Some(capacity), Some(slot)) =
                (pool.history_capacity(index), pool.slots.get(index))
            {
                let samples: Vec<(usize, SequenceHash)> = samples
                    .iter()
                    .map(|(upto, hash)| (*upto, SequenceHash(*hash)))
                    .collect();
                pool.kv
                    .predictions
                    .history
                    .freed_sampled(*slot, &samples, capacity);
            }
        }
        // The prompts in prefill are indexed anew only when they (or the table) changed: most
        // datagrams change a count, not a prompt.
        let unchanged = {
            let mut applied = crate::lock(&shared.applied);
            let key = (Arc::as_ptr(&table) as usize, peers.prefixes.clone());
            let unchanged = applied.as_ref() == Some(&key);
            *applied = Some(key);
            unchanged
        };
        for pool in table.pools() {
            let rate = peers.arrival_rates.get(&pool.config.id.0).copied();
            pool.kv.set_peer_arrival_rate(rate.unwrap_or(0.0));
            let mut prefixes = Vec::new();
            for (worker, slot) in pool.workers.iter().zip(&pool.slots) {
                let ledger = peers
                    .workers
                    .get(&worker.address)
                    .copied()
                    .unwrap_or_default();
                worker.load.set_peers(ledger);
                let learned = peers.speeds.get(&worker.address).into_iter().flatten();
                worker.ttft.set_peers(
                    learned
                        .map(|(ratio, observations)| Speed {
                            ratio: *ratio,
                            observations: *observations,
                            last: None,
                        })
                        .collect(),
                );
                if let Some(hashes) = peers.prefixes.get(&worker.address) {
                    let hashes = hashes.iter().map(|h| SequenceHash(*h)).collect();
                    prefixes.push((*slot, hashes));
                }
            }
            if !unchanged {
                pool.kv.set_peer_prefixes(PeerPrefixes::new(&prefixes));
            }
        }
    }

    /// Sends at every change of the ledger and every interval; resolves the peers every interval.
    /// New prompt pieces ride along, as many as fit; what is left goes out in the next datagram,
    /// at once.
    async fn send(&self, socket: &UdpSocket, shared: &Shared) {
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut seq = 0u64;
        let mut warned = false;
        loop {
            tokio::select! {
                _ = ticker.tick() => {
                    self.resolve(shared).await;
                    // Silent replicas drop out even when nobody sends.
                    self.apply(shared);
                }
                _ = LEDGER_CHANGED.notified() => {}
            }
            // Before the first table this replica counts nothing, and says so: the peers learn
            // its address from it.
            let mut more_pieces = false;
            let own = self
                .store
                .current()
                .map(|table| {
                    let mut own = ReplicaLedger::own(&table);
                    more_pieces = self.prompt_pieces && own.take_pieces(&table, seq as usize);
                    own
                })
                .unwrap_or_default();
            if more_pieces {
                crate::worker::ledger_changed();
            }
            seq += 1;
            let (body, pieces) = Datagram::encode_counting(&own, seq, self.interval);
            self.pieces.add("sent", pieces);
            let bytes = Datagram::seal(body, self.key.as_ref());
            let mut targets = crate::lock(&shared.resolved).clone();
            targets.extend(crate::lock(&shared.replicas).addresses());
            targets.sort();
            targets.dedup();
            for target in targets {
                let sent = socket.send_to(&bytes, target).await;
                if let Err(error) = sent
                    && !warned
                {
                    warned = true;
                    tracing::warn!(peer = %target, %error, "routing ledger not sent to a replica (warned once)");
                }
            }
            // After a datagram, let the changes of the next millisecond go out as one.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    async fn receive(&self, socket: &UdpSocket, shared: &Shared) {
        let mut buffer = vec![0u8; 65_536];
        loop {
            let (length, from) = match socket.recv_from(&mut buffer).await {
                Ok(received) => received,
                Err(error) => {
                    tracing::debug!(%error, "peer datagram not received");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            // Only the hosts the peers' names resolve to are heard (from any port: one with its
            // operator listener off sends from another).
            let known = crate::lock(&shared.resolved)
                .iter()
                .any(|peer| peer.ip().to_canonical() == from.ip().to_canonical());
            let opened = if known {
                let bytes = buffer.get(..length).unwrap_or_default();
                Datagram::open(bytes, self.key.as_ref(), SystemTime::now())
            } else {
                Err(Refused::UnknownHost)
            };
            let heard = opened.and_then(|datagram| {
                let fresh = crate::lock(&shared.replicas).hear(datagram, from, Instant::now());
                fresh.then_some(()).ok_or(Refused::Late)
            });
            count_received(&self.datagrams, heard);
            if heard.is_ok() {
                self.apply(shared);
            }
        }
    }
}

#[async_trait]
impl BackgroundService for PeerService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let bound = match UdpSocket::bind(self.bind.as_str()).await {
            // Without IPv6, any IPv4 port.
            Err(_) if self.bind == "[::]:0" => UdpSocket::bind("0.0.0.0:0").await,
            bound => bound,
        };
        let socket = match bound {
            Ok(socket) => socket,
            Err(error) => {
                tracing::error!(
                    bind = self.bind.as_str(),
                    %error,
                    "cannot receive the other replicas' ledgers; routing counts only this replica's requests and the workers' gauges"
                );
                return;
            }
        };
        let shared = Shared::default();
        SHARING.store(true, Ordering::Relaxed);
        self.resolve(&shared).await;
        if let Ok(local) = socket.local_addr()
            && local.ip().is_loopback()
            && crate::lock(&shared.resolved)
                .iter()
                .any(|peer| !peer.ip().is_loopback())
        {
            tracing::warn!(
                bind = %local,
                "the operator listener is on a loopback address: replicas on other hosts cannot send this one their ledgers, nor it them"
            );
        }
        tokio::select! {
            _ = self.send(&socket, &shared) => {}
            _ = self.receive(&socket, &shared) => {}
            _ = shutdown.changed() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer's datagram without a key: `None` when it is not one (another version, not ours,
    /// this process's).
    fn decode(bytes: &[u8]) -> Option<Datagram> {
        Datagram::open(bytes, None, SystemTime::now()).ok()
    }

    fn ledger(prefill_tokens: u64, prefill_elapsed_us: u64) -> PeerLedger {
        PeerLedger {
            prefills: 1,
            prefill_tokens,
            in_flight: 2,
            kv_blocks: 90,
            prefill_elapsed_us,
        }
    }

    fn answer(ttft_s: f64) -> Observation {
        Observation {
            prefill: PrefillWork::after(500, 2_000),
            running: 3.0,
            ttft_s,
        }
    }

    #[test]
    fn another_replicas_answers_teach_once_each() {
        let one: SocketAddr = "10.0.0.1:9090".parse().unwrap();
        let latest = |numbers: std::ops::RangeInclusive<u64>| ReplicaLedger {
            observations: HashMap::from([(
                "default/a".to_owned(),
                numbers.map(|n| (n, answer(n as f64))).collect(),
            )]),
            ..Default::default()
        };
        let now = Instant::now();
        let mut replicas = Replicas::default();
        assert!(replicas.hear(from("r1", 1, &latest(1..=3)), one, now));
        let taught = replicas.untaught();
        let times: Vec<f64> = taught.iter().map(|(_, o)| o.ttft_s).collect();
        assert_eq!(times, [1.0, 2.0, 3.0]);
        assert!(taught.iter().all(|(_, o)| *o == answer(o.ttft_s)));
        assert!(replicas.untaught().is_empty());
        // The next datagram repeats what the last carried (one may be lost): only the new count.
        assert!(replicas.hear(from("r1", 2, &latest(2..=5)), one, now));
        let taught: Vec<f64> = replicas.untaught().iter().map(|(_, o)| o.ttft_s).collect();
        assert_eq!(taught, [4.0, 5.0]);
        // A late datagram teaches nothing; a restarted replica numbers from 1 again.
        assert!(!replicas.hear(from("r1", 1, &latest(1..=3)), one, now));
        assert!(replicas.untaught().is_empty());
        assert!(replicas.hear(from("r2", 1, &latest(1..=1)), one, now));
        assert_eq!(replicas.untaught().len(), 1);
        // A replica that predates the attention pairs sends answers the model cannot place.
        let mut older = from("r3", 1, &latest(1..=2));
        older.observation_pairs.clear();
        assert!(replicas.hear(older, one, now));
        assert!(replicas.untaught().is_empty());
        // Observations are taught, not summed into the ledger.
        assert!(replicas.total(now).observations.is_empty());
    }

    #[test]
    fn another_replicas_ends_at_workers_without_events_are_assumed_held_once_each() {
        let one: SocketAddr = "10.0.0.1:9090".parse().unwrap();
        let latest = |numbers: std::ops::RangeInclusive<u64>| ReplicaLedger {
            freed: HashMap::from([(
                "default/a".to_owned(),
                numbers
                    .map(|n| {
                        (
                            n,
                            format!("10.0.1.{n}:8000"),
                            vec![(4, n * 10), (5, n * 10 + 1)],
                        )
                    })
                    .collect(),
            )]),
            ..Default::default()
        };
        let now = Instant::now();
        let mut replicas = Replicas::default();
        let workers = |replicas: &mut Replicas| -> Vec<String> {
            replicas
                .unheld()
                .into_iter()
                .map(|(pool, address, samples)| {
                    assert_eq!(pool, "default/a");
                    assert_eq!(samples.len(), 2);
                    address
                })
                .collect()
        };
        assert!(replicas.hear(from("r1", 1, &latest(1..=2)), one, now));
        assert_eq!(workers(&mut replicas), ["10.0.1.1:8000", "10.0.1.2:8000"]);
        assert!(workers(&mut replicas).is_empty());
        // Repeated in the next datagram (one may be lost): only the new ones count, in order.
        assert!(replicas.hear(from("r1", 3, &latest(2..=4)), one, now));
        assert_eq!(workers(&mut replicas), ["10.0.1.3:8000", "10.0.1.4:8000"]);
        assert!(!replicas.hear(from("r1", 2, &latest(1..=3)), one, now));
        assert!(workers(&mut replicas).is_empty());
        // Never summed into the ledger.
        assert!(replicas.total(now).freed.is_empty());
    }

    /// A table with one cache-aware pool, built as one process would (its own tokenizer).
    fn cache_aware_table() -> RoutingTable {
        let yaml = "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {name: p}\n\
                    spec: {model: m, loadBalancing: cache-aware, endpoints: [\"127.0.0.1:1\"]}\n";
        let snapshot = switchyard_snapshot::load_str("test", yaml).unwrap();
        RoutingTable::build(
            Arc::new(snapshot),
            &crate::routing::EndpointRegistry::default(),
            &crate::kv::KvRegistry::default(),
        )
        .unwrap()
    }

    #[test]
    fn another_replicas_prompt_pieces_are_adopted_once_each() {
        let one: SocketAddr = "10.0.0.1:9090".parse().unwrap();
        let now = Instant::now();
        let (sender, receiver) = (cache_aware_table(), cache_aware_table());
        let tokenizer =
            |table: &RoutingTable| table.pools().next().unwrap().tokenizer.clone().unwrap();
        let (sent_by, heard_by) = (tokenizer(&sender), tokenizer(&receiver));
        assert!(!Arc::ptr_eq(&sent_by, &heard_by));
        // Both offer what they tokenize from now on.
        sent_by.new_pieces(0);
        heard_by.new_pieces(0);
        let system: String = (0..200)
            .map(|i| format!("Rule {i}: the river runs by the garden wall.\n"))
            .collect();
        let prompt = format!("{system}Which wall?");
        let tokens = sent_by.encode(&prompt).unwrap();

        // The sender's next datagram carries the new pieces, a budget at a time.
        let mut replica = ReplicaLedger::default();
        assert!(!replica.take_pieces(&sender, 0));
        let sent: Vec<Piece> = replica.pieces.values().flatten().cloned().collect();
        assert!(sent.len() > 10, "{}", sent.len());
        assert_eq!(
            replica.pieces.keys().copied().collect::<Vec<_>>(),
            [sent_by.fingerprint()]
        );
        let mut again = ReplicaLedger::default();
        assert!(!again.take_pieces(&sender, 1));
        assert!(again.pieces.is_empty(), "each piece is sent once");

        let mut replicas = Replicas::default();
        assert!(replicas.hear(from("r1", 1, &replica), one, now));
        // Not kept with the ledger (never summed); handed over once.
        assert!(replicas.total(now).pieces.is_empty());
        let (heard, word_cuts_off) = replicas.unadopted();
        assert_eq!(heard.len(), sent.len());
        assert!(word_cuts_off.is_empty());
        assert!(replicas.unadopted().0.is_empty());
        // A pool whose tokenizer has another fingerprint takes none of them.
        let other: Vec<(u64, Piece)> = heard
            .iter()
            .map(|(fingerprint, piece)| (fingerprint ^ 1, piece.clone()))
            .collect();
        let counts = PeerCounts::default();
        let count = |outcome| counts.0.get_or_create(&OutcomeLabels { outcome }).get() as usize;
        adopt_pieces(&receiver, &other, &counts);
        assert_eq!(count("unused"), heard.len());
        assert_eq!(heard_by.encode(&prompt).unwrap(), tokens);
        let (own, _) = heard_by.new_pieces(usize::MAX);
        assert_eq!(own.len(), sent.len(), "tokenized for itself");

        // Adopted, the same prompt at a fresh receiver is looked up: nothing of it is new there.
        let receiver = cache_aware_table();
        let heard_by = tokenizer(&receiver);
        heard_by.new_pieces(0);
        adopt_pieces(&receiver, &heard, &counts);
        assert_eq!(heard_by.encode(&prompt).unwrap(), tokens);
        assert_eq!(heard_by.new_pieces(usize::MAX), (Vec::new(), false));
        assert_eq!((count("adopted"), count("known")), (heard.len(), 0));
        adopt_pieces(&receiver, &heard, &counts);
        assert_eq!(
            (count("adopted"), count("known")),
            (heard.len(), heard.len())
        );

        // A sender whose tokenizer found its cuts between words inexact says so in every
        // datagram (the receivers' tokenizers of that fingerprint stop cutting words too, and
        // forget what they adopted).
        assert!(replica.word_cuts_off.is_empty());
        sent_by.distrust_word_cuts();
        for seq in [2, 3] {
            let mut told = ReplicaLedger::default();
            told.take_pieces(&sender, seq as usize);
            assert_eq!(told.word_cuts_off, [sent_by.fingerprint()]);
            assert!(replicas.hear(from("r1", seq, &told), one, now));
            assert_eq!(replicas.unadopted().1, [sent_by.fingerprint()]);
        }
        assert!(replicas.total(now).word_cuts_off.is_empty());
    }

    #[test]
    fn pieces_heard_and_not_adopted_yet_keep_the_latest() {
        let one: SocketAddr = "10.0.0.1:9090".parse().unwrap();
        let mut replicas = Replicas::default();
        for seq in 1..=40 {
            let replica = ReplicaLedger {
                pieces: HashMap::from([(
                    9,
                    vec![Piece {
                        key: seq,
                        tokens: vec![1; 4_000].into(),
                    }],
                )]),
                ..Default::default()
            };
            assert!(replicas.hear(from("r1", seq, &replica), one, Instant::now()));
        }
        let kept: Vec<u64> = replicas.unadopted().0.iter().map(|(_, p)| p.key).collect();
        assert_eq!(kept, (25..=40).collect::<Vec<_>>());
    }

    /// `long` (lists too long for one datagram) beside a worker's counts and a prompt in
    /// prefill, through one datagram: what is left of it. The worker and the prompt stay: the
    /// longer lists go first.
    fn through_one_datagram(long: ReplicaLedger) -> ReplicaLedger {
        let replica = ReplicaLedger {
            workers: HashMap::from([("w".to_owned(), ledger(5, 0))]),
            prefixes: HashMap::from([("w".to_owned(), vec![7, 11])]),
            ..long
        };
        let bytes = Datagram::encode(&replica, 1, Duration::from_millis(100));
        assert!(bytes.len() <= MAX_DATAGRAM);
        let kept = serde_json::from_slice::<Datagram>(&bytes).unwrap().ledger();
        assert_eq!(kept.workers.len(), 1);
        assert_eq!(kept.prefixes, replica.prefixes);
        kept
    }

    #[test]
    fn a_ledger_too_long_for_one_datagram_gives_up_prompt_pieces_first() {
        let pieces: Vec<Piece> = (0..40)
            .map(|key| Piece {
                key,
                tokens: vec![151_000; 400].into(),
            })
            .collect();
        let kept = through_one_datagram(ReplicaLedger {
            pieces: HashMap::from([(9, pieces.clone())]),
            ..Default::default()
        });
        let kept = &kept.pieces[&9];
        assert!(
            !kept.is_empty() && kept.len() < pieces.len(),
            "{}",
            kept.len()
        );
        assert_eq!(kept[..], pieces[..kept.len()], "the first ones, whole");
    }

    #[test]
    fn a_ledger_too_long_for_one_datagram_gives_up_the_oldest_ends_of_each_pool_first() {
        let samples: Vec<(usize, u64)> = (1..=500).map(|b| (b * 4, u64::MAX - b as u64)).collect();
        // Two pools' ends, numbered apart: each pool keeps its latest.
        let ends = |numbers: std::ops::RangeInclusive<u64>| -> Vec<Freed> {
            numbers
                .map(|n| (n, "w".to_owned(), samples.clone()))
                .collect()
        };
        let kept = through_one_datagram(ReplicaLedger {
            freed: HashMap::from([
                ("default/a".to_owned(), ends(1..=4)),
                ("default/b".to_owned(), ends(101..=104)),
            ]),
            ..Default::default()
        });
        let numbers = |pool: &str| {
            let mut numbers: Vec<u64> = kept.freed[pool].iter().map(|f| f.0).collect();
            numbers.sort();
            numbers
        };
        assert_eq!(numbers("default/a"), [3, 4]);
        assert_eq!(numbers("default/b"), [103, 104]);
    }

    /// `replica`'s datagram as another process would send it.
    fn from(instance: &str, seq: u64, replica: &ReplicaLedger) -> Datagram {
        let mut datagram: Datagram =
            serde_json::from_slice(&Datagram::encode(replica, seq, Duration::from_millis(100)))
                .unwrap();
        datagram.instance = instance.to_owned();
        datagram
    }

    #[test]
    fn a_ledger_survives_its_datagram_and_this_replicas_own_are_skipped() {
        let replica = ReplicaLedger {
            workers: HashMap::from([
                ("10.0.0.1:8000".to_owned(), ledger(3000, 250_000)),
                (
                    "10.0.0.2:8000".to_owned(),
                    PeerLedger {
                        in_flight: 1,
                        ..Default::default()
                    },
                ),
            ]),
            arrival_rates: HashMap::from([("default/a".to_owned(), 12.5)]),
            prefixes: HashMap::from([("10.0.0.1:8000".to_owned(), vec![u64::MAX, 7, 11])]),
            speeds: HashMap::from([("10.0.0.2:8000".to_owned(), vec![(1.5, 12)])]),
            observations: HashMap::from([("default/a".to_owned(), vec![(3, answer(0.25))])]),
            freed: HashMap::from([(
                "default/a".to_owned(),
                vec![(9, "10.0.0.2:8000".to_owned(), vec![(4, u64::MAX), (6, 5)])],
            )]),
            pieces: HashMap::from([(
                u64::MAX,
                vec![Piece {
                    key: u64::MAX - 1,
                    tokens: vec![0, 151_000].into(),
                }],
            )]),
            word_cuts_off: vec![u64::MAX - 2],
        };
        let bytes = Datagram::encode(&replica, 7, Duration::from_millis(100));
        assert_eq!(decode(&bytes), None, "this process's own");
        let other = from("other", 7, &replica);
        let bytes = serde_json::to_vec(&other).unwrap();
        let decoded = decode(&bytes).unwrap();
        assert_eq!(decoded.seq, 7);
        assert_eq!(decoded.ledger(), replica);
        // Another version, or not a ledger at all, is ignored.
        let newer = String::from_utf8(bytes)
            .unwrap()
            .replace("\"v\":1", "\"v\":2");
        assert_eq!(decode(newer.as_bytes()), None);
        assert_eq!(decode(b"GET / HTTP/1.1"), None);
        // A replica that shares no prompts (one that predates them) is still heard.
        let older =
            br#"{"v":1,"instance":"old","seq":3,"workers":[["w",1,2,3,4,5]],"arrival_rates":{}}"#;
        let decoded = decode(older).unwrap().ledger();
        assert_eq!(decoded.workers["w"].kv_blocks, 4);
        assert!(decoded.prefixes.is_empty());
    }

    #[test]
    fn a_keyed_replica_hears_only_fresh_datagrams_tagged_with_its_key() {
        let key = PeerKey::new(b"the replicas' shared secret");
        let other_key = PeerKey::new(b"another fleet's shared secret");
        let replica = ReplicaLedger {
            workers: HashMap::from([("w".to_owned(), ledger(3000, 0))]),
            ..Default::default()
        };
        let body = serde_json::to_vec(&from("other", 3, &replica)).unwrap();
        let sealed = Datagram::seal(body.clone(), Some(&key));
        let now = SystemTime::now();
        let open = |bytes: &[u8], key: Option<&PeerKey>, at: SystemTime| {
            Datagram::open(bytes, key, at).map(|d| d.ledger())
        };
        assert_eq!(open(&sealed, Some(&key), now), Ok(replica.clone()));
        // Not under another key, nor untagged, nor with any bit of tag or body changed, nor cut.
        let unauthenticated = Err(Refused::Unauthenticated);
        assert_eq!(open(&sealed, Some(&other_key), now), unauthenticated);
        assert_eq!(open(&body, Some(&key), now), unauthenticated);
        for at in [
            0,
            PeerKey::TAG - 1,
            PeerKey::TAG,
            sealed.len() / 2,
            sealed.len() - 1,
        ] {
            let mut forged = sealed.clone();
            forged[at] ^= 1;
            assert_eq!(
                open(&forged, Some(&key), now),
                unauthenticated,
                "bit at {at}"
            );
        }
        assert_eq!(
            open(&sealed[..sealed.len() - 1], Some(&key), now),
            unauthenticated
        );
        assert_eq!(
            open(&sealed[..PeerKey::TAG - 1], Some(&key), now),
            unauthenticated
        );
        // A replica without a key hears none, and knows them for what they are (whatever the
        // tag's first byte).
        assert_eq!(open(&sealed, None, now), unauthenticated);
        let mut brace = sealed.clone();
        brace[0] = b'{';
        assert_eq!(open(&brace, None, now), unauthenticated);
        // Sent within FRESH_FOR of the receiver's clock, either way, or it is a replay (or the
        // clocks are apart); without a key the sender's clock is not read.
        let second = Duration::from_secs(1);
        assert_eq!(
            open(&sealed, Some(&key), now + FRESH_FOR - second),
            Ok(replica.clone())
        );
        assert_eq!(
            open(&sealed, Some(&key), now - FRESH_FOR + second),
            Ok(replica.clone())
        );
        assert_eq!(
            open(&sealed, Some(&key), now + FRESH_FOR + second),
            Err(Refused::Stale)
        );
        assert_eq!(
            open(&sealed, Some(&key), now - FRESH_FOR - second),
            Err(Refused::Stale)
        );
        assert_eq!(open(&body, None, now + FRESH_FOR * 10), Ok(replica.clone()));
        // This process's own, keyed, is skipped (not counted); a ledger of nothing is malformed.
        let own = Datagram::seal(
            Datagram::encode(&replica, 4, Duration::from_millis(100)),
            Some(&key),
        );
        assert_eq!(open(&own, Some(&key), now), Err(Refused::Own));
        let empty = Datagram::seal(b"{}".to_vec(), Some(&key));
        assert_eq!(open(&empty, Some(&key), now), Err(Refused::Malformed));
    }

    #[test]
    fn a_peers_key_file_is_read_less_its_surrounding_whitespace_and_must_be_long_enough() {
        let path = std::env::temp_dir().join(format!("switchyard-peers-key-{}", instance_id()));
        std::fs::write(&path, "  the replicas' shared secret\n").unwrap();
        let key = PeerKey::from_file(&path).unwrap();
        let body = b"{}".to_vec();
        assert_eq!(
            key.seal(&body),
            PeerKey::new(b"the replicas' shared secret").seal(&body)
        );
        assert_eq!(format!("{key:?}"), "PeerKey(..)");
        std::fs::write(&path, "short key\n\n").unwrap();
        let error = PeerKey::from_file(&path).unwrap_err();
        assert!(error.contains("holds 9 bytes; at least 16"), "{error}");
        std::fs::remove_file(&path).unwrap();
        let error = PeerKey::from_file(&path).unwrap_err();
        assert!(error.contains("cannot read the peers' key file"), "{error}");
    }

    #[test]
    fn a_ledger_too_long_for_one_datagram_gives_up_prompt_samples_before_workers() {
        let replica = ReplicaLedger {
            workers: HashMap::from([("w".to_owned(), ledger(5, 0))]),
            prefixes: HashMap::from([
                ("w".to_owned(), (0..4_000).map(|i| u64::MAX - i).collect()),
                ("v".to_owned(), (10_000..10_010).collect()),
            ]),
            ..Default::default()
        };
        let bytes = Datagram::encode(&replica, 1, Duration::from_millis(100));
        assert!(bytes.len() <= MAX_DATAGRAM);
        let kept: Datagram = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(kept.workers.len(), 1);
        let kept = kept.ledger().prefixes;
        // Each halved: the shortest prefixes (first) stay.
        let w = &kept["w"];
        assert!(w.len() > 1_000 && w.len() < 4_000, "{}", w.len());
        let first: Vec<u64> = (0..w.len() as u64).map(|i| u64::MAX - i).collect();
        assert_eq!(w, &first);
        assert_eq!(kept["v"].first(), Some(&10_000));
        // A replica that counts nothing against any worker but still tells prompts and speeds.
        let idle = ReplicaLedger {
            prefixes: replica.prefixes.clone(),
            speeds: (0..3_000)
                .map(|i| {
                    (
                        format!("10.1.{}.{}:8000", i / 256, i % 256),
                        vec![(1.25, 7)],
                    )
                })
                .collect(),
            ..Default::default()
        };
        assert!(Datagram::encode(&idle, 2, Duration::from_millis(100)).len() <= MAX_DATAGRAM);
    }

    #[test]
    fn a_ledger_too_long_for_one_datagram_keeps_its_busiest_workers() {
        let workers = (0..2_000u64)
            .map(|i| (format!("10.0.{}.{}:8000", i / 256, i % 256), ledger(i, 0)))
            .collect();
        let replica = ReplicaLedger {
            workers,
            ..Default::default()
        };
        let bytes = Datagram::encode(&replica, 1, Duration::from_millis(100));
        assert!(bytes.len() <= MAX_DATAGRAM);
        let kept: Datagram = serde_json::from_slice(&bytes).unwrap();
        assert!(kept.workers.len() > 500, "{}", kept.workers.len());
        let least = kept.workers.iter().map(|w| w.2).min().unwrap();
        assert_eq!(least, 2_000 - kept.workers.len() as u64);
    }

    #[test]
    fn a_replica_that_claims_a_long_interval_is_forgotten_within_the_freshness_window() {
        let address: SocketAddr = "10.0.0.1:9090".parse().unwrap();
        let replica = ReplicaLedger {
            workers: HashMap::from([("w".to_owned(), ledger(100, 0))]),
            ..Default::default()
        };
        let mut hourly = from("r1", 1, &replica);
        hourly.interval_ms = 3_600_000;
        let start = Instant::now();
        let mut replicas = Replicas::default();
        assert!(replicas.hear(hourly, address, start));
        // Silent for a minute: past this replica's own allowance (1 s) and the freshness
        // window, though within the ten hours its interval claims.
        let silence = Duration::from_secs(1);
        replicas.forget_silent(start + FRESH_FOR / 2, silence);
        assert_eq!(replicas.addresses().count(), 1, "kept within the window");
        replicas.forget_silent(start + Duration::from_secs(60), silence);
        assert_eq!(replicas.addresses().count(), 0, "forgotten past it");
    }

    #[test]
    fn replicas_add_up_late_datagrams_are_dropped_and_silent_replicas_forgotten() {
        let (one, two): (SocketAddr, SocketAddr) = (
            "10.0.0.1:9090".parse().unwrap(),
            "10.0.0.2:9090".parse().unwrap(),
        );
        let replica = |tokens: u64, elapsed_us: u64, rate: f64| ReplicaLedger {
            workers: HashMap::from([("w".to_owned(), ledger(tokens, elapsed_us))]),
            arrival_rates: HashMap::from([("default/a".to_owned(), rate)]),
            prefixes: HashMap::from([("w".to_owned(), vec![tokens])]),
            speeds: HashMap::from([("w".to_owned(), vec![(rate, 5)])]),
            ..Default::default()
        };
        let start = Instant::now();
        let mut replicas = Replicas::default();
        assert!(replicas.hear(from("r1", 2, &replica(100, 10_000, 2.0)), one, start));
        assert!(replicas.hear(from("r2", 1, &replica(50, 0, 3.5)), two, start));
        // r1's first datagram arrives after its second: it changes nothing.
        assert!(!replicas.hear(from("r1", 1, &replica(900, 0, 9.0)), one, start));

        let later = start + Duration::from_millis(30);
        let total = replicas.total(later);
        assert_eq!(total.arrival_rates["default/a"], 5.5);
        let w = total.workers["w"];
        assert_eq!(
            (w.prefills, w.prefill_tokens, w.in_flight, w.kv_blocks),
            (2, 150, 4, 180)
        );
        // The longest time on the oldest prefill, grown by the time since it was reported.
        assert_eq!(w.prefill_elapsed_us, 40_000);
        // Both replicas' prompts in prefill there.
        let mut prefixes = total.prefixes["w"].clone();
        prefixes.sort();
        assert_eq!(prefixes, [50, 100]);
        let mut speeds = total.speeds["w"].clone();
        speeds.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert_eq!(speeds, [(2.0, 5), (3.5, 5)]);

        // r2 goes on reporting; r1 (interval 100 ms) falls silent for more than ten of its
        // intervals and is forgotten, whatever this replica's own interval.
        let much_later = start + Duration::from_millis(1_500);
        assert!(replicas.hear(from("r2", 2, &replica(0, 0, 1.0)), two, much_later));
        replicas.forget_silent(much_later, Duration::from_secs(60));
        let total = replicas.total(much_later);
        assert_eq!(total.arrival_rates["default/a"], 1.0);
        assert_eq!(total.workers["w"].prefill_tokens, 0);
        assert_eq!(replicas.addresses().collect::<Vec<_>>(), vec![two]);

        // r2 restarts: a new instance at its address ends the old one's ledger at once.
        let restarted = from("r3", 1, &replica(7, 0, 0.5));
        let sent = restarted.sent_ms;
        assert!(replicas.hear(restarted, two, much_later));
        let total = replicas.total(much_later);
        assert_eq!(total.workers["w"].prefill_tokens, 7);
        assert_eq!(total.arrival_rates["default/a"], 0.5);
        // A datagram of the old instance sent before the new one's latest (late, or replayed
        // from a forged address) does not end the new one in turn...
        let mut replayed = from("r2", 3, &replica(900, 0, 9.0));
        replayed.sent_ms = sent - 1;
        assert!(!replicas.hear(replayed, two, much_later));
        assert_eq!(replicas.total(much_later).workers["w"].prefill_tokens, 7);
        // ...a later instance still does.
        let mut again = from("r4", 1, &replica(8, 0, 0.5));
        again.sent_ms = sent + 1;
        assert!(replicas.hear(again, two, much_later));
        assert_eq!(replicas.total(much_later).workers["w"].prefill_tokens, 8);
    }

    #[test]
    fn replicas_beyond_the_limit_are_not_remembered() {
        let mut replicas = Replicas::default();
        let now = Instant::now();
        for i in 0..MAX_REPLICAS + 10 {
            let address = SocketAddr::from(([10, 1, (i / 256) as u8, (i % 256) as u8], 9090));
            replicas.hear(
                from(&format!("r{i}"), 1, &ReplicaLedger::default()),
                address,
                now,
            );
        }
        assert_eq!(replicas.addresses().count(), MAX_REPLICAS);
    }
}

//! One worker as this proxy sees it, shared by every routing table that names its address:
//! what this proxy has sent it (requests in flight, prefill not yet answered), its queue as its
//! metrics report it, and its learned speed. Data only: the scorer and the attempt phase read
//! and count here.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use switchyard_kv::hash::SequenceHash;
use tokio::sync::Notify;

use crate::calibration::{PrefillWork, TtftCalibration};
use crate::kv::WorkerLoad;

/// Wakes the sender of this replica's ledger to the other replicas ([`crate::peers`]): a guard
/// below ended, or a request's guards are all in place (the attempt phase says so once it has
/// started all three, so the other replicas never see half a decision). A permit nobody takes
/// when no replicas are configured.
pub(crate) static LEDGER_CHANGED: Notify = Notify::const_new();

/// Requests this proxy has sent to workers, numbered in order ([`WorkerState::last_sent`]).
static SENT: AtomicU64 = AtomicU64::new(0);

pub(crate) fn ledger_changed() {
    LEDGER_CHANGED.notify_one();
}

/// One worker as this proxy sees it.
#[derive(Debug)]
pub struct WorkerState {
    /// `host:port` as configured.
    pub address: String,
    /// Resolved when the table was built; `None` when the name did not resolve.
    pub socket: Option<SocketAddr>,
    /// Uncached prompt tokens this proxy sent that have not produced a first token yet, and
    /// their attention pairs ([`PrefillWork`]).
    pending_prefill_tokens: AtomicUsize,
    pending_prefill_pairs: AtomicU64,
    /// When the worker started on the oldest of those (microseconds on [`crate::kv::clock_micros`]): the
    /// queue is worked off first come, first served, so part of it is done already.
    prefill_started_us: AtomicU64,
    /// The pending prefills by the order they were sent (a number each, one past the last
    /// pending one's): the first is the one the worker is on.
    prefill_order: Mutex<BTreeSet<u64>>,
    /// Queue as the worker's metrics report it, and this proxy's own requests there.
    pub load: Arc<WorkerLoad>,
    /// Observed against predicted time to first token, learned from this proxy's requests.
    pub ttft: TtftCalibration,
    /// The number of this proxy's latest request to the worker, in the order of all its
    /// requests to any worker ([`SENT`]; 0: never).
    last_sent: AtomicU64,
    /// The KV blocks this proxy's requests at the worker hold (or will, once scheduled).
    held: Mutex<HeldBlocks>,
}

/// The KV blocks a worker holds for this proxy's requests there, counted as the worker counts
/// them: a full prompt block by its hash, so that requests sharing a prefix hold its blocks
/// once; the rest (a prompt's last partial block, the output a request may generate) per
/// request. Every request holds a chain of hashes from its first block, so the hashes held
/// are closed under prefixes: a prompt's held blocks are a prefix of it.
#[derive(Debug, Default)]
struct HeldBlocks {
    by_hash: HashMap<SequenceHash, u32>,
    unhashed: u64,
    released: Released,
}

/// The full prompt blocks this proxy's requests at a worker held and none holds any more: the
/// worker keeps them cached, free to vLLM, and evicts the least recently freed first when a
/// request needs room. Those freed a moment ago are a conversation between its turns, or a
/// prefix the next request shares: what a request taking their room would cost the traffic
/// that comes back for them ([`crate::scorer`]).
#[derive(Debug, Default)]
struct Released {
    /// When each was last freed ([`crate::kv::clock_micros`]) and that freeing's number, for up
    /// to [`MAX_RELEASED_AGE_US`] and [`MAX_RELEASED`] of them.
    at: HashMap<SequenceHash, (u64, u64)>,
    /// The same in the order freed, numbered one after another (an entry whose block was held,
    /// and perhaps freed again, since is stale: `at` no longer has its number).
    order: VecDeque<Freeing>,
    /// The entries from `window_from` on are those freed within the scorer's horizon (older
    /// ones leave it as it reads), and `in_window` how many of them are not stale: the count is
    /// kept as blocks are held and freed, so a read costs what has left the horizon since the
    /// last, not the blocks in it.
    window_from: u64,
    in_window: u64,
    /// The next freeing's number.
    next: u64,
}

/// One block freed: when, its number, its hash.
type Freeing = (u64, u64, SequenceHash);

/// Freed blocks remembered per worker at most, and for at most this long.
const MAX_RELEASED: usize = 1 << 16;
const MAX_RELEASED_AGE_US: u64 = 600 * 1_000_000;

impl Released {
    fn held(&mut self, hash: &SequenceHash) {
        if let Some((_, number)) = self.at.remove(hash)
            && number >= self.window_from
        {
            self.in_window = self.in_window.saturating_sub(1);
        }
    }

    fn freed(&mut self, hash: SequenceHash, now: u64) {
        self.held(&hash);
        let number = self.next;
        self.next += 1;
        self.at.insert(hash, (now, number));
        self.order.push_back((now, number, hash));
        self.in_window += 1;
        while self.order.front().is_some_and(|(at, _, _)| {
            self.order.len() > MAX_RELEASED || now.saturating_sub(*at) > MAX_RELEASED_AGE_US
        }) {
            if let Some((_, number, oldest)) = self.order.pop_front() {
                if self.at.get(&oldest).is_some_and(|(_, n)| *n == number) {
                    self.held(&oldest);
                }
                self.window_from = self.window_from.max(number + 1);
            }
        }
    }

    /// Blocks freed within `horizon_us` of `now`, less those of `own` (the request's own prompt
    /// hits them: they make no room for it, and it takes none of theirs). A horizon longer
    /// than at the last read counts only what that one kept.
    fn recent(&mut self, own: &[SequenceHash], now: u64, horizon_us: u64) -> u64 {
        let since = now.saturating_sub(horizon_us);
        let first = self
            .order
            .front()
            .map_or(self.next, |(_, number, _)| *number);
        while let Some(&(at, number, hash)) = self
            .order
            .get(usize::try_from(self.window_from.saturating_sub(first)).unwrap_or(usize::MAX))
            && at < since
        {
            if self.at.get(&hash).is_some_and(|(_, n)| *n == number) {
                self.in_window = self.in_window.saturating_sub(1);
            }
            self.window_from = number + 1;
        }
        let own = own
            .iter()
            .filter(|hash| {
                self.at
                    .get(*hash)
                    .is_some_and(|(_, number)| *number >= self.window_from)
            })
            .count() as u64;
        self.in_window.saturating_sub(own)
    }

    /// How many leading blocks of `hashes` were freed here, and how long ago the deepest of
    /// them was (µs).
    fn reused(&self, hashes: &[SequenceHash], now: u64) -> Option<(usize, u64)> {
        let deepest = hashes.iter().rposition(|hash| self.at.contains_key(hash))?;
        let (at, _) = self.at.get(hashes.get(deepest)?)?;
        Some((deepest + 1, now.saturating_sub(*at)))
    }
}

impl HeldBlocks {
    fn blocks(&self) -> u64 {
        (self.by_hash.len() as u64).saturating_add(self.unhashed)
    }
}

impl WorkerState {
    /// This proxy's requests at the worker now.
    pub fn in_flight(&self) -> usize {
        self.load.own_in_flight() as usize
    }

    /// The number of this proxy's latest request to the worker ([`SENT`]; 0: never): the
    /// worker sent to longest ago has the smallest.
    pub fn last_sent(&self) -> u64 {
        self.last_sent.load(Ordering::Relaxed)
    }

    /// What this proxy counts against the worker now: the ledger it exports on `/metrics` and
    /// sends to the other replicas ([`crate::peers`]).
    pub fn ledger(&self) -> crate::kv::PeerLedger {
        crate::kv::PeerLedger {
            prefills: self.load.own_pending(),
            prefill_tokens: self.pending_prefill_tokens() as u64,
            in_flight: self.in_flight() as u64,
            kv_blocks: self.load.own_kv_blocks(),
            prefill_elapsed_us: self.prefill_elapsed().as_micros() as u64,
        }
    }

    /// How many leading blocks of a prompt (its chained block hashes) this proxy's requests at
    /// the worker hold now: blocks the worker need not take from its free ones to run it. (A
    /// cached block nobody runs is free to vLLM, evicted on demand: a request that hits it
    /// takes it out of the free blocks as surely as a new one.)
    pub fn held_prefix_blocks(&self, hashes: &[SequenceHash]) -> usize {
        let held = crate::lock(&self.held);
        if held.by_hash.is_empty() {
            return 0;
        }
        hashes.partition_point(|hash| held.by_hash.contains_key(hash))
    }

    /// Blocks this proxy's requests at the worker freed within `horizon` and nobody holds now,
    /// less those of `hashes` (a prompt's own blocks): others' cached history, the first the
    /// worker evicts when a request needs more than its other free blocks.
    pub fn recently_freed_blocks(&self, hashes: &[SequenceHash], horizon: Duration) -> u64 {
        let horizon_us = u64::try_from(horizon.as_micros()).unwrap_or(u64::MAX);
        crate::lock(&self.held)
            .released
            .recent(hashes, crate::kv::clock_micros(), horizon_us)
    }

    /// How deep a prompt (its chained block hashes) reaches into blocks this proxy's requests
    /// freed here, and how long ago the deepest of them was freed: a prompt coming back for
    /// its history.
    pub fn freed_prefix(&self, hashes: &[SequenceHash]) -> Option<(usize, Duration)> {
        let held = crate::lock(&self.held);
        let (depth, ago_us) = held.released.reused(hashes, crate::kv::clock_micros())?;
        Some((depth, Duration::from_micros(ago_us)))
    }

    pub fn pending_prefill_tokens(&self) -> usize {
        self.pending_prefill_tokens.load(Ordering::Relaxed)
    }

    /// The prefill work this proxy sent that has not produced a first token yet.
    pub fn pending_prefill(&self) -> PrefillWork {
        PrefillWork {
            tokens: self.pending_prefill_tokens() as f64,
            pairs: self.pending_prefill_pairs.load(Ordering::Relaxed) as f64,
        }
    }

    /// How long the worker has been on the oldest of this proxy's pending prefills (zero when
    /// none is pending).
    pub fn prefill_elapsed(&self) -> std::time::Duration {
        if self.load.own_pending() == 0 {
            return std::time::Duration::ZERO;
        }
        crate::kv::elapsed_since(self.prefill_started_us.load(Ordering::Relaxed))
    }
}

/// Counts prefill work sent to a worker until its first token (or the end of the request).
#[derive(Debug)]
pub struct PendingPrefill {
    worker: Arc<WorkerState>,
    tokens: usize,
    pairs: u64,
    /// Its place in the worker's order of pending prefills.
    number: u64,
}

impl PendingPrefill {
    pub fn start(worker: &Arc<WorkerState>, work: PrefillWork) -> PendingPrefill {
        let (tokens, pairs) = (work.tokens as usize, work.pairs as u64);
        let mut order = crate::lock(&worker.prefill_order);
        let number = order.last().map_or(0, |last| last + 1);
        if order.is_empty() {
            worker
                .prefill_started_us
                .store(crate::kv::clock_micros(), Ordering::Relaxed);
        }
        order.insert(number);
        worker
            .pending_prefill_tokens
            .fetch_add(tokens, Ordering::Relaxed);
        worker
            .pending_prefill_pairs
            .fetch_add(pairs, Ordering::Relaxed);
        worker.load.own_pending.fetch_add(1, Ordering::Relaxed);
        PendingPrefill {
            worker: worker.clone(),
            tokens,
            pairs,
            number,
        }
    }
}

impl Drop for PendingPrefill {
    fn drop(&mut self) {
        let mut order = crate::lock(&self.worker.prefill_order);
        let oldest = order.first() == Some(&self.number);
        order.remove(&self.number);
        self.worker
            .pending_prefill_tokens
            .fetch_sub(self.tokens, Ordering::Relaxed);
        self.worker
            .pending_prefill_pairs
            .fetch_sub(self.pairs, Ordering::Relaxed);
        self.worker.load.own_pending.fetch_sub(1, Ordering::Relaxed);
        // When the oldest is through, the worker starts on the next one now. A later one
        // released first (a short cached prompt overtaking a long one, a cancel, a retry) leaves
        // the worker's progress on the oldest as it was.
        if oldest {
            self.worker
                .prefill_started_us
                .store(crate::kv::clock_micros(), Ordering::Relaxed);
        }
        ledger_changed();
    }
}

/// A prefill counted against a worker: until its first token, or (a whole answer, whose first
/// token the proxy does not see) until the end of the prefill the scorer predicted, whichever
/// comes first, or the request ends. A whole answer's head arrives with its last token: held
/// until then, its prompt would count as queued while it decodes, and as the worker's oldest
/// prefill it would make everything sent after it look done ([`WorkerState::prefill_elapsed`]).
#[derive(Debug)]
pub enum Prefill {
    /// Released when dropped (at the first token).
    Seen(PendingPrefill),
    /// Released by the timer at the predicted first token, or when dropped first (the timer
    /// holds it only weakly).
    Unseen(Arc<Mutex<Option<PendingPrefill>>>),
}

impl Prefill {
    /// A prefill whose first token will not be seen: released `after` the predicted time (on
    /// the current Tokio runtime; without one, as [`Prefill::Seen`]).
    pub fn unseen(pending: PendingPrefill, after: std::time::Duration) -> Prefill {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Prefill::Seen(pending);
        };
        let shared = Arc::new(Mutex::new(Some(pending)));
        let timer = Arc::downgrade(&shared);
        runtime.spawn(async move {
            tokio::time::sleep(after).await;
            if let Some(shared) = timer.upgrade() {
                drop(crate::lock(&shared).take());
            }
        });
        Prefill::Unseen(shared)
    }

    /// Whether it is still counted.
    pub fn counted(&self) -> bool {
        match self {
            Prefill::Seen(_) => true,
            Prefill::Unseen(shared) => crate::lock(shared).is_some(),
        }
    }
}

/// Counts the KV blocks a request will hold at a worker (its prompt's full blocks by hash,
/// and `unhashed` more: the prompt past them and the output it may generate) until the
/// request ends.
#[derive(Debug)]
pub struct KvReservation {
    worker: Arc<WorkerState>,
    hashes: Vec<SequenceHash>,
    unhashed: u64,
}

impl KvReservation {
    pub fn start(
        worker: &Arc<WorkerState>,
        hashes: &[SequenceHash],
        unhashed: u64,
    ) -> KvReservation {
        let mut held = crate::lock(&worker.held);
        for hash in hashes {
            *held.by_hash.entry(*hash).or_default() += 1;
            held.released.held(hash);
        }
        held.unhashed = held.unhashed.saturating_add(unhashed);
        worker
            .load
            .own_kv_blocks
            .store(held.blocks(), Ordering::Relaxed);
        KvReservation {
            worker: worker.clone(),
            hashes: hashes.to_vec(),
            unhashed,
        }
    }
}

impl Drop for KvReservation {
    fn drop(&mut self) {
        let mut held = crate::lock(&self.worker.held);
        let now = crate::kv::clock_micros();
        for hash in &self.hashes {
            if let std::collections::hash_map::Entry::Occupied(mut entry) =
                held.by_hash.entry(*hash)
            {
                *entry.get_mut() -= 1;
                if *entry.get() == 0 {
                    entry.remove();
                    held.released.freed(*hash, now);
                }
            }
        }
        held.unhashed = held.unhashed.saturating_sub(self.unhashed);
        self.worker
            .load
            .own_kv_blocks
            .store(held.blocks(), Ordering::Relaxed);
        drop(held);
        ledger_changed();
    }
}

/// Counts a request against a worker for as long as it lives.
#[derive(Debug)]
pub struct InFlight(Arc<WorkerState>);

impl InFlight {
    pub fn start(worker: &Arc<WorkerState>) -> InFlight {
        worker.load.own_in_flight.fetch_add(1, Ordering::Relaxed);
        let number = SENT.fetch_add(1, Ordering::Relaxed) + 1;
        worker.last_sent.store(number, Ordering::Relaxed);
        InFlight(worker.clone())
    }

    pub fn worker(&self) -> &Arc<WorkerState> {
        &self.0
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.load.own_in_flight.fetch_sub(1, Ordering::Relaxed);
        ledger_changed();
    }
}

/// Worker state shared across snapshots, keyed by address.
#[derive(Debug, Default)]
pub struct EndpointRegistry {
    workers: Mutex<HashMap<String, Arc<WorkerState>>>,
}

impl EndpointRegistry {
    /// The state for `address`, created (and resolved) the first time it is seen.
    pub(crate) fn worker(&self, address: &str) -> Arc<WorkerState> {
        let mut workers = crate::lock(&self.workers);
        if let Some(existing) = workers.get(address)
            && existing.socket.is_some()
        {
            return existing.clone();
        }
        let socket = address.to_socket_addrs().ok().and_then(|mut a| a.next());
        if socket.is_none() {
            tracing::warn!(
                worker = address,
                "worker address does not resolve; it will not be chosen"
            );
        }
        let state = Arc::new(WorkerState {
            address: address.to_owned(),
            socket,
            pending_prefill_tokens: AtomicUsize::new(0),
            pending_prefill_pairs: AtomicU64::new(0),
            prefill_started_us: AtomicU64::new(0),
            prefill_order: Mutex::default(),
            load: Arc::default(),
            ttft: TtftCalibration::default(),
            last_sent: AtomicU64::new(0),
            held: Mutex::default(),
        });
        workers.insert(address.to_owned(), state.clone());
        state
    }

    /// Forget workers no table uses any more.
    pub(crate) fn retain(&self, live: &[Arc<WorkerState>]) {
        let mut workers = crate::lock(&self.workers);
        workers.retain(|address, _| live.iter().any(|w| &w.address == address));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_sharing_a_prefix_hold_its_blocks_once_until_the_last_ends() {
        let registry = EndpointRegistry::default();
        let worker = registry.worker("127.0.0.1:1");
        let hashes: Vec<SequenceHash> = (1..=10).map(SequenceHash).collect();
        assert_eq!(worker.held_prefix_blocks(&hashes), 0);
        // A system prompt's 6 blocks, and a conversation that adds 4 to them; each with an
        // unhashed tail (partial block, output).
        let system = KvReservation::start(&worker, &hashes[..6], 2);
        let conversation = KvReservation::start(&worker, &hashes, 3);
        assert_eq!(worker.load.own_kv_blocks(), 10 + 5);
        assert_eq!(worker.held_prefix_blocks(&hashes), 10);
        // Another prompt that parts from them after 3 blocks.
        let other: Vec<SequenceHash> = hashes[..3]
            .iter()
            .copied()
            .chain([SequenceHash(99)])
            .collect();
        assert_eq!(worker.held_prefix_blocks(&other), 3);
        drop(conversation);
        assert_eq!(worker.load.own_kv_blocks(), 6 + 2);
        assert_eq!(worker.held_prefix_blocks(&hashes), 6);
        drop(system);
        assert_eq!(worker.load.own_kv_blocks(), 0);
        assert_eq!(worker.held_prefix_blocks(&hashes), 0);
    }

    #[test]
    fn blocks_nobody_holds_any_more_are_remembered_as_freed_until_held_again() {
        let registry = EndpointRegistry::default();
        let worker = registry.worker("127.0.0.1:1");
        let hashes: Vec<SequenceHash> = (1..=10).map(SequenceHash).collect();
        let other: Vec<SequenceHash> = (11..=14).map(SequenceHash).collect();
        let minute = Duration::from_secs(60);
        let system = KvReservation::start(&worker, &hashes[..6], 2);
        let conversation = KvReservation::start(&worker, &hashes, 3);
        assert_eq!(worker.recently_freed_blocks(&other, minute), 0);
        assert_eq!(worker.freed_prefix(&hashes), None);
        // The conversation's turn ends: its own 4 blocks are freed, the system prompt's are
        // still held by the other request.
        drop(conversation);
        assert_eq!(worker.recently_freed_blocks(&other, minute), 4);
        // A prompt's own blocks are not others' history to it.
        assert_eq!(worker.recently_freed_blocks(&hashes, minute), 0);
        let (depth, ago) = worker.freed_prefix(&hashes).unwrap();
        assert_eq!(depth, 10);
        assert!(ago < minute);
        drop(system);
        assert_eq!(worker.recently_freed_blocks(&other, minute), 10);
        // Freed longer ago than the horizon: not counted.
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(
            worker.recently_freed_blocks(&other, Duration::from_micros(100)),
            0
        );
        // The next turn holds them again, and frees them again at its end: once each.
        let next = KvReservation::start(&worker, &hashes, 3);
        assert_eq!(worker.recently_freed_blocks(&other, minute), 0);
        assert_eq!(worker.freed_prefix(&hashes), None);
        drop(next);
        assert_eq!(worker.recently_freed_blocks(&other, minute), 10);
    }

    #[test]
    fn the_freed_blocks_count_stays_exact_and_bounded() {
        let hash = SequenceHash;
        let mut released = Released::default();
        // Freed, held again and freed again within one clock tick: counted once while in the
        // horizon, and leaving it once.
        released.freed(hash(1), 10);
        released.held(&hash(1));
        released.freed(hash(1), 10);
        released.freed(hash(2), 11);
        released.freed(hash(3), 12);
        assert_eq!(released.recent(&[], 12, 5), 3);
        assert_eq!(released.recent(&[hash(2)], 12, 5), 2);
        // Block 1's two entries leave the horizon: one block less, not two.
        assert_eq!(released.recent(&[], 14, 3), 2);
        assert_eq!(released.recent(&[], 100, 5), 0);
        assert_eq!(released.in_window, 0);
        released.freed(hash(3), 101);
        assert_eq!(released.recent(&[], 101, 5), 1);
        // Without a single read (no horizon yet), the count stays within what `at` keeps;
        // past the age limit, a block is forgotten.
        let mut released = Released::default();
        for i in 0..(MAX_RELEASED as u64 + 10) {
            released.freed(hash(1000 + i), i);
        }
        assert_eq!(released.order.len(), MAX_RELEASED);
        assert_eq!(released.at.len(), MAX_RELEASED);
        assert_eq!(released.in_window, MAX_RELEASED as u64);
        assert!(released.reused(&[hash(1000)], 0).is_none());
        released.freed(hash(1), MAX_RELEASED_AGE_US + 100_000);
        assert_eq!(released.at.len(), 1);
        assert_eq!(released.recent(&[], MAX_RELEASED_AGE_US + 100_000, 1), 1);
    }

    #[test]
    fn the_prefill_clock_restarts_only_when_the_oldest_prefill_is_through() {
        let registry = EndpointRegistry::default();
        let worker = registry.worker("127.0.0.1:1");
        assert_eq!(worker.prefill_elapsed(), std::time::Duration::ZERO);
        let long = PendingPrefill::start(&worker, PrefillWork::after(0, 2_000));
        let short = PendingPrefill::start(&worker, PrefillWork::after(0, 30));
        // When the worker started on the long prompt (a mark no clock reading is).
        let mark = u64::MAX / 2;
        worker.prefill_started_us.store(mark, Ordering::Relaxed);
        // A short cached prompt sent after it answers first: the long one is as far along.
        drop(short);
        assert_eq!(worker.prefill_started_us.load(Ordering::Relaxed), mark);
        assert_eq!(worker.pending_prefill_tokens(), 2_000);
        let next = PendingPrefill::start(&worker, PrefillWork::after(0, 500));
        assert_eq!(worker.prefill_started_us.load(Ordering::Relaxed), mark);
        // The long one is through: the worker starts on the next now.
        drop(long);
        assert!(worker.prefill_started_us.load(Ordering::Relaxed) < mark);
        assert_eq!(worker.pending_prefill_tokens(), 500);
        assert_eq!(worker.pending_prefill(), PrefillWork::after(0, 500));
        assert_eq!(worker.load.own_pending(), 1);
        drop(next);
        assert_eq!(worker.pending_prefill(), PrefillWork::default());
        assert_eq!(worker.prefill_elapsed(), std::time::Duration::ZERO);
    }
}

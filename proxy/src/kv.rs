//! What the proxy knows about each pool's workers beyond their addresses: the prefix index fed
//! by their KV events, the prompts routed to them but not yet confirmed by events, their queues
//! as read from their metrics, and the counters `/metrics` shows. [`crate::feeds`] keeps these
//! up to date; the scorer reads them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use switchyard_kv::index::{PrefixIndex, WorkerId};
use switchyard_kv::tokenize::{PromptTokenizer, TokenizeError};
use switchyard_snapshot::PoolId;
use switchyard_snapshot::snapshot::Tokenizer;

use crate::lock;

/// Counters of one worker's event stream.
#[derive(Debug, Default)]
pub struct StreamStats {
    pub batches: AtomicU64,
    pub gaps_replayed: AtomicU64,
    pub gaps_cleared: AtomicU64,
    pub publisher_restarts: AtomicU64,
    pub decode_errors: AtomicU64,
    /// When the last batch was applied ([`clock_micros`]; 0: never).
    pub last_batch_us: AtomicU64,
}

impl StreamStats {
    /// A batch was applied now.
    pub fn batch_applied(&self) {
        self.batches.fetch_add(1, Ordering::Relaxed);
        // 0 means never.
        self.last_batch_us
            .store(clock_micros().max(1), Ordering::Relaxed);
    }

    /// The stream's state as [`Predictions::unstored_blocks`] reads it: `None` unless a batch
    /// came within [`LIVE_EVENTS`], else the count of times the worker's entries were dropped
    /// (gaps that could not be filled, publisher restarts).
    fn epoch(&self) -> Option<u64> {
        let last = self.last_batch_us.load(Ordering::Relaxed);
        (last > 0 && elapsed_since(last) <= LIVE_EVENTS).then(|| {
            self.gaps_cleared.load(Ordering::Relaxed)
                + self.publisher_restarts.load(Ordering::Relaxed)
        })
    }
}

/// A worker that is scheduling a prompt's blocks publishes events every step: one whose stream
/// has been silent this long tells nothing of a prefill's progress.
const LIVE_EVENTS: std::time::Duration = std::time::Duration::from_secs(1);

/// Routing decisions of a pool, by what decided them.
#[derive(Debug, Default)]
pub struct DecisionStats {
    /// The chosen worker held part of the prompt.
    pub cache_hit: AtomicU64,
    /// No worker held any of it: chosen by queue alone.
    pub no_cache: AtomicU64,
    /// A worker holding more of the prompt was passed over because its queue was longer.
    pub spread: AtomicU64,
    /// A worker holding more of the prompt was passed over to copy a prefix whose traffic
    /// brings more work than its holders' fair share.
    pub replicate: AtomicU64,
}

/// Prompts routed to a worker whose blocks its KV events have not confirmed yet: the worker will
/// hold them within one prefill, so later requests with the same prefix can follow at once
/// instead of all being spread before the first one's events arrive.
#[derive(Debug, Default)]
pub struct Predictions {
    entries: Mutex<Vec<Predicted>>,
    next_id: AtomicU64,
    /// What workers without a KV event feed are assumed to hold once their requests end.
    pub history: crate::history::RoutedHistory,
    /// Remembered requests that ended known by their prompt's head only (a whole answer ends
    /// at its first token, before the whole is tokenized): id, worker and cache size, until
    /// the whole is ([`Predictions::take_ended_head`]); the newest [`ENDED_HEADS`].
    ended_heads: Mutex<std::collections::VecDeque<(u64, WorkerId, usize)>>,
    /// This replica's latest prompts assumed held by a worker without KV events once their
    /// requests ended, for the other replicas ([`Predictions::recent_frees`]): the newest
    /// [`SHARED_FREES`], numbered by [`NEXT_END`].
    frees: Mutex<std::collections::VecDeque<SharedFree>>,
}

/// The number of this process's next end told to the other replicas: one count for every pool,
/// so that a pool made anew (its block size changed, or it was removed and added back) goes on
/// from the last, and a receiver that heard them does not take the new ones for old.
static NEXT_END: AtomicU64 = AtomicU64::new(1);

/// Samples of a prompt told at its end at most (the first 512 blocks): a datagram carries
/// [`SHARED_FREES`] of them beside everything else, and what is shared past them is rarely a
/// prefix another request needs.
const MAX_END_SAMPLES: usize = 128;

/// One request that ended at a worker without KV events, for the other replicas: its number,
/// its worker, and its prompt's sampled blocks.
pub type SharedFree = (u64, WorkerId, Samples);

/// The latest ends a replica tells the other replicas of: every ledger datagram carries them
/// (but for the oldest when it would be too long), and one goes out at every end, so a datagram
/// lost is repaired by the next.
pub const SHARED_FREES: usize = 8;

/// Remembered requests that ended by their head waiting for the whole at most: the background
/// queue that tokenizes them holds sixteen jobs, so older ones were dropped anyway.
const ENDED_HEADS: usize = 64;

/// One prompt in flight to a worker.
#[derive(Debug)]
struct Predicted {
    id: u64,
    worker: WorkerId,
    prompt: Arc<crate::prompt::PromptInfo>,
    /// Leading blocks the worker was known to hold (or be sent) when the prompt was routed: the
    /// other replicas know them already, from the KV events or from whoever sent them.
    known: usize,
    /// While the prompt is prefilled, what the other replicas are told of it
    /// ([`Predictions::prefilling`]): before its first token the worker's KV events have not
    /// stored its blocks, so they can learn of them only from this replica. `None` after.
    told: Option<Samples>,
    /// Leading blocks stored by the worker's KV events or known when routed, as far as
    /// [`Predictions::unstored_blocks`] last looked (it goes on from there).
    stored: usize,
    /// The worker's stream epoch ([`StreamStats`]) when its events first stored a block of the
    /// prompt past `known`; `None` before.
    seen: Option<u64>,
    /// The prompt has its first output (not an error): the worker computed (and caches) its
    /// blocks.
    prefilled: bool,
    /// The worker publishes no KV events: when the request ends, its prompt goes to the
    /// [`crate::history::RoutedHistory`] of a cache of this many blocks (and the other
    /// replicas are told, as they were while it ran).
    remember: Option<usize>,
}

/// Sampled `(blocks, hash)` of a prompt past what was known of it ([`sample_blocks`]).
pub type Samples = Arc<[(usize, switchyard_kv::hash::SequenceHash)]>;

/// The hash of the first block of `hashes`, of every [`PEER_SAMPLE_BLOCKS`]-th and of its
/// last, past the first `known` blocks, with the blocks up to each. The first: a prompt is
/// first known by a head of a few blocks (two of 64 tokens, [`crate::prompt`]), which must
/// find where it may be held to be tokenized further ([`PoolKv::holds_all`]).
fn sample_blocks(
    hashes: &[switchyard_kv::hash::SequenceHash],
    known: usize,
) -> impl Iterator<Item = (usize, switchyard_kv::hash::SequenceHash)> + '_ {
    hashes
        .iter()
        .enumerate()
        .map(|(at, hash)| (at + 1, *hash))
        .filter(move |(blocks, _)| {
            *blocks > known
                && (*blocks == 1 || blocks % PEER_SAMPLE_BLOCKS == 0 || *blocks == hashes.len())
        })
}

/// A replica tells the others every this many blocks of a prompt it is having prefilled (and
/// its last): the hash of a block stands for the whole prefix before it, so a sample of them
/// places a shared prefix to within this many blocks at a quarter of the bytes.
pub const PEER_SAMPLE_BLOCKS: usize = 4;

/// Sampled hashes a replica tells the others per worker at most, the shortest prefixes first.
const MAX_PEER_HASHES: usize = 256;

impl Predictions {
    /// Predict that `worker` will hold `prompt`'s blocks until the guard drops; it was known to
    /// hold (or be sent) the first `known` of them already.
    pub fn add(
        self: &Arc<Self>,
        worker: WorkerId,
        prompt: Arc<crate::prompt::PromptInfo>,
        known: usize,
    ) -> Prediction {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let told = Some(sample_blocks(&prompt.hashes, known).collect());
        lock(&self.entries).push(Predicted {
            id,
            worker,
            prompt,
            known,
            told,
            stored: known,
            seen: None,
            prefilled: false,
            remember: None,
        });
        Prediction {
            predictions: self.clone(),
            id,
        }
    }

    /// Replace the prompt of prediction `id` by the whole of it (it was predicted from its head
    /// only); nothing when that request has ended.
    pub fn finish(&self, id: u64, prompt: Arc<crate::prompt::PromptInfo>) {
        let known = lock(&self.entries)
            .iter()
            .find(|e| e.id == id)
            .map(|e| e.known);
        // Sampled without the lock (a prompt can be thousands of blocks).
        let told = known.map(|known| sample_blocks(&prompt.hashes, known).collect());
        if let Some(entry) = lock(&self.entries).iter_mut().find(|e| e.id == id) {
            entry.prompt = prompt;
            if entry.told.is_some() {
                entry.told = told;
            }
        }
    }

    /// Whether prediction `id` is held and known by its prompt's head only.
    pub fn is_head(&self, id: u64) -> bool {
        lock(&self.entries)
            .iter()
            .any(|e| e.id == id && e.prompt.unfinished.is_some())
    }

    /// Finish, with `whole`, every prediction known only by its head when `request` runs past
    /// that head and shares all of it: only then can the rest of that prompt matter to
    /// routing, and it is tokenized for the first request that needs it, not for every prompt.
    /// `whole` runs without the lock; a prediction whose request ended meanwhile is skipped.
    pub fn finish_under(
        &self,
        request: &[switchyard_kv::hash::SequenceHash],
        whole: impl Fn(&crate::prompt::Unfinished) -> Option<Arc<crate::prompt::PromptInfo>>,
    ) {
        let wanted: Vec<(u64, Arc<crate::prompt::Unfinished>)> = lock(&self.entries)
            .iter()
            .filter_map(|entry| {
                let unfinished = entry.prompt.unfinished.as_ref()?;
                let head = &entry.prompt.hashes;
                (head.len() < request.len() && request.starts_with(head))
                    .then(|| (entry.id, unfinished.clone()))
            })
            .collect();
        let mut done: Vec<(&crate::prompt::Unfinished, Arc<crate::prompt::PromptInfo>)> =
            Vec::new();
        for (id, unfinished) in &wanted {
            // Two requests in flight with the same prompt need it tokenized once.
            let known = done
                .iter()
                .find(|(u, _)| **u == **unfinished)
                .map(|(_, info)| info.clone());
            if let Some(info) = known.or_else(|| whole(unfinished)) {
                self.finish(*id, info.clone());
                done.push((unfinished, info));
            }
        }
    }

    /// Raise each worker's depth in `overlap` to the longest prefix of `request` it was sent.
    pub fn raise(
        &self,
        request: &[switchyard_kv::hash::SequenceHash],
        overlap: &mut switchyard_kv::index::Overlap,
    ) {
        for entry in lock(&self.entries).iter() {
            let common = entry
                .prompt
                .hashes
                .iter()
                .zip(request)
                .take_while(|(a, b)| a == b)
                .count();
            if common > 0 {
                overlap.raise(entry.worker, common as u32);
            }
        }
    }

    /// Prediction `id`'s prompt has its first token: its worker's KV events tell every replica
    /// where its blocks are from now on. A worker without KV events tells nobody: the other
    /// replicas are told of a prompt it computed until the request ends, and then of its end
    /// ([`Predictions::recent_frees`]).
    /// `computed`: the worker answered with output, not with an error (which computed nothing).
    pub fn prefilled(&self, id: u64, computed: bool) {
        if let Some(entry) = lock(&self.entries).iter_mut().find(|e| e.id == id) {
            if !(computed && entry.remember.is_some()) {
                entry.told = None;
            }
            entry.prefilled = computed;
        }
    }

    /// Prediction `id`'s worker publishes no KV events: once its request ends, a prompt it
    /// prefilled is assumed held there, in a cache of `capacity_blocks`
    /// ([`crate::history::RoutedHistory`]).
    pub fn remember(&self, id: u64, capacity_blocks: usize) {
        if let Some(entry) = lock(&self.entries).iter_mut().find(|e| e.id == id) {
            entry.remember = Some(capacity_blocks);
        }
    }

    /// Prediction `id`'s request ended.
    fn end(&self, id: u64) {
        let ended = {
            let mut entries = lock(&self.entries);
            let at = entries.iter().position(|e| e.id == id);
            at.map(|at| entries.remove(at))
        };
        if let Some(Predicted {
            worker,
            prompt,
            prefilled: true,
            remember: Some(capacity),
            ..
        }) = ended
        {
            self.freed(worker, &prompt.hashes, capacity);
            if prompt.unfinished.is_some() {
                let mut heads = lock(&self.ended_heads);
                if heads.len() == ENDED_HEADS {
                    heads.pop_front();
                }
                heads.push_back((id, worker, capacity));
            }
        }
    }

    /// A request this replica had `worker` (without KV events) prefill ended, its prompt's
    /// blocks `hashes`: the worker is assumed to hold them now, in a cache of `capacity`
    /// blocks, and the other replicas are told.
    pub fn freed(
        &self,
        worker: WorkerId,
        hashes: &[switchyard_kv::hash::SequenceHash],
        capacity: usize,
    ) {
        self.history.freed(worker, hashes, capacity);
        let samples: Samples = sample_blocks(hashes, 0).take(MAX_END_SAMPLES).collect();
        if samples.is_empty() {
            return;
        }
        let mut recent = lock(&self.frees);
        recent.push_back((NEXT_END.fetch_add(1, Ordering::Relaxed), worker, samples));
        while recent.len() > SHARED_FREES {
            recent.pop_front();
        }
    }

    /// This replica's latest ends at workers without KV events ([`Predictions::freed`]),
    /// numbered (increasing): the worker, and the prompt's sampled blocks ([`sample_blocks`]:
    /// its first, every [`PEER_SAMPLE_BLOCKS`]-th and its last) with the blocks up to each.
    /// The other replicas assume them held as this one does
    /// ([`crate::history::RoutedHistory::freed_sampled`]): each sees only its share of the
    /// requests, and the worker's cache holds them all.
    pub fn recent_frees(&self) -> Vec<SharedFree> {
        lock(&self.frees).iter().cloned().collect()
    }

    /// The worker and cache size of remembered request `id` if it ended known by its prompt's
    /// head only: the whole is to be assumed held there too.
    pub fn take_ended_head(&self, id: u64) -> Option<(WorkerId, usize)> {
        let mut heads = lock(&self.ended_heads);
        let at = heads.iter().position(|(ended, _, _)| *ended == id)?;
        heads
            .remove(at)
            .map(|(_, worker, capacity)| (worker, capacity))
    }

    /// Per worker slot, the blocks of the prompts this replica is having prefilled there (before
    /// their first token) that the worker's KV events have not stored yet, past the blocks it
    /// held or was sent when each was routed. vLLM stores a block's hash, and publishes its
    /// `BlockStored`, when it schedules the block's tokens: what is not stored yet is work the
    /// worker has still to do, however fast the elapsed time says it goes. `epochs`: each
    /// slot's stream epoch ([`StreamStats`]), `None` for a silent stream.
    ///
    /// A prompt counts once the worker has stored a block of it, and only while its stream
    /// stays live in the epoch of that block: a prompt whose hashes the worker's never match (a
    /// template or adapter the gateway cannot reproduce) or a stream that lost its entries says
    /// nothing, and must not hold the prompt in the queue until its first token. Only the prompt
    /// as far as it is tokenized counts.
    pub fn unstored_blocks(&self, index: &PrefixIndex, epochs: &[Option<u64>]) -> Vec<usize> {
        let epoch = |worker: WorkerId| epochs.get(usize::from(worker.0)).copied().flatten();
        let prefilling: Vec<(u64, WorkerId, Arc<crate::prompt::PromptInfo>, usize)> =
            lock(&self.entries)
                .iter()
                .filter(|e| e.told.is_some() && e.prompt.hashes.len() > e.stored)
                .filter(|e| epoch(e.worker).is_some_and(|now| e.seen.is_none_or(|s| s == now)))
                .map(|e| (e.id, e.worker, e.prompt.clone(), e.stored))
                .collect();
        let mut walked = HashMap::with_capacity(prefilling.len());
        for (id, worker, prompt, from) in prefilling {
            // Without the lock, from where the last look stopped: each block is looked up about
            // once while it is prefilled, however many decisions are made meanwhile.
            let rest = prompt.hashes.get(from..).unwrap_or_default();
            walked.insert(id, from + index.held_depth(worker, rest));
        }
        let mut unstored = vec![0; epochs.len()];
        for entry in lock(&self.entries).iter_mut() {
            let Some(stored) = walked.get(&entry.id) else {
                continue;
            };
            entry.stored = entry.stored.max(*stored);
            if entry.stored > entry.known && entry.seen.is_none() {
                entry.seen = epoch(entry.worker);
            }
            if entry.seen.is_some()
                && let Some(count) = unstored.get_mut(usize::from(entry.worker.0))
            {
                *count += entry.prompt.hashes.len().saturating_sub(entry.stored);
            }
        }
        unstored
    }

    /// Predictions for `worker` are no longer waited for: it left the pool (its slot may be
    /// given to another worker).
    pub fn forget_worker(&self, worker: WorkerId) {
        for entry in lock(&self.entries)
            .iter_mut()
            .filter(|e| e.worker == worker)
        {
            entry.told = None;
            // Nor is its history kept: the slot may go to another worker before these end.
            entry.remember = None;
        }
        lock(&self.ended_heads).retain(|(_, w, _)| *w != worker);
        lock(&self.frees).retain(|(_, w, _)| *w != worker);
        self.history.forget(worker);
    }

    /// What the other replicas need to know of the prompts this one is having prefilled, per
    /// worker: the hash of every [`PEER_SAMPLE_BLOCKS`]-th block of each and of its last, past
    /// the blocks the worker was known to hold when it was routed (the part only this replica
    /// knows), without repeats, the shortest prefixes first, at most [`MAX_PEER_HASHES`].
    pub fn prefilling(&self) -> Vec<(WorkerId, Vec<switchyard_kv::hash::SequenceHash>)> {
        let told: Vec<(WorkerId, Samples)> = lock(&self.entries)
            .iter()
            .filter_map(|e| Some((e.worker, e.told.clone()?)))
            .collect();
        let mut sampled: HashMap<WorkerId, Vec<(usize, switchyard_kv::hash::SequenceHash)>> =
            HashMap::new();
        for (worker, samples) in told {
            sampled
                .entry(worker)
                .or_default()
                .extend_from_slice(&samples);
        }
        sampled
            .into_iter()
            .map(|(worker, mut samples)| {
                samples.sort_unstable();
                let mut seen = std::collections::HashSet::new();
                let hashes = samples
                    .into_iter()
                    .map(|(_, hash)| hash)
                    .filter(|hash| seen.insert(*hash))
                    .take(MAX_PEER_HASHES)
                    .collect();
                (worker, hashes)
            })
            .collect()
    }

    pub fn len(&self) -> usize {
        lock(&self.entries).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The prompts the other gateway replicas are having prefilled: block hashes sampled from them
/// ([`Predictions::prefilling`]), by the workers that will hold them.
#[derive(Debug, Default)]
pub struct PeerPrefixes {
    by_hash: HashMap<switchyard_kv::hash::SequenceHash, Vec<WorkerId>>,
}

impl PeerPrefixes {
    pub fn new(by_worker: &[(WorkerId, Vec<switchyard_kv::hash::SequenceHash>)]) -> PeerPrefixes {
        let mut by_hash: HashMap<switchyard_kv::hash::SequenceHash, Vec<WorkerId>> = HashMap::new();
        for (worker, hashes) in by_worker {
            for hash in hashes {
                let workers = by_hash.entry(*hash).or_default();
                if !workers.contains(worker) {
                    workers.push(*worker);
                }
            }
        }
        PeerPrefixes { by_hash }
    }

    /// Raise each worker's depth in `overlap` to the longest prefix of `request` another
    /// replica sent it (as far as the samples tell: up to [`PEER_SAMPLE_BLOCKS`] − 1 blocks
    /// short); the deepest such prefix of any worker.
    fn raise(
        &self,
        request: &[switchyard_kv::hash::SequenceHash],
        overlap: &mut switchyard_kv::index::Overlap,
    ) -> usize {
        let mut deepest = 0;
        if self.by_hash.is_empty() {
            return deepest;
        }
        for (at, hash) in request.iter().enumerate() {
            if let Some(workers) = self.by_hash.get(hash) {
                for worker in workers {
                    overlap.raise(*worker, (at + 1) as u32);
                }
                deepest = at + 1;
            }
        }
        deepest
    }
}

/// Keeps a prediction alive for as long as its request runs.
#[derive(Debug)]
pub struct Prediction {
    predictions: Arc<Predictions>,
    id: u64,
}

impl Prediction {
    /// The predictions this one is kept in, and its id there (see [`Predictions::finish`]).
    pub fn handle(&self) -> (Arc<Predictions>, u64) {
        (self.predictions.clone(), self.id)
    }

    /// Its prompt has its first output, or an error (see [`Predictions::prefilled`]).
    pub fn prefilled(&self, computed: bool) {
        self.predictions.prefilled(self.id, computed);
    }

    /// Its worker publishes no KV events (see [`Predictions::remember`]).
    pub fn remember(&self, capacity_blocks: usize) {
        self.predictions.remember(self.id, capacity_blocks);
    }
}

impl Drop for Prediction {
    fn drop(&mut self) {
        self.predictions.end(self.id);
    }
}

/// Whether a pool's tokenizer and its workers' give a probe prompt the same ids, per kind of
/// prompt (unknown until checked).
#[derive(Debug, Default)]
pub struct TokenizerAgreement {
    /// 0: unknown, 1: the same ids, 2: different ones.
    chat: AtomicU8,
    completions: AtomicU8,
    tools: AtomicU8,
    /// The tokenizer ([`PromptTokenizer::instance`]) the verdicts are about: a verdict on
    /// another is dropped.
    tokenizer: AtomicU64,
}

/// The kinds of prompt a pool's tokenizer is checked on: a chat (its template and tokenizer),
/// a completions prompt (the tokenizer and the special tokens vLLM adds) and a chat with a tool,
/// a tool call and its answer (what the template does with those).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeKind {
    Chat,
    Completions,
    Tools,
}

impl ProbeKind {
    pub const ALL: [ProbeKind; 3] = [ProbeKind::Chat, ProbeKind::Completions, ProbeKind::Tools];

    pub fn label(self) -> &'static str {
        match self {
            ProbeKind::Chat => "chat",
            ProbeKind::Completions => "completions",
            ProbeKind::Tools => "tools",
        }
    }
}

impl TokenizerAgreement {
    fn slot(&self, kind: ProbeKind) -> &AtomicU8 {
        match kind {
            ProbeKind::Chat => &self.chat,
            ProbeKind::Completions => &self.completions,
            ProbeKind::Tools => &self.tools,
        }
    }

    /// What the last check found for `kind` (`None`: not checked since the tokenizer changed).
    pub fn agrees(&self, kind: ProbeKind) -> Option<bool> {
        match self.slot(kind).load(Ordering::Relaxed) {
            1 => Some(true),
            2 => Some(false),
            _ => None,
        }
    }

    /// Record a verdict on the tokenizer `instance` (dropped when the pool has another now).
    pub fn set(&self, kind: ProbeKind, instance: u64, agrees: bool) {
        if self.tokenizer.load(Ordering::Relaxed) == instance {
            self.slot(kind)
                .store(if agrees { 1 } else { 2 }, Ordering::Relaxed);
        }
    }

    /// Verdicts are about `instance` from now on, and unknown.
    fn reset(&self, instance: u64) {
        self.tokenizer.store(instance, Ordering::Relaxed);
        for kind in ProbeKind::ALL {
            self.slot(kind).store(0, Ordering::Relaxed);
        }
    }
}

/// The prefix index and worker slots of one pool, kept across snapshots while the pool lives.
#[derive(Debug)]
pub struct PoolKv {
    pub id: PoolId,
    pub index: PrefixIndex,
    slots: Mutex<HashMap<String, WorkerId>>,
    streams: Mutex<HashMap<WorkerId, Arc<StreamStats>>>,
    pub decisions: DecisionStats,
    /// Recently tokenized prompts.
    pub prompts: crate::prompt::PromptCache,
    /// Prompts in flight, not yet confirmed by KV events.
    pub predictions: Arc<Predictions>,
    /// Prompts the other replicas are having prefilled ([`crate::peers`]).
    peer_prefixes: Mutex<Arc<PeerPrefixes>>,
    /// Running averages of the prefill work of routed requests (their uncached prompt tokens,
    /// and those tokens' attention pairs): estimate the work behind each request a worker
    /// reports as waiting.
    prefill_tokens_average: RunningAverage,
    prefill_pairs_average: RunningAverage,
    /// Running average of ln(seconds) between a routed prompt's history being freed at a
    /// worker (its deepest block that this proxy's requests held there) and the prompt coming
    /// back for it: how long freed blocks stay wanted ([`PoolKv::reuse_horizon`]).
    reuse_gap_ln_s: RunningAverage,
    /// When the last routed request arrived (`clock_micros`), and the running average of the
    /// time between arrivals (seconds): the pool's arrival rate.
    last_arrival_us: AtomicU64,
    arrival_interval_s: RunningAverage,
    /// What the other gateway replicas route into the pool per second, from their ledgers
    /// ([`crate::peers`]; f64 bits, 0 without peers).
    peer_arrival_rate: AtomicU64,
    /// The pool's TTFT coefficients, learned from its answers.
    pub calibration: crate::calibration::PoolCalibration,
    /// How much of the recent work comes with each prefix.
    pub popularity: crate::popularity::PrefixPopularity,
    /// Whether the pool's tokenizer gives the ids its workers give ([`crate::tokenizer_check`]),
    /// and which tokenizer that is (the one the pool's prompts are tokenized with).
    pub tokenizer_agreement: TokenizerAgreement,
    /// Held while a request chooses a worker and is counted against it: a request deciding on
    /// another thread meanwhile would see the chosen worker without this one's prefill, KV
    /// blocks and prediction, and could take it for idle too.
    pub choosing: Mutex<()>,
}

impl PoolKv {
    fn new(id: PoolId, block_size: usize) -> PoolKv {
        PoolKv {
            id,
            index: PrefixIndex::new(block_size),
            slots: Mutex::new(HashMap::new()),
            streams: Mutex::new(HashMap::new()),
            decisions: DecisionStats::default(),
            prompts: crate::prompt::PromptCache::default(),
            predictions: Arc::default(),
            peer_prefixes: Mutex::default(),
            prefill_tokens_average: RunningAverage::default(),
            reuse_gap_ln_s: RunningAverage::default(),
            prefill_pairs_average: RunningAverage::default(),
            last_arrival_us: AtomicU64::new(0),
            arrival_interval_s: RunningAverage::default(),
            peer_arrival_rate: AtomicU64::new(0),
            calibration: crate::calibration::PoolCalibration::default(),
            popularity: crate::popularity::PrefixPopularity::default(),
            tokenizer_agreement: TokenizerAgreement::default(),
            choosing: Mutex::new(()),
        }
    }

    /// The pool tokenizes with `tokenizer` from now on: when that is another tokenizer than
    /// before (the registry loads one per spec), the prompts it tokenized are forgotten and its
    /// agreement with the workers is unknown.
    pub fn use_tokenizer(&self, tokenizer: &PromptTokenizer) {
        let before = self.tokenizer_agreement.tokenizer.load(Ordering::Relaxed);
        if before == tokenizer.instance() {
            return;
        }
        // 0: none yet (instances count from 1).
        if before != 0 {
            self.prompts.clear();
        }
        self.tokenizer_agreement.reset(tokenizer.instance());
    }

    /// The worker's slot in this pool's index, assigned on first sight (lowest free).
    pub fn slot(&self, address: &str) -> WorkerId {
        let mut slots = lock(&self.slots);
        if let Some(slot) = slots.get(address) {
            return *slot;
        }
        let mut candidate = 0u16;
        while slots.values().any(|s| s.0 == candidate) {
            candidate += 1;
        }
        slots.insert(address.to_owned(), WorkerId(candidate));
        WorkerId(candidate)
    }

    /// How deep each worker holds `hashes`: in the index, or by a request in flight to it
    /// (from this replica or another).
    pub fn overlap(
        &self,
        hashes: &[switchyard_kv::hash::SequenceHash],
    ) -> switchyard_kv::index::Overlap {
        self.overlap_and_reach(hashes).0
    }

    /// [`Self::overlap`], and how far into `hashes` what is known of it by samples (another
    /// replica's prompts) may reach: a held sample stands for the blocks up to the next.
    fn overlap_and_reach(
        &self,
        hashes: &[switchyard_kv::hash::SequenceHash],
    ) -> (switchyard_kv::index::Overlap, usize) {
        let mut overlap = switchyard_kv::index::Overlap::default();
        self.index
            .overlap_into(hashes, self.slot_count(), &mut overlap);
        self.predictions.raise(hashes, &mut overlap);
        let history_reach = self.predictions.history.raise(hashes, &mut overlap);
        let peers = lock(&self.peer_prefixes).clone();
        let peer_depth = peers.raise(hashes, &mut overlap);
        let peer_reach = match peer_depth {
            0 => 0,
            depth => depth + PEER_SAMPLE_BLOCKS - 1,
        };
        (overlap, history_reach.max(peer_reach))
    }

    /// The prompts the other replicas are having prefilled, by worker (replacing the last).
    pub(crate) fn set_peer_prefixes(&self, prefixes: PeerPrefixes) {
        *lock(&self.peer_prefixes) = Arc::new(prefixes);
    }

    /// Per worker slot, blocks of this replica's prompts in prefill there that the worker's
    /// KV events have not stored yet ([`Predictions::unstored_blocks`]); zero for a worker whose
    /// stream is silent.
    pub fn unstored_prefill_blocks(&self) -> Vec<usize> {
        let slots = self.slot_count();
        let epochs: Vec<Option<u64>> = {
            let streams = lock(&self.streams);
            (0..slots)
                .map(|slot| {
                    let slot = WorkerId(u16::try_from(slot).ok()?);
                    streams.get(&slot)?.epoch()
                })
                .collect()
        };
        self.predictions.unstored_blocks(&self.index, &epochs)
    }

    /// Whether some worker holds (or is being sent) every one of `hashes`. A request in flight
    /// known only by its head, which `hashes` share and run past, is tokenized whole first
    /// (see [`Predictions::finish_under`]): it may hold more of them. Another replica's prompt
    /// is known by a sample of its blocks (in flight, or held by a worker without KV events):
    /// one that reaches within a sample of the end counts (the prompt is then tokenized
    /// further, and placed by what it shares).
    pub fn holds_all(
        &self,
        hashes: &[switchyard_kv::hash::SequenceHash],
        tokenizer: &switchyard_kv::tokenize::PromptTokenizer,
    ) -> bool {
        if hashes.is_empty() {
            return false;
        }
        self.predictions.finish_under(hashes, |unfinished| {
            crate::prompt::finish(tokenizer, &self.prompts, unfinished)
        });
        let (overlap, reach) = self.overlap_and_reach(hashes);
        overlap.deepest() as usize >= hashes.len() || reach >= hashes.len()
    }

    /// One past the highest slot in use (the size of an overlap buffer).
    pub fn slot_count(&self) -> usize {
        lock(&self.slots)
            .values()
            .map(|s| usize::from(s.0) + 1)
            .max()
            .unwrap_or(0)
    }

    /// Forget a worker that left the pool, and everything it held.
    pub(crate) fn release(&self, address: &str) {
        if let Some(slot) = lock(&self.slots).remove(address) {
            self.index.remove_worker(slot);
            lock(&self.streams).remove(&slot);
            self.predictions.forget_worker(slot);
        }
    }

    pub fn stream_stats(&self, slot: WorkerId) -> Arc<StreamStats> {
        lock(&self.streams).entry(slot).or_default().clone()
    }

    /// Slots and addresses, for metrics.
    pub fn workers(&self) -> Vec<(String, WorkerId)> {
        let mut workers: Vec<_> = lock(&self.slots)
            .iter()
            .map(|(a, s)| (a.clone(), *s))
            .collect();
        workers.sort();
        workers
    }

    /// The average uncached prompt of routed requests (0 before the first).
    pub fn prefill_tokens_average(&self) -> f64 {
        self.prefill_tokens_average.get()
    }

    /// Requests per second arriving at the pool's workers through every gateway replica: this
    /// proxy's [`Self::own_arrival_rate`] plus what the other replicas last reported.
    pub fn arrival_rate(&self) -> f64 {
        self.own_arrival_rate() + self.peer_arrival_rate()
    }

    /// The other replicas' arrival rate into this pool, from their last ledgers.
    pub fn peer_arrival_rate(&self) -> f64 {
        f64::from_bits(self.peer_arrival_rate.load(Ordering::Relaxed))
    }

    pub(crate) fn set_peer_arrival_rate(&self, rate: f64) {
        let rate = if rate.is_finite() { rate.max(0.0) } else { 0.0 };
        self.peer_arrival_rate
            .store(rate.to_bits(), Ordering::Relaxed);
    }

    /// Requests this proxy routed per second, lately (0 before two have been): the average
    /// time between arrivals, or the time since the last one when that is longer (a pool that
    /// went quiet). What the replica exports to its peers: their rates are never re-exported.
    pub fn own_arrival_rate(&self) -> f64 {
        let (interval, gaps) = self.arrival_interval_s.read();
        let last = self.last_arrival_us.load(Ordering::Relaxed);
        if gaps == 0 || last == 0 {
            return 0.0;
        }
        let since = clock_micros().saturating_sub(last) as f64 / 1e6;
        1.0 / interval.max(since).max(MIN_ARRIVAL_INTERVAL_S)
    }

    /// Count a routed request's arrival (for [`Self::arrival_rate`]). A gap longer than
    /// [`QUIET_GAPS`] average gaps (the pool went quiet) counts as that many: the quiet
    /// itself is read from the time since the last arrival, and an hour without traffic must
    /// not make the next burst look slow for dozens of requests.
    pub fn record_arrival(&self) {
        let now = clock_micros().max(1);
        let last = self.last_arrival_us.swap(now, Ordering::Relaxed);
        if last == 0 {
            return;
        }
        self.record_arrival_gap(now.saturating_sub(last) as f64 / 1e6);
    }

    fn record_arrival_gap(&self, gap_s: f64) {
        let gap_s = match self.arrival_interval_s.read() {
            (_, 0) => gap_s,
            (interval, _) => gap_s.min(QUIET_GAPS * interval.max(MIN_ARRIVAL_INTERVAL_S)),
        };
        self.arrival_interval_s.add(gap_s);
    }

    /// Attention pairs per prefilled token of routed requests, on average (0 before the first).
    pub fn prefill_pairs_per_token(&self) -> f64 {
        let tokens = self.prefill_tokens_average.get();
        if tokens > 0.0 {
            self.prefill_pairs_average.get() / tokens
        } else {
            0.0
        }
    }

    /// A routed prompt came back for blocks a worker freed `ago`.
    pub fn record_reuse(&self, ago: std::time::Duration) {
        self.reuse_gap_ln_s.add(ago.as_secs_f64().max(1e-6).ln());
    }

    /// How long blocks a worker freed stay wanted: [`REUSE_HORIZON_FACTOR`] times the typical
    /// time (geometric mean) before the pool's prompts came back for freed blocks; `None`
    /// until one has.
    pub fn reuse_horizon(&self) -> Option<std::time::Duration> {
        let (ln_s, count) = self.reuse_gap_ln_s.read();
        let seconds = REUSE_HORIZON_FACTOR * ln_s.exp();
        (count > 0 && seconds.is_finite())
            .then(|| std::time::Duration::from_secs_f64(seconds.min(600.0)))
    }

    pub fn record_prefill(&self, work: crate::calibration::PrefillWork) {
        self.prefill_tokens_average.add(work.tokens);
        self.prefill_pairs_average.add(work.pairs);
    }
}

/// Arrival rates are read as at most one request per this many seconds apart (10,000 a second).
const MIN_ARRIVAL_INTERVAL_S: f64 = 1e-4;
/// A gap between arrivals counts for at most this many average gaps.
const QUIET_GAPS: f64 = 10.0;

/// Freed blocks count as wanted for this many times the typical time before prompts came back
/// for them: most of those that come back do within it (times spread about their geometric
/// mean), and blocks freed longer ago are the first a worker evicts anyway.
pub const REUSE_HORIZON_FACTOR: f64 = 4.0;

/// A running average shared between threads: the plain mean of its first
/// [`RunningAverage::WINDOW`] values, then an exponential average with weight 1 / `WINDOW`. The
/// first value alone (one gap between two requests that happened to arrive together) would
/// otherwise stand for the whole average until a dozen more have worn it down.
#[derive(Debug, Default)]
pub struct RunningAverage {
    /// The average and how many values it has seen, updated together.
    state: Mutex<(f64, u64)>,
}

impl RunningAverage {
    /// Values after which the average is exponential (α = 0.1).
    pub const WINDOW: u64 = 10;

    pub fn add(&self, value: f64) {
        if !value.is_finite() {
            return;
        }
        let mut state = lock(&self.state);
        let (average, count) = &mut *state;
        *count = count.saturating_add(1);
        let weight = 1.0 / (*count).min(Self::WINDOW) as f64;
        *average += weight * (value - *average);
    }

    /// The average (0 before any value).
    pub fn get(&self) -> f64 {
        self.read().0
    }

    /// The average and how many values it has seen.
    pub fn read(&self) -> (f64, u64) {
        *lock(&self.state)
    }
}

/// Pool KV state and tokenizers that outlive snapshots.
#[derive(Default)]
pub struct KvRegistry {
    pools: Mutex<HashMap<PoolId, Arc<PoolKv>>>,
    tokenizers: Mutex<HashMap<Option<Tokenizer>, Arc<PromptTokenizer>>>,
}

impl KvRegistry {
    /// The pool's KV state; a new (empty) one when the block size changed.
    pub fn pool(&self, id: &PoolId, block_size: usize) -> Arc<PoolKv> {
        let mut pools = lock(&self.pools);
        match pools.get(id) {
            Some(existing) if existing.index.block_size() == block_size => existing.clone(),
            _ => {
                let created = Arc::new(PoolKv::new(id.clone(), block_size));
                pools.insert(id.clone(), created.clone());
                created
            }
        }
    }

    /// Pools that still exist; the rest are dropped.
    pub fn retain(&self, live: &[PoolId]) {
        lock(&self.pools).retain(|id, _| live.contains(id));
    }

    pub fn pools(&self) -> Vec<Arc<PoolKv>> {
        lock(&self.pools).values().cloned().collect()
    }

    /// The tokenizer of a pool (`None`: the shipped one), loaded once.
    pub fn tokenizer(
        &self,
        spec: &Option<Tokenizer>,
    ) -> Result<Arc<PromptTokenizer>, TokenizeError> {
        if let Some(existing) = lock(&self.tokenizers).get(spec) {
            return Ok(existing.clone());
        }
        let loaded = Arc::new(match spec {
            None => PromptTokenizer::shipped()?,
            Some(spec) => {
                PromptTokenizer::from_files(spec.path.as_ref(), spec.chat_template.as_ref())?
            }
        });
        lock(&self.tokenizers).insert(spec.clone(), loaded.clone());
        Ok(loaded)
    }
}

/// Microseconds since the first call, plus [`CLOCK_ORIGIN_US`]: a cheap monotonic clock shared
/// by all workers.
pub(crate) fn clock_micros() -> u64 {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let elapsed = EPOCH.get_or_init(std::time::Instant::now).elapsed();
    CLOCK_ORIGIN_US.saturating_add(elapsed.as_micros() as u64)
}

/// Where [`clock_micros`] starts (about 13 days): a moment dated back from it (another
/// replica's prefill, on for longer than this process has run) stays that far back instead of
/// stopping at the process's start.
const CLOCK_ORIGIN_US: u64 = 1 << 40;

/// Time since `started` on [`clock_micros`].
pub(crate) fn elapsed_since(started: u64) -> std::time::Duration {
    std::time::Duration::from_micros(clock_micros().saturating_sub(started))
}

/// What replicas other than this one count against one worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerLedger {
    pub prefills: u64,
    pub prefill_tokens: u64,
    pub in_flight: u64,
    pub kv_blocks: u64,
    /// How long the worker had been on the oldest of those prefills when they were read
    /// (microseconds; the longest of the replicas': the worker works off one queue).
    pub prefill_elapsed_us: u64,
}

impl PeerLedger {
    pub(crate) fn add(&mut self, other: &PeerLedger) {
        self.prefills = self.prefills.saturating_add(other.prefills);
        self.prefill_tokens = self.prefill_tokens.saturating_add(other.prefill_tokens);
        self.in_flight = self.in_flight.saturating_add(other.in_flight);
        self.kv_blocks = self.kv_blocks.saturating_add(other.kv_blocks);
        self.prefill_elapsed_us = self.prefill_elapsed_us.max(other.prefill_elapsed_us);
    }
}

/// The queue of one worker as its metrics report it, split into this proxy's own requests and
/// everyone else's (other gateway replicas, clients calling the worker directly).
///
/// This proxy knows its own requests exactly and at once; the worker's gauges arrive a scrape
/// interval late. So the scorer counts its own requests live, and from a scrape only what they
/// do not explain: `others = reported - own requests at the moment of the scrape`.
#[derive(Debug, Default)]
pub struct WorkerLoad {
    waiting: AtomicU64,
    running: AtomicU64,
    /// This proxy's requests at the worker, and those of them still before their first token
    /// (counted by the `InFlight` and `PendingPrefill` guards of `routing`).
    pub(crate) own_in_flight: AtomicU64,
    pub(crate) own_pending: AtomicU64,
    /// KV blocks this proxy's requests at the worker are expected to hold until they end
    /// (counted by the `KvReservation` guard of `routing`).
    pub(crate) own_kv_blocks: AtomicU64,
    /// Usable KV blocks of the worker (`vllm:cache_config_info`'s `num_gpu_blocks` less vLLM's
    /// null block; 0: not reported), and the last scrape's blocks in use beyond this proxy's
    /// own reservations.
    capacity_blocks: AtomicU64,
    others_kv_blocks: AtomicU64,
    /// Other gateway replicas' ledgers at this worker (`crate::peers`), as last received.
    peers_pending: AtomicU64,
    peers_pending_tokens: AtomicU64,
    peers_in_flight: AtomicU64,
    peers_kv_blocks: AtomicU64,
    /// When the worker started on the oldest of the peers' pending prefills, as of their last
    /// ledgers (microseconds on the worker clock).
    peers_prefill_started_us: AtomicU64,
    /// The last scrape's requests beyond this proxy's own: queued, and being served.
    others_waiting: AtomicU64,
    others_running: AtomicU64,
    kv_usage_bits: AtomicU64,
    /// Milliseconds since the service started at the last good scrape (0: never).
    last_ok_ms: AtomicU64,
    failures: AtomicU64,
}

impl WorkerLoad {
    pub fn waiting(&self) -> u64 {
        self.waiting.load(Ordering::Relaxed)
    }
    pub fn running(&self) -> u64 {
        self.running.load(Ordering::Relaxed)
    }
    /// Requests of others waiting at the worker at the last scrape.
    pub fn others_waiting(&self) -> u64 {
        self.others_waiting.load(Ordering::Relaxed)
    }
    /// Requests of others being served by the worker at the last scrape.
    pub fn others_running(&self) -> u64 {
        self.others_running.load(Ordering::Relaxed)
    }
    /// This proxy's requests at the worker now.
    pub fn own_in_flight(&self) -> u64 {
        self.own_in_flight.load(Ordering::Relaxed)
    }
    /// This proxy's requests at the worker that have not produced a first token yet.
    pub fn own_pending(&self) -> u64 {
        self.own_pending.load(Ordering::Relaxed)
    }
    pub fn kv_usage(&self) -> f64 {
        f64::from_bits(self.kv_usage_bits.load(Ordering::Relaxed))
    }
    /// KV blocks this proxy's requests at the worker hold (or will, once scheduled).
    pub fn own_kv_blocks(&self) -> u64 {
        self.own_kv_blocks.load(Ordering::Relaxed)
    }
    /// What the other replicas count against this worker, as last received.
    pub fn peers(&self) -> PeerLedger {
        PeerLedger {
            prefills: self.peers_pending.load(Ordering::Relaxed),
            prefill_tokens: self.peers_pending_tokens.load(Ordering::Relaxed),
            in_flight: self.peers_in_flight.load(Ordering::Relaxed),
            kv_blocks: self.peers_kv_blocks.load(Ordering::Relaxed),
            prefill_elapsed_us: self.peers_prefill_elapsed().as_micros() as u64,
        }
    }
    pub(crate) fn set_peers(&self, ledger: PeerLedger) {
        self.peers_pending.store(ledger.prefills, Ordering::Relaxed);
        self.peers_pending_tokens
            .store(ledger.prefill_tokens, Ordering::Relaxed);
        self.peers_in_flight
            .store(ledger.in_flight, Ordering::Relaxed);
        self.peers_kv_blocks
            .store(ledger.kv_blocks, Ordering::Relaxed);
        let started = clock_micros().saturating_sub(ledger.prefill_elapsed_us);
        self.peers_prefill_started_us
            .store(started, Ordering::Relaxed);
    }
    /// How long the worker has been on the oldest of the peers' pending prefills: what they
    /// reported, plus the time since (zero when no peer has any pending).
    fn peers_prefill_elapsed(&self) -> std::time::Duration {
        if self.peers_pending.load(Ordering::Relaxed) == 0 {
            return std::time::Duration::ZERO;
        }
        elapsed_since(self.peers_prefill_started_us.load(Ordering::Relaxed))
    }
    /// Requests of this proxy and of the other replicas at the worker, and those of them before
    /// their first token, and their KV blocks: what a scrape of the worker need not explain.
    fn known(&self) -> (u64, u64, u64) {
        let peers = self.peers();
        let in_flight = self.own_in_flight().saturating_add(peers.in_flight);
        let pending = self
            .own_pending()
            .saturating_add(peers.prefills)
            .min(in_flight);
        (
            in_flight,
            pending,
            self.own_kv_blocks().saturating_add(peers.kv_blocks),
        )
    }
    /// Usable KV blocks of the worker as its metrics report them (0: not reported).
    pub fn capacity_blocks(&self) -> u64 {
        self.capacity_blocks.load(Ordering::Relaxed)
    }
    /// KV blocks free for a new request: the worker's usable blocks less others' use at the last
    /// scrape and this proxy's reservations now. `None` when the worker does not report its
    /// cache size. Cached blocks nobody uses count as free, as vLLM counts them (it evicts them
    /// on demand).
    pub fn free_kv_blocks(&self) -> Option<u64> {
        let capacity = self.capacity_blocks.load(Ordering::Relaxed);
        (capacity > 0).then(|| {
            capacity
                .saturating_sub(self.others_kv_blocks.load(Ordering::Relaxed))
                .saturating_sub(self.known().2)
        })
    }
    /// Healthy unless the last three scrapes in a row failed.
    pub fn healthy(&self) -> bool {
        self.failures.load(Ordering::Relaxed) < 3
    }
    pub fn scraped(&self) -> bool {
        self.last_ok_ms.load(Ordering::Relaxed) > 0
    }

    /// Read vLLM's queue gauges from a Prometheus text exposition (summed over label sets).
    pub fn update_from_metrics(&self, text: &str, now_ms: u64) {
        let (mut waiting, mut running, mut usage) = (0.0, 0.0, 0.0f64);
        let mut capacity = 0u64;
        for line in text.lines() {
            if line.starts_with("vllm:cache_config_info{") {
                // An info gauge: the size is a label. vLLM counts its null block in it.
                capacity += label_value(line, "num_gpu_blocks")
                    .and_then(|v| v.parse::<u64>().ok())
                    .map_or(0, |blocks| blocks.saturating_sub(1));
                continue;
            }
            let Some((name, value)) = sample(line) else {
                continue;
            };
            match name {
                "vllm:num_requests_waiting" => waiting += value,
                "vllm:num_requests_running" => running += value,
                "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                    usage = usage.max(value)
                }
                _ => {}
            }
        }
        let (waiting, running) = (waiting.max(0.0) as u64, running.max(0.0) as u64);
        self.waiting.store(waiting, Ordering::Relaxed);
        self.running.store(running, Ordering::Relaxed);
        // Ours (and the other replicas') are waiting or being prefilled (pending) or decoding:
        // what is left is others'.
        let (known_in_flight, known_pending, known_kv_blocks) = self.known();
        let others_waiting = waiting.saturating_sub(known_pending);
        let others = (waiting + running).saturating_sub(known_in_flight);
        self.others_waiting
            .store(others_waiting.min(others), Ordering::Relaxed);
        self.others_running
            .store(others.saturating_sub(others_waiting), Ordering::Relaxed);
        self.kv_usage_bits.store(usage.to_bits(), Ordering::Relaxed);
        self.capacity_blocks.store(capacity, Ordering::Relaxed);
        // Usage is the share of usable blocks referenced by requests (vLLM's
        // `kv_cache_usage_perc`); what this proxy's reservations do not explain is others'.
        let used = (usage.clamp(0.0, 1.0) * capacity as f64).round() as u64;
        self.others_kv_blocks
            .store(used.saturating_sub(known_kv_blocks), Ordering::Relaxed);
        self.last_ok_ms.store(now_ms.max(1), Ordering::Relaxed);
        self.failures.store(0, Ordering::Relaxed);
    }

    pub(crate) fn scrape_failed(&self) {
        self.failures.fetch_add(1, Ordering::Relaxed);
    }
}

/// One line of a Prometheus text exposition as a sample: its metric name and value (`None` for
/// comments and lines whose value is not a number).
pub(crate) fn sample(line: &str) -> Option<(&str, f64)> {
    if line.starts_with('#') {
        return None;
    }
    let (name_and_labels, value) = line.rsplit_once(' ')?;
    let name = name_and_labels.split('{').next().unwrap_or_default();
    Some((name, value.trim().parse().ok()?))
}

/// The value of label `name` in one exposition line (`name="value"`; a label whose name only
/// starts with `name` is another label).
pub(crate) fn label_value<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let labels = line.split_once('{')?.1.rsplit_once('}')?.0;
    let key = format!("{name}=\"");
    let start = labels
        .match_indices(&key)
        .find(|(at, _)| *at == 0 || labels.get(..*at).is_some_and(|p| p.ends_with(',')))
        .map(|(at, _)| at + key.len())?;
    labels.get(start..)?.split_once('"').map(|(value, _)| value)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(hashes: std::ops::Range<u64>) -> Arc<crate::prompt::PromptInfo> {
        Arc::new(crate::prompt::PromptInfo {
            tokens: hashes.clone().count() * 16,
            hashes: hashes.map(switchyard_kv::hash::SequenceHash).collect(),
            unfinished: None,
        })
    }

    #[test]
    fn prompts_in_prefill_are_told_by_every_fourth_block_and_their_last() {
        use switchyard_kv::hash::SequenceHash;
        let predictions = Arc::new(Predictions::default());
        // Two prompts with the same 8-block prefix on worker 0, one of 3 blocks on worker 1.
        let a = predictions.add(WorkerId(0), prompt(0..10), 0);
        let b = predictions.add(WorkerId(0), prompt(0..8), 0);
        let _c = predictions.add(WorkerId(1), prompt(100..103), 0);
        // Routed to a worker known to hold its first 8 blocks: only what follows is told.
        let d = predictions.add(WorkerId(2), prompt(200..212), 8);
        let mut told = predictions.prefilling();
        told.sort();
        let hashes = |h: &[u64]| h.iter().copied().map(SequenceHash).collect::<Vec<_>>();
        assert_eq!(
            told,
            vec![
                (WorkerId(0), hashes(&[0, 3, 7, 9])),
                (WorkerId(1), hashes(&[100, 102])),
                (WorkerId(2), hashes(&[211])),
            ]
        );
        // Past its first token a prompt is the KV events' to tell.
        a.prefilled(true);
        b.prefilled(true);
        drop(d);
        assert_eq!(
            predictions.prefilling(),
            vec![(WorkerId(1), hashes(&[100, 102]))]
        );
        // At most MAX_PEER_HASHES per worker, the shortest prefixes first.
        let _long = predictions.add(WorkerId(1), prompt(1_000..3_000), 0);
        let told = predictions.prefilling();
        let (_, long) = told.iter().find(|(w, _)| *w == WorkerId(1)).unwrap();
        assert_eq!(long.len(), MAX_PEER_HASHES);
        assert_eq!(long.get(..4), Some(&hashes(&[100, 1_000, 102, 1_003])[..]));
    }

    #[test]
    fn a_worker_without_events_is_assumed_to_hold_what_it_prefilled_once_the_request_ends() {
        use switchyard_kv::hash::SequenceHash;
        let kv = KvRegistry::default().pool(&PoolId::new("ns", "p"), 16);
        let (fed, unfed) = (kv.slot("10.0.0.1:8000"), kv.slot("10.0.0.2:8000"));
        let request: Vec<SequenceHash> = (0..12).map(SequenceHash).collect();
        let depths = |kv: &PoolKv| {
            let overlap = kv.overlap(&request);
            (overlap.depth(fed), overlap.depth(unfed))
        };
        // In flight, both are predicted to hold what they were sent.
        let on_fed = kv.predictions.add(fed, prompt(0..10), 0);
        let on_unfed = kv.predictions.add(unfed, prompt(0..8), 0);
        on_unfed.remember(1_000);
        assert_eq!(depths(&kv), (10, 8));
        on_fed.prefilled(true);
        on_unfed.prefilled(true);
        drop((on_fed, on_unfed));
        // After: the fed worker's events (none here) say; the other keeps its prompt.
        assert_eq!(depths(&kv), (0, 8));
        // A request that failed before its first token, or answered with an error, computed
        // nothing.
        let failed = kv.predictions.add(unfed, prompt(0..12), 0);
        failed.remember(1_000);
        drop(failed);
        let refused = kv.predictions.add(unfed, prompt(0..12), 0);
        refused.remember(1_000);
        refused.prefilled(false);
        drop(refused);
        assert_eq!(depths(&kv), (0, 8));
        // A worker that leaves takes its history with it, and a request of it that ends later
        // gives none to the next worker in its slot.
        let late = kv.predictions.add(unfed, prompt(0..12), 0);
        late.remember(1_000);
        late.prefilled(true);
        kv.release("10.0.0.2:8000");
        drop(late);
        assert_eq!(kv.overlap(&request).deepest(), 0);
        assert_eq!(kv.slot("10.0.0.3:8000"), unfed);
        assert_eq!(kv.overlap(&request).deepest(), 0);
    }

    #[test]
    fn the_other_replicas_are_told_of_a_prompt_at_a_worker_without_events_until_and_after_its_end()
    {
        use switchyard_kv::hash::SequenceHash;
        let hashes = |h: &[u64]| h.iter().copied().map(SequenceHash).collect::<Vec<_>>();
        let kv = KvRegistry::default().pool(&PoolId::new("ns", "p"), 16);
        let (fed, unfed) = (kv.slot("10.0.0.1:8000"), kv.slot("10.0.0.2:8000"));
        let told = |kv: &PoolKv| {
            let mut told = kv.predictions.prefilling();
            told.sort_by_key(|(worker, _)| *worker);
            told
        };
        let on_fed = kv.predictions.add(fed, prompt(0..6), 0);
        let on_unfed = kv.predictions.add(unfed, prompt(10..19), 0);
        on_unfed.remember(1_000);
        let unfed_samples = hashes(&[10, 13, 17, 18]);
        assert_eq!(
            told(&kv),
            vec![(fed, hashes(&[0, 3, 5])), (unfed, unfed_samples.clone())]
        );
        // Past the first token a worker's events say where the prompt is; a worker without
        // them says nothing, so this replica goes on telling while the request runs...
        on_fed.prefilled(true);
        on_unfed.prefilled(true);
        assert_eq!(told(&kv), vec![(unfed, unfed_samples.clone())]);
        assert!(kv.predictions.recent_frees().is_empty());
        // ...and tells of its end, by the same samples, with the blocks up to each.
        drop((on_fed, on_unfed));
        assert!(told(&kv).is_empty());
        let ended = kv.predictions.recent_frees();
        let upto: Vec<(usize, SequenceHash)> =
            vec![1, 4, 8, 9].into_iter().zip(unfed_samples).collect();
        assert_eq!(ended.len(), 1);
        let first = ended[0].0;
        assert_eq!((ended[0].1, ended[0].2.to_vec()), (unfed, upto));
        // An error computed nothing: neither told past it nor at its end.
        let refused = kv.predictions.add(unfed, prompt(30..40), 0);
        refused.remember(1_000);
        refused.prefilled(false);
        assert!(told(&kv).is_empty());
        drop(refused);
        assert_eq!(kv.predictions.recent_frees().len(), 1);
        // The newest SHARED_FREES are kept, numbered on; a worker that leaves takes its own.
        for _ in 0..SHARED_FREES + 2 {
            let again = kv.predictions.add(unfed, prompt(10..19), 0);
            again.remember(1_000);
            again.prefilled(true);
        }
        // (Numbered by one count for the process: other tests' ends take numbers too.)
        let numbers: Vec<u64> = kv.predictions.recent_frees().iter().map(|f| f.0).collect();
        assert_eq!(numbers.len(), SHARED_FREES);
        assert!(numbers.windows(2).all(|n| n[0] < n[1]) && numbers[0] > first + 2);
        // A long prompt is told by its first samples only.
        let long = kv.predictions.add(unfed, prompt(1_000..3_000), 0);
        long.remember(1_000);
        long.prefilled(true);
        drop(long);
        let told = kv.predictions.recent_frees();
        let last = &told.last().unwrap().2;
        assert_eq!(last.len(), MAX_END_SAMPLES);
        assert_eq!(last[MAX_END_SAMPLES - 1].0, 4 * (MAX_END_SAMPLES - 1));
        kv.release("10.0.0.2:8000");
        assert!(kv.predictions.recent_frees().is_empty());
    }

    #[test]
    fn a_request_that_ended_by_its_head_is_finished_into_the_history() {
        use switchyard_kv::hash::SequenceHash;
        let kv = KvRegistry::default().pool(&PoolId::new("ns", "p"), 16);
        let worker = kv.slot("10.0.0.1:8000");
        let unfinished = Arc::new(crate::prompt::Unfinished::for_test("a long prompt"));
        let head = Arc::new(crate::prompt::PromptInfo {
            tokens: 32,
            hashes: (0..2).map(SequenceHash).collect(),
            unfinished: Some(unfinished),
        });
        let prediction = kv.predictions.add(worker, head, 0);
        prediction.remember(1_000);
        prediction.prefilled(true);
        let (_, id) = prediction.handle();
        drop(prediction);
        // The head at once; the whole once it is tokenized (by `exchange::finish_prompt`).
        let request: Vec<SequenceHash> = (0..6).map(SequenceHash).collect();
        assert_eq!(kv.overlap(&request).depth(worker), 2);
        assert_eq!(kv.predictions.take_ended_head(id), Some((worker, 1_000)));
        assert_eq!(kv.predictions.take_ended_head(id), None);
    }

    #[test]
    fn another_replicas_samples_place_a_shared_prefix_to_within_a_sample() {
        use switchyard_kv::hash::SequenceHash;
        let kv = KvRegistry::default().pool(&PoolId::new("ns", "p"), 16);
        let sender = Arc::new(Predictions::default());
        let _sent = sender.add(WorkerId(1), prompt(0..10), 0);
        kv.set_peer_prefixes(PeerPrefixes::new(&sender.prefilling()));
        let request = |blocks: std::ops::Range<u64>| -> Vec<SequenceHash> {
            blocks.map(SequenceHash).collect()
        };
        // Sharing 6 of its 10 blocks: sampled at 4.
        let shares_six = [request(0..6), request(50..60)].concat();
        assert_eq!(kv.overlap(&shares_six).depth(WorkerId(1)), 4);
        // Sharing all 10 (the last block is always told), and running past them.
        let longer = request(0..14);
        assert_eq!(kv.overlap(&longer).depth(WorkerId(1)), 10);
        assert_eq!(kv.overlap(&longer).depth(WorkerId(0)), 0);
        // A head that the sample reaches to within a sample counts as held: it is tokenized
        // further (and then placed by what it shares).
        let tokenizer = PromptTokenizer::shipped().unwrap();
        assert!(kv.holds_all(&request(0..7), &tokenizer));
        assert!(!kv.holds_all(&request(0..14), &tokenizer));
        assert!(!kv.holds_all(&request(20..22), &tokenizer));
        // A replica that stops telling (its prompt past its prefill) leaves nothing behind.
        kv.set_peer_prefixes(PeerPrefixes::new(&[]));
        assert_eq!(kv.overlap(&longer).deepest(), 0);
    }

    #[test]
    fn a_tokenizer_verdict_counts_only_for_the_tokenizer_the_pool_has() {
        let kv = PoolKv::new(PoolId::new("default", "p"), 16);
        let (old, new) = (
            PromptTokenizer::shipped().unwrap(),
            PromptTokenizer::shipped().unwrap(),
        );
        kv.use_tokenizer(&old);
        kv.tokenizer_agreement
            .set(ProbeKind::Chat, old.instance(), false);
        assert_eq!(kv.tokenizer_agreement.agrees(ProbeKind::Chat), Some(false));
        assert_eq!(kv.tokenizer_agreement.agrees(ProbeKind::Completions), None);
        // Given another tokenizer: the verdict is gone, and a late one on the old is dropped.
        kv.use_tokenizer(&new);
        assert_eq!(kv.tokenizer_agreement.agrees(ProbeKind::Chat), None);
        kv.tokenizer_agreement
            .set(ProbeKind::Chat, old.instance(), false);
        assert_eq!(kv.tokenizer_agreement.agrees(ProbeKind::Chat), None);
        kv.tokenizer_agreement
            .set(ProbeKind::Chat, new.instance(), true);
        assert_eq!(kv.tokenizer_agreement.agrees(ProbeKind::Chat), Some(true));
        // The same tokenizer again changes nothing.
        kv.use_tokenizer(&new);
        assert_eq!(kv.tokenizer_agreement.agrees(ProbeKind::Chat), Some(true));
    }

    #[test]
    fn metrics_parsing_sums_engines_and_ignores_comments() {
        let load = WorkerLoad::default();
        let text = "# HELP vllm:num_requests_waiting x\n# TYPE vllm:num_requests_waiting gauge\n\
                    vllm:num_requests_waiting{model_name=\"m\",engine=\"0\"} 3.0\n\
                    vllm:num_requests_waiting{model_name=\"m\",engine=\"1\"} 2.0\n\
                    vllm:num_requests_running{model_name=\"m\",engine=\"0\"} 7\n\
                    vllm:kv_cache_usage_perc{model_name=\"m\",engine=\"0\"} 0.25\n\
                    vllm:prefix_cache_hits_total{model_name=\"m\"} 99\n";
        load.update_from_metrics(text, 10);
        assert_eq!(
            (load.waiting(), load.running(), load.kv_usage()),
            (5, 7, 0.25)
        );
        assert_eq!(load.free_kv_blocks(), None);
        // vLLM's cache size (null block included); a quarter in use, 100 of it ours.
        load.own_kv_blocks.fetch_add(100, Ordering::Relaxed);
        let sized = format!(
            "{text}vllm:cache_config_info{{block_size=\"64\",engine=\"0\",num_gpu_blocks_override=\"None\",num_gpu_blocks=\"905\"}} 1.0\n"
        );
        load.update_from_metrics(&sized, 20);
        assert_eq!(load.free_kv_blocks(), Some(904 - 126 - 100));
        assert!(load.healthy() && load.scraped());
        for _ in 0..3 {
            load.scrape_failed();
        }
        assert!(!load.healthy());
    }

    #[test]
    fn a_scrape_counts_for_others_only_what_this_proxy_does_not_explain() {
        let load = WorkerLoad::default();
        let gauges = |waiting: u64, running: u64| {
            format!("vllm:num_requests_waiting {waiting}\nvllm:num_requests_running {running}\n")
        };
        // Three of ours: one still before its first token, two decoding.
        load.own_in_flight.fetch_add(3, Ordering::Relaxed);
        load.own_pending.fetch_add(1, Ordering::Relaxed);
        // The worker sees exactly ours (the pending one being prefilled, so running 3).
        load.update_from_metrics(&gauges(0, 3), 10);
        assert_eq!((load.others_waiting(), load.others_running()), (0, 0));
        // Ours waiting (not yet scheduled), plus two others queued and one other running.
        load.update_from_metrics(&gauges(3, 3), 20);
        assert_eq!((load.others_waiting(), load.others_running()), (2, 1));
        // A scrape that lags behind ours (one not arrived yet) never goes negative.
        load.update_from_metrics(&gauges(0, 1), 30);
        assert_eq!((load.others_waiting(), load.others_running()), (0, 0));
        // Another replica's ledger: two of its requests waiting, one decoding. The same gauges
        // as before now hold nobody else's.
        load.set_peers(PeerLedger {
            prefills: 2,
            prefill_tokens: 4000,
            in_flight: 3,
            ..Default::default()
        });
        load.update_from_metrics(&gauges(3, 3), 40);
        assert_eq!((load.others_waiting(), load.others_running()), (0, 0));
    }

    #[test]
    fn slots_are_reused_after_a_worker_leaves() {
        let pool = PoolKv::new(PoolId::new("default", "p"), 16);
        assert_eq!(pool.slot("a:1"), WorkerId(0));
        assert_eq!(pool.slot("b:1"), WorkerId(1));
        assert_eq!(pool.slot("a:1"), WorkerId(0));
        pool.release("a:1");
        assert_eq!(pool.slot("c:1"), WorkerId(0));
        assert_eq!(pool.slot_count(), 2);
    }

    #[test]
    fn averages_start_as_plain_means_and_a_quiet_spell_counts_as_ten_gaps() {
        let average = RunningAverage::default();
        assert_eq!(average.read(), (0.0, 0));
        // Two requests that arrived together do not stand for the whole average.
        for gap in [0.000_001, 0.5, 0.5, 0.5] {
            average.add(gap);
        }
        let (mean, count) = average.read();
        assert!((mean - 1.500_001 / 4.0).abs() < 1e-12, "{mean}");
        assert_eq!(count, 4);
        // Past the window, each value moves it by a tenth.
        for _ in 0..100 {
            average.add(1.0);
        }
        average.add(2.0);
        assert!((average.get() - 1.1).abs() < 1e-3, "{}", average.get());
        average.add(f64::NAN);
        assert_eq!(average.read().1, 105);

        let pool = PoolKv::new(PoolId::new("default", "p"), 16);
        assert_eq!(pool.arrival_rate(), 0.0);
        for _ in 0..10 {
            pool.record_arrival_gap(0.1);
        }
        // An hour without traffic counts as ten gaps, not as 36,000.
        pool.record_arrival_gap(3600.0);
        assert!((pool.arrival_interval_s.get() - 0.19).abs() < 1e-9);
        pool.record_arrival();
        let rate = pool.arrival_rate();
        assert!(rate > 0.0 && rate <= 1.0 / 0.19 + 1e-9, "{rate}");
        // Other replicas' arrivals add to the rate the scorer reads, never to the exported one.
        pool.set_peer_arrival_rate(4.0);
        assert_eq!(pool.peer_arrival_rate(), 4.0);
        let total = pool.arrival_rate();
        assert!((4.0..=4.0 + 1.0 / 0.19 + 1e-9).contains(&total), "{total}");
        assert!(pool.own_arrival_rate() <= 1.0 / 0.19 + 1e-9);
        pool.set_peer_arrival_rate(f64::NAN);
        assert_eq!(pool.peer_arrival_rate(), 0.0);
    }
}

//! The simulator's KV cache (`switchyard_loadtest::sim::kv_cache::KvCache`) against vLLM's own
//! `BlockPool` (`vllm/v1/core/block_pool.py` from the vLLM wheel, run by
//! `tests/python/vllm_block_pool.py`): the same operations, in the order vLLM's scheduler issues
//! them, must give the same events, cache hits, block ids and free-queue order, op by op.
//!
//! The two hash functions differ (vLLM pickles a tuple into sha256, the simulator hashes the
//! bytes), so both sides name each hash by a label, `<request>:<block index>` of the first
//! request in the script whose block hashes hold it: identical token prefixes get one label.
//!
//! Needs `.venv` and vLLM's sources in `.cache/vllm-0.34.0/`, both made by scripts/test.sh (or
//! `SWITCHYARD_PYTHON` and `VLLM_SRC`).

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::process::{Command, Stdio};

use serde_json::{Value, json};
use switchyard_e2e::{python, workspace_root};
use switchyard_kv::events::{ExternalBlockHash, KvEvent};
use switchyard_loadtest::sim::kv_cache::{BlockId, KvCache};

const BLOCK_SIZE: usize = 4;

/// A script for both sides: a pool, named token sequences and the operations on them.
struct Script {
    num_blocks: usize,
    /// In label order: the names sort as they are listed (serde_json's maps are sorted).
    requests: Vec<(String, Vec<u32>)>,
    /// vLLM's per-request `cache_salt`, for the requests that have one.
    salts: BTreeMap<String, String>,
    ops: Vec<Value>,
}

impl Script {
    fn to_json(&self) -> Value {
        let requests: serde_json::Map<String, Value> = self
            .requests
            .iter()
            .map(|(name, tokens)| (name.clone(), json!(tokens)))
            .collect();
        let order: Vec<&String> = requests.keys().collect();
        let listed: Vec<&String> = self.requests.iter().map(|(name, _)| name).collect();
        assert_eq!(order, listed, "request names must sort in script order");
        json!({
            "num_blocks": self.num_blocks,
            "block_size": BLOCK_SIZE,
            "requests": requests,
            "salts": self.salts,
            "ops": self.ops,
        })
    }
}

/// The simulator's side of a script: applies one op at a time and renders what vLLM's side
/// prints for it.
struct SimReplay {
    cache: KvCache,
    tokens: HashMap<String, Vec<u32>>,
    salts: BTreeMap<String, String>,
    hashes: HashMap<String, Vec<ExternalBlockHash>>,
    labels: HashMap<ExternalBlockHash, String>,
    held: BTreeMap<String, Vec<BlockId>>,
}

impl SimReplay {
    fn new(
        num_blocks: usize,
        requests: &[(String, Vec<u32>)],
        salts: &BTreeMap<String, String>,
    ) -> SimReplay {
        let cache = KvCache::new(num_blocks, BLOCK_SIZE, 0);
        let mut labels = HashMap::new();
        let mut hashes = HashMap::new();
        for (name, tokens) in requests {
            let own = cache.hashes_of_salted(tokens, salts.get(name).map(String::as_str));
            for (index, hash) in own.iter().enumerate() {
                labels
                    .entry(*hash)
                    .or_insert_with(|| format!("{name}:{index}"));
            }
            hashes.insert(name.clone(), own);
        }
        SimReplay {
            cache,
            tokens: requests.iter().cloned().collect(),
            salts: salts.clone(),
            hashes,
            labels,
            held: BTreeMap::new(),
        }
    }

    fn label(&self, hash: ExternalBlockHash) -> String {
        self.labels
            .get(&hash)
            .cloned()
            .unwrap_or_else(|| format!("unknown:{}", hash.0))
    }

    fn render(&self, event: &KvEvent) -> Value {
        match event {
            KvEvent::BlockStored(stored) => json!([
                "stored",
                stored.parent_block_hash.map(|hash| self.label(hash)),
                stored
                    .block_hashes
                    .iter()
                    .map(|hash| self.label(*hash))
                    .collect::<Vec<_>>(),
                stored.token_ids,
                stored.block_size,
                stored.group_idx,
                extra_keys_json(stored.extra_keys.as_ref()),
            ]),
            KvEvent::BlockRemoved(removed) => json!([
                "removed",
                removed
                    .block_hashes
                    .iter()
                    .map(|hash| self.label(*hash))
                    .collect::<Vec<_>>(),
                removed.group_idx,
            ]),
            KvEvent::AllBlocksCleared => json!(["cleared"]),
            KvEvent::Unknown(kind) => json!(["unknown", kind]),
        }
    }

    fn apply(&mut self, op: &Value) -> Value {
        let req = op["req"].as_str().unwrap_or_default().to_owned();
        let number = |key: &str| op[key].as_u64().unwrap_or_else(|| panic!("{op}: {key}")) as usize;
        let mut extra = serde_json::Map::new();
        match op["op"].as_str().unwrap() {
            "touch_hit" => {
                assert!(
                    self.held.get(&req).is_none_or(Vec::is_empty),
                    "touch_hit on {req}, which holds blocks"
                );
                let hashes = &self.hashes[&req];
                let limit = number("max_blocks").min(hashes.len());
                let hit = self.cache.longest_cache_hit(&hashes[..limit]);
                self.cache.touch(&hit);
                extra.insert("hit".into(), json!(hit));
                self.held.insert(req, hit);
            }
            "get_new_blocks" => {
                let n = number("n");
                let blocks = self
                    .cache
                    .get_new_blocks(n)
                    .unwrap_or_else(|| panic!("{op}: only {} free", self.cache.num_free()));
                self.held.entry(req).or_default().extend(blocks);
            }
            "cache_full_blocks" => {
                let blocks = self.held.get(&req).cloned().unwrap_or_default();
                self.cache.cache_full_blocks(
                    &blocks,
                    &self.hashes[&req],
                    &self.tokens[&req],
                    number("num_cached"),
                    number("num_full"),
                    self.salts.get(&req).map(String::as_str),
                );
            }
            "free" => {
                let blocks = self.held.remove(&req).unwrap_or_default();
                self.cache.free_blocks(blocks.iter().rev().copied());
            }
            "reset" => {
                extra.insert("reset".into(), json!(self.cache.reset()));
            }
            other => panic!("unknown op {other}"),
        }
        let events: Vec<Value> = self
            .cache
            .take_events()
            .iter()
            .map(|event| self.render(event))
            .collect();
        let blocks: serde_json::Map<String, Value> = self
            .held
            .iter()
            .filter(|(_, blocks)| !blocks.is_empty())
            .map(|(name, blocks)| (name.clone(), json!(blocks)))
            .collect();
        let mut line = json!({
            "events": events,
            "blocks": blocks,
            "free_queue": self.cache.free_queue(),
            "num_free": self.cache.num_free(),
            "usage": format!("{:.6}", self.cache.usage()),
        });
        line.as_object_mut().unwrap().extend(extra);
        line
    }
}

/// A published `extra_keys` as the Python side prints it: one entry per block, a list or null.
fn extra_keys_json(keys: Option<&rmpv::Value>) -> Value {
    let Some(rmpv::Value::Array(blocks)) = keys else {
        return json!([]);
    };
    Value::Array(
        blocks
            .iter()
            .map(|block| match block {
                rmpv::Value::Array(keys) => Value::Array(
                    keys.iter()
                        .map(|key| match key.as_str() {
                            Some(text) => json!(text),
                            None => json!(key.to_string()),
                        })
                        .collect(),
                ),
                _ => Value::Null,
            })
            .collect(),
    )
}

fn replay_sim(script: &Script) -> Vec<Value> {
    let mut replay = SimReplay::new(script.num_blocks, &script.requests, &script.salts);
    script.ops.iter().map(|op| replay.apply(op)).collect()
}

/// vLLM's outputs, and why they stop short of the script if they do.
fn replay_vllm(script: &Script) -> (Vec<Value>, Option<String>) {
    let mut child = Command::new(python())
        .arg(workspace_root().join("tests/python/vllm_block_pool.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start tests/python/vllm_block_pool.py");
    // The script reads all of stdin before it prints anything.
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.to_json().to_string().as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<Value> = stdout
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .collect();
    let failure = (!output.status.success() || lines.len() != script.ops.len()).then(|| {
        format!(
            "vllm_block_pool.py ({}) printed {} lines for {} ops; the op after the last line was {}\nstderr:\n{}",
            output.status,
            lines.len(),
            script.ops.len(),
            script.ops.get(lines.len()).unwrap_or(&Value::Null),
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (lines, failure)
}

/// Both sides, op by op; the first difference fails with the ops before it and both outputs.
fn assert_same(name: &str, script: &Script) -> Vec<Value> {
    let sim = replay_sim(script);
    let (vllm, failure) = replay_vllm(script);
    for (index, (ours, theirs)) in sim.iter().zip(&vllm).enumerate() {
        if ours == theirs {
            continue;
        }
        let keys = [
            "events",
            "hit",
            "blocks",
            "free_queue",
            "num_free",
            "usage",
            "reset",
        ];
        let differing: Vec<String> = keys
            .into_iter()
            .filter(|key| ours.get(key) != theirs.get(key))
            .map(|key| {
                format!(
                    "  {key}:\n    vLLM:      {}\n    simulator: {}",
                    theirs.get(key).unwrap_or(&Value::Null),
                    ours.get(key).unwrap_or(&Value::Null)
                )
            })
            .collect();
        let recent: Vec<String> = script.ops[index.saturating_sub(8)..index]
            .iter()
            .zip(index.saturating_sub(8)..)
            .map(|(op, at)| format!("  #{at} {op}"))
            .collect();
        let path = std::env::temp_dir().join(format!("vllm_block_pool_{name}.json"));
        let _ = std::fs::write(&path, script.to_json().to_string());
        panic!(
            "{name}: op #{index} {} differs\n{}\nops before it:\n{}\nvLLM:      {theirs}\nsimulator: {ours}\n(script in {}; replay it with `.venv/bin/python tests/python/vllm_block_pool.py < {}`)",
            script.ops[index],
            differing.join("\n"),
            recent.join("\n"),
            path.display(),
            path.display(),
        );
    }
    if let Some(failure) = failure {
        panic!("{name}: {failure}");
    }
    sim
}

/// SplitMix64: the tests crate has no `rand`, and a seed must give the same script everywhere.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

/// A request of the generated workload.
struct Planned {
    name: String,
    prompt_len: usize,
    total_len: usize,
    /// Slots taken ahead of the scheduled tokens (vLLM's `num_lookahead_tokens`, speculative
    /// decoding): blocks that are not full when freed, several per request.
    lookahead: usize,
}

/// A running request, as the scheduler tracks it.
struct Running {
    index: usize,
    /// Tokens computed (cache hits included).
    computed: usize,
    /// Blocks held.
    blocks: usize,
    /// Blocks cached so far (`num_cached_block`).
    cached: usize,
}

/// A random workload, scheduled as vLLM's scheduler would issue block-pool calls: a prefix-cache
/// hit at admission (`touch`, up to the prompt less its last token), then for each scheduled
/// chunk (prefill chunks, then one token per decode step) the blocks it needs (with lookahead
/// slots for some), taken only when that many are free, and the blocks its tokens fill cached;
/// the whole request freed when done, or when preempted to make room for another (it is
/// admitted again later); a prefix-cache reset now and then, refused while blocks are held.
fn generate(seed: u64, target_ops: usize) -> Script {
    let mut rng = Rng(seed);
    let num_blocks = 12 + rng.below(9);
    let capacity = num_blocks - 1;
    // Three families of shared prefixes; requests take a whole-block or a ragged share of one.
    let families: Vec<Vec<u32>> = (0..3)
        .map(|family| {
            (0..16)
                .map(|_| 1000 * (family + 1) + rng.below(40) as u32)
                .collect()
        })
        .collect();
    let mut planned: Vec<Planned> = Vec::new();
    let mut requests: Vec<(String, Vec<u32>)> = Vec::new();
    for index in 0..40 {
        let name = format!("r{index:02}");
        if index > 0 && rng.chance(25) {
            // An identical request: both compute (and cache) the same blocks.
            let twin = index - 1 - rng.below(index.min(3));
            requests.push((name.clone(), requests[twin].1.clone()));
            planned.push(Planned {
                name,
                prompt_len: planned[twin].prompt_len,
                total_len: planned[twin].total_len,
                lookahead: planned[twin].lookahead,
            });
            continue;
        }
        let family = &families[rng.below(families.len())];
        let shared = if rng.chance(70) {
            BLOCK_SIZE * rng.below(5)
        } else {
            rng.below(family.len() + 1)
        };
        let mut tokens: Vec<u32> = family[..shared].to_vec();
        let prompt_len = (shared + rng.below(9)).clamp(1, 20);
        while tokens.len() < prompt_len {
            tokens.push(rng.below(40) as u32);
        }
        tokens.truncate(prompt_len);
        let total_len = prompt_len + 1 + rng.below(8);
        while tokens.len() < total_len {
            tokens.push(5000 + rng.below(40) as u32);
        }
        // Alone, any request fits.
        assert!((total_len + 8).div_ceil(BLOCK_SIZE) <= capacity);
        requests.push((name.clone(), tokens));
        planned.push(Planned {
            name,
            prompt_len,
            total_len,
            lookahead: [0, 0, 0, 3, 8][rng.below(5)],
        });
    }

    // Some requests carry a cache_salt (a separate stream of choices, so the rest of the
    // workload is as it was): salted twins share blocks, salted and unsalted ones never do.
    let mut salt_rng = Rng(seed ^ 0x5a17_5a17);
    let salts: BTreeMap<String, String> = requests
        .iter()
        .filter_map(|(name, _)| match salt_rng.below(10) {
            0 | 1 => Some((name.clone(), "tenant-x".to_owned())),
            2 => Some((name.clone(), "tenant-y".to_owned())),
            _ => None,
        })
        .collect();
    let mut issuer = Issuer {
        pool: SimReplay::new(num_blocks, &requests, &salts),
        ops: Vec::new(),
    };
    let mut waiting: std::collections::VecDeque<usize> = (0..planned.len()).collect();
    let mut running: Vec<Running> = Vec::new();
    // Tokens known of each request (its prompt, then what it decoded before a preemption).
    let mut known: Vec<usize> = planned.iter().map(|p| p.prompt_len).collect();
    let mut draining = false;
    for _ in 0..100 * target_ops {
        if issuer.ops.len() >= target_ops || (waiting.is_empty() && running.is_empty()) {
            break;
        }
        // A prefix-cache reset: done when no block is held, refused (no event) otherwise.
        let idle = running.is_empty() && issuer.pool.cache.num_free() == capacity;
        if rng.chance(if idle { 30 } else { 1 }) {
            issuer.push(json!({"op": "reset"}));
            continue;
        }
        // Now and then no request is admitted until the running ones are done: the engine idles.
        draining = (draining || rng.chance(2)) && !running.is_empty();
        let admit = !draining && running.len() < 4 && (running.is_empty() || rng.chance(30));
        if admit && let Some(index) = waiting.pop_front() {
            let max_blocks = (known[index] - 1) / BLOCK_SIZE;
            let out = issuer.push(
                json!({"op": "touch_hit", "req": planned[index].name, "max_blocks": max_blocks}),
            );
            let hit = out["hit"].as_array().unwrap().len();
            running.push(Running {
                index,
                computed: hit * BLOCK_SIZE,
                blocks: hit,
                cached: hit,
            });
            continue;
        }
        if running.is_empty() {
            continue;
        }
        let at = rng.below(running.len());
        let (index, computed, blocks, cached) = {
            let r = &running[at];
            (r.index, r.computed, r.blocks, r.cached)
        };
        let plan = &planned[index];
        if rng.chance(3) {
            // Aborted or preempted: back to the front of the queue, computed again later.
            issuer.push(json!({"op": "free", "req": plan.name}));
            running.remove(at);
            known[index] = known[index].max(computed);
            waiting.push_front(index);
            continue;
        }
        let chunk = if computed < plan.prompt_len {
            1 + rng.below((plan.prompt_len - computed).min(12))
        } else {
            1
        };
        let scheduled = computed + chunk;
        let need = (scheduled + plan.lookahead)
            .div_ceil(BLOCK_SIZE)
            .saturating_sub(blocks);
        if need > issuer.pool.cache.num_free() {
            // Not enough free blocks: preempt the last admitted other request, as vLLM does.
            if let Some(victim) = (0..running.len()).rev().find(|&i| i != at) {
                let victim = running.remove(victim);
                let victim_plan = &planned[victim.index];
                issuer.push(json!({"op": "free", "req": victim_plan.name}));
                known[victim.index] = known[victim.index].max(victim.computed);
                waiting.push_front(victim.index);
            }
            continue;
        }
        if need > 0 {
            issuer.push(json!({"op": "get_new_blocks", "req": plan.name, "n": need}));
        }
        let full = scheduled / BLOCK_SIZE;
        if full > cached {
            issuer.push(
                json!({"op": "cache_full_blocks", "req": plan.name, "num_cached": cached, "num_full": full}),
            );
        }
        let r = &mut running[at];
        r.computed = scheduled;
        r.blocks += need;
        r.cached = r.cached.max(full);
        if scheduled == plan.total_len {
            issuer.push(json!({"op": "free", "req": plan.name}));
            running.remove(at);
        }
    }
    // Finish in a random order, then forget everything.
    while !running.is_empty() {
        let r = running.remove(rng.below(running.len()));
        issuer.push(json!({"op": "free", "req": planned[r.index].name}));
    }
    issuer.push(json!({"op": "reset"}));
    Script {
        num_blocks,
        requests,
        salts,
        ops: issuer.ops,
    }
}

/// The ops issued so far, each applied to the simulator as it is issued: the scheduler's
/// choices depend on the pool (free blocks, hits).
struct Issuer {
    pool: SimReplay,
    ops: Vec<Value>,
}

impl Issuer {
    fn push(&mut self, op: Value) -> Value {
        let out = self.pool.apply(&op);
        self.ops.push(op);
        out
    }
}

#[test]
fn random_schedules_match_vllms_block_pool_op_by_op() {
    let (mut removed, mut hits, mut resets, mut duplicates) = (0, 0, 0, 0);
    for seed in 1..=5 {
        let script = generate(seed, 200);
        let outputs = assert_same(&format!("seed{seed}"), &script);
        // The workload must exercise what it is for: evictions, hits, resets and duplicates.
        let mut stored: HashMap<String, usize> = HashMap::new();
        for out in &outputs {
            for event in out["events"].as_array().unwrap() {
                match event[0].as_str().unwrap() {
                    "removed" => removed += 1,
                    "cleared" => resets += 1,
                    "stored" => {
                        for label in event[2].as_array().unwrap() {
                            *stored.entry(label.to_string()).or_default() += 1;
                        }
                    }
                    _ => {}
                }
            }
            if out["hit"].as_array().is_some_and(|hit| !hit.is_empty()) {
                hits += 1;
            }
        }
        duplicates += stored.values().filter(|&&count| count > 1).count();
    }
    assert!(removed > 20, "{removed} evictions");
    assert!(hits > 20, "{hits} cache hits");
    assert!(resets >= 5, "{resets} resets");
    assert!(duplicates > 10, "{duplicates} blocks stored more than once");
}

/// Two identical requests each compute and cache the same two blocks: vLLM does not
/// de-duplicate them, so each copy is stored with its own `BlockStored`, a lookup finds the
/// first copy still cached, and each copy's eviction sends its own `BlockRemoved`.
#[test]
fn identical_blocks_are_stored_and_removed_once_per_copy_like_vllm() {
    let prompt: Vec<u32> = (0..8).collect();
    let script = Script {
        num_blocks: 7,
        requests: vec![
            ("a".into(), prompt.clone()),
            ("b".into(), prompt.clone()),
            ("c".into(), (100..124).collect()),
            ("d".into(), (0..9).collect()),
        ],
        salts: BTreeMap::new(),
        ops: vec![
            json!({"op": "get_new_blocks", "req": "a", "n": 2}),
            json!({"op": "cache_full_blocks", "req": "a", "num_cached": 0, "num_full": 2}),
            json!({"op": "get_new_blocks", "req": "b", "n": 2}),
            json!({"op": "cache_full_blocks", "req": "b", "num_cached": 0, "num_full": 2}),
            json!({"op": "free", "req": "a"}),
            json!({"op": "free", "req": "b"}),
            json!({"op": "get_new_blocks", "req": "c", "n": 3}),
            json!({"op": "touch_hit", "req": "d", "max_blocks": 2}),
            json!({"op": "free", "req": "d"}),
            json!({"op": "get_new_blocks", "req": "c", "n": 3}),
        ],
    };
    let out = assert_same("duplicates", &script);
    let stored = json!([["stored", null, ["a:0", "a:1"], prompt, 4, 0, [null, null]]]);
    assert_eq!(out[1]["events"], stored, "a stores both blocks");
    assert_eq!(
        out[3]["events"], stored,
        "b stores the same two blocks again"
    );
    assert_eq!(out[5]["free_queue"], json!([5, 6, 2, 1, 4, 3]));
    // c takes the unused blocks 5 and 6, then block 2: a's copy of the second block.
    assert_eq!(out[6]["events"], json!([["removed", ["a:1"], 0]]));
    // That hash is still cached in block 4 (b's copy); the first block's first copy is block 1.
    assert_eq!(out[7]["hit"], json!([1, 4]));
    // The other three copies go too, each with its own removal.
    assert_eq!(
        out[9]["events"],
        json!([
            ["removed", ["a:0"], 0],
            ["removed", ["a:1"], 0],
            ["removed", ["a:0"], 0]
        ])
    );
    assert_eq!(out[9]["blocks"]["c"], json!([5, 6, 2, 3, 4, 1]));
}

/// The same prompt under two salts and none: vLLM hashes the salt into the first block only
/// (the chain carries it on), publishes it in that block's extra keys, and a lookup under one
/// salt never finds another's blocks.
#[test]
fn cache_salts_keep_identical_prompts_apart_like_vllm() {
    let prompt: Vec<u32> = (0..12).collect();
    let script = Script {
        num_blocks: 12,
        requests: vec![
            ("a".into(), prompt.clone()),
            ("b".into(), prompt.clone()),
            ("c".into(), prompt.clone()),
            ("d".into(), prompt.clone()),
        ],
        salts: [("a", "x"), ("b", "y"), ("d", "x")]
            .into_iter()
            .map(|(name, salt)| (name.to_owned(), salt.to_owned()))
            .collect(),
        ops: vec![
            json!({"op": "get_new_blocks", "req": "a", "n": 3}),
            json!({"op": "cache_full_blocks", "req": "a", "num_cached": 0, "num_full": 1}),
            json!({"op": "cache_full_blocks", "req": "a", "num_cached": 1, "num_full": 3}),
            json!({"op": "touch_hit", "req": "b", "max_blocks": 3}),
            json!({"op": "touch_hit", "req": "c", "max_blocks": 3}),
            json!({"op": "touch_hit", "req": "d", "max_blocks": 3}),
        ],
    };
    let out = assert_same("salts", &script);
    assert_eq!(
        out[1]["events"],
        json!([["stored", null, ["a:0"], [0, 1, 2, 3], 4, 0, [["x"]]]])
    );
    assert_eq!(
        out[2]["events"],
        json!([[
            "stored",
            "a:0",
            ["a:1", "a:2"],
            [4, 5, 6, 7, 8, 9, 10, 11],
            4,
            0,
            [null, null]
        ]])
    );
    assert_eq!(out[3]["hit"], json!([]), "another salt");
    assert_eq!(out[4]["hit"], json!([]), "no salt");
    assert_eq!(out[5]["hit"], json!([1, 2, 3]), "the same salt");
}

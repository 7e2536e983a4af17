//! Prefix index benchmark: Switchyard's `PrefixIndex` next to dynamo-kv-router's `RadixTree`
//! (single-threaded) and `ConcurrentRadixTreeCompressed` behind its `ThreadPoolIndexer`, on the
//! same seeded data, in one run. Criterion measures lookups; the summary at the end prints
//! ingest rate, lookup latency (prompt hashing included, as on the request path), memory per
//! stored block, and the ratios; then lookup latency while another thread ingests.
//! `INDEX_BENCH_BLOCKS` overrides the 1M stored blocks.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::Criterion;
use dynamo_kv_router::ConcurrentRadixTreeCompressed;
use dynamo_kv_router::indexer::{RadixTree, SyncIndexer, ThreadPoolIndexer};
use switchyard_index_bench::{
    CountingAllocator, Dataset, build_switchyard, dynamo_event, dynamo_request, live_bytes,
    lookup_switchyard,
};
use switchyard_kv::index::Overlap;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

struct Row {
    label: String,
    ours: f64,
    radix: f64,
    concurrent: f64,
}

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// Median microseconds per call of `f` over the prompts, repeated.
fn time_lookups(prompts: &[Vec<u32>], mut f: impl FnMut(&[u32]) -> u32) -> f64 {
    let rounds = 5;
    let samples = (0..rounds)
        .map(|_| {
            let start = Instant::now();
            for prompt in prompts {
                black_box(f(prompt));
            }
            start.elapsed().as_secs_f64() * 1e6 / prompts.len() as f64
        })
        .collect();
    median(samples)
}

fn main() {
    let total_blocks: usize = std::env::var("INDEX_BENCH_BLOCKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut criterion = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    let mut ingest = Vec::new();
    let mut memory = Vec::new();
    let mut lookups = Vec::new();
    let mut disagreements = 0usize;

    // INDEX_BENCH_SECTION=contention runs only the last section.
    let only_contention = std::env::var("INDEX_BENCH_SECTION").is_ok_and(|s| s == "contention");
    let worker_counts: &[usize] = if only_contention { &[] } else { &[3, 32, 256] };
    for &workers in worker_counts {
        let data = Dataset::generate(workers, total_blocks, 42);
        eprintln!(
            "{workers} workers: {} stored blocks in {} events",
            data.stored_blocks,
            data.events.len()
        );

        let before = live_bytes();
        let start = Instant::now();
        let ours = build_switchyard(&data);
        let ours_ingest = data.stored_blocks as f64 / start.elapsed().as_secs_f64();
        let ours_bytes = (live_bytes() - before) as f64 / data.stored_blocks as f64;

        let before = live_bytes();
        let start = Instant::now();
        let mut radix = RadixTree::new();
        for (id, event) in data.events.iter().enumerate() {
            radix.apply_event(dynamo_event(event, id as u64)).unwrap();
        }
        let radix_ingest = data.stored_blocks as f64 / start.elapsed().as_secs_f64();
        let radix_bytes = (live_bytes() - before) as f64 / data.stored_blocks as f64;

        let before = live_bytes();
        let start = Instant::now();
        let pool = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 2, 16);
        for (id, event) in data.events.iter().enumerate() {
            pool.enqueue_event(dynamo_event(event, id as u64)).unwrap();
        }
        runtime.block_on(pool.flush_and_wait()).unwrap();
        let concurrent_ingest = data.stored_blocks as f64 / start.elapsed().as_secs_f64();
        let concurrent_bytes = (live_bytes() - before) as f64 / data.stored_blocks as f64;

        ingest.push(Row {
            label: format!("{workers} workers"),
            ours: ours_ingest,
            radix: radix_ingest,
            concurrent: concurrent_ingest,
        });
        memory.push(Row {
            label: format!("{workers} workers"),
            ours: ours_bytes,
            radix: radix_bytes,
            concurrent: concurrent_bytes,
        });

        let mut overlap = Overlap::default();
        for tokens in [1024usize, 8192, 32768] {
            let prompts = data.lookups(tokens, 64, 7);
            // Same data, same answers: the best match per prompt must agree.
            for prompt in &prompts {
                let ours_best = lookup_switchyard(&ours, workers, prompt, &mut overlap);
                let radix_best = radix
                    .find_matches(dynamo_request(prompt), false)
                    .scores
                    .values()
                    .copied()
                    .max()
                    .unwrap_or(0);
                let concurrent_best = pool
                    .backend()
                    .find_matches(&dynamo_request(prompt), false)
                    .scores
                    .values()
                    .copied()
                    .max()
                    .unwrap_or(0);
                if ours_best != radix_best || ours_best != concurrent_best {
                    disagreements += 1;
                }
            }
            let mut group = criterion.benchmark_group(format!("lookup/{workers}w/{tokens}t"));
            let mut next = 0usize;
            group.bench_function("switchyard", |b| {
                b.iter(|| {
                    next = (next + 1) % prompts.len();
                    lookup_switchyard(&ours, workers, &prompts[next], &mut overlap)
                })
            });
            group.bench_function("dynamo_radix_tree", |b| {
                b.iter(|| {
                    next = (next + 1) % prompts.len();
                    radix
                        .find_matches(dynamo_request(&prompts[next]), false)
                        .scores
                        .len()
                })
            });
            group.bench_function("dynamo_concurrent", |b| {
                b.iter(|| {
                    next = (next + 1) % prompts.len();
                    pool.backend()
                        .find_matches(&dynamo_request(&prompts[next]), false)
                        .scores
                        .len()
                })
            });
            group.finish();
            lookups.push(Row {
                label: format!("{workers} workers, {tokens} tokens"),
                ours: time_lookups(&prompts, |p| {
                    lookup_switchyard(&ours, workers, p, &mut overlap)
                }),
                radix: time_lookups(&prompts, |p| {
                    radix.find_matches(dynamo_request(p), false).scores.len() as u32
                }),
                concurrent: time_lookups(&prompts, |p| {
                    pool.backend()
                        .find_matches(&dynamo_request(p), false)
                        .scores
                        .len() as u32
                }),
            });
        }
        drop(pool);
    }

    println!(
        "\n== prefix index vs dynamo-kv-router 1.6.1 ({total_blocks} stored blocks, block size 16) =="
    );
    println!("\ningest, blocks/s (higher is better; ratio = switchyard / dynamo)");
    println!(
        "{:<28} {:>12} {:>12} {:>12} {:>8} {:>8}",
        "", "switchyard", "radix", "concurrent", "x radix", "x conc"
    );
    for row in &ingest {
        println!(
            "{:<28} {:>12.0} {:>12.0} {:>12.0} {:>8.2} {:>8.2}",
            row.label,
            row.ours,
            row.radix,
            row.concurrent,
            row.ours / row.radix,
            row.ours / row.concurrent
        );
    }
    println!("\nlookup incl. prompt hashing, µs (lower is better; ratio = dynamo / switchyard)");
    println!(
        "{:<28} {:>12} {:>12} {:>12} {:>8} {:>8}",
        "", "switchyard", "radix", "concurrent", "x radix", "x conc"
    );
    for row in &lookups {
        println!(
            "{:<28} {:>12.1} {:>12.1} {:>12.1} {:>8.2} {:>8.2}",
            row.label,
            row.ours,
            row.radix,
            row.concurrent,
            row.radix / row.ours,
            row.concurrent / row.ours
        );
    }
    println!("\nmemory, heap bytes per stored block (lower is better)");
    println!(
        "{:<28} {:>12} {:>12} {:>12}",
        "", "switchyard", "radix", "concurrent"
    );
    for row in &memory {
        println!(
            "{:<28} {:>12.1} {:>12.1} {:>12.1}",
            row.label, row.ours, row.radix, row.concurrent
        );
    }
    println!("\nbest-match disagreements between the indexes: {disagreements}");

    // Lookups while events stream in: one thread applies a fresh 32-worker dataset's events in a
    // loop while this one looks up 8k-token prompts. Shows whether lookups wait behind ingest.
    let data = Dataset::generate(32, total_blocks / 4, 43);
    let prompts = data.lookups(8192, 64, 9);
    println!(
        "\nlookup latency while another thread ingests ({} blocks per pass), 8k-token prompts, µs",
        data.stored_blocks
    );
    println!("{:<28} {:>10} {:>10} {:>10}", "", "p50", "p99", "max");
    let index = std::sync::Arc::new(build_switchyard(&data));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for contended in [false, true] {
        let writer = contended.then(|| {
            let index = index.clone();
            let stop = stop.clone();
            let events: Vec<_> = data
                .events
                .iter()
                .map(|e| (e.worker, e.external.clone(), e.parent, e.tokens.clone()))
                .collect();
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    for (worker, external, parent, tokens) in &events {
                        index.apply(
                            switchyard_kv::index::WorkerId(*worker),
                            &switchyard_kv::events::KvEvent::BlockStored(
                                switchyard_kv::events::BlockStored {
                                    block_hashes: external
                                        .iter()
                                        .map(|h| switchyard_kv::events::ExternalBlockHash(*h))
                                        .collect(),
                                    parent_block_hash: parent
                                        .map(switchyard_kv::events::ExternalBlockHash),
                                    token_ids: tokens.clone(),
                                    block_size: 16,
                                    ..Default::default()
                                },
                            ),
                        );
                    }
                }
            })
        });
        let mut overlap = Overlap::default();
        let mut samples: Vec<f64> = (0..20_000)
            .map(|i| {
                let start = Instant::now();
                black_box(lookup_switchyard(
                    &index,
                    32,
                    &prompts[i % prompts.len()],
                    &mut overlap,
                ));
                start.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(writer) = writer {
            writer.join().unwrap();
        }
        stop.store(false, std::sync::atomic::Ordering::Relaxed);
        samples.sort_by(f64::total_cmp);
        let label = if contended {
            "switchyard, ingest running"
        } else {
            "switchyard, idle"
        };
        println!(
            "{:<28} {:>10.1} {:>10.1} {:>10.1}",
            label,
            samples[samples.len() / 2],
            samples[samples.len() * 99 / 100],
            samples[samples.len() - 1]
        );
    }
    criterion.final_summary();
}

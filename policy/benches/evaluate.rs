//! Policy evaluation on the request path: the shipped example rules (`conf/examples`) against
//! prompts of several sizes, next to classification alone and to a rule set that never reads
//! the prompt. Run: `cargo bench -p switchyard-policy`.
//!
//! Read the ratios printed by criterion side by side: `facts_only` is the floor (integer
//! compares), `classify/*` the cost of reading the text, `examples/*` the whole evaluation.

// A benchmark, like a test, may stop loudly on broken fixtures.
#![allow(clippy::panic, clippy::indexing_slicing)]

use std::collections::BTreeMap;
use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use switchyard_policy::{
    ClassSet, Classifier, Context, Evaluator, PoolState, RequestFacts, Segments,
};
use switchyard_snapshot::PoolId;

struct BenchContext<'a> {
    prompt: Segments<'a>,
    headers: BTreeMap<String, String>,
    state: PoolState,
}

impl Context for BenchContext<'_> {
    fn classes(&mut self, classifier: &Classifier) -> ClassSet {
        classifier.classify(&self.prompt)
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
    fn pool_state(&mut self, _: &PoolId, _: bool) -> Option<PoolState> {
        Some(self.state)
    }
}

/// Seeded, deterministic prose with an occasional number, no personal data.
fn prose(bytes: usize) -> String {
    const WORDS: [&str; 16] = [
        "the", "cache", "router", "sends", "each", "request", "to", "a", "worker", "whose",
        "prefix", "matches", "version", "2024", "queue", "tokens",
    ];
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut out = String::with_capacity(bytes + 16);
    while out.len() < bytes {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.push_str(WORDS[(state % WORDS.len() as u64) as usize]);
        out.push(if state.is_multiple_of(11) { '.' } else { ' ' });
    }
    out
}

fn examples() -> switchyard_snapshot::Snapshot {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../conf/examples");
    match switchyard_snapshot::load_paths(&[dir]) {
        Ok(snapshot) => snapshot,
        Err(errors) => panic!("{errors}"),
    }
}

fn bench(c: &mut Criterion) {
    let snapshot = examples();
    let evaluator = match Evaluator::new(&snapshot) {
        Ok(evaluator) => evaluator,
        Err(error) => panic!("{error}"),
    };
    let facts = RequestFacts {
        tenant: Some("chat-team"),
        model: "assistant",
        stream: false,
        max_tokens: Some(512),
    };
    let idle = PoolState {
        queue_depth: 0,
        running: 2,
        kv_usage_percent: 30,
        predicted_ttft_ms: Some(150),
    };

    let mut group = c.benchmark_group("policy");
    for size in [256usize, 2_048, 16_384] {
        let text = prose(size);
        group.bench_with_input(BenchmarkId::new("classify", size), &text, |b, text| {
            b.iter(|| {
                evaluator.classifier().classify(&Segments {
                    texts: vec![black_box(text.as_str())],
                    user_turns: 1,
                })
            })
        });
        group.bench_with_input(BenchmarkId::new("examples", size), &text, |b, text| {
            b.iter(|| {
                let mut context = BenchContext {
                    prompt: Segments {
                        texts: vec![black_box(text.as_str())],
                        user_turns: 1,
                    },
                    headers: BTreeMap::new(),
                    state: idle,
                };
                let decision = evaluator.evaluate(black_box(&facts), &mut context, None);
                black_box(decision.rule.is_some())
            })
        });
    }
    // A request no class rule looks at: batch header, busy pool, rejected before the prompt.
    let busy = PoolState {
        queue_depth: 9,
        ..idle
    };
    let headers: BTreeMap<String, String> = [("x-priority".to_owned(), "batch".to_owned())]
        .into_iter()
        .collect();
    let batch_facts = RequestFacts {
        tenant: Some("batch-jobs"),
        ..facts
    };
    let long = prose(16_384);
    group.bench_function("reject_before_reading_prompt", |b| {
        b.iter(|| {
            let mut context = BenchContext {
                prompt: Segments {
                    texts: vec![long.as_str()],
                    user_turns: 1,
                },
                headers: headers.clone(),
                state: busy,
            };
            black_box(
                evaluator
                    .evaluate(black_box(&batch_facts), &mut context, None)
                    .rule
                    .is_some(),
            )
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

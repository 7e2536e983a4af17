//! The attempt phase without a network: worker choice, retries on connect failures and broken
//! pooled connections, fallbacks on 5xx, and the guards released at the end.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;

use super::*;
use crate::api::Endpoint;
use crate::config::ConfigStore;
use crate::kv::KvRegistry;
use crate::plan::{self, Request};
use crate::routing::EndpointRegistry;

const CONFIG: &str = r#"
apiVersion: switchyard.dev/v1alpha1
kind: InferencePool
metadata: {name: first}
spec: {model: served-a, endpoints: ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], maxAttempts: 2}
---
apiVersion: switchyard.dev/v1alpha1
kind: InferencePool
metadata: {name: second}
spec: {model: served-b, endpoints: ["127.0.0.1:4"]}
---
apiVersion: switchyard.dev/v1alpha1
kind: InferenceModel
metadata: {name: chain}
spec: {strategy: ordered, targets: [{pool: first}, {pool: second}]}
"#;

fn exchange(metrics: &Metrics) -> Exchange {
    exchange_of(
        metrics,
        Bytes::from_static(br#"{"model":"chain","messages":[{"role":"user","content":"hi"}]}"#),
    )
}

fn table() -> Arc<RoutingTable> {
    let snapshot = switchyard_snapshot::load_str("test", CONFIG).unwrap();
    Arc::new(
        RoutingTable::build(
            Arc::new(snapshot),
            &EndpointRegistry::default(),
            &KvRegistry::default(),
        )
        .unwrap(),
    )
}

fn exchange_of(metrics: &Metrics, body: Bytes) -> Exchange {
    exchange_on(metrics, table(), body)
}

fn exchange_on(metrics: &Metrics, table: Arc<RoutingTable>, body: Bytes) -> Exchange {
    let typed = crate::wire::parse(&body).unwrap();
    let client = ClientRequest {
        endpoint: Endpoint::ChatCompletions,
        parsed: crate::request::summarise(Endpoint::ChatCompletions, &body, &typed).unwrap(),
        body: body.clone(),
    };
    let plan = plan::plan(
        &table,
        &Request {
            client: &client,
            body: &typed,
            headers: &HeaderMap::new(),
            tenant: None,
            explain: false,
            previous: Default::default(),
        },
    )
    .unwrap();
    let series = metrics.request_series(None, "chain", &plan.target.label);
    Exchange::new(table, client, None, plan, false, None, series)
}

fn metrics() -> Metrics {
    Metrics::new(Arc::new(ConfigStore::default()))
}

const TIMEOUT: Duration = Duration::from_secs(1);

#[tokio::test]
async fn connect_failures_try_another_worker_then_the_next_target() {
    let metrics = metrics();
    let mut exchange = exchange(&metrics);
    assert_eq!(exchange.target().label, "pool default/first");
    let first = exchange.next_peer(TIMEOUT).unwrap();
    let pool = exchange.pool().unwrap().clone();
    let in_flight = |pool: &PoolRuntime| pool.workers.iter().map(|w| w.in_flight()).sum::<usize>();
    assert_eq!(in_flight(&pool), 1, "the attempt counts against its worker");
    // maxAttempts 2: one more worker of the pool...
    assert!(exchange.retry_after_connect_failure("ConnectRefused"));
    assert_eq!(exchange.target().label, "pool default/first");
    let second = exchange.next_peer(TIMEOUT).unwrap();
    assert_ne!(first._address, second._address, "another worker");
    assert_eq!(in_flight(&pool), 1, "the failed attempt no longer counts");
    // ...then the next target, prepared before the next attempt, with a fresh attempt and its
    // own body.
    assert!(exchange.retry_after_connect_failure("ConnectRefused"));
    assert!(exchange.advance(&metrics).await);
    assert_eq!(exchange.target().label, "pool default/second");
    assert!(exchange.attempt.tried.is_empty());
    let body: serde_json::Value = serde_json::from_slice(exchange.upstream_body()).unwrap();
    assert_eq!(body["model"], "served-b");
    assert_eq!(
        exchange.last_connect_error.as_deref(),
        Some("ConnectRefused")
    );
    exchange.next_peer(TIMEOUT).unwrap();
    // Nothing is left after the last target.
    assert!(!exchange.retry_after_connect_failure("ConnectRefused"));
    let text = metrics.encode().unwrap();
    assert!(
        text.contains(r#"switchyard_target_fallbacks_total{from="pool default/first",to="pool default/second"} 1"#),
        "{text}"
    );
    exchange.finish();
    assert_eq!(in_flight(&pool), 0);
    assert_eq!(
        in_flight(exchange.pool().unwrap()),
        0,
        "finish releases the worker"
    );
}

/// Choosing a worker and counting the request against it are one step: requests choosing on
/// several threads at the same moment each see the others' choices, so three requests on three
/// idle workers take one each (without the pool's lock, two of them often read the same worker
/// as idle before either counted against it).
#[test]
fn requests_choosing_at_once_see_each_others_choices() {
    let metrics = metrics();
    let table = table();
    let body =
        Bytes::from_static(br#"{"model":"chain","messages":[{"role":"user","content":"hi"}]}"#);
    for round in 0..300 {
        let mut exchanges: Vec<Exchange> = (0..3)
            .map(|_| exchange_on(&metrics, table.clone(), body.clone()))
            .collect();
        let barrier = std::sync::Barrier::new(exchanges.len());
        let mut chosen: Vec<usize> = std::thread::scope(|scope| {
            let handles: Vec<_> = exchanges
                .iter_mut()
                .map(|exchange| {
                    let barrier = &barrier;
                    scope.spawn(move || {
                        barrier.wait();
                        exchange.next_peer(TIMEOUT).unwrap();
                        exchange.attempt.tried[0]
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        chosen.sort_unstable();
        assert_eq!(chosen, [0, 1, 2], "round {round}: one worker each");
        for exchange in &mut exchanges {
            exchange.finish();
        }
    }
}

#[test]
fn a_closed_pooled_connection_is_resent_to_the_same_worker_only_before_an_answer() {
    let metrics = metrics();
    let mut exchange = exchange(&metrics);
    exchange.next_peer(TIMEOUT).unwrap();
    let worker = exchange.attempt.tried.clone();
    // A fresh connection that broke: not retried.
    assert!(!exchange.retry_after_broken_connection(false, false));
    // A reused one before any answer: the same worker again, on a new connection.
    assert!(exchange.retry_after_broken_connection(true, false));
    exchange.next_peer(TIMEOUT).unwrap();
    assert_eq!(exchange.attempt.tried, worker, "no new worker was tried");
    // Never once the answer started.
    assert!(!exchange.retry_after_broken_connection(true, true));
    // At most maxAttempts times.
    assert!(exchange.retry_after_broken_connection(true, false));
    assert!(!exchange.retry_after_broken_connection(true, false));
}

#[test]
fn only_errors_the_upstream_cannot_have_read_are_resent() {
    use pingora_error::{Error, ErrorType, RetryType};
    // A pooled connection the worker had closed, as Pingora's HTTP/1 client marks it: resent
    // only when the connection was a reused one.
    let mut closed = Error::explain(
        ErrorType::ConnectionClosed,
        "while reading response headers",
    );
    closed.retry = RetryType::ReusedOnly;
    assert!(super::resendable(&closed, true));
    assert!(!super::resendable(&closed, false));
    // A read timeout while the worker works, the client gone while it waits: the request may
    // be running, whatever the connection.
    let timeout = Error::explain(ErrorType::ReadTimedout, "while reading response headers");
    assert!(!super::resendable(&timeout, true));
    let gone = Error::explain(ErrorType::ConnectionClosed, "downstream");
    assert!(!super::resendable(&gone, true));
    // A pooled connection that broke while the request was written: it never arrived whole.
    let write = Error::explain(ErrorType::WriteError, "while writing request headers");
    assert!(super::resendable(&write, true));
    assert!(!super::resendable(&write, false));
    // An HTTP/2 stream the upstream refused.
    let mut refused = Error::explain(ErrorType::H2Error, "stream refused");
    refused.retry = RetryType::Decided(true);
    assert!(super::resendable(&refused, false));
}

#[tokio::test]
async fn a_5xx_before_the_first_byte_moves_to_the_next_target_once() {
    let metrics = metrics();
    let mut exchange = exchange(&metrics);
    exchange.next_peer(TIMEOUT).unwrap();
    assert!(!exchange.fall_back_on_status(404), "4xx answers stand");
    assert!(exchange.fall_back_on_status(503));
    assert!(exchange.advance(&metrics).await);
    assert_eq!(exchange.target().label, "pool default/second");
    // The abandoned answer's error is retried once, on the new target.
    assert!(exchange.retry_after_broken_connection(false, true));
    assert!(!exchange.retry_after_broken_connection(false, true));
    exchange.next_peer(TIMEOUT).unwrap();
    assert!(!exchange.fall_back_on_status(503), "no target left");
}

#[tokio::test]
async fn a_large_bodys_fallback_is_prepared_off_the_event_loop_all_the_same() {
    let metrics = metrics();
    let text = "a river ".repeat(4_000);
    let body = format!(r#"{{"model":"chain","messages":[{{"role":"user","content":"{text}"}}]}}"#);
    let mut exchange = exchange_of(&metrics, Bytes::from(body));
    exchange.next_peer(TIMEOUT).unwrap();
    assert!(exchange.fall_back_on_status(502));
    assert!(exchange.advance(&metrics).await);
    assert_eq!(exchange.target().label, "pool default/second");
    let sent: serde_json::Value = serde_json::from_slice(exchange.upstream_body()).unwrap();
    assert_eq!(sent["model"], "served-b");
    assert_eq!(
        sent["messages"][0]["content"].as_str().unwrap().len(),
        text.len()
    );
}

/// A whole answer's head comes with its last token: its prefill counts until the first token
/// the scorer predicted, not while it decodes; a stream's until its first token shows.
#[tokio::test]
async fn a_whole_answers_prefill_counts_until_its_predicted_first_token() {
    let metrics = metrics();
    let table = table();
    // Logprobs of a chat: answered whole by the worker (not assembled from a stream).
    let whole = Bytes::from_static(
        br#"{"model":"chain","messages":[{"role":"user","content":"hi"}],"logprobs":true}"#,
    );
    let mut exchange = exchange_on(&metrics, table.clone(), whole);
    assert!(!exchange.upstream_streams());
    exchange.next_peer(TIMEOUT).unwrap();
    let chosen = exchange.attempt.tried[0];
    let predicted = exchange
        .attempt
        .decision
        .as_ref()
        .and_then(|decision| decision.score(chosen))
        .map(|score| score.predicted_ttft_s)
        .expect("a cache-aware pool scores the attempt");
    let pending = exchange.attempt.pending.as_ref().unwrap();
    assert!(pending.counted(), "counted when sent");
    let waited = std::time::Instant::now();
    while pending.counted() {
        assert!(waited.elapsed() < Duration::from_secs(5), "never released");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(waited.elapsed().as_secs_f64() + 0.001 >= predicted);
    let worker = &exchange.pool().unwrap().workers[chosen];
    assert_eq!(worker.load.own_pending(), 0);
    assert_eq!(worker.in_flight(), 1, "still in flight while it decodes");

    // A stream on the same worker stays counted past that time, until its first token.
    let stream = Bytes::from_static(
        br#"{"model":"chain","messages":[{"role":"user","content":"hi"}],"stream":true}"#,
    );
    let mut streamed = exchange_on(&metrics, table, stream);
    streamed.next_peer(TIMEOUT).unwrap();
    tokio::time::sleep(Duration::from_secs_f64(predicted * 2.0 + 0.05)).await;
    assert!(streamed.attempt.pending.as_ref().unwrap().counted());
    streamed.finish();
    exchange.finish();
}

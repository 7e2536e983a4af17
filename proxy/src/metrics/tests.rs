use super::*;

fn metrics() -> Metrics {
    Metrics::new(Arc::new(ConfigStore::default()))
}

fn text(metrics: &Metrics) -> String {
    metrics.encode().unwrap()
}

fn has(text: &str, line: &str) -> bool {
    text.lines().any(|l| l == line)
}

#[test]
fn counters_with_labels_are_openmetrics_text() {
    let metrics = metrics();
    metrics.policy_decision("default/gateway/batch", "reject");
    metrics.policy_decision("default/gateway/batch", "reject");
    metrics.policy_decision("", "default");
    metrics.fallback("pool default/a", "provider default/\"cloud\"");
    metrics.connection_refused("head_timeout");
    metrics.client_disconnected();
    let open = metrics.connection_opened();
    let text = text(&metrics);
    for line in [
        "# HELP switchyard_policy_decisions Inference-policy decisions by rule (none: no rule decided) and outcome.",
        "# TYPE switchyard_policy_decisions counter",
        "switchyard_policy_decisions_total{rule=\"default/gateway/batch\",outcome=\"reject\"} 2",
        "switchyard_policy_decisions_total{rule=\"none\",outcome=\"default\"} 1",
        "switchyard_target_fallbacks_total{from=\"pool default/a\",to=\"provider default/\\\"cloud\\\"\"} 1",
        "switchyard_connections_refused_total{reason=\"head_timeout\"} 1",
        "switchyard_client_disconnects_total 1",
        "# TYPE switchyard_open_connections gauge",
        "switchyard_open_connections 1",
    ] {
        assert!(has(&text, line), "missing {line}\n{text}");
    }
    assert!(text.ends_with("# EOF\n"), "{text}");
    // Families with no series yet are left out, as the registry does.
    assert!(!text.contains("switchyard_tenant_rejections"), "{text}");
    drop(open);
    assert!(has(
        &metrics.encode().unwrap(),
        "switchyard_open_connections 0"
    ));
}

#[test]
fn a_request_series_counts_by_outcome_and_observes_latency() {
    let metrics = metrics();
    let series = metrics.request_series(Some("team-a"), "chat", "pool default/p");
    assert!(Arc::ptr_eq(
        &series,
        &metrics.request_series(Some("team-a"), "chat", "pool default/p")
    ));
    series.finished(&Finished {
        status: 200,
        usage: Usage {
            prompt_tokens: 7,
            cached_tokens: 4,
            completion_tokens: 3,
            reported: true,
            cached_reported: true,
        },
        ttft: Some(Duration::from_millis(300)),
        total: Duration::from_millis(1200),
    });
    series.finished(&Finished {
        status: 502,
        usage: Usage::default(),
        ttft: Some(Duration::from_millis(20)),
        total: Duration::from_millis(40),
    });
    metrics
        .request_series(None, "chat", "provider default/cloud")
        .finished(&Finished {
            status: 0,
            usage: Usage::default(),
            ttft: None,
            total: Duration::from_millis(10),
        });
    let text = text(&metrics);
    let labels = "tenant=\"team-a\",model=\"chat\",target=\"pool default/p\"";
    for line in [
        format!("switchyard_tenant_requests_total{{{labels},outcome=\"success\"}} 1"),
        format!("switchyard_tenant_requests_total{{{labels},outcome=\"upstream_error\"}} 1"),
        format!("switchyard_tenant_prompt_tokens_total{{{labels},outcome=\"success\"}} 7"),
        format!(
            "switchyard_tenant_cached_prompt_tokens_total{{{labels},outcome=\"success\"}} 4"
        ),
        format!("switchyard_tenant_completion_tokens_total{{{labels},outcome=\"success\"}} 3"),
        "switchyard_tenant_requests_total{tenant=\"anonymous\",model=\"chat\",target=\"provider default/cloud\",outcome=\"aborted\"} 1".to_owned(),
        "# TYPE switchyard_tenant_ttft_seconds histogram".to_owned(),
        "# UNIT switchyard_tenant_ttft_seconds seconds".to_owned(),
        // Only the successful answer's first byte is a time to first token.
        "switchyard_tenant_ttft_seconds_count{tenant=\"team-a\",model=\"chat\"} 1".to_owned(),
        "switchyard_tenant_ttft_seconds_sum{tenant=\"team-a\",model=\"chat\"} 0.3".to_owned(),
        "switchyard_tenant_ttft_seconds_bucket{le=\"0.25\",tenant=\"team-a\",model=\"chat\"} 0".to_owned(),
        "switchyard_tenant_ttft_seconds_bucket{le=\"0.5\",tenant=\"team-a\",model=\"chat\"} 1".to_owned(),
        "switchyard_tenant_ttft_seconds_bucket{le=\"+Inf\",tenant=\"team-a\",model=\"chat\"} 1".to_owned(),
        "switchyard_tenant_request_duration_seconds_count{tenant=\"team-a\",model=\"chat\"} 2".to_owned(),
        "switchyard_tenant_request_duration_seconds_bucket{le=\"0.05\",tenant=\"team-a\",model=\"chat\"} 1".to_owned(),
        "switchyard_tenant_request_duration_seconds_bucket{le=\"1.0\",tenant=\"team-a\",model=\"chat\"} 1".to_owned(),
        "switchyard_tenant_request_duration_seconds_bucket{le=\"2.5\",tenant=\"team-a\",model=\"chat\"} 2".to_owned(),
    ] {
        assert!(has(&text, &line), "missing {line}\n{text}");
    }
    // Outcomes that did not happen have no series.
    assert!(!text.contains("outcome=\"client_error\""), "{text}");
}

#[test]
fn rejections_take_model_labels_from_configuration_only() {
    let store = Arc::new(ConfigStore::default());
    let yaml = "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {name: p}\n\
                spec: {model: m, endpoints: [\"127.0.0.1:1\"]}\n---\n\
                apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {name: chat}\n\
                spec: {targets: [{pool: p}]}\n";
    store
        .apply(switchyard_snapshot::load_str("test", yaml).unwrap())
        .unwrap();
    let table = store.current().unwrap();
    let metrics = Metrics::new(store);
    metrics.rejected(&table, Some("team-a"), "chat", "model_not_allowed");
    metrics.rejected(&table, Some("team-a"), "made-up", "model_not_found");
    metrics.rejected_early(None, "unauthenticated");
    let text = text(&metrics);
    for line in [
        "switchyard_tenant_rejections_total{tenant=\"team-a\",model=\"chat\",reason=\"model_not_allowed\"} 1",
        "switchyard_tenant_rejections_total{tenant=\"team-a\",model=\"unknown\",reason=\"model_not_found\"} 1",
        "switchyard_tenant_rejections_total{tenant=\"anonymous\",model=\"unknown\",reason=\"unauthenticated\"} 1",
    ] {
        assert!(has(&text, line), "missing {line}\n{text}");
    }
}

#[test]
fn the_collector_reads_the_live_table_when_scraped() {
    let store = Arc::new(ConfigStore::default());
    let metrics = Metrics::new(store.clone());
    // No table yet: no pools, no worker or version families.
    let empty = text(&metrics);
    assert!(!empty.contains("switchyard_config_version"), "{empty}");
    assert!(!empty.contains("switchyard_kv_index_blocks"), "{empty}");

    let yaml = "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {name: p}\n\
                spec: {model: m, blockSize: 4, endpoints: [\"127.0.0.1:1\", \"127.0.0.1:2\"]}\n";
    store
        .apply(switchyard_snapshot::load_str("test", yaml).unwrap())
        .unwrap();
    let table = store.current().unwrap();
    let pool = table.pools().next().unwrap();
    pool.kv.decisions.cache_hit.fetch_add(3, Ordering::Relaxed);
    pool.kv
        .stream_stats(pool.slots[1])
        .gaps_replayed
        .fetch_add(2, Ordering::Relaxed);
    let text = text(&metrics);
    for line in [
        "# TYPE switchyard_kv_index_blocks gauge",
        "switchyard_kv_index_blocks{pool=\"default/p\"} 0",
        "switchyard_kv_index_prefixes{pool=\"default/p\"} 0",
        "switchyard_kv_assumed_blocks{pool=\"default/p\"} 0",
        "# TYPE switchyard_kv_events_applied counter",
        "switchyard_kv_events_applied_total{pool=\"default/p\"} 0",
        "switchyard_kv_orphan_blocks_total{pool=\"default/p\"} 0",
        "switchyard_kv_malformed_events_total{pool=\"default/p\"} 0",
        "switchyard_kv_event_batches_total{pool=\"default/p\",worker=\"127.0.0.1:1\"} 0",
        "switchyard_kv_event_gaps_replayed_total{pool=\"default/p\",worker=\"127.0.0.1:2\"} 2",
        "switchyard_kv_event_gaps_cleared_total{pool=\"default/p\",worker=\"127.0.0.1:2\"} 0",
        "switchyard_kv_publisher_restarts_total{pool=\"default/p\",worker=\"127.0.0.1:1\"} 0",
        "switchyard_kv_decode_errors_total{pool=\"default/p\",worker=\"127.0.0.1:1\"} 0",
        "switchyard_routing_decisions_total{pool=\"default/p\",outcome=\"cache_hit\"} 3",
        "switchyard_routing_decisions_total{pool=\"default/p\",outcome=\"spread\"} 0",
        "switchyard_worker_requests_waiting{pool=\"default/p\",worker=\"127.0.0.1:1\"} 0",
        "switchyard_worker_requests_running{pool=\"default/p\",worker=\"127.0.0.1:2\"} 0",
        "switchyard_worker_requests_in_flight{pool=\"default/p\",worker=\"127.0.0.1:2\"} 0",
        "# HELP switchyard_config_version Version of the live configuration snapshot.",
        "switchyard_config_version 1",
    ] {
        assert!(has(&text, line), "missing {line}\n{text}");
    }
    assert!(text.ends_with("# EOF\n"), "{text}");
}

#[test]
fn series_past_the_cap_fold_into_tenant_other() {
    let metrics = metrics();
    for tenant in 0..MAX_SERIES {
        let tenant = format!("t{tenant}");
        metrics.request_series(Some(&tenant), "chat", "pool default/p");
        metrics.rejected_early(Some(&tenant), "unauthenticated");
    }
    // Known series keep their labels; a new tenant counts as `other`.
    let known = metrics.request_series(Some("t7"), "chat", "pool default/p");
    assert_eq!(known.tenant, "t7");
    let late = metrics.request_series(Some("late"), "chat", "pool default/p");
    assert_eq!(late.tenant, OTHER);
    assert!(Arc::ptr_eq(
        &late,
        &metrics.request_series(Some("later"), "chat", "pool default/p")
    ));
    late.finished(&Finished {
        status: 200,
        usage: Usage::default(),
        ttft: None,
        total: Duration::from_millis(5),
    });
    metrics.rejected_early(Some("late"), "unauthenticated");
    metrics.rejected_early(Some("later"), "unauthenticated");
    metrics.rejected_early(Some("t7"), "unauthenticated");
    let text = text(&metrics);
    for line in [
        "switchyard_tenant_requests_total{tenant=\"other\",model=\"chat\",target=\"pool default/p\",outcome=\"success\"} 1",
        "switchyard_tenant_rejections_total{tenant=\"other\",model=\"unknown\",reason=\"unauthenticated\"} 2",
        "switchyard_tenant_rejections_total{tenant=\"t7\",model=\"unknown\",reason=\"unauthenticated\"} 2",
    ] {
        assert!(has(&text, line), "missing {line}\n{text}");
    }
    assert!(!text.contains("tenant=\"late"), "{text}");

    for rule in 0..MAX_RULE_LABELS {
        metrics.policy_decision(&format!("default/p/r{rule}"), "route");
    }
    metrics.policy_decision("default/p/late", "route");
    let text = metrics.encode().unwrap();
    assert!(has(
        &text,
        "switchyard_policy_decisions_total{rule=\"other\",outcome=\"route\"} 1"
    ));
}

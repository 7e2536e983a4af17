//! The planner against a configuration with every kind of rule the README documents: aliases,
//! tenants' model lists, prompt classes, policies (route, reject, requireLocal), fallbacks,
//! translations and cache isolation. No process, no socket: a table built from YAML.

use std::sync::Arc;

use bytes::Bytes;
use http::HeaderMap;
use serde_json::Value;
use switchyard_snapshot::snapshot::Tenant;

use super::*;
use crate::kv::KvRegistry;
use crate::routing::EndpointRegistry;

const CONFIG: &str = r#"
apiVersion: switchyard.dev/v1alpha1
kind: InferencePool
metadata: {name: large}
spec: {model: Qwen/Qwen3-27B, endpoints: ["127.0.0.1:8001", "127.0.0.1:8002"], loadBalancing: cache-aware}
---
apiVersion: switchyard.dev/v1alpha1
kind: InferencePool
metadata: {name: small}
spec: {model: Qwen/Qwen3-4B, endpoints: ["127.0.0.1:8011"], anthropicMessages: translate, responsesApi: translate}
---
apiVersion: switchyard.dev/v1alpha1
kind: InferencePool
metadata: {name: empty}
spec: {model: Qwen/Qwen3-4B, selector: {app: empty}, targetPort: 8000}
---
apiVersion: switchyard.dev/v1alpha1
kind: ExternalProvider
metadata: {name: claude}
spec: {baseUrl: "http://127.0.0.1:9/v1", format: anthropic}
---
apiVersion: switchyard.dev/v1alpha1
kind: ExternalProvider
metadata: {name: openai}
spec: {baseUrl: "http://127.0.0.1:9/v1", format: openai}
---
apiVersion: switchyard.dev/v1alpha1
kind: InferenceModel
metadata: {name: assistant}
spec: {targets: [{pool: large}]}
---
apiVersion: switchyard.dev/v1alpha1
kind: InferenceModel
metadata: {name: assistant-small}
spec: {targets: [{pool: small}]}
---
apiVersion: switchyard.dev/v1alpha1
kind: InferenceModel
metadata: {name: chain}
spec: {strategy: ordered, targets: [{pool: empty}, {pool: small}, {provider: openai, model: gpt-4.1-mini}]}
---
apiVersion: switchyard.dev/v1alpha1
kind: InferenceModel
metadata: {name: claude}
spec: {targets: [{provider: claude, model: claude-sonnet-4}]}
---
apiVersion: switchyard.dev/v1alpha1
kind: Tenant
metadata: {name: analytics}
spec: {models: ["assistant*"], cacheIsolation: true}
---
apiVersion: switchyard.dev/v1alpha1
kind: InferencePolicy
metadata: {name: gateway}
spec:
  rules:
    - name: personal-data-stays-local
      match: {promptClasses: {anyOf: [pii]}}
      action: {requireLocal: true}
    - name: batch-rejected
      match: {headers: {x-priority: batch}}
      action: {reject: {status: 429, message: no batch work now, retryAfterSeconds: 30}}
    - name: simple-to-small-model
      match: {models: [assistant], promptClasses: {anyOf: [simple]}}
      action: {route: {inferenceModel: assistant-small}}
"#;

fn table() -> RoutingTable {
    let snapshot = switchyard_snapshot::load_str("test", CONFIG).unwrap();
    RoutingTable::build(
        Arc::new(snapshot),
        &EndpointRegistry::default(),
        &KvRegistry::default(),
    )
    .unwrap()
}

fn client(endpoint: Endpoint, body: &str) -> ClientRequest {
    let body = Bytes::from(body.to_owned());
    ClientRequest {
        endpoint,
        parsed: crate::request::parse(endpoint, &body).unwrap(),
        body,
    }
}

fn chat(model: &str, text: &str) -> ClientRequest {
    client(
        Endpoint::ChatCompletions,
        &format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"{text}"}}]}}"#),
    )
}

/// A prompt of the `complex` class only: long (over 2,000 characters), no personal data.
fn ordinary() -> String {
    "Compare the drainage basins of the Danube and the Rhine, their tributaries, the countries \
     each crosses, and how their navigation rules differ for commercial barges. "
        .repeat(16)
}

fn plan_for(
    table: &RoutingTable,
    client: &ClientRequest,
    headers: &HeaderMap,
    tenant: Option<&Tenant>,
) -> Result<Plan, Box<Rejection>> {
    let body = crate::wire::parse(&client.body).unwrap();
    plan(
        table,
        &Request {
            client,
            body: &body,
            headers,
            tenant,
            explain: true,
            previous: Previous::None,
        },
    )
}

fn body_of(target: &Target) -> Value {
    serde_json::from_slice(&target.body).unwrap()
}

fn tenant<'t>(table: &'t RoutingTable, name: &str) -> &'t Tenant {
    table.snapshot.tenants.get(name).unwrap()
}

#[test]
fn an_alias_resolves_to_its_pool_and_the_served_model() {
    let table = table();
    let plan = plan_for(
        &table,
        &chat("assistant", &ordinary()),
        &HeaderMap::new(),
        None,
    )
    .unwrap();
    assert_eq!(plan.target.label, "pool default/large");
    assert_eq!(plan.target.upstream_model, "Qwen/Qwen3-27B");
    assert_eq!(plan.target.translate, Translation::None);
    assert_eq!(plan.target.upstream_path, None);
    assert_eq!(body_of(&plan.target)["model"], "Qwen/Qwen3-27B");
    assert_eq!(plan.verdict.outcome, "default");
    assert!(plan.fallbacks.is_empty());
    let trace = plan.policy_explain.unwrap();
    assert!(trace.contains("target=pool default/large"), "{trace}");
}

#[test]
fn an_unknown_model_is_404_and_a_model_outside_the_tenants_list_403() {
    let table = table();
    let unknown =
        plan_for(&table, &chat("nope", &ordinary()), &HeaderMap::new(), None).unwrap_err();
    assert_eq!(unknown.error.status(), 404);
    assert_eq!(unknown.reason, "model_not_found");
    let analytics = tenant(&table, "analytics");
    let denied = plan_for(
        &table,
        &chat("claude", &ordinary()),
        &HeaderMap::new(),
        Some(analytics),
    )
    .unwrap_err();
    assert_eq!(denied.error.status(), 403);
    assert_eq!(denied.error.code, "model_not_allowed");
    assert!(
        plan_for(
            &table,
            &chat("assistant", &ordinary()),
            &HeaderMap::new(),
            Some(analytics)
        )
        .is_ok()
    );
}

#[test]
fn a_simple_prompt_is_routed_by_its_class_to_the_small_model() {
    let table = table();
    let plan = plan_for(&table, &chat("assistant", "hi"), &HeaderMap::new(), None).unwrap();
    assert_eq!(plan.target.label, "pool default/small");
    assert_eq!(plan.target.upstream_model, "Qwen/Qwen3-4B");
    assert_eq!(
        plan.rule.as_deref(),
        Some("default/gateway/simple-to-small-model")
    );
    assert_eq!(plan.verdict.outcome, "route");
    assert!(plan.policy_explain.unwrap().contains("classes=simple"));
}

#[test]
fn a_reject_rule_answers_with_its_status_and_is_counted_as_policy() {
    let table = table();
    let mut headers = HeaderMap::new();
    headers.insert("x-priority", "batch".parse().unwrap());
    let rejection = plan_for(&table, &chat("assistant", &ordinary()), &headers, None).unwrap_err();
    assert_eq!(rejection.error.status(), 429);
    assert_eq!(rejection.error.message, "no batch work now");
    assert_eq!(rejection.error.retry_after, Some(30));
    assert_eq!(rejection.reason, "policy");
    assert_eq!(rejection.verdict.unwrap().outcome, "reject");
}

#[test]
fn personal_data_never_goes_to_a_provider() {
    let table = table();
    let pii =
        "My e-mail is jane.doe@example.com, please draft a reply to the landlord for me today.";
    let rejection = plan_for(&table, &chat("claude", pii), &HeaderMap::new(), None).unwrap_err();
    assert_eq!(rejection.error.status(), 503);
    assert_eq!(rejection.error.code, "no_local_target");
    assert_eq!(rejection.reason, "no_local_target");
    // A model with a local pool keeps serving it there.
    let plan = plan_for(&table, &chat("assistant", pii), &HeaderMap::new(), None).unwrap();
    assert!(plan.target.pool().is_some());
}

#[test]
fn an_ordered_chain_skips_an_empty_pool_and_keeps_the_rest_as_fallbacks() {
    let table = table();
    let request = chat("chain", &ordinary());
    let mut plan = plan_for(&table, &request, &HeaderMap::new(), None).unwrap();
    assert_eq!(plan.target.label, "pool default/small");
    let labels: Vec<String> = plan
        .fallbacks
        .iter()
        .map(|t| t.backend.to_string())
        .collect();
    assert_eq!(labels, ["provider default/openai"]);
    let next = next_fallback(&table, &mut plan.fallbacks, &request, None).unwrap();
    assert_eq!(next.label, "provider default/openai");
    assert_eq!(next.upstream_path.as_deref(), Some("/v1/chat/completions"));
    assert_eq!(body_of(&next)["model"], "gpt-4.1-mini");
    assert!(next_fallback(&table, &mut plan.fallbacks, &request, None).is_none());
}

#[test]
fn messages_to_a_translating_pool_become_chat_completions() {
    let table = table();
    let request = client(
        Endpoint::Messages,
        r#"{"model":"assistant-small","max_tokens":64,"system":"Be brief.","messages":[{"role":"user","content":"Name three rivers of Europe and where each one meets the sea."}]}"#,
    );
    let plan = plan_for(&table, &request, &HeaderMap::new(), None).unwrap();
    assert_eq!(plan.target.translate, Translation::MessagesToChat);
    assert_eq!(
        plan.target.upstream_path.as_deref(),
        Some("/v1/chat/completions")
    );
    let body = body_of(&plan.target);
    assert_eq!(body["model"], "Qwen/Qwen3-4B");
    assert_eq!(body["messages"][0]["role"], "system");
}

/// A pool sent Anthropic (or Responses) requests translated is routed by the chat it is sent,
/// not by vLLM's own conversion: Claude Code's billing line, which vLLM's `/v1/messages` drops,
/// stays in the gateway's translation.
#[test]
fn a_translating_pool_is_routed_by_the_chat_it_is_sent() {
    let table = table();
    let pool = table.pool(&PoolId::new("default", "small")).unwrap();
    let anthropic = client(
        Endpoint::Messages,
        r#"{"model":"assistant-small","max_tokens":64,"system":[{"type":"text","text":"x-anthropic-billing-header: cch=3\nBe brief."}],"messages":[{"role":"user","content":"Name three rivers of Europe and where each one meets the sea."}]}"#,
    );
    let body = crate::wire::parse(&anthropic.body).unwrap();
    let routed = analyse_prompt(pool, Endpoint::Messages, &body, None).unwrap();
    let chat = crate::translate_request::messages_to_chat(&body, "").unwrap();
    let chat = crate::wire::parse(&chat).unwrap();
    let sent = analyse_prompt(pool, Endpoint::ChatCompletions, &chat, None).unwrap();
    assert_eq!(routed.hashes, sent.hashes);
    let tokenizer = pool.tokenizer.as_ref().unwrap();
    let (messages, inputs) = crate::prompt::anthropic_chat_of(tokenizer, &body).unwrap();
    let native = tokenizer.render_chat_with(&messages, &inputs).unwrap();
    assert_ne!(routed.tokens, tokenizer.encode(&native).unwrap().len());

    let responses = client(
        Endpoint::Responses,
        r#"{"model":"assistant-small","instructions":"Be brief.","input":[{"role":"user","content":"Name three rivers of Europe and where each one meets the sea."}]}"#,
    );
    let mut body = crate::wire::parse(&responses.body).unwrap();
    body.is_responses = true;
    let routed = analyse_prompt(pool, Endpoint::Responses, &body, None).unwrap();
    let chat = crate::translate_responses::responses_to_chat(&body, "").unwrap();
    let chat = crate::wire::parse(&chat).unwrap();
    let sent = analyse_prompt(pool, Endpoint::ChatCompletions, &chat, None).unwrap();
    assert_eq!(routed.hashes, sent.hashes);
}

#[test]
fn chat_to_an_anthropic_provider_is_translated_and_legacy_completions_refused() {
    let table = table();
    let plan = plan_for(
        &table,
        &chat("claude", &ordinary()),
        &HeaderMap::new(),
        None,
    )
    .unwrap();
    assert_eq!(plan.target.translate, Translation::ChatToMessages);
    assert_eq!(plan.target.upstream_path.as_deref(), Some("/v1/messages"));
    assert_eq!(body_of(&plan.target)["model"], "claude-sonnet-4");
    let legacy = client(
        Endpoint::Completions,
        r#"{"model":"claude","prompt":"Once upon a time"}"#,
    );
    let refused = plan_for(&table, &legacy, &HeaderMap::new(), None).unwrap_err();
    assert_eq!(refused.error.status(), 501);
    assert_eq!(refused.error.code, "translation_unsupported");
}

#[test]
fn an_isolated_tenants_requests_carry_its_cache_salt_to_pools_only() {
    let table = table();
    let analytics = tenant(&table, "analytics");
    let plan = plan_for(
        &table,
        &chat("assistant", &ordinary()),
        &HeaderMap::new(),
        Some(analytics),
    )
    .unwrap();
    let salt = plan.cache_salt.clone().unwrap();
    assert!(salt.starts_with("t:"), "{salt}");
    assert_eq!(body_of(&plan.target)["cache_salt"], salt.as_str());
    // A client's `null` salt does not undo the tenant's (a null after an added field would win).
    let nulled = client(
        Endpoint::ChatCompletions,
        &format!(
            r#"{{"model":"assistant","cache_salt":null,"messages":[{{"role":"user","content":"{}"}}]}}"#,
            ordinary()
        ),
    );
    let plan_of_null = plan_for(&table, &nulled, &HeaderMap::new(), Some(analytics)).unwrap();
    assert_eq!(body_of(&plan_of_null.target)["cache_salt"], salt.as_str());
    // The prompt tokenized for the pool is keyed by that salt: another tenant's cache can't match.
    let pool = plan.target.pool().unwrap();
    let request = chat("assistant", &ordinary());
    let body = crate::wire::parse(&request.body).unwrap();
    let salted = analyse_prompt(pool, request.endpoint, &body, Some(&salt)).unwrap();
    let plain = analyse_prompt(pool, request.endpoint, &body, None).unwrap();
    assert_eq!(salted.tokens, plain.tokens);
    assert_ne!(salted.hashes.first(), plain.hashes.first());
}

#[test]
fn a_streamed_chat_asks_for_usage_and_strips_it_when_the_client_did_not() {
    let table = table();
    let ordinary = ordinary();
    let request = client(
        Endpoint::ChatCompletions,
        &format!(
            r#"{{"model":"assistant","stream":true,"messages":[{{"role":"user","content":"{ordinary}"}}]}}"#
        ),
    );
    let plan = plan_for(&table, &request, &HeaderMap::new(), None).unwrap();
    assert!(plan.target.strip_usage);
    assert_eq!(
        body_of(&plan.target)["stream_options"]["include_usage"],
        true
    );
    let asked = client(
        Endpoint::ChatCompletions,
        &format!(
            r#"{{"model":"assistant","stream":true,"stream_options":{{"include_usage":true}},"messages":[{{"role":"user","content":"{ordinary}"}}]}}"#
        ),
    );
    let plan = plan_for(&table, &asked, &HeaderMap::new(), None).unwrap();
    assert!(!plan.target.strip_usage);
}

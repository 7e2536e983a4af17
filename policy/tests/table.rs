//! A table of policy cases: matching, not matching, rule order, requireLocal, fall-through.
#![allow(clippy::indexing_slicing, clippy::unwrap_used)]

use std::collections::BTreeMap;

use switchyard_policy::{
    ClassSet, Classifier, Context, Evaluator, NoTarget, Outcome, PoolState, RequestFacts, Segments,
    targets,
};
use switchyard_snapshot::PoolId;
use switchyard_snapshot::snapshot::Snapshot;

const CONFIG: &str = r#"
apiVersion: switchyard.dev/v1alpha1
kind: InferencePool
metadata: {name: big}
spec: {model: big-model, endpoints: ["127.0.0.1:1"]}
---
apiVersion: switchyard.dev/v1alpha1
kind: InferencePool
metadata: {name: small}
spec: {model: small-model, endpoints: ["127.0.0.1:2"]}
---
apiVersion: switchyard.dev/v1alpha1
kind: ExternalProvider
metadata: {name: cloud}
spec: {baseUrl: "https://api.example.com/v1", format: openai, models: [cloud-model]}
---
apiVersion: switchyard.dev/v1alpha1
kind: InferenceModel
metadata: {name: chat}
spec: {targets: [{pool: big}]}
---
apiVersion: switchyard.dev/v1alpha1
kind: InferenceModel
metadata: {name: chat-small}
spec: {targets: [{pool: small}]}
---
apiVersion: switchyard.dev/v1alpha1
kind: InferenceModel
metadata: {name: cloud-only}
spec: {targets: [{provider: cloud, model: cloud-model}]}
---
apiVersion: switchyard.dev/v1alpha1
kind: InferenceModel
metadata: {name: mixed}
spec: {strategy: ordered, targets: [{provider: cloud, model: cloud-model}, {pool: big}]}
---
apiVersion: switchyard.dev/v1alpha1
kind: Tenant
metadata: {name: alice, labels: {tier: gold}}
spec: {}
---
apiVersion: switchyard.dev/v1alpha1
kind: Tenant
metadata: {name: bob, labels: {tier: free}}
spec: {}
---
apiVersion: switchyard.dev/v1alpha1
kind: InferencePolicy
metadata: {name: late}
spec:
  priority: 50
  rules:
    - name: free-tier-max-tokens
      match: {tenants: {labels: {tier: free}}, maxTokens: {gt: 1000}}
      action: {reject: {status: 400, message: "free tier: max_tokens up to 1000"}}
    - name: overflow
      match: {models: [chat], poolState: {predictedTtftMs: {gte: 2000}}}
      action: {route: {provider: cloud, model: cloud-model}}
    - name: streams-to-small
      match: {models: ["chat*"], stream: true}
      action: {route: {inferenceModel: chat-small}}
---
apiVersion: switchyard.dev/v1alpha1
kind: InferencePolicy
metadata: {name: early}
spec:
  priority: 1
  classes:
    - {name: secret-project, keywords: [bluebird]}
  rules:
    - name: vip-exempt
      match: {tenants: {names: [alice]}, headers: {x-vip: "*"}}
      action: {fallThrough: true}
    - name: pii-local
      match: {promptClasses: {anyOf: [pii, secret-project]}}
      action: {requireLocal: true}
    - name: batch-quiet
      match: {headers: {x-priority: batch}, poolState: {pool: big, queueDepth: {gt: 4}}}
      action: {reject: {status: 429, message: "busy"}}
    - name: anonymous-blocked
      match: {tenants: {anonymous: true}, models: [cloud-only]}
      action: {reject: {status: 403, message: "sign in to use cloud models"}}
"#;

struct Case {
    name: &'static str,
    tenant: Option<&'static str>,
    model: &'static str,
    stream: bool,
    max_tokens: Option<u64>,
    headers: &'static [(&'static str, &'static str)],
    text: &'static str,
    big_queue: u64,
    big_ttft_ms: u64,
    /// `rule` that decided, or "" for none.
    rule: &'static str,
    /// "default", "route <backend>", "reject <status>", "503-local".
    expect: &'static str,
    require_local: bool,
}

struct TestContext<'a> {
    text: Segments<'a>,
    headers: BTreeMap<String, String>,
    states: BTreeMap<String, PoolState>,
    prompt_reads: usize,
    state_reads: usize,
}

impl Context for TestContext<'_> {
    fn classes(&mut self, classifier: &Classifier) -> ClassSet {
        self.prompt_reads += 1;
        classifier.classify(&self.text)
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
    fn pool_state(&mut self, pool: &PoolId, _: bool) -> Option<PoolState> {
        self.state_reads += 1;
        self.states.get(&pool.0).copied()
    }
}

fn base() -> Case {
    Case {
        name: "",
        tenant: Some("bob"),
        model: "chat",
        stream: false,
        max_tokens: None,
        headers: &[],
        text: "hello there",
        big_queue: 0,
        big_ttft_ms: 100,
        rule: "",
        expect: "default",
        require_local: false,
    }
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "nothing matches: model's own targets",
            ..base()
        },
        Case {
            name: "pii requires local, evaluation continues to the end",
            text: "write to a@b.co",
            rule: "",
            require_local: true,
            ..base()
        },
        Case {
            name: "user class counts like pii",
            text: "status of Bluebird?",
            require_local: true,
            ..base()
        },
        Case {
            name: "overflow to the provider when TTFT is high",
            big_ttft_ms: 2500,
            rule: "default/late/overflow",
            expect: "route provider default/cloud",
            ..base()
        },
        Case {
            name: "boundary: gte 2000 holds at 2000",
            big_ttft_ms: 2000,
            rule: "default/late/overflow",
            expect: "route provider default/cloud",
            ..base()
        },
        Case {
            name: "boundary: 1999 is below",
            big_ttft_ms: 1999,
            ..base()
        },
        Case {
            name: "pii skips the remote overflow and falls to the next rule",
            text: "card 4111 1111 1111 1111",
            big_ttft_ms: 5000,
            stream: true,
            rule: "default/late/streams-to-small",
            expect: "route pool default/small",
            require_local: true,
            ..base()
        },
        Case {
            name: "pii + overflow only: stays on the model's local pool",
            text: "my ssn 123-45-6789",
            big_ttft_ms: 5000,
            require_local: true,
            ..base()
        },
        Case {
            name: "pii to a provider-only model: 503",
            model: "cloud-only",
            text: "a@b.co",
            require_local: true,
            expect: "503-local",
            ..base()
        },
        Case {
            name: "pii to an ordered model: the local fallback is used",
            model: "mixed",
            text: "a@b.co",
            require_local: true,
            expect: "default-local",
            ..base()
        },
        Case {
            name: "batch rejected when the pool is busy",
            headers: &[("x-priority", "batch")],
            big_queue: 5,
            rule: "default/early/batch-quiet",
            expect: "reject 429",
            ..base()
        },
        Case {
            name: "batch admitted on a quiet pool",
            headers: &[("x-priority", "batch")],
            big_queue: 4,
            ..base()
        },
        Case {
            name: "other header value does not match",
            headers: &[("x-priority", "interactive")],
            big_queue: 50,
            ..base()
        },
        Case {
            name: "order: early policy's reject wins over late policy's route",
            headers: &[("x-priority", "batch")],
            big_queue: 9,
            big_ttft_ms: 9000,
            rule: "default/early/batch-quiet",
            expect: "reject 429",
            ..base()
        },
        Case {
            name: "fall-through exempts alice from later rules",
            tenant: Some("alice"),
            headers: &[("x-vip", "1"), ("x-priority", "batch")],
            big_queue: 9,
            rule: "default/early/vip-exempt",
            ..base()
        },
        Case {
            name: "fall-through needs the named tenant",
            tenant: Some("bob"),
            headers: &[("x-vip", "1"), ("x-priority", "batch")],
            big_queue: 9,
            rule: "default/early/batch-quiet",
            expect: "reject 429",
            ..base()
        },
        Case {
            name: "label match: free tier with large max_tokens",
            max_tokens: Some(4000),
            rule: "default/late/free-tier-max-tokens",
            expect: "reject 400",
            ..base()
        },
        Case {
            name: "label mismatch: gold tier not limited",
            tenant: Some("alice"),
            max_tokens: Some(4000),
            ..base()
        },
        Case {
            name: "max_tokens rule needs max_tokens",
            max_tokens: None,
            ..base()
        },
        Case {
            name: "stream rule with glob model",
            model: "chat-small",
            stream: true,
            rule: "default/late/streams-to-small",
            expect: "route pool default/small",
            ..base()
        },
        Case {
            name: "anonymous caller blocked from cloud",
            tenant: None,
            model: "cloud-only",
            rule: "default/early/anonymous-blocked",
            expect: "reject 403",
            ..base()
        },
        Case {
            name: "named tenant not matched by anonymous rule",
            tenant: Some("bob"),
            model: "cloud-only",
            expect: "default-remote",
            ..base()
        },
    ]
}

fn describe(
    snapshot: &Snapshot,
    case: &Case,
    evaluator: &Evaluator,
) -> (String, String, bool, usize) {
    let mut context = TestContext {
        text: Segments {
            texts: vec![case.text],
            user_turns: 1,
        },
        headers: case
            .headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        states: [(
            "default/big".to_owned(),
            PoolState {
                queue_depth: case.big_queue,
                running: 0,
                kv_usage_percent: 0,
                predicted_ttft_ms: Some(case.big_ttft_ms),
            },
        )]
        .into_iter()
        .collect(),
        prompt_reads: 0,
        state_reads: 0,
    };
    let facts = RequestFacts {
        tenant: case.tenant,
        model: case.model,
        stream: case.stream,
        max_tokens: case.max_tokens,
    };
    let decision = evaluator.evaluate(&facts, &mut context, None);
    let rule = decision.rule_name().unwrap_or_default();
    let model = &snapshot.models[case.model];
    let expect = match targets(snapshot, model, &decision) {
        Err(NoTarget::Rejected { status, .. }) => format!("reject {status}"),
        Err(NoTarget::NoLocalTarget { .. }) => "503-local".to_owned(),
        Ok(chosen) => match decision.outcome {
            Outcome::Default
                if chosen.targets.iter().all(|t| t.backend.is_local())
                    && model.targets.iter().any(|t| !t.backend.is_local()) =>
            {
                "default-local".to_owned()
            }
            Outcome::Default if chosen.targets.iter().any(|t| !t.backend.is_local()) => {
                "default-remote".to_owned()
            }
            Outcome::Default => "default".to_owned(),
            _ => format!(
                "route {}",
                chosen
                    .targets
                    .first()
                    .map(|t| t.backend.to_string())
                    .unwrap_or_default()
            ),
        },
    };
    (
        rule,
        expect,
        decision.require_local.is_some(),
        context.prompt_reads,
    )
}

#[test]
fn policy_table() {
    let snapshot = switchyard_snapshot::load_str("table.yaml", CONFIG).unwrap();
    let evaluator = Evaluator::new(&snapshot).unwrap();
    let order: Vec<String> = evaluator
        .rules()
        .iter()
        .map(|r| format!("{}/{}", r.policy, r.name))
        .collect();
    assert_eq!(
        order,
        [
            "default/early/vip-exempt",
            "default/early/pii-local",
            "default/early/batch-quiet",
            "default/early/anonymous-blocked",
            "default/late/free-tier-max-tokens",
            "default/late/overflow",
            "default/late/streams-to-small",
        ],
        "policies run by priority, rules in the order written"
    );
    let mut failures = Vec::new();
    for case in cases() {
        let (rule, expect, require_local, prompt_reads) = describe(&snapshot, &case, &evaluator);
        assert!(
            prompt_reads <= 1,
            "{}: the prompt is classified at most once",
            case.name
        );
        if rule != case.rule || expect != case.expect || require_local != case.require_local {
            failures.push(format!(
                "{}: got rule '{rule}', {expect}, local {require_local}; want '{}', {}, local {}",
                case.name, case.rule, case.expect, case.require_local
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn cheap_conditions_first_and_lazy_facts() {
    let snapshot = switchyard_snapshot::load_str("table.yaml", CONFIG).unwrap();
    let evaluator = Evaluator::new(&snapshot).unwrap();
    // A fall-through before any class or pool rule: neither prompt nor pool state is read.
    let case = Case {
        tenant: Some("alice"),
        headers: &[("x-vip", "yes")],
        ..base()
    };
    let mut context = TestContext {
        text: Segments {
            texts: vec![case.text],
            user_turns: 1,
        },
        headers: case
            .headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        states: BTreeMap::new(),
        prompt_reads: 0,
        state_reads: 0,
    };
    let facts = RequestFacts {
        tenant: case.tenant,
        model: "chat",
        stream: false,
        max_tokens: None,
    };
    let decision = evaluator.evaluate(&facts, &mut context, None);
    assert_eq!(
        decision.rule_name().as_deref(),
        Some("default/early/vip-exempt")
    );
    assert_eq!((context.prompt_reads, context.state_reads), (0, 0));
    assert_eq!(
        evaluator.prediction_pools("chat"),
        [PoolId::new("default", "big")]
    );
    assert!(evaluator.prediction_pools("cloud-only").is_empty());
}

//! The policy evaluator: rules compiled against one snapshot, evaluated per request.
//!
//! Compilation resolves names to indexes so evaluation compares integers: the tenant and the
//! requested model become bit positions, prompt classes a 64-bit set, pool references
//! `PoolId`s. Evaluation allocates nothing unless a trace is asked for.

use std::collections::HashMap;

use switchyard_snapshot::PoolId;
use switchyard_snapshot::compile_policy::range_holds;
use switchyard_snapshot::snapshot::{
    Action, Backend, Model, ModelTarget, PoolStateMatch, Range, RouteTarget, Rule, Snapshot,
    TargetStrategy, glob_match,
};

use crate::classify::{ClassSet, Classifier, ClassifierError};

/// What is known about a request before any rule runs.
#[derive(Debug, Clone, Copy)]
pub struct RequestFacts<'a> {
    /// The authenticated tenant's name; `None` for anonymous requests.
    pub tenant: Option<&'a str>,
    /// The model the client asked for.
    pub model: &'a str,
    pub stream: bool,
    pub max_tokens: Option<u64>,
}

/// Live state of a pool as seen by this proxy (or given to `explain`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolState {
    /// Requests waiting in the workers' queues.
    pub queue_depth: u64,
    pub running: u64,
    pub kv_usage_percent: u64,
    /// Predicted time to first token on the best worker for this prompt.
    pub predicted_ttft_ms: Option<u64>,
}

/// What the evaluator asks for only when a rule needs it.
pub trait Context {
    /// The prompt's classes (asked at most once per evaluation, only when a rule looks at
    /// classes): classify the text with `classifier`, or hand back classes computed earlier
    /// (the proxy classifies large prompts off its event loop).
    fn classes(&mut self, classifier: &Classifier) -> ClassSet;
    /// A request header's value (`name` is lowercase).
    fn header(&self, name: &str) -> Option<&str>;
    /// A pool's live state; `with_prediction` asks for the predicted TTFT as well.
    fn pool_state(&mut self, pool: &PoolId, with_prediction: bool) -> Option<PoolState>;
}

/// The result of evaluating the rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision<'e> {
    pub outcome: Outcome<'e>,
    /// The rule that decided (`None`: no rule did; the model's own targets apply).
    pub rule: Option<&'e Rule>,
    /// A `requireLocal` rule matched: only local pools may serve the request.
    pub require_local: Option<&'e Rule>,
    /// The prompt's classes, when a rule needed them.
    pub classes: Option<ClassSet>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<'e> {
    /// The requested model's own targets.
    Default,
    Route(&'e RouteTarget),
    Reject {
        status: u16,
        message: &'e str,
        retry_after_s: Option<u32>,
    },
}

/// One line of an explanation: a rule and what happened to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceStep {
    pub policy: String,
    pub rule: String,
    pub result: String,
}

struct CompiledRule {
    /// Tenants (by index) the rule applies to; `None`: every tenant.
    tenants: Option<Vec<bool>>,
    anonymous: bool,
    /// Models (by index) the rule applies to; `None`: every model.
    models: Option<Vec<bool>>,
    classes_any: ClassSet,
    classes_none: ClassSet,
    /// `(pool or the model's default pool, conditions)`.
    pool_state: Option<PoolStateMatch>,
    stream: Option<bool>,
    max_tokens: Option<Range>,
    headers: Vec<(String, Option<String>)>,
    /// A route target outside local pools (skipped once local is required).
    routes_remote: bool,
}

/// The rules of one snapshot, ready to evaluate.
pub struct Evaluator {
    rules: Vec<Rule>,
    compiled: Vec<CompiledRule>,
    classifier: Classifier,
    tenant_index: HashMap<String, usize>,
    model_index: HashMap<String, usize>,
    /// For each model (by index), its first pool target: the default pool of `poolState`.
    default_pool: Vec<Option<PoolId>>,
}

impl std::fmt::Debug for Evaluator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Evaluator")
            .field("rules", &self.rules.len())
            .field("classifier", &self.classifier)
            .finish()
    }
}

impl Evaluator {
    /// Compile a snapshot's rules. The snapshot compiler has checked every reference; this fails
    /// only on limits it does not know (more than 64 classes).
    pub fn new(snapshot: &Snapshot) -> Result<Evaluator, ClassifierError> {
        let classifier = Classifier::new(&snapshot.classes, &snapshot.complexity)?;
        let tenant_names: Vec<&String> = snapshot.tenants.keys().collect();
        let tenant_index = tenant_names
            .iter()
            .enumerate()
            .map(|(i, n)| ((*n).clone(), i))
            .collect();
        let model_names: Vec<&String> = snapshot.models.keys().collect();
        let model_index = model_names
            .iter()
            .enumerate()
            .map(|(i, n)| ((*n).clone(), i))
            .collect();
        let default_pool = snapshot
            .models
            .values()
            .map(|m| {
                m.targets.iter().find_map(|t| match &t.backend {
                    Backend::Pool(id) => Some(id.clone()),
                    Backend::Provider(_) => None,
                })
            })
            .collect::<Vec<_>>();
        let mut compiled = Vec::with_capacity(snapshot.rules.len());
        for rule in &snapshot.rules {
            let m = &rule.matches;
            let tenants = m.tenants.as_ref().map(|t| {
                snapshot
                    .tenants
                    .values()
                    .map(|tenant| {
                        let named = t.names.is_empty() || t.names.contains(&tenant.name);
                        let labelled = t
                            .labels
                            .iter()
                            .all(|(k, v)| tenant.labels.get(k) == Some(v));
                        (!t.names.is_empty() || !t.labels.is_empty()) && named && labelled
                    })
                    .collect()
            });
            let anonymous = m.tenants.as_ref().is_none_or(|t| t.anonymous);
            let models = (!m.models.is_empty()).then(|| {
                model_names
                    .iter()
                    .map(|name| m.models.iter().any(|p| glob_match(p, name)))
                    .collect()
            });
            let class_set = |names: &[String]| {
                let mut set = ClassSet::default();
                for name in names {
                    if let Some(id) = classifier.id(name) {
                        set.insert(id);
                    }
                }
                set
            };
            let routes_remote = match &rule.action {
                Action::Route(RouteTarget::Target(target)) => !target.backend.is_local(),
                Action::Route(RouteTarget::Model(name)) => snapshot
                    .models
                    .get(name)
                    .is_some_and(|model| !model.targets.iter().any(|t| t.backend.is_local())),
                _ => false,
            };
            compiled.push(CompiledRule {
                tenants,
                anonymous,
                models,
                classes_any: class_set(&m.classes_any),
                classes_none: class_set(&m.classes_none),
                pool_state: m.pool_state.clone(),
                stream: m.stream,
                max_tokens: m.max_tokens,
                headers: m.headers.clone(),
                routes_remote,
            });
        }
        Ok(Evaluator {
            rules: snapshot.rules.clone(),
            compiled,
            classifier,
            tenant_index,
            model_index,
            default_pool,
        })
    }

    pub fn classifier(&self) -> &Classifier {
        &self.classifier
    }

    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// Does any rule look at prompt classes? (If not, the prompt is never read for policies.)
    pub fn uses_classes(&self) -> bool {
        self.compiled
            .iter()
            .any(|r| r.classes_any.0 != 0 || r.classes_none.0 != 0)
    }

    /// Run the rules in order. `trace` (for `explain` and the debug header) receives a line per
    /// rule looked at; pass `None` on the hot path.
    pub fn evaluate<'e>(
        &'e self,
        facts: &RequestFacts<'_>,
        context: &mut dyn Context,
        mut trace: Option<&mut Vec<TraceStep>>,
    ) -> Decision<'e> {
        let tenant = facts
            .tenant
            .and_then(|name| self.tenant_index.get(name).copied());
        let model = self.model_index.get(facts.model).copied();
        let mut classes: Option<ClassSet> = None;
        let mut require_local: Option<&Rule> = None;
        for (rule, compiled) in self.rules.iter().zip(&self.compiled) {
            let verdict = self.check(compiled, facts, tenant, model, context, &mut classes);
            let mut note = |result: String| {
                if let Some(trace) = trace.as_deref_mut() {
                    trace.push(TraceStep {
                        policy: rule.policy.clone(),
                        rule: rule.name.clone(),
                        result,
                    });
                }
            };
            if let Err(reason) = verdict {
                note(format!("no match: {reason}"));
                continue;
            }
            match &rule.action {
                Action::RequireLocal => {
                    note("matched: requires local pools from here on".to_owned());
                    require_local.get_or_insert(rule);
                }
                Action::Route(target) => {
                    if require_local.is_some() && compiled.routes_remote {
                        note("matched but skipped: its target is not local".to_owned());
                        continue;
                    }
                    note("matched: route".to_owned());
                    return Decision {
                        outcome: Outcome::Route(target),
                        rule: Some(rule),
                        require_local,
                        classes,
                    };
                }
                Action::Reject {
                    status,
                    message,
                    retry_after_s,
                } => {
                    note(format!("matched: reject with {status}"));
                    return Decision {
                        outcome: Outcome::Reject {
                            status: *status,
                            message,
                            retry_after_s: *retry_after_s,
                        },
                        rule: Some(rule),
                        require_local,
                        classes,
                    };
                }
                Action::FallThrough => {
                    note("matched: fall through to the model's own targets".to_owned());
                    return Decision {
                        outcome: Outcome::Default,
                        rule: Some(rule),
                        require_local,
                        classes,
                    };
                }
            }
        }
        Decision {
            outcome: Outcome::Default,
            rule: None,
            require_local,
            classes,
        }
    }

    /// `Ok` when every condition of the rule holds, else the first that does not (cheap
    /// conditions first: the prompt is classified and pool state read only when needed).
    fn check(
        &self,
        rule: &CompiledRule,
        facts: &RequestFacts<'_>,
        tenant: Option<usize>,
        model: Option<usize>,
        context: &mut dyn Context,
        classes: &mut Option<ClassSet>,
    ) -> Result<(), &'static str> {
        match (&rule.tenants, tenant) {
            (None, _) => {}
            (Some(_), None) if rule.anonymous => {}
            (Some(allowed), Some(index)) if allowed.get(index).copied().unwrap_or(false) => {}
            _ => return Err("tenant"),
        }
        if let Some(allowed) = &rule.models
            && !model.is_some_and(|index| allowed.get(index).copied().unwrap_or(false))
        {
            return Err("model");
        }
        if rule.stream.is_some_and(|stream| stream != facts.stream) {
            return Err("stream");
        }
        if let Some(range) = &rule.max_tokens
            && !facts
                .max_tokens
                .is_some_and(|value| range_holds(range, value))
        {
            return Err("max_tokens");
        }
        for (name, expected) in &rule.headers {
            match (context.header(name), expected) {
                (Some(_), None) => {}
                (Some(value), Some(expected)) if value == expected => {}
                _ => return Err("header"),
            }
        }
        if rule.classes_any.0 != 0 || rule.classes_none.0 != 0 {
            let set = match *classes {
                Some(set) => set,
                None => {
                    let set = context.classes(&self.classifier);
                    *classes = Some(set);
                    set
                }
            };
            if rule.classes_any.0 != 0 && !set.intersects(rule.classes_any) {
                return Err("prompt class");
            }
            if set.intersects(rule.classes_none) {
                return Err("prompt class (excluded)");
            }
        }
        if let Some(state_match) = &rule.pool_state {
            let pool = state_match.pool.as_ref().or_else(|| {
                model.and_then(|index| self.default_pool.get(index).and_then(Option::as_ref))
            });
            let Some(pool) = pool else {
                return Err("pool state (the model has no pool)");
            };
            let Some(state) = context.pool_state(pool, state_match.predicted_ttft_ms.is_some())
            else {
                return Err("pool state (unknown)");
            };
            let holds = |range: &Option<Range>, value: Option<u64>| match range {
                None => true,
                Some(range) => value.is_some_and(|v| range_holds(range, v)),
            };
            if !holds(&state_match.queue_depth, Some(state.queue_depth))
                || !holds(&state_match.running, Some(state.running))
                || !holds(&state_match.kv_usage_percent, Some(state.kv_usage_percent))
                || !holds(&state_match.predicted_ttft_ms, state.predicted_ttft_ms)
            {
                return Err("pool state");
            }
        }
        Ok(())
    }
}

impl Evaluator {
    /// Pools whose predicted TTFT a rule may read for a request to `model` (compute the
    /// prompt's overlap for these before evaluating; usually none or one).
    pub fn prediction_pools(&self, model: &str) -> Vec<PoolId> {
        let default = self
            .model_index
            .get(model)
            .and_then(|i| self.default_pool.get(*i))
            .and_then(Option::as_ref);
        let mut pools: Vec<PoolId> = Vec::new();
        for rule in &self.compiled {
            let Some(state) = &rule.pool_state else {
                continue;
            };
            if state.predicted_ttft_ms.is_none() {
                continue;
            }
            if let Some(pool) = state.pool.as_ref().or(default)
                && !pools.contains(pool)
            {
                pools.push(pool.clone());
            }
        }
        pools
    }
}

/// The targets a decision leaves for a request, and how to choose among them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Targets<'a> {
    pub strategy: TargetStrategy,
    pub targets: Vec<&'a ModelTarget>,
}

/// Why a decision leaves no target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoTarget {
    /// A `reject` rule matched.
    Rejected {
        status: u16,
        message: String,
        /// Seconds for `Retry-After`.
        retry_after_s: Option<u32>,
    },
    /// Local hardware is required and none of the targets is local.
    NoLocalTarget { rule: String },
}

impl Decision<'_> {
    /// `namespace/policy/rule` of the deciding rule.
    pub fn rule_name(&self) -> Option<String> {
        self.rule.map(|r| format!("{}/{}", r.policy, r.name))
    }
}

/// Apply a decision to the requested model: the targets it leaves (local ones only when a
/// `requireLocal` rule matched). The proxy and `explain` both resolve targets here.
pub fn targets<'a>(
    snapshot: &'a Snapshot,
    model: &'a Model,
    decision: &Decision<'a>,
) -> Result<Targets<'a>, NoTarget> {
    let mut chosen = match decision.outcome {
        Outcome::Reject {
            status,
            message,
            retry_after_s,
        } => {
            return Err(NoTarget::Rejected {
                status,
                message: message.to_owned(),
                retry_after_s,
            });
        }
        Outcome::Default => Targets {
            strategy: model.strategy,
            targets: model.targets.iter().collect(),
        },
        Outcome::Route(RouteTarget::Model(name)) => {
            let routed = snapshot.models.get(name).unwrap_or(model);
            Targets {
                strategy: routed.strategy,
                targets: routed.targets.iter().collect(),
            }
        }
        Outcome::Route(RouteTarget::Target(target)) => Targets {
            strategy: TargetStrategy::Ordered,
            targets: vec![target],
        },
    };
    if let Some(rule) = decision.require_local {
        chosen.targets.retain(|t| t.backend.is_local());
        if chosen.targets.is_empty() {
            return Err(NoTarget::NoLocalTarget {
                rule: format!("{}/{}", rule.policy, rule.name),
            });
        }
    }
    Ok(chosen)
}

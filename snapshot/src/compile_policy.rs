//! Compiling `Tenant` and `InferencePolicy` documents: references checked, rules put in order.

use std::collections::{BTreeMap, BTreeSet};

use crate::compile::{References, error_at, resolve_target};
use crate::documents::{
    ActionSpec, ClassSpec, Document, InferencePolicySpec, RangeSpec, RuleSpec, Spec, TenantSpec,
};
use crate::error::ConfigError;
use crate::snapshot::{
    Action, BUILTIN_CLASSES, ClassDef, Complexity, Model, PoolStateMatch, Range, RouteTarget, Rule,
    RuleMatch, Tenant, TenantMatch, glob_match,
};

/// Largest compiled size of one user pattern: keeps a hostile or careless regex from costing
/// the request path memory or time (the `regex` crate is linear-time; this bounds the constant).
pub const MAX_PATTERN_BYTES: usize = 1 << 20;

/// Policies without a priority run at this one.
pub const DEFAULT_POLICY_PRIORITY: i32 = 100;

pub(crate) fn compile_tenants(
    documents: &[Document],
    models: &BTreeMap<String, Model>,
    errors: &mut Vec<ConfigError>,
) -> BTreeMap<String, Tenant> {
    let mut tenants = BTreeMap::new();
    let mut sources: BTreeMap<String, &Document> = BTreeMap::new();
    let mut key_owner: BTreeMap<String, String> = BTreeMap::new();
    let mut default_tenant: Option<String> = None;
    for document in documents {
        let Spec::Tenant(spec) = &document.spec else {
            continue;
        };
        let name = document.metadata.name.clone();
        if let Some(first) = sources.get(&name) {
            errors.push(error_at(
                document,
                "metadata.name",
                format!(
                    "tenant '{name}' is already defined in {} (tenant names are global)",
                    first.origin
                ),
            ));
            continue;
        }
        sources.insert(name.clone(), document);
        if let Some(tenant) = compile_tenant(
            document,
            &name,
            spec,
            models,
            &mut key_owner,
            &mut default_tenant,
            errors,
        ) {
            tenants.insert(name, tenant);
        }
    }
    tenants
}

fn compile_tenant(
    document: &Document,
    name: &str,
    spec: &TenantSpec,
    models: &BTreeMap<String, Model>,
    key_owner: &mut BTreeMap<String, String>,
    default_tenant: &mut Option<String>,
    errors: &mut Vec<ConfigError>,
) -> Option<Tenant> {
    let before = errors.len();
    let mut key_sha256 = Vec::new();
    let mut key_secrets = Vec::new();
    for (index, key) in spec.api_keys.iter().enumerate() {
        let field = format!("spec.apiKeys[{index}]");
        match (&key.sha256, &key.secret_ref) {
            (Some(hash), None) => {
                let hash = hash.trim();
                if hash.len() != 64 || !hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
                {
                    errors.push(error_at(
                        document,
                        &format!("{field}.sha256"),
                        "must be 64 lowercase hex digits: the SHA-256 of the key \
                         (printf %s \"$KEY\" | sha256sum), never the key itself"
                            .into(),
                    ));
                    continue;
                }
                if let Some(owner) = key_owner.insert(hash.to_owned(), name.to_owned()) {
                    errors.push(error_at(
                        document,
                        &format!("{field}.sha256"),
                        format!("the same key is already given to tenant '{owner}'"),
                    ));
                    continue;
                }
                key_sha256.push(hash.to_owned());
            }
            (None, Some(secret)) => key_secrets.push(secret.clone()),
            _ => errors.push(error_at(
                document,
                &field,
                "give exactly one of sha256 or secretRef".into(),
            )),
        }
    }
    for (index, pattern) in spec.models.iter().enumerate() {
        let pattern = pattern.trim();
        let field = format!("spec.models[{index}]");
        if pattern.is_empty() {
            errors.push(error_at(document, &field, "must not be empty".into()));
        } else if !models.keys().any(|m| glob_match(pattern, m)) {
            errors.push(error_at(
                document,
                &field,
                format!(
                    "'{pattern}' matches no InferenceModel; models defined: {}",
                    names(models.keys())
                ),
            ));
        }
    }
    let limits = spec.rate_limits.unwrap_or_default();
    for (field, zero) in [
        (
            "spec.rateLimits.requestsPerMinute",
            limits.requests_per_minute == Some(0),
        ),
        (
            "spec.rateLimits.tokensPerMinute",
            limits.tokens_per_minute == Some(0),
        ),
        ("spec.rateLimits.concurrency", limits.concurrency == Some(0)),
    ] {
        if zero {
            errors.push(error_at(
                document,
                field,
                "must be at least 1 (leave it out for no limit)".into(),
            ));
        }
    }
    if spec.default {
        if let Some(first) = default_tenant {
            errors.push(error_at(
                document,
                "spec.default",
                format!("tenant '{first}' is already the default tenant; only one may be"),
            ));
        } else {
            *default_tenant = Some(name.to_owned());
        }
    }
    if errors.len() > before {
        return None;
    }
    Some(Tenant {
        name: name.to_owned(),
        labels: document.metadata.labels.clone(),
        key_sha256,
        key_secrets,
        models: spec.models.iter().map(|m| m.trim().to_owned()).collect(),
        rate_limits: limits,
        default: spec.default,
        cache_isolation: spec.cache_isolation,
    })
}

type Policies = (Vec<Rule>, Vec<ClassDef>, Complexity);

pub(crate) fn compile_policies(
    documents: &[Document],
    refs: &References<'_>,
    models: &BTreeMap<String, Model>,
    tenants: &BTreeMap<String, Tenant>,
    errors: &mut Vec<ConfigError>,
) -> Policies {
    let mut policies: Vec<(&Document, &InferencePolicySpec)> = documents
        .iter()
        .filter_map(|d| match &d.spec {
            Spec::InferencePolicy(spec) => Some((d, spec)),
            _ => None,
        })
        .collect();
    policies.sort_by(|(a, a_spec), (b, b_spec)| {
        let key = |d: &Document, s: &InferencePolicySpec| {
            (
                s.priority.unwrap_or(DEFAULT_POLICY_PRIORITY),
                d.metadata.namespace_or_default().to_owned(),
                d.metadata.name.clone(),
            )
        };
        key(a, a_spec).cmp(&key(b, b_spec))
    });
    let mut seen_policies: BTreeMap<String, &Document> = BTreeMap::new();
    policies.retain(|(document, _)| {
        let id = policy_id(document);
        if let Some(first) = seen_policies.get(&id) {
            errors.push(error_at(
                document,
                "metadata.name",
                format!(
                    "duplicate InferencePolicy {id} (first defined in {})",
                    first.origin
                ),
            ));
            return false;
        }
        seen_policies.insert(id, document);
        true
    });

    let mut classes = Vec::new();
    let mut class_sources: BTreeMap<String, String> = BTreeMap::new();
    let mut complexity: Option<(Complexity, String)> = None;
    for (document, spec) in &policies {
        for (index, class) in spec.classes.iter().enumerate() {
            if let Some(def) = compile_class(document, index, class, &class_sources, errors) {
                class_sources.insert(def.name.clone(), policy_id(document));
                classes.push(def);
            }
        }
        if let Some(tuning) = &spec.complexity {
            if let Some((_, first)) = &complexity {
                errors.push(error_at(
                    document,
                    "spec.complexity",
                    format!("already set by InferencePolicy {first}; set it in one policy only"),
                ));
                continue;
            }
            let defaults = Complexity::default();
            let keywords = tuning
                .complex_keywords
                .clone()
                .unwrap_or(defaults.complex_keywords);
            if keywords.iter().any(|k| k.trim().is_empty()) {
                errors.push(error_at(
                    document,
                    "spec.complexity.complexKeywords",
                    "keywords must not be empty".into(),
                ));
            }
            complexity = Some((
                Complexity {
                    max_simple_chars: tuning.max_simple_chars.unwrap_or(defaults.max_simple_chars),
                    max_simple_turns: tuning.max_simple_turns.unwrap_or(defaults.max_simple_turns),
                    complex_keywords: keywords.iter().map(|k| k.trim().to_lowercase()).collect(),
                },
                policy_id(document),
            ));
        }
    }
    let known_classes: BTreeSet<&str> = BUILTIN_CLASSES
        .iter()
        .copied()
        .chain(classes.iter().map(|c: &ClassDef| c.name.as_str()))
        .collect();

    let mut rules = Vec::new();
    for (document, spec) in &policies {
        let mut rule_names: BTreeSet<&str> = BTreeSet::new();
        for (index, rule) in spec.rules.iter().enumerate() {
            let field = format!("spec.rules[{index}]");
            if !rule_names.insert(rule.name.as_str()) {
                errors.push(error_at(
                    document,
                    &format!("{field}.name"),
                    format!("rule name '{}' is used twice in this policy", rule.name),
                ));
                continue;
            }
            let context = RuleContext {
                document,
                field: &field,
                refs,
                models,
                tenants,
                known_classes: &known_classes,
            };
            if let Some(rule) = context.compile(rule, errors) {
                rules.push(rule);
            }
        }
    }
    (
        rules,
        classes,
        complexity.map(|(c, _)| c).unwrap_or_default(),
    )
}

fn policy_id(document: &Document) -> String {
    format!(
        "{}/{}",
        document.metadata.namespace_or_default(),
        document.metadata.name
    )
}

fn names<'a>(names: impl Iterator<Item = &'a String>) -> String {
    let all: Vec<&str> = names.map(String::as_str).collect();
    if all.is_empty() {
        "none".to_owned()
    } else {
        all.join(", ")
    }
}

/// Class names: lowercase letters, digits, '-', '.' and '_'.
fn valid_class_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'.' | b'_')
        })
}

fn compile_class(
    document: &Document,
    index: usize,
    class: &ClassSpec,
    defined: &BTreeMap<String, String>,
    errors: &mut Vec<ConfigError>,
) -> Option<ClassDef> {
    let field = format!("spec.classes[{index}]");
    let before = errors.len();
    let name = class.name.trim();
    if !valid_class_name(name) {
        errors.push(error_at(
            document,
            &format!("{field}.name"),
            format!("'{name}' is not a valid class name: use lowercase letters, digits, '-', '_' and '.'"),
        ));
    } else if BUILTIN_CLASSES.contains(&name) {
        errors.push(error_at(
            document,
            &format!("{field}.name"),
            format!("'{name}' is a built-in class; choose another name"),
        ));
    } else if let Some(first) = defined.get(name) {
        errors.push(error_at(
            document,
            &format!("{field}.name"),
            format!("class '{name}' is already defined by InferencePolicy {first}"),
        ));
    }
    if class.keywords.is_empty() && class.patterns.is_empty() {
        errors.push(error_at(
            document,
            &field,
            "a class needs keywords or patterns to recognise it".into(),
        ));
    }
    for (k, keyword) in class.keywords.iter().enumerate() {
        if keyword.trim().is_empty() {
            errors.push(error_at(
                document,
                &format!("{field}.keywords[{k}]"),
                "must not be empty".into(),
            ));
        }
    }
    for (p, pattern) in class.patterns.iter().enumerate() {
        if let Err(error) = regex::RegexBuilder::new(pattern)
            .size_limit(MAX_PATTERN_BYTES)
            .build()
        {
            errors.push(error_at(
                document,
                &format!("{field}.patterns[{p}]"),
                format!(
                    "invalid regular expression: {}",
                    one_line(&error.to_string())
                ),
            ));
        }
    }
    if errors.len() > before {
        return None;
    }
    Some(ClassDef {
        name: name.to_owned(),
        keywords: class
            .keywords
            .iter()
            .map(|k| k.trim().to_lowercase())
            .collect(),
        patterns: class.patterns.clone(),
        personal_data: class.personal_data,
    })
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

struct RuleContext<'a> {
    document: &'a Document,
    field: &'a str,
    refs: &'a References<'a>,
    models: &'a BTreeMap<String, Model>,
    tenants: &'a BTreeMap<String, Tenant>,
    known_classes: &'a BTreeSet<&'a str>,
}

impl RuleContext<'_> {
    fn error(&self, suffix: &str, message: String, errors: &mut Vec<ConfigError>) {
        errors.push(error_at(
            self.document,
            &format!("{}{suffix}", self.field),
            message,
        ));
    }

    fn compile(&self, rule: &RuleSpec, errors: &mut Vec<ConfigError>) -> Option<Rule> {
        let before = errors.len();
        let name = rule.name.trim();
        if !valid_class_name(name) {
            self.error(
                ".name",
                format!("'{name}' is not a valid rule name: use lowercase letters, digits, '-', '_' and '.'"),
                errors,
            );
        }
        let matches = self.compile_match(rule, errors);
        let action = self.compile_action(&rule.action, errors);
        if errors.len() > before {
            return None;
        }
        Some(Rule {
            policy: policy_id(self.document),
            name: name.to_owned(),
            matches: matches?,
            action: action?,
        })
    }

    fn compile_match(&self, rule: &RuleSpec, errors: &mut Vec<ConfigError>) -> Option<RuleMatch> {
        let spec = &rule.matches;
        let mut out = RuleMatch::default();
        if let Some(tenants) = &spec.tenants {
            for (index, name) in tenants.names.iter().enumerate() {
                if !self.tenants.contains_key(name.trim()) {
                    self.error(
                        &format!(".match.tenants.names[{index}]"),
                        format!(
                            "no Tenant named '{}'; tenants defined: {}",
                            name.trim(),
                            names(self.tenants.keys())
                        ),
                        errors,
                    );
                }
            }
            if tenants.names.is_empty() && tenants.labels.is_empty() && !tenants.anonymous {
                self.error(
                    ".match.tenants",
                    "give names, labels or anonymous: true (leave tenants out to match everyone)"
                        .into(),
                    errors,
                );
            }
            out.tenants = Some(TenantMatch {
                names: tenants.names.iter().map(|n| n.trim().to_owned()).collect(),
                labels: tenants.labels.clone(),
                anonymous: tenants.anonymous,
            });
        }
        for (index, pattern) in spec.models.iter().enumerate() {
            let pattern = pattern.trim();
            if pattern.is_empty() || !self.models.keys().any(|m| glob_match(pattern, m)) {
                self.error(
                    &format!(".match.models[{index}]"),
                    format!(
                        "'{pattern}' matches no InferenceModel; models defined: {}",
                        names(self.models.keys())
                    ),
                    errors,
                );
            }
            out.models.push(pattern.to_owned());
        }
        if let Some(classes) = &spec.prompt_classes {
            for (list, field, target) in [
                (&classes.any_of, "anyOf", &mut out.classes_any),
                (&classes.none_of, "noneOf", &mut out.classes_none),
            ] {
                for (index, class) in list.iter().enumerate() {
                    let class = class.trim();
                    if !self.known_classes.contains(class) {
                        let known: Vec<&str> = self.known_classes.iter().copied().collect();
                        self.error(
                            &format!(".match.promptClasses.{field}[{index}]"),
                            format!(
                                "unknown prompt class '{class}'; classes: {}",
                                known.join(", ")
                            ),
                            errors,
                        );
                    }
                    target.push(class.to_owned());
                }
            }
            if out.classes_any.is_empty() && out.classes_none.is_empty() {
                self.error(
                    ".match.promptClasses",
                    "give anyOf or noneOf".into(),
                    errors,
                );
            }
        }
        if let Some(state) = &spec.pool_state {
            let pool = match &state.pool {
                Some(name) => {
                    let id =
                        crate::PoolId::new(self.document.metadata.namespace_or_default(), name);
                    if !self.refs.pool_sources.contains_key(&id) {
                        self.error(
                            ".match.poolState.pool",
                            format!("no InferencePool {id}"),
                            errors,
                        );
                    }
                    Some(id)
                }
                None => None,
            };
            let mut ranges = 0;
            for (field, range, max) in [
                ("queueDepth", &state.queue_depth, None),
                ("running", &state.running, None),
                ("kvUsagePercent", &state.kv_usage_percent, Some(100)),
                ("predictedTtftMs", &state.predicted_ttft_ms, None),
            ] {
                if let Some(range) = range {
                    ranges += 1;
                    self.check_range(&format!(".match.poolState.{field}"), range, max, errors);
                }
            }
            if ranges == 0 {
                self.error(
                    ".match.poolState",
                    "give at least one of queueDepth, running, kvUsagePercent, predictedTtftMs"
                        .into(),
                    errors,
                );
            }
            out.pool_state = Some(PoolStateMatch {
                pool,
                queue_depth: state.queue_depth,
                running: state.running,
                kv_usage_percent: state.kv_usage_percent,
                predicted_ttft_ms: state.predicted_ttft_ms,
            });
        }
        out.stream = spec.stream;
        if let Some(range) = &spec.max_tokens {
            self.check_range(".match.maxTokens", range, None, errors);
            out.max_tokens = Some(*range);
        }
        for (name, value) in &spec.headers {
            let lower = name.trim().to_ascii_lowercase();
            if lower.is_empty() || http_header_name_invalid(&lower) {
                self.error(
                    &format!(".match.headers.{name}"),
                    "not a valid HTTP header name".into(),
                    errors,
                );
            }
            let value = value.trim();
            out.headers
                .push((lower, (value != "*").then(|| value.to_owned())));
        }
        Some(out)
    }

    fn check_range(
        &self,
        field: &str,
        range: &RangeSpec,
        max: Option<u64>,
        errors: &mut Vec<ConfigError>,
    ) {
        if range.gt.is_none() && range.gte.is_none() && range.lt.is_none() && range.lte.is_none() {
            self.error(
                field,
                "give at least one of gt, gte, lt, lte".into(),
                errors,
            );
            return;
        }
        let low = range.gt.map(|v| v.saturating_add(1)).max(range.gte);
        let high = match (range.lt, range.lte) {
            (Some(0), _) => {
                self.error(field, "lt: 0 can never hold".into(), errors);
                return;
            }
            (Some(lt), Some(lte)) => Some(lt.saturating_sub(1).min(lte)),
            (lt, lte) => lt.map(|v| v.saturating_sub(1)).or(lte),
        };
        if let (Some(low), Some(high)) = (low, high)
            && low > high
        {
            self.error(
                field,
                "the bounds exclude every value: this rule can never match".into(),
                errors,
            );
        }
        if let (Some(max), Some(low)) = (max, low)
            && low > max
        {
            self.error(field, format!("values go up to {max} only"), errors);
        }
    }

    fn compile_action(&self, action: &ActionSpec, errors: &mut Vec<ConfigError>) -> Option<Action> {
        let given = [
            action.route.is_some(),
            action.reject.is_some(),
            action.require_local.is_some(),
            action.fall_through.is_some(),
        ]
        .iter()
        .filter(|x| **x)
        .count();
        if given != 1 {
            self.error(
                ".action",
                format!(
                    "an action is exactly one of route, reject, requireLocal or fallThrough ({given} given)"
                ),
                errors,
            );
            return None;
        }
        if let Some(route) = &action.route {
            if let Some(model) = &route.inference_model {
                if route.pool.is_some() || route.provider.is_some() {
                    self.error(
                        ".action.route",
                        "inferenceModel cannot be combined with pool or provider".into(),
                        errors,
                    );
                    return None;
                }
                if route.model.is_some() {
                    self.error(
                        ".action.route.model",
                        "not used with inferenceModel (that model's targets say which upstream model)"
                            .into(),
                        errors,
                    );
                    return None;
                }
                let model = model.trim();
                if !self.models.contains_key(model) {
                    self.error(
                        ".action.route.inferenceModel",
                        format!(
                            "no InferenceModel named '{model}'; models defined: {}",
                            names(self.models.keys())
                        ),
                        errors,
                    );
                    return None;
                }
                return Some(Action::Route(RouteTarget::Model(model.to_owned())));
            }
            return resolve_target(
                self.document,
                &format!("{}.action.route", self.field),
                route.pool.as_deref(),
                route.provider.as_deref(),
                route.model.as_deref(),
                self.refs,
                errors,
            )
            .map(|target| Action::Route(RouteTarget::Target(target)));
        }
        if let Some(reject) = &action.reject {
            if !(400..=599).contains(&reject.status) {
                self.error(
                    ".action.reject.status",
                    format!("{} is not an error status (400-599)", reject.status),
                    errors,
                );
                return None;
            }
            if reject.message.trim().is_empty() {
                self.error(
                    ".action.reject.message",
                    "say why: the client sees this message".into(),
                    errors,
                );
                return None;
            }
            if reject
                .retry_after_seconds
                .is_some_and(|seconds| !(1..=86_400).contains(&seconds))
            {
                self.error(
                    ".action.reject.retryAfterSeconds",
                    "must be between 1 and 86400 seconds".to_owned(),
                    errors,
                );
                return None;
            }
            return Some(Action::Reject {
                status: reject.status,
                message: reject.message.trim().to_owned(),
                retry_after_s: reject.retry_after_seconds,
            });
        }
        if let Some(require) = action.require_local {
            if !require {
                self.error(
                    ".action.requireLocal",
                    "only `true` means something; leave the rule out otherwise".into(),
                    errors,
                );
                return None;
            }
            return Some(Action::RequireLocal);
        }
        if action.fall_through == Some(false) {
            self.error(
                ".action.fallThrough",
                "only `true` means something; leave the rule out otherwise".into(),
                errors,
            );
            return None;
        }
        Some(Action::FallThrough)
    }
}

fn http_header_name_invalid(name: &str) -> bool {
    !name.bytes().all(|b| {
        b.is_ascii_alphanumeric()
            || matches!(
                b,
                b'!' | b'#'
                    | b'$'
                    | b'%'
                    | b'&'
                    | b'\''
                    | b'*'
                    | b'+'
                    | b'-'
                    | b'.'
                    | b'^'
                    | b'_'
                    | b'`'
                    | b'|'
                    | b'~'
            )
    })
}

/// A range check, shared by the evaluator and `explain`.
pub fn range_holds(range: &Range, value: u64) -> bool {
    range.gt.is_none_or(|b| value > b)
        && range.gte.is_none_or(|b| value >= b)
        && range.lt.is_none_or(|b| value < b)
        && range.lte.is_none_or(|b| value <= b)
}

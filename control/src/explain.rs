//! `switchyard-control explain`: run a request through the policies offline, with the same
//! evaluator and target resolution as the proxy, and say what happened and why.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use serde::Deserialize;
use switchyard_policy::{
    ClassSet, Classifier, Context, Evaluator, NoTarget, PoolState, RequestFacts, RequestPrompt,
};
use switchyard_snapshot::PoolId;
use switchyard_snapshot::documents::DEFAULT_NAMESPACE;
use switchyard_snapshot::snapshot::{Snapshot, TargetStrategy};

#[derive(clap::Args, Debug)]
pub struct ExplainArgs {
    /// The request body (OpenAI chat/completions or Anthropic messages JSON).
    #[arg(long, value_name = "FILE")]
    request: PathBuf,
    /// The tenant the request authenticates as (leave out: anonymous).
    #[arg(long)]
    tenant: Option<String>,
    /// Live state of pools: YAML `pools: {name: {queueDepth, running, kvUsagePercent,
    /// predictedTtftMs}}`. Pools not listed count as idle, with no TTFT prediction.
    #[arg(long, value_name = "FILE")]
    pool_state: Option<PathBuf>,
    /// A request header, `name=value` (repeatable), e.g. `--header x-priority=batch`.
    #[arg(long = "header", value_name = "NAME=VALUE")]
    headers: Vec<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Configuration files or directories.
    #[arg(required = true, value_name = "PATH")]
    pub paths: Vec<PathBuf>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct StateFile {
    #[serde(default)]
    pools: BTreeMap<String, PoolStateSpec>,
}

#[derive(Deserialize, Default, Clone, Copy)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PoolStateSpec {
    #[serde(default)]
    queue_depth: u64,
    #[serde(default)]
    running: u64,
    #[serde(default)]
    kv_usage_percent: u64,
    #[serde(default)]
    predicted_ttft_ms: Option<u64>,
}

struct OfflineContext {
    prompt: Option<RequestPrompt>,
    headers: BTreeMap<String, String>,
    pools: BTreeMap<String, PoolStateSpec>,
    /// Pools the rules asked about, for the report.
    asked: Vec<(String, PoolState)>,
}

impl Context for OfflineContext {
    fn classes(&mut self, classifier: &Classifier) -> ClassSet {
        self.prompt
            .as_ref()
            .map(|p| classifier.classify(p))
            .unwrap_or_default()
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    fn pool_state(&mut self, pool: &PoolId, _with_prediction: bool) -> Option<PoolState> {
        // State files name pools as `name` (default namespace) or `namespace/name`.
        let short = pool
            .0
            .strip_prefix(&format!("{DEFAULT_NAMESPACE}/"))
            .unwrap_or(&pool.0);
        let spec = self
            .pools
            .get(&pool.0)
            .or_else(|| self.pools.get(short))
            .copied()
            .unwrap_or_default();
        let state = PoolState {
            queue_depth: spec.queue_depth,
            running: spec.running,
            kv_usage_percent: spec.kv_usage_percent,
            predicted_ttft_ms: spec.predicted_ttft_ms,
        };
        if !self.asked.iter().any(|(name, _)| *name == pool.0) {
            self.asked.push((pool.0.clone(), state));
        }
        Some(state)
    }
}

pub fn run(args: &ExplainArgs, snapshot: &Snapshot) -> anyhow::Result<ExitCode> {
    let text = std::fs::read(&args.request)
        .with_context(|| format!("cannot read {}", args.request.display()))?;
    let body: serde_json::Value = serde_json::from_slice(&text)
        .with_context(|| format!("{} is not JSON", args.request.display()))?;
    let model = body
        .get("model")
        .and_then(serde_json::Value::as_str)
        .context("the request has no \"model\" string")?
        .to_owned();
    let stream = body
        .get("stream")
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(false);
    let max_tokens = body
        .get("max_tokens")
        .or_else(|| body.get("max_completion_tokens"))
        .and_then(serde_json::Value::as_u64);
    let pools = match &args.pool_state {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            serde_norway::from_str::<StateFile>(&text)
                .with_context(|| format!("{}: invalid pool state", path.display()))?
                .pools
        }
        None => BTreeMap::new(),
    };
    let mut headers = BTreeMap::new();
    for header in &args.headers {
        let (name, value) = header
            .split_once('=')
            .with_context(|| format!("--header '{header}': expected name=value"))?;
        headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_owned());
    }

    let mut report = Report::default();
    report.line(format!(
        "request: model={model} stream={stream} max_tokens={}",
        max_tokens.map_or("-".to_owned(), |t| t.to_string())
    ));
    let tenant = match &args.tenant {
        Some(name) => match snapshot.tenants.get(name) {
            Some(tenant) => Some(tenant),
            None => {
                let known: Vec<&str> = snapshot.tenants.keys().map(String::as_str).collect();
                anyhow::bail!(
                    "no Tenant named '{name}'; tenants defined: {}",
                    if known.is_empty() {
                        "none".to_owned()
                    } else {
                        known.join(", ")
                    }
                );
            }
        },
        None => {
            if !snapshot.tenants.is_empty() {
                report.line(
                    "note: tenants are configured, so the proxy would answer 401 without a key \
                     (unless a default tenant exists); evaluating as anonymous"
                        .to_owned(),
                );
            }
            snapshot.tenants.values().find(|t| t.default)
        }
    };
    if let Some(tenant) = tenant {
        let labels: Vec<String> = tenant
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        report.line(format!(
            "tenant: {} (labels: {})",
            tenant.name,
            labels.join(", ")
        ));
        report
            .json
            .insert("tenant".into(), tenant.name.clone().into());
    }
    let Some(model_config) = snapshot.models.get(&model) else {
        report.outcome(404, format!("the model '{model}' does not exist"));
        return report.finish(args.json);
    };
    if let Some(tenant) = tenant
        && !tenant.allows_model(&model)
    {
        report.outcome(
            403,
            format!("tenant '{}' may not use the model '{model}'", tenant.name),
        );
        return report.finish(args.json);
    }

    let evaluator = Evaluator::new(snapshot).context("compiling the policies")?;
    let mut context = OfflineContext {
        prompt: Some(RequestPrompt::new(body.clone())),
        headers,
        pools,
        asked: Vec::new(),
    };
    let facts = RequestFacts {
        tenant: tenant.map(|t| t.name.as_str()),
        model: &model,
        stream,
        max_tokens,
    };
    let mut trace = Vec::new();
    let decision = evaluator.evaluate(&facts, &mut context, Some(&mut trace));
    // Classes are shown even when no rule asked for them.
    let classes = decision.classes.unwrap_or_else(|| {
        context
            .prompt
            .as_ref()
            .map(|p| evaluator.classifier().classify(p))
            .unwrap_or_default()
    });
    let class_names = evaluator.classifier().names(classes);
    report.line(format!("prompt classes: {}", class_names.join(", ")));
    report
        .json
        .insert("classes".into(), class_names.clone().into());
    for (pool, state) in &context.asked {
        report.line(format!(
            "pool state {pool}: queueDepth={} running={} kvUsagePercent={} predictedTtftMs={}",
            state.queue_depth,
            state.running,
            state.kv_usage_percent,
            state
                .predicted_ttft_ms
                .map_or("unknown".to_owned(), |t| t.to_string())
        ));
    }
    report.line("rules:".to_owned());
    let mut rules_json = Vec::new();
    for step in &trace {
        report.line(format!("  {}/{}: {}", step.policy, step.rule, step.result));
        rules_json.push(serde_json::json!({
            "rule": format!("{}/{}", step.policy, step.rule),
            "result": step.result,
        }));
    }
    if trace.is_empty() {
        report.line("  (no policy rules)".to_owned());
    }
    report.json.insert("rules".into(), rules_json.into());
    let rule = decision.rule_name();
    report.line(format!(
        "matched rule: {}",
        rule.as_deref().unwrap_or("none (the model's own targets)")
    ));
    report
        .json
        .insert("matchedRule".into(), rule.clone().into());
    if let Some(local) = decision.require_local {
        report.line(format!(
            "local hardware required by {}/{}",
            local.policy, local.name
        ));
        report.json.insert("requireLocal".into(), true.into());
    }
    match switchyard_policy::targets(snapshot, model_config, &decision) {
        Err(NoTarget::Rejected {
            status,
            message,
            retry_after_s,
        }) => {
            report.outcome(status, message);
            if let Some(seconds) = retry_after_s {
                report.line(format!("retry after: {seconds} s (Retry-After)"));
                report
                    .json
                    .insert("retryAfterSeconds".into(), seconds.into());
            }
        }
        Err(NoTarget::NoLocalTarget { rule }) => report.outcome(
            503,
            format!("must stay on local hardware ({rule}) and '{model}' has no local pool"),
        ),
        Ok(chosen) => {
            let total: u64 = chosen.targets.iter().map(|t| u64::from(t.weight)).sum();
            let mut targets_json = Vec::new();
            for (index, target) in chosen.targets.iter().enumerate() {
                let share = match chosen.strategy {
                    TargetStrategy::Weighted => format!(
                        "{:.0}% of requests",
                        100.0 * f64::from(target.weight) / (total.max(1) as f64)
                    ),
                    TargetStrategy::Ordered if index == 0 => "first choice".to_owned(),
                    TargetStrategy::Ordered => format!("fallback {index}"),
                };
                report.line(format!(
                    "target: {} model {} ({share})",
                    target.backend, target.upstream_model
                ));
                targets_json.push(serde_json::json!({
                    "backend": target.backend.to_string(),
                    "model": target.upstream_model,
                    "share": share,
                }));
            }
            report.json.insert("targets".into(), targets_json.into());
            report.json.insert("status".into(), 200.into());
        }
    }
    report.finish(args.json)
}

#[derive(Default)]
struct Report {
    lines: Vec<String>,
    json: serde_json::Map<String, serde_json::Value>,
}

impl Report {
    fn line(&mut self, line: String) {
        self.lines.push(line);
    }

    fn outcome(&mut self, status: u16, message: String) {
        self.lines.push(format!("outcome: {status} {message}"));
        self.json.insert("status".into(), status.into());
        self.json.insert("message".into(), message.into());
    }

    fn finish(self, json: bool) -> anyhow::Result<ExitCode> {
        if json {
            println!("{}", serde_json::Value::Object(self.json));
        } else {
            for line in self.lines {
                println!("{line}");
            }
        }
        Ok(ExitCode::SUCCESS)
    }
}

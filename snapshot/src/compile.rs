//! The one configuration compiler: documents → [`Snapshot`], or every error with where it is.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

use crate::documents::{
    Document, EndpointSpec, InferenceModelSpec, InferencePoolSpec, Kind, KvEventsSpec, Spec,
};
use crate::error::{ConfigError, ConfigErrors};
use crate::parse::Parsed;
use crate::snapshot::{
    DEFAULT_BLOCK_SIZE, DEFAULT_CONNECT_TIMEOUT_MS, DEFAULT_MAX_ATTEMPTS, DEFAULT_METRICS_PATH,
    DEFAULT_SCRAPE_INTERVAL_MS, Endpoint, Model, ModelTarget, Pool, PoolId, Snapshot,
};

/// Compile what was read, adding compile errors to the reading errors; a snapshot only when both are empty.
pub fn compile_parsed(parsed: Parsed) -> Result<Snapshot, ConfigErrors> {
    let mut errors = parsed.errors;
    match compile_with(&parsed.documents, &parsed.broken) {
        Ok(snapshot) if errors.is_empty() => Ok(snapshot),
        Ok(_) => Err(ConfigErrors(errors)),
        Err(ConfigErrors(mut compile_errors)) => {
            errors.append(&mut compile_errors);
            Err(ConfigErrors(errors))
        }
    }
}

/// Compile a complete set of documents. The result has version 0; the source assigns versions.
pub fn compile(documents: &[Document]) -> Result<Snapshot, ConfigErrors> {
    compile_with(documents, &[])
}

/// `broken` names documents that exist but failed to read: references to them are not reported
/// again as missing.
fn compile_with(
    documents: &[Document],
    broken: &[(Kind, String)],
) -> Result<Snapshot, ConfigErrors> {
    let mut errors = Vec::new();
    let mut pools: BTreeMap<PoolId, Pool> = BTreeMap::new();
    let mut pool_sources: BTreeMap<PoolId, &Document> = BTreeMap::new();

    for document in documents {
        check_name(document, &mut errors);
    }

    for document in documents {
        if let Spec::InferencePool(spec) = &document.spec {
            let id = PoolId::new(
                document.metadata.namespace_or_default(),
                &document.metadata.name,
            );
            if let Some(first) = pool_sources.get(&id) {
                errors.push(error_at(
                    document,
                    "metadata.name",
                    format!(
                        "duplicate InferencePool {id} (first defined in {})",
                        first.origin
                    ),
                ));
                continue;
            }
            pool_sources.insert(id.clone(), document);
            if let Some(pool) = compile_pool(document, id.clone(), spec, &mut errors) {
                pools.insert(id, pool);
            }
        }
    }

    let mut models: BTreeMap<String, Model> = BTreeMap::new();
    let mut model_sources: BTreeMap<String, &Document> = BTreeMap::new();
    for document in documents {
        if let Spec::InferenceModel(spec) = &document.spec {
            let Some(model) =
                compile_model(document, spec, &pool_sources, &pools, broken, &mut errors)
            else {
                continue;
            };
            if let Some(first) = model_sources.get(&model.name) {
                errors.push(error_at(
                    document,
                    if spec.model_name.is_some() {
                        "spec.modelName"
                    } else {
                        "metadata.name"
                    },
                    format!(
                        "model name '{}' is already defined by {} in {}",
                        model.name,
                        first_label(first),
                        first.origin
                    ),
                ));
                continue;
            }
            model_sources.insert(model.name.clone(), document);
            models.insert(model.name.clone(), model);
        }
    }

    if !errors.is_empty() {
        return Err(ConfigErrors(errors));
    }
    let fingerprint = fingerprint(&pools, &models);
    Ok(Snapshot {
        version: 0,
        fingerprint,
        pools,
        models,
    })
}

fn compile_pool(
    document: &Document,
    id: PoolId,
    spec: &InferencePoolSpec,
    errors: &mut Vec<ConfigError>,
) -> Option<Pool> {
    let before = errors.len();
    if spec.model.trim().is_empty() {
        errors.push(error_at(
            document,
            "spec.model",
            "must name the model the workers serve".into(),
        ));
    }
    if spec.endpoints.is_empty() && spec.selector.is_empty() {
        errors.push(error_at(
            document,
            "spec.endpoints",
            "a pool needs static endpoints (host:port) or a selector of worker pods".into(),
        ));
    }
    if !spec.selector.is_empty() && spec.target_port.is_none() {
        errors.push(error_at(
            document,
            "spec.targetPort",
            "required with a selector: the port the workers' HTTP server listens on".into(),
        ));
    }
    let mut endpoints: Vec<Endpoint> = Vec::with_capacity(spec.endpoints.len());
    for (index, endpoint) in spec.endpoints.iter().enumerate() {
        let field = format!("spec.endpoints[{index}]");
        match compile_endpoint(endpoint, spec.kv_events.as_ref()) {
            Ok(endpoint) => endpoints.push(endpoint),
            Err((suffix, message)) => {
                errors.push(error_at(document, &format!("{field}{suffix}"), message))
            }
        }
    }
    endpoints.sort();
    endpoints.dedup_by(|a, b| a.address == b.address);
    if spec.block_size == Some(0) {
        errors.push(error_at(
            document,
            "spec.blockSize",
            "must be at least 1".into(),
        ));
    }
    if spec.scrape_interval_ms == Some(0) {
        errors.push(error_at(
            document,
            "spec.scrapeIntervalMs",
            "must be greater than 0".into(),
        ));
    }
    if let Some(path) = &spec.metrics_path
        && !path.starts_with('/')
    {
        errors.push(error_at(
            document,
            "spec.metricsPath",
            format!("'{path}' must start with '/'"),
        ));
    }
    if let Some(tokenizer) = &spec.tokenizer {
        for (field, path) in [
            ("spec.tokenizer.path", &tokenizer.path),
            ("spec.tokenizer.chatTemplate", &tokenizer.chat_template),
        ] {
            if path.trim().is_empty() {
                errors.push(error_at(document, field, "must name a file".into()));
            }
        }
    }
    if spec.connect_timeout_ms == Some(0) {
        errors.push(error_at(
            document,
            "spec.connectTimeoutMs",
            "must be greater than 0".into(),
        ));
    }
    if spec.max_attempts == Some(0) {
        errors.push(error_at(
            document,
            "spec.maxAttempts",
            "must be at least 1".into(),
        ));
    }
    if errors.len() > before {
        return None;
    }
    Some(Pool {
        id,
        engine: spec.engine,
        served_model: spec.model.trim().to_owned(),
        endpoints,
        load_balancing: spec.load_balancing,
        anthropic_messages: spec.anthropic_messages,
        connect_timeout_ms: spec
            .connect_timeout_ms
            .unwrap_or(DEFAULT_CONNECT_TIMEOUT_MS),
        max_attempts: spec.max_attempts.unwrap_or(DEFAULT_MAX_ATTEMPTS),
        block_size: spec.block_size.unwrap_or(DEFAULT_BLOCK_SIZE),
        tokenizer: spec.tokenizer.clone(),
        kv_topic: spec
            .kv_events
            .as_ref()
            .map(|k| k.topic.clone())
            .unwrap_or_default(),
        metrics_path: spec
            .metrics_path
            .clone()
            .unwrap_or_else(|| DEFAULT_METRICS_PATH.to_owned()),
        scrape_interval_ms: spec
            .scrape_interval_ms
            .unwrap_or(DEFAULT_SCRAPE_INTERVAL_MS),
        scoring: spec.scoring.unwrap_or_default(),
    })
}

fn compile_model(
    document: &Document,
    spec: &InferenceModelSpec,
    pool_sources: &BTreeMap<PoolId, &Document>,
    pools: &BTreeMap<PoolId, Pool>,
    broken: &[(Kind, String)],
    errors: &mut Vec<ConfigError>,
) -> Option<Model> {
    let before = errors.len();
    let name = spec
        .model_name
        .as_deref()
        .unwrap_or(&document.metadata.name)
        .trim()
        .to_owned();
    if name.is_empty() {
        errors.push(error_at(
            document,
            "spec.modelName",
            "must not be empty".into(),
        ));
    }
    if spec.targets.is_empty() {
        errors.push(error_at(
            document,
            "spec.targets",
            "at least one target is required".into(),
        ));
    }
    let namespace = document.metadata.namespace_or_default();
    let mut targets = Vec::with_capacity(spec.targets.len());
    for (index, target) in spec.targets.iter().enumerate() {
        let pool_id = PoolId::new(namespace, &target.pool);
        let pool_is_broken = broken
            .iter()
            .any(|(kind, id)| *kind == Kind::InferencePool && *id == pool_id.0);
        if pool_is_broken {
            continue;
        }
        if !pool_sources.contains_key(&pool_id) {
            let known: Vec<&str> = pool_sources.keys().map(|id| id.0.as_str()).collect();
            errors.push(error_at(
                document,
                &format!("spec.targets[{index}].pool"),
                format!(
                    "no InferencePool {pool_id}; pools defined: {}",
                    if known.is_empty() {
                        "none".to_owned()
                    } else {
                        known.join(", ")
                    }
                ),
            ));
            continue;
        }
        if target.model.as_deref().is_some_and(|m| m.trim().is_empty()) {
            errors.push(error_at(
                document,
                &format!("spec.targets[{index}].model"),
                "must not be empty (leave it out to use the pool's model)".into(),
            ));
            continue;
        }
        let weight = target.weight.unwrap_or(1);
        if weight == 0 {
            continue;
        }
        // The pool may have failed to compile; its own errors are reported already.
        let Some(pool) = pools.get(&pool_id) else {
            continue;
        };
        let upstream_model = target
            .model
            .as_deref()
            .map(str::trim)
            .unwrap_or(&pool.served_model)
            .to_owned();
        targets.push(ModelTarget {
            pool: pool_id,
            upstream_model,
            weight,
        });
    }
    if errors.len() == before && targets.is_empty() && !spec.targets.is_empty() {
        let all_zero = spec.targets.iter().all(|t| t.weight == Some(0));
        if all_zero {
            errors.push(error_at(
                document,
                "spec.targets",
                "every target has weight 0: at least one must be positive".into(),
            ));
        }
    }
    if errors.len() > before || targets.is_empty() {
        return None;
    }
    Some(Model {
        name,
        defined_by: format!("{namespace}/{}", document.metadata.name),
        targets,
    })
}

/// Kubernetes object names: DNS-1123 subdomain (lowercase alphanumerics, '-' and '.').
fn check_name(document: &Document, errors: &mut Vec<ConfigError>) {
    let name = &document.metadata.name;
    let valid = !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    if !valid {
        errors.push(error_at(
            document,
            "metadata.name",
            format!(
                "'{name}' is not a valid object name: use lowercase letters, digits, '-' and '.', \
                 starting and ending with a letter or digit (put names like 'Org/Model' in spec.modelName)"
            ),
        ));
    }
}

/// A static endpoint with its KV-event sockets resolved (explicit, or the pool's ports on its host).
fn compile_endpoint(
    endpoint: &EndpointSpec,
    kv: Option<&KvEventsSpec>,
) -> Result<Endpoint, (&'static str, String)> {
    let (address, kv_events, kv_replay) = match endpoint {
        EndpointSpec::Address(address) => (address.trim(), None, None),
        EndpointSpec::Detailed(detailed) => (
            detailed.address.trim(),
            detailed.kv_events.clone(),
            detailed.kv_replay.clone(),
        ),
    };
    let suffix = if matches!(endpoint, EndpointSpec::Detailed(_)) {
        ".address"
    } else {
        ""
    };
    check_endpoint(address).map_err(|message| (suffix, message))?;
    for (field, value) in [(".kvEvents", &kv_events), (".kvReplay", &kv_replay)] {
        if let Some(value) = value
            && !value.starts_with("tcp://")
            && !value.starts_with("ipc://")
        {
            return Err((
                field,
                format!("'{value}' must be a ZMQ endpoint such as tcp://10.0.0.7:5557"),
            ));
        }
    }
    let host = address.rsplit_once(':').map_or(address, |(host, _)| host);
    let kv_events = kv_events.or_else(|| kv.map(|kv| format!("tcp://{host}:{}", kv.port)));
    let kv_replay = kv_replay.or_else(|| {
        kv.and_then(|kv| kv.replay_port)
            .map(|port| format!("tcp://{host}:{port}"))
    });
    Ok(Endpoint {
        address: address.to_owned(),
        kv_events,
        kv_replay,
    })
}

fn check_endpoint(endpoint: &str) -> Result<(), String> {
    let endpoint = endpoint.trim();
    let invalid =
        || format!("invalid endpoint '{endpoint}': expected host:port, e.g. 10.0.0.7:8000");
    if endpoint.contains("://") || endpoint.contains('/') {
        return Err(format!("{}; leave out the scheme and path", invalid()));
    }
    let (host, port) = endpoint.rsplit_once(':').ok_or_else(invalid)?;
    if host.is_empty() {
        return Err(invalid());
    }
    match port.parse::<u16>() {
        Ok(0) | Err(_) => Err(invalid()),
        Ok(_) => Ok(()),
    }
}

fn first_label(document: &Document) -> String {
    format!(
        "{} {}/{}",
        document.spec.kind(),
        document.metadata.namespace_or_default(),
        document.metadata.name
    )
}

fn error_at(document: &Document, field: &str, message: String) -> ConfigError {
    ConfigError {
        source_name: document.origin.to_string(),
        document: first_label(document),
        field: field.to_owned(),
        message,
    }
}

fn fingerprint(pools: &BTreeMap<PoolId, Pool>, models: &BTreeMap<String, Model>) -> String {
    let mut hasher = Sha256::new();
    // serde_json of BTreeMaps is deterministic; serializing plain data cannot fail.
    if let Ok(bytes) = serde_json::to_vec(&(pools, models)) {
        hasher.update(&bytes);
    }
    let digest = hasher.finalize();
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

//! The one configuration compiler: documents → [`Snapshot`], or every error with where it is.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

use crate::documents::{
    Document, EndpointSpec, InferenceModelSpec, InferencePoolSpec, Kind, KvEventsSpec, Spec,
};
use crate::error::{ConfigError, ConfigErrors};
use crate::parse::Parsed;
use crate::snapshot::{
    Backend, Credentials, DEFAULT_BLOCK_SIZE, DEFAULT_CONNECT_TIMEOUT_MS, DEFAULT_MAX_ATTEMPTS,
    DEFAULT_METRICS_PATH, DEFAULT_PROVIDER_CONNECT_TIMEOUT_MS, DEFAULT_PROVIDER_READ_TIMEOUT_MS,
    DEFAULT_SCRAPE_INTERVAL_MS, Endpoint, Model, ModelTarget, Pool, PoolId, Provider, ProviderId,
    Snapshot,
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

    let (providers, provider_sources) = compile_providers(documents, &mut errors);
    let refs = References {
        pool_sources: &pool_sources,
        pools: &pools,
        provider_sources: &provider_sources,
        providers: &providers,
        broken,
    };
    let mut models: BTreeMap<String, Model> = BTreeMap::new();
    let mut model_sources: BTreeMap<String, &Document> = BTreeMap::new();
    for document in documents {
        if let Spec::InferenceModel(spec) = &document.spec {
            let Some(model) = compile_model(document, spec, &refs, &mut errors) else {
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

    let tenants = crate::compile_policy::compile_tenants(documents, &models, &mut errors);
    let (rules, classes, complexity) =
        crate::compile_policy::compile_policies(documents, &refs, &models, &tenants, &mut errors);

    if !errors.is_empty() {
        return Err(ConfigErrors(errors));
    }
    let mut snapshot = Snapshot {
        version: 0,
        fingerprint: String::new(),
        pools,
        models,
        providers,
        tenants,
        rules,
        classes,
        complexity,
    };
    snapshot.fingerprint = fingerprint(&snapshot);
    Ok(snapshot)
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
        responses_api: spec.responses_api,
        task: spec.task,
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
    refs: &References<'_>,
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
        let field = format!("spec.targets[{index}]");
        let resolved = resolve_target(
            document,
            &field,
            target.pool.as_deref(),
            target.provider.as_deref(),
            target.model.as_deref(),
            refs,
            errors,
        );
        let weight = target.weight.unwrap_or(1);
        if let Some(backend_target) = resolved
            && weight > 0
        {
            targets.push(ModelTarget {
                weight,
                ..backend_target
            });
        }
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
        strategy: spec.strategy,
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

/// What targets may name, for resolving references.
pub(crate) struct References<'a> {
    pub pool_sources: &'a BTreeMap<PoolId, &'a Document>,
    pub pools: &'a BTreeMap<PoolId, Pool>,
    pub provider_sources: &'a BTreeMap<ProviderId, &'a Document>,
    pub providers: &'a BTreeMap<ProviderId, Provider>,
    pub broken: &'a [(Kind, String)],
}

impl References<'_> {
    fn is_broken(&self, kind: Kind, id: &str) -> bool {
        self.broken.iter().any(|(k, b)| *k == kind && b == id)
    }
}

/// Resolve a `{pool|provider, model}` reference. `None` after an error was pushed, or when the
/// referenced document is broken (its own errors are reported).
pub(crate) fn resolve_target(
    document: &Document,
    field: &str,
    pool: Option<&str>,
    provider: Option<&str>,
    model: Option<&str>,
    refs: &References<'_>,
    errors: &mut Vec<ConfigError>,
) -> Option<ModelTarget> {
    let namespace = document.metadata.namespace_or_default();
    if model.is_some_and(|m| m.trim().is_empty()) {
        errors.push(error_at(
            document,
            &format!("{field}.model"),
            "must not be empty (leave it out to use the pool's model)".into(),
        ));
        return None;
    }
    let model = model.map(str::trim);
    match (pool, provider) {
        (Some(pool), None) => {
            let pool_id = PoolId::new(namespace, pool);
            if refs.is_broken(Kind::InferencePool, &pool_id.0) {
                return None;
            }
            if !refs.pool_sources.contains_key(&pool_id) {
                let known: Vec<&str> = refs.pool_sources.keys().map(|id| id.0.as_str()).collect();
                errors.push(error_at(
                    document,
                    &format!("{field}.pool"),
                    format!(
                        "no InferencePool {pool_id}; pools defined: {}",
                        list(&known)
                    ),
                ));
                return None;
            }
            // The pool may have failed to compile; its own errors are reported already.
            let pool = refs.pools.get(&pool_id)?;
            Some(ModelTarget {
                upstream_model: model.unwrap_or(&pool.served_model).to_owned(),
                backend: Backend::Pool(pool_id),
                weight: 1,
            })
        }
        (None, Some(provider)) => {
            let provider_id = ProviderId::new(namespace, provider);
            if refs.is_broken(Kind::ExternalProvider, &provider_id.0) {
                return None;
            }
            if !refs.provider_sources.contains_key(&provider_id) {
                let known: Vec<&str> = refs
                    .provider_sources
                    .keys()
                    .map(|id| id.0.as_str())
                    .collect();
                errors.push(error_at(
                    document,
                    &format!("{field}.provider"),
                    format!(
                        "no ExternalProvider {provider_id}; providers defined: {}",
                        list(&known)
                    ),
                ));
                return None;
            }
            let Some(model) = model else {
                errors.push(error_at(
                    document,
                    &format!("{field}.model"),
                    format!("required with a provider: the model name {provider_id} serves"),
                ));
                return None;
            };
            let provider_config = refs.providers.get(&provider_id)?;
            if !provider_config.models.is_empty()
                && !provider_config.models.iter().any(|m| m == model)
            {
                errors.push(error_at(
                    document,
                    &format!("{field}.model"),
                    format!(
                        "ExternalProvider {provider_id} does not list model '{model}'; it serves: {}",
                        provider_config.models.join(", ")
                    ),
                ));
                return None;
            }
            Some(ModelTarget {
                upstream_model: model.to_owned(),
                backend: Backend::Provider(provider_id),
                weight: 1,
            })
        }
        (Some(_), Some(_)) => {
            errors.push(error_at(
                document,
                field,
                "names both a pool and a provider; a target is one or the other".into(),
            ));
            None
        }
        (None, None) => {
            errors.push(error_at(
                document,
                field,
                "names neither a pool nor a provider".into(),
            ));
            None
        }
    }
}

fn list(names: &[&str]) -> String {
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

type Providers<'a> = (
    BTreeMap<ProviderId, Provider>,
    BTreeMap<ProviderId, &'a Document>,
);

/// Headers the gateway sets on a provider request itself: a client cannot have them forwarded.
const GATEWAY_OWNED_HEADERS: &[&str] = &[
    "authorization",
    "x-api-key",
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "x-request-id",
    "traceparent",
    "tracestate",
];

/// RFC 9110 token characters, as header names use them.
fn is_header_name_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&byte)
}

fn compile_providers<'a>(
    documents: &'a [Document],
    errors: &mut Vec<ConfigError>,
) -> Providers<'a> {
    let mut providers = BTreeMap::new();
    let mut sources: BTreeMap<ProviderId, &Document> = BTreeMap::new();
    for document in documents {
        let Spec::ExternalProvider(spec) = &document.spec else {
            continue;
        };
        let id = ProviderId::new(
            document.metadata.namespace_or_default(),
            &document.metadata.name,
        );
        if let Some(first) = sources.get(&id) {
            errors.push(error_at(
                document,
                "metadata.name",
                format!(
                    "duplicate ExternalProvider {id} (first defined in {})",
                    first.origin
                ),
            ));
            continue;
        }
        sources.insert(id.clone(), document);
        let before = errors.len();
        let base_url = spec.base_url.trim().trim_end_matches('/').to_owned();
        match base_url.split_once("://") {
            Some(("http" | "https", rest))
                if !rest.is_empty() && !rest.starts_with('/') && !rest.contains(['?', '#']) => {}
            _ => errors.push(error_at(
                document,
                "spec.baseUrl",
                format!(
                    "'{}' must be an http:// or https:// URL such as https://api.openai.com/v1",
                    spec.base_url
                ),
            )),
        }
        let credentials = match &spec.credentials {
            None => None,
            Some(c) => match (&c.secret_ref, &c.file, &c.env) {
                (Some(secret), None, None) => Some(Credentials::Secret(secret.clone())),
                (None, Some(file), None) if !file.trim().is_empty() => {
                    Some(Credentials::File(file.trim().to_owned()))
                }
                (None, None, Some(env)) if !env.trim().is_empty() => {
                    Some(Credentials::Env(env.trim().to_owned()))
                }
                _ => {
                    errors.push(error_at(
                        document,
                        "spec.credentials",
                        "give exactly one of secretRef, file or env".into(),
                    ));
                    None
                }
            },
        };
        if let Some(ca_file) = &spec.ca_file {
            if ca_file.trim().is_empty() {
                errors.push(error_at(document, "spec.caFile", "must name a file".into()));
            } else if !base_url.starts_with("https://") {
                errors.push(error_at(
                    document,
                    "spec.caFile",
                    "only used with an https:// baseUrl".into(),
                ));
            }
        }
        for (field, value) in [
            ("spec.connectTimeoutMs", spec.connect_timeout_ms),
            ("spec.readTimeoutMs", spec.read_timeout_ms),
        ] {
            if value == Some(0) {
                errors.push(error_at(document, field, "must be greater than 0".into()));
            }
        }
        let mut forward_headers = Vec::with_capacity(spec.forward_headers.len());
        for (index, header) in spec.forward_headers.iter().enumerate() {
            let name = header.trim().to_ascii_lowercase();
            let field = format!("spec.forwardHeaders[{index}]");
            if name.is_empty() || !name.bytes().all(is_header_name_byte) {
                errors.push(error_at(
                    document,
                    &field,
                    format!("'{header}' is not an HTTP header name"),
                ));
            } else if GATEWAY_OWNED_HEADERS.contains(&name.as_str()) {
                errors.push(error_at(
                    document,
                    &field,
                    format!("'{name}' is set by the gateway and cannot be forwarded"),
                ));
            } else if !forward_headers.contains(&name) {
                forward_headers.push(name);
            }
        }
        if errors.len() > before {
            continue;
        }
        providers.insert(
            id.clone(),
            Provider {
                id,
                base_url,
                format: spec.format,
                credentials,
                models: spec.models.iter().map(|m| m.trim().to_owned()).collect(),
                ca_file: spec.ca_file.as_ref().map(|f| f.trim().to_owned()),
                forward_headers,
                responses_api: spec.responses_api,
                connect_timeout_ms: spec
                    .connect_timeout_ms
                    .unwrap_or(DEFAULT_PROVIDER_CONNECT_TIMEOUT_MS),
                read_timeout_ms: spec
                    .read_timeout_ms
                    .unwrap_or(DEFAULT_PROVIDER_READ_TIMEOUT_MS),
            },
        );
    }
    (providers, sources)
}

pub(crate) fn first_label(document: &Document) -> String {
    format!(
        "{} {}/{}",
        document.spec.kind(),
        document.metadata.namespace_or_default(),
        document.metadata.name
    )
}

pub(crate) fn error_at(document: &Document, field: &str, message: String) -> ConfigError {
    ConfigError {
        source_name: document.origin.to_string(),
        document: first_label(document),
        field: field.to_owned(),
        message,
    }
}

/// sha256 of everything but the version and the fingerprint itself.
pub fn fingerprint(snapshot: &Snapshot) -> String {
    let mut hasher = Sha256::new();
    let content = (
        &snapshot.pools,
        &snapshot.models,
        &snapshot.providers,
        &snapshot.tenants,
        &snapshot.rules,
        &snapshot.classes,
        &snapshot.complexity,
    );
    // serde_json of BTreeMaps is deterministic; serializing plain data cannot fail.
    if let Ok(bytes) = serde_json::to_vec(&content) {
        hasher.update(&bytes);
    }
    let digest = hasher.finalize();
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

//! Reading YAML (files, directories or strings) into [`Document`]s, collecting every error.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::documents::{API_VERSION, Document, Kind, ObjectMeta, Origin, Spec};
use crate::error::ConfigError;

/// Name used for configuration compiled into the binary.
pub const EMBEDDED_SOURCE: &str = "<embedded default>";

/// The raw envelope of a document before its kind is known.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Envelope {
    api_version: Option<String>,
    kind: Option<String>,
    metadata: Option<serde_json::Value>,
    spec: Option<serde_json::Value>,
}

/// What reading produced: the good documents, every error, and the names of documents that were
/// recognisable but broken (so the compiler does not also call them missing).
#[derive(Debug, Default)]
pub struct Parsed {
    pub documents: Vec<Document>,
    pub errors: Vec<ConfigError>,
    pub broken: Vec<(Kind, String)>,
}

impl Parsed {
    fn append(&mut self, mut other: Parsed) {
        self.documents.append(&mut other.documents);
        self.errors.append(&mut other.errors);
        self.broken.append(&mut other.broken);
    }
}

/// Parse every document in one YAML text. Empty documents are skipped.
pub fn parse_str(source: &str, text: &str) -> Parsed {
    let mut parsed = Parsed::default();
    for (position, yaml) in serde_norway::Deserializer::from_str(text).enumerate() {
        let origin = Origin {
            source: source.to_owned(),
            index: position + 1,
        };
        let value = match serde_json::Value::deserialize(yaml) {
            Ok(value) => value,
            Err(error) => {
                // A syntax error stops the YAML stream: report it and what came before.
                parsed.errors.push(whole_document_error(
                    &origin,
                    format!("invalid YAML: {error}"),
                ));
                break;
            }
        };
        if value.is_null() {
            continue;
        }
        match parse_document(origin, value) {
            Ok(document) => parsed.documents.push(document),
            Err((mut document_errors, broken)) => {
                parsed.errors.append(&mut document_errors);
                parsed.broken.extend(broken);
            }
        }
    }
    parsed
}

/// Read files and directories (every `*.yaml` / `*.yml` inside, sorted by name, not recursive).
pub fn parse_paths(paths: &[PathBuf]) -> Parsed {
    let mut parsed = Parsed::default();
    for file in expand_paths(paths, &mut parsed.errors) {
        let source = file.display().to_string();
        match std::fs::read_to_string(&file) {
            Ok(text) => {
                let file_parsed = parse_str(&source, &text);
                // A file of nothing is what `> file` or an editor's unfinished write leaves:
                // never a configuration anyone meant.
                if file_parsed.documents.is_empty() && file_parsed.errors.is_empty() {
                    parsed.errors.push(ConfigError {
                        source_name: source,
                        document: "file".to_owned(),
                        field: String::new(),
                        message: "holds no documents (empty, or a write that has not finished)"
                            .to_owned(),
                    });
                } else {
                    parsed.append(file_parsed);
                }
            }
            Err(error) => parsed.errors.push(ConfigError {
                source_name: source,
                document: "file".to_owned(),
                field: String::new(),
                message: format!("cannot read: {error}"),
            }),
        }
    }
    parsed
}

/// Lowercase hex SHA-256 of the files a set of paths stands for: their names, their bytes (or
/// why they cannot be read) and listing errors. Watchers compare it to notice edits cheaply.
pub fn files_digest(paths: &[PathBuf]) -> String {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    let mut errors = Vec::new();
    for file in expand_paths(paths, &mut errors) {
        hasher.update(file.display().to_string().as_bytes());
        hasher.update([0]);
        match std::fs::read(&file) {
            Ok(bytes) => hasher.update(&bytes),
            Err(error) => hasher.update(error.to_string().as_bytes()),
        }
        hasher.update([0]);
    }
    for error in &errors {
        hasher.update(error.to_string().as_bytes());
    }
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The files a set of paths stands for, in a stable order.
pub fn expand_paths(paths: &[PathBuf], errors: &mut Vec<ConfigError>) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for path in paths {
        if path.is_dir() {
            match std::fs::read_dir(path) {
                Ok(entries) => {
                    let mut in_dir: Vec<PathBuf> = entries
                        .filter_map(|entry| entry.ok().map(|e| e.path()))
                        .filter(|p| p.is_file() && is_yaml(p))
                        .collect();
                    in_dir.sort();
                    files.append(&mut in_dir);
                }
                Err(error) => errors.push(ConfigError {
                    source_name: path.display().to_string(),
                    document: "directory".to_owned(),
                    field: String::new(),
                    message: format!("cannot list: {error}"),
                }),
            }
        } else {
            files.push(path.clone());
        }
    }
    files
}

fn is_yaml(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("yaml" | "yml")
    )
}

type Broken = (Vec<ConfigError>, Option<(Kind, String)>);

fn parse_document(origin: Origin, value: serde_json::Value) -> Result<Document, Broken> {
    let envelope: Envelope = serde_json::from_value(value).map_err(|e| {
        (
            vec![whole_document_error(
                &origin,
                format!("not a document: {e}"),
            )],
            None,
        )
    })?;
    let mut errors = Vec::new();
    let label = format!("document {}", origin.index);
    let error = |field: &str, message: String| ConfigError {
        source_name: origin.source.clone(),
        document: label.clone(),
        field: field.to_owned(),
        message,
    };

    match envelope.api_version.as_deref() {
        Some(API_VERSION) => {}
        Some(other) => errors.push(error(
            "apiVersion",
            format!("unsupported apiVersion '{other}', expected '{API_VERSION}'"),
        )),
        None => errors.push(error(
            "apiVersion",
            format!("missing; expected '{API_VERSION}'"),
        )),
    }
    let kind = match envelope.kind.as_deref() {
        Some(kind) => match Kind::parse(kind) {
            Some(kind) => Some(kind),
            None => {
                let known: Vec<&str> = Kind::ALL.iter().map(|k| k.as_str()).collect();
                errors.push(error(
                    "kind",
                    format!(
                        "unknown kind '{kind}', expected one of {}",
                        known.join(", ")
                    ),
                ));
                None
            }
        },
        None => {
            errors.push(error("kind", "missing".to_owned()));
            None
        }
    };
    let metadata = match envelope.metadata {
        Some(value) => match serde_path_to_error::deserialize::<_, ObjectMeta>(value) {
            Ok(meta) => Some(meta),
            Err(e) => {
                errors.push(error(
                    &field_path("metadata", e.path()),
                    e.inner().to_string(),
                ));
                None
            }
        },
        None => {
            errors.push(error("metadata.name", "missing".to_owned()));
            None
        }
    };
    let document_name = match (&kind, &metadata) {
        (Some(kind), Some(meta)) => {
            format!("{kind} {}/{}", meta.namespace_or_default(), meta.name)
        }
        _ => label.clone(),
    };
    let spec = match (kind, envelope.spec) {
        (Some(kind), Some(value)) => match parse_spec(kind, value) {
            Ok(spec) => Some(spec),
            Err((path, message)) => {
                errors.push(ConfigError {
                    source_name: origin.source.clone(),
                    document: document_name.clone(),
                    field: path,
                    message,
                });
                None
            }
        },
        (Some(_), None) => {
            errors.push(error("spec", "missing".to_owned()));
            None
        }
        (None, _) => None,
    };
    match (metadata, spec) {
        (Some(metadata), Some(spec)) if errors.is_empty() => Ok(Document {
            origin,
            metadata,
            spec,
        }),
        (metadata, _) => {
            let broken = kind.zip(metadata).map(|(kind, meta)| {
                (
                    kind,
                    format!("{}/{}", meta.namespace_or_default(), meta.name),
                )
            });
            Err((errors, broken))
        }
    }
}

fn parse_spec(kind: Kind, value: serde_json::Value) -> Result<Spec, (String, String)> {
    fn typed<T: serde::de::DeserializeOwned>(
        value: serde_json::Value,
    ) -> Result<T, (String, String)> {
        serde_path_to_error::deserialize(value)
            .map_err(|e| (field_path("spec", e.path()), e.inner().to_string()))
    }
    Ok(match kind {
        Kind::InferencePool => Spec::InferencePool(typed(value)?),
        Kind::InferenceModel => Spec::InferenceModel(typed(value)?),
        Kind::InferencePolicy => Spec::InferencePolicy(typed(value)?),
        Kind::Tenant => Spec::Tenant(typed(value)?),
        Kind::ExternalProvider => Spec::ExternalProvider(typed(value)?),
    })
}

fn field_path(root: &str, path: &serde_path_to_error::Path) -> String {
    let rest = path.to_string();
    if rest == "." || rest.is_empty() {
        root.to_owned()
    } else if rest.starts_with('[') {
        format!("{root}{rest}")
    } else {
        format!("{root}.{rest}")
    }
}

fn whole_document_error(origin: &Origin, message: String) -> ConfigError {
    ConfigError {
        source_name: origin.source.clone(),
        document: format!("document {}", origin.index),
        field: String::new(),
        message,
    }
}

//! An external provider made ready for requests: its address resolved, its key read, its CA
//! loaded.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;

use pingora_core::protocols::tls::CaType;
use pingora_core::utils::tls::{WrappedX509, parse_x509};
use switchyard_snapshot::snapshot::{Credentials, Provider};

/// An external provider ready for requests: its address resolved and its key read.
pub struct ProviderRuntime {
    pub config: Provider,
    /// `None` while the provider cannot be used (see `unavailable`).
    pub socket: Option<SocketAddr>,
    /// Why requests cannot go there (a host that does not resolve, a missing credential).
    pub unavailable: Option<String>,
    pub tls: bool,
    /// Host name for SNI and the `Host` header.
    pub host: String,
    /// `host[:port]` as written in the base URL (the `Host` header).
    pub authority: String,
    /// Path of the base URL (`/v1`), without a trailing `/`.
    pub base_path: String,
    /// The credential; never logged (Debug prints it redacted).
    pub key: Option<String>,
    /// CA certificates trusted for this provider (`caFile`); `None`: the system's roots.
    pub ca: Option<Arc<CaType>>,
    /// Keeps this provider's pooled connections apart from any other peer's.
    pub group_key: u64,
}

impl std::fmt::Debug for ProviderRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProviderRuntime")
            .field("id", &self.config.id)
            .field("socket", &self.socket)
            .field("unavailable", &self.unavailable)
            .field("tls", &self.tls)
            .field("key", &self.key.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl ProviderRuntime {
    /// Resolve `config`'s address and read its key. `Err`: the configuration itself is wrong
    /// (the snapshot is refused); a provider that is only unreachable for now is built with
    /// `unavailable` set.
    pub(crate) fn build(config: &Provider) -> Result<ProviderRuntime, String> {
        let fail = |message: String| message;
        let (scheme, rest) = config
            .base_url
            .split_once("://")
            .ok_or_else(|| fail(format!("base URL '{}' has no scheme", config.base_url)))?;
        let tls = scheme == "https";
        let (authority, path) = match rest.find('/') {
            Some(at) => rest.split_at(at),
            None => (rest, ""),
        };
        let (host, port) = match authority.rsplit_once(':') {
            Some((host, port)) if !host.ends_with(']') || authority.starts_with('[') => (
                host,
                port.parse::<u16>()
                    .map_err(|_| fail(format!("invalid port in '{}'", config.base_url)))?,
            ),
            _ => (authority, if tls { 443 } else { 80 }),
        };
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let mut unavailable = None;
        let socket = (host.as_str(), port)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next());
        if socket.is_none() {
            unavailable = Some(format!("its host '{host}' does not resolve"));
        }
        let mut read_key = |result: Result<String, String>| match result {
            Ok(key) if !key.trim().is_empty() => Some(key.trim().to_owned()),
            Ok(_) => None,
            Err(reason) => {
                unavailable.get_or_insert(reason);
                None
            }
        };
        let key = match &config.credentials {
            None => None,
            Some(Credentials::File(path)) => read_key(
                std::fs::read_to_string(path)
                    .map_err(|e| format!("its credentials file {path} cannot be read: {e}")),
            ),
            Some(Credentials::Env(name)) => read_key(
                std::env::var(name).map_err(|_| format!("environment variable {name} is not set")),
            ),
            Some(Credentials::Key(value)) => read_key(Ok(value.expose().to_owned())),
            Some(Credentials::Secret(secret)) => read_key(Err(format!(
                "its key lives in Secret {}/{}, which only the control process reads \
                 (switchyard-control serve --kubernetes --read-secrets); outside Kubernetes use \
                 credentials.file or credentials.env",
                secret.name, secret.key
            ))),
        };
        let ca = match &config.ca_file {
            Some(path) if tls => match load_ca(path) {
                Ok(ca) => Some(ca),
                Err(reason) => {
                    unavailable.get_or_insert(reason);
                    None
                }
            },
            _ => None,
        };
        if let Some(reason) = &unavailable {
            tracing::error!(provider = %config.id, %reason, "external provider unavailable");
        }
        Ok(ProviderRuntime {
            config: config.clone(),
            socket,
            unavailable,
            tls,
            host,
            authority: authority.to_owned(),
            base_path: path.trim_end_matches('/').to_owned(),
            key,
            ca,
            group_key: {
                use std::hash::{Hash, Hasher};
                let mut hasher = std::collections::hash_map::DefaultHasher::new();
                (&config.id, &config.ca_file).hash(&mut hasher);
                hasher.finish()
            },
        })
    }
}

/// Read a PEM file of CA certificates for one provider's TLS connections.
fn load_ca(path: &str) -> Result<Arc<CaType>, String> {
    let text = std::fs::read(path).map_err(|e| format!("its caFile {path} cannot be read: {e}"))?;
    let mut reader = std::io::BufReader::new(text.as_slice());
    let mut certificates = Vec::new();
    for item in rustls_pemfile::certs(&mut reader) {
        let der = item.map_err(|e| format!("its caFile {path} is not valid PEM: {e}"))?;
        // pingora's wrapper parses the certificate again and panics on bad DER: check first.
        x509_parser::parse_x509_certificate(der.as_ref())
            .map_err(|e| format!("its caFile {path} holds an invalid certificate: {e}"))?;
        certificates.push(WrappedX509::new(der.to_vec(), parse_x509));
    }
    if certificates.is_empty() {
        return Err(format!("its caFile {path} holds no certificate"));
    }
    Ok(Arc::from(certificates))
}

//! The proxy's side of the control socket: connect, say what it serves, apply each snapshot
//! the control process pushes and answer applied/rejected. While the control process is away
//! the proxy keeps serving its last good snapshot and reconnects with backoff.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use switchyard_snapshot::wire::{self, ControlMessage, ProxyMessage, WireError};
use tokio::net::UnixStream;

use crate::config::{Applied, ConfigStore};

/// First and largest wait between connection attempts.
const BACKOFF_START: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

pub struct ControlClient {
    pub store: Arc<ConfigStore>,
    pub socket: PathBuf,
}

impl ControlClient {
    /// One connection, until it ends. Returns whether a snapshot was received (to reset the
    /// backoff).
    async fn session(&self) -> Result<bool, WireError> {
        let stream = UnixStream::connect(&self.socket).await?;
        let peer = stream.peer_cred().map(|c| c.uid()).ok();
        if !wire::peer_allowed(peer) {
            return Err(WireError::Io(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!("the control socket belongs to uid {peer:?}, not this user or root"),
            )));
        }
        let (mut reader, mut writer) = stream.into_split();
        let current = self.store.current();
        let hello = ProxyMessage::Hello {
            protocol: wire::PROTOCOL_VERSION,
            pid: std::process::id(),
            version: current.as_ref().map_or(0, |t| t.snapshot.version),
            fingerprint: current.as_ref().map(|t| t.snapshot.fingerprint.clone()),
        };
        wire::write_frame(&mut writer, &hello).await?;
        tracing::info!(socket = %self.socket.display(), "connected to the control process");
        let mut received = false;
        while let Some(message) = wire::read_frame::<_, ControlMessage>(&mut reader).await? {
            let ControlMessage::Snapshot { snapshot } = message;
            received = true;
            let version = snapshot.version;
            let answer = match self.store.apply(*snapshot) {
                Ok(Applied::Swapped { version }) => {
                    tracing::info!(version, "snapshot from the control process applied");
                    ProxyMessage::Applied { version }
                }
                Ok(Applied::Unchanged { .. }) => ProxyMessage::Applied { version },
                Err(error) => {
                    tracing::error!(version, %error, "snapshot rejected; keeping the last good one");
                    ProxyMessage::Rejected {
                        version,
                        reason: error.to_string(),
                    }
                }
            };
            wire::write_frame(&mut writer, &answer).await?;
        }
        Ok(received)
    }
}

#[async_trait]
impl BackgroundService for ControlClient {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut backoff = BACKOFF_START;
        loop {
            tokio::select! {
                result = self.session() => {
                    match result {
                        Ok(received) => {
                            tracing::warn!("the control process closed the connection; serving the last good snapshot");
                            if received {
                                backoff = BACKOFF_START;
                            }
                        }
                        Err(error) => tracing::debug!(%error, "control socket unavailable"),
                    }
                }
                _ = shutdown.changed() => return,
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = shutdown.changed() => return,
            }
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }
}

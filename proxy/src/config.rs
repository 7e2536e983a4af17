//! Where the proxy's configuration lives: the current routing table (swapped whole with arc-swap)
//! and the file source that hot-reloads it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use switchyard_snapshot::{ConfigErrors, Snapshot};
use tokio::sync::watch;

use crate::kv::KvRegistry;
use crate::routing::{BuildError, EndpointRegistry, RoutingTable};

/// The embedded default configuration: three local workers, as `switchyard-sim --workers 3` starts them.
pub const EMBEDDED_DEFAULT: &str = include_str!("../../conf/default.yaml");

/// The live configuration. Readers take an `Arc` and keep it for the whole request; background
/// feeds [`subscribe`](ConfigStore::subscribe) to learn of each new table.
pub struct ConfigStore {
    table: ArcSwapOption<RoutingTable>,
    changes: watch::Sender<Option<Arc<RoutingTable>>>,
    registry: EndpointRegistry,
    kv: KvRegistry,
}

impl Default for ConfigStore {
    fn default() -> ConfigStore {
        ConfigStore {
            table: ArcSwapOption::default(),
            changes: watch::Sender::new(None),
            registry: EndpointRegistry::default(),
            kv: KvRegistry::default(),
        }
    }
}

/// What applying a snapshot did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// A new table is live.
    Swapped { version: u64 },
    /// Same content as the live one: nothing changed.
    Unchanged { version: u64 },
}

impl ConfigStore {
    pub fn current(&self) -> Option<Arc<RoutingTable>> {
        self.table.load_full()
    }

    /// The live table now and every table made live from now on.
    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<RoutingTable>>> {
        self.changes.subscribe()
    }

    /// KV state (prefix indexes, tokenizers) of every pool.
    pub fn kv(&self) -> &KvRegistry {
        &self.kv
    }

    /// Make `snapshot` live unless it routes exactly like the current one.
    /// A snapshot with version 0 gets the next version after the current one. Refused (the
    /// current one stays) when a pool's tokenizer or a provider's credentials cannot be loaded.
    pub fn apply(&self, snapshot: Snapshot) -> Result<Applied, BuildError> {
        let current = self.table.load_full();
        let current_version = current.as_ref().map_or(0, |t| t.snapshot.version);
        if let Some(current) = &current
            && current.snapshot.fingerprint == snapshot.fingerprint
        {
            return Ok(Applied::Unchanged {
                version: current_version,
            });
        }
        let snapshot = if snapshot.version == 0 {
            snapshot.with_version(current_version + 1)
        } else {
            snapshot
        };
        let version = snapshot.version;
        let table = RoutingTable::build(Arc::new(snapshot), &self.registry, &self.kv)?;
        let table = Arc::new(table);
        self.table.store(Some(table.clone()));
        self.changes.send_replace(Some(table));
        Ok(Applied::Swapped { version })
    }
}

/// Reads the configuration files: returns a digest of their bytes and the compiled result.
pub fn read_files(paths: &[PathBuf]) -> (String, Result<Snapshot, ConfigErrors>) {
    (
        switchyard_snapshot::parse::files_digest(paths),
        switchyard_snapshot::load_paths(paths),
    )
}

/// Polls configuration files and applies each valid change; an invalid edit is reported and the
/// last good snapshot keeps serving. Polling (rather than inotify) also follows Kubernetes
/// ConfigMap mounts, whose files change by symlink swap.
pub struct FileWatcher {
    pub store: Arc<ConfigStore>,
    pub paths: Vec<PathBuf>,
    pub interval: Duration,
    /// Digest of the files as first loaded, so an edit made before the watcher starts is seen.
    pub loaded_digest: String,
}

impl FileWatcher {
    fn poll(&self, last_digest: &mut String) {
        // Compile only when the files changed, not on every poll.
        let digest = switchyard_snapshot::parse::files_digest(&self.paths);
        if &digest == last_digest {
            return;
        }
        *last_digest = digest;
        match switchyard_snapshot::load_paths(&self.paths) {
            Ok(snapshot) => match self.store.apply(snapshot) {
                Ok(Applied::Swapped { version }) => {
                    tracing::info!(version, "configuration reloaded");
                }
                Ok(Applied::Unchanged { version }) => {
                    tracing::debug!(version, "configuration files changed; routing unchanged");
                }
                Err(error) => {
                    tracing::error!(%error, "configuration rejected; keeping the last good snapshot");
                }
            },
            Err(errors) => errors.log_rejected(),
        }
    }
}

#[async_trait]
impl BackgroundService for FileWatcher {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut last_digest = self.loaded_digest.clone();
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => self.poll(&mut last_digest),
                _ = shutdown.changed() => return,
            }
        }
    }
}

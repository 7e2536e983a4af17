//! `switchyard-control serve`: compile configuration documents and push every new snapshot to
//! the proxies connected on a Unix socket.
//!
//! The socket is created with mode 0600 and every peer must run as this process's user (or
//! root), checked with the kernel's peer credentials. A proxy that connects gets the current
//! snapshot at once (unless its `Hello` says it serves it already) and then each new one;
//! snapshots whose fingerprint did not change are not sent again. An invalid edit is logged with
//! every error and the last good snapshot stays current. The documents come from files (polled)
//! or, with `--kubernetes`, from the API server (see `kubernetes.rs`); both feed one channel.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use switchyard_snapshot::Snapshot;
use switchyard_snapshot::wire::{self, ControlMessage, ProxyMessage};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Unix socket the proxies connect to.
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// How often the files are checked for changes.
    #[arg(long, default_value_t = 1000)]
    reload_interval_ms: u64,
    /// Read the five CRDs and the pools' pods from the Kubernetes API server (KUBECONFIG, or the
    /// in-cluster service account) instead of files.
    #[arg(long, conflicts_with = "paths")]
    pub kubernetes: bool,
    #[command(flatten)]
    pub kube: crate::kubernetes::KubernetesArgs,
    /// Log as JSON lines.
    #[arg(long)]
    pub log_json: bool,
    /// Configuration files or directories.
    #[arg(required_unless_present = "kubernetes", value_name = "PATH")]
    pub paths: Vec<PathBuf>,
}

/// Versions increase across restarts of the control process too: they start from the clock.
pub(crate) fn next_version(previous: u64) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    now.max(previous + 1)
}

/// `initial` is the compiled files; `None` with `--kubernetes`.
pub fn run(args: ServeArgs, initial: Option<Snapshot>) -> anyhow::Result<std::process::ExitCode> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(serve(args, initial))
}

async fn serve(
    args: ServeArgs,
    initial: Option<Snapshot>,
) -> anyhow::Result<std::process::ExitCode> {
    let initial = initial.map(|initial| {
        let initial = initial.with_version(next_version(0));
        tracing::info!(version = initial.version, fingerprint = %initial.fingerprint, "serving snapshot");
        Arc::new(initial)
    });
    let (publish, current) = watch::channel(initial);

    // A stale socket file from an earlier run is replaced; anything else at that path is not.
    if let Ok(metadata) = std::fs::symlink_metadata(&args.socket) {
        use std::os::unix::fs::FileTypeExt;
        anyhow::ensure!(
            metadata.file_type().is_socket(),
            "{} exists and is not a socket",
            args.socket.display()
        );
        std::fs::remove_file(&args.socket)?;
    }
    let listener = UnixListener::bind(&args.socket)
        .with_context(|| format!("cannot listen on {}", args.socket.display()))?;
    std::fs::set_permissions(&args.socket, std::fs::Permissions::from_mode(0o600))?;
    tracing::info!(socket = %args.socket.display(), "control socket ready");

    let mut source = if args.kubernetes {
        tokio::spawn(crate::kubernetes::run(args.kube.clone(), publish))
    } else {
        tokio::spawn(watch_files(
            args.paths.clone(),
            Duration::from_millis(args.reload_interval_ms.max(20)),
            publish,
        ))
    };
    let accept = async {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    let peer_uid = stream.peer_cred().map(|c| c.uid()).ok();
                    if !wire::peer_allowed(peer_uid) {
                        tracing::warn!(?peer_uid, "refused a connection from another user");
                        continue;
                    }
                    tokio::spawn(serve_proxy(stream, current.clone()));
                }
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    };
    let mut code = std::process::ExitCode::SUCCESS;
    tokio::select! {
        _ = accept => {}
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate() => {}
        ended = &mut source => {
            // The Kubernetes source ends only on a setup error (no kubeconfig, say).
            match ended {
                Ok(Err(error)) => tracing::error!("{error:#}"),
                Ok(Ok(())) => tracing::error!("the configuration source stopped"),
                Err(error) => tracing::error!(%error, "the configuration source failed"),
            }
            code = std::process::ExitCode::FAILURE;
        }
    }
    source.abort();
    let _ = std::fs::remove_file(&args.socket);
    Ok(code)
}

async fn terminate() {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut signal) => {
            signal.recv().await;
        }
        Err(_) => std::future::pending().await,
    }
}

async fn watch_files(
    paths: Vec<PathBuf>,
    interval: Duration,
    publish: watch::Sender<Option<Arc<Snapshot>>>,
) -> anyhow::Result<()> {
    let mut last = switchyard_snapshot::parse::files_digest(&paths);
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let now = switchyard_snapshot::parse::files_digest(&paths);
        if now == last {
            continue;
        }
        last = now;
        match switchyard_snapshot::load_paths(&paths) {
            Ok(snapshot) => {
                let previous = publish.borrow().clone();
                if previous.as_ref().map(|p| &p.fingerprint) == Some(&snapshot.fingerprint) {
                    tracing::debug!("files changed; snapshot unchanged");
                    continue;
                }
                let snapshot =
                    snapshot.with_version(next_version(previous.map_or(0, |p| p.version)));
                tracing::info!(version = snapshot.version, fingerprint = %snapshot.fingerprint, "new snapshot");
                publish.send_replace(Some(Arc::new(snapshot)));
            }
            Err(errors) => errors.log_rejected(),
        }
    }
}

/// One proxy connection: send what it lacks, then each new snapshot; log its answers.
async fn serve_proxy(stream: UnixStream, mut current: watch::Receiver<Option<Arc<Snapshot>>>) {
    let (mut reader, mut writer) = stream.into_split();
    let hello = match tokio::time::timeout(
        Duration::from_secs(10),
        wire::read_frame::<_, ProxyMessage>(&mut reader),
    )
    .await
    {
        Ok(Ok(Some(ProxyMessage::Hello {
            protocol,
            pid,
            version,
            fingerprint,
        }))) => {
            if protocol != wire::PROTOCOL_VERSION {
                tracing::warn!(
                    protocol,
                    pid,
                    "proxy speaks another protocol version; closing"
                );
                return;
            }
            tracing::info!(pid, version, "proxy connected");
            (pid, fingerprint)
        }
        Ok(Ok(other)) => {
            tracing::warn!(?other, "expected Hello first; closing");
            return;
        }
        Ok(Err(error)) => {
            tracing::warn!(%error, "bad first frame; closing");
            return;
        }
        Err(_) => {
            tracing::warn!("no Hello within 10 s; closing");
            return;
        }
    };
    let (pid, mut sent_fingerprint) = hello;
    // Acknowledgements are read on their own task so a slow proxy never blocks pushes; the
    // task drops `_gone` when the proxy goes away.
    let (gone, mut gone_rx) = tokio::sync::oneshot::channel::<()>();
    let acks = tokio::spawn(async move {
        let _gone = gone;
        loop {
            match wire::read_frame::<_, ProxyMessage>(&mut reader).await {
                Ok(Some(ProxyMessage::Applied { version })) => {
                    tracing::info!(pid, version, "proxy applied snapshot")
                }
                Ok(Some(ProxyMessage::Rejected { version, reason })) => {
                    tracing::error!(pid, version, %reason, "proxy rejected snapshot; it keeps its last good one")
                }
                Ok(Some(ProxyMessage::Hello { .. })) => {
                    tracing::warn!(pid, "unexpected second Hello")
                }
                Ok(None) => return,
                Err(error) => {
                    tracing::warn!(pid, %error, "bad frame from proxy");
                    return;
                }
            }
        }
    });
    loop {
        // None until the Kubernetes source has built its first snapshot.
        let snapshot = current.borrow_and_update().clone();
        if let Some(snapshot) = snapshot
            && sent_fingerprint.as_deref() != Some(snapshot.fingerprint.as_str())
        {
            let message = ControlMessage::Snapshot {
                snapshot: Box::new((*snapshot).clone()),
            };
            if let Err(error) = wire::write_frame(&mut writer, &message).await {
                tracing::info!(pid, %error, "proxy went away");
                break;
            }
            sent_fingerprint = Some(snapshot.fingerprint.clone());
        }
        tokio::select! {
            changed = current.changed() => if changed.is_err() { break },
            _ = &mut gone_rx => {
                tracing::info!(pid, "proxy disconnected");
                break;
            }
        }
    }
    acks.abort();
}

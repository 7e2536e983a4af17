//! One status writer among the control replicas: a `coordination.k8s.io/v1` Lease.
//!
//! Every proxy pod runs its own control process, and each builds and pushes snapshots on its
//! own; only writing objects' status needs a single voice (replicas that joined at different
//! times know different histories, and two writers would overwrite each other forever). The
//! holder renews the Lease every third of its duration; another replica takes it over once it
//! has not been renewed for a whole duration. Losing the Lease (or the API server) only pauses
//! status writes: routing never depends on it.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::sync::{Notify, watch};

#[derive(clap::Args, Debug, Clone)]
pub struct LeaseArgs {
    /// Name of the Lease that elects the replica writing objects' status.
    #[arg(
        long,
        default_value = "switchyard-control",
        env = "SWITCHYARD_LEASE_NAME"
    )]
    pub lease_name: String,
    /// Seconds a holder keeps the Lease without renewing it.
    #[arg(long, default_value_t = 15)]
    pub lease_duration_s: u32,
    /// This replica's identity in the Lease (default: the pod name, or host name and pid).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
}

fn default_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "control".to_owned());
    format!("{host}-{}", std::process::id())
}

/// Hold the Lease when possible; the receiver says whether this replica holds it, and `gained`
/// is notified each time it starts to.
pub fn elect(
    client: Client,
    namespace: &str,
    args: &LeaseArgs,
    gained: Arc<Notify>,
) -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    let elector = Elector {
        api: Api::namespaced(client, namespace),
        name: args.lease_name.clone(),
        identity: args.identity.clone().unwrap_or_else(default_identity),
        duration: Duration::from_secs(u64::from(args.lease_duration_s.max(1))),
    };
    tokio::spawn(async move {
        tracing::info!(lease = %elector.name, identity = %elector.identity, "joining the status-writer election");
        let mut renewed_at: Option<tokio::time::Instant> = None;
        let mut reported_error = false;
        loop {
            let holding = match elector.try_hold().await {
                Ok(holding) => {
                    reported_error = false;
                    if holding {
                        renewed_at = Some(tokio::time::Instant::now());
                    }
                    holding
                }
                Err(error) => {
                    if !std::mem::replace(&mut reported_error, true) {
                        tracing::warn!(lease = %elector.name, %error, "cannot read or renew the lease (RBAC for leases?)");
                    }
                    // Keep writing only while the last renewal is surely still valid.
                    renewed_at.is_some_and(|at| at.elapsed() < elector.duration / 2)
                }
            };
            if holding != *tx.borrow() {
                if holding {
                    tracing::info!(identity = %elector.identity, "writing objects' status (lease held)");
                    gained.notify_one();
                } else {
                    tracing::info!(identity = %elector.identity, "another replica writes objects' status");
                }
                tx.send_replace(holding);
            }
            tokio::time::sleep(elector.duration / 3).await;
        }
    });
    rx
}

struct Elector {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
}

impl Elector {
    /// Create, renew or take over the Lease; `Ok(false)` when another replica holds it.
    async fn try_hold(&self) -> kube::Result<bool> {
        let now = Timestamp::now();
        let Some(current) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(self.spec(now, now, 0)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(error) if is_conflict(&error) => Ok(false),
                Err(error) => Err(error),
            };
        };
        let spec = current.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.as_deref().unwrap_or("");
        let ours = holder == self.identity;
        let duration =
            SignedDuration::from_secs(i64::from(spec.lease_duration_seconds.unwrap_or(0)));
        let expired = spec
            .renew_time
            .as_ref()
            .and_then(|renewed| renewed.0.checked_add(duration).ok())
            .is_none_or(|until| until < now);
        if !ours && !holder.is_empty() && !expired {
            return Ok(false);
        }
        let (acquired, transitions) = if ours {
            (
                spec.acquire_time.map_or(now, |t| t.0),
                spec.lease_transitions.unwrap_or(0),
            )
        } else {
            (now, spec.lease_transitions.unwrap_or(0) + 1)
        };
        let lease = Lease {
            metadata: current.metadata,
            spec: Some(self.spec(acquired, now, transitions)),
        };
        // The resourceVersion in the metadata makes two replicas' takeovers conflict.
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(true),
            Err(error) if is_conflict(&error) => Ok(false),
            Err(error) => Err(error),
        }
    }

    fn spec(&self, acquired: Timestamp, renewed: Timestamp, transitions: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.duration.as_secs() as i32),
            acquire_time: Some(MicroTime(acquired)),
            renew_time: Some(MicroTime(renewed)),
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        }
    }
}

fn is_conflict(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 409)
}

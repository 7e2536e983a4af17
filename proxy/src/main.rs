//! `switchyard-proxy`: serve the gateway on a Pingora server.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use pingora_core::apps::HttpServerOptions;
use pingora_core::server::Server;
use pingora_core::server::configuration::{Opt, ServerConf};
use pingora_core::services::background::background_service;
use pingora_core::services::listening::Service;
use switchyard_proxy::config::{self, ConfigStore, FileWatcher};
use switchyard_proxy::connection::{ConnectionSettings, Guarded};
use switchyard_proxy::control::ControlClient;
use switchyard_proxy::cors::Cors;
use switchyard_proxy::feeds::KvService;
use switchyard_proxy::gateway::{Gateway, Settings};
use switchyard_proxy::peers::{PeerKey, PeerService};

#[derive(Parser, Debug)]
#[command(
    name = "switchyard-proxy",
    version,
    about = "Inference gateway in front of vLLM workers"
)]
struct Args {
    /// Configuration files or directories of YAML documents; watched and reloaded on change.
    /// Without it the embedded default (conf/default.yaml) is served.
    #[arg(long, value_name = "PATH")]
    config: Vec<PathBuf>,
    /// Address to listen on (HTTP/1.1 and cleartext HTTP/2).
    #[arg(long, default_value = "127.0.0.1:8080", env = "SWITCHYARD_LISTEN")]
    listen: String,
    /// Address of the operator's listener: `/metrics`, `POST /debug/route/...` and the
    /// `x-switchyard-explain` header (plus everything the tenants' listener serves). `off` to
    /// serve none.
    #[arg(
        long,
        default_value = "127.0.0.1:9090",
        env = "SWITCHYARD_ADMIN_LISTEN"
    )]
    admin_listen: String,
    /// Also serve `/metrics`, `/debug/route` and explain output on `--listen` (single-port set-ups
    /// where every client is trusted).
    #[arg(long)]
    admin_on_main_listener: bool,
    /// Longest time to receive a request head, in seconds (from the connection's opening, or
    /// from the first byte of the next request on a kept-alive connection).
    #[arg(long, default_value_t = 10.0)]
    header_timeout_s: f64,
    /// Longest time to receive a request body once its head is in, in seconds.
    #[arg(long, default_value_t = 60.0)]
    body_timeout_s: f64,
    /// Longest wait for the next request on a kept-alive connection, in seconds.
    #[arg(long, default_value_t = 60.0)]
    idle_timeout_s: f64,
    /// Largest request head (request line and header fields), in bytes; larger ones get 431.
    #[arg(long, default_value_t = 64 * 1024)]
    max_header_bytes: usize,
    /// Open client connections at most; more are answered 503 and closed (0: no limit).
    #[arg(long, default_value_t = 10_000)]
    max_connections: usize,
    /// Open client connections at most from one IP address (0: no limit). Behind a load
    /// balancer that does not preserve client addresses, raise it or set 0.
    #[arg(long, default_value_t = 1_000)]
    max_connections_per_client: usize,
    /// Largest request body accepted, in bytes; larger requests get 413.
    #[arg(long, default_value_t = 32 * 1024 * 1024)]
    max_body_bytes: usize,
    /// Origins browser clients may call from, comma-separated (`https://app.example.com`, or
    /// `*` for any); none by default. Preflights are answered by the gateway.
    #[arg(long, default_value = "")]
    cors_allow_origins: String,
    /// Other replicas of this gateway in front of the same workers: `host:port` of their
    /// operator listeners, comma-separated; a name resolves to all its addresses (a Kubernetes
    /// headless Service), this replica among them is skipped. Replicas send each other their
    /// ledgers (prefill pending, requests in flight, KV blocks) as UDP datagrams on those
    /// ports whenever they change, and count the others' in routing like their own.
    #[arg(long, value_delimiter = ',', env = "SWITCHYARD_PEERS")]
    peers: Vec<String>,
    /// How often this replica sends its ledger to the peers when it does not change, and
    /// resolves their names, in milliseconds; one silent for ten of these counts for nothing.
    #[arg(long, default_value_t = 100)]
    peer_interval_ms: u64,
    /// A file holding a key the replicas share (a mounted Secret; at least 16 bytes, leading
    /// and trailing whitespace aside), read at start: every ledger datagram is tagged with
    /// HMAC-SHA256 under it, and one that is not (forged, or from a replica with another key)
    /// or was sent over 30 s ago is dropped. Without it a datagram is believed from any host
    /// the peers' names resolve to.
    #[arg(long, env = "SWITCHYARD_PEERS_KEY_FILE")]
    peers_key_file: Option<PathBuf>,
    /// Whether replicas send each other the token ids of prompt pieces they tokenized (with
    /// `--peers`), so that a long prompt another replica routed first is looked up, not
    /// tokenized again on a request's path. The ids are the prompts' content in another form:
    /// `false` keeps prompt content out of the datagrams (they then carry counts and hashes).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, env = "SWITCHYARD_PEER_PROMPT_PIECES")]
    peer_prompt_pieces: bool,
    /// Responses API: how many response ids the gateway remembers the worker of (each
    /// `previous_response_id` and `/v1/responses/{id}` goes to the worker that made it).
    #[arg(long, default_value_t = 100_000)]
    response_ids_max: usize,
    /// ... and for how long, in seconds.
    #[arg(long, default_value_t = 86_400.0)]
    response_ids_ttl_s: f64,
    /// How often configuration files are checked for changes, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    reload_interval_ms: u64,
    /// Longest silence from a worker before the request fails with 504, in seconds.
    #[arg(long, default_value_t = 600)]
    upstream_read_timeout_s: u64,
    /// Worker threads (default: number of CPUs).
    #[arg(long)]
    threads: Option<usize>,
    /// Seconds to keep serving in-flight requests after SIGTERM.
    #[arg(long, default_value_t = 10)]
    grace_period_s: u64,
    /// Log as JSON lines instead of text.
    #[arg(long)]
    log_json: bool,
    /// Validate the configuration, print every error, and exit.
    #[arg(long)]
    check: bool,
    /// Take snapshots from `switchyard-control serve` on this Unix socket instead of files; the
    /// proxy is not ready until the first snapshot arrives.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["config", "check"])]
    control_socket: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    switchyard_proxy::logging::init(args.log_json);
    // Read once, at start (a new key takes a restart of every replica), and before `--check`
    // answers, which then catches a bad key file too.
    let peers_key = match &args.peers_key_file {
        Some(path) => match PeerKey::from_file(path) {
            Ok(key) => Some(key),
            Err(error) => {
                eprintln!("--peers-key-file: {error}");
                std::process::exit(2);
            }
        },
        None => None,
    };

    let store = Arc::new(ConfigStore::default());
    // With a control socket the proxy starts empty (not ready) and waits for the first snapshot.
    let (loaded_digest, initial) = if args.control_socket.is_some() {
        (String::new(), None)
    } else if args.config.is_empty() {
        (
            String::new(),
            Some(switchyard_snapshot::load_str(
                switchyard_snapshot::EMBEDDED_SOURCE,
                config::EMBEDDED_DEFAULT,
            )),
        )
    } else {
        let (digest, result) = config::read_files(&args.config);
        (digest, Some(result))
    };
    if let Some(initial) = initial {
        let snapshot = match initial {
            Ok(snapshot) => snapshot,
            Err(errors) => {
                eprintln!("{errors}");
                std::process::exit(2);
            }
        };
        let (pools, models) = (snapshot.pools.len(), snapshot.models.len());
        // Building the routing tables also loads each pool's tokenizer, so --check catches a
        // bad path.
        if let Err(error) = store.apply(snapshot) {
            eprintln!("cannot serve the configuration: {error}");
            std::process::exit(2);
        }
        if args.check {
            println!("configuration OK: {pools} pool(s), {models} model(s)");
            return Ok(());
        }
    }

    let conf = ServerConf {
        threads: args
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get())),
        grace_period_seconds: Some(args.grace_period_s),
        graceful_shutdown_timeout_seconds: Some(args.grace_period_s),
        ..ServerConf::default()
    };
    check_listeners(&args.listen, &args.admin_listen)?;
    let mut server = Server::new_with_opt_and_conf(Opt::default(), conf);
    server.bootstrap();

    let seconds = |value: f64, flag: &str| {
        Duration::try_from_secs_f64(value)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| anyhow::anyhow!("--{flag} must be a positive number of seconds"))
    };
    let settings = Settings {
        max_body_bytes: args.max_body_bytes,
        upstream_read_timeout: Duration::from_secs(args.upstream_read_timeout_s),
        body_timeout: seconds(args.body_timeout_s, "body-timeout-s")?,
        cors: Cors::parse(&args.cors_allow_origins)
            .map_err(|e| anyhow::anyhow!("--cors-allow-origins: {e}"))?,
        response_ids_max: args.response_ids_max,
        response_ids_ttl: seconds(args.response_ids_ttl_s, "response-ids-ttl-s")?,
    };
    let connections = ConnectionSettings {
        header_timeout: seconds(args.header_timeout_s, "header-timeout-s")?,
        idle_timeout: seconds(args.idle_timeout_s, "idle-timeout-s")?,
        max_header_bytes: args.max_header_bytes,
        max_connections: args.max_connections,
        max_connections_per_client: args.max_connections_per_client,
        h2c: true,
    };
    // OTLP traces when OTEL_EXPORTER_OTLP_ENDPOINT is set; kept alive until the process ends.
    let telemetry = switchyard_proxy::telemetry::Telemetry::from_env()?;
    let gateway =
        Gateway::new(store.clone(), settings).with_tracer(telemetry.as_ref().map(|t| t.tracer()));
    let admin = (args.admin_listen != "off").then(|| gateway.admin_listener());
    let gateway = gateway.with_admin(args.admin_on_main_listener);
    let server_conf = server.configuration.clone();
    // Both listeners count their connections into the gateway's metrics.
    let metrics = gateway.metrics().clone();
    let listener = |gateway: Gateway, name: &str, address: &str| {
        let mut app = pingora_proxy::http_proxy(&server_conf, gateway);
        let mut server_options = HttpServerOptions::default();
        server_options.h2c = true;
        server_options.h2_idle_timeout = Some(connections.idle_timeout);
        app.server_options = Some(server_options);
        let guarded = Guarded::new(app, connections.clone(), metrics.clone());
        let mut service = Service::new(name.to_owned(), guarded);
        service.add_tcp(address);
        service
    };
    let main_listener = listener(gateway, "switchyard-proxy", &args.listen);
    server.add_service(main_listener);
    if let Some(admin) = admin {
        let admin_listener = listener(admin, "switchyard-proxy admin", &args.admin_listen);
        server.add_service(admin_listener);
    }

    server.add_service(background_service(
        "kv events and worker metrics",
        KvService {
            store: store.clone(),
        },
    ));

    let peers: Vec<String> = args
        .peers
        .iter()
        .map(|peer| peer.trim().to_owned())
        .filter(|peer| !peer.is_empty())
        .collect();
    if !peers.is_empty() {
        if peers_key.is_none() {
            tracing::warn!(
                "the ledger datagrams between replicas are not authenticated: give every replica the same --peers-key-file"
            );
        }
        server.add_service(background_service(
            "peer ledgers",
            PeerService {
                store: store.clone(),
                peers,
                // Datagrams arrive on the operator listener's port; without that listener, on
                // any port (the peers learn it from this replica's datagrams).
                bind: if args.admin_listen == "off" {
                    "[::]:0".to_owned()
                } else {
                    args.admin_listen.clone()
                },
                interval: Duration::from_millis(args.peer_interval_ms.max(10)),
                key: peers_key,
                prompt_pieces: args.peer_prompt_pieces,
                datagrams: metrics.peer_datagrams(),
                pieces: metrics.peer_pieces(),
            },
        ));
    }

    if let Some(socket) = &args.control_socket {
        server.add_service(background_service(
            "control socket",
            ControlClient {
                store: store.clone(),
                socket: socket.clone(),
            },
        ));
    } else if !args.config.is_empty() {
        let watcher = FileWatcher {
            store,
            paths: args.config.clone(),
            interval: Duration::from_millis(args.reload_interval_ms.max(50)),
            loaded_digest,
        };
        server.add_service(background_service("config watcher", watcher));
    }

    if let Some(telemetry) = &telemetry {
        server.add_service(background_service("trace flush", telemetry.flusher()));
    }

    tracing::info!(listen = %args.listen, admin = %args.admin_listen, "switchyard-proxy starting");
    server.run_forever();
}

/// Pingora binds each listener on its own service thread and only logs a failure, so a taken,
/// malformed or shared address would leave the proxy running without that listener (an admin
/// address equal to the main one answered `/metrics` with the tenants' 404). Bind both here
/// first, the main one held while the admin one binds, and refuse to start on any error.
fn check_listeners(listen: &str, admin_listen: &str) -> anyhow::Result<()> {
    let bind = |flag: &str, address: &str| {
        std::net::TcpListener::bind(address)
            .map_err(|error| anyhow::anyhow!("cannot listen on --{flag} {address}: {error}"))
    };
    let main = bind("listen", listen)?;
    if admin_listen != "off" {
        drop(bind("admin-listen", admin_listen)?);
    }
    drop(main);
    Ok(())
}

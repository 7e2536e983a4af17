//! Building and running the real `switchyard-*` binaries as child processes.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The workspace root (this crate lives in `<root>/tests`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// A port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> u16 {
    let [port] = free_ports();
    port
}

/// `N` distinct ports that were free a moment ago on 127.0.0.1: each listener is held until
/// all are bound (two separate [`free_port`] calls can return the same port).
pub fn free_ports<const N: usize>() -> [u16; N] {
    let listeners: [TcpListener; N] =
        std::array::from_fn(|_| TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0"));
    listeners.map(|listener| listener.local_addr().expect("local addr").port())
}

/// Path of a workspace binary, built once per test process with the same profile as the tests.
pub fn binary(name: &str) -> PathBuf {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let dir = BUILT
        .get_or_init(|| {
            let root = workspace_root();
            let target = std::env::var_os("CARGO_TARGET_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| root.join("target"));
            let profile_dir = target.join(if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            });
            if std::env::var_os("SWITCHYARD_SKIP_BUILD").is_none() {
                let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
                let mut command = Command::new(cargo);
                command
                    .current_dir(&root)
                    .args(["build", "--bins", "--quiet"]);
                if !cfg!(debug_assertions) {
                    command.arg("--release");
                }
                let status = command.status().map_err(|e| format!("cargo build: {e}"))?;
                if !status.success() {
                    return Err(format!("cargo build --bins failed: {status}"));
                }
            }
            Ok(profile_dir)
        })
        .clone()
        .expect("workspace binaries build");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} not found; run `cargo build --bins`",
        path.display()
    );
    path
}

/// A running `switchyard-proxy`, killed on drop. Its stderr is collected for assertions.
pub struct Proxy {
    child: Child,
    pub port: u16,
    /// The operator's listener (`/metrics`, `/debug/route`, explain output).
    pub admin_port: u16,
    pub config_dir: tempfile::TempDir,
    pub config_path: PathBuf,
    log: Arc<Mutex<String>>,
}

impl Proxy {
    /// Start the proxy on a free port with `config_yaml` written to a temp file, plus `args`;
    /// returns once `/ready` answers 200 and the admin listener answers `/metrics`.
    pub async fn start(config_yaml: &str, args: &[&str]) -> Proxy {
        Proxy::start_with_env(config_yaml, args, &[]).await
    }

    /// [`Proxy::start`] with extra environment variables.
    pub async fn start_with_env(config_yaml: &str, args: &[&str], env: &[(&str, &str)]) -> Proxy {
        let config_dir = tempfile::tempdir().expect("tempdir");
        let config_path = config_dir.path().join("switchyard.yaml");
        std::fs::write(&config_path, config_yaml).expect("write config");
        let config_arg = config_path.display().to_string();
        let mut all = vec!["--config", config_arg.as_str()];
        all.extend_from_slice(args);
        Proxy::spawn(config_dir, config_path, &all, env).await
    }

    /// Start the proxy fed by `switchyard-control serve` on `socket`; returns once it is ready
    /// (that is, once the first snapshot arrived).
    pub async fn start_with_control(socket: &std::path::Path, args: &[&str]) -> Proxy {
        let config_dir = tempfile::tempdir().expect("tempdir");
        let config_path = config_dir.path().join("unused.yaml");
        let socket_arg = socket.display().to_string();
        let mut all = vec!["--control-socket", socket_arg.as_str()];
        all.extend_from_slice(args);
        Proxy::spawn(config_dir, config_path, &all, &[]).await
    }

    async fn spawn(
        mut config_dir: tempfile::TempDir,
        mut config_path: PathBuf,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Proxy {
        // Another test's process can take a port between its check here and the proxy's own
        // check; the proxy then refuses to start ("cannot listen"), and a fresh pair is tried.
        // (One taken after that check, before Pingora binds, is not caught: `wait_ready` fails.)
        let mut attempt = 0;
        loop {
            attempt += 1;
            let [port, admin_port] = free_ports();
            let mut child = Command::new(binary("switchyard-proxy"))
                .args([
                    "--listen",
                    &format!("127.0.0.1:{port}"),
                    "--admin-listen",
                    &format!("127.0.0.1:{admin_port}"),
                    "--threads",
                    "2",
                    "--grace-period-s",
                    "1",
                ])
                .args(args)
                .env("RUST_LOG", "info")
                .envs(env.iter().copied())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn switchyard-proxy");
            let log = capture_stderr(&mut child, "proxy");
            let mut proxy = Proxy {
                child,
                port,
                admin_port,
                config_dir,
                config_path,
                log,
            };
            match proxy.wait_ready(Duration::from_secs(30)).await {
                Ok(()) => return proxy,
                Err(log) if attempt < 3 && log.contains("cannot listen") => {
                    // Keep the config for the next attempt; dropping `proxy` kills the child.
                    let spare = tempfile::tempdir().expect("tempdir");
                    config_dir = std::mem::replace(&mut proxy.config_dir, spare);
                    config_path = std::mem::take(&mut proxy.config_path);
                }
                Err(log) => panic!("switchyard-proxy exited early; log:\n{log}"),
            }
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The admin listener's base URL: `/metrics`, `/debug/route`, and where
    /// `x-switchyard-explain` is honoured.
    pub fn admin_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.admin_port)
    }

    /// The proxy's Prometheus exposition (`GET /metrics` on the admin listener).
    pub async fn metrics(&self) -> String {
        reqwest::get(format!("{}/metrics", self.admin_url()))
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("/metrics body")
    }

    /// The routing the proxy would do for the chat request `body`, as the tenant of `key` when
    /// given, without sending it (`POST /debug/route/v1/chat/completions`, which must answer 200).
    pub async fn debug_route(
        &self,
        key: Option<&str>,
        body: &serde_json::Value,
    ) -> serde_json::Value {
        self.debug_route_at("/v1/chat/completions", key, body).await
    }

    /// [`Proxy::debug_route`] for a request to `path` (`/v1/completions`, `/v1/messages`).
    pub async fn debug_route_at(
        &self,
        path: &str,
        key: Option<&str>,
        body: &serde_json::Value,
    ) -> serde_json::Value {
        let mut request =
            reqwest::Client::new().post(format!("{}/debug/route{path}", self.admin_url()));
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        let response = request.json(body).send().await.expect("POST /debug/route");
        assert_eq!(response.status(), 200);
        response.json().await.expect("/debug/route body")
    }

    /// The snapshot version `/ready` reports.
    pub async fn config_version(&self) -> u64 {
        let ready: serde_json::Value = reqwest::get(format!("{}/ready", self.url()))
            .await
            .expect("GET /ready")
            .json()
            .await
            .expect("/ready JSON");
        ready["config_version"].as_u64().expect("config_version")
    }

    /// Send chat requests for `model` until `upstream` answers one, or panic after 20 s.
    pub async fn wait_served_by(&self, model: &str, key: Option<&str>, upstream: &str) {
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let answer = crate::served_by(&http, &self.url(), model, key).await;
            if answer.as_deref() == Ok(upstream) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{model} never routed to {upstream}; last answer {answer:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Everything the proxy has logged so far.
    pub fn log(&self) -> String {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Wait until the log contains `needle`, or panic at the deadline.
    pub async fn wait_for_log(&self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.log().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "proxy never logged {needle:?}; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Wait until the proxy has subscribed to `workers` KV event streams, and a moment more: a
    /// ZMQ subscriber misses what is published before its subscription reaches the publisher,
    /// and a test that sends one request and then waits for its events would wait forever.
    pub async fn wait_subscribed(&self, workers: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.log().matches("subscribed to KV events").count() < workers {
            assert!(
                Instant::now() < deadline,
                "proxy never subscribed to {workers} event streams; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    /// Replace the config file atomically (write then rename), as editors and ConfigMaps do.
    pub fn write_config(&self, yaml: &str) {
        let temp = self.config_dir.path().join(".switchyard.yaml.tmp");
        std::fs::write(&temp, yaml).expect("write config");
        std::fs::rename(&temp, &self.config_path).expect("rename config");
    }

    /// Wait for both listeners; the log as the error when the proxy exited first.
    async fn wait_ready(&mut self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        let client = reqwest::Client::new();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                // Let the stderr reader catch up with the last lines.
                tokio::time::sleep(Duration::from_millis(100)).await;
                return Err(format!("exit status {status}\n{}", self.log()));
            }
            // Both listeners: Pingora starts the admin service on its own thread, so the main
            // listener can answer before the admin one (`/debug/route`, `/metrics`) is bound.
            let answers = |url: String| {
                let request = client.get(url).send();
                async move { request.await.is_ok_and(|r| r.status() == 200) }
            };
            if answers(format!("{}/ready", self.url())).await
                && answers(format!("{}/metrics", self.admin_url())).await
            {
                return Ok(());
            }
            assert!(
                Instant::now() < deadline,
                "switchyard-proxy not ready in {timeout:?}; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Echo a child's stderr with a `[name]` prefix and collect it for assertions.
fn capture_stderr(child: &mut Child, name: &'static str) -> Arc<Mutex<String>> {
    let log = Arc::new(Mutex::new(String::new()));
    if let Some(stderr) = child.stderr.take() {
        let log = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[{name}] {line}");
                if let Ok(mut log) = log.lock() {
                    log.push_str(&line);
                    log.push('\n');
                }
            }
        });
    }
    log
}

/// A running `switchyard-control serve`, killed on drop; its stderr is collected.
pub struct Control {
    child: Child,
    log: Arc<Mutex<String>>,
}

impl Control {
    /// Serve the documents at `config` (polled every 50 ms) on `socket`.
    pub async fn start_files(socket: &Path, config: &Path) -> Control {
        let config = config.display().to_string();
        Control::start(socket, &["--reload-interval-ms", "50", &config], &[]).await
    }

    /// `switchyard-control serve --socket <socket> <args>` with `env`; returns once the socket
    /// exists.
    pub async fn start(socket: &Path, args: &[&str], env: &[(&str, &str)]) -> Control {
        let _ = std::fs::remove_file(socket);
        let mut child = Command::new(binary("switchyard-control"))
            .arg("serve")
            .arg("--socket")
            .arg(socket)
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn switchyard-control");
        let log = capture_stderr(&mut child, "control");
        let mut control = Control { child, log };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !socket.exists() {
            if let Ok(Some(status)) = control.child.try_wait() {
                panic!(
                    "switchyard-control exited with {status}:\n{}",
                    control.log()
                );
            }
            assert!(Instant::now() < deadline, "control socket never appeared");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        control
    }

    pub fn log(&self) -> String {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Wait until the log holds `needle` at least `count` times, or panic after 20 s.
    pub async fn wait_log_count(&self, needle: &str, count: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.log().matches(needle).count() < count {
            assert!(
                Instant::now() < deadline,
                "control never logged {needle:?} {count} times:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kill it at once (SIGKILL), as a crash or an OOM kill would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One simulated worker's addresses, as `switchyard-sim` prints them.
#[derive(Debug, Clone)]
pub struct SimWorker {
    pub http: String,
    pub kv_events: Option<String>,
    pub kv_replay: Option<String>,
}

impl SimWorker {
    pub fn url(&self) -> String {
        format!("http://{}", self.http)
    }

    /// This worker as a pool endpoint in YAML flow style: its address, KV events and replay
    /// (its address alone when it publishes none: `--no-kv-events`).
    pub fn endpoint_yaml(&self) -> String {
        if self.kv_events.is_none() {
            return format!("\"{}\"", self.http);
        }
        format!(
            "{{address: \"{}\", kvEvents: \"{}\", kvReplay: \"{}\"}}",
            self.http,
            self.kv_events
                .as_deref()
                .expect("the simulator publishes KV events"),
            self.kv_replay
                .as_deref()
                .expect("the simulator replays KV events")
        )
    }
}

/// A running `switchyard-sim`, killed on drop.
pub struct Sim {
    child: Child,
    pub model: String,
    pub workers: Vec<SimWorker>,
}

impl Sim {
    /// Every worker as a pool endpoint, comma-separated (for `endpoints: [...]`).
    pub fn endpoints_yaml(&self) -> String {
        self.workers
            .iter()
            .map(SimWorker::endpoint_yaml)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Start `switchyard-sim` with ephemeral ports plus `args`; returns once it printed its addresses.
    pub fn start(args: &[&str]) -> Sim {
        let mut child = Command::new(binary("switchyard-sim"))
            .args([
                "--port",
                "0",
                "--kv-events-port",
                "0",
                "--kv-replay-port",
                "0",
            ])
            .args(args)
            .current_dir(workspace_root())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn switchyard-sim");
        let stdout = child.stdout.take().expect("sim stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read sim addresses");
        let value: serde_json::Value = match serde_json::from_str(&line) {
            Ok(value) => value,
            Err(e) => {
                let _ = child.kill();
                panic!("switchyard-sim did not print its addresses ({e}): {line:?}");
            }
        };
        let text = |v: &serde_json::Value| v.as_str().map(str::to_owned);
        let workers = value["workers"]
            .as_array()
            .expect("workers")
            .iter()
            .map(|w| SimWorker {
                http: text(&w["http"]).expect("http"),
                kv_events: text(&w["kv_events"]),
                kv_replay: text(&w["kv_replay"]),
            })
            .collect();
        Sim {
            child,
            model: text(&value["model"]).unwrap_or_default(),
            workers,
        }
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

//! Throwaway PostgreSQL and Redis servers started from the locally installed binaries, for
//! `pgfence simulate` and for tests when no `DATABASE_URL` / `REDIS_URL` is given.
//!
//! Each server runs under a small `sh` supervisor that owns a fresh temporary directory. The
//! supervisor's stdin is a pipe from this process: when this process exits — normally, by
//! panic, or killed — the pipe closes and the supervisor stops the server and deletes the
//! directory. Nothing is left behind, even without `Drop` running. The supervisor runs in its
//! own process group, so a Ctrl-C at the terminal reaches only this process, which then shuts
//! the servers down in order.
//!
//! PostgreSQL refuses to run as root; when this process is root the supervisor runs as the
//! `postgres` user (through `runuser`).
//!
//! [`PgBouncer`] puts Debian's PgBouncer in front of a PostgreSQL, in transaction or session
//! mode. [`Provider`] is a fake payment API that honours `Idempotency-Key`. [`Proxy`] is a
//! loopback TCP proxy that drops or stalls the connections through it, for
//! resilience tests, and can be pointed at another server. [`PgReplicaSet`] is a primary and a
//! streaming standby behind such a proxy, to fail PostgreSQL over for real.
//! [`PatroniCluster`] is a real Patroni cluster (the installed package, an etcd as its DCS)
//! with a proxy that follows its leader.
//!
//! Sentinel, etcd, ZooKeeper, PgBouncer and Patroni are optional: their start functions take
//! the proof [`needs`] hands a test (or prints the test's skip line, naming the Debian package
//! to install), so no test can start one without having asked ([`optional`]).

mod certs;
pub mod clock;
mod etcd;
pub mod optional;
mod patroni;
mod pgbouncer;
mod process;
pub mod provider;
mod redis_tls;
mod replica;
mod sentinel;
mod zk;

pub use certs::Certs;
pub use etcd::{ETCD_ELECTION_MS, ETCD_HEARTBEAT_MS, EtcdCluster, EtcdMember};
pub use optional::{Installed, needs};
pub use patroni::{PATRONI_LOOP_WAIT_S, PATRONI_TTL_S, PatroniCluster, PatroniConfig};
pub use pgbouncer::{PgBouncer, PoolMode};
pub use provider::Provider;
pub use redis_tls::{ClientAuth, RedisTls, RedisTlsCluster, SentinelTls};
pub use replica::{Failover, PgReplicaSet, Replication};
pub use sentinel::{RedisNode, SentinelConfig, SentinelSet};
pub use zk::{
    ZK_MAX_SESSION_TIMEOUT_MS, ZK_MIN_SESSION_TIMEOUT_MS, ZK_TICK_MS, ZkEnsemble, ZkMember,
};

use std::io::Read;
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use process::Supervisor;

/// Why a throwaway server could not be started.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// The server binaries are not installed (or not where we look).
    #[error("{what} not found: {hint}")]
    NotInstalled {
        /// What is missing.
        what: &'static str,
        /// What to install, or which URL to set instead.
        hint: &'static str,
    },
    /// The server did not come up.
    #[error("{what} did not start: {detail}")]
    StartFailed {
        /// Which server.
        what: &'static str,
        /// Its output, or what timed out.
        detail: String,
    },
    /// An operation on running servers (a query, a promotion, a kill) failed or timed out.
    #[error("{what}: {detail}")]
    Operation {
        /// Which server, or which tool.
        what: &'static str,
        /// What failed, or what timed out.
        detail: String,
    },
    /// Spawning or talking to the supervisor failed.
    #[error("throwaway server I/O: {0}")]
    Io(#[from] std::io::Error),
}

const PG_HINT: &str = "install the PostgreSQL server (Debian: apt-get install postgresql), \
    set PGFENCE_PG_BINDIR to its bin directory, or set DATABASE_URL to use a running server";
const REDIS_HINT: &str = "install Redis (Debian: apt-get install redis-server), or set REDIS_URL to use a running server";

/// Which kind of server a [`Server`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// PostgreSQL.
    Postgres,
    /// Redis (standalone or a cluster node).
    Redis,
}

/// A running throwaway server. Dropping it stops the server and removes its directory.
#[derive(Debug)]
pub struct Server {
    kind: Kind,
    port: u16,
    supervisor: Supervisor,
    /// The CA a TLS-only server's certificate is signed by (`None`: plaintext server).
    ca: Option<PathBuf>,
}

/// How a throwaway PostgreSQL is set up.
#[derive(Debug, Default)]
struct PgSetup {
    /// `(server certificate, key, CA)`: `ssl = on`, TCP over TLS only.
    tls: Option<(PathBuf, PathBuf, PathBuf)>,
    /// Make the data directory with `pg_basebackup -R` from the server on this port of
    /// 127.0.0.1 (a streaming standby of it) instead of `initdb`.
    standby_of: Option<u16>,
    /// More `-c name=value` settings, given after the defaults (so they win over them).
    settings: Vec<String>,
}

impl Server {
    /// Starts a throwaway PostgreSQL (superuser `postgres`, trust auth, fsync off).
    ///
    /// # Errors
    /// [`ServerError::NotInstalled`] when no PostgreSQL server binaries are found;
    /// [`ServerError::StartFailed`] when it does not come up within 60 s.
    pub async fn postgres() -> Result<Self, ServerError> {
        Self::postgres_with(&PgSetup::default()).await
    }

    /// Starts a throwaway PostgreSQL with `ssl = on` and the certificates of `certs`, which
    /// accepts TCP connections over TLS only (`hostssl` lines, no `host` line): user `certuser`
    /// must present a client certificate of `certs` (`cert` authentication); every other user
    /// is trusted once on TLS. [`Server::url`] then has `sslmode=verify-full` and the CA.
    ///
    /// # Errors
    /// As [`Server::postgres`].
    pub async fn postgres_tls(certs: &Certs) -> Result<Self, ServerError> {
        let mut server = Self::postgres_with(&PgSetup {
            tls: Some((certs.server_cert(), certs.server_key(), certs.ca())),
            ..PgSetup::default()
        })
        .await?;
        server.ca = Some(certs.ca());
        Ok(server)
    }

    async fn postgres_with(setup: &PgSetup) -> Result<Self, ServerError> {
        let bindir = postgres_bindir()?;
        let (tls_setup, tls_args) = match &setup.tls {
            None => (String::new(), String::new()),
            Some((cert, key, ca)) => (
                format!(
                    r#"cp {cert} "$dir/server.crt" && cp {key} "$dir/server.key" && cp {ca} "$dir/ca.crt" && chmod 600 "$dir/server.key" || exit 1
printf 'local all all trust\nhostssl all certuser 127.0.0.1/32 cert\nhostssl all all 127.0.0.1/32 trust\nhostnossl all all 0.0.0.0/0 reject\n' >"$dir/hba.conf"
"#,
                    cert = sh_quote(cert),
                    key = sh_quote(key),
                    ca = sh_quote(ca)
                ),
                " -c ssl=on -c ssl_cert_file=\"$dir/server.crt\" -c ssl_key_file=\"$dir/server.key\" \
                 -c ssl_ca_file=\"$dir/ca.crt\" -c hba_file=\"$dir/hba.conf\""
                    .to_owned(),
            ),
        };
        let run_as_postgres = is_root();
        let init = match setup.standby_of {
            None => format!(
                "{bin}/initdb -D \"$dir/data\" -U postgres -A trust -E UTF8 --no-sync",
                bin = sh_quote(&bindir)
            ),
            Some(primary) => format!(
                "{bin}/pg_basebackup -h 127.0.0.1 -p {primary} -U postgres -D \"$dir/data\" -R \
                 -X stream -c fast --no-sync && chmod 700 \"$dir/data\"",
                bin = sh_quote(&bindir)
            ),
        };
        let settings: String = setup
            .settings
            .iter()
            .map(|s| format!(" -c {}", sh_quote(Path::new(s))))
            .collect();
        retry_on_port_clash(Kind::Postgres, |port| {
            let script = format!(
                r#"set -u
umask 077
dir=$(mktemp -d /tmp/pgfence-pg.XXXXXX) || exit 1
trap 'rm -rf "$dir"' EXIT
{init} >"$dir/init.log" 2>&1 || {{ cat "$dir/init.log" >&2; exit 1; }}
{tls_setup}{supervise}"#,
                supervise = supervise(&format!(
                    "{bin}/postgres -D \"$dir/data\" -p {port} -k \"$dir\" -c listen_addresses=127.0.0.1 \
                     -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=400{tls_args}{settings}",
                    bin = sh_quote(&bindir)
                ), "INT"),
            );
            if run_as_postgres {
                let mut c = Command::new("runuser");
                c.args(["-u", "postgres", "--", "sh", "-c", &script]);
                c
            } else {
                let mut c = Command::new("sh");
                c.args(["-c", &script]);
                c
            }
        })
        .await
    }

    /// Starts a throwaway Redis that keeps nothing on disk.
    ///
    /// # Errors
    /// As [`Server::postgres`].
    pub async fn redis() -> Result<Self, ServerError> {
        Self::redis_with(&[]).await
    }

    /// Starts a throwaway Redis with extra `redis-server` arguments (e.g. cluster mode).
    /// `PGFENCE_REDIS_SERVER` names the `redis-server` binary to run (else it is looked up on
    /// `PATH`); naming one that does not exist acts as a machine without Redis.
    ///
    /// # Errors
    /// As [`Server::postgres`].
    pub async fn redis_with(extra: &[&str]) -> Result<Self, ServerError> {
        let bin = match std::env::var_os("PGFENCE_REDIS_SERVER").filter(|v| !v.is_empty()) {
            Some(path) => Some(PathBuf::from(path)).filter(|p| p.is_file()),
            None => find_in_path("redis-server"),
        }
        .ok_or(ServerError::NotInstalled {
            what: "redis-server",
            hint: REDIS_HINT,
        })?;
        retry_on_port_clash(Kind::Redis, |port| {
            let mut server = format!(
                "{} --port {port} --bind 127.0.0.1 --save '' --appendonly no --dir \"$dir\" --daemonize no",
                sh_quote(&bin)
            );
            for arg in extra {
                server.push(' ');
                server.push_str(&sh_quote(Path::new(arg)));
            }
            let script = format!(
                r#"set -u
dir=$(mktemp -d "${{TMPDIR:-/tmp}}/pgfence-redis.XXXXXX") || exit 1
trap 'rm -rf "$dir"' EXIT
{}"#,
                supervise(&server, "TERM")
            );
            let mut cmd = Command::new("sh");
            cmd.args(["-c", &script]);
            cmd
        })
        .await
    }

    /// Waits until the server accepts connections.
    async fn wait_ready(&mut self, timeout: Duration) -> Result<(), ServerError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.supervisor.try_wait()? {
                let detail = format!("exited with {status}: {}", self.supervisor.failure_output());
                return Err(ServerError::StartFailed {
                    what: self.kind.name(),
                    detail,
                });
            }
            if self.accepts_connections() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(ServerError::StartFailed {
                    what: self.kind.name(),
                    detail: format!("not accepting connections after {timeout:?}"),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn accepts_connections(&self) -> bool {
        let Ok(mut stream) = TcpStream::connect((Ipv4Addr::LOCALHOST, self.port)) else {
            return false;
        };
        match self.kind {
            // A connection is accepted before recovery ends; the socket file shows readiness.
            Kind::Postgres => {
                self.dir().join(format!(".s.PGSQL.{}", self.port)).exists() && {
                    // postmaster.pid's 8th line is "ready" once it accepts queries ("standby"
                    // for a hot standby that accepts read-only ones).
                    std::fs::read_to_string(self.dir().join("data/postmaster.pid"))
                        .map(|pid| {
                            pid.lines()
                                .nth(7)
                                .is_some_and(|l| matches!(l.trim(), "ready" | "standby"))
                        })
                        .unwrap_or(false)
                }
            }
            Kind::Redis => {
                use std::io::Write;
                let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
                let mut buf = [0u8; 64];
                stream.write_all(b"PING\r\n").is_ok()
                    && stream
                        .read(&mut buf)
                        .is_ok_and(|n| buf[..n].starts_with(b"+PONG"))
            }
        }
    }

    /// The server's kind.
    #[must_use]
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// TCP port on 127.0.0.1.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's temporary directory (removed when it stops).
    #[must_use]
    pub fn dir(&self) -> &Path {
        self.supervisor.dir()
    }

    /// The server's log (its stdout and stderr: PostgreSQL logs there by default), for tests
    /// that check what the server said about its clients. Rewritten by [`Server::restart`].
    #[must_use]
    pub fn log_path(&self) -> PathBuf {
        self.dir().join("server.log")
    }

    /// A connection URL: `postgres://postgres@127.0.0.1:PORT/postgres` (with
    /// `?sslmode=verify-full&sslrootcert=CA` for [`Server::postgres_tls`]) or
    /// `redis://127.0.0.1:PORT`.
    #[must_use]
    pub fn url(&self) -> String {
        match self.kind {
            Kind::Postgres => match &self.ca {
                None => format!("postgres://postgres@127.0.0.1:{}/postgres", self.port),
                Some(ca) => format!(
                    "postgres://postgres@127.0.0.1:{}/postgres?sslmode=verify-full&sslrootcert={}",
                    self.port,
                    ca.display()
                ),
            },
            Kind::Redis => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    /// Restarts the server in place (same port and data directory), as a crash-restart would.
    /// A Redis server comes back empty, like a failover that lost its writes.
    ///
    /// # Errors
    /// [`ServerError`] when it does not come back.
    pub async fn restart(&mut self) -> Result<(), ServerError> {
        let pid = std::fs::read_to_string(self.dir().join("pid"))?;
        let signal = if self.kind == Kind::Postgres {
            "-INT"
        } else {
            "-TERM"
        };
        let status = Command::new("kill").args([signal, pid.trim()]).status()?;
        if !status.success() {
            return Err(ServerError::StartFailed {
                what: self.kind.name(),
                detail: "could not signal".into(),
            });
        }
        // Wait for it to go down, then up again.
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.accepts_connections() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.wait_ready(Duration::from_secs(60)).await
    }

    /// Stops the server and removes its directory, waiting until both are done.
    pub fn stop(mut self) {
        self.supervisor.shutdown();
    }
}

/// `configured` when it is a non-empty URL (e.g. from `DATABASE_URL`), else the URL of a new
/// throwaway server of `kind`, returned with the server: keep it alive while you use the URL.
///
/// # Errors
/// As [`Server::postgres`] / [`Server::redis`].
pub async fn url_or_start(
    kind: Kind,
    configured: Option<&str>,
) -> Result<(String, Option<Server>), ServerError> {
    if let Some(url) = configured.filter(|u| !u.is_empty()) {
        return Ok((url.to_owned(), None));
    }
    let server = match kind {
        Kind::Postgres => Server::postgres().await?,
        Kind::Redis => Server::redis().await?,
    };
    Ok((server.url(), Some(server)))
}

/// Sends `signal` (`-STOP`, `-CONT`, `-KILL`, ...) with `kill(1)` to process `pid` alone: for
/// tests that pause, resume or kill a process they started themselves (a worker), by its PID.
///
/// # Errors
/// [`ServerError::StartFailed`] when `kill` failed (no such process);
/// [`ServerError::Io`] when `kill` could not be run.
pub fn signal_pid(pid: u32, signal: &str) -> Result<(), ServerError> {
    process::signal("process", Some(pid), signal, String::new).map(|_| ())
}

/// A local Redis Cluster of throwaway masters (no replicas), for cluster tests.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<Server>,
}

impl RedisCluster {
    /// Starts `masters` (at least 3) cluster-enabled servers and joins them with
    /// `redis-cli --cluster create`, then waits until every node reports `cluster_state:ok`.
    ///
    /// # Errors
    /// [`ServerError`] when a node does not start or the cluster does not form.
    pub async fn start(masters: usize) -> Result<Self, ServerError> {
        let cli = find_in_path("redis-cli").ok_or(ServerError::NotInstalled {
            what: "redis-cli",
            hint: REDIS_HINT,
        })?;
        let mut nodes = Vec::with_capacity(masters);
        for _ in 0..masters {
            nodes.push(
                Server::redis_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ])
                .await?,
            );
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let out = Command::new(&cli)
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()?;
        if !out.status.success() {
            return Err(ServerError::StartFailed {
                what: "redis cluster",
                detail: String::from_utf8_lossy(&out.stdout).into_owned()
                    + &String::from_utf8_lossy(&out.stderr),
            });
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        for node in &nodes {
            loop {
                let info = Command::new(&cli)
                    .args(["-p", &node.port().to_string(), "cluster", "info"])
                    .output()?;
                if String::from_utf8_lossy(&info.stdout).contains("cluster_state:ok") {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(ServerError::StartFailed {
                        what: "redis cluster",
                        detail: "cluster_state never ok".into(),
                    });
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(Self { nodes })
    }

    /// `redis://` URLs of every node.
    #[must_use]
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(Server::url).collect()
    }
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Postgres => "PostgreSQL",
            Kind::Redis => "redis-server",
        }
    }
}

/// The supervisor loop shared by both servers: run `server` in the background, restart it
/// when it exits cleanly without a stop request (that is [`Server::restart`]), stop it with
/// `signal` when stdin closes, report its log on a failed start.
fn supervise(server: &str, signal: &str) -> String {
    format!(
        r#"exec 3<&0
( cat <&3 >/dev/null; touch "$dir/stop"; kill -{signal} "$(cat "$dir/pid")" 2>/dev/null ) &
first=1
while :; do
  {server} >"$dir/server.log" 2>&1 &
  echo $! >"$dir/pid"
  if [ $first = 1 ]; then echo "dir=$dir"; first=0; fi
  wait $!; status=$?
  [ -e "$dir/stop" ] && exit 0
  if [ $status -ne 0 ]; then cat "$dir/server.log" >&2; exit 1; fi
done"#
    )
}

async fn retry_on_port_clash(
    kind: Kind,
    command: impl Fn(u16) -> Command,
) -> Result<Server, ServerError> {
    let mut last = None;
    for _ in 0..5 {
        let port = process::free_ports(1)?[0];
        let cmd = command(port);
        // Spawning waits for the supervisor's first line (initdb takes seconds): off the runtime.
        let supervisor = process::blocking(move || Supervisor::spawn(kind.name(), cmd)).await?;
        let mut server = Server {
            kind,
            port,
            supervisor,
            ca: None,
        };
        match server.wait_ready(Duration::from_secs(60)).await {
            Ok(()) => return Ok(server),
            // Another process may have taken the port between our probe and the bind.
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("at least one attempt"))
}

fn is_root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false)
}

fn sh_quote(p: &Path) -> String {
    format!("'{}'", p.to_string_lossy().replace('\'', r"'\''"))
}

/// `name` on `PATH` (or in `/usr/sbin`, `/usr/bin`, `/usr/local/bin`); `None` as well when
/// [`optional::HIDE_ENV`] hides it.
fn find_in_path(name: &str) -> Option<PathBuf> {
    if optional::hidden(name) {
        return None;
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain(["/usr/sbin", "/usr/bin", "/usr/local/bin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Finds the PostgreSQL server binaries: `PGFENCE_PG_BINDIR`, else the newest
/// `/usr/lib/postgresql/*/bin` (Debian/Ubuntu), else `initdb` on `PATH`.
fn postgres_bindir() -> Result<PathBuf, ServerError> {
    let has_server = |d: &Path| d.join("initdb").is_file() && d.join("postgres").is_file();
    if let Some(dir) = std::env::var_os("PGFENCE_PG_BINDIR").map(PathBuf::from) {
        return if has_server(&dir) {
            Ok(dir)
        } else {
            Err(ServerError::NotInstalled {
                what: "initdb/postgres in PGFENCE_PG_BINDIR",
                hint: PG_HINT,
            })
        };
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            has_server(&bin).then_some((v, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return Ok(bin);
    }
    find_in_path("initdb")
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .filter(|d| has_server(d))
        .ok_or(ServerError::NotInstalled {
            what: "PostgreSQL server (initdb, postgres)",
            hint: PG_HINT,
        })
}

/// A loopback TCP proxy in front of a server, to break its clients' connections on demand:
/// close every open connection ([`Proxy::drop_connections`], as a server's idle timeout or a
/// reset would), or stop forwarding for a while ([`Proxy::pause`], as a failover pause or a
/// stalled network would: connections stay open, bytes wait; [`Proxy::pause_open`] only on
/// the connections open now, as a black-holed path that new connections route around).
///
/// Plain threads and blocking sockets, so it runs whatever runtime (or none) the test uses.
/// Dropping it closes the listener and every connection.
#[derive(Debug)]
pub struct Proxy {
    port: u16,
    shared: std::sync::Arc<ProxyShared>,
    acceptor: Option<std::thread::JoinHandle<()>>,
}

#[derive(Debug, Default)]
struct ProxyShared {
    stop: std::sync::atomic::AtomicBool,
    /// Both sockets of every connection accepted since the last drop, and its own pause.
    open: std::sync::Mutex<Vec<(TcpStream, TcpStream, ConnPause)>>,
    /// Nothing is forwarded before this instant.
    paused_until: std::sync::Mutex<Option<Instant>>,
    /// Nothing is forwarded from the clients to the server before this instant.
    paused_to_server: std::sync::Mutex<Option<Instant>>,
    /// Nothing is forwarded from the server to the clients before this instant.
    paused_to_client: std::sync::Mutex<Option<Instant>>,
    accepted: std::sync::atomic::AtomicUsize,
    /// Where new connections go (`127.0.0.1:PORT`).
    target: std::sync::atomic::AtomicU16,
}

/// Nothing is forwarded on one connection before this instant ([`Proxy::pause_open`]).
type ConnPause = std::sync::Arc<std::sync::Mutex<Option<Instant>>>;

/// One direction of a proxied connection ([`Proxy::pause_one_way`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// From the clients to the server (requests).
    ToServer,
    /// From the server to the clients (replies).
    ToClient,
}

impl Proxy {
    /// Listens on a free port of 127.0.0.1 and forwards every connection to
    /// `127.0.0.1:target_port`.
    ///
    /// # Errors
    /// The listener could not be bound.
    pub fn start(target_port: u16) -> std::io::Result<Self> {
        Self::start_on(Ipv4Addr::LOCALHOST, target_port)
    }

    /// [`Proxy::start`], listening on `bind` (e.g. this machine's non-loopback address, for a
    /// client that must see a remote-looking host) instead of 127.0.0.1.
    ///
    /// # Errors
    /// When it cannot listen.
    pub fn start_on(bind: Ipv4Addr, target_port: u16) -> std::io::Result<Self> {
        use std::sync::atomic::Ordering;
        let listener = TcpListener::bind((bind, 0))?;
        let port = listener.local_addr()?.port();
        listener.set_nonblocking(true)?;
        let shared = std::sync::Arc::new(ProxyShared::default());
        shared.target.store(target_port, Ordering::SeqCst);
        let acceptor = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("testkit-proxy-{port}"))
                .spawn(move || {
                    while !shared.stop.load(Ordering::SeqCst) {
                        match listener.accept() {
                            Ok((client, _)) => {
                                shared.accepted.fetch_add(1, Ordering::SeqCst);
                                let target = shared.target.load(Ordering::SeqCst);
                                let _ = Self::connect(&shared, client, target);
                            }
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                                std::thread::sleep(Duration::from_millis(5));
                            }
                            Err(_) => std::thread::sleep(Duration::from_millis(5)),
                        }
                    }
                })?
        };
        Ok(Self {
            port,
            shared,
            acceptor: Some(acceptor),
        })
    }

    fn connect(
        shared: &std::sync::Arc<ProxyShared>,
        client: TcpStream,
        target_port: u16,
    ) -> std::io::Result<()> {
        client.set_nonblocking(false)?;
        client.set_nodelay(true)?;
        let upstream = match TcpStream::connect((Ipv4Addr::LOCALHOST, target_port)) {
            Ok(s) => s,
            Err(e) => {
                let _ = client.shutdown(std::net::Shutdown::Both);
                return Err(e);
            }
        };
        upstream.set_nodelay(true)?;
        let paused = ConnPause::default();
        shared.open.lock().expect("proxy lock").push((
            client.try_clone()?,
            upstream.try_clone()?,
            paused.clone(),
        ));
        for (from, to, direction) in [
            (
                client.try_clone()?,
                upstream.try_clone()?,
                Direction::ToServer,
            ),
            (upstream, client, Direction::ToClient),
        ] {
            let (shared, paused) = (shared.clone(), paused.clone());
            std::thread::Builder::new()
                .name("testkit-proxy-pipe".into())
                .spawn(move || pipe(&shared, &paused, direction, from, to))?;
        }
        Ok(())
    }

    /// The port clients connect to (on 127.0.0.1).
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT`, for a proxy in front of a Redis.
    #[must_use]
    pub fn redis_url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Closes every connection open now, both towards the client and towards the server (a
    /// client sees its connection closed under it). New connections are accepted as before.
    pub fn drop_connections(&self) {
        let open = std::mem::take(&mut *self.shared.open.lock().expect("proxy lock"));
        for (client, upstream, _) in open {
            let _ = client.shutdown(std::net::Shutdown::Both);
            let _ = upstream.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Stops forwarding for `duration` from now, in both directions and on every connection,
    /// old and new; connections stay open. Returns at once.
    pub fn pause(&self, duration: Duration) {
        *self.shared.paused_until.lock().expect("proxy lock") = Some(Instant::now() + duration);
    }

    /// Stops forwarding in one `direction` only for `duration` from now, on every connection,
    /// old and new (a one-way partition: with [`Direction::ToServer`] requests wait and no reply
    /// comes; with [`Direction::ToClient`] the server runs what it gets, and its replies wait).
    /// The other direction forwards as usual; connections stay open. Returns at once.
    pub fn pause_one_way(&self, direction: Direction, duration: Duration) {
        let until = Some(Instant::now() + duration);
        let slot = match direction {
            Direction::ToServer => &self.shared.paused_to_server,
            Direction::ToClient => &self.shared.paused_to_client,
        };
        *slot.lock().expect("proxy lock") = until;
    }

    /// Stops forwarding for `duration` from now, in both directions, on the connections open
    /// now only (a black hole on their path: they stay open, their bytes wait and are
    /// delivered when it ends, unless a side closed meanwhile); connections accepted from now on
    /// are forwarded as usual. Returns at once.
    pub fn pause_open(&self, duration: Duration) {
        let until = Some(Instant::now() + duration);
        for (_, _, paused) in self.shared.open.lock().expect("proxy lock").iter() {
            *paused.lock().expect("proxy lock") = until;
        }
    }

    /// Sends every connection accepted from now on to `127.0.0.1:target_port` (as a virtual IP
    /// or a failover manager's endpoint moves to a new primary). Connections open now keep
    /// their old server: [`Proxy::drop_connections`] closes them.
    pub fn retarget(&self, target_port: u16) {
        self.shared
            .target
            .store(target_port, std::sync::atomic::Ordering::SeqCst);
    }

    /// The port of 127.0.0.1 new connections are forwarded to.
    #[must_use]
    pub fn target_port(&self) -> u16 {
        self.shared.target.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`, for a proxy in front of a throwaway
    /// PostgreSQL (superuser `postgres`, trust auth).
    #[must_use]
    pub fn postgres_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// How many client connections the proxy has accepted so far.
    #[must_use]
    pub fn accepted(&self) -> usize {
        self.shared
            .accepted
            .load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared
            .stop
            .store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
        self.drop_connections();
    }
}

/// Copies `from` to `to` (in `direction`) until either side closes, holding bytes while the
/// proxy, this direction or this connection (`paused`) is paused.
fn pipe(
    shared: &ProxyShared,
    paused: &ConnPause,
    direction: Direction,
    mut from: TcpStream,
    mut to: TcpStream,
) {
    use std::io::Write;
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        loop {
            let all = *shared.paused_until.lock().expect("proxy lock");
            let this = *paused.lock().expect("proxy lock");
            let way = *match direction {
                Direction::ToServer => &shared.paused_to_server,
                Direction::ToClient => &shared.paused_to_client,
            }
            .lock()
            .expect("proxy lock");
            match all.max(this).max(way) {
                Some(until) if Instant::now() < until => {
                    std::thread::sleep(Duration::from_millis(5).min(until - Instant::now()));
                }
                _ => break,
            }
            if shared.stop.load(std::sync::atomic::Ordering::SeqCst) {
                break;
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}

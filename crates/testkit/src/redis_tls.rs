//! Throwaway Redis servers that speak TLS only, with the certificates of a [`Certs`]: one
//! server ([`RedisTls`]), a Redis Cluster whose nodes and bus use TLS ([`RedisTlsCluster`]),
//! and a master with a sentinel, both on TLS ([`SentinelTls`]).
//!
//! Every process runs under a member supervisor (see `process.rs`) that owns a fresh
//! temporary directory and kills the server when this process drops it, exits or dies. Each
//! listens on `--tls-port` only (`--port 0`); readiness and setup go through `redis-cli --tls`
//! with a client certificate of the same CA, so a server that does not speak TLS as
//! configured never counts as started.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::optional::{Installed, Sentinel};
use crate::process::{self, Supervisor};
use crate::{Certs, ServerError, find_in_path, sh_quote};

const HINT: &str = "install Redis built with TLS (Debian: apt-get install redis-server \
    redis-tools redis-sentinel)";

/// The CN of the client certificate the kit's own `redis-cli` calls present.
const ADMIN_CN: &str = "pgfence-testkit-admin";

/// Whether a [`RedisTls`] asks its clients for a certificate (`--tls-auth-clients`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientAuth {
    /// `no`: clients present none.
    None,
    /// `optional`: a certificate is checked when a client presents one.
    Optional,
    /// `yes`: every client must present a certificate signed by the CA.
    Required,
}

impl ClientAuth {
    fn arg(self) -> &'static str {
        match self {
            ClientAuth::None => "no",
            ClientAuth::Optional => "optional",
            ClientAuth::Required => "yes",
        }
    }
}

/// What the kit's `redis-cli` calls need: the binary and the TLS flags.
#[derive(Clone, Debug)]
struct Cli {
    bin: PathBuf,
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

impl Cli {
    fn new(certs: &Certs) -> Result<Self, ServerError> {
        let bin = find_in_path("redis-cli").ok_or(ServerError::NotInstalled {
            what: "redis-cli",
            hint: HINT,
        })?;
        let (cert, key) = certs.client(ADMIN_CN)?;
        Ok(Self {
            bin,
            ca: certs.ca(),
            cert,
            key,
        })
    }

    fn command(&self, port: u16) -> Command {
        let mut cmd = Command::new(&self.bin);
        cmd.arg("--tls")
            .arg("--cacert")
            .arg(&self.ca)
            .arg("--cert")
            .arg(&self.cert)
            .arg("--key")
            .arg(&self.key)
            .args(["-h", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null());
        cmd
    }

    /// Runs one command on `127.0.0.1:port`; its output (`redis-cli` prints errors on stdout
    /// too, so an error reply is `Ok`). A call that takes over 5 s is killed (its own PID).
    fn run(&self, port: u16, args: &[&str]) -> Result<String, ServerError> {
        let mut cmd = self.command(port);
        cmd.args(args);
        let out = output_within(cmd, Duration::from_secs(5))?;
        if !out.status.success() {
            return Err(ServerError::StartFailed {
                what: "redis-cli",
                detail: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `PING` answered `PONG` (over TLS, within about a second).
    fn pings(&self, port: u16) -> bool {
        self.run(port, &["PING"])
            .is_ok_and(|out| out.trim() == "PONG")
    }
}

/// Runs `cmd` to completion, killing it (its own PID) after `timeout`: `redis-cli` has no
/// timeout of its own, and a server that accepts TCP but never answers must not hang a test.
fn output_within(mut cmd: Command, timeout: Duration) -> Result<std::process::Output, ServerError> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let deadline = Instant::now() + timeout;
    while child.try_wait()?.is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(ServerError::StartFailed {
                what: "redis-cli",
                detail: format!("no answer within {timeout:?}"),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(child.wait_with_output()?)
}

/// One TLS-only Redis process (a server, a cluster node or a sentinel).
#[derive(Debug)]
struct Node {
    role: &'static str,
    port: u16,
    supervisor: Supervisor,
}

impl Node {
    fn spawn(role: &'static str, port: u16, server: &str) -> Result<Self, ServerError> {
        let supervisor = Supervisor::member(
            role,
            r#""${TMPDIR:-/tmp}/pgfence-redis-tls.XXXXXX""#,
            server,
        )?;
        Ok(Self {
            role,
            port,
            supervisor,
        })
    }

    /// Starts it and waits until `redis-cli --tls` gets `PONG`.
    async fn start(&mut self, cli: &Cli, timeout: Duration) -> Result<(), ServerError> {
        self.supervisor.start()?;
        let (cli, port) = (cli.clone(), self.port);
        let deadline = Instant::now() + timeout;
        let (role, supervisor) = (self.role, &mut self.supervisor);
        let exited = || {
            if let Some(status) = supervisor.try_wait()? {
                return Err(ServerError::StartFailed {
                    what: role,
                    detail: format!("supervisor exited with {status}"),
                });
            }
            match supervisor.pid() {
                Some(pid) if !process::process_alive(pid) => Err(ServerError::StartFailed {
                    what: role,
                    detail: format!("exited: {}", supervisor.log_tail(30)),
                }),
                _ => Ok(()),
            }
        };
        if process::poll_until(deadline, exited, move || cli.pings(port)).await? {
            return Ok(());
        }
        Err(ServerError::StartFailed {
            what: self.role,
            detail: format!(
                "no PONG over TLS on port {} after {timeout:?}: {}",
                self.port,
                self.supervisor.log_tail(30)
            ),
        })
    }
}

/// The `redis-server` arguments of a TLS-only server on `port` (`$dir` is its directory).
fn server_args(bin: &Path, certs: &Certs, port: u16, auth: ClientAuth, extra: &str) -> String {
    format!(
        "{bin} --port 0 --tls-port {port} --bind 127.0.0.1 --save '' --appendonly no \
         --dir \"$dir\" --daemonize no --tls-cert-file {cert} --tls-key-file {key} \
         --tls-ca-cert-file {ca} --tls-auth-clients {auth} {extra}",
        bin = sh_quote(bin),
        cert = sh_quote(&certs.server_cert()),
        key = sh_quote(&certs.server_key()),
        ca = sh_quote(&certs.ca()),
        auth = auth.arg(),
    )
}

fn redis_server() -> Result<PathBuf, ServerError> {
    find_in_path("redis-server").ok_or(ServerError::NotInstalled {
        what: "redis-server",
        hint: HINT,
    })
}

/// `?cacert=PATH`, percent-encoding what a query value cannot hold.
fn cacert_param(ca: &Path) -> String {
    let mut out = String::from("?cacert=");
    for b in ca.to_string_lossy().bytes() {
        if b.is_ascii_alphanumeric() || b"/-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A throwaway Redis that accepts TLS connections only, with the server certificate of a
/// [`Certs`] (for `localhost` / `127.0.0.1`). Dropping it stops the server and removes its
/// directory.
#[derive(Debug)]
pub struct RedisTls {
    node: Node,
    cli: Cli,
}

impl RedisTls {
    /// Starts a TLS-only `redis-server` on a free port; `auth` says whether clients must
    /// present a certificate of `certs`' CA.
    ///
    /// # Errors
    /// [`ServerError::NotInstalled`] without `redis-server` / `redis-cli`;
    /// [`ServerError::StartFailed`] when it does not answer over TLS within 30 s (e.g. a
    /// Redis built without TLS).
    pub async fn start(certs: &Certs, auth: ClientAuth) -> Result<Self, ServerError> {
        Self::start_with(certs, auth, "").await
    }

    async fn start_with(certs: &Certs, auth: ClientAuth, extra: &str) -> Result<Self, ServerError> {
        let (bin, cli) = (redis_server()?, Cli::new(certs)?);
        process::retry(3, || async {
            let port = process::free_ports(1)?[0];
            let server = server_args(&bin, certs, port, auth, extra);
            let mut node =
                process::blocking(move || Node::spawn("redis-server (TLS)", port, &server)).await?;
            node.start(&cli, Duration::from_secs(30)).await?;
            Ok(Self {
                node,
                cli: cli.clone(),
            })
        })
        .await
    }

    /// The TLS port on 127.0.0.1.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.node.port
    }

    /// `rediss://127.0.0.1:PORT` (trusting the system store: add the CA to connect).
    #[must_use]
    pub fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.node.port)
    }

    /// `rediss://127.0.0.1:PORT?cacert=CA`, with the CA of the [`Certs`] it was started with.
    #[must_use]
    pub fn url_with_ca(&self) -> String {
        format!("{}{}", self.url(), cacert_param(&self.cli.ca))
    }

    /// Runs one command with `redis-cli --tls` (as a client with a certificate of the CA) and
    /// returns what it printed (error replies included).
    ///
    /// # Errors
    /// `redis-cli` could not be run or failed (e.g. could not connect).
    pub fn cli(&self, args: &[&str]) -> Result<String, ServerError> {
        self.cli.run(self.node.port, args)
    }

    /// The last lines of the server's log, for error messages.
    #[must_use]
    pub fn log_tail(&self) -> String {
        self.node.supervisor.log_tail(30)
    }
}

/// A throwaway Redis Cluster of TLS-only masters (no replicas): clients and the cluster bus
/// both speak TLS (`--tls-cluster yes`), so the slot map names the TLS ports.
#[derive(Debug)]
pub struct RedisTlsCluster {
    nodes: Vec<RedisTls>,
}

impl RedisTlsCluster {
    /// Starts `masters` (at least 3) TLS-only cluster nodes (clients need no certificate),
    /// joins them with `redis-cli --tls --cluster create` and waits until every node reports
    /// `cluster_state:ok`.
    ///
    /// # Errors
    /// [`ServerError`] when a node does not start or the cluster does not form within 30 s.
    pub async fn start(certs: &Certs, masters: usize) -> Result<Self, ServerError> {
        let mut nodes = Vec::with_capacity(masters);
        for _ in 0..masters {
            // An explicit bus port: TLS port + 10000 may be past 65535.
            let bus = process::free_ports(1)?[0];
            let extra = format!(
                "--cluster-enabled yes --cluster-config-file nodes.conf \
                 --cluster-node-timeout 2000 --tls-cluster yes --cluster-port {bus}"
            );
            nodes.push(RedisTls::start_with(certs, ClientAuth::None, &extra).await?);
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let cli = nodes[0].cli.clone();
        let mut create = cli.command(nodes[0].port());
        create.arg("--cluster").arg("create").args(&addrs).args([
            "--cluster-replicas",
            "0",
            "--cluster-yes",
        ]);
        let out = process::blocking(move || output_within(create, Duration::from_secs(30))).await?;
        if !out.status.success() {
            return Err(ServerError::StartFailed {
                what: "redis cluster (TLS)",
                detail: String::from_utf8_lossy(&out.stdout).into_owned()
                    + &String::from_utf8_lossy(&out.stderr),
            });
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        for node in &nodes {
            loop {
                if node.cli(&["cluster", "info"])?.contains("cluster_state:ok") {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(ServerError::StartFailed {
                        what: "redis cluster (TLS)",
                        detail: format!("cluster_state never ok: {}", node.log_tail()),
                    });
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(Self { nodes })
    }

    /// `rediss://127.0.0.1:PORT` of every node.
    #[must_use]
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisTls::url).collect()
    }

    /// The nodes, in start order.
    #[must_use]
    pub fn nodes(&self) -> &[RedisTls] {
        &self.nodes
    }
}

/// A throwaway TLS-only master and one TLS-only sentinel monitoring it (quorum 1), the
/// sentinel reaching the master over TLS too (`tls-replication yes`).
#[derive(Debug)]
pub struct SentinelTls {
    name: String,
    master: RedisTls,
    sentinel: Node,
}

impl SentinelTls {
    /// Starts the master (clients need no certificate) and a sentinel monitoring it as `name`,
    /// and waits until the sentinel has reached the master over TLS (its flags say `master`).
    ///
    /// # Errors
    /// [`ServerError::NotInstalled`] without `redis-server` / `redis-sentinel` / `redis-cli`;
    /// [`ServerError::StartFailed`] when the sentinel does not reach the master within 30 s.
    pub async fn start(
        _sentinel: Installed<Sentinel>,
        certs: &Certs,
        name: &str,
    ) -> Result<Self, ServerError> {
        let (_, sentinel_bin) = crate::sentinel::sentinel_bins()?;
        let master = RedisTls::start(certs, ClientAuth::None).await?;
        let cli = master.cli.clone();
        let port = process::free_ports(1)?[0];
        let command = format!("{} \"$dir/sentinel.conf\"", sh_quote(&sentinel_bin));
        let mut sentinel =
            process::blocking(move || Node::spawn("redis-sentinel (TLS)", port, &command)).await?;
        let conf = format!(
            "port 0\ntls-port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {dir}\n\
             tls-cert-file {cert}\ntls-key-file {key}\ntls-ca-cert-file {ca}\n\
             tls-auth-clients no\ntls-replication yes\n\
             sentinel monitor {name} 127.0.0.1 {master} 1\n\
             sentinel down-after-milliseconds {name} 5000\n",
            dir = sentinel.supervisor.dir().display(),
            cert = certs.server_cert().display(),
            key = certs.server_key().display(),
            ca = certs.ca().display(),
            master = master.port(),
        );
        std::fs::write(sentinel.supervisor.dir().join("sentinel.conf"), conf)?;
        sentinel.start(&cli, Duration::from_secs(30)).await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let reply = cli.run(port, &["SENTINEL", "master", name])?;
            let flags = reply
                .lines()
                .skip_while(|l| l.trim() != "flags")
                .nth(1)
                .unwrap_or("");
            if flags.trim() == "master" {
                break;
            }
            if Instant::now() > deadline {
                return Err(ServerError::StartFailed {
                    what: "redis-sentinel (TLS)",
                    detail: format!(
                        "the sentinel did not reach the master over TLS (flags {flags:?}): {}",
                        sentinel.supervisor.log_tail(30)
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(Self {
            name: name.to_owned(),
            master,
            sentinel,
        })
    }

    /// The name the sentinel monitors the master under.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The master.
    #[must_use]
    pub fn master(&self) -> &RedisTls {
        &self.master
    }

    /// The sentinel's TLS port on 127.0.0.1.
    #[must_use]
    pub fn sentinel_port(&self) -> u16 {
        self.sentinel.port
    }

    /// `rediss+sentinel://127.0.0.1:PORT/NAME` (add the CA to connect).
    #[must_use]
    pub fn url(&self) -> String {
        format!(
            "rediss+sentinel://127.0.0.1:{}/{}",
            self.sentinel.port, self.name
        )
    }

    /// [`SentinelTls::url`] with `?cacert=CA`.
    #[must_use]
    pub fn url_with_ca(&self) -> String {
        format!("{}{}", self.url(), cacert_param(&self.master.cli.ca))
    }

    /// Runs one command on the sentinel with `redis-cli --tls`.
    ///
    /// # Errors
    /// As [`RedisTls::cli`].
    pub fn sentinel_cli(&self, args: &[&str]) -> Result<String, ServerError> {
        self.master.cli.run(self.sentinel.port, args)
    }
}

#[cfg(test)]
mod tests {
    use super::cacert_param;

    #[test]
    fn encodes_the_ca_path() {
        assert_eq!(
            cacert_param(std::path::Path::new("/tmp/a b&c/ca.crt")),
            "?cacert=/tmp/a%20b%26c/ca.crt"
        );
    }
}

//! A throwaway Redis Sentinel deployment on 127.0.0.1: one master, replicas and sentinels,
//! each its own process with a PID the test can `SIGSTOP`, `SIGCONT` or `SIGKILL` (its own
//! process only, never by name).
//!
//! Every process runs under a small `sh` supervisor that owns a fresh temporary directory and
//! starts the server when told to on its stdin. When the pipe closes — this process dropped
//! the deployment, exited, panicked or was killed — the supervisor `SIGKILL`s the server (a
//! stopped one too) and removes the directory. Nothing is persisted (`save ''`, no AOF).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::optional::{Installed, Sentinel};
use crate::process::{self, Supervisor};
use crate::{ServerError, find_in_path, sh_quote};

const SENTINEL_HINT: &str = "install Redis with Sentinel (Debian: apt-get install redis-server \
    redis-sentinel)";

/// The `redis-server` and `redis-sentinel` binaries.
pub(crate) fn sentinel_bins() -> Result<(PathBuf, PathBuf), ServerError> {
    let server = find_in_path("redis-server").ok_or(ServerError::NotInstalled {
        what: "redis-server",
        hint: SENTINEL_HINT,
    })?;
    let sentinel = find_in_path("redis-sentinel").ok_or(ServerError::NotInstalled {
        what: "redis-sentinel",
        hint: SENTINEL_HINT,
    })?;
    Ok((server, sentinel))
}

/// Timing of a [`SentinelSet`]'s sentinels.
#[derive(Clone, Copy, Debug)]
pub struct SentinelConfig {
    /// Replicas of the master.
    pub replicas: usize,
    /// Sentinels.
    pub sentinels: usize,
    /// Sentinels that must agree the master is down.
    pub quorum: usize,
    /// `down-after-milliseconds`.
    pub down_after: Duration,
    /// `failover-timeout`.
    pub failover_timeout: Duration,
}

impl Default for SentinelConfig {
    fn default() -> Self {
        Self {
            replicas: 1,
            sentinels: 1,
            quorum: 1,
            down_after: Duration::from_millis(800),
            failover_timeout: Duration::from_secs(3),
        }
    }
}

/// One process of a [`SentinelSet`]: a Redis server or a sentinel.
#[derive(Debug)]
pub struct RedisNode {
    role: &'static str,
    port: u16,
    supervisor: Supervisor,
    killed: bool,
    paused: std::sync::atomic::AtomicBool,
}

impl RedisNode {
    /// Spawns the node's supervisor, which runs `server` (a shell command line, which may use
    /// `"$dir"`) once [`RedisNode::start`] asks.
    fn spawn(role: &'static str, port: u16, server: &str) -> Result<Self, ServerError> {
        let supervisor =
            Supervisor::member(role, r#""${TMPDIR:-/tmp}/pgfence-sentinel.XXXXXX""#, server)?;
        Ok(Self {
            role,
            port,
            supervisor,
            killed: false,
            paused: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn start(&mut self) -> Result<(), ServerError> {
        self.supervisor.start()
    }

    /// `redis-server` or `redis-sentinel`.
    #[must_use]
    pub fn role(&self) -> &'static str {
        self.role
    }

    /// TCP port on 127.0.0.1.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The node's temporary directory (removed when it stops).
    #[must_use]
    pub fn dir(&self) -> &Path {
        self.supervisor.dir()
    }

    /// The server's process id (`None` before it started or after [`RedisNode::kill`]).
    #[must_use]
    pub fn pid(&self) -> Option<u32> {
        (!self.killed).then(|| self.supervisor.pid()).flatten()
    }

    fn signal(&self, signal: &str) -> Result<u32, ServerError> {
        process::signal(self.role, self.pid(), signal, || self.not_running())
    }

    fn not_running(&self) -> String {
        format!("port {}: not running", self.port)
    }

    /// `SIGSTOP`s the process: it keeps its sockets and answers nothing until
    /// [`RedisNode::resume`].
    ///
    /// # Errors
    /// Not running, or `kill` failed.
    pub fn pause(&self) -> Result<(), ServerError> {
        self.signal("-STOP")?;
        self.paused.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    /// Whether the process runs: started, not paused, not killed.
    #[must_use]
    pub fn is_running(&self) -> bool {
        !self.killed
            && !self.paused.load(std::sync::atomic::Ordering::SeqCst)
            && self.pid().is_some()
    }

    /// `SIGCONT`s a paused process.
    ///
    /// # Errors
    /// Not running, or `kill` failed.
    pub fn resume(&self) -> Result<(), ServerError> {
        self.signal("-CONT")?;
        self.paused
            .store(false, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    /// `SIGKILL`s the process (paused or not) and waits until its port is closed.
    ///
    /// # Errors
    /// Not running, or `kill` failed.
    pub fn kill(&mut self) -> Result<(), ServerError> {
        self.supervisor.kill_server(
            self.pid(),
            || self.not_running(),
            self.port,
            Duration::from_millis(100),
        )?;
        self.killed = true;
        Ok(())
    }

    /// Sends one command (inline protocol) and returns the raw reply, or `None` if the node does
    /// not answer within 1 s.
    #[must_use]
    pub fn command(&self, command: &str) -> Option<String> {
        raw_command(self.port, command)
    }

    /// The last lines of the node's log, for error messages.
    #[must_use]
    pub fn log_tail(&self) -> String {
        self.supervisor.log_tail(30)
    }
}

/// A throwaway master, its replicas and the sentinels that monitor it, on 127.0.0.1. Dropping
/// it kills every process it started and removes their directories.
#[derive(Debug)]
pub struct SentinelSet {
    name: String,
    master: RedisNode,
    replicas: Vec<RedisNode>,
    sentinels: Vec<RedisNode>,
}

impl SentinelSet {
    /// Starts the master, `config.replicas` replicas (waiting until each has synced) and
    /// `config.sentinels` sentinels monitoring the master as `name` (waiting until every
    /// sentinel sees every replica and every other sentinel).
    ///
    /// # Errors
    /// [`ServerError::NotInstalled`] without `redis-server` / `redis-sentinel`;
    /// [`ServerError::StartFailed`] when the deployment does not form within 30 s.
    pub async fn start(
        _sentinel: Installed<Sentinel>,
        name: &str,
        config: SentinelConfig,
    ) -> Result<Self, ServerError> {
        let (server, sentinel) = sentinel_bins()?;
        assert!(config.sentinels >= 1 && config.quorum >= 1);
        let ports = process::free_ports(1 + config.replicas + config.sentinels)?;
        let server_cmd = |port: u16, extra: &str| {
            format!(
                "{} --port {port} --bind 127.0.0.1 --save '' --appendonly no --dir \"$dir\" \
                 --daemonize no --repl-diskless-sync-delay 0 --repl-ping-replica-period 1 {extra}",
                sh_quote(&server)
            )
        };
        let mut master = RedisNode::spawn("redis-server", ports[0], &server_cmd(ports[0], ""))?;
        master.start()?;
        wait_for(&master, Duration::from_secs(30), |port| {
            raw_command(port, "PING").is_some_and(|r| r.starts_with("+PONG"))
        })
        .await?;
        let mut replicas = Vec::new();
        for &port in &ports[1..=config.replicas] {
            let replica_cmd = server_cmd(port, &format!("--replicaof 127.0.0.1 {}", ports[0]));
            let mut replica = RedisNode::spawn("redis-server", port, &replica_cmd)?;
            replica.start()?;
            wait_for(&replica, Duration::from_secs(30), |port| {
                raw_command(port, "INFO replication")
                    .is_some_and(|r| r.contains("master_link_status:up"))
            })
            .await?;
            replicas.push(replica);
        }
        // The master streams writes to a replica only once it is `online` on its side (after
        // the replica's first REPLCONF ACK), which can lag the replica's `link up`.
        let want = config.replicas;
        wait_for(&master, Duration::from_secs(30), move |port| {
            raw_command(port, "INFO replication")
                .is_some_and(|r| r.matches("state=online").count() >= want)
        })
        .await?;
        let mut sentinels = Vec::new();
        for &port in &ports[1 + config.replicas..] {
            let sentinel_cmd = format!("{} \"$dir/sentinel.conf\"", sh_quote(&sentinel));
            let mut node = RedisNode::spawn("redis-sentinel", port, &sentinel_cmd)?;
            let conf = format!(
                "port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {dir}\n\
                 sentinel monitor {name} 127.0.0.1 {master} {quorum}\n\
                 sentinel down-after-milliseconds {name} {down}\n\
                 sentinel failover-timeout {name} {failover}\n\
                 sentinel parallel-syncs {name} 1\n",
                dir = node.dir().display(),
                master = ports[0],
                quorum = config.quorum,
                down = config.down_after.as_millis(),
                failover = config.failover_timeout.as_millis(),
            );
            std::fs::write(node.dir().join("sentinel.conf"), conf)?;
            node.start()?;
            sentinels.push(node);
        }
        let set = Self {
            name: name.to_owned(),
            master,
            replicas,
            sentinels,
        };
        let (replicas, others) = (config.replicas, config.sentinels - 1);
        for node in &set.sentinels {
            let name = set.name.clone();
            wait_for(node, Duration::from_secs(30), move |port| {
                let seen_replicas =
                    raw_command(port, &format!("SENTINEL replicas {name}")).map_or(0, |r| {
                        // Known, healthy, and its INFO read: promotable.
                        r.matches("$5\r\nslave\r\n")
                            .count()
                            .min(r.matches("master-link-status\r\n$2\r\nok").count())
                    });
                let seen_sentinels = raw_command(port, &format!("SENTINEL sentinels {name}"))
                    .map_or(0, |r| r.matches("$8\r\nsentinel\r\n").count());
                seen_replicas >= replicas && seen_sentinels >= others
            })
            .await?;
        }
        Ok(set)
    }

    /// The name the sentinels monitor the master under.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The master the deployment started with.
    #[must_use]
    pub fn master(&self) -> &RedisNode {
        &self.master
    }

    /// The master the deployment started with, to kill it.
    pub fn master_mut(&mut self) -> &mut RedisNode {
        &mut self.master
    }

    /// The replicas, in start order.
    #[must_use]
    pub fn replicas(&self) -> &[RedisNode] {
        &self.replicas
    }

    /// The sentinels, in start order.
    #[must_use]
    pub fn sentinels(&self) -> &[RedisNode] {
        &self.sentinels
    }

    /// The sentinels, to kill one.
    pub fn sentinels_mut(&mut self) -> &mut [RedisNode] {
        &mut self.sentinels
    }

    /// `redis+sentinel://127.0.0.1:P1,127.0.0.1:P2,.../NAME`.
    #[must_use]
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        format!("redis+sentinel://{}/{}", hosts.join(","), self.name)
    }

    fn running_sentinels(&self) -> Vec<u16> {
        self.sentinels
            .iter()
            .filter(|s| s.is_running())
            .map(|s| s.port)
            .collect()
    }

    /// The master's port as the first running sentinel that answers names it
    /// (`SENTINEL get-master-addr-by-name`).
    #[must_use]
    pub fn master_port(&self) -> Option<u16> {
        let ports = self.running_sentinels();
        master_port(&ports, &self.name)
    }

    /// Waits until the running sentinels name a master other than port `old` and that node says it
    /// is a master; returns its port.
    ///
    /// # Errors
    /// [`ServerError::StartFailed`] (with every sentinel's log tail) after `timeout`.
    pub async fn wait_for_new_master(
        &self,
        old: u16,
        timeout: Duration,
    ) -> Result<u16, ServerError> {
        let deadline = Instant::now() + timeout;
        let sentinels = self.running_sentinels();
        loop {
            let (sentinels, name) = (sentinels.clone(), self.name.clone());
            let found = tokio::task::spawn_blocking(move || {
                let port = master_port(&sentinels, &name).filter(|p| *p != old)?;
                raw_command(port, "ROLE")
                    .is_some_and(|r| r.contains("$6\r\nmaster"))
                    .then_some(port)
            })
            .await
            .ok()
            .flatten();
            if let Some(port) = found {
                return Ok(port);
            }
            if Instant::now() > deadline {
                let logs: Vec<String> = self.sentinels.iter().map(RedisNode::log_tail).collect();
                return Err(ServerError::StartFailed {
                    what: "redis-sentinel failover",
                    detail: format!("no new master after {timeout:?}:\n{}", logs.join("\n---\n")),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The master's port as the first of `sentinels` that answers names it.
fn master_port(sentinels: &[u16], name: &str) -> Option<u16> {
    sentinels.iter().find_map(|&s| {
        let reply = raw_command(s, &format!("SENTINEL get-master-addr-by-name {name}"))?;
        // *2\r\n$9\r\n127.0.0.1\r\n$5\r\nPORT\r\n
        reply.lines().nth(4)?.trim().parse().ok()
    })
}

async fn wait_for(
    node: &RedisNode,
    timeout: Duration,
    ready: impl Fn(u16) -> bool + Clone + Send + 'static,
) -> Result<(), ServerError> {
    let port = node.port;
    let deadline = Instant::now() + timeout;
    if process::poll_until(deadline, || Ok(()), move || ready(port)).await? {
        return Ok(());
    }
    Err(ServerError::StartFailed {
        what: node.role,
        detail: format!(
            "port {} not ready after {timeout:?}: {}",
            node.port,
            node.log_tail()
        ),
    })
}

/// One inline command, its raw reply (everything the server sends within a short while).
fn raw_command(port: u16, command: &str) -> Option<String> {
    let mut stream = TcpStream::connect_timeout(
        &SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
        Duration::from_millis(500),
    )
    .ok()?;
    stream
        .set_read_timeout(Some(Duration::from_millis(1000)))
        .ok()?;
    stream.write_all(format!("{command}\r\n").as_bytes()).ok()?;
    let mut reply = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                reply.extend_from_slice(&buf[..n]);
                // Stop once the reply is complete enough: a short wait for more bytes.
                stream
                    .set_read_timeout(Some(Duration::from_millis(30)))
                    .ok()?;
            }
            Err(_) => break,
        }
    }
    (!reply.is_empty()).then(|| String::from_utf8_lossy(&reply).into_owned())
}

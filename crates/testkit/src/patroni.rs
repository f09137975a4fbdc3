//! A throwaway Patroni cluster ([`PatroniCluster`]): 2 or 3 members started from the
//! installed `patroni` package, each a `patroni CONFIG.yml` process with its own PostgreSQL,
//! on free ports of 127.0.0.1, with a single-node throwaway etcd ([`EtcdCluster`]) as the
//! distributed configuration store (Patroni's `etcd3` client).
//!
//! Each member runs under a supervisor that owns its temporary directory (configuration,
//! data directory, log). When the cluster is dropped, or this process exits, each supervisor
//! `SIGKILL`s its Patroni (by PID), stops the PostgreSQL that Patroni started (the postmaster
//! named in its own data directory's `postmaster.pid`, checked to be that directory's), and
//! removes the directory. PostgreSQL refuses to run as root: when this process is root, the
//! supervisors (and so Patroni) run as the `postgres` user through `runuser`.
//!
//! Every member advertises its PostgreSQL to the others (`postgresql.connect_address`: what
//! replicas stream from and what `pg_rewind` reads) through a [`Proxy`] of its own, so a test
//! can cut replication off ([`PatroniCluster::cut_off`]) as a network partition would, while
//! the member and Patroni go on. Clients use [`PatroniCluster::url`]: another proxy, moved to
//! the current leader by [`PatroniCluster::wait_leader`] — what HAProxy in front of Patroni
//! (with `GET /leader` as its health check) gives applications.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::etcd::EtcdCluster;
use crate::optional::{Installed, Patroni};
use crate::process::{self, Supervisor, process_alive};
use crate::replica::{kill_postgres, psql};
use crate::{Proxy, ServerError, find_in_path, is_root, postgres_bindir, sh_quote};

const WHAT: &str = "Patroni";

const PATRONI_HINT: &str = "install Patroni with its etcd client (Debian: apt-get install \
    patroni python3-etcd) and etcd (etcd-server)";

/// Patroni's `ttl` (seconds): how long the leader key lives without being refreshed, so
/// roughly how long after a leader's death a replica is promoted.
pub const PATRONI_TTL_S: u64 = 10;
/// Patroni's `loop_wait` (seconds): the pause between two runs of its HA loop.
pub const PATRONI_LOOP_WAIT_S: u64 = 1;

/// How long a wait on the cluster may take before it fails.
const WAIT: Duration = Duration::from_secs(60);

/// The `patroni` binary, when its Python has the etcd client module (`python3 -c 'import
/// etcd'`, Debian's `python3-etcd`).
pub(crate) fn patroni_bin() -> Result<PathBuf, ServerError> {
    let not_installed = || ServerError::NotInstalled {
        what: "patroni (with python3-etcd)",
        hint: PATRONI_HINT,
    };
    let bin = find_in_path("patroni").ok_or_else(not_installed)?;
    // Patroni's etcd and etcd3 clients both import python-etcd.
    let python = std::fs::read_to_string(&bin)
        .ok()
        .and_then(|s| {
            s.lines()
                .next()
                .and_then(|l| l.strip_prefix("#!"))
                .map(|l| l.split_whitespace().next().unwrap_or("python3").to_owned())
        })
        .unwrap_or_else(|| "python3".to_owned());
    let has_etcd = Command::new(python)
        .args(["-c", "import etcd"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if has_etcd {
        Ok(bin)
    } else {
        Err(not_installed())
    }
}

/// How a [`PatroniCluster`] is configured (Patroni's `bootstrap.dcs`).
#[derive(Clone, Copy, Debug)]
pub struct PatroniConfig {
    /// How many members (2 or 3).
    pub members: usize,
    /// `synchronous_mode`: the leader names one replica in `synchronous_standby_names` and
    /// only that replica may be promoted.
    pub synchronous_mode: bool,
    /// `check_timeline`: a replica whose timeline is behind the cluster's last known one is
    /// not promoted.
    pub check_timeline: bool,
}

impl Default for PatroniConfig {
    fn default() -> Self {
        Self {
            members: 2,
            synchronous_mode: false,
            check_timeline: false,
        }
    }
}

/// One member of a [`PatroniCluster`].
#[derive(Debug)]
struct PatroniMember {
    name: String,
    pg_port: u16,
    api_port: u16,
    /// The address the member advertises to the others (`connect_address`).
    advertised: Proxy,
    supervisor: Supervisor,
    running: bool,
}

impl PatroniMember {
    fn data(&self) -> PathBuf {
        self.supervisor.dir().join("data")
    }
}

/// A throwaway Patroni cluster (see the module documentation). Dropping it stops every member
/// and the etcd, and removes their directories.
#[derive(Debug)]
pub struct PatroniCluster {
    config: PatroniConfig,
    // Members first: they stop before the DCS they talk to.
    members: Vec<PatroniMember>,
    leader_proxy: Proxy,
    etcd: EtcdCluster,
    bindir: PathBuf,
    scope: String,
}

impl PatroniCluster {
    /// Starts an etcd, then member `p0` (which bootstraps the cluster: `initdb`) and, once it
    /// leads, the others (replicas made by Patroni with `pg_basebackup`); waits until every
    /// replica streams from the leader (as the synchronous standby with `synchronous_mode`),
    /// and points [`PatroniCluster::url`] at `p0`.
    ///
    /// # Errors
    /// [`ServerError::NotInstalled`] without Patroni, its etcd module, etcd or PostgreSQL;
    /// [`ServerError::StartFailed`] when the cluster does not form within 60 s.
    pub async fn start(
        _patroni: Installed<Patroni>,
        config: PatroniConfig,
    ) -> Result<Self, ServerError> {
        assert!(
            (1..=5).contains(&config.members),
            "a Patroni cluster of 1 to 5 members"
        );
        let bin = patroni_bin()?;
        let bindir = postgres_bindir()?;
        // Patroni's probe found etcd too.
        let etcd = EtcdCluster::single(Installed::assume()).await?;
        let etcd_port = etcd.members()[0].client_port();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let scope = format!("pgfence-{}-{nanos}", std::process::id());
        let ports = process::free_ports(config.members * 2)?;
        let leader_proxy = Proxy::start(ports[0])?;
        let mut members = Vec::with_capacity(config.members);
        for (i, p) in ports.chunks(2).enumerate() {
            let (pg_port, api_port) = (p[0], p[1]);
            let advertised = Proxy::start(pg_port)?;
            let bin = bin.clone();
            let supervisor = process::blocking(move || Self::spawn_supervisor(&bin)).await?;
            let member = PatroniMember {
                name: format!("p{i}"),
                pg_port,
                api_port,
                advertised,
                supervisor,
                running: false,
            };
            let yaml = member_config(&config, &scope, etcd_port, &member, &bindir);
            std::fs::write(member.supervisor.dir().join("patroni.yml"), yaml)?;
            members.push(member);
        }
        let mut cluster = Self {
            config,
            members,
            leader_proxy,
            etcd,
            bindir,
            scope,
        };
        cluster.start_member(0)?;
        let leader = cluster.wait_leader(None).await?;
        if leader != 0 {
            return Err(cluster.fail(&format!("p{leader} leads, not the bootstrapping p0")));
        }
        for i in 1..cluster.members.len() {
            cluster.start_member(i)?;
        }
        cluster.wait_streaming(cluster.members.len() - 1).await?;
        Ok(cluster)
    }

    /// The supervisor of one member: a fresh directory, `patroni "$dir/patroni.yml"` started
    /// (again) on every `start` line, and on EOF the cleanup described in the module
    /// documentation.
    fn spawn_supervisor(bin: &Path) -> Result<Supervisor, ServerError> {
        let base = process::scratch_base();
        let script = format!(
            r#"set -u
umask 077
dir=$(mktemp -d {base}/pgfence-patroni.XXXXXX) || exit 1
cleanup() {{
  kill -KILL $(cat "$dir/pid" 2>/dev/null) 2>/dev/null
  pm=$(head -n 1 "$dir/data/postmaster.pid" 2>/dev/null)
  if [ -n "$pm" ] && grep -q "$dir/data" "/proc/$pm/cmdline" 2>/dev/null; then
    kill -QUIT "$pm" 2>/dev/null
    i=0
    while kill -0 "$pm" 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
    kill -KILL "$pm" 2>/dev/null
  fi
  rm -rf "$dir"
}}
trap cleanup EXIT
echo "dir=$dir"
while IFS= read -r cmd; do
  if [ "$cmd" = start ]; then
    {bin} "$dir/patroni.yml" >>"$dir/server.log" 2>&1 &
    echo $! >"$dir/pid.new" && mv "$dir/pid.new" "$dir/pid"
  fi
done"#,
            base = sh_quote(&base),
            bin = sh_quote(bin),
        );
        let cmd = if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--", "sh", "-c", &script]);
            c
        } else {
            let mut c = Command::new("sh");
            c.args(["-c", &script]);
            c
        };
        Supervisor::spawn(WHAT, cmd)
    }

    fn start_member(&mut self, i: usize) -> Result<(), ServerError> {
        self.members[i].supervisor.start()?;
        self.members[i].running = true;
        Ok(())
    }

    fn fail(&self, detail: &str) -> ServerError {
        let logs: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("--- {}:\n{}", m.name, m.supervisor.log_tail(15)))
            .collect();
        ServerError::Operation {
            what: WHAT,
            detail: format!("{detail}\n{}", logs.join("\n")),
        }
    }

    /// The stable address clients use: `postgres://postgres@127.0.0.1:PORT/postgres?sslmode=disable`
    /// of a proxy that forwards to the leader [`PatroniCluster::wait_leader`] last found.
    #[must_use]
    pub fn url(&self) -> String {
        format!("{}?sslmode=disable", self.leader_proxy.postgres_url())
    }

    /// The Patroni scope (cluster name) in the DCS.
    #[must_use]
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// How the cluster was configured.
    #[must_use]
    pub fn config(&self) -> PatroniConfig {
        self.config
    }

    /// Member `i`'s name (`p0`, `p1`, ...).
    #[must_use]
    pub fn name(&self, i: usize) -> &str {
        &self.members[i].name
    }

    /// Member `i`'s PostgreSQL port (its own, not a proxy).
    #[must_use]
    pub fn pg_port(&self, i: usize) -> u16 {
        self.members[i].pg_port
    }

    /// Member `i`'s REST API port.
    #[must_use]
    pub fn api_port(&self, i: usize) -> u16 {
        self.members[i].api_port
    }

    /// Member `i`'s own PostgreSQL URL (superuser `postgres`, trust).
    #[must_use]
    pub fn member_url(&self, i: usize) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres?sslmode=disable",
            self.members[i].pg_port
        )
    }

    /// The last lines of member `i`'s log (Patroni's and its PostgreSQL's).
    #[must_use]
    pub fn log_tail(&self, i: usize, lines: usize) -> String {
        self.members[i].supervisor.log_tail(lines)
    }

    /// The index of the member whose REST API answers `GET /leader` with 200 (it holds the
    /// leader key) and whose PostgreSQL is out of recovery, if any.
    pub async fn leader(&self) -> Option<usize> {
        for (i, m) in self.members.iter().enumerate() {
            if !m.running {
                continue;
            }
            let port = m.api_port;
            let status = process::blocking(move || Ok(http(port, "GET", "/leader", "", 2)))
                .await
                .ok()
                .flatten();
            if status.is_some_and(|(code, _)| code == 200)
                && psql(&self.bindir, m.pg_port, "SELECT pg_is_in_recovery()")
                    .await
                    .is_ok_and(|r| r == "f")
            {
                return Some(i);
            }
        }
        None
    }

    /// Waits (up to 60 s) until a member other than `not` leads and accepts writes, points
    /// [`PatroniCluster::url`] at it and closes every connection through it (they reached
    /// the old leader). Returns the leader's index.
    ///
    /// # Errors
    /// [`ServerError::Operation`] (with every member's log tail) when none does in time.
    pub async fn wait_leader(&self, not: Option<usize>) -> Result<usize, ServerError> {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(i) = self.leader().await.filter(|i| Some(*i) != not) {
                self.leader_proxy.retarget(self.members[i].pg_port);
                self.leader_proxy.drop_connections();
                return Ok(i);
            }
            if Instant::now() > deadline {
                return Err(self.fail(&format!("no new leader within {WAIT:?}")));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The member [`PatroniCluster::url`] forwards to.
    #[must_use]
    pub fn proxied_member(&self) -> Option<usize> {
        let port = self.leader_proxy.target_port();
        self.members.iter().position(|m| m.pg_port == port)
    }

    /// Runs `sql` with `psql` on member `i`'s own port (as `postgres`) and returns what it
    /// printed (unaligned, tuples only, trimmed).
    ///
    /// # Errors
    /// [`ServerError::Operation`] when `psql` fails.
    pub async fn sql(&self, i: usize, sql: &str) -> Result<String, ServerError> {
        psql(&self.bindir, self.members[i].pg_port, sql).await
    }

    /// Member `i`'s timeline: its current WAL file's (a primary) or the one its WAL receiver
    /// streams (a replica, which never writes WAL of its own; 0 when it does not stream).
    ///
    /// # Errors
    /// As [`PatroniCluster::sql`].
    pub async fn timeline(&self, i: usize) -> Result<i64, ServerError> {
        let out = self
            .sql(
                i,
                "SELECT CASE WHEN pg_is_in_recovery() \
                 THEN coalesce((SELECT received_tli FROM pg_stat_wal_receiver), 0) \
                 ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int END",
            )
            .await?;
        out.trim()
            .parse()
            .map_err(|_| self.fail(&format!("not a timeline: {out:?}")))
    }

    /// Waits (up to 60 s) until the leader (the member the URL points at) has `replicas`
    /// streaming replicas (with `synchronous_mode`, one of them `sync`).
    ///
    /// # Errors
    /// [`ServerError::Operation`] when they do not stream in time.
    pub async fn wait_streaming(&self, replicas: usize) -> Result<(), ServerError> {
        let sync = if self.config.synchronous_mode && replicas > 0 {
            " AND (SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync') = 1"
        } else {
            ""
        };
        let sql = format!(
            "SELECT (SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming') = {replicas}{sync}"
        );
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(leader) = self.proxied_member()
                && self.sql(leader, &sql).await.is_ok_and(|r| r == "t")
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(self.fail(&format!("{replicas} replica(s) not streaming in time")));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits (up to 60 s) until member `i` has replayed everything the leader had flushed
    /// when this was called.
    ///
    /// # Errors
    /// [`ServerError::Operation`] when it does not catch up in time.
    pub async fn wait_replayed(&self, i: usize) -> Result<(), ServerError> {
        let leader = self
            .proxied_member()
            .ok_or_else(|| self.fail("no leader"))?;
        let lsn = self
            .sql(leader, "SELECT pg_current_wal_flush_lsn()")
            .await?;
        let sql = format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn");
        let deadline = Instant::now() + WAIT;
        while !self.sql(i, &sql).await.is_ok_and(|r| r == "t") {
            if Instant::now() > deadline {
                return Err(self.fail(&format!("p{i} did not replay up to {lsn} in time")));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Cuts member `i`'s PostgreSQL off from the other members, as a network partition
    /// would: the address it advertises refuses (its proxy forwards to a closed port) and
    /// the replication connections open through it are closed. Patroni and clients (which
    /// use [`PatroniCluster::url`] or the member's own port) are not affected.
    ///
    /// # Errors
    /// When no free port could be found.
    pub fn cut_off(&self, i: usize) -> Result<(), ServerError> {
        let nowhere = process::free_ports(1)?[0];
        let m = &self.members[i];
        m.advertised.retarget(nowhere);
        m.advertised.drop_connections();
        Ok(())
    }

    /// Undoes [`PatroniCluster::cut_off`].
    pub fn reconnect(&self, i: usize) {
        let m = &self.members[i];
        m.advertised.retarget(m.pg_port);
    }

    /// Crashes member `i`, as a lost machine would: `SIGKILL` of its Patroni (by PID), then
    /// of its postmaster and every process the postmaster started; waits until all are gone
    /// and its PostgreSQL port is closed. Its data directory stays, for
    /// [`PatroniCluster::restart`]. Returns how long it took.
    ///
    /// # Errors
    /// The member is not running, or a process could not be killed.
    pub async fn kill(&mut self, i: usize) -> Result<Duration, ServerError> {
        let started = Instant::now();
        let m = &mut self.members[i];
        let pid = m.running.then(|| m.supervisor.pid()).flatten();
        let name = m.name.clone();
        let pid = process::signal(WHAT, pid, "-KILL", || format!("{name} is not running"))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while process_alive(pid) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let _ = std::fs::remove_file(m.supervisor.dir().join("pid"));
        m.running = false;
        let (data, port) = (m.data(), m.pg_port);
        let postmaster = std::fs::read_to_string(data.join("postmaster.pid"))
            .ok()
            .and_then(|s| s.lines().next()?.trim().parse::<u32>().ok());
        if postmaster.is_some_and(process_alive) {
            process::blocking(move || kill_postgres(&data, port)).await?;
        }
        m.advertised.drop_connections();
        Ok(started.elapsed())
    }

    /// Starts killed member `i`'s Patroni again on its data directory (it rejoins: as a
    /// replica of the current leader, after `pg_rewind` when its timeline diverged).
    ///
    /// # Errors
    /// The supervisor is gone.
    pub fn restart(&mut self, i: usize) -> Result<(), ServerError> {
        self.start_member(i)
    }

    /// Asks Patroni for a switchover (`POST /switchover` on the leader's REST API, which
    /// answers once it is done) from `leader` to `candidate`, then waits until `candidate`
    /// leads ([`PatroniCluster::wait_leader`]).
    ///
    /// # Errors
    /// [`ServerError::Operation`] when Patroni refuses (with its answer) or the candidate
    /// does not lead in time.
    pub async fn switchover(&self, leader: usize, candidate: usize) -> Result<(), ServerError> {
        let body = format!(
            r#"{{"leader": "{}", "candidate": "{}"}}"#,
            self.members[leader].name, self.members[candidate].name
        );
        let port = self.members[leader].api_port;
        let answer =
            process::blocking(move || Ok(http(port, "POST", "/switchover", &body, 60))).await?;
        match answer {
            Some((200, _)) => {}
            other => return Err(self.fail(&format!("POST /switchover answered {other:?}"))),
        }
        let deadline = Instant::now() + WAIT;
        loop {
            let now = self.wait_leader(None).await?;
            if now == candidate {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(self.fail(&format!("p{now} still leads after the switchover")));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The failover history Patroni keeps in the DCS, as member `i`'s REST API reports it
    /// (`GET /history`: a JSON list of `[timeline, switch LSN, reason, time, new leader]`), or
    /// `None` when it does not answer.
    pub async fn history(&self, i: usize) -> Option<String> {
        let port = self.members[i].api_port;
        process::blocking(move || Ok(http(port, "GET", "/history", "", 2)))
            .await
            .ok()
            .flatten()
            .filter(|(code, _)| *code == 200)
            .map(|(_, body)| body)
    }

    /// Member `i`'s PostgreSQL data directory (removed when the cluster stops).
    #[must_use]
    pub fn data_dir(&self, i: usize) -> PathBuf {
        self.members[i].data()
    }

    /// Whether member `i`'s Patroni runs (started, and not killed since).
    #[must_use]
    pub fn is_running(&self, i: usize) -> bool {
        self.members[i].running
    }

    /// The etcd the members use as their DCS.
    #[must_use]
    pub fn etcd(&self) -> &EtcdCluster {
        &self.etcd
    }
}

impl Drop for PatroniCluster {
    fn drop(&mut self) {
        for m in &mut self.members {
            m.supervisor.shutdown();
        }
    }
}

/// Member `m`'s `patroni.yml`.
fn member_config(
    config: &PatroniConfig,
    scope: &str,
    etcd_port: u16,
    m: &PatroniMember,
    bindir: &Path,
) -> String {
    let dir = m.supervisor.dir().display().to_string();
    format!(
        r#"scope: {scope}
name: {name}
log:
  level: INFO
restapi:
  listen: 127.0.0.1:{api}
  connect_address: 127.0.0.1:{api}
etcd3:
  hosts: 127.0.0.1:{etcd_port}
bootstrap:
  dcs:
    ttl: {PATRONI_TTL_S}
    loop_wait: {PATRONI_LOOP_WAIT_S}
    retry_timeout: 4
    maximum_lag_on_failover: 1073741824
    synchronous_mode: {sync}
    check_timeline: {check}
    postgresql:
      use_pg_rewind: true
      use_slots: true
      parameters:
        wal_log_hints: 'on'
        fsync: 'off'
        max_connections: 100
        wal_keep_size: 256MB
        wal_receiver_status_interval: 1s
  initdb:
    - encoding: UTF8
    - auth: trust
postgresql:
  listen: 127.0.0.1:{pg}
  connect_address: 127.0.0.1:{advertised}
  data_dir: {dir}/data
  bin_dir: {bindir}
  pgpass: {dir}/pgpass
  authentication:
    superuser:
      username: postgres
      password: postgres
    replication:
      username: replicator
      password: replicator
  pg_hba:
    - local all all trust
    - host all all 127.0.0.1/32 trust
    - host replication all 127.0.0.1/32 trust
  parameters:
    unix_socket_directories: '{dir}'
"#,
        name = m.name,
        api = m.api_port,
        pg = m.pg_port,
        advertised = m.advertised.port(),
        sync = config.synchronous_mode,
        check = config.check_timeline,
        bindir = bindir.display(),
    )
}

/// A tiny HTTP/1.1 client for Patroni's REST API: the status code and body, `None` when it
/// does not answer within `timeout_s`.
fn http(port: u16, method: &str, path: &str, body: &str, timeout_s: u64) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(
        &SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
        Duration::from_millis(500),
    )
    .ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(timeout_s)))
        .ok()?;
    stream
        .set_write_timeout(Some(Duration::from_secs(2)))
        .ok()?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body.to_owned()))
}

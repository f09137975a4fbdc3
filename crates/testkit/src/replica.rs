//! A throwaway replicated PostgreSQL ([`PgReplicaSet`]): a primary, one streaming standby made
//! with `pg_basebackup -R`, and a [`Proxy`] in front of whichever is the primary — the stable
//! address clients keep across a failover, as a virtual IP or a failover manager's endpoint
//! gives them. It can cut the standby off ([`PgReplicaSet::cut_off_standby`]) and fail over
//! for real ([`PgReplicaSet::fail_over`]: `SIGKILL` of the primary, `pg_promote` of the
//! standby, the proxy moved), so tests can see what a promotion loses.
//!
//! Both servers run under the testkit's supervisors ([`Server`]): dropping the set (or this
//! process exiting) stops them and removes their directories. SQL is sent with the installed
//! `psql` (no client library here), as the superuser `postgres` over loopback TCP.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::process::{self, connects, process_alive};
use crate::{PgSetup, Proxy, Server, ServerError, postgres_bindir};

/// How long every wait of a [`PgReplicaSet`] may take before it fails.
const WAIT: Duration = Duration::from_secs(60);

/// How a [`PgReplicaSet`]'s standby is replicated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replication {
    /// Asynchronous streaming: the primary acknowledges a commit once it is in its own WAL
    /// (`synchronous_commit = on`, no synchronous standby). A promotion loses every commit the
    /// standby had not received.
    Async,
    /// Synchronous streaming: `synchronous_standby_names = '*'` and `synchronous_commit = on`
    /// on the primary, which acknowledges a commit only once the standby has flushed it. A
    /// promotion loses no acknowledged commit; while the standby is cut off, commits wait.
    Sync,
}

/// What a [`PgReplicaSet::fail_over`] did.
#[derive(Clone, Copy, Debug)]
pub struct Failover {
    /// The old primary's port (its server is gone).
    pub old_port: u16,
    /// The promoted standby's port: the new primary, where the proxy now forwards.
    pub new_port: u16,
    /// The timeline the old primary was on.
    pub old_timeline: i64,
    /// The new primary's timeline (a promotion starts a new one: `old_timeline + 1` here).
    pub new_timeline: i64,
    /// From the start of the failover until the old primary's processes were gone and its
    /// port closed.
    pub kill: Duration,
    /// From the start of the failover until the new primary accepted writes behind the proxy.
    pub took: Duration,
}

/// A throwaway primary, one streaming standby, and a proxy in front of the primary (see the
/// module documentation). After [`PgReplicaSet::fail_over`] the promoted standby is the
/// primary and there is no standby.
#[derive(Debug)]
pub struct PgReplicaSet {
    replication: Replication,
    primary: Server,
    standby: Option<Server>,
    proxy: Proxy,
    bindir: PathBuf,
    /// The primary's timeline, as last read.
    timeline: i64,
    cut_off: bool,
}

impl PgReplicaSet {
    /// Starts a primary (superuser `postgres`, trust auth, `fsync = off` but
    /// `synchronous_commit = on`), takes a base backup of it with `pg_basebackup -R` and starts
    /// that as a hot standby streaming from it, then (for [`Replication::Sync`]) makes it the
    /// primary's synchronous standby; waits until the standby streams (as `sync` when
    /// synchronous) and a proxy forwards to the primary.
    ///
    /// # Errors
    /// [`ServerError::NotInstalled`] without the PostgreSQL server binaries;
    /// [`ServerError::StartFailed`] when a server does not come up, or the standby does not
    /// stream, within 60 s.
    pub async fn start(replication: Replication) -> Result<Self, ServerError> {
        let bindir = postgres_bindir()?;
        // Local commits are acknowledged once written to the WAL (fsync stays off: a SIGKILL
        // loses no written WAL); what the standby lacks is what a promotion loses.
        let settings = vec![
            "synchronous_commit=on".to_owned(),
            "wal_level=replica".to_owned(),
            "max_wal_senders=10".to_owned(),
            "hot_standby=on".to_owned(),
            "wal_receiver_status_interval=1s".to_owned(),
        ];
        let primary = Server::postgres_with(&PgSetup {
            settings: settings.clone(),
            ..PgSetup::default()
        })
        .await?;
        let standby = Server::postgres_with(&PgSetup {
            standby_of: Some(primary.port()),
            settings,
            ..PgSetup::default()
        })
        .await?;
        let proxy = Proxy::start(primary.port())?;
        let mut set = Self {
            replication,
            primary,
            standby: Some(standby),
            proxy,
            bindir,
            timeline: 0,
            cut_off: false,
        };
        if replication == Replication::Sync {
            // Only now: the base backup's own WAL stream must not be waited for.
            set.alter_system(set.primary.port(), "synchronous_standby_names", "'*'")
                .await?;
        }
        let sql = match replication {
            Replication::Async => {
                "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
            }
            Replication::Sync => {
                "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming' \
                 AND sync_state = 'sync'"
            }
        };
        let port = set.primary.port();
        set.wait_until("the standby to stream", || async move {
            Ok(set_psql(port, sql).await? == "1")
        })
        .await?;
        set.timeline = set.timeline().await?;
        Ok(set)
    }

    /// How the standby is replicated.
    #[must_use]
    pub fn replication(&self) -> Replication {
        self.replication
    }

    /// The stable address: `postgres://postgres@127.0.0.1:PORT/postgres?sslmode=disable` of
    /// the proxy, which forwards to the current primary (after a failover, the promoted
    /// standby). TLS is off (the throwaway servers have none), so a client that connects while
    /// no server is behind the proxy sees its connection closed — an I/O error, as a refused
    /// connection would be — rather than a garbled TLS negotiation.
    #[must_use]
    pub fn url(&self) -> String {
        format!("{}?sslmode=disable", self.proxy.postgres_url())
    }

    /// The proxy behind [`PgReplicaSet::url`] (e.g. to count its connections).
    #[must_use]
    pub fn proxy(&self) -> &Proxy {
        &self.proxy
    }

    /// The current primary's own URL (not through the proxy).
    #[must_use]
    pub fn primary_url(&self) -> String {
        self.primary.url()
    }

    /// The current primary's port.
    #[must_use]
    pub fn primary_port(&self) -> u16 {
        self.primary.port()
    }

    /// The standby's own URL (`None` after a failover promoted it).
    #[must_use]
    pub fn standby_url(&self) -> Option<String> {
        self.standby.as_ref().map(Server::url)
    }

    /// The standby's port (`None` after a failover promoted it).
    #[must_use]
    pub fn standby_port(&self) -> Option<u16> {
        self.standby.as_ref().map(Server::port)
    }

    /// Whether [`PgReplicaSet::cut_off_standby`] cut the standby off (and no failover since).
    #[must_use]
    pub fn is_cut_off(&self) -> bool {
        self.cut_off
    }

    /// Runs `sql` with `psql` through the stable address (the proxy, as clients do) and returns
    /// what it printed (unaligned, tuples only, trimmed: one value per line). Several
    /// statements in `sql` run in one implicit transaction.
    ///
    /// # Errors
    /// [`ServerError::Operation`] when `psql` fails (with its stderr) or takes over 60 s.
    pub async fn sql(&self, sql: &str) -> Result<String, ServerError> {
        psql(&self.bindir, self.proxy.port(), sql).await
    }

    /// Runs `sql` with `psql` on the current primary (its own port, not the proxy) and returns
    /// what it printed (unaligned, tuples only, trimmed: one value per line).
    ///
    /// # Errors
    /// [`ServerError::Operation`] when `psql` fails (with its stderr) or takes over 60 s.
    pub async fn primary_sql(&self, sql: &str) -> Result<String, ServerError> {
        psql(&self.bindir, self.primary.port(), sql).await
    }

    /// [`PgReplicaSet::primary_sql`] on the standby (read-only queries: it is in recovery).
    ///
    /// # Errors
    /// As [`PgReplicaSet::primary_sql`]; [`ServerError::Operation`] after a failover (no
    /// standby).
    pub async fn standby_sql(&self, sql: &str) -> Result<String, ServerError> {
        psql(&self.bindir, self.standby()?.port(), sql).await
    }

    /// The current primary's timeline (`1` for a fresh cluster; a promotion starts a new one),
    /// read from the name of its current WAL file, which changes at the promotion itself (the
    /// control file's checkpoint timeline only after the next checkpoint).
    ///
    /// # Errors
    /// As [`PgReplicaSet::primary_sql`].
    pub async fn timeline(&self) -> Result<i64, ServerError> {
        let out = self.primary_sql(TIMELINE_SQL).await?;
        parse_timeline(&out)
    }

    /// The standby's timeline: that of the last checkpoint it replayed (its primary's, since
    /// it never was promoted).
    ///
    /// # Errors
    /// As [`PgReplicaSet::standby_sql`].
    pub async fn standby_timeline(&self) -> Result<i64, ServerError> {
        let out = self
            .standby_sql("SELECT timeline_id FROM pg_control_checkpoint()")
            .await?;
        parse_timeline(&out)
    }

    /// Waits until the standby has replayed everything the primary had flushed to its WAL
    /// when this was called (so every commit acknowledged before the call is on the
    /// standby). Returns how long it took.
    ///
    /// # Errors
    /// [`ServerError::Operation`] after a failover, once the standby is cut off, or when it
    /// has not caught up within 60 s.
    pub async fn wait_replayed(&self) -> Result<Duration, ServerError> {
        if self.cut_off {
            return Err(op("the standby is cut off: it will not catch up"));
        }
        let started = Instant::now();
        let lsn = self
            .primary_sql("SELECT pg_current_wal_flush_lsn()")
            .await?;
        let standby = self.standby()?.port();
        let sql = format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn");
        self.wait_until("the standby to replay the primary's WAL", || {
            let sql = sql.clone();
            async move { Ok(set_psql(standby, &sql).await? == "t") }
        })
        .await?;
        Ok(started.elapsed())
    }

    /// Cuts the standby off: it stops receiving WAL (`ALTER SYSTEM SET primary_conninfo = ''`
    /// and a reload on the standby, which ends its WAL receiver and does not start another)
    /// while the primary goes on. Returns once neither side has a replication connection, so
    /// every commit after it is missing from the standby: with [`Replication::Async`] a
    /// promotion loses it; with [`Replication::Sync`] commits wait (nothing is acknowledged)
    /// until a failover.
    ///
    /// # Errors
    /// [`ServerError::Operation`] after a failover, or when the replication connection is
    /// still there after 60 s.
    pub async fn cut_off_standby(&mut self) -> Result<(), ServerError> {
        let standby = self.standby()?.port();
        self.alter_system(standby, "primary_conninfo", "''").await?;
        let primary = self.primary.port();
        self.wait_until("the standby's WAL receiver to stop", || async move {
            Ok(
                set_psql(standby, "SELECT count(*) FROM pg_stat_wal_receiver").await? == "0"
                    && set_psql(primary, "SELECT count(*) FROM pg_stat_replication").await? == "0",
            )
        })
        .await?;
        self.cut_off = true;
        Ok(())
    }

    /// Fails over: `SIGKILL`s the primary (its postmaster and every backend, as a crashed
    /// machine would lose them) and waits until its port is closed, closes every connection
    /// through the proxy, promotes the standby (`pg_promote(wait => true)`) and points the
    /// proxy at it. Clients reconnecting to [`PgReplicaSet::url`] reach the new primary,
    /// which starts a new timeline and has every commit the standby had received (all the
    /// acknowledged ones with [`Replication::Sync`]).
    ///
    /// # Errors
    /// [`ServerError::Operation`] when there is no standby (a second failover), a process
    /// could not be killed, or the promotion did not finish within 60 s.
    pub async fn fail_over(&mut self) -> Result<Failover, ServerError> {
        let standby = self
            .standby
            .take()
            .ok_or_else(|| op("no standby to promote (the set already failed over)"))?;
        let started = Instant::now();
        let old_port = self.primary.port();
        let dir = self.primary.dir().to_owned();
        // The supervisor then takes the server's death for a stop (it exits and removes the
        // directory) rather than a failed start (whose log it would copy to a pipe).
        std::fs::write(dir.join("stop"), b"")?;
        process::blocking(move || kill_postgres(&dir.join("data"), old_port)).await?;
        let kill = started.elapsed();
        let mut old = std::mem::replace(&mut self.primary, standby);
        process::blocking(move || {
            // Only once it has removed the directory is its stdin closed (its stop request
            // would otherwise race the removal).
            let deadline = Instant::now() + Duration::from_secs(10);
            while old.supervisor.try_wait()?.is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            old.stop();
            Ok(())
        })
        .await?;
        self.proxy.drop_connections();
        let promoted = self
            .primary_sql("SELECT pg_promote(wait => true, wait_seconds => 60)")
            .await?;
        if promoted != "t" {
            return Err(op(&format!("pg_promote said {promoted:?}")));
        }
        self.proxy.retarget(self.primary.port());
        // Anything that connected through the proxy meanwhile reached the dead port.
        self.proxy.drop_connections();
        let took = started.elapsed();
        let old_timeline = self.timeline;
        self.timeline = self.timeline().await?;
        self.cut_off = false;
        Ok(Failover {
            old_port,
            new_port: self.primary.port(),
            old_timeline,
            new_timeline: self.timeline,
            kill,
            took,
        })
    }

    /// Stops both servers and the proxy, removing their directories (as dropping it does).
    pub fn stop(self) {
        drop(self);
    }

    fn standby(&self) -> Result<&Server, ServerError> {
        self.standby
            .as_ref()
            .ok_or_else(|| op("no standby (the set failed over)"))
    }

    /// `ALTER SYSTEM SET name = value` and a reload on the server on `port`.
    async fn alter_system(&self, port: u16, name: &str, value: &str) -> Result<(), ServerError> {
        // Two statements: ALTER SYSTEM cannot run inside the implicit transaction of one.
        psql_many(
            &self.bindir,
            port,
            &[
                &format!("ALTER SYSTEM SET {name} = {value}"),
                "SELECT pg_reload_conf()",
            ],
        )
        .await
        .map(drop)
    }

    /// Polls `ready` every 50 ms until it says so; fails after [`WAIT`] naming `what`.
    async fn wait_until<F, Fut>(&self, what: &str, mut ready: F) -> Result<(), ServerError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<bool, ServerError>>,
    {
        let deadline = Instant::now() + WAIT;
        let mut last = None;
        loop {
            match ready().await {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => last = Some(e),
            }
            if Instant::now() > deadline {
                let why = last.map_or_else(String::new, |e| format!(" (last error: {e})"));
                return Err(op(&format!("waited {WAIT:?} for {what}{why}")));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The timeline of the current WAL file's name (its first 8 hex digits).
const TIMELINE_SQL: &str =
    "SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int";

fn parse_timeline(out: &str) -> Result<i64, ServerError> {
    out.trim()
        .parse()
        .map_err(|_| op(&format!("not a timeline: {out:?}")))
}

fn op(detail: &str) -> ServerError {
    ServerError::Operation {
        what: "PostgreSQL replica set",
        detail: detail.to_owned(),
    }
}

/// `psql` on `port`, found in the testkit's PostgreSQL bin directory.
async fn set_psql(port: u16, sql: &str) -> Result<String, ServerError> {
    psql(&postgres_bindir()?, port, sql).await
}

pub(crate) async fn psql(bindir: &Path, port: u16, sql: &str) -> Result<String, ServerError> {
    psql_many(bindir, port, &[sql]).await
}

/// Runs each of `sqls` (one `-c` each, so each in its own transaction) with `psql` as
/// `postgres` on `127.0.0.1:port`, off the runtime; at most 60 s.
async fn psql_many(bindir: &Path, port: u16, sqls: &[&str]) -> Result<String, ServerError> {
    let mut cmd = Command::new(bindir.join("psql"));
    cmd.args(["-X", "-A", "-t", "-q", "-v", "ON_ERROR_STOP=1"])
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-U", "postgres", "-d", "postgres"])
        .env("PGCONNECT_TIMEOUT", "5")
        .env("PGOPTIONS", "-c statement_timeout=60000")
        .stdin(Stdio::null());
    for sql in sqls {
        cmd.args(["-c", sql]);
    }
    let out = process::blocking(move || Ok(cmd.output()?)).await?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(ServerError::Operation {
            what: "psql",
            detail: format!(
                "port {port}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        })
    }
}

/// `SIGKILL`s the postmaster of the data directory `data` and every process it started (its
/// backends, the WAL sender...): stopped first, so it cannot start another meanwhile. Waits up
/// to 10 s until all are gone and `port` refuses connections.
pub(crate) fn kill_postgres(data: &Path, port: u16) -> Result<(), ServerError> {
    let pid: u32 = std::fs::read_to_string(data.join("postmaster.pid"))?
        .lines()
        .next()
        .and_then(|l| l.trim().parse().ok())
        .ok_or_else(|| op("no postmaster.pid"))?;
    let what = "PostgreSQL primary";
    process::signal(what, Some(pid), "-STOP", String::new)?;
    let mut victims = children_of(pid);
    victims.push(pid);
    for victim in &victims {
        // A backend may have exited meanwhile.
        let _ = process::signal(what, Some(*victim), "-KILL", String::new);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while victims.iter().any(|p| process_alive(*p)) || connects(port, Duration::from_millis(100)) {
        if Instant::now() > deadline {
            return Err(op("the old primary's processes survived SIGKILL for 10 s"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// The processes whose parent is `pid` (from `/proc`).
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| {
            std::fs::read_to_string(format!("/proc/{child}/stat")).is_ok_and(|stat| {
                // After the parenthesised command: state, then the parent's PID.
                stat.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
                    == Some(pid)
            })
        })
        .collect()
}

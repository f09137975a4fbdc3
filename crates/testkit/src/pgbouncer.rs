//! A throwaway PgBouncer (Debian's `pgbouncer` package) in front of a PostgreSQL on loopback,
//! in transaction or session pooling mode, with a deliberately small server pool so that
//! clients really share server connections.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::optional::{self, Installed};
use crate::process::{self, Supervisor};
use crate::{ServerError, find_in_path, is_root};

const HINT: &str = "install PgBouncer (Debian: apt-get install pgbouncer)";

/// The `pgbouncer` binary.
pub(crate) fn pgbouncer_bin() -> Result<PathBuf, ServerError> {
    find_in_path("pgbouncer").ok_or(ServerError::NotInstalled {
        what: "pgbouncer",
        hint: HINT,
    })
}

/// PgBouncer's `pool_mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolMode {
    /// A server connection is a client's for one transaction (one statement in autocommit).
    Transaction,
    /// A server connection is a client's until it disconnects.
    Session,
}

impl PoolMode {
    fn name(self) -> &'static str {
        match self {
            PoolMode::Transaction => "transaction",
            PoolMode::Session => "session",
        }
    }
}

/// A running throwaway PgBouncer. Dropping it stops it and removes its directory.
#[derive(Debug)]
pub struct PgBouncer {
    port: u16,
    mode: PoolMode,
    supervisor: Supervisor,
}

impl PgBouncer {
    /// Starts PgBouncer on a free loopback port in front of the PostgreSQL on
    /// `127.0.0.1:pg_port` (every database, user `postgres`, trust auth), with `pool_size`
    /// server connections per database and user. Runs as the `postgres` user when this
    /// process is root (PgBouncer refuses to run as root).
    ///
    /// # Errors
    /// [`ServerError::NotInstalled`] without `pgbouncer`; [`ServerError::StartFailed`] when it
    /// does not accept connections within 20 s.
    pub async fn start(
        pgbouncer: Installed<optional::PgBouncer>,
        pg_port: u16,
        mode: PoolMode,
        pool_size: u32,
    ) -> Result<Self, ServerError> {
        Self::start_with_users(pgbouncer, pg_port, mode, pool_size, &[]).await
    }

    /// [`PgBouncer::start`], letting `users` log in too (trust authentication, as for
    /// `postgres`: PgBouncer lets in only the users of its auth file).
    ///
    /// # Errors
    /// As [`PgBouncer::start`].
    pub async fn start_with_users(
        _pgbouncer: Installed<optional::PgBouncer>,
        pg_port: u16,
        mode: PoolMode,
        pool_size: u32,
        users: &[&str],
    ) -> Result<Self, ServerError> {
        let bin = pgbouncer_bin()?;
        let port = process::free_ports(1)?[0];
        let script = script(&bin, port, pg_port, mode, pool_size, users);
        let cmd = if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--", "sh", "-c", &script]);
            c
        } else {
            let mut c = Command::new("sh");
            c.args(["-c", &script]);
            c
        };
        let mut supervisor = process::blocking(move || Supervisor::spawn("pgbouncer", cmd)).await?;
        let deadline = Instant::now() + Duration::from_secs(20);
        while !process::connects(port, Duration::from_millis(200)) {
            if let Some(status) = supervisor.try_wait()? {
                return Err(ServerError::StartFailed {
                    what: "pgbouncer",
                    detail: format!("exited with {status}: {}", supervisor.failure_output()),
                });
            }
            if Instant::now() > deadline {
                return Err(ServerError::StartFailed {
                    what: "pgbouncer",
                    detail: format!("not accepting connections: {}", supervisor.log_tail(20)),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Self {
            port,
            mode,
            supervisor,
        })
    }

    /// The port it listens on.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its pooling mode.
    #[must_use]
    pub fn mode(&self) -> PoolMode {
        self.mode
    }

    /// A URL for `database` through it, as user `postgres`.
    #[must_use]
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// The last lines of its log.
    #[must_use]
    pub fn log_tail(&self, lines: usize) -> String {
        self.supervisor.log_tail(lines)
    }
}

fn script(
    bin: &std::path::Path,
    port: u16,
    pg_port: u16,
    mode: PoolMode,
    pool_size: u32,
    users: &[&str],
) -> String {
    let bin = crate::sh_quote(&PathBuf::from(bin));
    let mode = mode.name();
    // The auth file's lines, `"user" ""` (a `"` in a name doubled), inside printf's single
    // quotes: `%` and `\` escaped for printf, `'` closed and reopened for the shell.
    let mut userlist = String::from(r#""postgres" ""\n"#);
    for user in users {
        let name = user
            .replace('"', "\"\"")
            .replace('\\', "\\\\")
            .replace('%', "%%")
            .replace('\'', "'\\''");
        userlist.push_str(&format!(r#""{name}" ""\n"#));
    }
    format!(
        r#"set -u
umask 077
dir=$(mktemp -d /tmp/pgfence-pgbouncer.XXXXXX) || exit 1
trap 'rm -rf "$dir"' EXIT
printf '{userlist}' >"$dir/userlist.txt"
cat >"$dir/pgbouncer.ini" <<INI
[databases]
* = host=127.0.0.1 port={pg_port}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = $dir/userlist.txt
pool_mode = {mode}
default_pool_size = {pool_size}
max_client_conn = 500
ignore_startup_parameters = extra_float_digits
logfile = $dir/server.log
pidfile = $dir/pgbouncer.pid
INI
exec 3<&0
{bin} "$dir/pgbouncer.ini" >>"$dir/server.log" 2>&1 &
echo $! >"$dir/pid"
echo "dir=$dir"
( cat <&3 >/dev/null; kill -INT "$(cat "$dir/pid")" 2>/dev/null ) &
wait "$(cat "$dir/pid")"; status=$?
[ $status -ne 0 ] && cat "$dir/server.log" >&2
exit $status
"#
    )
}

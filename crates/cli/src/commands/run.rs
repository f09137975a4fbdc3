//! `pgfence run`: flock-style, for cron jobs and shell scripts.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::signal::unix::{SignalKind, signal};

use crate::cli::Conn;
use crate::connect::take_lock;
use crate::util::{self, cell};

/// One variable `pgfence run` exports to its command: its name, what it holds (for
/// `--help`), and its value for a lease.
pub struct ChildVar {
    pub name: &'static str,
    pub about: &'static str,
    value: fn(&pgfence::Lease) -> String,
}

/// Everything the command gets in its environment from `pgfence run`: the one list that both
/// builds the environment and is shown by `pgfence run --help`.
pub const CHILD_ENV: &[ChildVar] = &[
    ChildVar {
        name: "PGFENCE_FENCE",
        about: "the fence for hand-written SQL in the write-up's form: SET fence = $PGFENCE_FENCE ... WHERE ... AND fence < $PGFENCE_FENCE (every write of the lease; 0 rows when a newer lease wrote the row)",
        value: |l| l.fence().to_string(),
    },
    ChildVar {
        name: "PGFENCE_TOKEN",
        about: "the lease's fencing token, for pgfence.check / try_check / next_fence / admits (a token is not a fence: never compare it with the fence column)",
        value: |l| l.token().to_string(),
    },
    ChildVar {
        name: "PGFENCE_RESOURCE",
        about: "the resource's name in PostgreSQL, for pgfence.check / pgfence.try_check and `pgfence effect`: the locked resource, or under a --key-prefix P other than pgfence P{RESOURCE ({P{D}NAME in a fencing domain)",
        value: |l| l.fencing_resource().as_str().to_owned(),
    },
    ChildVar {
        name: "PGFENCE_KEY_PREFIX",
        about: "the issuer's key prefix, so that pgfence commands run by the command use the run's (`pgfence lock status \"$PGFENCE_RESOURCE\"`)",
        value: |l| {
            l.fencing_resource()
                .key_prefix()
                .unwrap_or(pgfence::issuer::DEFAULT_KEY_PREFIX)
                .to_owned()
        },
    },
    ChildVar {
        name: "PGFENCE_OWNER",
        about: "the lease's owner id",
        value: |l| l.owner().to_owned(),
    },
    ChildVar {
        name: "PGFENCE_TIMELINE",
        about: "the PostgreSQL timeline the lease is bound to, read when the lock was taken (0 without a database URL): pass it to pgfence.try_check / pgfence.check / pgfence.admits so the command's writes are refused after a failover of the database",
        value: |l| l.timeline().unwrap_or(0).to_string(),
    },
    ChildVar {
        name: "PGFENCE_TAG",
        about: "the holder tag SQL callers pass to pgfence.check / pgfence.next_fence",
        value: |l| pgfence::Fencing::from(l).tag().to_string(),
    },
];

/// Binds the lease to the database's current timeline (`PGFENCE_TIMELINE`), so that the
/// command's fenced statements are refused after a failover of the database. Without a
/// database URL the lease stays unbound; when the timeline cannot be read, a warning says the
/// command's writes are not fenced across a failover.
async fn bind_timeline(conn: &Conn, lease: pgfence::Lease) -> pgfence::Lease {
    let Ok(url) = conn.database_url() else {
        return lease;
    };
    let read = async {
        let pool = crate::connect::connect_pg(url).await?;
        let timeline: i64 = sqlx::query_scalar("SELECT pgfence.timeline()")
            .fetch_one(&pool)
            .await?;
        pool.close().await;
        anyhow::Ok(timeline)
    };
    match read.await {
        Ok(timeline) => lease.on_timeline(timeline),
        Err(e) => {
            util::warn_later(format!(
                "PGFENCE_TIMELINE is 0: the database's timeline could not be read ({}), so the command's writes are not fenced across a failover of PostgreSQL (run `pgfence migrate`)",
                util::one_line(&e)
            ));
            lease
        }
    }
}

/// The `after_help` of `pgfence run`: the variables of [`CHILD_ENV`].
pub fn env_help() -> String {
    let width = CHILD_ENV.iter().map(|v| v.name.len()).max().unwrap_or(0);
    let mut help = String::from("The command gets these variables in its environment:\n");
    for v in CHILD_ENV {
        help.push_str(&format!("  {:<width$}  {}\n", v.name, v.about));
    }
    help.trim_end().to_owned()
}

/// Acquires the lock, runs `command` with the variables of [`CHILD_ENV`] in its environment
/// while a keep-alive renews the lease, then releases the lock and exits with the command's
/// status (128 + signal if it was killed).
///
/// SIGTERM and SIGHUP are forwarded to the command. SIGINT is forwarded after one second if
/// the command is still running (a terminal's Ctrl-C already reaches the whole foreground
/// process group). Either way the lock is released once the command has exited. If the lease
/// is lost while the command runs, a line on stderr says so; the command's writes are still
/// fenced by Postgres.
pub async fn run(
    conn: &Conn,
    resource: &str,
    ttl: Duration,
    wait: Option<Duration>,
    on_lost: crate::cli::OnLeaseLost,
    command: &[String],
) -> Result<ExitCode> {
    let resource = util::resource(resource)?;
    pgfence::issuer::limits::check_ttl(ttl)?;
    let Some(program) = command.first() else {
        bail!("no command given after --")
    };
    // Resolve the program before taking the lock: a missing one is reported as such.
    resolve_program(program)
        .with_context(|| format!("cannot run {:?}", cell(&util::shorten(program))))?;
    let issuer = conn.lock_issuer().await?;
    let lease = take_lock(&*issuer, &resource, ttl, wait).await?;
    let lease = bind_timeline(conn, lease).await;

    let spawned = child_command(program, &command[1..])
        .envs(CHILD_ENV.iter().map(|v| (v.name, (v.value)(&lease))))
        .spawn();
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            let _ = issuer.release(&lease).await;
            return Err(e)
                .with_context(|| format!("cannot run {:?}", cell(&util::shorten(program))));
        }
    };

    // The command is under way: say now what was held back (it may run for hours).
    util::flush_warnings();
    let mut keep = pgfence::issuer::KeepAlive::spawn(issuer.clone(), lease.clone());
    let mut term = signal(SignalKind::terminate())?;
    let mut hup = signal(SignalKind::hangup())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut lost_reported = false;
    let mut int_forward_at: Option<tokio::time::Instant> = None;
    let status = loop {
        tokio::select! {
            status = child.wait() => break status?,
            _ = term.recv() => forward(&child, "TERM"),
            _ = hup.recv() => forward(&child, "HUP"),
            // A terminal delivers SIGINT to the command too; if it was sent to pgfence alone,
            // pass it on after a grace period rather than doubling a terminal's Ctrl-C.
            _ = int.recv() => int_forward_at = Some(tokio::time::Instant::now() + Duration::from_secs(1)),
            _ = sleep_until_opt(int_forward_at) => {
                int_forward_at = None;
                forward(&child, "INT");
            }
            lost = keep.lost(), if !lost_reported => {
                lost_reported = true;
                let action = match on_lost {
                    crate::cli::OnLeaseLost::Kill => {
                        forward(&child, "TERM");
                        "sent it SIGTERM (--on-lease-lost kill)"
                    }
                    crate::cli::OnLeaseLost::Wait => "letting it finish (--on-lease-lost wait)",
                };
                eprintln!(
                    "pgfence: lease on {} lost while the command runs: {lost}; {action}; its writes with token {} are still fenced by Postgres",
                    cell(resource.as_str()), lease.token()
                );
            }
        }
    };
    keep.stop();
    match issuer.release(&lease).await {
        Ok(_) => {}
        Err(e) => eprintln!(
            "pgfence: could not release {} ({e}); it expires on its own",
            cell(resource.as_str())
        ),
    }
    Ok(exit_code(status))
}

/// `setpriv`, from util-linux, when installed: it sets the parent-death signal.
const SETPRIV: &str = "/usr/bin/setpriv";

/// The command to spawn for `program`. Where `setpriv` is installed it is started through
/// `setpriv --pdeathsig TERM`, which makes the kernel send it SIGTERM if pgfence dies
/// (even by SIGKILL, which pgfence cannot handle) and then execs the program in the same
/// process: so the command does not outlive the lock's keep-alive. (Setting the signal
/// directly needs `prctl` between fork and exec, i.e. unsafe code, which this workspace
/// forbids.) Elsewhere the program is started directly.
fn child_command(program: &str, args: &[String]) -> tokio::process::Command {
    // The parent-death signal fires when the *thread* that forked exits: this runs on the
    // main thread (the command's future is not spawned onto the runtime's workers), which
    // lives as long as pgfence.
    if std::path::Path::new(SETPRIV).is_file() {
        let mut c = tokio::process::Command::new(SETPRIV);
        c.args(["--pdeathsig", "TERM", "--"])
            .arg(program)
            .args(args);
        c
    } else {
        tracing::info!(target: "pgfence::run", "{SETPRIV} not found: the command will outlive pgfence if pgfence is killed with SIGKILL");
        let mut c = tokio::process::Command::new(program);
        c.args(args);
        c
    }
}

/// `program` as a path to an executable file: as given when it contains a `/`, else the
/// first match on `PATH` (the lookup the spawn itself makes; checked first so that a missing
/// program is reported as such, not as `setpriv`'s failure).
fn resolve_program(program: &str) -> Result<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &std::path::Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.is_empty() {
        bail!("empty program name");
    }
    if program.contains('/') {
        let path = std::path::PathBuf::from(program);
        if executable(&path) {
            return Ok(path);
        }
        bail!("no such executable file");
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| executable(p))
        .context("not found on PATH")
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Sends `signal` to the child with `kill`, if it is still running.
fn forward(child: &tokio::process::Child, signal: &str) {
    if let Some(pid) = child.id() {
        let _ = std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status();
    }
}

/// The command's exit code, or 128 + the signal that killed it.
fn exit_code(status: std::process::ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    let code = status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1);
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

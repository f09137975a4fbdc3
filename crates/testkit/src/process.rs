//! What every kind of throwaway server shares: the `sh` supervisor that owns a server's
//! temporary directory ([`Supervisor`]), the member supervisor script the etcd, ZooKeeper and
//! Sentinel processes run under ([`Supervisor::member`]), a cluster member's start / kill /
//! wait ([`Member`], for etcd and ZooKeeper), signals by PID ([`signal`],
//! [`Supervisor::kill_server`]), and small helpers (free ports, the scratch directory, running
//! blocking work off the runtime, retries).
//!
//! A supervisor prints `dir=DIR` as its first line, or exits with the reason on stderr. Its
//! stdin is a pipe from this process: when the pipe closes (the owner dropped it, or this
//! process exited, panicked or was killed) the supervisor stops its server and removes `DIR`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::ServerError;

/// A running `sh` supervisor and the directory it owns. Dropping it closes its stdin and waits
/// until it has stopped the server and removed the directory.
#[derive(Debug)]
pub(crate) struct Supervisor {
    /// Which server, for errors.
    what: &'static str,
    dir: PathBuf,
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Supervisor {
    /// Spawns `cmd` (a supervisor script, run from `/`) with piped stdio in its own process
    /// group, so a Ctrl-C at the terminal reaches only this process, and reads its `dir=` line.
    ///
    /// Blocks until that line comes (an `initdb` takes seconds): call it through [`blocking`]
    /// from async code.
    ///
    /// # Errors
    /// [`ServerError::Io`] when it cannot be spawned; [`ServerError::StartFailed`] with its
    /// stderr ([`Supervisor::failure_output`]) when it exits without a directory.
    pub(crate) fn spawn(what: &'static str, mut cmd: Command) -> Result<Self, ServerError> {
        cmd.current_dir("/")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let mut child = cmd.spawn()?;
        let stdin = child.stdin.take();
        let mut line = String::new();
        let stdout = child.stdout.take().expect("stdout is piped");
        BufReader::new(stdout).read_line(&mut line)?;
        let mut supervisor = Self {
            what,
            dir: PathBuf::new(),
            child,
            stdin,
        };
        match line.trim().strip_prefix("dir=") {
            Some(dir) => {
                supervisor.dir = PathBuf::from(dir);
                Ok(supervisor)
            }
            None => Err(ServerError::StartFailed {
                what,
                detail: supervisor.failure_output(),
            }),
        }
    }

    /// Spawns a member supervisor: it makes a fresh directory with `mktemp -d DIR_TEMPLATE`
    /// (shell words, quoted by the caller, e.g. `'/dev/shm'/pgfence-etcd.XXXXXX`) and runs
    /// `server` (a shell command line, which may use `"$dir"`) in the background, logging to
    /// `$dir/server.log` and writing its PID to `$dir/pid`, each time [`Supervisor::start`]
    /// asks. When its stdin closes it `SIGKILL`s the server (a stopped one too) and removes the
    /// directory.
    ///
    /// # Errors
    /// As [`Supervisor::spawn`].
    pub(crate) fn member(
        what: &'static str,
        dir_template: &str,
        server: &str,
    ) -> Result<Self, ServerError> {
        // `start` lines start the server (again, on the same directory); EOF stops everything.
        let script = format!(
            r#"set -u
umask 077
dir=$(mktemp -d {dir_template}) || exit 1
trap 'kill -KILL $(cat "$dir/pid" 2>/dev/null) 2>/dev/null; rm -rf "$dir"' EXIT
echo "dir=$dir"
while IFS= read -r cmd; do
  if [ "$cmd" = start ]; then
    {server} >>"$dir/server.log" 2>&1 &
    echo $! >"$dir/pid.new" && mv "$dir/pid.new" "$dir/pid"
  fi
done"#
        );
        let mut cmd = Command::new("sh");
        cmd.args(["-c", &script]);
        Self::spawn(what, cmd)
    }

    /// The directory the supervisor owns (removed when it stops).
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Tells a member supervisor ([`Supervisor::member`]) to start its server, after removing
    /// the previous server's PID file so [`Supervisor::pid`] names only the new one.
    ///
    /// # Errors
    /// The supervisor was shut down, or writing to it failed.
    pub(crate) fn start(&mut self) -> Result<(), ServerError> {
        let _ = std::fs::remove_file(self.dir.join("pid"));
        let stdin = self.stdin.as_mut().ok_or(ServerError::StartFailed {
            what: self.what,
            detail: "already stopped".into(),
        })?;
        stdin.write_all(b"start\n")?;
        stdin.flush()?;
        Ok(())
    }

    /// The PID the supervisor last wrote to `$dir/pid`: its server's, once started.
    pub(crate) fn pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.dir.join("pid"))
            .ok()
            .and_then(|p| p.trim().parse().ok())
    }

    /// `SIGKILL`s the server `pid` (found by the caller, `None` when it does not run: then
    /// `not_running` says why), forgets its PID file (the supervisor must not signal this PID
    /// again once it may belong to another process), and waits up to 10 s until the process
    /// has exited and `port` refuses connections (each try waiting up to `connect_timeout`).
    ///
    /// # Errors
    /// As [`signal`].
    pub(crate) fn kill_server(
        &self,
        pid: Option<u32>,
        not_running: impl FnOnce() -> String,
        port: u16,
        connect_timeout: Duration,
    ) -> Result<(), ServerError> {
        let pid = signal(self.what, pid, "-KILL", not_running)?;
        let _ = std::fs::remove_file(self.dir.join("pid"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && (process_alive(pid) || connects(port, connect_timeout)) {
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    /// The last `lines` lines of `$dir/server.log`, for error messages.
    pub(crate) fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// The supervisor's exit status, if it has exited.
    pub(crate) fn try_wait(&mut self) -> std::io::Result<Option<ExitStatus>> {
        self.child.try_wait()
    }

    /// Waits for the supervisor to exit and returns the end of what it wrote to stderr (at
    /// most 2000 characters, trimmed; `no output` when empty).
    pub(crate) fn failure_output(&mut self) -> String {
        let _ = self.child.wait();
        let mut out = String::new();
        if let Some(mut err) = self.child.stderr.take() {
            let _ = err.read_to_string(&mut out);
        }
        let out = out.trim();
        if out.is_empty() {
            "no output".to_owned()
        } else {
            out.chars()
                .rev()
                .take(2000)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect()
        }
    }

    /// Closes the supervisor's stdin, its signal to stop the server and clean up, and waits
    /// until it has. Idempotent.
    pub(crate) fn shutdown(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// One member of a throwaway etcd cluster or ZooKeeper ensemble: its name, client port and
/// member supervisor ([`Supervisor::member`]), and whether its server was started and not
/// killed since. Dropping it stops the server and removes its directory.
#[derive(Debug)]
pub(crate) struct Member {
    /// `m0`, `m1`, ...
    pub(crate) name: String,
    /// The client port on 127.0.0.1.
    pub(crate) client_port: u16,
    /// How many lines of its log errors quote.
    log_lines: usize,
    pub(crate) supervisor: Supervisor,
    /// Started, and not killed since.
    pub(crate) running: bool,
}

impl Member {
    /// A member whose server has not started yet.
    pub(crate) fn new(
        name: String,
        client_port: u16,
        log_lines: usize,
        supervisor: Supervisor,
    ) -> Self {
        Self {
            name,
            client_port,
            log_lines,
            supervisor,
            running: false,
        }
    }

    /// The server's PID, while it runs.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.running.then(|| self.supervisor.pid()).flatten()
    }

    /// Starts the server (again, on the same directory).
    ///
    /// # Errors
    /// As [`Supervisor::start`].
    pub(crate) fn start(&mut self) -> Result<(), ServerError> {
        self.supervisor.start()?;
        self.running = true;
        Ok(())
    }

    /// `SIGKILL`s the server (its PID only; a stopped one too) and waits until it has exited
    /// and its client port refuses connections ([`Supervisor::kill_server`]).
    ///
    /// # Errors
    /// The member is not running, or `kill` failed.
    pub(crate) fn kill(&mut self) -> Result<(), ServerError> {
        self.supervisor.kill_server(
            self.pid(),
            || format!("member {} is not running", self.name),
            self.client_port,
            Duration::from_millis(200),
        )?;
        self.running = false;
        Ok(())
    }

    /// The last lines of the member's log, for error messages.
    pub(crate) fn log_tail(&self) -> String {
        self.supervisor.log_tail(self.log_lines)
    }

    /// Polls until `ready(client_port)` (run off the runtime) says the server is ready.
    ///
    /// # Errors
    /// [`ServerError::StartFailed`] at once when the supervisor or the server exited (with the
    /// end of its log), or, after `deadline`, that it is not `state` (e.g. `healthy`) in time.
    pub(crate) async fn wait_ready(
        &mut self,
        state: &str,
        deadline: Instant,
        ready: fn(u16) -> bool,
    ) -> Result<(), ServerError> {
        let port = self.client_port;
        let exited = || -> Result<(), ServerError> {
            let detail = if let Some(status) = self.supervisor.try_wait()? {
                format!("supervisor exited with {status}")
            } else if self.pid().is_some_and(|pid| !process_alive(pid)) {
                format!("member {} exited: {}", self.name, self.log_tail())
            } else {
                return Ok(());
            };
            Err(ServerError::StartFailed {
                what: self.supervisor.what,
                detail,
            })
        };
        if poll_until(deadline, exited, move || ready(port)).await? {
            return Ok(());
        }
        Err(ServerError::StartFailed {
            what: self.supervisor.what,
            detail: format!(
                "member {} not {state} in time: {}",
                self.name,
                self.log_tail()
            ),
        })
    }
}

/// Every 50 ms: `check` (its error ends the wait), then `ready` (run off the runtime). `true`
/// once `ready` says so, `false` when `deadline` passes first.
///
/// # Errors
/// `check`'s.
pub(crate) async fn poll_until(
    deadline: Instant,
    mut check: impl FnMut() -> Result<(), ServerError>,
    ready: impl Fn() -> bool + Clone + Send + 'static,
) -> Result<bool, ServerError> {
    loop {
        check()?;
        if tokio::task::spawn_blocking(ready.clone())
            .await
            .unwrap_or(false)
        {
            return Ok(true);
        }
        if Instant::now() > deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sends `signal` (`-KILL`, `-STOP`, `-CONT`, ...) with `kill(1)` to process `pid` alone (found
/// by the caller; `None` when it does not run, then `not_running` says why). Returns the PID.
///
/// # Errors
/// [`ServerError::StartFailed`] naming `what` when there is no PID or `kill` failed;
/// [`ServerError::Io`] when `kill` could not be run.
pub(crate) fn signal(
    what: &'static str,
    pid: Option<u32>,
    signal: &str,
    not_running: impl FnOnce() -> String,
) -> Result<u32, ServerError> {
    let pid = pid.ok_or_else(|| ServerError::StartFailed {
        what,
        detail: not_running(),
    })?;
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .stderr(Stdio::null())
        .status()?;
    if !status.success() {
        return Err(ServerError::StartFailed {
            what,
            detail: format!("could not send {signal} to pid {pid}"),
        });
    }
    Ok(pid)
}

/// Whether process `pid` exists and has not exited (a zombie has).
pub(crate) fn process_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // The state follows the parenthesised command name.
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}

/// Whether `127.0.0.1:port` accepts a TCP connection within `timeout`.
pub(crate) fn connects(port: u16, timeout: Duration) -> bool {
    TcpStream::connect_timeout(&SocketAddr::from((Ipv4Addr::LOCALHOST, port)), timeout).is_ok()
}

/// `count` distinct free ports of 127.0.0.1 (all bound at once, then released).
pub(crate) fn free_ports(count: usize) -> std::io::Result<Vec<u16>> {
    let listeners = (0..count)
        .map(|_| TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))
        .collect::<std::io::Result<Vec<_>>>()?;
    listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect()
}

/// Where member directories go: `/dev/shm` when writable (no fsync cost), else `$TMPDIR`, else
/// `/tmp`.
pub(crate) fn scratch_base() -> PathBuf {
    // Unique per call: clusters started at once in one process must not share a probe file.
    static PROBES: AtomicU64 = AtomicU64::new(0);
    let shm = Path::new("/dev/shm");
    let probe = shm.join(format!(
        ".pgfence-probe-{}-{}",
        std::process::id(),
        PROBES.fetch_add(1, Ordering::Relaxed)
    ));
    if shm.is_dir() && std::fs::write(&probe, b"").is_ok() && std::fs::remove_file(&probe).is_ok() {
        return shm.to_owned();
    }
    std::env::var_os("TMPDIR")
        .map(PathBuf::from)
        .filter(|p| p.is_dir())
        .unwrap_or_else(|| PathBuf::from("/tmp"))
}

/// Runs `work` (which blocks: spawning a supervisor, talking to a server) off the runtime.
///
/// # Errors
/// `work`'s error, or [`ServerError::Io`] when it panicked.
pub(crate) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ServerError> + Send + 'static,
) -> Result<T, ServerError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ServerError::Io(std::io::Error::other(e)))?
}

/// Runs `attempt` up to `tries` times (at least once) until it succeeds; else the last error.
pub(crate) async fn retry<T, F>(
    tries: usize,
    mut attempt: impl FnMut() -> F,
) -> Result<T, ServerError>
where
    F: Future<Output = Result<T, ServerError>>,
{
    let mut last = None;
    for _ in 0..tries.max(1) {
        match attempt().await {
            Ok(value) => return Ok(value),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("at least one attempt"))
}

/// A new, empty directory under `$TMPDIR` (else `/tmp`) named `{prefix}.{pid}.{n}`.
///
/// # Errors
/// When it cannot be created.
pub(crate) fn temp_dir(prefix: &str) -> std::io::Result<PathBuf> {
    static DIRS: AtomicU64 = AtomicU64::new(0);
    let base = std::env::var_os("TMPDIR")
        .map(PathBuf::from)
        .filter(|p| p.is_dir())
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    loop {
        let dir = base.join(format!(
            "{prefix}.{}.{}",
            std::process::id(),
            DIRS.fetch_add(1, Ordering::Relaxed)
        ));
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{Supervisor, free_ports, process_alive};
    use crate::ServerError;

    const TEMPLATE: &str = r#""${TMPDIR:-/tmp}/pgfence-test.XXXXXX""#;

    fn wait_for_pid(supervisor: &Supervisor) -> u32 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(pid) = supervisor.pid() {
                return pid;
            }
            assert!(Instant::now() < deadline, "no pid file");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_dropped_member_supervisor_kills_its_server_and_removes_its_directory() {
        let mut supervisor = Supervisor::member("test", TEMPLATE, "sleep 600").unwrap();
        let dir = supervisor.dir().to_owned();
        assert!(dir.is_dir());
        supervisor.start().unwrap();
        let pid = wait_for_pid(&supervisor);
        assert!(process_alive(pid));
        drop(supervisor);
        assert!(!dir.exists(), "{} left behind", dir.display());
        // `SIGKILL` is sent before the supervisor exits; the server dies a moment later.
        let deadline = Instant::now() + Duration::from_secs(5);
        while process_alive(pid) {
            assert!(
                Instant::now() < deadline,
                "server {pid} survived its supervisor"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn kill_server_waits_until_the_server_is_gone_and_forgets_its_pid() {
        let mut supervisor = Supervisor::member("test", TEMPLATE, "sleep 600").unwrap();
        supervisor.start().unwrap();
        let pid = wait_for_pid(&supervisor);
        let port = free_ports(1).unwrap()[0];
        supervisor
            .kill_server(Some(pid), String::new, port, Duration::from_millis(50))
            .unwrap();
        assert!(!process_alive(pid));
        assert_eq!(supervisor.pid(), None);
        // Started again on the same directory.
        supervisor.start().unwrap();
        assert_ne!(wait_for_pid(&supervisor), pid);
        let not_running = supervisor
            .kill_server(None, || "not running".into(), port, Duration::ZERO)
            .unwrap_err();
        assert!(
            matches!(&not_running, ServerError::StartFailed { what: "test", detail } if detail == "not running"),
            "{not_running:?}"
        );
    }

    /// The kit's async functions can run in spawned tasks (checked at compile time).
    #[test]
    fn public_futures_are_send() {
        use crate::Installed;
        fn send<T: Send>(_: T) {}
        let _ = |etcd: &mut crate::EtcdCluster,
                 zk: &mut crate::ZkEnsemble,
                 sentinels: &crate::SentinelSet,
                 server: &mut crate::Server| {
            send(crate::EtcdCluster::start(Installed::assume(), 3));
            send(etcd.restart(0));
            send(crate::ZkEnsemble::start(Installed::assume(), 3));
            send(zk.restart(0));
            send(crate::SentinelSet::start(
                Installed::assume(),
                "m",
                crate::SentinelConfig::default(),
            ));
            send(sentinels.wait_for_new_master(0, Duration::ZERO));
            send(crate::Server::postgres());
            send(crate::Server::redis());
            send(server.restart());
            send(crate::RedisCluster::start(3));
        };
        let _ = |patroni: &mut crate::PatroniCluster| {
            send(crate::PatroniCluster::start(
                Installed::assume(),
                crate::PatroniConfig::default(),
            ));
            send(patroni.wait_leader(None));
            send(patroni.wait_streaming(1));
            send(patroni.kill(0));
            send(patroni.switchover(0, 1));
            send(patroni.timeline(0));
        };
        let _ = |set: &mut crate::PgReplicaSet| {
            send(crate::PgReplicaSet::start(crate::Replication::Async));
            send(set.wait_replayed());
            send(set.cut_off_standby());
            send(set.fail_over());
            send(set.timeline());
        };
    }

    #[test]
    fn a_supervisor_without_a_directory_reports_its_stderr() {
        let err =
            Supervisor::member("test", "/nonexistent/pgfence-test.XXXXXX", "true").unwrap_err();
        let ServerError::StartFailed { what, detail } = err else {
            panic!("{err:?}");
        };
        assert_eq!(what, "test");
        assert!(detail.contains("nonexistent"), "{detail}");
    }
}

//! A lock server whose wall clock can be stepped while it runs: a small `LD_PRELOAD` shim,
//! compiled at run time with the machine's C compiler, that offsets only the wall clock
//! (`CLOCK_REALTIME` and `CLOCK_REALTIME_COARSE` in `clock_gettime`, plus `gettimeofday` and
//! `time`) by a number of milliseconds read from a file, so the offset can change under a
//! running server ([`WallClockShim::step`]). Monotonic clocks are left alone.
//!
//! (libfaketime does not do here: `redis-server` aborts under it with "recursive calls to
//! `clock_gettime()`" and PostgreSQL fails `sem_open`. The shim reads the real clocks with the
//! raw `clock_gettime` system call and reads its file with plain `open`/`read`, so it never
//! calls itself.) The shim re-reads the file at most every 2 ms of monotonic time: a step is
//! seen by the server within 2 ms.
//!
//! [`ShimmedRedis`] is a throwaway `redis-server` started with the shim (under the same kind
//! of `sh` supervisor as the other throwaway servers: it is killed and its directory removed
//! when the value is dropped or this process exits). Redis expires keys — and so the issuer's
//! locks — by its wall clock: a step forward ends every lease early, as a lock server whose
//! clock jumped would.
//!
//! [`ShimmedPostgres`] is the same for a throwaway PostgreSQL: the PostgreSQL issuer expires
//! its leases by the database's clock, so a step forward ends them early too.
//!
//! Without a C compiler (`cc`, else `gcc`, on `PATH`) [`WallClockShim::build_in`],
//! [`ShimmedRedis::start`] and [`ShimmedPostgres::start`] return [`ServerError::NotInstalled`]: tests skip.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::process::{Supervisor, blocking, connects, free_ports, scratch_base};
use crate::{REDIS_HINT, ServerError, find_in_path, sh_quote};

/// The environment variable naming the shim's offset file (milliseconds, a signed decimal
/// integer, read at most every 2 ms; a missing or unreadable file keeps the last offset).
pub const OFFSET_FILE_ENV: &str = "PGFENCE_CLOCK_OFFSET_FILE";

const CC_HINT: &str = "install a C compiler (Debian: apt-get install gcc) to build the wall-clock \
    shim";

/// The shim's source. Offsets `CLOCK_REALTIME(_COARSE)`, `gettimeofday` and `time` by the
/// milliseconds in the file `$PGFENCE_CLOCK_OFFSET_FILE` names.
const SHIM_C: &str = r#"
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static long long cached_ms;
static long long next_read_ns;

static int real_clock(clockid_t id, struct timespec *ts) {
    return (int)syscall(SYS_clock_gettime, id, ts);
}

static long long offset_ms(void) {
    struct timespec mono;
    if (real_clock(CLOCK_MONOTONIC, &mono) != 0) {
        return __atomic_load_n(&cached_ms, __ATOMIC_RELAXED);
    }
    long long now = (long long)mono.tv_sec * 1000000000LL + mono.tv_nsec;
    if (now < __atomic_load_n(&next_read_ns, __ATOMIC_RELAXED)) {
        return __atomic_load_n(&cached_ms, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&next_read_ns, now + 2000000LL, __ATOMIC_RELAXED);
    const char *path = getenv("PGFENCE_CLOCK_OFFSET_FILE");
    if (path != NULL) {
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            char buf[32];
            ssize_t n = read(fd, buf, sizeof buf - 1);
            close(fd);
            if (n > 0) {
                buf[n] = 0;
                __atomic_store_n(&cached_ms, strtoll(buf, NULL, 10), __ATOMIC_RELAXED);
            }
        }
    }
    return __atomic_load_n(&cached_ms, __ATOMIC_RELAXED);
}

static void shift(struct timespec *ts) {
    long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + offset_ms() * 1000000LL;
    ts->tv_sec = (time_t)(ns / 1000000000LL);
    ts->tv_nsec = (long)(ns % 1000000000LL);
    if (ts->tv_nsec < 0) {
        ts->tv_nsec += 1000000000L;
        ts->tv_sec -= 1;
    }
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    int r = real_clock(id, ts);
    if (r == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
        shift(ts);
    }
    return r;
}

/* Declared here with its own struct: <sys/time.h>'s prototype differs between glibc versions. */
struct shim_timeval { long tv_sec; long tv_usec; };

int gettimeofday(struct shim_timeval *tv, void *tz) {
    (void)tz;
    if (tv != NULL) {
        struct timespec ts;
        if (real_clock(CLOCK_REALTIME, &ts) != 0) {
            return -1;
        }
        shift(&ts);
        tv->tv_sec = (long)ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return 0;
}

time_t time(time_t *out) {
    struct timespec ts;
    if (real_clock(CLOCK_REALTIME, &ts) != 0) {
        return (time_t)-1;
    }
    shift(&ts);
    if (out != NULL) {
        *out = ts.tv_sec;
    }
    return ts.tv_sec;
}
"#;

/// The C compiler the shim is built with: `cc`, else `gcc`, on `PATH`.
#[must_use]
pub fn compiler() -> Option<PathBuf> {
    find_in_path("cc").or_else(|| find_in_path("gcc"))
}

/// The compiled shim and its offset file.
#[derive(Debug)]
pub struct WallClockShim {
    library: PathBuf,
    offset_file: PathBuf,
    offset_ms: Mutex<i64>,
}

impl WallClockShim {
    /// Compiles the shim into `dir` (`libpgfence_clock.so`) and writes its offset file
    /// (`clock_offset`, 0) there.
    ///
    /// # Errors
    /// [`ServerError::NotInstalled`] without a C compiler; [`ServerError::StartFailed`] when
    /// it does not compile; [`ServerError::Io`] when `dir` cannot be written.
    pub fn build_in(dir: &Path) -> Result<Self, ServerError> {
        let cc = compiler().ok_or(ServerError::NotInstalled {
            what: "C compiler (cc)",
            hint: CC_HINT,
        })?;
        let source = dir.join("pgfence_clock.c");
        std::fs::write(&source, SHIM_C)?;
        let library = dir.join("libpgfence_clock.so");
        let out = Command::new(cc)
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&library)
            .arg(&source)
            .output()?;
        if !out.status.success() {
            return Err(ServerError::StartFailed {
                what: "wall-clock shim",
                detail: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
        }
        let shim = Self {
            library,
            offset_file: dir.join("clock_offset"),
            offset_ms: Mutex::new(0),
        };
        shim.set_offset_ms(0)?;
        Ok(shim)
    }

    /// The shared library to `LD_PRELOAD`.
    #[must_use]
    pub fn library(&self) -> &Path {
        &self.library
    }

    /// The offset file (its path goes in [`OFFSET_FILE_ENV`]).
    #[must_use]
    pub fn offset_file(&self) -> &Path {
        &self.offset_file
    }

    /// The offset last set, in ms (positive: the server's clock is ahead of real time).
    #[must_use]
    pub fn offset_ms(&self) -> i64 {
        *self
            .offset_ms
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sets the offset (replacing the file, so a reader sees the old or the new value).
    ///
    /// # Errors
    /// When the file cannot be written.
    pub fn set_offset_ms(&self, ms: i64) -> std::io::Result<()> {
        let mut offset = self
            .offset_ms
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let tmp = self.offset_file.with_extension("new");
        std::fs::write(&tmp, format!("{ms}\n"))?;
        std::fs::rename(&tmp, &self.offset_file)?;
        *offset = ms;
        Ok(())
    }

    /// Steps the clock by `by`, forwards or backwards, and returns the new offset in ms.
    ///
    /// # Errors
    /// When the file cannot be written.
    pub fn step(&self, by: Duration, forward: bool) -> std::io::Result<i64> {
        let by = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        let next = if forward {
            self.offset_ms().saturating_add(by)
        } else {
            self.offset_ms().saturating_sub(by)
        };
        self.set_offset_ms(next)?;
        Ok(next)
    }
}

/// A throwaway `redis-server` (nothing on disk) running with the wall-clock shim.
#[derive(Debug)]
pub struct ShimmedRedis {
    supervisor: Supervisor,
    clock: WallClockShim,
    port: u16,
}

impl ShimmedRedis {
    /// Compiles the shim and starts `redis-server` with it (`PGFENCE_REDIS_SERVER` names the
    /// binary, else it is looked up on `PATH`), on a free port of 127.0.0.1, its clock at
    /// real time.
    ///
    /// # Errors
    /// [`ServerError::NotInstalled`] without `redis-server` or a C compiler;
    /// [`ServerError::StartFailed`] when it does not answer `PING` within 10 s.
    pub async fn start() -> Result<Self, ServerError> {
        let bin = match std::env::var_os("PGFENCE_REDIS_SERVER").filter(|v| !v.is_empty()) {
            Some(path) => Some(PathBuf::from(path)).filter(|p| p.is_file()),
            None => find_in_path("redis-server"),
        }
        .ok_or(ServerError::NotInstalled {
            what: "redis-server",
            hint: REDIS_HINT,
        })?;
        if compiler().is_none() {
            return Err(ServerError::NotInstalled {
                what: "C compiler (cc)",
                hint: CC_HINT,
            });
        }
        blocking(move || Self::start_blocking(&bin)).await
    }

    fn start_blocking(bin: &Path) -> Result<Self, ServerError> {
        let port = free_ports(1)?[0];
        let template = format!("{}/pgfence-clock.XXXXXX", sh_quote(&scratch_base()));
        let server = format!(
            "LD_PRELOAD=\"$dir/libpgfence_clock.so\" {OFFSET_FILE_ENV}=\"$dir/clock_offset\" \
             {} --port {port} --bind 127.0.0.1 --save '' --appendonly no --dir \"$dir\" \
             --daemonize no",
            sh_quote(bin)
        );
        let mut supervisor = Supervisor::member("redis-server (clock shim)", &template, &server)?;
        let clock = WallClockShim::build_in(supervisor.dir())?;
        supervisor.start()?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ping(port) {
            if Instant::now() > deadline {
                return Err(ServerError::StartFailed {
                    what: "redis-server (clock shim)",
                    detail: supervisor.log_tail(20),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Self {
            supervisor,
            clock,
            port,
        })
    }

    /// `redis://127.0.0.1:PORT`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Its port on 127.0.0.1.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its clock: [`WallClockShim::step`] moves it.
    #[must_use]
    pub fn clock(&self) -> &WallClockShim {
        &self.clock
    }

    /// The server's directory (removed when it stops).
    #[must_use]
    pub fn dir(&self) -> &Path {
        self.supervisor.dir()
    }
}

/// Whether a Redis on `port` answers `PING`.
fn ping(port: u16) -> bool {
    use std::io::{Read, Write};
    if !connects(port, Duration::from_millis(200)) {
        return false;
    }
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let mut buf = [0u8; 16];
    stream.write_all(b"PING\r\n").is_ok()
        && stream
            .read(&mut buf)
            .is_ok_and(|n| buf[..n].starts_with(b"+PONG"))
}

/// A throwaway PostgreSQL (superuser `postgres`, trust authentication, nothing synced to
/// disk) running with the wall-clock shim: `now()`, `clock_timestamp()` and so the PostgreSQL
/// issuer's lease expiry follow the shim's offset. (libfaketime makes PostgreSQL fail
/// `sem_open`; the shim touches only the wall clock.) `initdb` runs without the shim. As
/// root, the server runs as the `postgres` user (`setpriv`).
#[derive(Debug)]
pub struct ShimmedPostgres {
    supervisor: Supervisor,
    clock: WallClockShim,
    port: u16,
}

impl ShimmedPostgres {
    /// Compiles the shim, runs `initdb` and starts `postgres` with the shim on a free port of
    /// 127.0.0.1, its clock at real time.
    ///
    /// # Errors
    /// [`ServerError::NotInstalled`] without the PostgreSQL server or a C compiler;
    /// [`ServerError::StartFailed`] when it is not ready within 60 s.
    pub async fn start() -> Result<Self, ServerError> {
        let bindir = crate::postgres_bindir()?;
        if compiler().is_none() {
            return Err(ServerError::NotInstalled {
                what: "C compiler (cc)",
                hint: CC_HINT,
            });
        }
        blocking(move || Self::start_blocking(&bindir)).await
    }

    fn start_blocking(bindir: &Path) -> Result<Self, ServerError> {
        let port = free_ports(1)?[0];
        let template = format!("{}/pgfence-clock-pg.XXXXXX", sh_quote(&scratch_base()));
        let server = if crate::is_root() {
            "chmod 755 \"$dir\" && mkdir -p \"$dir/pg\" && chown postgres \"$dir/pg\" && \
             exec setpriv --reuid=postgres --regid=postgres --init-groups sh \"$dir/run.sh\" \"$dir\""
        } else {
            "mkdir -p \"$dir/pg\" && exec sh \"$dir/run.sh\" \"$dir\""
        };
        let mut supervisor = Supervisor::member("postgres (clock shim)", &template, server)?;
        let clock = WallClockShim::build_in(supervisor.dir())?;
        let bin = sh_quote(bindir);
        let run = format!(
            r#"set -e
dir="$1"
[ -d "$dir/pg/data" ] || {bin}/initdb -D "$dir/pg/data" -U postgres -A trust -E UTF8 --no-sync >"$dir/pg/init.log" 2>&1
LD_PRELOAD="$dir/libpgfence_clock.so" {OFFSET_FILE_ENV}="$dir/clock_offset" exec {bin}/postgres \
  -D "$dir/pg/data" -p {port} -k "$dir/pg" -c listen_addresses=127.0.0.1 -c fsync=off \
  -c synchronous_commit=off -c full_page_writes=off -c max_connections=200
"#
        );
        std::fs::write(supervisor.dir().join("run.sh"), run)?;
        supervisor.start()?;
        let pid_file = supervisor.dir().join("pg/data/postmaster.pid");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ready = std::fs::read_to_string(&pid_file)
                .is_ok_and(|pid| pid.lines().nth(7).is_some_and(|l| l.trim() == "ready"));
            if ready && connects(port, Duration::from_millis(200)) {
                break;
            }
            if Instant::now() > deadline {
                return Err(ServerError::StartFailed {
                    what: "postgres (clock shim)",
                    detail: supervisor.log_tail(20),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Self {
            supervisor,
            clock,
            port,
        })
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Its port on 127.0.0.1.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its clock: [`WallClockShim::step`] moves it.
    #[must_use]
    pub fn clock(&self) -> &WallClockShim {
        &self.clock
    }

    /// The server's directory (removed when it stops): the shim, its offset file, `run.sh`,
    /// `server.log`, and the cluster in `pg/data`.
    #[must_use]
    pub fn dir(&self) -> &Path {
        self.supervisor.dir()
    }
}

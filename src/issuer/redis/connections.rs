//! The issuer's Redis connections: a few reconnecting connections used in turn, and which
//! Redis errors say nothing about the lock (so that an owner-safe call may be sent again).

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::{RedisError, RedisResult, RetryMethod, Value};

use crate::Result;

/// A small set of reconnecting Redis connections, used in turn: each command goes out on the
/// next one.
///
/// One multiplexed connection serialises every task's commands through one socket and one
/// driver task; with a connection per CPU the issuer's acquire + release cycle ran 1.6× faster
/// on the benchmark machine (`BENCHMARKS.md`). Commands of one call (an acquire, a release)
/// are awaited one after the other, so spreading them over connections never reorders what a
/// caller does.
///
/// A connection learns that the server closed it (an idle `timeout`, a restart, a reset) only
/// when a command fails on it, and then reconnects. Two things keep such a failure from
/// costing more than the one command: the next command goes to the connection that just
/// reconnected rather than to the next in turn (which has likely been closed for the same
/// reason), and the other connections are probed with a `PING` in the background so that the
/// dead ones reconnect before they are used. The issuer re-sends its own calls (acquire,
/// extend, release) after such a failure; other commands are not re-sent.
#[derive(Clone)]
pub struct RedisConnections {
    conns: Arc<[ConnectionManager]>,
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    next: AtomicUsize,
    /// 1 + the index of a connection that has just lost its link and is reconnecting (0: none).
    reconnected: AtomicUsize,
    /// A background probe of every connection is running.
    probing: AtomicBool,
}

/// How long connecting (and each reply) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection that failed for want of an answer (refused, unreachable, timed out, reset),
/// as an error naming the server and how it failed (`Redis at HOST:PORT refused the
/// connection`, `... did not answer within 5s`: [`crate::issuer::unanswered`]). Other
/// errors (the server answered: a password refused, an ACL, a TLS certificate) are kept.
fn unanswered(addr: &str, e: RedisError) -> RedisError {
    if crate::tls::is_tls_rejection(&e) || !(e.is_io_error() || e.is_timeout()) {
        return e;
    }
    let cause = std::io::Error::new(
        if e.is_timeout() {
            std::io::ErrorKind::TimedOut
        } else if e.is_connection_refusal() {
            std::io::ErrorKind::ConnectionRefused
        } else {
            std::io::ErrorKind::Other
        },
        e.to_string(),
    );
    RedisError::from(crate::issuer::unanswered(
        "Redis",
        addr,
        CONNECT_TIMEOUT,
        Some(&cause),
    ))
}

impl std::fmt::Debug for RedisConnections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConnections")
            .field("connections", &self.conns.len())
            .finish_non_exhaustive()
    }
}

impl RedisConnections {
    /// Opens `count` connections to the standalone Redis at `url` (`redis://host:port/db`, or
    /// `rediss://` with the TLS parameters of [`RedisIssuer::connect`](crate::RedisIssuer::connect)).
    /// Each reconnects by itself, with 5 s connect and response timeouts.
    ///
    /// # Errors
    /// As [`RedisIssuer::connect`](crate::RedisIssuer::connect).
    pub async fn open(url: &str, count: NonZeroUsize) -> Result<Self> {
        let client = crate::tls::redis_client(url)?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(Some(CONNECT_TIMEOUT))
            .set_number_of_retries(2);
        let addr = client.get_connection_info().addr().to_string();
        let mut conns = Vec::with_capacity(count.get());
        for _ in 0..count.get() {
            let conn = ConnectionManager::new_with_config(client.clone(), config.clone())
                .await
                .map_err(|e| super::acl::connect_error(unanswered(&addr, e)))?;
            conns.push(conn);
        }
        Ok(Self {
            conns: conns.into(),
            shared: Arc::default(),
        })
    }

    /// How many connections there are.
    #[must_use]
    pub fn len(&self) -> usize {
        self.conns.len()
    }

    /// Always `false`: there is at least one connection.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.conns.is_empty()
    }

    /// Each of the connections: a command sent on every one runs, on each, after whatever that
    /// one carried before (Redis runs one connection's commands in order).
    pub(super) fn lanes(&self) -> Vec<ConnectionManager> {
        self.conns.to_vec()
    }

    fn pick(&self) -> (usize, ConnectionManager) {
        let i = match self.shared.reconnected.swap(0, Ordering::Relaxed) {
            0 => self.shared.next.fetch_add(1, Ordering::Relaxed) % self.conns.len(),
            fresh => fresh - 1,
        };
        (i, self.conns[i].clone())
    }

    /// Notes the outcome of a command sent on connection `i`.
    fn observe<T>(&self, i: usize, result: &RedisResult<T>) {
        let Err(e) = result else { return };
        // `ConnectionManager` reconnects after exactly these errors.
        if !e.is_connection_dropped() {
            return;
        }
        self.shared.reconnected.store(i + 1, Ordering::Relaxed);
        self.probe_others(i);
    }

    /// PINGs every connection but `failed` in the background (one probe at a time), so that
    /// those the server closed too find out and reconnect now rather than on their next use.
    fn probe_others(&self, failed: usize) {
        if self.conns.len() < 2 || self.shared.probing.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.shared.probing.store(false, Ordering::Release);
            return;
        };
        let this = self.clone();
        runtime.spawn(async move {
            for (i, conn) in this.conns.iter().enumerate() {
                if i == failed {
                    continue;
                }
                let (mut conn, ping) = (conn.clone(), redis::cmd("PING"));
                let ping = ping.query_async::<()>(&mut conn);
                // A dead connection fails at once (and reconnects); a stalled one is left alone.
                let _ = tokio::time::timeout(Duration::from_secs(1), ping).await;
            }
            this.shared.probing.store(false, Ordering::Release);
        });
    }
}

impl ConnectionLike for RedisConnections {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        let (i, mut conn) = self.pick();
        Box::pin(async move {
            let result = conn.req_packed_command(cmd).await;
            self.observe(i, &result);
            result
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        let (i, mut conn) = self.pick();
        Box::pin(async move {
            let result = conn.req_packed_commands(pipeline, offset, count).await;
            self.observe(i, &result);
            result
        })
    }

    fn get_db(&self) -> i64 {
        self.conns[0].get_db()
    }
}

/// Connections [`RedisIssuer::connect`](crate::RedisIssuer::connect) opens: one per CPU, at most 8.
#[must_use]
pub fn default_connections() -> NonZeroUsize {
    let cpus = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
    NonZeroUsize::new(cpus.clamp(1, 8)).unwrap_or(NonZeroUsize::MIN)
}

/// Whether `e` says nothing about the lock — the request or its reply was lost on the way
/// (I/O error, dropped or refused connection, timeout) or the server could not answer yet
/// (loading, failing over, read-only after a demotion) — so that sending the same owner-safe
/// call again may succeed.
pub(super) fn transport_error(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || matches!(
            e.retry_method(),
            RetryMethod::Reconnect
                | RetryMethod::RetryImmediately
                | RetryMethod::WaitAndRetry
                | RetryMethod::RefreshSlotsAndRetry
                | RetryMethod::ReconnectFromInitialConnections
        )
}

//! The issuer's Redis connections: a few reconnecting connections used in turn.

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use redis::Value;
use redis::aio::{ConnectionLike, ConnectionManager};

use crate::Result;

/// A small set of reconnecting Redis connections, used in turn: each command goes out on the
/// next one.
///
/// One multiplexed connection serialises every task's commands through one socket and one
/// driver task; with a connection per CPU the issuer's acquire + release cycle ran 1.6× faster
/// on the benchmark machine (`BENCHMARKS.md`). Commands of one call (an acquire, a release)
/// are awaited one after the other, so spreading them over connections never reorders what a
/// caller does.
#[derive(Clone)]
pub struct RedisConnections {
    conns: Arc<[ConnectionManager]>,
    next: Arc<AtomicUsize>,
}

impl std::fmt::Debug for RedisConnections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConnections")
            .field("connections", &self.conns.len())
            .finish_non_exhaustive()
    }
}

impl RedisConnections {
    /// Opens `count` connections to the standalone Redis at `url` (`redis://host:port/db`).
    /// Each reconnects by itself, with 5 s connect and response timeouts.
    ///
    /// # Errors
    /// [`Error::Redis`](crate::Error::Redis) for a malformed URL or an unreachable server.
    pub async fn open(url: &str, count: NonZeroUsize) -> Result<Self> {
        let client = redis::Client::open(url)?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(5)))
            .set_response_timeout(Some(Duration::from_secs(5)))
            .set_number_of_retries(2);
        let mut conns = Vec::with_capacity(count.get());
        for _ in 0..count.get() {
            conns.push(ConnectionManager::new_with_config(client.clone(), config.clone()).await?);
        }
        Ok(Self {
            conns: conns.into(),
            next: Arc::new(AtomicUsize::new(0)),
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

    fn pick(&self) -> ConnectionManager {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.conns.len();
        self.conns[i].clone()
    }
}

impl ConnectionLike for RedisConnections {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        let mut conn = self.pick();
        Box::pin(async move { conn.req_packed_command(cmd).await })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        let mut conn = self.pick();
        Box::pin(async move { conn.req_packed_commands(pipeline, offset, count).await })
    }

    fn get_db(&self) -> i64 {
        self.conns[0].get_db()
    }
}

/// Connections [`Issuer::connect`](crate::Issuer::connect) opens: one per CPU, at most 8.
#[must_use]
pub fn default_connections() -> NonZeroUsize {
    let cpus = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
    NonZeroUsize::new(cpus.clamp(1, 8)).unwrap_or(NonZeroUsize::MIN)
}

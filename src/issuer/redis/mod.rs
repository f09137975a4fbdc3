//! The Redis token issuer: a lock and its fence token in one atomic round trip, owner-safe
//! release and extend, waiting, and recovery of the counter after a Redis failover.
//!
//! Keys for resource `R` are `pgfence:{R}:lock` and `pgfence:{R}:fence`; for resource `NAME`
//! in fencing domain `D`, `pgfence:{D}:lock:NAME` and the domain's `pgfence:{D}:fence`
//! (`pgfence` is the default key prefix; [`RedisIssuer::with_key_prefix`] changes it). The
//! hash tag puts a lock and its counter in one Redis Cluster slot (with `PREFIX:{R}:attempt`,
//! which records the acquire call that took the lock, expiring with it, for the clean-up of a
//! failed acquire: `docs/issuers.md`, "Time bounds"). The counter never expires,
//! and nothing here deletes it but an acquire refused at the token limit, which undoes the
//! counter it had just created. Redis only hands out numbers: safety comes from Postgres
//! rejecting old tokens, so a counter that goes backwards costs liveness (rejected writes)
//! until it is reseeded, never correctness.

mod acl;
mod connections;
mod scripts;
mod sentinel;
mod state;

use std::future::Future;
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use redis::Value;
use redis::aio::ConnectionLike;
use sqlx::PgPool;
use tokio::time::Instant;

pub use acl::{ACL_COMMANDS, SENTINEL_ACL_RULE, acl_key_pattern, acl_rule};
use connections::transport_error;
pub use connections::{RedisConnections, default_connections};
use scripts::{ABANDON, ABANDON_SOURCE, ACQUIRE, EXTEND, RAISE_FLOOR, REISSUE, RELEASE};
pub use sentinel::{
    DEFAULT_FAILOVER_WAIT, DEFAULT_SENTINEL_PORT, SENTINEL_SCHEME, SENTINEL_TLS_SCHEME,
    SentinelConnections, SentinelUrl, is_sentinel_url,
};

use super::idle::IssuerState;
use super::keys::{DEFAULT_KEY_PREFIX, check_key_prefix};
use super::lease::ttl_millis;
use super::methods::issuer_methods;
use super::policy::{
    self, Ask, Attempt, Backend, DEFAULT_CALL_TIMEOUT, Renewal, Resend, limit_refused,
};
use super::token_issuer::IssuerKind;
use super::{Lease, LeaseState, LockStatus, ReleaseOutcome};
#[cfg(doc)]
use crate::issuer::limits::{MAX_KEY_PREFIX_LEN, MAX_TTL, MIN_TTL};
use crate::{Error, FenceToken, Resource, Result, error::StaleTarget, token::MAX_TOKEN};

/// Where an issuer reads the mark a fresh counter must start above (Postgres's high-water
/// mark, through [`RedisIssuer::with_floor_source`]): the issuer's only view of the database.
pub trait FloorSource: Send + Sync + std::fmt::Debug + 'static {
    /// The highest token `resource` has been checked with (0 when none). `resource` is the
    /// name PostgreSQL fences the lease under ([`Lease::fencing_resource`]: with a key prefix
    /// other than the default, that prefix's name), so an issuer reads its own prefix's marks
    /// only.
    fn high_water<'a>(
        &'a self,
        resource: &'a Resource,
    ) -> Pin<Box<dyn Future<Output = Result<i64>> + Send + 'a>>;
}

fn prefixed_lock_key(prefix: &str, resource: &Resource) -> String {
    match resource.domain() {
        Some(domain) => {
            let name = &resource.as_str()[domain.len() + 2..];
            format!("{prefix}:{{{domain}}}:lock:{name}")
        }
        None => format!("{prefix}:{{{resource}}}:lock"),
    }
}

/// The key recording which acquire call of the lock's owner took or last renewed the lock
/// (`PREFIX:{R}:attempt`, or `PREFIX:{D}:attempt:NAME` in a fencing domain), so that the
/// clean-up of a failed call removes only a lock that call took. It lives as long as the TTL
/// the acquire asked for.
fn prefixed_attempt_key(prefix: &str, resource: &Resource) -> String {
    match resource.domain() {
        Some(domain) => {
            let name = &resource.as_str()[domain.len() + 2..];
            format!("{prefix}:{{{domain}}}:attempt:{name}")
        }
        None => format!("{prefix}:{{{resource}}}:attempt"),
    }
}

fn prefixed_counter_key(prefix: &str, resource: &Resource) -> String {
    format!("{prefix}:{{{}}}:fence", resource.counter_id())
}

/// The Redis key of `resource`'s lock with the default prefix: `pgfence:{R}:lock`, or
/// `pgfence:{D}:lock:NAME` for resource `NAME` in fencing domain `D` (one hash slot per
/// domain). [`RedisIssuer::lock_key`] gives an issuer's key, whatever its prefix.
#[must_use]
pub fn lock_key(resource: &Resource) -> String {
    prefixed_lock_key(DEFAULT_KEY_PREFIX, resource)
}

/// The Redis key of `resource`'s token counter with the default prefix: `pgfence:{R}:fence`,
/// or the domain's `pgfence:{D}:fence`, shared by every resource of the domain.
/// [`RedisIssuer::counter_key`] gives an issuer's key, whatever its prefix.
#[must_use]
pub fn counter_key(resource: &Resource) -> String {
    prefixed_counter_key(DEFAULT_KEY_PREFIX, resource)
}

/// What to do about a Redis counter at the limit.
const REDIS_LIMIT_FIX: &str = "if it was raised by mistake (set by hand, a bogus floor), set it back to PostgreSQL's high-water mark (`pgfence reseed` only raises counters)";

/// Issues leases and fence tokens from Redis.
///
/// Generic over the connection: [`RedisIssuer::connect`] gives a set of reconnecting connections
/// ([`RedisConnections`]), [`RedisIssuer::connect_cluster`] a Redis Cluster connection, and
/// [`RedisIssuer::new`] takes any [`ConnectionLike`] (for example one [`ConnectionManager`](redis::aio::ConnectionManager)).
///
/// Every key starts with the key prefix, `pgfence` unless [`RedisIssuer::with_key_prefix`] sets
/// another: issuers with different prefixes share no lock and no counter on one Redis, and
/// no mark in one database (their leases are fenced under their prefix's name,
/// [`Lease::fencing_resource`]).
#[derive(Clone)]
pub struct RedisIssuer<C = RedisConnections> {
    conn: C,
    pub(crate) floor_source: Option<Arc<dyn FloorSource>>,
    prefix: Arc<str>,
    call_timeout: Duration,
    idle_expiry: Option<Duration>,
}

impl<C> std::fmt::Debug for RedisIssuer<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisIssuer")
            .field("key_prefix", &self.prefix)
            .field("floor_source", &self.floor_source.is_some())
            .field("call_timeout", &self.call_timeout)
            .field("idle_expiry", &self.idle_expiry)
            .finish_non_exhaustive()
    }
}

impl<C> RedisIssuer<C> {
    /// The same issuer with another key prefix: keys become `PREFIX:{R}:lock` and
    /// `PREFIX:{R}:fence` (`PREFIX:{D}:lock:NAME` and `PREFIX:{D}:fence` in a fencing domain).
    /// Applications that share a Redis but must not share locks use different prefixes. With
    /// a prefix other than the default, PostgreSQL fences the leases under the prefix's name
    /// for the resource ([`Resource::in_key_prefix`]): applications that also share a
    /// database share no mark, check or audit filter.
    ///
    /// # Errors
    /// [`InvalidInput::KeyPrefix`](crate::error::InvalidInput::KeyPrefix) for a prefix that is empty, longer than
    /// [`MAX_KEY_PREFIX_LEN`], or contains braces, whitespace or control characters.
    pub fn with_key_prefix(mut self, prefix: &str) -> Result<Self> {
        self.prefix = Arc::from(check_key_prefix(prefix)?);
        Ok(self)
    }

    /// The key prefix (`pgfence` by default).
    #[must_use]
    pub fn key_prefix(&self) -> &str {
        &self.prefix
    }

    /// The same issuer with another call bound ([`DEFAULT_CALL_TIMEOUT`], 5 s, by default):
    /// an acquire, release, extend, status read or floor raise returns within `bound`, its
    /// re-sends included, or fails with an [`Error::Backend`] timeout (which is
    /// [retryable](Error::is_retryable): the outcome is unknown). Each attempt is cut off
    /// after 1 s, so an acquire (at most 3 attempts) gives up within about 3 s whatever the
    /// bound; the first attempt of a call gets at least 100 ms however small `bound` is. See
    /// `docs/issuers.md`, "Time bounds".
    #[must_use]
    pub fn with_call_timeout(mut self, bound: Duration) -> Self {
        self.call_timeout = bound;
        self
    }

    /// The call bound (see [`RedisIssuer::with_call_timeout`]).
    #[must_use]
    pub fn call_timeout(&self) -> Duration {
        self.call_timeout
    }

    /// The same issuer with idle counters expiring: a resource's counter key
    /// (`PREFIX:{R}:fence`) gets a Redis expiry of `idle` past the TTL of each lease an
    /// acquire or extend gives it (never shortened), so a resource nobody locked for `idle`
    /// leaves no key behind; its lock and attempt keys expire with the lease as always. Off
    /// by default (counters are kept for ever). Give every issuer of a key prefix the same
    /// setting.
    ///
    /// A counter that expired restarts low. With a floor source
    /// ([`with_floor_source`](RedisIssuer::with_floor_source)) the next lease's token is
    /// re-issued above PostgreSQL's high-water mark for the resource (the marks
    /// [`Fence::check`](crate::Fence::check) keeps), logged as a reseed; a row of a guarded
    /// table that no mark covers refuses the first write as stale, and
    /// [`recover_from`](RedisIssuer::recover_from) heals it in one call. PostgreSQL never
    /// accepts a token below what a row or mark has seen. See `docs/issuers.md`, "Idle
    /// expiry".
    ///
    /// # Errors
    /// [`InvalidInput::Duration`](crate::error::InvalidInput::Duration) outside
    /// [`MIN_IDLE_EXPIRY`](crate::issuer::MIN_IDLE_EXPIRY)`..=`[`MAX_IDLE_EXPIRY`](crate::issuer::MAX_IDLE_EXPIRY).
    pub fn with_idle_expiry(mut self, idle: Duration) -> Result<Self> {
        self.idle_expiry = Some(crate::issuer::check_idle_expiry(idle)?);
        Ok(self)
    }

    /// The idle expiry (see [`RedisIssuer::with_idle_expiry`]); `None`: counters are kept for
    /// ever.
    #[must_use]
    pub fn idle_expiry(&self) -> Option<Duration> {
        self.idle_expiry
    }

    /// This issuer's Redis key for `resource`'s lock (see [`lock_key`]).
    #[must_use]
    pub fn lock_key(&self, resource: &Resource) -> String {
        prefixed_lock_key(&self.prefix, resource)
    }

    /// This issuer's Redis key for `resource`'s counter (see [`counter_key`]).
    #[must_use]
    pub fn counter_key(&self, resource: &Resource) -> String {
        prefixed_counter_key(&self.prefix, resource)
    }

    /// The minimal Redis ACL of this issuer's user, for its key prefix (see
    /// [`acl_rule`]).
    #[must_use]
    pub fn acl_rule(&self) -> String {
        acl_rule(&self.prefix)
    }

    /// A Redis error as the caller gets it: an ACL refusal names the rule the user needs
    /// ([`Error::RedisPermission`]).
    fn redis_error(&self, e: redis::RedisError) -> Error {
        acl::redis_error(e, &self.prefix)
    }
}

impl RedisIssuer<RedisConnections> {
    /// Connects to a standalone Redis (`redis://[user:password@]host:port/db`) with
    /// [`default_connections`] reconnecting connections, used in turn.
    ///
    /// # TLS
    ///
    /// `rediss://host:port/db` connects over TLS (feature `tls`: rustls with the `ring`
    /// provider), verifying the server's certificate and host name against the system trust
    /// store, or against the CA file of the query parameter `cacert=PATH`. `cert=PATH&key=PATH`
    /// present a client certificate (for `tls-auth-clients yes`). The parameters are named as
    /// `redis-cli`'s flags, percent-decoded, read when connecting, and refused on a `redis://`
    /// URL:
    ///
    /// ```text
    /// rediss://pgfence-app:PASSWORD@redis.internal:6380/0?cacert=/etc/pgfence/ca.pem&cert=/etc/pgfence/client.pem&key=/etc/pgfence/client.key
    /// ```
    ///
    /// For the user's ACL, see [`acl_rule`].
    ///
    /// # Errors
    /// [`InvalidInput::IssuerUrl`](crate::error::InvalidInput::IssuerUrl) for a malformed URL; [`Error::Backend`] for an unreachable
    /// server (a certificate refused by either side is not
    /// [retryable](Error::is_retryable)); [`InvalidInput::Tls`](crate::error::InvalidInput::Tls) and
    /// [`InvalidInput::TlsFile`](crate::error::InvalidInput::TlsFile) for the TLS parameters; [`Error::IssuerNotBuilt`] for `rediss://`
    /// without the `tls` feature.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(url, default_connections()).await
    }

    /// Like [`RedisIssuer::connect`] with `connections` connections.
    ///
    /// # Errors
    /// As [`RedisIssuer::connect`].
    pub async fn connect_with(url: &str, connections: NonZeroUsize) -> Result<Self> {
        Ok(Self::new(RedisConnections::open(url, connections).await?))
    }
}

impl RedisIssuer<redis::cluster_async::ClusterConnection> {
    /// Connects to a Redis Cluster through any of its nodes: `redis://host:port` URLs, or
    /// `rediss://host:port` for TLS (feature `tls`) with the optional `cacert`, `cert` and
    /// `key` parameters of [`RedisIssuer::connect`] on any one node URL (they apply to every node).
    ///
    /// # Errors
    /// [`InvalidInput::Tls`](crate::error::InvalidInput::Tls) / [`InvalidInput::TlsFile`](crate::error::InvalidInput::TlsFile) for the TLS parameters;
    /// [`Error::IssuerNotBuilt`] for `rediss://` without the `tls` feature;
    /// [`InvalidInput::IssuerUrl`](crate::error::InvalidInput::IssuerUrl) for a malformed node URL or no nodes; [`Error::Backend`].
    pub async fn connect_cluster(nodes: &[String]) -> Result<Self> {
        let client = crate::tls::redis_cluster_client(nodes)?;
        Ok(Self::new(client.get_async_connection().await?))
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> RedisIssuer<C> {
    /// An issuer on an existing connection.
    #[must_use]
    pub fn new(conn: C) -> Self {
        Self {
            conn,
            floor_source: None,
            prefix: Arc::from(DEFAULT_KEY_PREFIX),
            call_timeout: DEFAULT_CALL_TIMEOUT,
            idle_expiry: None,
        }
    }

    /// Raises `resource`'s counter to at least `floor` (never lowers it) and returns its value
    /// afterwards. The next lease gets a token above `floor`.
    ///
    /// # Errors
    /// [`InvalidInput::Token`](crate::error::InvalidInput::Token) for a negative floor; [`Error::Backend`].
    pub async fn raise_floor(&self, resource: &Resource, floor: i64) -> Result<i64> {
        policy::raise_floor(self, resource, floor).await
    }

    /// The clean-up of an acquire call (`ask`) that returned no lease after an attempt whose
    /// outcome is unknown — one cut off by its bound stays queued on its connection and takes
    /// the lock when its bytes arrive; one lost with a reset connection is gone or already
    /// applied. Sent in the background on each of the issuer's connections (Redis runs one
    /// connection's commands in order, so on the connection that carried the late attempt it
    /// runs right after it, however late), it removes the lock if the owner holds it by this
    /// very call (the attempt key): never a lease a later call of the same owner took or
    /// adopted. Re-sent after transport failures until the TTL the call asked for has passed.
    fn abandon(&self, ask: &Ask<'_>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let task = || Abandon {
            lock: self.lock_key(ask.resource),
            attempt: prefixed_attempt_key(&self.prefix, ask.resource),
            owner: ask.owner.to_owned(),
            // "": the owner id alone names the call (see `Ask::own_owner`).
            call: if ask.own_owner {
                String::new()
            } else {
                call_id(ask.call)
            },
            until: Instant::now() + ask.ttl,
        };
        let conn: &dyn std::any::Any = &self.conn;
        if let Some(set) = conn.downcast_ref::<RedisConnections>() {
            for lane in set.lanes() {
                runtime.spawn(task().run(lane, true));
            }
            return;
        }
        if let Some(set) = conn.downcast_ref::<SentinelConnections>() {
            let lanes = set.lanes();
            if !lanes.is_empty() {
                for lane in lanes {
                    runtime.spawn(task().run(lane, true));
                }
                return;
            }
        }
        // One connection (a clone shares it), or a cluster's connection to the key's node.
        runtime.spawn(task().run(self.conn.clone(), false));
    }

    /// Settles a lease granted on a counter that did not exist (a new resource, or a Redis that
    /// lost its data): with a floor source whose mark is not below the token, the counter is
    /// raised past the mark and the token re-issued.
    async fn reseed_fresh(&self, lease: &mut Lease) -> Result<()> {
        let Some(source) = &self.floor_source else {
            return Ok(());
        };
        // The marks of this issuer's leases: under its key prefix's name.
        let mark = source.high_water(&lease.fencing).await?;
        if mark < lease.token.get() {
            return Ok(());
        }
        let mut conn = self.conn.clone();
        let reply: Value = REISSUE
            .key(self.lock_key(&lease.resource))
            .key(self.counter_key(&lease.resource))
            .arg(lease.value())
            .arg(&lease.owner)
            .arg(mark.to_string())
            .arg(MAX_TOKEN)
            .arg(lease.token.get())
            .invoke_async(&mut conn)
            .await
            .map_err(|e| self.redis_error(e))?;
        let token = int(&reply)?;
        if token == -1 {
            // The script undid the acquire: no lock, and the counter it had created is gone.
            return Err(limit_refused(
                &lease.resource,
                &format!(
                    "PostgreSQL's high-water mark ({mark}), above which the lost fence counter {} must start,",
                    self.counter_key(&lease.resource)
                ),
                "if the mark is bogus (poisoned), lower it with pgfence.unpoison_resource",
                true,
            ));
        }
        if token == 0 {
            // The lease lapsed while we were reading Postgres: report what Redis would.
            return Err(Error::StaleToken {
                target: StaleTarget::Resource(lease.resource.to_string()),
                presented: lease.token.get(),
                current: mark,
                other_counter: false,
            });
        }
        crate::metrics::counter_reseeded();
        tracing::info!(
            target: "pgfence::issuer",
            resource = lease.resource.as_str(),
            lost_token = lease.token.get(),
            high_water = mark,
            token,
            idle_expiry_ms = self.idle_expiry.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            "fence counter was missing (expired idle, or lost); re-created above Postgres's high-water mark"
        );
        lease.token = FenceToken::new(token)?;
        Ok(())
    }
}

issuer_methods! {
    impl[C: ConnectionLike + Clone + Send + Sync + 'static] RedisIssuer<C> {
        error: "[`Error::Backend`](crate::Error::Backend)",
        acquire: {
            ///
            /// One round trip: a Lua script takes the lock and increments the counter. Each
            /// attempt is cut off after 1 s and an acquire is sent at most 3 times (see
            /// [`with_call_timeout`](Self::with_call_timeout)); a late attempt that takes the
            /// lock after the call gave up is removed in the background.
            ///
            /// # Example
            /// ```no_run
            /// # async fn f() -> pgfence::Result<()> {
            /// use std::time::Duration;
            /// let issuer = pgfence::RedisIssuer::connect("redis://127.0.0.1:6379").await?;
            /// let resource = pgfence::Resource::new("payments:batch:42")?;
            /// if let Some(lease) = issuer.acquire(&resource, Duration::from_secs(30)).await? {
            ///     println!("token {}", lease.token());
            ///     issuer.release(&lease).await?;
            /// }
            /// # Ok(()) }
            /// ```
        }
        acquire_as: {
            /// `retry_in` is the holder's remaining TTL (`PTTL`).
        }
        acquire_wait: {}
        release: {
            /// The counter is left alone.
        }
        extend: {}
        status: {}
    }
}

/// An acquire call's id as the scripts take it: 16 hex digits, so that comparing the text
/// compares the numbers.
fn call_id(call: u64) -> String {
    format!("{call:016x}")
}

/// What [`RedisIssuer::abandon`] sends on one connection.
struct Abandon {
    lock: String,
    attempt: String,
    owner: String,
    call: String,
    /// Given up at (the TTL the call asked for, from its failure).
    until: Instant,
}

impl Abandon {
    /// Sends the clean-up on `conn` until Redis answers it, re-sent after transport failures
    /// (harmless: it removes only the failed call's lock) until `until`. `pipelined`: the
    /// script is loaded in the same write (one server: no `NOSCRIPT` round trip that would let
    /// the wait end before the script ran); otherwise the script is invoked as usual.
    async fn run<K: ConnectionLike + Send>(self, mut conn: K, pipelined: bool) {
        let mut pause = Duration::from_millis(50);
        loop {
            let sent = async {
                if pipelined {
                    redis::pipe()
                        .cmd("SCRIPT")
                        .arg("LOAD")
                        .arg(ABANDON_SOURCE)
                        .ignore()
                        .cmd("EVALSHA")
                        .arg(ABANDON.get_hash())
                        .arg(2)
                        .arg(&self.lock)
                        .arg(&self.attempt)
                        .arg(&self.owner)
                        .arg(&self.call)
                        .query_async::<(i64,)>(&mut conn)
                        .await
                        .map(|(code,)| code)
                } else {
                    ABANDON
                        .key(&self.lock)
                        .key(&self.attempt)
                        .arg(&self.owner)
                        .arg(&self.call)
                        .invoke_async::<i64>(&mut conn)
                        .await
                }
            };
            match tokio::time::timeout_at(self.until, sent).await {
                Ok(Ok(code)) => {
                    if code == 1 {
                        tracing::info!(target: "pgfence::issuer", lock = self.lock, owner = self.owner, "removed the lock a failed acquire's late attempt took");
                    }
                    return;
                }
                Ok(Err(e)) if transport_error(&e) && Instant::now() + pause < self.until => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                Ok(Err(e)) => {
                    tracing::warn!(target: "pgfence::issuer", lock = self.lock, owner = self.owner, error = %e, "could not clean up after a failed acquire; a lock its late attempt took lapses with its TTL");
                    return;
                }
                Err(_) => return,
            }
        }
    }
}

/// How a Redis call is re-sent: at once (to the connection that just reconnected), then after
/// 10 ms doubling to 250 ms, at most 8 times (an acquire: 3 times), all within the call bound;
/// each attempt, an acquire's too, is cut off after 1 s, since a stalled connection is not
/// reconnected by the client (the next attempt goes out on the next connection).
const RESEND: Resend = Resend {
    first: Duration::ZERO,
    start: Duration::from_millis(10),
    max: Duration::from_millis(250),
    max_attempts: 8,
    attempt_timeout: Some(Duration::from_secs(1)),
};

impl<C: ConnectionLike + Clone + Send + Sync + 'static> Backend for RedisIssuer<C> {
    const KIND: IssuerKind = IssuerKind::Redis;
    const RESEND: Resend = RESEND;

    fn key_prefix(&self) -> &str {
        &self.prefix
    }

    fn call_timeout(&self) -> Duration {
        self.call_timeout
    }

    fn idle_expiry(&self) -> Option<Duration> {
        self.idle_expiry
    }

    /// Counts this prefix's keys with `SCAN` (1,000 a step) and reads each counter's `PTTL`;
    /// not on a Cluster (`None`: a scan would cover one node).
    async fn state_once(&self) -> Result<Option<IssuerState>> {
        let conn: &dyn std::any::Any = &self.conn;
        if conn.is::<redis::cluster_async::ClusterConnection>() {
            return Ok(None);
        }
        state::count(self.conn.clone(), &self.prefix, self.idle_expiry)
            .await
            .map(Some)
            .map_err(|e| self.redis_error(e))
    }

    fn no_reply(after: Duration) -> Error {
        Error::redis(redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no reply from Redis within {after:?}"),
        )))
    }

    fn resendable(e: &Error) -> bool {
        matches!(e, Error::Backend(b) if b.as_redis().is_some_and(transport_error))
    }

    /// One round trip: the acquire script (`SET NX PX` and `INCR`, or the same owner's token
    /// again).
    async fn try_acquire(&self, ask: &Ask<'_>) -> Result<Attempt> {
        let ttl_ms = ttl_millis(ask.ttl)?;
        let (lock, counter) = (self.lock_key(ask.resource), self.counter_key(ask.resource));
        let sent_at = Instant::now();
        let mut conn = self.conn.clone();
        let mut script = ACQUIRE.key(&lock);
        script.key(&counter);
        // The attempt record tells a failed call's clean-up apart from a later call of the
        // same owner; an owner id no other call can present needs none (a write saved).
        if !ask.own_owner {
            script.key(prefixed_attempt_key(&self.prefix, ask.resource));
        }
        let reply = script
            .arg(ask.owner)
            .arg(ttl_ms)
            .arg(MAX_TOKEN)
            .arg(call_id(ask.call))
            .arg(crate::issuer::idle_millis(self.idle_expiry))
            .invoke_async::<Vec<Value>>(&mut conn)
            .await
            .map_err(|e| self.redis_error(e))?;
        match reply.as_slice() {
            [Value::Int(1), token, fresh] => {
                let lease = ask.lease(FenceToken::new(int(token)?)?, sent_at);
                Ok(if int(fresh)? == 1 {
                    Attempt::FreshCounter(lease)
                } else {
                    Attempt::Granted(lease)
                })
            }
            [Value::Int(0), pttl] => Ok(Attempt::Busy(Duration::from_millis(
                u64::try_from(int(pttl)?).unwrap_or(0),
            ))),
            // The script refused before INCR and SET: nothing changed.
            [Value::Int(-1), at] => Err(limit_refused(
                ask.resource,
                &format!("the fence counter {counter} (at {})", text(at)?),
                REDIS_LIMIT_FIX,
                false,
            )),
            other => Err(unexpected(other)),
        }
    }

    /// Removes, in the background, the lock a late attempt of the failed call `ask` takes:
    /// see [`RedisIssuer::abandon`].
    async fn acquire_abandoned(&self, ask: &Ask<'_>) {
        self.abandon(ask);
    }

    async fn settle_fresh(&self, mut lease: Lease) -> Result<Lease> {
        self.reseed_fresh(&mut lease).await?;
        Ok(lease)
    }

    async fn release_once(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let mut conn = self.conn.clone();
        let code = RELEASE
            .key(self.lock_key(&lease.resource))
            .arg(lease.value())
            .invoke_async::<i64>(&mut conn)
            .await
            .map_err(|e| self.redis_error(e))?;
        Ok(ReleaseOutcome::from_reply(code))
    }

    async fn extend_once(&self, lease: &Lease, ttl: Duration) -> Result<Renewal> {
        let ttl_ms = ttl_millis(ttl)?;
        let sent_at = Instant::now();
        let mut conn = self.conn.clone();
        let mut script = EXTEND.key(self.lock_key(&lease.resource));
        // With idle expiry the counter lives on past the extended lease (same hash slot).
        if self.idle_expiry.is_some() {
            script.key(self.counter_key(&lease.resource));
        }
        let code = script
            .arg(lease.value())
            .arg(ttl_ms)
            .arg(crate::issuer::idle_millis(self.idle_expiry))
            .invoke_async::<i64>(&mut conn)
            .await
            .map_err(|e| self.redis_error(e))?;
        Ok(Renewal::of(LeaseState::from_reply(code), sent_at + ttl))
    }

    async fn status_once(&self, resource: &Resource) -> Result<LockStatus> {
        let lock = self.lock_key(resource);
        let mut conn = self.conn.clone();
        let (held, pttl, count) = redis::pipe()
            .get(&lock)
            .pttl(&lock)
            .get(self.counter_key(resource))
            .query_async::<(Option<String>, i64, Option<i64>)>(&mut conn)
            .await
            .map_err(|e| self.redis_error(e))?;
        let (owner, token) = match held.as_deref().and_then(|v| v.rsplit_once(':')) {
            Some((o, t)) => (Some(o.to_owned()), t.parse().ok()),
            None => (None, None),
        };
        Ok(LockStatus {
            resource: resource.to_string(),
            owner,
            token,
            ttl_ms: held.is_some().then_some(pttl),
            counter: count.unwrap_or(0),
        })
    }

    async fn raise_floor_once(&self, resource: &Resource, floor: i64) -> Result<i64> {
        let mut conn = self.conn.clone();
        let reply = RAISE_FLOOR
            .key(self.counter_key(resource))
            .arg(floor.to_string())
            .invoke_async::<Value>(&mut conn)
            .await
            .map_err(|e| self.redis_error(e))?;
        int(&reply)
    }

    fn recover_from(&self, err: &Error) -> impl Future<Output = Result<bool>> + Send {
        RedisIssuer::recover_from(self, err)
    }

    fn reseed(
        &self,
        pool: &PgPool,
        resource: &Resource,
    ) -> impl Future<Output = Result<i64>> + Send {
        RedisIssuer::reseed(self, pool, resource)
    }
}

fn int(v: &Value) -> Result<i64> {
    match v {
        Value::Int(i) => Ok(*i),
        Value::BulkString(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| unexpected(std::slice::from_ref(v))),
        Value::SimpleString(s) => s.parse().map_err(|_| unexpected(std::slice::from_ref(v))),
        other => Err(unexpected(std::slice::from_ref(other))),
    }
}

/// A script's reply as text (a counter's exact decimal text, which may not fit an `i64`).
fn text(v: &Value) -> Result<String> {
    match v {
        Value::BulkString(b) => Ok(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Ok(s.clone()),
        Value::Int(i) => Ok(i.to_string()),
        other => Err(unexpected(std::slice::from_ref(other))),
    }
}

fn unexpected(v: &[Value]) -> Error {
    Error::redis(redis::RedisError::from((
        redis::ErrorKind::UnexpectedReturnType,
        "unexpected reply from a pgfence script",
        format!("{v:?}"),
    )))
}

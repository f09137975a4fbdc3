//! The Redis token issuer: a lock and its fence token in one atomic round trip, owner-safe
//! release and extend, waiting, and recovery of the counter after a Redis failover.
//!
//! Keys for resource `R` are `pgfence:{R}:lock` and `pgfence:{R}:fence`; for resource `NAME`
//! in fencing domain `D`, `pgfence:{D}:lock:NAME` and the domain's `pgfence:{D}:fence`
//! (`pgfence` is the default key prefix; [`Issuer::with_key_prefix`] changes it). The
//! hash tag puts a lock and its counter in one Redis Cluster slot. The counter never expires,
//! and nothing here deletes it but an acquire refused at the token limit, which undoes the
//! counter it had just created. Redis only hands out numbers: safety comes from Postgres
//! rejecting old tokens, so a counter that goes backwards costs liveness (rejected writes)
//! until it is reseeded, never correctness.

mod acl;
mod any;
mod connections;
#[cfg(feature = "etcd")]
mod etcd;
mod keepalive;
mod pg;
mod scripts;
mod sentinel;
#[cfg(feature = "zk")]
mod zk;

use std::future::Future;
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use redis::Value;
use redis::aio::ConnectionLike;
use tokio::time::Instant;

pub use acl::{REDIS_ACL_COMMANDS, REDIS_SENTINEL_ACL_RULE, redis_acl_key_pattern, redis_acl_rule};
pub use any::{
    BoxFuture, IssuerKind, IssuerOptions, TokenIssuer, connect_issuer, connect_issuer_with,
};
use connections::retry_transport;
pub use connections::{RedisConnections, default_connections};
#[cfg(feature = "etcd")]
pub(crate) use etcd::is_transient as etcd_is_transient;
#[cfg(feature = "etcd")]
pub use etcd::{ETCD_SCHEME, ETCD_TLS_SCHEME, EtcdIssuer, etcd_lock_key, is_etcd_url};
pub use keepalive::{KeepAlive, LeaseLost};
pub use pg::{POSTGRES_SCHEMES, PgIssuer, is_postgres_url};
use scripts::{ACQUIRE, EXTEND, RAISE_FLOOR, REISSUE, RELEASE};
pub use sentinel::{
    DEFAULT_FAILOVER_WAIT, DEFAULT_SENTINEL_PORT, SENTINEL_SCHEME, SENTINEL_TLS_SCHEME,
    SentinelConnections, SentinelUrl, is_sentinel_url,
};
#[cfg(feature = "zk")]
pub(crate) use zk::is_transient as zk_is_transient;
#[cfg(feature = "zk")]
pub use zk::{ZK_SCHEME, ZkIssuer, is_zk_url, zk_lock_dir};

use crate::{Error, FenceToken, Fencing, MAX_TOKEN, Resource, Result, StaleTarget};

/// Where an issuer reads the mark a fresh counter must start above (Postgres's high-water
/// mark, through [`Issuer::with_floor_source`]): the issuer's only view of the database.
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

/// Shortest lease accepted.
pub const MIN_TTL: Duration = Duration::from_millis(10);
/// Longest lease accepted: a lease is a lease, not a reservation.
pub const MAX_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// How many times an acquire is re-sent, with the same owner id, after a transport error.
const ACQUIRE_ATTEMPTS: u32 = 3;

/// The default key prefix: keys are `pgfence:{R}:lock` and `pgfence:{R}:fence`.
pub const DEFAULT_KEY_PREFIX: &str = "pgfence";

/// The longest key prefix accepted ([`Issuer::with_key_prefix`]).
pub const MAX_KEY_PREFIX_LEN: usize = 64;

/// Checks a key prefix: non-empty, at most [`MAX_KEY_PREFIX_LEN`] bytes, and free of braces
/// (which would move the Redis Cluster hash tag), whitespace and control characters.
///
/// # Errors
/// [`Error::InvalidKeyPrefix`] saying what is wrong.
pub fn check_key_prefix(prefix: &str) -> Result<&str> {
    let why = if prefix.is_empty() {
        Some("it is empty".to_owned())
    } else if prefix.len() > MAX_KEY_PREFIX_LEN {
        Some(format!(
            "it is {} bytes long, at most {MAX_KEY_PREFIX_LEN} are allowed",
            prefix.len()
        ))
    } else if prefix.contains(['{', '}']) {
        Some("it contains a brace ('{' or '}'), which would change the key's hash slot".into())
    } else if prefix.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Some("it contains whitespace or a control character".into())
    } else {
        None
    };
    match why {
        Some(why) => Err(Error::InvalidKeyPrefix(format!(
            "{:?}: {why}",
            prefix.escape_debug().to_string()
        ))),
        None => Ok(prefix),
    }
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

fn prefixed_counter_key(prefix: &str, resource: &Resource) -> String {
    format!("{prefix}:{{{}}}:fence", resource.counter_id())
}

/// The Redis key of `resource`'s lock with the default prefix: `pgfence:{R}:lock`, or
/// `pgfence:{D}:lock:NAME` for resource `NAME` in fencing domain `D` (one hash slot per
/// domain). [`Issuer::lock_key`] gives an issuer's key, whatever its prefix.
#[must_use]
pub fn lock_key(resource: &Resource) -> String {
    prefixed_lock_key(DEFAULT_KEY_PREFIX, resource)
}

/// The Redis key of `resource`'s token counter with the default prefix: `pgfence:{R}:fence`,
/// or the domain's `pgfence:{D}:fence`, shared by every resource of the domain.
/// [`Issuer::counter_key`] gives an issuer's key, whatever its prefix.
#[must_use]
pub fn counter_key(resource: &Resource) -> String {
    prefixed_counter_key(DEFAULT_KEY_PREFIX, resource)
}

/// The refusal of an acquire whose token would pass [`MAX_TOKEN`]: the lock stays free and the
/// next acquire is refused the same way until the counter is repaired. Every issuer refuses
/// before it writes (the counter as it was); `undone` says it wrote and undid it instead (a
/// race with the limit on etcd and ZooKeeper, whose counters cannot be read before a write
/// they did not see, or a lost Redis counter whose floor is at the limit). `counter` names
/// what reached the limit (with its value), `fix` what to do about it.
/// [`Error::InvalidToken`], the error a token past the limit has always been.
pub(crate) fn limit_refused(resource: &Resource, counter: &str, fix: &str, undone: bool) -> Error {
    let outcome = if undone {
        "left nothing behind (what it had written was removed again)"
    } else {
        "changed nothing (no lock taken, the counter as it was)"
    };
    Error::InvalidToken(format!(
        "for resource {resource}: {counter} reached the token limit, so the acquire was refused and {outcome}; {fix}; `pgfence doctor --resource '{resource}'` reports the counters and marks near the limit"
    ))
}

/// What to do about a Redis counter at the limit.
const REDIS_LIMIT_FIX: &str = "if it was raised by mistake (set by hand, a bogus floor), set it back to PostgreSQL's high-water mark (`pgfence reseed` only raises counters)";

/// Validates a lease TTL.
///
/// # Errors
/// [`Error::InvalidDuration`] outside [`MIN_TTL`]`..=`[`MAX_TTL`].
pub fn check_ttl(ttl: Duration) -> Result<Duration> {
    if (MIN_TTL..=MAX_TTL).contains(&ttl) {
        Ok(ttl)
    } else {
        Err(Error::InvalidDuration(format!(
            "lease TTL {ttl:?}: a lease TTL must be between {MIN_TTL:?} and {MAX_TTL:?}"
        )))
    }
}

fn ttl_millis(ttl: Duration) -> Result<u64> {
    u64::try_from(check_ttl(ttl)?.as_millis())
        .map_err(|_| Error::InvalidDuration(format!("{ttl:?}")))
}

/// A new unguessable owner id: 128 random bits from the OS-seeded CSPRNG, as hex.
#[must_use]
pub fn new_owner_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// The name PostgreSQL fences `resource` under for leases of key prefix `prefix`
/// ([`Resource::in_key_prefix`]), checked before an acquire sends anything: a lock is taken on
/// a resource name, never on a prefix's PostgreSQL name.
pub(crate) fn fencing_name(prefix: &str, resource: &Resource) -> Result<Resource> {
    if let Some(other) = resource.key_prefix() {
        return Err(Error::InvalidResource(format!(
            "{resource} is the PostgreSQL name of {} under key prefix {other}: lock {} itself (with that key prefix)",
            resource.without_key_prefix(),
            resource.without_key_prefix()
        )));
    }
    resource.in_key_prefix(prefix)
}

/// A granted lock: who holds what, with which token, until when.
#[derive(Clone, Debug)]
pub struct Lease {
    resource: Resource,
    fencing: Resource,
    owner: String,
    token: FenceToken,
    ttl: Duration,
    deadline: Instant,
    /// The PostgreSQL timeline the lease's first fenced statement ran on; shared by clones
    /// and by every [`Fencing`] made from the lease ([`Lease::timeline`]).
    pub(crate) timeline: crate::timeline::Binding,
}

impl PartialEq for Lease {
    fn eq(&self, other: &Self) -> bool {
        self.resource == other.resource
            && self.fencing == other.fencing
            && self.owner == other.owner
            && self.token == other.token
            && self.ttl == other.ttl
            && self.deadline == other.deadline
            && self.timeline.get() == other.timeline.get()
    }
}

impl Eq for Lease {}

impl Lease {
    /// The locked resource.
    #[must_use]
    pub fn resource(&self) -> &Resource {
        &self.resource
    }

    /// The name PostgreSQL fences this lease's resource under: [`Lease::resource`] itself for
    /// an issuer with the default key prefix, its key prefix's name otherwise
    /// ([`Resource::in_key_prefix`]: `P{R`, `{P{D}NAME`), so that prefixes sharing a database
    /// share no mark. [`Fencing`] (`&lease`) carries it: checks, audit rows, effects and the
    /// token tag use it. SQL callers pass it to `pgfence.check` (`pgfence run` exports it as
    /// `PGFENCE_RESOURCE`); [`high_water`](crate::high_water) and
    /// [`counter_floor`](crate::counter_floor) read its marks.
    #[must_use]
    pub fn fencing_resource(&self) -> &Resource {
        &self.fencing
    }

    /// The owner id (unguessable; only its holder can release or extend the lock).
    #[must_use]
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The fence token to present with every write made under this lease.
    #[must_use]
    pub fn token(&self) -> FenceToken {
        self.token
    }

    /// The TTL the lease was granted (or last extended) with.
    #[must_use]
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Local deadline: measured from before the request was sent, on a monotonic clock, so
    /// it can only be early, never late, relative to the server's expiry.
    #[must_use]
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Time left before [`Lease::deadline`] (zero once passed). An efficiency hint only: a
    /// pause can still land between this check and a write, which is why writes are fenced.
    #[must_use]
    pub fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// The PostgreSQL timeline this lease is bound to: the one its first fenced statement ran
    /// on, `None` before that. After a failover of the database (a promotion, which starts a
    /// new timeline and may have lost commits) the lease's fenced statements are refused
    /// with [`Error::FencedByFailover`]: take a new lease. See [`Fencing::timeline`].
    #[must_use]
    pub fn timeline(&self) -> Option<i64> {
        self.timeline.get()
    }

    /// Binds the lease to `timeline` unless it is bound already (a lease continued in another
    /// process: `pgfence run` exports `PGFENCE_TIMELINE`).
    #[must_use]
    pub fn on_timeline(self, timeline: i64) -> Self {
        self.timeline.pin(timeline);
        self
    }

    /// Rebuilds a lease handle from what another process printed (`pgfence lock acquire`),
    /// to release or extend that lock from here. The local deadline is unknown, so it is set
    /// to now: [`Lease::remaining`] is zero until a successful [`Issuer::extend`].
    ///
    /// The lease is fenced as one of the default key prefix; [`Lease::with_key_prefix`] puts
    /// it under another.
    #[must_use]
    pub fn resume(resource: Resource, owner: impl Into<String>, token: FenceToken) -> Self {
        Self {
            fencing: resource.clone(),
            resource,
            owner: owner.into(),
            token,
            ttl: MIN_TTL,
            deadline: Instant::now(),
            timeline: crate::timeline::Binding::default(),
        }
    }

    /// The same lease as one of an issuer with key prefix `prefix`: its
    /// [`Lease::fencing_resource`] becomes that prefix's name (a resumed lease of a prefixed
    /// issuer, for its fenced writes).
    ///
    /// # Errors
    /// [`Error::InvalidKeyPrefix`]; [`Error::InvalidResource`] when the name would be too long
    /// (see [`Resource::in_key_prefix`]).
    pub fn with_key_prefix(mut self, prefix: &str) -> Result<Self> {
        self.fencing = fencing_name(prefix, &self.resource)?;
        Ok(self)
    }

    /// The lease with its fencing name (set by the issuer that granted it).
    pub(crate) fn fenced_as(mut self, fencing: Resource) -> Self {
        self.fencing = fencing;
        self
    }

    fn value(&self) -> String {
        format!("{}:{}", self.owner, self.token)
    }
}

impl From<&Lease> for Fencing {
    fn from(lease: &Lease) -> Self {
        let mut fencing = Fencing::new(lease.token)
            .resource(lease.fencing.clone())
            .holder(lease.owner.clone());
        fencing.timeline = lease.timeline.clone();
        fencing
    }
}

impl From<Lease> for Fencing {
    fn from(lease: Lease) -> Self {
        Fencing::from(&lease)
    }
}

/// What [`Issuer::extend`] (and [`TokenIssuer::extend`]) found: whether the lease still
/// holds the lock after the call.
///
/// `Held` means what it says here: the lease still holds the lock, now extended. Releasing
/// has its own answer, [`ReleaseOutcome`], because after a release nothing is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseState {
    /// The lease still holds the lock, and it was extended.
    Held,
    /// The lock had expired; nobody holds it.
    Expired,
    /// Another lease holds the lock now.
    Taken,
}

/// What [`Issuer::release`] (and [`TokenIssuer::release`]) did.
///
/// Only [`ReleaseOutcome::Released`] means this call (or an earlier attempt of it lost in
/// transit) freed the lock. The other two are not errors: the lease had already ended, and
/// the lock was left as it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReleaseOutcome {
    /// The lease held the lock and released it: the lock is free.
    Released,
    /// The lock had already expired (nobody held it); nothing was changed.
    AlreadyExpired,
    /// Another lease holds the lock now; it was left alone.
    TakenByOther,
}

impl ReleaseOutcome {
    /// Whether this release freed the lock.
    #[must_use]
    pub fn is_released(self) -> bool {
        self == ReleaseOutcome::Released
    }

    /// A short lower-case word for output: `released`, `expired` or `taken`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseOutcome::Released => "released",
            ReleaseOutcome::AlreadyExpired => "expired",
            ReleaseOutcome::TakenByOther => "taken",
        }
    }

    /// What a release reports when it was re-sent after a transport failure: a lock found gone
    /// before the lease's local deadline cannot have expired, so an earlier attempt released
    /// it. Every issuer's release goes through here.
    pub(crate) fn after_resend(self, retried: bool, lease: &Lease) -> Self {
        if self == ReleaseOutcome::AlreadyExpired && retried && Instant::now() < lease.deadline {
            ReleaseOutcome::Released
        } else {
            self
        }
    }

    fn from_reply(code: i64) -> Self {
        match code {
            1 => ReleaseOutcome::Released,
            0 => ReleaseOutcome::AlreadyExpired,
            _ => ReleaseOutcome::TakenByOther,
        }
    }
}

impl std::fmt::Display for ReleaseOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl LeaseState {
    fn from_reply(code: i64) -> Self {
        match code {
            1 => LeaseState::Held,
            0 => LeaseState::Expired,
            _ => LeaseState::Taken,
        }
    }
}

/// The state of a resource's lock and counter, for status displays.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LockStatus {
    /// The resource.
    pub resource: String,
    /// Owner id of the current holder, if the lock is held.
    pub owner: Option<String>,
    /// Token of the current holder, if the lock is held.
    pub token: Option<i64>,
    /// Milliseconds until the lock expires, if held.
    pub ttl_ms: Option<i64>,
    /// The counter: the last token issued (0 if none).
    pub counter: i64,
}

/// Issues leases and fence tokens from Redis.
///
/// Generic over the connection: [`Issuer::connect`] gives a set of reconnecting connections
/// ([`RedisConnections`]), [`Issuer::connect_cluster`] a Redis Cluster connection, and
/// [`Issuer::new`] takes any [`ConnectionLike`] (for example one [`ConnectionManager`](redis::aio::ConnectionManager)).
///
/// Every key starts with the key prefix, `pgfence` unless [`Issuer::with_key_prefix`] sets
/// another: issuers with different prefixes share no lock and no counter on one Redis, and
/// no mark in one database (their leases are fenced under their prefix's name,
/// [`Lease::fencing_resource`]).
#[derive(Clone)]
pub struct Issuer<C = RedisConnections> {
    conn: C,
    pub(crate) floor_source: Option<Arc<dyn FloorSource>>,
    prefix: Arc<str>,
}

impl<C> std::fmt::Debug for Issuer<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Issuer")
            .field("key_prefix", &self.prefix)
            .field("floor_source", &self.floor_source.is_some())
            .finish_non_exhaustive()
    }
}

impl<C> Issuer<C> {
    /// The same issuer with another key prefix: keys become `PREFIX:{R}:lock` and
    /// `PREFIX:{R}:fence` (`PREFIX:{D}:lock:NAME` and `PREFIX:{D}:fence` in a fencing domain).
    /// Applications that share a Redis but must not share locks use different prefixes. With
    /// a prefix other than the default, PostgreSQL fences the leases under the prefix's name
    /// for the resource ([`Resource::in_key_prefix`]): applications that also share a
    /// database share no mark, check or audit filter.
    ///
    /// # Errors
    /// [`Error::InvalidKeyPrefix`] for a prefix that is empty, longer than
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
    /// [`redis_acl_rule`]).
    #[must_use]
    pub fn acl_rule(&self) -> String {
        redis_acl_rule(&self.prefix)
    }

    /// A Redis error as the caller gets it: an ACL refusal names the rule the user needs
    /// ([`Error::RedisPermission`]).
    fn redis_error(&self, e: redis::RedisError) -> Error {
        acl::redis_error(e, &self.prefix)
    }
}

impl Issuer<RedisConnections> {
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
    /// For the user's ACL, see [`redis_acl_rule`].
    ///
    /// # Errors
    /// [`Error::Redis`] for a malformed URL or an unreachable server (a certificate refused by
    /// either side is not [retryable](Error::is_retryable)); [`Error::InvalidTls`] and
    /// [`Error::TlsFile`] for the TLS parameters; [`Error::IssuerNotBuilt`] for `rediss://`
    /// without the `tls` feature.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(url, default_connections()).await
    }

    /// Like [`Issuer::connect`] with `connections` connections.
    ///
    /// # Errors
    /// As [`Issuer::connect`].
    pub async fn connect_with(url: &str, connections: NonZeroUsize) -> Result<Self> {
        Ok(Self::new(RedisConnections::open(url, connections).await?))
    }
}

impl Issuer<redis::cluster_async::ClusterConnection> {
    /// Connects to a Redis Cluster through any of its nodes: `redis://host:port` URLs, or
    /// `rediss://host:port` for TLS (feature `tls`) with the optional `cacert`, `cert` and
    /// `key` parameters of [`Issuer::connect`] on any one node URL (they apply to every node).
    ///
    /// # Errors
    /// [`Error::InvalidTls`] / [`Error::TlsFile`] for the TLS parameters;
    /// [`Error::IssuerNotBuilt`] for `rediss://` without the `tls` feature; [`Error::Redis`].
    pub async fn connect_cluster(nodes: &[String]) -> Result<Self> {
        let client = crate::tls::redis_cluster_client(nodes)?;
        Ok(Self::new(client.get_async_connection().await?))
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> Issuer<C> {
    /// An issuer on an existing connection.
    #[must_use]
    pub fn new(conn: C) -> Self {
        Self {
            conn,
            floor_source: None,
            prefix: Arc::from(DEFAULT_KEY_PREFIX),
        }
    }

    /// Tries once to take `resource`'s lock for `ttl`. `Ok(None)` when another owner holds it.
    ///
    /// # Errors
    /// [`Error::InvalidDuration`] for a TTL outside [`MIN_TTL`]`..=`[`MAX_TTL`] (nothing is
    /// sent); [`Error::Redis`] when Redis fails after retries; [`Error::InvalidToken`] when the
    /// counter is at [`MAX_TOKEN`] (the acquire is refused before anything changes: the lock
    /// stays free, the counter as it was).
    ///
    /// # Example
    /// ```no_run
    /// # async fn f() -> pgfence::Result<()> {
    /// use std::time::Duration;
    /// let issuer = pgfence::Issuer::connect("redis://127.0.0.1:6379").await?;
    /// let resource = pgfence::Resource::new("payments:batch:42")?;
    /// if let Some(lease) = issuer.acquire(&resource, Duration::from_secs(30)).await? {
    ///     println!("token {}", lease.token());
    ///     issuer.release(&lease).await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn acquire(&self, resource: &Resource, ttl: Duration) -> Result<Option<Lease>> {
        Ok(self.acquire_as(resource, &new_owner_id(), ttl).await?.ok())
    }

    /// Like [`Issuer::acquire`] with a caller-chosen owner id. Re-running it with the same
    /// owner while the lease is held returns the same token (the idempotent retry after a lost
    /// reply). Returns `Err(retry_in)` when another owner holds the lock.
    ///
    /// # Errors
    /// As [`Issuer::acquire`]; [`Error::InvalidOwner`] for an empty owner id or one containing
    /// `:`.
    pub async fn acquire_as(
        &self,
        resource: &Resource,
        owner: &str,
        ttl: Duration,
    ) -> Result<std::result::Result<Lease, Duration>> {
        let ttl_ms = ttl_millis(ttl)?;
        check_owner(owner)?;
        let fencing = fencing_name(&self.prefix, resource)?;
        let (lock, counter) = (self.lock_key(resource), self.counter_key(resource));
        let _timer = crate::metrics::Timer::acquire();
        let result = self
            .acquire_once(resource, &fencing, owner, ttl, ttl_ms, &lock, &counter)
            .await;
        crate::metrics::acquisition(match &result {
            Ok(Ok(_)) => "acquired",
            Ok(Err(_)) => "busy",
            Err(_) => "error",
        });
        result
    }

    #[allow(clippy::too_many_arguments)]
    async fn acquire_once(
        &self,
        resource: &Resource,
        fencing: &Resource,
        owner: &str,
        ttl: Duration,
        ttl_ms: u64,
        lock: &str,
        counter: &str,
    ) -> Result<std::result::Result<Lease, Duration>> {
        let mut attempt = 0;
        let (reply, sent_at) = loop {
            let sent_at = Instant::now();
            let mut conn = self.conn.clone();
            match ACQUIRE
                .key(lock)
                .key(counter)
                .arg(owner)
                .arg(ttl_ms)
                .arg(MAX_TOKEN)
                .invoke_async::<Vec<Value>>(&mut conn)
                .await
            {
                Ok(reply) => break (reply, sent_at),
                // The same owner id makes a re-sent acquire return the token already issued.
                Err(e) if attempt + 1 < ACQUIRE_ATTEMPTS && transient(&e) => attempt += 1,
                Err(e) => return Err(self.redis_error(e)),
            }
        };
        match reply.as_slice() {
            [Value::Int(1), token, fresh] => {
                let token = FenceToken::new(int(token)?)?;
                let mut lease = Lease {
                    timeline: crate::timeline::Binding::default(),
                    resource: resource.clone(),
                    fencing: fencing.clone(),
                    owner: owner.to_owned(),
                    token,
                    ttl,
                    deadline: sent_at + ttl,
                };
                if int(fresh)? == 1 {
                    self.reseed_fresh(&mut lease).await?;
                }
                Ok(Ok(lease))
            }
            [Value::Int(0), pttl] => Ok(Err(Duration::from_millis(
                u64::try_from(int(pttl)?).unwrap_or(0),
            ))),
            // The script refused before INCR and SET: nothing changed.
            [Value::Int(-1), at] => Err(limit_refused(
                resource,
                &format!("the fence counter {counter} (at {})", text(at)?),
                REDIS_LIMIT_FIX,
                false,
            )),
            other => Err(unexpected(other)),
        }
    }

    /// Waits up to `wait` for the lock, retrying (also after retryable errors, such as a
    /// failover in progress) with jittered exponential backoff (10 ms
    /// doubling to 500 ms, never sleeping past the holder's remaining TTL). `Ok(None)` when
    /// the wait ran out.
    ///
    /// # Errors
    /// As [`Issuer::acquire`].
    pub async fn acquire_wait(
        &self,
        resource: &Resource,
        ttl: Duration,
        wait: Duration,
    ) -> Result<Option<Lease>> {
        check_ttl(ttl)?;
        let give_up = Instant::now() + wait;
        let owner = new_owner_id();
        let mut backoff = Duration::from_millis(10);
        loop {
            let retry_in = match self.acquire_as(resource, &owner, ttl).await {
                Ok(Ok(lease)) => return Ok(Some(lease)),
                Ok(Err(retry_in)) => retry_in,
                // A failover or a dropped connection while waiting: keep waiting (the same
                // owner id makes a retried acquire idempotent), up to the caller's deadline.
                Err(e) if e.is_retryable() && Instant::now() < give_up => Duration::ZERO,
                Err(e) => return Err(e),
            };
            let now = Instant::now();
            if now >= give_up {
                return Ok(None);
            }
            tokio::time::sleep(wait_nap(&mut backoff, retry_in, give_up - now)).await;
        }
    }

    /// Releases the lock if `lease` still holds it. The counter is left alone.
    ///
    /// A release lost in transit (a dropped or refused connection, a timeout) is sent again
    /// for up to 2 s: releasing is owner-safe. When a re-sent release finds the lock gone
    /// before the lease's local deadline, the lock cannot have expired, so an earlier attempt
    /// released it: that is reported as [`ReleaseOutcome::Released`].
    ///
    /// # Errors
    /// [`Error::Redis`].
    pub async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        const WINDOW: Duration = Duration::from_secs(2);
        const ATTEMPTS: u32 = 8;
        let (lock, value) = (self.lock_key(&lease.resource), lease.value());
        let sent = retry_transport(Instant::now() + WINDOW, ATTEMPTS, || {
            let (mut conn, lock, value) = (self.conn.clone(), &lock, &value);
            async move {
                RELEASE
                    .key(lock)
                    .arg(value)
                    .invoke_async::<i64>(&mut conn)
                    .await
            }
        })
        .await;
        let code = sent.result.map_err(|e| self.redis_error(e))?;
        Ok(ReleaseOutcome::from_reply(code).after_resend(sent.retried, lease))
    }

    /// Extends the lock to `ttl` from now if `lease` still holds it, and moves the lease's
    /// local deadline accordingly.
    ///
    /// An extend lost in transit is sent again (extending is owner-safe and idempotent) until
    /// the lease's local deadline, or for 2 s when that is sooner; only Redis's answer
    /// ([`LeaseState::Expired`], [`LeaseState::Taken`]) or running out of time ends it early.
    ///
    /// # Errors
    /// [`Error::InvalidDuration`]; [`Error::Redis`].
    pub async fn extend(&self, lease: &mut Lease, ttl: Duration) -> Result<LeaseState> {
        let until = lease.deadline.max(Instant::now() + Duration::from_secs(2));
        self.extend_until(lease, ttl, until).await
    }

    /// [`Issuer::extend`], re-sending after transport failures until `until` (what
    /// [`KeepAlive`] uses: it gives up at the lease's local deadline).
    ///
    /// # Errors
    /// As [`Issuer::extend`].
    pub async fn extend_until(
        &self,
        lease: &mut Lease,
        ttl: Duration,
        until: Instant,
    ) -> Result<LeaseState> {
        let ttl_ms = ttl_millis(ttl)?;
        let (lock, value) = (self.lock_key(&lease.resource), lease.value());
        let sent = retry_transport(until, u32::MAX, || {
            let (mut conn, lock, value) = (self.conn.clone(), &lock, &value);
            async move {
                EXTEND
                    .key(lock)
                    .arg(value)
                    .arg(ttl_ms)
                    .invoke_async::<i64>(&mut conn)
                    .await
            }
        })
        .await;
        let state = LeaseState::from_reply(sent.result.map_err(|e| self.redis_error(e))?);
        if state == LeaseState::Held {
            // From the attempt that succeeded: an earlier one that arrives later only moves
            // the server's expiry further out.
            lease.ttl = ttl;
            lease.deadline = sent.sent_at + ttl;
        }
        Ok(state)
    }

    /// Reads the lock and counter of `resource`.
    ///
    /// # Errors
    /// [`Error::Redis`].
    pub async fn status(&self, resource: &Resource) -> Result<LockStatus> {
        let (lock, counter) = (self.lock_key(resource), self.counter_key(resource));
        // A read: re-sent after a connection dropped in transit, for up to 2 s.
        let sent = retry_transport(Instant::now() + Duration::from_secs(2), 8, || {
            let (mut conn, lock, counter) = (self.conn.clone(), &lock, &counter);
            async move {
                redis::pipe()
                    .get(lock)
                    .pttl(lock)
                    .get(counter)
                    .query_async::<(Option<String>, i64, Option<i64>)>(&mut conn)
                    .await
            }
        })
        .await;
        let (held, pttl, count) = sent.result.map_err(|e| self.redis_error(e))?;
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

    /// Raises `resource`'s counter to at least `floor` (never lowers it) and returns its value
    /// afterwards. The next lease gets a token above `floor`.
    ///
    /// # Errors
    /// [`Error::InvalidToken`] for a negative floor; [`Error::Redis`].
    pub async fn raise_floor(&self, resource: &Resource, floor: i64) -> Result<i64> {
        if floor < 0 {
            return Err(Error::InvalidToken(floor.to_string()));
        }
        // Raising only ever raises, so a re-send after a dropped connection is harmless.
        let counter = self.counter_key(resource);
        let sent = retry_transport(Instant::now() + Duration::from_secs(2), 8, || {
            let (mut conn, counter) = (self.conn.clone(), &counter);
            async move {
                RAISE_FLOOR
                    .key(counter)
                    .arg(floor.to_string())
                    .invoke_async::<Value>(&mut conn)
                    .await
            }
        })
        .await;
        int(&sent.result.map_err(|e| self.redis_error(e))?)
    }

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
        tracing::info!(
            target: "pgfence::issuer",
            resource = lease.resource.as_str(),
            lost_token = lease.token.get(),
            high_water = mark,
            token,
            "fence counter was lost; reseeded from Postgres"
        );
        lease.token = FenceToken::new(token)?;
        Ok(())
    }

    /// Keeps `lease` alive in the background; see [`KeepAlive`].
    #[must_use]
    pub fn keep_alive(&self, lease: &Lease) -> KeepAlive {
        KeepAlive::spawn(Arc::new(self.clone()), lease.clone())
    }
}

/// Validates a lock owner id (stored as `owner:token`, so it cannot contain `:`).
pub(crate) fn check_owner(owner: &str) -> Result<()> {
    if owner.is_empty() || owner.contains(':') {
        return Err(Error::InvalidOwner(
            "owner ids are non-empty and contain no ':'".into(),
        ));
    }
    Ok(())
}

/// How long a waiting acquire sleeps before its next try: jittered exponential backoff (10 ms
/// doubling to 500 ms, advanced here), never past the holder's reported remaining time — a
/// lock that reports none (no expiry, or under a second on etcd) gets the plain backoff
/// instead of a busy poll — nor past `left`, the caller's remaining wait.
pub(crate) fn wait_nap(backoff: &mut Duration, retry_in: Duration, left: Duration) -> Duration {
    let jittered = backoff.mul_f64(0.5 + rand::random::<f64>() / 2.0);
    *backoff = (*backoff * 2).min(Duration::from_millis(500));
    let nap = if retry_in.is_zero() {
        jittered
    } else {
        jittered.min(retry_in)
    };
    nap.min(left)
}

fn transient(e: &redis::RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_timeout()
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
    Error::Redis(redis::RedisError::from((
        redis::ErrorKind::UnexpectedReturnType,
        "unexpected reply from a pgfence script",
        format!("{v:?}"),
    )))
}

/// Runs an owner-safe `op` until it succeeds, fails for a reason that is not transient, or
/// `until` passes (backoff 25 ms doubling to 400 ms between attempts). Also says whether it was
/// re-sent. Used by the consensus-store and PostgreSQL issuers, whose release and extend
/// compare owner and token, so sending them twice is harmless.
pub(crate) async fn retrying<T, F, Fut>(until: Instant, mut op: F) -> (Result<T>, bool)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let mut backoff = Duration::from_millis(25);
    let mut made = 0;
    loop {
        made += 1;
        match op().await {
            Err(e) if e.is_retryable() && Instant::now() + backoff < until => {
                tracing::debug!(target: "pgfence::issuer", error = %e, attempt = made, "issuer call failed in transit; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(400));
            }
            result => return (result, made > 1),
        }
    }
}

/// The waiting acquire of the consensus-store and PostgreSQL issuers: calls `try_once` with one owner id
/// until it gets the lock or `wait` runs out (`Ok(None)`), sleeping [`wait_nap`] between tries
/// and waiting through retryable errors (a failover while waiting) up to the deadline.
pub(crate) async fn acquire_waiting<F, Fut>(
    ttl: Duration,
    wait: Duration,
    mut try_once: F,
) -> Result<Option<Lease>>
where
    F: FnMut(String) -> Fut,
    Fut: Future<Output = Result<std::result::Result<Lease, Duration>>>,
{
    check_ttl(ttl)?;
    let give_up = Instant::now() + wait;
    let owner = new_owner_id();
    let mut backoff = Duration::from_millis(10);
    loop {
        let retry_in = match try_once(owner.clone()).await {
            Ok(Ok(lease)) => return Ok(Some(lease)),
            Ok(Err(retry_in)) => retry_in,
            // The same owner id makes a retried acquire idempotent.
            Err(e) if e.is_retryable() && Instant::now() < give_up => Duration::ZERO,
            Err(e) => return Err(e),
        };
        let now = Instant::now();
        if now >= give_up {
            return Ok(None);
        }
        tokio::time::sleep(wait_nap(&mut backoff, retry_in, give_up - now)).await;
    }
}

/// Splits `host[:port][,host[:port]...]` into `host:port` entries (`default_port` where a
/// host names none; `[v6]` hosts keep their brackets). The reason when malformed.
#[cfg(any(feature = "etcd", feature = "zk"))]
pub(crate) fn host_list(
    hosts: &str,
    default_port: u16,
) -> std::result::Result<Vec<String>, &'static str> {
    let mut out = Vec::new();
    for host in hosts.split(',') {
        let host = host.trim();
        if host.is_empty() || host.contains(['/', '?', '@']) {
            return Err("empty or malformed host");
        }
        let has_port = match host.rsplit_once(':') {
            // `[::1]:2379` or `h:2379` have a port; a bare `[::1]` does not.
            Some((h, port)) if !h.is_empty() && !port.contains(']') => {
                port.parse::<u16>().map_err(|_| "bad port")?;
                true
            }
            Some(_) | None => false,
        };
        out.push(if has_port {
            host.to_owned()
        } else {
            format!("{host}:{default_port}")
        });
    }
    Ok(out)
}

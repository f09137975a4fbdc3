//! [`TokenIssuer`]: one interface over every issuer (Redis, etcd, ZooKeeper, PostgreSQL), and
//! [`IssuerKind`], which tells them apart (and reads which one a URL names).

use crate::error::InvalidInput;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use sqlx::PgPool;
use tokio::time::Instant;

use super::url::{EXPECTED_SCHEMES, scheme};
use super::{Lease, LeaseState, LockStatus, ReleaseOutcome};
use crate::{Error, Resource, Result};
#[cfg(doc)]
use crate::{RedisIssuer, connect_issuer, issuer::KeepAlive};

/// A boxed, `Send` future borrowing from `'a`: what [`TokenIssuer`]'s methods return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Which kind of issuer a [`TokenIssuer`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum IssuerKind {
    /// The [`RedisIssuer`] (standalone, cluster or sentinel): a per-resource counter that a
    /// failover or restart can send backwards; [`TokenIssuer::raise_floor`] reseeds it.
    Redis,
    /// The etcd issuer (`EtcdIssuer`, feature `etcd`): tokens are cluster revisions, which
    /// never go backwards; reseeding is a no-op.
    Etcd,
    /// The ZooKeeper issuer (`ZkIssuer`, feature `zk`): tokens are the zxids that created the
    /// lock nodes, which never go backwards; reseeding is a no-op.
    ZooKeeper,
    /// The PostgreSQL issuer ([`PgIssuer`](crate::issuer::PgIssuer)): a counter row that commits in
    /// the same WAL as the fences it protects; reseeding is a no-op.
    Postgres,
}

impl IssuerKind {
    /// `"redis"`, `"etcd"`, `"zk"` or `"postgres"`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            IssuerKind::Redis => "redis",
            IssuerKind::Etcd => "etcd",
            IssuerKind::ZooKeeper => "zk",
            IssuerKind::Postgres => "postgres",
        }
    }

    /// Whether this build of pgfence includes this issuer (Redis and PostgreSQL always; etcd
    /// with the `etcd` feature, ZooKeeper with the `zk` feature).
    #[must_use]
    pub fn is_built(self) -> bool {
        match self {
            IssuerKind::Redis | IssuerKind::Postgres => true,
            IssuerKind::Etcd => cfg!(feature = "etcd"),
            IssuerKind::ZooKeeper => cfg!(feature = "zk"),
        }
    }

    /// The issuer `url` names, by its scheme (whether or not this build includes it: see
    /// [`IssuerKind::is_built`]): `redis://`, `rediss://`, `redis+unix://`, `unix://`,
    /// `redis+sentinel://`, `rediss+sentinel://` → Redis; `etcd://`, `etcd+https://` → etcd;
    /// `zk://` → ZooKeeper; `postgres://`, `postgresql://` → PostgreSQL. The same table
    /// [`connect_issuer`] dispatches on, for code that must know the kind before connecting
    /// (a CLI giving Redis a floor source).
    ///
    /// # Errors
    /// [`InvalidInput::IssuerUrl`](crate::error::InvalidInput::IssuerUrl) without a scheme or with one no issuer handles; the message
    /// never repeats the URL (it may hold a password).
    pub fn of_url(url: &str) -> Result<Self> {
        match scheme(url).as_deref() {
            Some(
                "redis://" | "rediss://" | "redis+unix://" | "unix://" | "redis+sentinel://"
                | "rediss+sentinel://",
            ) => Ok(IssuerKind::Redis),
            Some("etcd://" | "etcd+https://") => Ok(IssuerKind::Etcd),
            // `zks://` and kin: ZooKeeper, which connecting refuses (`Error::TlsUnsupported`).
            Some(zk) if zk == "zk://" || crate::tls::is_zk_tls_url(zk) => Ok(IssuerKind::ZooKeeper),
            Some("postgres://" | "postgresql://") => Ok(IssuerKind::Postgres),
            Some(other) => Err(Error::Invalid(InvalidInput::IssuerUrl(format!(
                "unknown scheme {other:?}; expected {EXPECTED_SCHEMES}"
            )))),
            None => Err(Error::Invalid(InvalidInput::IssuerUrl(format!(
                "no scheme; expected {EXPECTED_SCHEMES}"
            )))),
        }
    }

    /// Whether this issuer's counter can go backwards (and so can be reseeded from Postgres):
    /// true for Redis, false for etcd, ZooKeeper and PostgreSQL.
    #[must_use]
    pub fn can_reseed(self) -> bool {
        self == IssuerKind::Redis
    }
}

impl std::fmt::Display for IssuerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What every token issuer does: hand out [`Lease`]s with fence tokens, release and extend
/// them owner-safely, report a lock's state, and (where the counter can go backwards) raise
/// the counter after a failover.
///
/// Implemented by [`RedisIssuer`] (any connection type), by [`PgIssuer`](crate::issuer::PgIssuer), by `EtcdIssuer` (feature
/// `etcd`) and by `ZkIssuer` (feature `zk`). The methods have the same names and meaning as the issuers' own methods, which
/// stay callable directly; this trait is for code that picks the issuer at run time
/// ([`connect_issuer`]) or must work with either ([`KeepAlive`](crate::issuer::KeepAlive)).
///
/// # Why object-safe, with boxed futures
///
/// The trait is used as `Arc<dyn TokenIssuer>` / `Box<dyn TokenIssuer>`: a CLI or a service
/// reads an issuer URL from its configuration and gets one value whose type does not depend
/// on the URL. `async fn` in traits would make the trait generic-only (not `dyn`-compatible)
/// and leaves the futures' `Send`-ness unstated, so every caller would have to be generic over
/// the issuer and every issuer combination monomorphised. The methods therefore return
/// [`BoxFuture`]s (`Pin<Box<dyn Future + Send>>`): one allocation per call, noise next to a
/// network round trip. Code that knows its issuer's type statically can keep calling the
/// concrete methods ([`RedisIssuer::acquire`] etc.), which are plain `async fn`s.
///
/// # Differences between issuers
///
/// * Redis tokens count per resource (or per fencing domain); etcd tokens are cluster-wide
///   revisions, ZooKeeper tokens ensemble-wide zxids. All are strictly increasing per
///   resource, which is all Postgres needs.
/// * etcd revisions and ZooKeeper zxids cannot go backwards: [`TokenIssuer::raise_floor`] and
///   [`TokenIssuer::recover_from`] do nothing there (they return the current revision or zxid
///   and `false`). See [`TokenIssuer::kind`] and [`IssuerKind::can_reseed`].
/// * etcd TTLs have whole-second resolution on the server; ZooKeeper TTLs are kept by the
///   issuer's process, and a dead process's locks end with its session.
///
/// ```no_run
/// # async fn f() -> pgfence::Result<()> {
/// use std::time::Duration;
/// // "redis://...", "redis+sentinel://...", "etcd://..." (feature `etcd`) or "zk://..."
/// // (feature `zk`): chosen by the URL.
/// let url = std::env::var("PGFENCE_ISSUER_URL").unwrap_or("redis://127.0.0.1:6379".into());
/// let issuer = pgfence::connect_issuer(&url).await?;
/// let resource = pgfence::Resource::new("payments:batch:42")?;
/// if let Some(lease) = issuer.acquire(&resource, Duration::from_secs(30)).await? {
///     // ... fenced writes with lease.token() ...
///     let outcome = issuer.release(&lease).await?;
///     if !outcome.is_released() {
///         eprintln!("the lease had already ended: {outcome}"); // expired or taken: no error
///     }
/// }
/// # Ok(()) }
/// ```
pub trait TokenIssuer: Send + Sync + std::fmt::Debug + 'static {
    /// Which issuer this is.
    fn kind(&self) -> IssuerKind;

    /// Tries once to take `resource`'s lock for `ttl`. `Ok(None)` when another owner holds
    /// it. See [`RedisIssuer::acquire`].
    fn acquire<'a>(
        &'a self,
        resource: &'a Resource,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<Lease>>>;

    /// Like [`TokenIssuer::acquire`] with a caller-chosen owner id (an idempotent retry);
    /// `Err(retry_in)` when another owner holds the lock. See [`RedisIssuer::acquire_as`].
    fn acquire_as<'a>(
        &'a self,
        resource: &'a Resource,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<std::result::Result<Lease, Duration>>>;

    /// Waits up to `wait` for the lock; `Ok(None)` when the wait ran out. See
    /// [`RedisIssuer::acquire_wait`].
    fn acquire_wait<'a>(
        &'a self,
        resource: &'a Resource,
        ttl: Duration,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Option<Lease>>>;

    /// Releases the lock if `lease` still holds it. See [`RedisIssuer::release`] and
    /// [`ReleaseOutcome`].
    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<ReleaseOutcome>>;

    /// Extends the lock to `ttl` from now if `lease` still holds it; [`LeaseState::Held`]
    /// means it still holds the lock, extended. See [`RedisIssuer::extend`].
    fn extend<'a>(
        &'a self,
        lease: &'a mut Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<LeaseState>>;

    /// [`TokenIssuer::extend`], re-sending after transport failures only until `until` (what
    /// [`KeepAlive`](crate::issuer::KeepAlive) uses, with the lease's local deadline). The default
    /// calls [`TokenIssuer::extend`].
    fn extend_until<'a>(
        &'a self,
        lease: &'a mut Lease,
        ttl: Duration,
        until: Instant,
    ) -> BoxFuture<'a, Result<LeaseState>> {
        let _ = until;
        self.extend(lease, ttl)
    }

    /// Reads `resource`'s lock and counter (for etcd, `counter` is the cluster's revision).
    fn status<'a>(&'a self, resource: &'a Resource) -> BoxFuture<'a, Result<LockStatus>>;

    /// Raises `resource`'s counter to at least `floor` and returns it afterwards. For etcd a
    /// no-op that returns the current revision (revisions never go backwards). See
    /// [`RedisIssuer::raise_floor`].
    fn raise_floor<'a>(&'a self, resource: &'a Resource, floor: i64) -> BoxFuture<'a, Result<i64>>;

    /// Recovery from a rejected write: raises the counter past the token the write met;
    /// whether it was raised. For etcd always `Ok(false)`. See [`RedisIssuer::recover_from`].
    fn recover_from<'a>(&'a self, err: &'a Error) -> BoxFuture<'a, Result<bool>>;

    /// Raises `resource`'s counter to the high-water mark Postgres recorded for it (under
    /// this issuer's key prefix: [`TokenIssuer::fencing_resource`]); the counter afterwards.
    /// See [`RedisIssuer::reseed`].
    fn reseed<'a>(
        &'a self,
        pool: &'a PgPool,
        resource: &'a Resource,
    ) -> BoxFuture<'a, Result<i64>> {
        Box::pin(async move {
            let mark = crate::admin::counter_floor(pool, &self.fencing_resource(resource)?).await?;
            self.raise_floor(resource, mark).await
        })
    }

    /// How long a resource's counter (and anything else the issuer keeps for it) outlives
    /// its last lease ([`RedisIssuer::with_idle_expiry`], [`PgIssuer::with_idle_expiry`](crate::issuer::PgIssuer::with_idle_expiry));
    /// `None`: kept for ever (the default, and always for etcd and ZooKeeper, which keep
    /// nothing per resource once its lock is gone). See `docs/issuers.md`, "Idle expiry".
    fn idle_expiry(&self) -> Option<Duration> {
        None
    }

    /// What the issuer keeps per resource, counted on its server: counters, locks, how many
    /// are idle ([`IssuerState`](crate::issuer::IssuerState)). `None` where the issuer does not
    /// count (Redis Cluster; an issuer outside this crate). `pgfence doctor` reports it.
    /// Bounded by the issuer's call bound, and at least 60 s (it reads every key or row of
    /// the key prefix).
    fn state(&self) -> BoxFuture<'_, Result<Option<super::idle::IssuerState>>> {
        Box::pin(async { Ok(None) })
    }

    /// The key prefix ([`RedisIssuer::with_key_prefix`]; the default is
    /// [`DEFAULT_KEY_PREFIX`](crate::issuer::DEFAULT_KEY_PREFIX), which this default method returns).
    fn key_prefix(&self) -> &str {
        crate::issuer::DEFAULT_KEY_PREFIX
    }

    /// The name PostgreSQL fences `resource` under for this issuer's leases (their
    /// [`Lease::fencing_resource`]): see [`Resource::in_key_prefix`]. The name whose marks
    /// [`crate::admin::high_water`] and [`crate::admin::counter_floor`] read for this issuer.
    ///
    /// # Errors
    /// [`InvalidInput::Resource`](crate::error::InvalidInput::Resource) when the name would be too long, or `resource` is already a
    /// key prefix's name.
    fn fencing_resource(&self, resource: &Resource) -> Result<Resource> {
        super::keys::fencing_name(self.key_prefix(), resource)
    }
}

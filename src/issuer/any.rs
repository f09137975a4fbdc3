//! [`TokenIssuer`]: one interface over every issuer (Redis, etcd, ZooKeeper), and [`connect_issuer`],
//! which picks one from a URL at run time.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionLike;
use sqlx::PgPool;
use tokio::time::Instant;

use super::{Issuer, Lease, LeaseState, LockStatus, ReleaseOutcome, check_key_prefix};
use crate::{Error, Resource, Result};

/// A boxed, `Send` future borrowing from `'a`: what [`TokenIssuer`]'s methods return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Which kind of issuer a [`TokenIssuer`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum IssuerKind {
    /// The Redis [`Issuer`] (standalone, cluster or sentinel): a per-resource counter that a
    /// failover or restart can send backwards; [`TokenIssuer::raise_floor`] reseeds it.
    Redis,
    /// The etcd issuer (`EtcdIssuer`, feature `etcd`): tokens are cluster revisions, which
    /// never go backwards; reseeding is a no-op.
    Etcd,
    /// The ZooKeeper issuer (`ZkIssuer`, feature `zk`): tokens are the zxids that created the
    /// lock nodes, which never go backwards; reseeding is a no-op.
    ZooKeeper,
    /// The PostgreSQL issuer ([`PgIssuer`](crate::PgIssuer)): a counter row that commits in
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
    /// [`Error::InvalidIssuerUrl`] without a scheme or with one no issuer handles; the message
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
            Some(other) => Err(Error::InvalidIssuerUrl(format!(
                "unknown scheme {other:?}; expected {EXPECTED_SCHEMES}"
            ))),
            None => Err(Error::InvalidIssuerUrl(format!(
                "no scheme; expected {EXPECTED_SCHEMES}"
            ))),
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
/// Implemented by the Redis [`Issuer`] (any connection type), by `EtcdIssuer` (feature
/// `etcd`) and by `ZkIssuer` (feature `zk`). The methods have the same names and meaning as the issuers' own methods, which
/// stay callable directly; this trait is for code that picks the issuer at run time
/// ([`connect_issuer`]) or must work with either ([`KeepAlive`](crate::KeepAlive)).
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
/// concrete methods ([`Issuer::acquire`] etc.), which are plain `async fn`s.
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
    /// it. See [`Issuer::acquire`].
    fn acquire<'a>(
        &'a self,
        resource: &'a Resource,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<Lease>>>;

    /// Like [`TokenIssuer::acquire`] with a caller-chosen owner id (an idempotent retry);
    /// `Err(retry_in)` when another owner holds the lock. See [`Issuer::acquire_as`].
    fn acquire_as<'a>(
        &'a self,
        resource: &'a Resource,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<std::result::Result<Lease, Duration>>>;

    /// Waits up to `wait` for the lock; `Ok(None)` when the wait ran out. See
    /// [`Issuer::acquire_wait`].
    fn acquire_wait<'a>(
        &'a self,
        resource: &'a Resource,
        ttl: Duration,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Option<Lease>>>;

    /// Releases the lock if `lease` still holds it. See [`Issuer::release`] and
    /// [`ReleaseOutcome`].
    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<ReleaseOutcome>>;

    /// Extends the lock to `ttl` from now if `lease` still holds it; [`LeaseState::Held`]
    /// means it still holds the lock, extended. See [`Issuer::extend`].
    fn extend<'a>(
        &'a self,
        lease: &'a mut Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<LeaseState>>;

    /// [`TokenIssuer::extend`], re-sending after transport failures only until `until` (what
    /// [`KeepAlive`](crate::KeepAlive) uses, with the lease's local deadline). The default
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
    /// [`Issuer::raise_floor`].
    fn raise_floor<'a>(&'a self, resource: &'a Resource, floor: i64) -> BoxFuture<'a, Result<i64>>;

    /// Recovery from a rejected write: raises the counter past the token the write met;
    /// whether it was raised. For etcd always `Ok(false)`. See [`Issuer::recover_from`].
    fn recover_from<'a>(&'a self, err: &'a Error) -> BoxFuture<'a, Result<bool>>;

    /// Raises `resource`'s counter to the high-water mark Postgres recorded for it (under
    /// this issuer's key prefix: [`TokenIssuer::fencing_resource`]); the counter afterwards.
    /// See [`Issuer::reseed`].
    fn reseed<'a>(
        &'a self,
        pool: &'a PgPool,
        resource: &'a Resource,
    ) -> BoxFuture<'a, Result<i64>> {
        Box::pin(async move {
            let mark = crate::counter_floor(pool, &self.fencing_resource(resource)?).await?;
            self.raise_floor(resource, mark).await
        })
    }

    /// The key prefix ([`Issuer::with_key_prefix`]; the default is
    /// [`DEFAULT_KEY_PREFIX`](crate::DEFAULT_KEY_PREFIX), which this default method returns).
    fn key_prefix(&self) -> &str {
        crate::DEFAULT_KEY_PREFIX
    }

    /// The name PostgreSQL fences `resource` under for this issuer's leases (their
    /// [`Lease::fencing_resource`]): see [`Resource::in_key_prefix`]. The name whose marks
    /// [`crate::high_water`] and [`crate::counter_floor`] read for this issuer.
    ///
    /// # Errors
    /// [`Error::InvalidResource`] when the name would be too long, or `resource` is already a
    /// key prefix's name.
    fn fencing_resource(&self, resource: &Resource) -> Result<Resource> {
        super::fencing_name(self.key_prefix(), resource)
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> TokenIssuer for Issuer<C> {
    fn kind(&self) -> IssuerKind {
        IssuerKind::Redis
    }

    fn key_prefix(&self) -> &str {
        Issuer::key_prefix(self)
    }

    fn acquire<'a>(
        &'a self,
        resource: &'a Resource,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<Lease>>> {
        Box::pin(Issuer::acquire(self, resource, ttl))
    }

    fn acquire_as<'a>(
        &'a self,
        resource: &'a Resource,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<std::result::Result<Lease, Duration>>> {
        Box::pin(Issuer::acquire_as(self, resource, owner, ttl))
    }

    fn acquire_wait<'a>(
        &'a self,
        resource: &'a Resource,
        ttl: Duration,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Option<Lease>>> {
        Box::pin(Issuer::acquire_wait(self, resource, ttl, wait))
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<ReleaseOutcome>> {
        Box::pin(Issuer::release(self, lease))
    }

    fn extend<'a>(
        &'a self,
        lease: &'a mut Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<LeaseState>> {
        Box::pin(Issuer::extend(self, lease, ttl))
    }

    fn extend_until<'a>(
        &'a self,
        lease: &'a mut Lease,
        ttl: Duration,
        until: Instant,
    ) -> BoxFuture<'a, Result<LeaseState>> {
        Box::pin(Issuer::extend_until(self, lease, ttl, until))
    }

    fn status<'a>(&'a self, resource: &'a Resource) -> BoxFuture<'a, Result<LockStatus>> {
        Box::pin(Issuer::status(self, resource))
    }

    fn raise_floor<'a>(&'a self, resource: &'a Resource, floor: i64) -> BoxFuture<'a, Result<i64>> {
        Box::pin(Issuer::raise_floor(self, resource, floor))
    }

    fn recover_from<'a>(&'a self, err: &'a Error) -> BoxFuture<'a, Result<bool>> {
        Box::pin(Issuer::recover_from(self, err))
    }

    fn reseed<'a>(
        &'a self,
        pool: &'a PgPool,
        resource: &'a Resource,
    ) -> BoxFuture<'a, Result<i64>> {
        Box::pin(Issuer::reseed(self, pool, resource))
    }
}

/// [`TokenIssuer`] for an issuer whose tokens never go backwards (etcd revisions, ZooKeeper
/// zxids, a PostgreSQL counter committed with the fences): the methods delegate to the
/// issuer's own; `raise_floor`, `recover_from` and `reseed` change nothing and report the
/// current counter (`raise_floor` still checks `floor` as the Redis issuer does).
macro_rules! never_backwards_issuer {
    ($ty:ty, $kind:expr) => {
        impl TokenIssuer for $ty {
            fn kind(&self) -> IssuerKind {
                $kind
            }

            fn key_prefix(&self) -> &str {
                <$ty>::key_prefix(self)
            }

            fn acquire<'a>(
                &'a self,
                resource: &'a Resource,
                ttl: Duration,
            ) -> BoxFuture<'a, Result<Option<Lease>>> {
                Box::pin(<$ty>::acquire(self, resource, ttl))
            }

            fn acquire_as<'a>(
                &'a self,
                resource: &'a Resource,
                owner: &'a str,
                ttl: Duration,
            ) -> BoxFuture<'a, Result<std::result::Result<Lease, Duration>>> {
                Box::pin(<$ty>::acquire_as(self, resource, owner, ttl))
            }

            fn acquire_wait<'a>(
                &'a self,
                resource: &'a Resource,
                ttl: Duration,
                wait: Duration,
            ) -> BoxFuture<'a, Result<Option<Lease>>> {
                Box::pin(<$ty>::acquire_wait(self, resource, ttl, wait))
            }

            fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<ReleaseOutcome>> {
                Box::pin(<$ty>::release(self, lease))
            }

            fn extend<'a>(
                &'a self,
                lease: &'a mut Lease,
                ttl: Duration,
            ) -> BoxFuture<'a, Result<LeaseState>> {
                Box::pin(<$ty>::extend(self, lease, ttl))
            }

            fn extend_until<'a>(
                &'a self,
                lease: &'a mut Lease,
                ttl: Duration,
                until: Instant,
            ) -> BoxFuture<'a, Result<LeaseState>> {
                Box::pin(<$ty>::extend_until(self, lease, ttl, until))
            }

            fn status<'a>(&'a self, resource: &'a Resource) -> BoxFuture<'a, Result<LockStatus>> {
                Box::pin(<$ty>::status(self, resource))
            }

            /// Tokens never go backwards: nothing to raise. Returns the current counter (after
            /// checking `floor` as the Redis issuer does).
            fn raise_floor<'a>(
                &'a self,
                resource: &'a Resource,
                floor: i64,
            ) -> BoxFuture<'a, Result<i64>> {
                Box::pin(async move {
                    if floor < 0 {
                        return Err(Error::InvalidToken(floor.to_string()));
                    }
                    Ok(<$ty>::status(self, resource).await?.counter)
                })
            }

            /// Tokens never go backwards: there is no counter to recover. Always `Ok(false)`.
            fn recover_from<'a>(&'a self, _err: &'a Error) -> BoxFuture<'a, Result<bool>> {
                Box::pin(async { Ok(false) })
            }

            /// A no-op (see [`TokenIssuer::raise_floor`]): returns the current counter without
            /// reading Postgres.
            fn reseed<'a>(
                &'a self,
                _pool: &'a PgPool,
                resource: &'a Resource,
            ) -> BoxFuture<'a, Result<i64>> {
                self.raise_floor(resource, 0)
            }
        }
    };
}

#[cfg(feature = "etcd")]
never_backwards_issuer!(super::EtcdIssuer, IssuerKind::Etcd);
#[cfg(feature = "zk")]
never_backwards_issuer!(super::ZkIssuer, IssuerKind::ZooKeeper);
never_backwards_issuer!(super::PgIssuer, IssuerKind::Postgres);

/// How [`connect_issuer_with`] sets up the issuer it connects.
#[derive(Clone, Debug, Default)]
pub struct IssuerOptions {
    key_prefix: Option<String>,
    floor_source: Option<PgPool>,
}

impl IssuerOptions {
    /// The defaults: key prefix `pgfence`, no floor source.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The key prefix ([`Issuer::with_key_prefix`]; for etcd, keys become
    /// `PREFIX/lock/R`; for ZooKeeper, nodes `/PREFIX/lock/R/...`). Checked when connecting.
    #[must_use]
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = Some(prefix.into());
        self
    }

    /// Recover a lost Redis counter from this database ([`Issuer::with_floor_source`]).
    /// Ignored by etcd, ZooKeeper and PostgreSQL, whose counters never go backwards.
    #[must_use]
    pub fn floor_source(mut self, pool: PgPool) -> Self {
        self.floor_source = Some(pool);
        self
    }
}

/// The issuer URL schemes, for error messages.
const EXPECTED_SCHEMES: &str = "redis://, rediss://, redis+sentinel://, rediss+sentinel://, etcd://, etcd+https://, zk://, postgres:// or postgresql://";

/// The scheme of `url`, lower-cased, with its `://` (`None` without one).
fn scheme(url: &str) -> Option<String> {
    url.find("://")
        .map(|i| url[..i + 3].to_ascii_lowercase())
        .filter(|s| {
            s[..s.len() - 3]
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
        })
}

/// Connects the issuer `url` names, with the default options (see [`connect_issuer_with`]).
///
/// # Errors
/// As [`connect_issuer_with`].
pub async fn connect_issuer(url: &str) -> Result<Arc<dyn TokenIssuer>> {
    connect_issuer_with(url, IssuerOptions::default()).await
}

/// Connects the issuer `url` names, chosen by its scheme:
///
/// * `redis://`, `rediss://` (TLS, feature `tls`), `redis+unix://`, `unix://`: the Redis
///   [`Issuer`] ([`Issuer::connect`]);
/// * `redis+sentinel://[user:password@]host:port[,host:port...]/master-name[/db]`, or
///   `rediss+sentinel://...` over TLS (feature `tls`): the Redis issuer through Redis Sentinel
///   ([`Issuer::connect_sentinel`]);
/// * `etcd://host:port[,host:port...]`, or `etcd+https://...` over TLS (features `etcd` and
///   `tls`): the etcd issuer;
/// * `zk://host:port[,host:port...][?session_timeout_ms=N]`: the ZooKeeper issuer (feature
///   `zk`; no TLS: `zks://` and the like fail with [`Error::TlsUnsupported`]);
/// * `postgres://...` or `postgresql://...`: the PostgreSQL issuer
///   ([`PgIssuer::connect`](crate::PgIssuer::connect)); the database needs pgfence's
///   migrations.
///
/// The TLS URLs take the query parameters `cacert=PATH`, `cert=PATH` and `key=PATH` (see
/// [`Issuer::connect`]).
///
/// # Errors
/// [`Error::IssuerNotBuilt`] for `etcd://` or `zk://` without the feature, and for a TLS
/// scheme without the `tls` feature; [`Error::TlsUnsupported`] for ZooKeeper over TLS;
/// [`Error::InvalidIssuerUrl`] for any other scheme; [`Error::InvalidKeyPrefix`];
/// [`Error::InvalidTls`] / [`Error::TlsFile`] for the TLS parameters; the issuer's
/// connection error ([`Error::Redis`], [`Error::RedisPermission`], `Error::Etcd`,
/// `Error::ZooKeeper`).
pub async fn connect_issuer_with(
    url: &str,
    options: IssuerOptions,
) -> Result<Arc<dyn TokenIssuer>> {
    if let Some(prefix) = &options.key_prefix {
        check_key_prefix(prefix)?;
    }
    let scheme = scheme(url);
    match scheme.as_deref() {
        Some("redis://" | "rediss://" | "redis+unix://" | "unix://") => {
            let mut issuer = Issuer::connect(url).await?;
            if let Some(prefix) = &options.key_prefix {
                issuer = issuer.with_key_prefix(prefix)?;
            }
            if let Some(pool) = options.floor_source {
                issuer = issuer.with_floor_source(pool);
            }
            Ok(Arc::new(issuer))
        }
        Some("redis+sentinel://" | "rediss+sentinel://") => {
            let mut issuer = Issuer::connect_sentinel(url).await?;
            if let Some(prefix) = &options.key_prefix {
                issuer = issuer.with_key_prefix(prefix)?;
            }
            if let Some(pool) = options.floor_source {
                issuer = issuer.with_floor_source(pool);
            }
            Ok(Arc::new(issuer))
        }
        #[cfg(feature = "etcd")]
        Some(super::ETCD_SCHEME | super::ETCD_TLS_SCHEME) => {
            let mut issuer = super::EtcdIssuer::connect(url).await?;
            if let Some(prefix) = &options.key_prefix {
                issuer = issuer.with_key_prefix(prefix)?;
            }
            Ok(Arc::new(issuer))
        }
        #[cfg(not(feature = "etcd"))]
        Some("etcd://" | "etcd+https://") => Err(Error::IssuerNotBuilt {
            scheme: "etcd://",
            feature: "etcd",
        }),
        Some(zk_tls) if crate::tls::is_zk_tls_url(zk_tls) => Err(crate::tls::zk_tls_unsupported()),
        #[cfg(feature = "zk")]
        Some(super::ZK_SCHEME) => {
            let mut issuer = super::ZkIssuer::connect(url).await?;
            if let Some(prefix) = &options.key_prefix {
                issuer = issuer.with_key_prefix(prefix)?;
            }
            Ok(Arc::new(issuer))
        }
        #[cfg(not(feature = "zk"))]
        Some("zk://") => Err(Error::IssuerNotBuilt {
            scheme: "zk://",
            feature: "zk",
        }),
        Some("postgres://" | "postgresql://") => {
            let mut issuer = super::PgIssuer::connect(url).await?;
            if let Some(prefix) = &options.key_prefix {
                issuer = issuer.with_key_prefix(prefix)?;
            }
            Ok(Arc::new(issuer))
        }
        Some(other) => Err(Error::InvalidIssuerUrl(format!(
            "unknown scheme {other:?}; expected {EXPECTED_SCHEMES}"
        ))),
        None => Err(Error::InvalidIssuerUrl(format!(
            "no scheme; expected {EXPECTED_SCHEMES}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes() {
        assert_eq!(scheme("REDIS://h:1").as_deref(), Some("redis://"));
        assert_eq!(
            scheme("redis+sentinel://h").as_deref(),
            Some("redis+sentinel://")
        );
        assert_eq!(scheme("etcd://a,b").as_deref(), Some("etcd://"));
        assert_eq!(scheme("zk://a,b").as_deref(), Some("zk://"));
        assert_eq!(
            scheme("Rediss+Sentinel://h").as_deref(),
            Some("rediss+sentinel://")
        );
        assert_eq!(scheme("etcd+https://a").as_deref(), Some("etcd+https://"));
        assert_eq!(scheme("not a url"), None);
        assert_eq!(scheme("a b://x"), None);
    }

    #[test]
    fn kinds_of_urls() {
        for (url, kind) in [
            ("REDIS://h:1", IssuerKind::Redis),
            ("rediss+sentinel://h/m", IssuerKind::Redis),
            ("unix:///tmp/r.sock", IssuerKind::Redis),
            ("etcd+https://a,b", IssuerKind::Etcd),
            ("zk://a", IssuerKind::ZooKeeper),
            ("zks://a", IssuerKind::ZooKeeper),
            ("postgresql://h/db", IssuerKind::Postgres),
        ] {
            assert_eq!(IssuerKind::of_url(url).unwrap(), kind, "{url}");
        }
        for bad in [":hunter2@h:6379", "mysql://u:hunter2@h/db", ""] {
            let err = IssuerKind::of_url(bad).unwrap_err().to_string();
            assert!(err.contains("invalid issuer URL"), "{err}");
            assert!(!err.contains("hunter2"), "{err}");
        }
    }

    #[tokio::test]
    async fn rejects_unknown_schemes_and_bad_prefixes() {
        let err = connect_issuer("nope://x").await.unwrap_err();
        assert!(matches!(err, Error::InvalidIssuerUrl(_)), "{err}");
        let err = connect_issuer("").await.unwrap_err();
        assert!(matches!(err, Error::InvalidIssuerUrl(_)), "{err}");
        let err = connect_issuer_with(
            "redis://127.0.0.1:1",
            IssuerOptions::new().key_prefix("a b"),
        )
        .await
        .unwrap_err();
        assert!(matches!(err, Error::InvalidKeyPrefix(_)), "{err}");
        #[cfg(not(feature = "etcd"))]
        {
            let err = connect_issuer("etcd://127.0.0.1:2379").await.unwrap_err();
            assert!(matches!(err, Error::IssuerNotBuilt { .. }), "{err}");
            assert!(err.to_string().contains("`etcd` feature"), "{err}");
        }
        #[cfg(not(feature = "zk"))]
        {
            let err = connect_issuer("zk://127.0.0.1:2181").await.unwrap_err();
            assert!(matches!(err, Error::IssuerNotBuilt { .. }), "{err}");
        }
        // With or without the zk feature: ZooKeeper over TLS is refused, saying why.
        for zk_tls in ["zks://127.0.0.1:2281", "zk+tls://127.0.0.1:2281"] {
            let err = connect_issuer(zk_tls).await.unwrap_err();
            assert!(matches!(err, Error::TlsUnsupported { .. }), "{err}");
        }
    }

    #[tokio::test]
    async fn tls_urls_are_routed_and_checked_before_connecting() {
        // Nothing listens on port 1: each of these fails before any connection is tried.
        let err = connect_issuer("redis://127.0.0.1:1?cacert=/ca.pem")
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidTls(_)), "{err}");
        let err = connect_issuer("redis+sentinel://127.0.0.1:1/m?cacert=/ca.pem")
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidTls(_)), "{err}");
        assert!(err.to_string().contains("rediss+sentinel://"), "{err}");
        for url in [
            "rediss://127.0.0.1:1?cert=/c.pem",
            "rediss+sentinel://127.0.0.1:1/m?key=/k.pem",
        ] {
            let err = connect_issuer(url).await.unwrap_err();
            assert!(matches!(err, Error::InvalidTls(_)), "{url}: {err}");
        }
        #[cfg(feature = "tls")]
        {
            let missing = "/nonexistent/pgfence-ca.pem";
            for url in [
                format!("rediss://127.0.0.1:1?cacert={missing}"),
                format!("rediss+sentinel://127.0.0.1:1/m?cacert={missing}"),
            ] {
                let err = connect_issuer(&url).await.unwrap_err();
                assert!(
                    matches!(
                        &err,
                        Error::TlsFile {
                            param: "cacert",
                            ..
                        }
                    ),
                    "{url}: {err}"
                );
                assert!(err.to_string().contains(missing), "{err}");
            }
        }
        #[cfg(not(feature = "tls"))]
        for (url, scheme) in [
            ("rediss://127.0.0.1:1", "rediss://"),
            ("rediss+sentinel://127.0.0.1:1/m", "rediss+sentinel://"),
        ] {
            let err = connect_issuer(url).await.unwrap_err();
            assert!(
                matches!(err, Error::IssuerNotBuilt { scheme: s, feature: "tls" } if s == scheme),
                "{url}: {err}"
            );
            assert!(err.to_string().contains("`tls` feature"), "{err}");
        }
        #[cfg(all(feature = "etcd", not(feature = "tls")))]
        {
            let err = connect_issuer("etcd+https://127.0.0.1:1")
                .await
                .unwrap_err();
            assert!(
                matches!(err, Error::IssuerNotBuilt { feature: "tls", .. }),
                "{err}"
            );
        }
    }
}

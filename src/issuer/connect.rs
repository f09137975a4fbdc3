//! [`connect_issuer`]: the issuer a URL names, picked at run time.

use std::sync::Arc;

use sqlx::PgPool;

use super::keys::check_key_prefix;
use super::token_issuer::{IssuerKind, TokenIssuer};
use super::{PgIssuer, RedisIssuer};
#[cfg(any(doc, not(feature = "etcd"), not(feature = "zk")))]
use crate::Error;
use crate::Result;

/// How [`connect_issuer_with`] sets up the issuer it connects.
#[derive(Clone, Debug, Default)]
pub struct IssuerOptions {
    key_prefix: Option<String>,
    floor_source: Option<PgPool>,
    call_timeout: Option<std::time::Duration>,
    idle_expiry: Option<std::time::Duration>,
}

impl IssuerOptions {
    /// The defaults: key prefix `pgfence`, no floor source, the call bound
    /// [`DEFAULT_CALL_TIMEOUT`](crate::issuer::DEFAULT_CALL_TIMEOUT).
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The key prefix ([`RedisIssuer::with_key_prefix`]; for etcd, keys become
    /// `PREFIX/lock/R`; for ZooKeeper, nodes `/PREFIX/lock/R/...`). Checked when connecting.
    #[must_use]
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = Some(prefix.into());
        self
    }

    /// Recover a lost Redis counter from this database ([`RedisIssuer::with_floor_source`]).
    /// Ignored by etcd, ZooKeeper and PostgreSQL, whose counters never go backwards.
    #[must_use]
    pub fn floor_source(mut self, pool: PgPool) -> Self {
        self.floor_source = Some(pool);
        self
    }

    /// The bound of every call of the issuer, re-sends included (each issuer's
    /// `with_call_timeout`, such as [`RedisIssuer::with_call_timeout`]; `docs/issuers.md`, "Time
    /// bounds").
    #[must_use]
    pub fn call_timeout(mut self, bound: std::time::Duration) -> Self {
        self.call_timeout = Some(bound);
        self
    }

    /// Idle issuer state expires after `idle` ([`RedisIssuer::with_idle_expiry`],
    /// [`PgIssuer::with_idle_expiry`]); checked when connecting. Ignored by etcd and
    /// ZooKeeper, which keep nothing per resource once its lock is gone. See
    /// `docs/issuers.md`, "Idle expiry".
    #[must_use]
    pub fn idle_expiry(mut self, idle: std::time::Duration) -> Self {
        self.idle_expiry = Some(idle);
        self
    }
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
///   [`RedisIssuer`] ([`RedisIssuer::connect`]);
/// * `redis+sentinel://[user:password@]host:port[,host:port...]/master-name[/db]`, or
///   `rediss+sentinel://...` over TLS (feature `tls`): the Redis issuer through Redis Sentinel
///   ([`RedisIssuer::connect_sentinel`]);
/// * `etcd://host:port[,host:port...]`, or `etcd+https://...` over TLS (features `etcd` and
///   `tls`): the etcd issuer;
/// * `zk://host:port[,host:port...][?session_timeout_ms=N]`: the ZooKeeper issuer (feature
///   `zk`; no TLS: `zks://` and the like fail with [`Error::TlsUnsupported`]);
/// * `postgres://...` or `postgresql://...`: the PostgreSQL issuer
///   ([`PgIssuer::connect`](crate::issuer::PgIssuer::connect)); the database needs pgfence's
///   migrations.
///
/// The TLS URLs take the query parameters `cacert=PATH`, `cert=PATH` and `key=PATH` (see
/// [`RedisIssuer::connect`]).
///
/// # Errors
/// [`Error::IssuerNotBuilt`] for `etcd://` or `zk://` without the feature, and for a TLS
/// scheme without the `tls` feature; [`Error::TlsUnsupported`] for ZooKeeper over TLS;
/// [`InvalidInput::IssuerUrl`](crate::error::InvalidInput::IssuerUrl) for any other scheme; [`InvalidInput::KeyPrefix`](crate::error::InvalidInput::KeyPrefix);
/// [`InvalidInput::Tls`](crate::error::InvalidInput::Tls) / [`InvalidInput::TlsFile`](crate::error::InvalidInput::TlsFile) for the TLS parameters; the issuer's
/// connection error ([`Error::Backend`](crate::Error::Backend), [`Error::RedisPermission`], [`Error::Backend`](crate::Error::Backend),
/// [`Error::Backend`](crate::Error::Backend)).
pub async fn connect_issuer_with(
    url: &str,
    options: IssuerOptions,
) -> Result<Arc<dyn TokenIssuer>> {
    if let Some(prefix) = &options.key_prefix {
        check_key_prefix(prefix)?;
    }
    if let Some(idle) = options.idle_expiry {
        super::check_idle_expiry(idle)?;
    }
    let prefix = options.key_prefix.as_deref();
    match IssuerKind::of_url(url)? {
        IssuerKind::Redis if super::redis::is_sentinel_url(url) => {
            redis_with(RedisIssuer::connect_sentinel(url).await?, options)
        }
        IssuerKind::Redis => redis_with(RedisIssuer::connect(url).await?, options),
        #[cfg(feature = "etcd")]
        IssuerKind::Etcd => {
            let issuer = super::EtcdIssuer::connect(url).await?;
            let issuer = match options.call_timeout {
                Some(bound) => issuer.with_call_timeout(bound),
                None => issuer,
            };
            Ok(Arc::new(prefixed(issuer, prefix, |i, p| {
                i.with_key_prefix(p)
            })?))
        }
        #[cfg(not(feature = "etcd"))]
        IssuerKind::Etcd => Err(Error::IssuerNotBuilt {
            scheme: "etcd://",
            feature: "etcd",
        }),
        // `zks://` and kin, with or without the feature: refused, saying why.
        IssuerKind::ZooKeeper if crate::tls::is_zk_tls_url(url) => {
            Err(crate::tls::zk_tls_unsupported())
        }
        #[cfg(feature = "zk")]
        IssuerKind::ZooKeeper => {
            let issuer = super::ZkIssuer::connect(url).await?;
            let issuer = match options.call_timeout {
                Some(bound) => issuer.with_call_timeout(bound),
                None => issuer,
            };
            Ok(Arc::new(prefixed(issuer, prefix, |i, p| {
                i.with_key_prefix(p)
            })?))
        }
        #[cfg(not(feature = "zk"))]
        IssuerKind::ZooKeeper => Err(Error::IssuerNotBuilt {
            scheme: "zk://",
            feature: "zk",
        }),
        IssuerKind::Postgres => {
            let issuer = PgIssuer::connect(url).await?;
            let issuer = match options.call_timeout {
                Some(bound) => issuer.with_call_timeout(bound),
                None => issuer,
            };
            let issuer = match options.idle_expiry {
                Some(idle) => issuer.with_idle_expiry(idle)?,
                None => issuer,
            };
            Ok(Arc::new(prefixed(issuer, prefix, |i, p| {
                i.with_key_prefix(p)
            })?))
        }
    }
}

/// `issuer` under `prefix`, when one is given.
fn prefixed<I>(issuer: I, prefix: Option<&str>, with: fn(I, &str) -> Result<I>) -> Result<I> {
    match prefix {
        Some(prefix) => with(issuer, prefix),
        None => Ok(issuer),
    }
}

/// A Redis issuer (standalone or through Sentinel) with `options`' prefix and floor source.
fn redis_with<C>(issuer: RedisIssuer<C>, options: IssuerOptions) -> Result<Arc<dyn TokenIssuer>>
where
    C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
{
    let mut issuer = prefixed(issuer, options.key_prefix.as_deref(), |i, p| {
        i.with_key_prefix(p)
    })?;
    if let Some(pool) = options.floor_source {
        issuer = issuer.with_floor_source(pool);
    }
    if let Some(bound) = options.call_timeout {
        issuer = issuer.with_call_timeout(bound);
    }
    if let Some(idle) = options.idle_expiry {
        issuer = issuer.with_idle_expiry(idle)?;
    }
    Ok(Arc::new(issuer))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use crate::error::InvalidInput;

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
        assert!(
            matches!(err, Error::Invalid(InvalidInput::IssuerUrl(_))),
            "{err}"
        );
        let err = connect_issuer("").await.unwrap_err();
        assert!(
            matches!(err, Error::Invalid(InvalidInput::IssuerUrl(_))),
            "{err}"
        );
        let err = connect_issuer_with(
            "redis://127.0.0.1:1",
            IssuerOptions::new().key_prefix("a b"),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(err, Error::Invalid(InvalidInput::KeyPrefix(_))),
            "{err}"
        );
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

    /// A malformed URL is the same error whatever the issuer, and never echoes the password.
    /// Nothing listens on these ports: each fails while parsing, before connecting.
    #[tokio::test]
    async fn malformed_urls_are_one_error_for_every_issuer() {
        let mut bad = vec![
            "redis://:hunter2@127.0.0.1:notaport",
            "redis://:hunter2@[::1",
            "redis+sentinel://:hunter2@127.0.0.1:1",
            "redis+sentinel://:hunter2@127.0.0.1:x/m",
            "redis+sentinel:///m",
            "postgres://u:hunter2@127.0.0.1:notaport/db",
            "nope://u:hunter2@h",
        ];
        if cfg!(feature = "etcd") {
            bad.extend(["etcd://", "etcd://u:hunter2@127.0.0.1:x", "etcd://h:1?x=1"]);
        }
        if cfg!(feature = "zk") {
            bad.extend(["zk://", "zk://127.0.0.1:x"]);
        }
        for url in bad {
            let err = connect_issuer(url).await.unwrap_err();
            assert!(
                matches!(err, Error::Invalid(InvalidInput::IssuerUrl(_))),
                "{url}: {err:?}"
            );
            assert_eq!(err.kind(), crate::error::ErrorKind::Invalid, "{url}");
            assert!(!err.to_string().contains("hunter2"), "{url}: {err}");
        }
        // A Redis Cluster node list goes through the same check.
        let nodes = [
            "redis://127.0.0.1:x".to_owned(),
            "redis://127.0.0.1:2".into(),
        ];
        let err = crate::RedisIssuer::connect_cluster(&nodes)
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::Invalid(InvalidInput::IssuerUrl(_))),
            "{err:?}"
        );
        // With TLS certificates too: the URL is checked before them (this PEM decodes but is
        // no certificate, so building a client with it would fail on its own).
        #[cfg(feature = "tls")]
        {
            let pem = std::env::temp_dir().join(format!("pgfence-ca-{}.pem", std::process::id()));
            std::fs::write(
                &pem,
                "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
            )
            .unwrap();
            let ca = pem.display();
            let url = format!("rediss://:hunter2@127.0.0.1:notaport?cacert={ca}");
            let err = connect_issuer(&url).await.unwrap_err();
            assert!(
                matches!(err, Error::Invalid(InvalidInput::IssuerUrl(_))),
                "{url}: {err:?}"
            );
            assert!(!err.to_string().contains("hunter2"), "{err}");
            let nodes = [
                format!("rediss://127.0.0.1:x?cacert={ca}"),
                "rediss://127.0.0.1:2".into(),
            ];
            let err = crate::RedisIssuer::connect_cluster(&nodes)
                .await
                .unwrap_err();
            assert!(
                matches!(err, Error::Invalid(InvalidInput::IssuerUrl(_))),
                "{err:?}"
            );
            std::fs::remove_file(&pem).unwrap();
        }
    }

    #[tokio::test]
    async fn tls_urls_are_routed_and_checked_before_connecting() {
        // Nothing listens on port 1: each of these fails before any connection is tried.
        let err = connect_issuer("redis://127.0.0.1:1?cacert=/ca.pem")
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Invalid(InvalidInput::Tls(_))), "{err}");
        let err = connect_issuer("redis+sentinel://127.0.0.1:1/m?cacert=/ca.pem")
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Invalid(InvalidInput::Tls(_))), "{err}");
        assert!(err.to_string().contains("rediss+sentinel://"), "{err}");
        for url in [
            "rediss://127.0.0.1:1?cert=/c.pem",
            "rediss+sentinel://127.0.0.1:1/m?key=/k.pem",
        ] {
            let err = connect_issuer(url).await.unwrap_err();
            assert!(
                matches!(err, Error::Invalid(InvalidInput::Tls(_))),
                "{url}: {err}"
            );
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
                        Error::Invalid(InvalidInput::TlsFile {
                            param: "cacert",
                            ..
                        })
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

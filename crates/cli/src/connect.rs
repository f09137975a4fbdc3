//! Connections to the servers, and taking a lock on one.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use pgfence::{Issuer, IssuerOptions, Lease, Resource, TokenIssuer};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};
use tokio::time::Instant;

use crate::cli::Conn;
use crate::util::{cell, fmt_duration, redact};

/// How long establishing a connection may take before the command gives up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a pool checkout may wait (the CLI's pool is small and lightly used).
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(2);

impl Conn {
    /// The PostgreSQL URL, or an error saying how to give one.
    pub fn database_url(&self) -> Result<&str> {
        self.database_url
            .as_deref()
            .filter(|u| !u.is_empty())
            .context("no PostgreSQL URL: pass --database-url or set DATABASE_URL")
    }

    /// The issuer URL (`--issuer-url` / `PGFENCE_ISSUER_URL`, else the Redis URL), or an
    /// error saying how to give one.
    pub fn issuer_url(&self) -> Result<&str> {
        match self.issuer_url.as_deref().filter(|u| !u.is_empty()) {
            Some(url) => Ok(url),
            None => self.redis_url.as_deref().filter(|u| !u.is_empty()).context(
                "no issuer URL: pass --issuer-url (or --redis-url), or set PGFENCE_ISSUER_URL (or REDIS_URL)",
            ),
        }
    }

    /// The key prefix (`--key-prefix` / `PGFENCE_KEY_PREFIX`), checked; `None` for the
    /// default.
    pub fn key_prefix(&self) -> Result<Option<&str>> {
        match self.key_prefix.as_deref() {
            None => Ok(None),
            Some(prefix) => Ok(Some(
                pgfence::check_key_prefix(prefix)
                    .context("bad --key-prefix / PGFENCE_KEY_PREFIX")?,
            )),
        }
    }

    fn issuer_options(&self) -> Result<IssuerOptions> {
        Ok(match self.key_prefix()? {
            Some(prefix) => IssuerOptions::new().key_prefix(prefix),
            None => IssuerOptions::new(),
        })
    }

    /// A small pool on the configured PostgreSQL.
    pub async fn pg(&self) -> Result<PgPool> {
        connect_pg(self.database_url()?).await
    }

    /// A pool on the configured PostgreSQL, which must have pgfence's schema.
    pub async fn pg_migrated(&self) -> Result<PgPool> {
        let pool = self.pg().await?;
        require_schema(&pool).await?;
        Ok(pool)
    }

    /// The configured issuer (Redis, etcd or ZooKeeper, by the URL's scheme), with the key
    /// prefix.
    pub async fn issuer(&self) -> Result<Arc<dyn TokenIssuer>> {
        connect_issuer(self.issuer_url()?, self.issuer_options()?).await
    }

    /// An issuer for taking locks: for Redis, when a PostgreSQL URL is configured, it
    /// recovers a lost counter by itself ([`Issuer::with_floor_source`]): a lease taken on a
    /// missing counter gets a token above the resource's high-water mark. Without a
    /// reachable, migrated database it says so on stderr and issues tokens from Redis alone
    /// (safety does not depend on it: Postgres still rejects old tokens). etcd, ZooKeeper and
    /// the PostgreSQL issuer need no floor (their counters never go backwards).
    pub async fn lock_issuer(&self) -> Result<Arc<dyn TokenIssuer>> {
        let url = self.issuer_url()?;
        if consensus_store(url).is_some() {
            return self.issuer().await;
        }
        let prefix = self.key_prefix()?;
        if !is_plain_redis(url) {
            // Redis Sentinel: the floor source is given when connecting.
            let options = self.issuer_options()?;
            let options = match self.floor().await {
                Some(pool) => options.floor_source(pool),
                None => options,
            };
            return connect_issuer(url, options).await;
        }
        let mut issuer = connect_redis(url).await?;
        if let Some(prefix) = prefix {
            issuer = issuer.with_key_prefix(prefix)?;
        }
        Ok(match self.floor().await {
            Some(pool) => Arc::new(issuer.with_floor_source(pool)),
            None => Arc::new(issuer),
        })
    }

    /// The migrated database to recover a lost Redis counter from, when one is configured;
    /// says on stderr when it is configured but cannot be used.
    async fn floor(&self) -> Option<PgPool> {
        let url = self.database_url().ok()?;
        let floor = async {
            let pool = connect_pg(url).await?;
            require_schema(&pool).await?;
            anyhow::Ok(pool)
        };
        match floor.await {
            Ok(pool) => Some(pool),
            Err(e) => {
                eprintln!(
                    "pgfence: warning: a lost Redis counter cannot be recovered from PostgreSQL ({})",
                    crate::util::one_line(&e)
                );
                None
            }
        }
    }
}

/// A small pool on PostgreSQL at `url`. One connection is made first, directly, so that a
/// refused or failed connection reports its real cause at once (a pool keeps retrying a
/// refused connection until its timeout and then only says that it timed out).
pub async fn connect_pg(url: &str) -> Result<PgPool> {
    let context = || format!("cannot connect to PostgreSQL at {}", redact(url));
    let options = PgConnectOptions::from_str(url).with_context(context)?;
    let probe = tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(&options))
        .await
        .map_err(|_| anyhow!("timed out after {}", fmt_duration(CONNECT_TIMEOUT)))
        .and_then(|r| r.map_err(anyhow::Error::from))
        .with_context(context)?;
    let _ = probe.close().await;
    PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect_with(options)
        .await
        .with_context(context)
}

/// Fails with "run `pgfence migrate`" when the database has no `pgfence` schema.
pub async fn require_schema(pool: &PgPool) -> Result<()> {
    let present: bool = sqlx::query_scalar("SELECT to_regnamespace('pgfence') IS NOT NULL")
        .fetch_one(pool)
        .await
        .context("cannot read the catalog")?;
    if !present {
        bail!("this database has no pgfence schema: run `pgfence migrate` first");
    }
    Ok(())
}

/// Whether `url` names a standalone Redis (`redis://`, `rediss://`, a Unix socket) rather than
/// etcd or Redis Sentinel: the issuer the CLI builds itself, to give it a floor source.
pub fn is_plain_redis(url: &str) -> bool {
    let lower = url.get(..16).unwrap_or(url).to_ascii_lowercase();
    ["redis://", "rediss://", "redis+unix://", "unix://"]
        .iter()
        .any(|s| lower.starts_with(s))
        // Not a URL the issuer selector understands: let Redis say what is wrong with it.
        || !lower.contains("://")
}

/// The issuer other than Redis that `url` names (`etcd://`, `zk://`, `postgres://`), if it
/// names one: an issuer whose counter never goes backwards, which needs no floor source.
fn consensus_store(url: &str) -> Option<&'static str> {
    let scheme = url.split_once("://")?.0.to_ascii_lowercase();
    match scheme.as_str() {
        "etcd" => Some("etcd"),
        "zk" => Some("ZooKeeper"),
        "postgres" | "postgresql" => Some("PostgreSQL"),
        _ => None,
    }
}

/// The issuer `url` names ([`pgfence::connect_issuer_with`]), giving up after a few seconds.
pub async fn connect_issuer(url: &str, options: IssuerOptions) -> Result<Arc<dyn TokenIssuer>> {
    let what = consensus_store(url).unwrap_or("Redis");
    match tokio::time::timeout(CONNECT_TIMEOUT, pgfence::connect_issuer_with(url, options)).await {
        Ok(Ok(issuer)) => Ok(issuer),
        // Not a connection problem: say what to do.
        Ok(Err(e @ pgfence::Error::IssuerNotBuilt { feature, .. })) => Err(anyhow!(
            "{e} (for this command: cargo install pgfence-cli --features {feature})"
        )),
        Ok(Err(e)) => Err(anyhow::Error::from(e))
            .with_context(|| format!("cannot connect to {what} at {}", redact(url))),
        Err(_) => Err(anyhow!("timed out after {}", fmt_duration(CONNECT_TIMEOUT)))
            .with_context(|| format!("cannot connect to {what} at {}", redact(url))),
    }
}

/// An issuer on Redis at `url`, giving up after a few seconds.
pub async fn connect_redis(url: &str) -> Result<Issuer> {
    tokio::time::timeout(CONNECT_TIMEOUT, Issuer::connect(url))
        .await
        .map_err(|_| anyhow!("timed out after {}", fmt_duration(CONNECT_TIMEOUT)))
        .and_then(|r| r.map_err(anyhow::Error::from))
        .with_context(|| format!("cannot connect to Redis at {}", redact(url)))
}

/// Backoff between attempts while waiting: 10 ms doubling to 500 ms, jittered.
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_millis(500);

/// Takes `resource`'s lock, waiting up to `wait` if given; fails if another holder keeps it,
/// saying who and for how long.
///
/// The wait is this loop rather than [`Issuer::acquire_wait`]: that one never sleeps past the
/// holder's remaining TTL, which Redis reports as nothing (PTTL -1) for a lock key without an
/// expiry, and so polls it about every millisecond. Here the backoff only shortens to a
/// positive remaining TTL, and a lock that will never expire is reported.
pub async fn take_lock(
    issuer: &dyn TokenIssuer,
    resource: &Resource,
    ttl: Duration,
    wait: Option<Duration>,
) -> Result<Lease> {
    pgfence::check_ttl(ttl)?;
    let started = Instant::now();
    let give_up = wait.map(|w| started.checked_add(w).unwrap_or_else(far_future));
    let owner = pgfence::new_owner_id();
    let mut backoff = FIRST_BACKOFF;
    let mut warned = false;
    loop {
        let retry_in = match issuer.acquire_as(resource, &owner, ttl).await? {
            Ok(lease) => return Ok(lease),
            Err(retry_in) => retry_in,
        };
        let now = Instant::now();
        let Some(give_up) = give_up.filter(|g| now < *g) else {
            return Err(held_error(issuer, resource, wait.map(|_| now - started)).await);
        };
        if retry_in.is_zero() && !warned {
            warned = true;
            if let Ok(status) = issuer.status(resource).await
                && status.ttl_ms == Some(-1)
            {
                eprintln!(
                    "pgfence: warning: the lock on {} has no expiry (its key was set outside pgfence?); it will not free itself",
                    cell(resource.as_str())
                );
            }
        }
        let jittered = backoff.mul_f64(0.5 + rand::random::<f64>() / 2.0);
        let mut nap = jittered.min(give_up - now);
        if !retry_in.is_zero() {
            // The holder's lease ends sooner: try again right then.
            nap = nap.min(retry_in.max(Duration::from_millis(1)));
        }
        tokio::time::sleep(nap).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// About thirty years from now: a deadline that is never reached.
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400 * 365 * 30)
}

/// "R is locked by another holder: held by OWNER (token N), for another N ms".
async fn held_error(
    issuer: &dyn TokenIssuer,
    resource: &Resource,
    waited: Option<Duration>,
) -> anyhow::Error {
    let name = cell(resource.as_str());
    let mut msg = match waited {
        Some(w) => format!(
            "{name} is locked by another holder (still after waiting {})",
            fmt_duration(w)
        ),
        None => format!("{name} is locked by another holder"),
    };
    if let Ok(status) = issuer.status(resource).await
        && let Some(owner) = &status.owner
    {
        let token = status
            .token
            .map(|t| format!(" (token {t})"))
            .unwrap_or_default();
        let until = match status.ttl_ms {
            Some(ms) if ms >= 0 => format!("for another {ms} ms"),
            _ => "with no expiry (the key was set without a TTL)".to_owned(),
        };
        msg.push_str(&format!(": held by {}{token}, {until}", cell(owner)));
    }
    anyhow!(msg)
}

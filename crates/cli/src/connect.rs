//! Connections to the servers, and taking a lock on one.

use std::time::Duration;

use anyhow::{Context, Result};
use pgfence::{Issuer, Lease, Resource};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::cli::Conn;
use crate::util::{cell, redact};

impl Conn {
    /// The PostgreSQL URL, or an error saying how to give one.
    pub fn database_url(&self) -> Result<&str> {
        self.database_url
            .as_deref()
            .filter(|u| !u.is_empty())
            .context("no PostgreSQL URL: pass --database-url or set DATABASE_URL")
    }

    /// The Redis URL, or an error saying how to give one.
    pub fn redis_url(&self) -> Result<&str> {
        self.redis_url
            .as_deref()
            .filter(|u| !u.is_empty())
            .context("no Redis URL: pass --redis-url or set REDIS_URL")
    }

    /// A small pool on the configured PostgreSQL.
    pub async fn pg(&self) -> Result<PgPool> {
        connect_pg(self.database_url()?).await
    }

    /// An issuer on the configured Redis.
    pub async fn issuer(&self) -> Result<Issuer> {
        connect_redis(self.redis_url()?).await
    }
}

/// A small pool on PostgreSQL at `url`.
pub async fn connect_pg(url: &str) -> Result<PgPool> {
    PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .with_context(|| format!("cannot connect to PostgreSQL at {}", redact(url)))
}

/// An issuer on Redis at `url`, giving up after ten seconds.
pub async fn connect_redis(url: &str) -> Result<Issuer> {
    tokio::time::timeout(Duration::from_secs(10), Issuer::connect(url))
        .await
        .map_err(|_| anyhow::anyhow!("timed out"))
        .and_then(|r| r.map_err(anyhow::Error::from))
        .with_context(|| format!("cannot connect to Redis at {}", redact(url)))
}

/// Takes `resource`'s lock, waiting up to `wait` if given; fails if another holder keeps it.
pub async fn take_lock(
    issuer: &Issuer,
    resource: &Resource,
    ttl: Duration,
    wait: Option<Duration>,
) -> Result<Lease> {
    let lease = match wait {
        Some(wait) => issuer.acquire_wait(resource, ttl, wait).await?,
        None => issuer.acquire(resource, ttl).await?,
    };
    lease.with_context(|| format!("{} is locked by another holder", cell(resource.as_str())))
}

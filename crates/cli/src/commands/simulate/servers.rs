//! The servers the race runs on (the configured ones, or throwaway ones), the demo table and
//! lock set up on them, and the cleanup afterwards.

use std::sync::Arc;

use anyhow::{Context, Result};
use pgfence::{Repository, Resource, TokenIssuer, issuer::PgIssuer, table::TableName};
use pgfence_testkit::{Kind, Server, ServerError, url_or_start};
use sqlx::AssertSqlSafe;

use super::events::Recorder;
use super::race::Stage;
use super::render::Narrator;
use crate::cli::Conn;
use crate::connect::{connect_issuer, connect_pg, connect_redis, is_plain_redis};
use crate::util;

/// The servers' URLs, and the throwaway servers among them, which live as long as this.
pub struct Servers {
    /// PostgreSQL.
    pub pg_url: String,
    /// Redis, when the issuer is a plain Redis (the configured one or a throwaway one).
    pub redis_url: Option<String>,
    /// Any other issuer (`--issuer-url` naming Redis Sentinel, etcd, ZooKeeper or a
    /// PostgreSQL): used as is, never started.
    pub issuer_url: Option<String>,
    /// The PostgreSQL issuer on the demo's own database (`--issuer postgres`).
    pub pg_issuer: bool,
    /// The issuer's key prefix (`--key-prefix`), if not the default.
    pub key_prefix: Option<String>,
    /// How many servers the demo runs on (PostgreSQL and Redis, or PostgreSQL alone).
    wanted: usize,
    throwaway: Vec<Server>,
}

impl Servers {
    /// The given URLs, or throwaway servers where none is given.
    pub async fn start(conn: &Conn, pg_issuer: bool, say: &Narrator) -> Result<Self> {
        let key_prefix = conn.key_prefix()?.map(str::to_owned);
        let issuer_url = conn
            .issuer_url
            .as_deref()
            .filter(|u| !u.is_empty())
            .map(str::to_owned);
        // A plain Redis given as the issuer URL is the Redis to use.
        let (redis_url, issuer_url) = match issuer_url {
            Some(url) if is_plain_redis(&url) => (Some(url), None),
            Some(url) => (None, Some(url)),
            None => (conn.redis_url.clone().filter(|u| !u.is_empty()), None),
        };
        let mut wanted = vec![(
            Kind::Postgres,
            conn.database_url.as_deref(),
            "postgres",
            "DATABASE_URL",
        )];
        if issuer_url.is_none() && !pg_issuer {
            wanted.push((Kind::Redis, redis_url.as_deref(), "redis", "REDIS_URL"));
        }
        let mut throwaway: Vec<Server> = Vec::new();
        let mut urls = Vec::new();
        for (kind, configured, label, var) in wanted {
            let (url, server) = match url_or_start(kind, configured).await {
                Ok(started) => started,
                // Without redis-server the race still runs: on the PostgreSQL issuer.
                Err(e @ ServerError::NotInstalled { .. }) if kind == Kind::Redis => {
                    return Err(anyhow::Error::from(e).context(
                        "cannot start a throwaway redis server (or set REDIS_URL); \
                         `pgfence simulate --issuer postgres` needs only PostgreSQL",
                    ));
                }
                Err(e) => {
                    return Err(anyhow::Error::from(e).context(format!(
                        "cannot start a throwaway {label} server (or set {var})"
                    )));
                }
            };
            match server {
                Some(server) => {
                    say.line(format!(
                        "  {:<10}throwaway server on 127.0.0.1:{} in {}",
                        format!("{label}:"),
                        server.port(),
                        server.dir().display()
                    ));
                    throwaway.push(server);
                }
                None => say.line(format!(
                    "  {:<10}{} ({var})",
                    format!("{label}:"),
                    util::redact(&url)
                )),
            }
            urls.push(url);
        }
        if let Some(url) = &issuer_url {
            say.line(format!(
                "  {:<10}{} (PGFENCE_ISSUER_URL / --issuer-url)",
                "issuer:",
                util::redact(url)
            ));
        }
        if pg_issuer {
            say.line(format!(
                "  {:<10}the PostgreSQL issuer, on the database above (--issuer postgres)",
                "issuer:"
            ));
        }
        Ok(Self {
            pg_url: urls[0].clone(),
            redis_url: urls.get(1).cloned(),
            issuer_url,
            pg_issuer,
            key_prefix,
            wanted: urls.len(),
            throwaway,
        })
    }

    /// True when some server is the user's: then the demo must clean up after itself.
    pub fn has_users_server(&self) -> bool {
        self.throwaway.len() < self.wanted || self.issuer_url.is_some()
    }

    /// Stops the throwaway servers, saying so.
    pub fn stop(self, say: &Narrator) {
        for server in self.throwaway {
            let dir = server.dir().display().to_string();
            server.stop();
            say.line(format!("stopped throwaway server, removed {dir}"));
        }
    }
}

/// Migrates, creates the demo table (guarded when `fenced`) and a fresh demo resource.
pub async fn setup(servers: &Servers, fenced: bool, say: &Narrator) -> Result<Arc<Stage>> {
    let pool = connect_pg(&servers.pg_url).await?;
    let suffix = format!("{:08x}", rand::random::<u32>());
    let table = TableName::new("public", &format!("pgfence_demo_{suffix}"))?;
    let resource = Resource::new(format!("demo:payments:batch-42:{suffix}"))?;
    let (issuer, redis_keys): (Arc<dyn TokenIssuer>, _) = match &servers.redis_url {
        None if servers.pg_issuer => {
            let mut issuer = PgIssuer::new(pool.clone());
            if let Some(prefix) = &servers.key_prefix {
                issuer = issuer.with_key_prefix(prefix)?;
            }
            (Arc::new(issuer), None)
        }
        Some(url) => {
            let mut issuer = connect_redis(url).await?;
            if let Some(prefix) = &servers.key_prefix {
                issuer = issuer.with_key_prefix(prefix)?;
            }
            let keys = vec![issuer.lock_key(&resource), issuer.counter_key(&resource)];
            (Arc::new(issuer), Some((url.clone(), keys)))
        }
        None => {
            let url = servers
                .issuer_url
                .as_deref()
                .context("no issuer to run the demo on")?;
            (
                connect_issuer(url, servers.key_prefix.as_deref(), None, None).await?,
                None,
            )
        }
    };
    let applied = pgfence::admin::migrate(&pool).await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {t} (batch text PRIMARY KEY, status text NOT NULL, paid_by text NOT NULL);
         INSERT INTO {t} VALUES ('batch-42', 'pending', 'nobody');",
        t = table.quoted()
    )))
    .execute(&pool)
    .await?;
    if fenced {
        pgfence::guard::guard(&pool, &table).await?;
    }
    say.line(format!(
        "  setup:    pgfence schema {}; demo table {} created{}",
        if applied.is_empty() {
            "already current"
        } else {
            "migrated"
        },
        table.name().as_str(),
        if fenced {
            " and guarded"
        } else {
            " (NOT guarded)"
        }
    ));
    let provider = pgfence_testkit::Provider::start(std::time::Duration::ZERO)
        .context("cannot start the demo's payment provider on loopback")?;
    say.line(format!(
        "  {:<10}fake payment API on 127.0.0.1:{} (honours Idempotency-Key)",
        "provider:",
        provider.port()
    ));
    say.line(String::new());

    Ok(Arc::new(Stage {
        effects: fenced.then(|| pgfence::Effects::new(pool.clone())),
        provider,
        repo: fenced
            .then(|| Repository::for_table(pool.clone(), table.clone()))
            .transpose()?,
        pool,
        issuer,
        redis_keys,
        resource,
        table,
        fenced,
        rec: Recorder::start(),
    }))
}

/// Drops the demo table, its audit rows and its Redis keys, leaving the user's servers as
/// they were.
pub async fn cleanup(stage: &Stage) {
    let drop = format!("DROP TABLE IF EXISTS {}", stage.table.quoted());
    if let Err(e) = sqlx::raw_sql(AssertSqlSafe(drop))
        .execute(&stage.pool)
        .await
    {
        eprintln!("pgfence: could not drop demo table: {e}");
    }
    let _ = sqlx::query("DELETE FROM pgfence.audit WHERE resource = $1")
        .bind(stage.resource.as_str())
        .execute(&stage.pool)
        .await;
    // The PostgreSQL issuer's rows for the demo's own resource (as for its Redis keys below).
    if stage.issuer.kind() == pgfence::issuer::IssuerKind::Postgres {
        for sql in [
            "DELETE FROM pgfence.issuer_lock WHERE resource = $1",
            "DELETE FROM pgfence.issuer_counter WHERE counter = $1",
        ] {
            let _ = sqlx::query(sql)
                .bind(stage.resource.as_str())
                .execute(&stage.pool)
                .await;
        }
    }
    // The demo's own resource only: production counters are never deleted. (etcd and
    // ZooKeeper locks are gone once released; their revisions and zxids are not state.)
    if let Some((url, keys)) = &stage.redis_keys
        && let Ok(client) = redis::Client::open(url.as_str())
        && let Ok(mut conn) = client.get_multiplexed_async_connection().await
    {
        let _: redis::RedisResult<i64> = redis::cmd("DEL").arg(keys).query_async(&mut conn).await;
    }
}

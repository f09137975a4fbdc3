//! Set-up: the servers (given or throwaway), the bench database and its tables, the external
//! tools, and the bookkeeping every section shares ([`Env`]).

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::Ordering;

use anyhow::{Context, Result};
use pgfence::{FenceToken, Repository, table::TableName};
use pgfence_testkit::{Kind, Server, url_or_start};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};

use crate::PAYLOAD;
use crate::config::Config;
use crate::cpu::find_postmaster;
use crate::measure::{NONCE, TOKENS, next_token};
use crate::parts::UNGUARDED_TABLE;
use crate::workloads::GuardedRow;

/// The PostgreSQL and Redis servers of a run: `DATABASE_URL` / `REDIS_URL` when set, else
/// throwaway servers, stopped when this is dropped.
pub(crate) struct Servers {
    pub(crate) pg_url: String,
    pub(crate) redis_url: String,
    /// Where each server comes from, for the report.
    pub(crate) pg_source: &'static str,
    pub(crate) redis_source: &'static str,
    /// The server's maintenance database, where the bench database is created and dropped.
    maintenance: PgConnectOptions,
    // Field order is drop order: Redis stops first, then PostgreSQL (held only to be
    // dropped last).
    redis_server: Option<Server>,
    _pg_server: Option<Server>,
}

/// `name`'s value, when set and not empty.
fn configured(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

impl Servers {
    /// Connects to the configured servers, or starts throwaway ones.
    pub(crate) async fn start() -> Result<Self> {
        let pg_configured = configured("DATABASE_URL");
        if pg_configured.is_none() {
            eprintln!("starting a throwaway PostgreSQL (set DATABASE_URL to use a running one)");
        }
        let (pg_url, pg_server) = url_or_start(Kind::Postgres, pg_configured.as_deref()).await?;
        let redis_configured = configured("REDIS_URL");
        if redis_configured.is_none() {
            eprintln!("starting a throwaway Redis (set REDIS_URL to use a running one)");
        }
        let (redis_url, redis_server) =
            url_or_start(Kind::Redis, redis_configured.as_deref()).await?;
        Ok(Self {
            maintenance: PgConnectOptions::from_str(&pg_url)?,
            pg_source: if pg_server.is_some() {
                "throwaway (fsync=off, synchronous_commit=off)"
            } else {
                "DATABASE_URL"
            },
            redis_source: if redis_server.is_some() {
                "throwaway (no persistence)"
            } else {
                "REDIS_URL"
            },
            pg_url,
            redis_url,
            redis_server,
            _pg_server: pg_server,
        })
    }

    /// Creates the bench database `db_name`.
    pub(crate) async fn create_database(&self, db_name: &str) -> Result<()> {
        let mut conn = PgConnection::connect_with(&self.maintenance).await?;
        run_sql_conn(&mut conn, &format!("CREATE DATABASE \"{db_name}\"")).await?;
        conn.close().await?;
        Ok(())
    }

    /// Best effort, whatever happened: drops the bench database, and deletes this run's keys
    /// from a Redis we did not start.
    pub(crate) async fn cleanup(&self, db_name: &str, run_id: &str) {
        if let Ok(mut conn) = PgConnection::connect_with(&self.maintenance).await {
            let _ = run_sql_conn(
                &mut conn,
                &format!("DROP DATABASE IF EXISTS \"{db_name}\" WITH (FORCE)"),
            )
            .await;
            let _ = conn.close().await;
        }
        if self.redis_server.is_none()
            && let Err(e) = delete_keys(&self.redis_url, run_id).await
        {
            eprintln!("could not delete this run's Redis keys ({run_id}*): {e}");
        }
    }
}

/// What every section needs.
pub(crate) struct Env {
    pub(crate) cfg: Config,
    /// Connect options of the bench database.
    pub(crate) db: PgConnectOptions,
    /// The bench database as a URL, for pgbench.
    pub(crate) db_url: String,
    /// Setup / bookkeeping pool on the bench database.
    pub(crate) admin: PgPool,
    pub(crate) redis_url: String,
    /// Prefix of every Redis key and resource this run creates.
    pub(crate) run_id: String,
    /// The repository's update SQL ([`Repository::update_sql`]).
    pub(crate) repo_sql: String,
    /// The statements on `bench_guarded` the server had prepared after one real
    /// [`Repository::update`]: `repo_sql` should be among them.
    pub(crate) repo_sql_prepared: Vec<String>,
    /// The statement [`Repository::update_many`] sends for `bench_guarded`, as the server
    /// prepared it for one real batch (`pg_prepared_statements`); `None` (with why) when it
    /// could not be told apart. The library does not expose it: the pgbench ceiling of the
    /// `batch` section runs this text.
    pub(crate) batch_sql: Result<String, String>,
    /// The database's PostgreSQL timeline (`pgfence.timeline()`): what the repository binds
    /// as every statement's last lease parameter for the bench's bare tokens (a lease is
    /// bound to the timeline its first statement runs on, see `pgfence::Fencing::timeline`).
    /// The raw-SQL and pgbench forms of the repository's statements bind it the same way.
    pub(crate) timeline: i64,
    pub(crate) pgbench: Option<PathBuf>,
    pub(crate) redis_benchmark: Option<PathBuf>,
    /// Scratch directory for pgbench scripts.
    pub(crate) scratch: PathBuf,
}

impl Env {
    /// Migrates the (new, empty) bench database `db_name`, creates and fills the tables,
    /// reads the repository's SQL, and finds the external tools.
    pub(crate) async fn open(
        cfg: Config,
        servers: &Servers,
        db_name: &str,
        run_id: String,
        scratch: PathBuf,
    ) -> Result<Self> {
        let db = servers.maintenance.clone().database(db_name);
        let admin = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(db.clone())
            .await?;
        pgfence::admin::migrate(&admin).await?;
        find_postmaster(&admin).await;
        create_tables(&admin, cfg.rows).await?;
        let (repo_sql, repo_sql_prepared) = repository_sql(&db).await?;
        let batch_sql = batch_sql(&db).await?;
        let timeline: i64 = sqlx::query_scalar("SELECT pgfence.timeline()")
            .fetch_one(&admin)
            .await
            .context("reading pgfence.timeline()")?;
        let mut pg_dirs = postgres_bindirs();
        pg_dirs.extend(["/usr/bin", "/usr/local/bin"].map(PathBuf::from));
        Ok(Self {
            db,
            db_url: pgfence_bench::with_database(&servers.pg_url, db_name)
                .map_err(anyhow::Error::msg)?,
            admin,
            redis_url: servers.redis_url.clone(),
            run_id,
            repo_sql,
            repo_sql_prepared,
            batch_sql,
            timeline,
            pgbench: find_tool("pgbench", &pg_dirs),
            redis_benchmark: find_tool(
                "redis-benchmark",
                &["/usr/bin", "/usr/local/bin"].map(PathBuf::from),
            ),
            scratch,
            cfg,
        })
    }

    /// Whether the server prepared exactly [`Env::repo_sql`] for a real `Repository::update`.
    pub(crate) fn repo_sql_matches(&self) -> bool {
        self.repo_sql_prepared.contains(&self.repo_sql)
    }
}

/// `name` on `PATH`, then in `extra` directories.
fn find_tool(name: &str, extra: &[PathBuf]) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain(extra.iter().cloned())
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// `/usr/lib/postgresql/*/bin`, newest version first.
fn postgres_bindirs() -> Vec<PathBuf> {
    let mut dirs: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .collect();
    dirs.sort_by_key(|d| std::cmp::Reverse(d.0));
    dirs.into_iter().map(|(_, d)| d).collect()
}

/// Runs `sql` (one or more statements, no parameters) on `pool`.
async fn run_sql(pool: &PgPool, sql: &str) -> Result<()> {
    sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
        .execute(pool)
        .await
        .with_context(|| format!("running {sql}"))?;
    Ok(())
}

/// Runs `sql` (no parameters) on `conn`.
async fn run_sql_conn(conn: &mut PgConnection, sql: &str) -> Result<()> {
    sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
        .execute(&mut *conn)
        .await
        .with_context(|| format!("running {sql}"))?;
    Ok(())
}

/// The vacuum before every figure (and after the tables are filled).
const VACUUM_TABLES: &str =
    "VACUUM (ANALYZE) bench_guarded, bench_plain, bench_jobs, bench_unguarded";

/// A pool of `size` connections opened up front, without the per-checkout ping.
pub(crate) async fn tuned_pool(env: &Env, size: u32) -> Result<PgPool> {
    Ok(PgPoolOptions::new()
        .max_connections(size)
        .min_connections(size)
        .test_before_acquire(false)
        .connect_with(env.db.clone())
        .await?)
}

/// Creates and fills the tables, guards two of them. Autovacuum is off for them: [`prep`]
/// vacuums before every measurement instead, so that no measurement gets a vacuum mid-run.
async fn create_tables(admin: &PgPool, rows: i32) -> Result<()> {
    for table in ["bench_guarded", "bench_plain", "bench_jobs"] {
        run_sql(
            admin,
            &format!(
                "CREATE TABLE {table} (id integer PRIMARY KEY, payload text NOT NULL)
                     WITH (autovacuum_enabled = off);
                 INSERT INTO {table} SELECT g, '{PAYLOAD}' FROM generate_series(1, {rows}) g;"
            ),
        )
        .await?;
    }
    for table in ["bench_guarded", "bench_jobs"] {
        pgfence::guard::guard(admin, &TableName::parse(table)?).await?;
    }
    // Section `parts`: bench_guarded's twin, with the `fence` column guard added there (the
    // same definition) but no trigger.
    run_sql(
        admin,
        &format!(
            "CREATE TABLE {UNGUARDED_TABLE} (id integer PRIMARY KEY, payload text NOT NULL,
                 fence bigint NOT NULL DEFAULT 0) WITH (autovacuum_enabled = off);
             INSERT INTO {UNGUARDED_TABLE} SELECT g, '{PAYLOAD}' FROM generate_series(1, {rows}) g;"
        ),
    )
    .await?;
    run_sql(admin, VACUUM_TABLES).await
}

/// The repository's update SQL ([`Repository::update_sql`]), and the statements on
/// `bench_guarded` that the server has prepared on a connection after one real
/// [`Repository::update`] there (from `pg_prepared_statements`), to check the two agree.
async fn repository_sql(db: &PgConnectOptions) -> Result<(String, Vec<String>)> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(db.clone())
        .await?;
    let repo = Repository::<GuardedRow>::new(pool.clone())?;
    let mut conn = pool.acquire().await?;
    let row = GuardedRow {
        id: 1,
        payload: PAYLOAD.to_owned(),
    };
    repo.update(&mut *conn, next_token(), &row).await?;
    let prepared: Vec<String> = sqlx::query_scalar(
        "SELECT statement FROM pg_prepared_statements
         WHERE strpos(statement, $1) > 0 AND strpos(statement, 'pg_prepared_statements') = 0",
    )
    .bind("bench_guarded")
    .fetch_all(&mut *conn)
    .await?;
    drop(conn);
    pool.close().await;
    Ok((repo.update_sql().to_owned(), prepared))
}

/// The text of [`Repository::update_many`]'s statement for `bench_guarded`: the one statement
/// on that table the server has prepared on a fresh connection after one real two-row
/// `update_many` whose rows all applied (so no explaining statement was sent). `Err` says why
/// it could not be told apart.
async fn batch_sql(db: &PgConnectOptions) -> Result<Result<String, String>> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(db.clone())
        .await?;
    let repo = Repository::<GuardedRow>::new(pool.clone())?;
    let mut conn = pool.acquire().await?;
    let rows: Vec<GuardedRow> = [1, 2]
        .map(|id| GuardedRow {
            id,
            payload: PAYLOAD.to_owned(),
        })
        .into();
    let outcome = repo.update_many(&mut *conn, next_token(), &rows).await?;
    let prepared: Vec<String> = sqlx::query_scalar(
        "SELECT statement FROM pg_prepared_statements
         WHERE strpos(statement, $1) > 0 AND strpos(statement, 'pg_prepared_statements') = 0",
    )
    .bind("bench_guarded")
    .fetch_all(&mut *conn)
    .await?;
    drop(conn);
    pool.close().await;
    Ok(match prepared.as_slice() {
        _ if !outcome.all_applied() => Err(format!(
            "the capturing batch was not applied: {:?}",
            outcome.summary()
        )),
        [one] => Ok(one.clone()),
        many => Err(format!(
            "{} statements prepared for one update_many, expected 1",
            many.len()
        )),
    })
}

/// Vacuums the tables (so every measurement starts from the same table state), asks for a
/// checkpoint (best effort: needs privileges), and moves the token counter past every fence.
pub(crate) async fn prep(env: &Env) -> Result<()> {
    run_sql(&env.admin, VACUUM_TABLES).await?;
    let _ = sqlx::raw_sql("CHECKPOINT").execute(&env.admin).await;
    resync_tokens(env).await
}

/// Moves the token counter past the token of every fence of the guarded table.
pub(crate) async fn resync_tokens(env: &Env) -> Result<()> {
    let max: i64 = sqlx::query_scalar("SELECT coalesce(max(fence), 0) FROM bench_guarded")
        .fetch_one(&env.admin)
        .await?;
    TOKENS.fetch_max(FenceToken::of_fence(max), Ordering::SeqCst);
    Ok(())
}

/// Rows in the audit table.
pub(crate) async fn audit_rows(env: &Env) -> Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM pgfence.audit")
        .fetch_one(&env.admin)
        .await?)
}

/// A prefix for resource names (and Redis keys) no other measurement uses.
pub(crate) fn prefix(env: &Env, what: &str) -> String {
    format!(
        "{}:{what}:{}",
        env.run_id,
        NONCE.fetch_add(1, Ordering::Relaxed)
    )
}

/// A multiplexed connection to the Redis at `url`.
pub(crate) async fn redis_conn(url: &str) -> Result<redis::aio::MultiplexedConnection> {
    Ok(redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?)
}

/// Deletes every key containing `run_id` (SCAN + UNLINK).
async fn delete_keys(url: &str, run_id: &str) -> Result<()> {
    let mut conn = redis_conn(url).await?;
    let pattern = format!("*{run_id}*");
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await?;
        if !keys.is_empty() {
            redis::cmd("UNLINK")
                .arg(&keys)
                .query_async::<i64>(&mut conn)
                .await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

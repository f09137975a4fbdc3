//! Shared test support: real servers, a fresh migrated database per test, log capture.
//!
//! `DATABASE_URL` / `REDIS_URL` select running servers; without them each test binary starts
//! its own throwaway servers from the installed binaries (see `pgfence_testkit`).

use std::io::Write;
use std::str::FromStr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use pgfence_testkit::{Kind, Server, url_or_start};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};
use tokio::sync::OnceCell;

static PG: OnceCell<(String, Option<Server>)> = OnceCell::const_new();
static REDIS: OnceCell<(String, Option<Server>)> = OnceCell::const_new();
static COUNTER: AtomicU32 = AtomicU32::new(0);

/// URL of the Postgres server tests use (maintenance database).
pub async fn pg_url() -> String {
    PG.get_or_init(|| async {
        url_or_start(
            Kind::Postgres,
            std::env::var("DATABASE_URL").ok().as_deref(),
        )
        .await
        .expect("start throwaway PostgreSQL")
    })
    .await
    .0
    .clone()
}

/// URL of the Redis server tests use.
pub async fn redis_url() -> String {
    REDIS
        .get_or_init(|| async {
            url_or_start(Kind::Redis, std::env::var("REDIS_URL").ok().as_deref())
                .await
                .expect("start throwaway Redis")
        })
        .await
        .0
        .clone()
}

/// A fresh database, migrated, dropped when the test ends.
pub struct TestDb {
    /// A pool on the database.
    pub pool: PgPool,
    /// How to connect to it (as the server's superuser).
    pub options: PgConnectOptions,
    /// The database's name.
    pub name: String,
    admin: PgConnectOptions,
}

impl TestDb {
    /// A new database with pgfence's migrations applied.
    pub async fn new() -> Self {
        let mut db = Self::empty().await;
        pgfence::admin::migrate(&db.pool).await.expect("migrate");
        // Sessions opened from now on get the database settings the migration made
        // (`client_connection_check_interval`), as a service's pool does after a deploy.
        db.pool.close().await;
        db.pool = PgPoolOptions::new()
            .max_connections(20)
            .connect_with(db.options.clone())
            .await
            .expect("pool");
        db
    }

    /// A new database without pgfence's schema.
    pub async fn empty() -> Self {
        let admin = PgConnectOptions::from_str(&pg_url().await).expect("database URL");
        let name = format!(
            "pgfence_test_{}_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed),
            rand::random::<u32>()
        );
        let mut conn = PgConnection::connect_with(&admin)
            .await
            .expect("connect to Postgres");
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&mut conn)
            .await
            .expect("create db");
        conn.close().await.ok();
        let options = admin.clone().database(&name);
        let pool = PgPoolOptions::new()
            .max_connections(20)
            .connect_with(options.clone())
            .await
            .expect("pool");
        Self {
            pool,
            options,
            name,
            admin,
        }
    }

    /// `n` new databases made from this one as their template: the same objects, data and
    /// OIDs, each dropped when the test ends. Closes this database's pool first (a template
    /// may have no other session): use the copies, or new connections, afterwards.
    pub async fn copies(&self, n: usize) -> Vec<TestDb> {
        self.pool.close().await;
        let mut copies = Vec::with_capacity(n);
        for _ in 0..n {
            let name = format!(
                "pgfence_test_{}_{}_{}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::Relaxed),
                rand::random::<u32>()
            );
            let mut conn = PgConnection::connect_with(&self.admin)
                .await
                .expect("connect to Postgres");
            sqlx::raw_sql(AssertSqlSafe(format!(
                "CREATE DATABASE \"{name}\" TEMPLATE \"{}\"",
                self.name
            )))
            .execute(&mut conn)
            .await
            .expect("copy db");
            conn.close().await.ok();
            let options = self.admin.clone().database(&name);
            let pool = PgPoolOptions::new()
                .max_connections(4)
                .connect_with(options.clone())
                .await
                .expect("pool");
            copies.push(Self {
                pool,
                options,
                name,
                admin: self.admin.clone(),
            });
        }
        copies
    }

    /// The database's URL, for processes (the CLI) that take one.
    pub fn url(&self) -> String {
        format!(
            "postgres://{}@{}:{}/{}",
            self.options.get_username(),
            self.options.get_host(),
            self.options.get_port(),
            self.name
        )
    }

    /// Another pool on the same database (e.g. for an independent audit connection).
    pub async fn pool(&self, max: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max)
            .connect_with(self.options.clone())
            .await
            .expect("pool")
    }

    /// Runs SQL text (setup only).
    pub async fn exec(&self, sql: &str) {
        sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .execute(&self.pool)
            .await
            .expect(sql);
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = &self.name;
        run_on_drop(
            &self.admin,
            format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"),
        );
    }
}

/// Runs `sql` as `admin` from a `Drop`: drop cannot await, so a short-lived thread with its
/// own runtime does it, and the drop waits for it. Failures are ignored (the server may be
/// gone already).
fn run_on_drop(admin: &PgConnectOptions, sql: String) {
    let admin = admin.clone();
    let _ = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok()?;
        rt.block_on(async {
            let mut conn = PgConnection::connect_with(&admin).await.ok()?;
            sqlx::raw_sql(AssertSqlSafe(sql))
                .execute(&mut conn)
                .await
                .ok()
        })
    })
    .join();
}

/// Captured `tracing` output for the current thread: JSON lines, or the plain text an
/// operator would tail.
///
/// One global subscriber is installed per test binary, with a JSON and a plain fmt layer; each
/// layer's writer appends to the buffer of whichever test thread captures in its format.
/// (Scoped subscribers would race with tracing's per-callsite interest cache when tests run in
/// parallel.)
#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

/// The format a thread captures in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    Json,
    Plain,
}

thread_local! {
    static CAPTURE: std::cell::RefCell<Option<(Logs, Format)>> =
        const { std::cell::RefCell::new(None) };
}

/// Stops capturing on this thread when dropped.
pub struct CaptureGuard;

impl Drop for CaptureGuard {
    fn drop(&mut self) {
        CAPTURE.with(|c| c.borrow_mut().take());
    }
}

/// Writes to the capturing thread's buffer when it captures in this format, or nowhere.
struct ThreadWriter(Format);

impl Write for ThreadWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        CAPTURE.with(|c| {
            if let Some((logs, format)) = c.borrow().as_ref()
                && *format == self.0
            {
                logs.0.lock().unwrap().extend_from_slice(buf);
            }
        });
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    /// Captures events emitted on this thread, as JSON lines, until the guard drops. Use with
    /// `#[tokio::test]` (current-thread runtime) so every await stays on this thread.
    pub fn capture() -> (Self, CaptureGuard) {
        Self::capture_as(Format::Json)
    }

    /// Like [`Logs::capture`], in the plain (non-JSON, no ANSI colours) fmt output; read it
    /// with [`Logs::text`].
    pub fn capture_plain() -> (Self, CaptureGuard) {
        Self::capture_as(Format::Plain)
    }

    fn capture_as(format: Format) -> (Self, CaptureGuard) {
        static INSTALL: std::sync::Once = std::sync::Once::new();
        INSTALL.call_once(|| {
            use tracing_subscriber::layer::SubscriberExt;
            let subscriber = tracing_subscriber::registry()
                .with(tracing_subscriber::filter::LevelFilter::INFO)
                .with(
                    tracing_subscriber::fmt::layer()
                        .json()
                        .with_writer(|| ThreadWriter(Format::Json)),
                )
                .with(
                    tracing_subscriber::fmt::layer()
                        .with_ansi(false)
                        .with_writer(|| ThreadWriter(Format::Plain)),
                );
            tracing::subscriber::set_global_default(subscriber)
                .expect("no other global subscriber");
        });
        let logs = Logs::default();
        CAPTURE.with(|c| *c.borrow_mut() = Some((logs.clone(), format)));
        (logs, CaptureGuard)
    }

    /// Everything captured, as text.
    pub fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }

    /// Every captured event.
    pub fn events(&self) -> Vec<serde_json::Value> {
        let bytes = self.0.lock().unwrap().clone();
        String::from_utf8(bytes)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).expect("JSON log line"))
            .collect()
    }

    /// Events with `target` and `level`.
    pub fn with(&self, target: &str, level: &str) -> Vec<serde_json::Value> {
        self.events()
            .into_iter()
            .filter(|e| e["target"] == target && e["level"] == level)
            .collect()
    }
}

/// Number of audit rows.
/// How many rows `pgfence.audit` holds.
pub async fn audit_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pgfence.audit")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Token `n` (panics when `n` is not a token).
pub fn token(n: i64) -> pgfence::FenceToken {
    pgfence::FenceToken::new(n).unwrap()
}

/// A resource name unique to this test run.
pub fn unique_resource(prefix: &str) -> pgfence::Resource {
    pgfence::Resource::new(format!("{prefix}:{}", rand::random::<u64>())).unwrap()
}

/// An issuer on the shared test Redis.
pub async fn issuer() -> pgfence::RedisIssuer {
    pgfence::RedisIssuer::connect(&redis_url().await)
        .await
        .expect("connect to Redis")
}

/// Asserts that `err` is a stale-token rejection with exactly these tokens.
#[track_caller]
pub fn assert_stale(err: &pgfence::Error, presented: i64, current: i64) {
    match err {
        pgfence::Error::StaleToken {
            presented: p,
            current: c,
            ..
        } => {
            assert_eq!((*p, *c), (presented, current), "{err:?}");
        }
        other => panic!(
            "expected StaleToken {{ presented: {presented}, current: {current} }}, got {other:?}"
        ),
    }
}

/// A login role created for one test; dropped (with everything it owns or was granted in the
/// test database) when the test ends, even on panic.
pub struct Role {
    /// The role's name (unquoted).
    pub name: String,
    admin: PgConnectOptions,
}

impl Role {
    /// Creates a login role named after `prefix`, with `attributes` (`NOSUPERUSER`...).
    pub async fn create(db: &TestDb, prefix: &str, attributes: &str) -> Self {
        let name = format!("{prefix}_{}_{}", std::process::id(), rand::random::<u32>());
        let quoted = pgfence::table::Ident::new(name.as_str()).unwrap().quoted();
        db.exec(&format!("CREATE ROLE {quoted} LOGIN {attributes}"))
            .await;
        Self {
            name,
            admin: db.options.clone(),
        }
    }

    /// The role's name as an identifier.
    pub fn ident(&self) -> pgfence::table::Ident {
        pgfence::table::Ident::new(self.name.as_str()).unwrap()
    }

    /// The role's name, quoted for SQL.
    pub fn quoted(&self) -> String {
        self.ident().quoted()
    }

    /// A pool of sessions logged in as this role.
    pub async fn pool(&self, db: &TestDb) -> PgPool {
        PgPoolOptions::new()
            .max_connections(4)
            .connect_with(db.options.clone().username(&self.name))
            .await
            .expect("connect as the test role")
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        let role = self.quoted();
        run_on_drop(
            &self.admin,
            format!(
                "REASSIGN OWNED BY {role} TO CURRENT_USER; DROP OWNED BY {role}; DROP ROLE {role}"
            ),
        );
    }
}

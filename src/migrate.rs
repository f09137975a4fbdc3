//! pgfence's schema migrations: refinery migrations embedded in the crate, run over sqlx.
//!
//! Everything lives in the `pgfence` schema and the history in
//! `pgfence.refinery_schema_history`, so a user's own refinery (or other) history is never
//! touched. Runs are serialised with a session advisory lock, so two processes migrating at
//! once both succeed and exactly one applies.

use refinery_core::traits::r#async::{AsyncQuery, AsyncTransaction};
use refinery_core::{AsyncMigrate, Migration, Runner};
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool, Row};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::{Error, Result};

/// The table refinery records pgfence's applied migrations in.
pub const HISTORY_TABLE: &str = "pgfence.refinery_schema_history";

/// Advisory lock key held while migrating ("pgfence" in ASCII).
const MIGRATION_LOCK_KEY: i64 = 0x0070_6766_656e_6365;

/// Set on the migrating connection before anything else runs.
const PINNED_SEARCH_PATH: &str = "SET search_path = pg_catalog, pg_temp";

/// The migrations shipped with this version, in order: `(refinery name, SQL)`.
const MIGRATIONS: &[(&str, &str)] = &[
    ("V1__core", include_str!("../migrations/V1__core.sql")),
    (
        "V2__guard_refuses_system_schemas",
        include_str!("../migrations/V2__guard_refuses_system_schemas.sql"),
    ),
    (
        "V3__audit_from_the_rejecting_statement",
        include_str!("../migrations/V3__audit_from_the_rejecting_statement.sql"),
    ),
    (
        "V4__one_lease_many_writes",
        include_str!("../migrations/V4__one_lease_many_writes.sql"),
    ),
    (
        "V5__least_privilege",
        include_str!("../migrations/V5__least_privilege.sql"),
    ),
    (
        "V6__observe_mode",
        include_str!("../migrations/V6__observe_mode.sql"),
    ),
    (
        "V7__pg_issuer",
        include_str!("../migrations/V7__pg_issuer.sql"),
    ),
    ("V8__effects", include_str!("../migrations/V8__effects.sql")),
];

/// One migration, as reported by [`migrate`] and [`status`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigrationInfo {
    /// Version number (the `N` of `V{N}__name.sql`).
    pub version: i32,
    /// Name (after the `__`).
    pub name: String,
    /// When it was applied, if it is.
    pub applied_on: Option<OffsetDateTime>,
}

/// Applies pgfence's pending migrations to the database behind `pool` and returns the ones
/// this call applied (empty when the schema was already current).
///
/// Safe on an existing, populated database: it only creates objects in the `pgfence` schema.
/// Safe to run from several processes at once. Runs with `search_path = pg_catalog, pg_temp`
/// whatever the role's own setting, so no pgfence object can come to depend on an object in
/// another schema that shadows a catalog name.
///
/// # Errors
/// [`Error::Migration`] when a migration fails or the applied history diverges from the
/// embedded migrations; [`Error::Database`] when the database cannot be reached.
///
/// # Example
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> pgfence::Result<()> {
/// let applied = pgfence::migrate(&pool).await?;
/// println!("applied {} migration(s)", applied.len());
/// # Ok(()) }
/// ```
pub async fn migrate(pool: &PgPool) -> Result<Vec<MigrationInfo>> {
    let migrations = embedded()?;
    // A dedicated connection: if anything fails, closing it releases the advisory lock.
    let mut conn = PgConnection::connect_with(&pool.connect_options()).await?;
    let result = async {
        // Every name the migrations (and refinery's history statements) leave unqualified —
        // `now()`, `length`, operators, types — resolves in the catalog, whatever the
        // migrating role's search_path puts first; new objects land nowhere by accident.
        // Session-level on this dedicated connection, which is closed afterwards.
        sqlx::raw_sql(PINNED_SEARCH_PATH).execute(&mut conn).await?;
        sqlx::query("SELECT pg_catalog.pg_advisory_lock($1)")
            .bind(MIGRATION_LOCK_KEY)
            .execute(&mut conn)
            .await?;
        sqlx::raw_sql("CREATE SCHEMA IF NOT EXISTS pgfence")
            .execute(&mut conn)
            .await?;
        let report = runner(&migrations)
            .run_async(&mut RefineryConn(&mut conn))
            .await
            .map_err(|e| Error::Migration(Box::new(e)))?;
        Ok(report.applied_migrations().iter().map(info).collect())
    }
    .await;
    // Closing the connection releases the lock in every case.
    let _ = conn.close().await;
    result
}

/// Lists every embedded migration with its applied time (`None` when pending).
///
/// # Errors
/// [`Error::Database`] when the database cannot be read.
pub async fn status(pool: &PgPool) -> Result<Vec<MigrationInfo>> {
    let migrations = embedded()?;
    let schema_exists: bool = sqlx::query_scalar(
        "SELECT pg_catalog.to_regclass('pgfence.refinery_schema_history') IS NOT NULL",
    )
    .fetch_one(pool)
    .await?;
    let applied = if schema_exists {
        let mut conn = pool.acquire().await?;
        runner(&migrations)
            .get_applied_migrations_async(&mut RefineryConn(&mut conn))
            .await
            .map_err(|e| Error::Migration(Box::new(e)))?
    } else {
        Vec::new()
    };
    Ok(migrations
        .iter()
        .map(|m| MigrationInfo {
            version: m.version(),
            name: m.name().to_owned(),
            applied_on: applied
                .iter()
                .find(|a| a.version() == m.version())
                .and_then(|a| a.applied_on().copied()),
        })
        .collect())
}

fn embedded() -> Result<Vec<Migration>> {
    MIGRATIONS
        .iter()
        .map(|(name, sql)| {
            Migration::unapplied(name, sql).map_err(|e| Error::Migration(Box::new(e)))
        })
        .collect()
}

fn runner(migrations: &[Migration]) -> Runner {
    let mut runner = Runner::new(migrations)
        .set_abort_divergent(true)
        .set_abort_missing(true);
    runner.set_migration_table_name(HISTORY_TABLE);
    runner
}

fn info(m: &Migration) -> MigrationInfo {
    MigrationInfo {
        version: m.version(),
        name: m.name().to_owned(),
        applied_on: m.applied_on().copied(),
    }
}

/// refinery's async driver traits, implemented for an sqlx connection.
struct RefineryConn<'c>(&'c mut PgConnection);

impl AsyncTransaction for RefineryConn<'_> {
    type Error = sqlx::Error;

    async fn execute<'a, T: Iterator<Item = &'a str> + Send + 'a>(
        &'a mut self,
        queries: T,
    ) -> Result<usize, Self::Error> {
        let mut tx = self.0.begin().await?;
        let mut count = 0;
        for query in queries {
            // Migration SQL is embedded in the crate and refinery's history inserts are built
            // from it: no user input reaches this string.
            sqlx::raw_sql(AssertSqlSafe(query))
                .execute(&mut *tx)
                .await?;
            count += 1;
        }
        tx.commit().await?;
        Ok(count)
    }
}

impl AsyncQuery<Vec<Migration>> for RefineryConn<'_> {
    async fn query<'a>(&'a mut self, query: &'a str) -> Result<Vec<Migration>, Self::Error> {
        // The history query comes from refinery with only our constant table name in it.
        let rows = sqlx::query(AssertSqlSafe(query))
            .fetch_all(&mut *self.0)
            .await?;
        rows.iter()
            .map(|row| {
                let applied_on: String = row.try_get(2)?;
                let checksum: String = row.try_get(3)?;
                Ok(Migration::applied(
                    row.try_get(0)?,
                    row.try_get(1)?,
                    OffsetDateTime::parse(&applied_on, &Rfc3339)
                        .map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
                    checksum
                        .parse::<u64>()
                        .map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
                ))
            })
            .collect()
    }
}

impl AsyncMigrate for RefineryConn<'_> {}

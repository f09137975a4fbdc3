//! pgfence's schema migrations: refinery migrations embedded in the crate, run over sqlx.
//!
//! Everything lives in the `pgfence` schema and the history in
//! `pgfence.refinery_schema_history`, so a user's own refinery (or other) history is never
//! touched. A run is one transaction serialised by a transaction-level advisory lock, so two
//! processes migrating at once both succeed and exactly one applies, and nothing outlives the
//! transaction on the server connection (a transaction-mode pooler's shared connection keeps
//! no lock, setting or prepared statement of pgfence's).

use refinery_core::traits::r#async::{AsyncQuery, AsyncTransaction};
use refinery_core::{AsyncMigrate, Migration, Runner};
use sqlx::{Acquire, AssertSqlSafe, Connection, PgConnection, Postgres, Row};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::{Error, Result};

/// The table refinery records pgfence's applied migrations in.
pub const HISTORY_TABLE: &str = "pgfence.refinery_schema_history";

/// Advisory lock key held while migrating ("pgfence" in ASCII).
const MIGRATION_LOCK_KEY: i64 = 0x0070_6766_656e_6365;

/// Set in the migrating transaction before anything else runs (`SET LOCAL`: it ends with the
/// transaction, so a pooled server connection keeps the search path it had).
const PINNED_SEARCH_PATH: &str = "SET LOCAL search_path = pg_catalog, pg_temp";

/// The migrations shipped with this version, in order: `(refinery name, SQL)`.
const MIGRATIONS: &[(&str, &str)] = &[
    ("V1__core", include_str!("../../migrations/V1__core.sql")),
    (
        "V2__guard_refuses_system_schemas",
        include_str!("../../migrations/V2__guard_refuses_system_schemas.sql"),
    ),
    (
        "V3__audit_from_the_rejecting_statement",
        include_str!("../../migrations/V3__audit_from_the_rejecting_statement.sql"),
    ),
    (
        "V4__one_lease_many_writes",
        include_str!("../../migrations/V4__one_lease_many_writes.sql"),
    ),
    (
        "V5__least_privilege",
        include_str!("../../migrations/V5__least_privilege.sql"),
    ),
    (
        "V6__observe_mode",
        include_str!("../../migrations/V6__observe_mode.sql"),
    ),
    (
        "V7__pgfence_0_3",
        include_str!("../../migrations/V7__pgfence_0_3.sql"),
    ),
];

/// The history rows of an unreleased 0.3 build: main recorded migrations V7 to V13 under these
/// names before they were squashed into one migration, `V7__pgfence_0_3`, for the release. A
/// database that ran them is not a 0.2.0 database and not a 0.3 one: [`migrate`] refuses it
/// with [`Error::UnreleasedMigrations`] instead of refinery's "divergent version".
const UNRELEASED_0_3_HISTORY: &[(i32, &str)] = &[
    (7, "pg_issuer"),
    (8, "effects"),
    (9, "schema_version"),
    (10, "fences_people_cannot_break"),
    (11, "failover_fencing"),
    (12, "fence_layout"),
    (13, "issuer_token_limit"),
];

/// [`Error::UnreleasedMigrations`] when the applied history holds rows of an unreleased 0.3
/// build ([`UNRELEASED_0_3_HISTORY`]).
fn refuse_unreleased_history(applied: &[Migration]) -> Result<()> {
    let versions: Vec<i32> = applied
        .iter()
        .filter(|m| UNRELEASED_0_3_HISTORY.contains(&(m.version(), m.name())))
        .map(Migration::version)
        .collect();
    if versions.is_empty() {
        Ok(())
    } else {
        Err(Error::UnreleasedMigrations { versions })
    }
}

/// The newest migration this version ships.
pub(crate) fn latest_version() -> i32 {
    i32::try_from(MIGRATIONS.len()).unwrap_or(i32::MAX)
}

/// One migration, as reported by [`migrate`] and [`migration_status`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigrationInfo {
    /// Version number (the `N` of `V{N}__name.sql`).
    pub version: i32,
    /// Name (after the `__`).
    pub name: String,
    /// When it was applied, if it is.
    pub applied_on: Option<OffsetDateTime>,
}

/// Applies pgfence's pending migrations to the database behind `conn` (a pool, a connection
/// or a transaction) and returns the ones this call applied (empty when the schema was already
/// current).
///
/// Safe on an existing, populated database: it only creates objects in the `pgfence` schema.
/// Safe to run from several processes at once. Runs with `search_path = pg_catalog, pg_temp`
/// whatever the role's own setting, so no pgfence object can come to depend on an object in
/// another schema that shadows a catalog name.
///
/// One transaction (a savepoint when `conn` is already in one): a transaction-level advisory
/// lock serialises concurrent runs, the search path is `SET LOCAL`, and every statement is
/// sent unnamed — so it works through a transaction-mode pooler (PgBouncer) and leaves
/// nothing on the server connection.
///
/// It checks before it writes: on a current schema it creates nothing and takes no lock, so a
/// role without `CREATE` privileges (the application role of [`grant`](crate::admin::grant)) may call
/// it; on a schema that is behind, such a role gets [`Error::MigrationNotPermitted`].
///
/// # Errors
/// [`Error::Backend`](crate::Error::Backend) when a migration fails or the applied history diverges from the
/// embedded migrations; [`Error::UnreleasedMigrations`] when the history holds migrations of
/// an unreleased 0.3 build (V7 to V13 before they were squashed);
/// [`Error::MigrationNotPermitted`] when the schema is behind and this role may not migrate
/// it; [`Error::Backend`](crate::Error::Backend) when the database cannot be reached.
///
/// # Example
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> pgfence::Result<()> {
/// let applied = pgfence::admin::migrate(&pool).await?;
/// println!("applied {} migration(s)", applied.len());
/// # Ok(()) }
/// ```
pub async fn migrate<'c, A>(conn: A) -> Result<Vec<MigrationInfo>>
where
    A: Acquire<'c, Database = Postgres>,
{
    let migrations = embedded()?;
    let mut tx = conn.begin().await?;
    // Inside a caller's transaction this is a savepoint, and a `SET LOCAL` outlives its
    // release: the caller's search path is put back before returning (a failure rolls back to
    // the savepoint, which undoes the setting by itself).
    let callers_path: String =
        sqlx::query_scalar("SELECT pg_catalog.current_setting('search_path')")
            .persistent(false)
            .fetch_one(&mut *tx)
            .await?;
    sqlx::raw_sql(PINNED_SEARCH_PATH).execute(&mut *tx).await?;
    match applied_state(&mut tx).await? {
        Applied::Current => {
            restore_search_path(&mut tx, &callers_path).await?;
            tx.commit().await?;
            return Ok(Vec::new());
        }
        Applied::Behind { version, role } if !may_migrate(&mut tx).await? => {
            return Err(Error::MigrationNotPermitted {
                role,
                applied: version,
                latest: latest_version(),
                installed: true,
            });
        }
        Applied::Missing => {
            if let Some(role) = may_not_install(&mut tx).await? {
                return Err(Error::MigrationNotPermitted {
                    role,
                    applied: 0,
                    latest: latest_version(),
                    installed: false,
                });
            }
        }
        Applied::Readable => {
            let applied = runner(&migrations)
                .get_applied_migrations_async(&mut RefineryConn(&mut tx))
                .await
                .map_err(Error::migration)?;
            refuse_unreleased_history(&applied)?;
        }
        Applied::Behind { .. } => {}
    }
    // The key is a constant: the literal needs no quoting.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "SELECT pg_catalog.pg_advisory_xact_lock({MIGRATION_LOCK_KEY})"
    )))
    .execute(&mut *tx)
    .await?;
    let schema_exists = scalar(
        &mut tx,
        "SELECT pg_catalog.to_regnamespace('pgfence') IS NOT NULL",
    )
    .await?;
    if !schema_exists {
        sqlx::raw_sql("CREATE SCHEMA pgfence")
            .execute(&mut *tx)
            .await?;
    }
    let report = runner(&migrations)
        .run_async(&mut RefineryConn(&mut tx))
        .await
        .map_err(Error::migration)?;
    restore_search_path(&mut tx, &callers_path).await?;
    tx.commit().await?;
    Ok(report.applied_migrations().iter().map(info).collect())
}

/// Sets the transaction's search path back to `path` (what it was before [`migrate`]).
async fn restore_search_path(conn: &mut PgConnection, path: &str) -> Result<()> {
    sqlx::query("SELECT pg_catalog.set_config('search_path', $1, true)")
        .bind(path)
        .persistent(false)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// What [`applied_state`] found.
enum Applied {
    /// No `pgfence` schema (or no history in it).
    Missing,
    /// This role can read the history: let refinery compare it (divergence included).
    Readable,
    /// Every shipped migration is applied (read through `pgfence.schema_version()`).
    Current,
    /// Behind (or not readable): `version` is the newest applied one known (0: unknown).
    Behind { version: i32, role: String },
}

/// Reads how far the schema is without privileges on the history table when this role has
/// none: `pgfence.schema_version()` (migration V7, any role with `USAGE` on the schema).
async fn applied_state(conn: &mut PgConnection) -> Result<Applied> {
    // From the catalog, which every role reads: `to_regclass` would fail with "permission
    // denied for schema" for a role without USAGE on it. CASE: privileges are asked of objects
    // that exist.
    let row = sqlx::query(
        "SELECT h.oid IS NOT NULL,
                CASE WHEN h.oid IS NOT NULL
                     THEN pg_catalog.has_schema_privilege(h.nsp, 'USAGE')
                          AND pg_catalog.has_table_privilege(h.oid, 'SELECT') END,
                CASE WHEN f.oid IS NOT NULL
                     THEN pg_catalog.has_schema_privilege(f.nsp, 'USAGE')
                          AND pg_catalog.has_function_privilege(f.oid, 'EXECUTE') END,
                CURRENT_USER::pg_catalog.text
           FROM (SELECT) AS one
           LEFT JOIN (SELECT c.oid, c.relnamespace AS nsp
                        FROM pg_catalog.pg_class c
                        JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace
                       WHERE n.nspname OPERATOR(pg_catalog.=) 'pgfence'
                         AND c.relname OPERATOR(pg_catalog.=) 'refinery_schema_history') AS h ON true
           LEFT JOIN (SELECT p.oid, p.pronamespace AS nsp
                        FROM pg_catalog.pg_proc p
                        JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) p.pronamespace
                       WHERE n.nspname OPERATOR(pg_catalog.=) 'pgfence'
                         AND p.proname OPERATOR(pg_catalog.=) 'schema_version') AS f ON true",
    )
    .persistent(false)
    .fetch_one(&mut *conn)
    .await?;
    let history: bool = row.try_get(0)?;
    if !history {
        return Ok(Applied::Missing);
    }
    let readable: Option<bool> = row.try_get(1)?;
    let versioned: Option<bool> = row.try_get(2)?;
    let role: String = row.try_get(3)?;
    if readable == Some(true) {
        return Ok(Applied::Readable);
    }
    if versioned != Some(true) {
        return Ok(Applied::Behind { version: 0, role });
    }
    let row = sqlx::query("SELECT version, applied FROM pgfence.schema_version()")
        .persistent(false)
        .fetch_one(&mut *conn)
        .await?;
    let version: i32 = row.try_get(0)?;
    let applied: i32 = row.try_get(1)?;
    if version == latest_version() && usize::try_from(applied).ok() == Some(MIGRATIONS.len()) {
        Ok(Applied::Current)
    } else {
        Ok(Applied::Behind { version, role })
    }
}

/// Whether this role could create pgfence's objects: `CREATE` on the `pgfence` schema.
async fn may_migrate(conn: &mut PgConnection) -> Result<bool> {
    scalar(
        conn,
        "SELECT pg_catalog.has_schema_privilege('pgfence', 'CREATE')",
    )
    .await
}

/// For a database without pgfence's history: the connected role when it may not install
/// pgfence (no `pgfence` schema and no `CREATE` on the database, or a schema it may not
/// create objects in); `None` when it may.
async fn may_not_install(conn: &mut PgConnection) -> Result<Option<String>> {
    let row = sqlx::query(
        // A scan of pg_namespace, not to_regnamespace: a name looked up and not found stays
        // "not found" in this session's catalog cache until it takes a lock on a relation,
        // and a concurrent run may create the schema while this one waits for the advisory
        // lock.
        "SELECT CASE WHEN n.oid IS NULL
                     THEN pg_catalog.has_database_privilege(pg_catalog.current_database(), 'CREATE')
                     ELSE pg_catalog.has_schema_privilege(n.oid, 'CREATE') END,
                CURRENT_USER::pg_catalog.text
           FROM (SELECT) AS one
           LEFT JOIN pg_catalog.pg_namespace n ON n.nspname OPERATOR(pg_catalog.=) 'pgfence'",
    )
    .persistent(false)
    .fetch_one(&mut *conn)
    .await?;
    let may: bool = row.try_get(0)?;
    Ok((!may).then(|| row.try_get(1)).transpose()?)
}

/// A boolean from a constant statement, sent unnamed.
async fn scalar(conn: &mut PgConnection, sql: &'static str) -> Result<bool> {
    Ok(sqlx::query_scalar(sql)
        .persistent(false)
        .fetch_one(&mut *conn)
        .await?)
}

/// Lists every embedded migration with its applied time (`None` when pending).
///
/// Reads the history table (the schema owner's); a role without `SELECT` on it gets
/// [`Error::Backend`](crate::Error::Backend) (permission denied) — [`migrate`] and [`doctor`](crate::admin::doctor) read
/// `pgfence.schema_version()` instead.
///
/// # Errors
/// [`Error::Backend`](crate::Error::Backend) when the database cannot be read; [`Error::UnreleasedMigrations`] when
/// the history holds migrations of an unreleased 0.3 build (its V7 would read as applied).
pub async fn migration_status<'c, A>(conn: A) -> Result<Vec<MigrationInfo>>
where
    A: Acquire<'c, Database = Postgres>,
{
    let migrations = embedded()?;
    let mut conn = conn.acquire().await?;
    let schema_exists = scalar(
        &mut conn,
        "SELECT pg_catalog.to_regclass('pgfence.refinery_schema_history') IS NOT NULL",
    )
    .await?;
    let applied = if schema_exists {
        runner(&migrations)
            .get_applied_migrations_async(&mut RefineryConn(&mut conn))
            .await
            .map_err(Error::migration)?
    } else {
        Vec::new()
    };
    refuse_unreleased_history(&applied)?;
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
        .map(|(name, sql)| Migration::unapplied(name, sql).map_err(Error::migration))
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
        let mut tx = Connection::begin(&mut *self.0).await?;
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
        // Unnamed: nothing stays prepared on a pooled server connection.
        let rows = sqlx::query(AssertSqlSafe(query))
            .persistent(false)
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

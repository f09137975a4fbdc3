//! Guarding tables: the `fence` column and the trigger that rejects any UPDATE — library or
//! raw SQL — that does not advance a row's fence (SQLSTATE [`crate::SQLSTATE_STALE`]).

use sqlx::PgExecutor;

use crate::Result;
use crate::ident::{TableName, quote_literal};

/// Guards `table`: adds `fence BIGINT NOT NULL DEFAULT 0` if missing (metadata-only, no table
/// rewrite), and installs the trigger. Returns `true` if anything changed, `false` if the
/// table was already guarded.
///
/// # Errors
/// [`crate::Error::TableNotFound`]; [`crate::Error::FenceColumnType`] when `fence` exists with
/// another type; [`crate::Error::Database`].
///
/// # Example
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> pgfence::Result<()> {
/// let table = pgfence::TableName::parse("inventory_snapshot")?;
/// pgfence::guard(&pool, &table).await?;
/// # Ok(()) }
/// ```
pub async fn guard<'c, E: PgExecutor<'c>>(exec: E, table: &TableName) -> Result<bool> {
    let changed = sqlx::query_scalar!(
        r#"SELECT pgfence.guard($1, $2) AS "changed!""#,
        table.schema().as_str(),
        table.name().as_str()
    )
    .fetch_one(exec)
    .await?;
    Ok(changed)
}

/// Removes the guard trigger from `table`; with `drop_column`, drops the `fence` column too.
/// Returns `true` if anything changed.
///
/// # Errors
/// [`crate::Error::TableNotFound`]; [`crate::Error::Database`].
pub async fn unguard<'c, E: PgExecutor<'c>>(
    exec: E,
    table: &TableName,
    drop_column: bool,
) -> Result<bool> {
    let changed = sqlx::query_scalar!(
        r#"SELECT pgfence.unguard($1, $2, $3) AS "changed!""#,
        table.schema().as_str(),
        table.name().as_str(),
        drop_column
    )
    .fetch_one(exec)
    .await?;
    Ok(changed)
}

/// Lists guarded tables.
///
/// # Errors
/// [`crate::Error::Database`].
pub async fn guarded_tables<'c, E: PgExecutor<'c>>(exec: E) -> Result<Vec<TableName>> {
    let rows = sqlx::query!(
        r#"SELECT schema_name AS "schema!", table_name AS "table!" FROM pgfence.guarded_tables ORDER BY 1, 2"#
    )
    .fetch_all(exec)
    .await?;
    rows.into_iter()
        .map(|r| TableName::new(&r.schema, &r.table))
        .collect()
}

/// The SQL of a migration that guards `table` (what [`guard`] does), for a user's own
/// migrations folder. Requires pgfence's migrations to have run first.
///
/// # Errors
/// Only for names that cannot be written as SQL literals (NUL bytes), which [`TableName`]
/// already refuses.
pub fn guard_migration_sql(table: &TableName) -> Result<String> {
    Ok(format!(
        "-- Guard a table with pgfence: adds `fence bigint NOT NULL DEFAULT 0` (if missing) and the\n\
         -- trigger that rejects updates which do not advance a row's fence.\n\
         -- Needs pgfence's own schema (`pgfence migrate`) to be applied first.\n\
         SELECT pgfence.guard({}, {});\n",
        quote_literal(table.schema().as_str())?,
        quote_literal(table.name().as_str())?
    ))
}

//! Guarding tables: the `fence` column and the trigger that rejects any UPDATE — library or
//! raw SQL — that does not advance a row's fence (SQLSTATE [`crate::error::sqlstate::STALE`]).

use serde::Serialize;
use sqlx::PgExecutor;

use crate::Result;
use crate::error::{SCHEMA_OWNER, TABLE_OWNER, deploy_time};
use crate::ident::{Ident, TableName, quote_literal};

/// Guards `table`: adds `fence BIGINT NOT NULL DEFAULT 0` if missing (metadata-only, no table
/// rewrite), and installs the trigger. Returns `true` if anything changed, `false` if the
/// table was already guarded.
///
/// # Errors
/// [`crate::Error::TableNotFound`]; [`crate::Error::FenceColumnType`] when `fence` exists with
/// another type; [`Error::Backend`](crate::Error::Backend).
///
/// # Example
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> pgfence::Result<()> {
/// let table = pgfence::table::TableName::parse("inventory_snapshot")?;
/// pgfence::guard::guard(&pool, &table).await?;
/// # Ok(()) }
/// ```
///
/// This is [`guard_with`] in [`GuardMode::Enforce`]: a table in observe mode is switched to
/// enforcing.
pub async fn guard<'c, E: PgExecutor<'c>>(exec: E, table: &TableName) -> Result<bool> {
    guard_with(exec, table, GuardMode::Enforce).await
}

/// What the guard trigger does with an UPDATE that is not a lease's write (it leaves the
/// fence alone, lowers it, or changes it some other way, such as `fence = fence + 1`).
///
/// In both modes a token more than `pgfence.max_token_jump()` above the row's is refused
/// (`PF008`, [`crate::Error::TokenJump`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GuardMode {
    /// Reject it (the default): `PF001` when the fence did not advance, `PF007`
    /// ([`crate::Error::LeaselessWrite`]) when it changed some other way — unless the
    /// transaction called [`bypass`] and its role may bypass ([`allow_bypass`]): then let it
    /// through, audited, and seal the row.
    Enforce,
    /// Report only: let it through, record it in `pgfence.audit` (operation `observe`, holder
    /// = the writing role, `application_name`), raise a PostgreSQL `WARNING`, and seal the row
    /// (the lease that wrote it before gets [`crate::Error::RowSealed`], so the write let
    /// through is not overwritten). For rolling pgfence out: find every writer that does not
    /// fence before enforcing.
    Observe,
}

impl GuardMode {
    /// `"enforce"` or `"observe"`, as SQL and the CLI spell it.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Enforce => "enforce",
            Self::Observe => "observe",
        }
    }

    fn from_sql(mode: &str) -> Self {
        if mode == "observe" {
            Self::Observe
        } else {
            Self::Enforce
        }
    }
}

impl std::fmt::Display for GuardMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Guards `table` in `mode`: like [`guard`] (adds or adopts the `fence` column), then installs
/// the trigger in that mode, switches an installed trigger to it (the trigger is replaced,
/// under the same lock `guard` takes) and re-enables a disabled one. Returns `true` if
/// anything changed.
///
/// # Errors
/// As [`guard`].
///
/// # Example
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> pgfence::Result<()> {
/// use pgfence::{guard::GuardMode, table::TableName};
/// let table = TableName::parse("accounts")?;
/// pgfence::guard::guard_with(&pool, &table, GuardMode::Observe).await?; // roll out: report only
/// // ... once `pgfence audit` shows no more `observe` rows for it:
/// pgfence::guard::guard_with(&pool, &table, GuardMode::Enforce).await?;
/// # Ok(()) }
/// ```
pub async fn guard_with<'c, E: PgExecutor<'c>>(
    exec: E,
    table: &TableName,
    mode: GuardMode,
) -> Result<bool> {
    let changed = sqlx::query_scalar!(
        r#"SELECT pgfence.guard($1, $2, $3) AS "changed!""#,
        table.schema().as_str(),
        table.name().as_str(),
        mode.as_str()
    )
    .fetch_one(exec)
    .await
    .map_err(deploy_time("pgfence guard", TABLE_OWNER))?;
    Ok(changed)
}

/// The mode of `table`'s guard trigger, or `None` when it is not guarded.
///
/// # Errors
/// [`Error::Backend`](crate::Error::Backend).
pub async fn guard_mode<'c, E: PgExecutor<'c>>(
    exec: E,
    table: &TableName,
) -> Result<Option<GuardMode>> {
    let mode = sqlx::query_scalar!(
        r#"SELECT mode AS "mode!" FROM pgfence.guarded_tables
            WHERE schema_name OPERATOR(pg_catalog.=) $1 AND table_name OPERATOR(pg_catalog.=) $2"#,
        table.schema().as_str(),
        table.name().as_str()
    )
    .fetch_optional(exec)
    .await?;
    Ok(mode.as_deref().map(GuardMode::from_sql))
}

/// A guarded table, as [`guarded_tables_with_modes`] lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuardedTable {
    /// The table.
    pub table: TableName,
    /// What its trigger does.
    pub mode: GuardMode,
    /// Whether the trigger fires (`false` after `ALTER TABLE ... DISABLE TRIGGER`).
    pub enabled: bool,
}

/// Lists guarded tables with their mode and whether the trigger is enabled.
///
/// # Errors
/// [`Error::Backend`](crate::Error::Backend).
pub async fn guarded_tables_with_modes<'c, E: PgExecutor<'c>>(
    exec: E,
) -> Result<Vec<GuardedTable>> {
    let rows = sqlx::query!(
        r#"SELECT schema_name AS "schema!", table_name AS "table!", mode AS "mode!",
                  enabled AS "enabled!"
             FROM pgfence.guarded_tables ORDER BY 1, 2"#
    )
    .fetch_all(exec)
    .await?;
    rows.into_iter()
        .map(|r| {
            Ok(GuardedTable {
                table: TableName::new(&r.schema, &r.table)?,
                mode: GuardMode::from_sql(&r.mode),
                enabled: r.enabled,
            })
        })
        .collect()
}

/// Removes the guard trigger from `table`; with `drop_column`, drops the `fence` column too.
/// Returns `true` if anything changed.
///
/// # Errors
/// [`crate::Error::TableNotFound`]; [`Error::Backend`](crate::Error::Backend).
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
    .await
    .map_err(deploy_time("pgfence unguard", TABLE_OWNER))?;
    Ok(changed)
}

/// Lists guarded tables.
///
/// # Errors
/// [`Error::Backend`](crate::Error::Backend).
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
    guard_migration_sql_with(table, GuardMode::Enforce)
}

/// The SQL of a migration that guards `table` in `mode` (what [`guard_with`] does).
///
/// # Errors
/// As [`guard_migration_sql`].
pub fn guard_migration_sql_with(table: &TableName, mode: GuardMode) -> Result<String> {
    guard_migration_sql_for(std::slice::from_ref(table), mode)
}

/// The SQL of one migration that guards every table of `tables`, in order, in `mode`: one
/// file, so one transaction under sqlx's migrator and refinery's, and so all the tables are
/// guarded or none. For one table it is [`guard_migration_sql_with`]'s text. Requires
/// pgfence's migrations to have run first (the migration's first statement says so when
/// they have not).
///
/// # Errors
/// As [`guard_migration_sql`].
///
/// # Example
/// ```
/// use pgfence::guard::{GuardMode, guard_migration_sql_for};
/// use pgfence::table::TableName;
/// # fn main() -> pgfence::Result<()> {
/// let tables = [TableName::parse("orders")?, TableName::parse("billing.invoices")?];
/// let sql = guard_migration_sql_for(&tables, GuardMode::Enforce)?;
/// assert!(sql.ends_with(
///     "SELECT pgfence.guard('public', 'orders');\nSELECT pgfence.guard('billing', 'invoices');\n"
/// ));
/// # Ok(()) }
/// ```
pub fn guard_migration_sql_for(tables: &[TableName], mode: GuardMode) -> Result<String> {
    let mut calls = String::new();
    for table in tables {
        let (schema, name) = (
            quote_literal(table.schema().as_str())?,
            quote_literal(table.name().as_str())?,
        );
        calls.push_str(&if mode == GuardMode::Observe {
            format!("SELECT pgfence.guard({schema}, {name}, 'observe');\n")
        } else {
            format!("SELECT pgfence.guard({schema}, {name});\n")
        });
    }
    let about = if mode == GuardMode::Observe {
        "-- Guard a table with pgfence in observe mode: adds `fence bigint NOT NULL DEFAULT 0` (if\n\
         -- missing) and the trigger, which lets updates that do not advance a row's fence through\n\
         -- and records them in pgfence.audit. Switch to enforcing with\n\
         -- SELECT pgfence.guard(schema, table, 'enforce').\n"
    } else {
        "-- Guard a table with pgfence: adds `fence bigint NOT NULL DEFAULT 0` (if missing) and the\n\
         -- trigger that rejects updates which do not advance a row's fence.\n"
    };
    Ok(format!("{about}{NEEDS_PGFENCE}{calls}"))
}

/// The SQL of the migration that reverts [`guard_migration_sql_for`]'s (a reversible
/// migration's down file): unguards every table of `tables`, last first, and keeps their
/// `fence` columns (the up migration adds one only when it is missing, so it may have been
/// the table's own; the values stay for a later guard).
///
/// # Errors
/// As [`guard_migration_sql`].
///
/// # Example
/// ```
/// use pgfence::table::TableName;
/// # fn main() -> pgfence::Result<()> {
/// let sql = pgfence::guard::unguard_migration_sql(&[TableName::parse("orders")?])?;
/// assert!(sql.ends_with("SELECT pgfence.unguard('public', 'orders', false);\n"));
/// # Ok(()) }
/// ```
pub fn unguard_migration_sql(tables: &[TableName]) -> Result<String> {
    let mut sql = String::from(
        "-- Remove pgfence's guard trigger; the `fence` column stays (drop it by hand, or with\n\
         -- SELECT pgfence.unguard(schema, table, true), once nothing reads it).\n",
    );
    for table in tables.iter().rev() {
        sql.push_str(&format!(
            "SELECT pgfence.unguard({}, {}, false);\n",
            quote_literal(table.schema().as_str())?,
            quote_literal(table.name().as_str())?
        ));
    }
    Ok(sql)
}

/// The first statement of an emitted guard migration: pgfence keeps its own migration
/// history, so a service's migrations can run before `pgfence migrate`; this one then stops
/// with a message that says what to run first, instead of `schema "pgfence" does not exist`.
const NEEDS_PGFENCE: &str = "-- Needs pgfence's own schema: run `pgfence migrate` (or pgfence::admin::migrate) first.\n\
DO $pgfence$\n\
BEGIN\n    \
    IF pg_catalog.to_regprocedure('pgfence.guard(text,text,text)') IS NULL THEN\n        \
        RAISE EXCEPTION 'pgfence is not installed in this database: run `pgfence migrate` (or pgfence::admin::migrate) before this migration'\n            \
            USING ERRCODE = '55000',\n                  \
                  HINT = 'pgfence keeps its own migration history (schema pgfence): apply it first at deploy time, e.g. pgfence migrate && <your migrations>';\n    \
    END IF;\n\
END\n\
$pgfence$;\n";

/// Allows the role named `role` (and its members) to bypass the guard of every guarded table
/// with [`bypass`] (`SELECT pgfence.bypass('<reason>')`) in a transaction, and grants it
/// what that call needs (`USAGE` on the schema, `EXECUTE` on `pgfence.bypass`). Each
/// bypassed row is audited (operation `bypass`, holder = the role, the reason) and raises a
/// PostgreSQL `WARNING`; its fence is sealed against every lease that wrote it before. Run it
/// as the owner of the `pgfence` schema. Returns `true` if the role was not allowed before.
///
/// # Errors
/// [`InvalidInput::Identifier`](crate::error::InvalidInput::Identifier) for a name that is not a role name; [`Error::Backend`](crate::Error::Backend)
/// when the role does not exist (SQLSTATE `42704`) or the caller is not the schema's owner.
pub async fn allow_bypass<'c, E: PgExecutor<'c>>(exec: E, role: &str) -> Result<bool> {
    let role = Ident::new(role)?;
    let changed = sqlx::query_scalar!(
        r#"SELECT pgfence.allow_bypass($1) AS "changed!""#,
        role.as_str()
    )
    .fetch_one(exec)
    .await
    .map_err(deploy_time("pgfence::guard::allow_bypass", SCHEMA_OWNER))?;
    Ok(changed)
}

/// Takes back [`allow_bypass`] (and the role's `EXECUTE` on `pgfence.bypass`). Returns `true`
/// if the role was allowed.
///
/// # Errors
/// [`InvalidInput::Identifier`](crate::error::InvalidInput::Identifier); [`Error::Backend`](crate::Error::Backend).
pub async fn disallow_bypass<'c, E: PgExecutor<'c>>(exec: E, role: &str) -> Result<bool> {
    let role = Ident::new(role)?;
    let changed = sqlx::query_scalar!(
        r#"SELECT pgfence.disallow_bypass($1) AS "changed!""#,
        role.as_str()
    )
    .fetch_one(exec)
    .await
    .map_err(deploy_time("pgfence::guard::disallow_bypass", SCHEMA_OWNER))?;
    Ok(changed)
}

/// Starts an audited bypass of the guard for the transaction `tx` (`SELECT
/// pgfence.bypass($1)`): its UPDATEs of guarded rows that are not a lease's write go through,
/// each audited (operation `bypass`, the role, `reason`) and sealed, when the role was allowed
/// ([`allow_bypass`]). The bypass ends with the transaction; a plain `SET pgfence.bypass` (which
/// would outlive it on a pooled connection) bypasses nothing ([`crate::Error::BypassRefused`]).
///
/// # Errors
/// [`Error::Backend`](crate::Error::Backend) for an empty reason or one over 500 characters (SQLSTATE
/// `22023`), or a role without `EXECUTE` on `pgfence.bypass` (not allowed).
///
/// # Example
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> pgfence::Result<()> {
/// let mut tx = pool.begin().await?;
/// pgfence::guard::bypass(&mut tx, "refund #123, ticket OPS-7").await?;
/// sqlx::query("UPDATE accounts SET balance = balance + 100 WHERE id = 14")
///     .execute(&mut *tx)
///     .await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
pub async fn bypass(tx: &mut sqlx::PgTransaction<'_>, reason: &str) -> Result<()> {
    sqlx::query("SELECT pgfence.bypass($1)")
        .bind(reason)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

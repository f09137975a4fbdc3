//! The typed repository: fenced `update`, `upsert` and `delete` for tables declared with
//! [`fenced_table!`](crate::fenced_table) (or a hand-written [`FencedTable`] impl).
//!
//! An applied write is one plain statement (`UPDATE ... WHERE <key> AND fence < $token`, the
//! fenced `INSERT ... ON CONFLICT`, the fenced `DELETE`). Only a write that changed nothing
//! sends a second statement, on the same executor, that tells why: stale (the row's fence is
//! at least the presented token, or for upsert a newer token deleted the row), not found, or
//! contended (the row was replaced meanwhile, retryable) — and, on a pool, writes the audit
//! row in that same statement. The common path pays nothing for the rare one
//! (`BENCHMARKS.md`: classifying inside the write cost ~15% of its throughput).
//!
//! Between the two statements the row can change; the second reports what it finds then. A
//! row a newer token deleted through [`Repository::delete`] left a tombstone and still
//! reports stale to `upsert`; a row deleted by raw SQL in between reports not found — the
//! write was rejected either way and nothing was written.

use std::marker::PhantomData;
use std::sync::Arc;

use sqlx::postgres::{PgArguments, PgRow};
use sqlx::{AssertSqlSafe, PgPool, Postgres, Row, SqlSafeStr, SqlStr};

use crate::audit::{AuditRow, Auditor, Rejection};
use crate::ident::{Ident, TableName};
use crate::{Error, FenceToken, Resource, Result};

/// A query under construction, as handed to [`FencedTable`]'s bind methods.
pub type PgQuery = sqlx::query::Query<'static, Postgres, PgArguments>;

/// A table whose rows are written only with a fence token.
///
/// Implement it with [`fenced_table!`](crate::fenced_table); by hand, the bind methods must
/// bind exactly the columns listed, in order.
pub trait FencedTable: Send + Sync + 'static {
    /// The key, as passed to [`Repository::delete`]: a single value or a tuple.
    type Key: Send + Sync;
    /// Schema of the table (default `public`).
    const SCHEMA: &'static str = "public";
    /// Table name, as stored in the catalog.
    const TABLE: &'static str;
    /// Columns of the primary key (or another unique key, which `upsert` targets).
    const KEY_COLUMNS: &'static [&'static str];
    /// The other columns a write sets (not `fence`, which pgfence manages).
    const COLUMNS: &'static [&'static str];
    /// Binds this row's key columns, in [`Self::KEY_COLUMNS`] order.
    fn bind_key(&self, query: PgQuery) -> PgQuery;
    /// Binds this row's other columns, in [`Self::COLUMNS`] order.
    fn bind_columns(&self, query: PgQuery) -> PgQuery;
    /// Binds a bare key, in [`Self::KEY_COLUMNS`] order.
    fn bind_key_value(key: &Self::Key, query: PgQuery) -> PgQuery;
}

/// Declares a struct as a fenced table: its field names are the column names.
///
/// ```
/// #[derive(Debug, Clone)]
/// struct Snapshot { sku: String, payload: String, qty: i32 }
///
/// pgfence::fenced_table!(Snapshot {
///     table: "inventory_snapshot",
///     key: sku: String,
///     columns: [payload, qty],
/// });
///
/// // Composite key, explicit schema:
/// struct Line { batch: i64, line: i32, amount: i64 }
/// pgfence::fenced_table!(Line {
///     schema: "billing",
///     table: "ledger_line",
///     key: (batch: i64, line: i32),
///     columns: [amount],
/// });
/// ```
#[macro_export]
macro_rules! fenced_table {
    ($ty:ty { $(schema: $schema:literal,)? table: $table:literal,
        key: ($($key:ident : $kty:ty),+ $(,)?), columns: [$($col:ident),* $(,)?] $(,)? }) => {
        impl $crate::FencedTable for $ty {
            type Key = ($($kty,)+);
            $(const SCHEMA: &'static str = $schema;)?
            const TABLE: &'static str = $table;
            const KEY_COLUMNS: &'static [&'static str] = &[$(stringify!($key)),+];
            const COLUMNS: &'static [&'static str] = &[$(stringify!($col)),*];
            fn bind_key(&self, q: $crate::PgQuery) -> $crate::PgQuery { q $(.bind(&self.$key))+ }
            fn bind_columns(&self, q: $crate::PgQuery) -> $crate::PgQuery { q $(.bind(&self.$col))* }
            fn bind_key_value(key: &Self::Key, q: $crate::PgQuery) -> $crate::PgQuery {
                #[allow(non_snake_case)]
                let ($($key,)+) = key;
                q $(.bind($key))+
            }
        }
    };
    ($ty:ty { $(schema: $schema:literal,)? table: $table:literal,
        key: $key:ident : $kty:ty, columns: [$($col:ident),* $(,)?] $(,)? }) => {
        impl $crate::FencedTable for $ty {
            type Key = $kty;
            $(const SCHEMA: &'static str = $schema;)?
            const TABLE: &'static str = $table;
            const KEY_COLUMNS: &'static [&'static str] = &[stringify!($key)];
            const COLUMNS: &'static [&'static str] = &[$(stringify!($col)),*];
            fn bind_key(&self, q: $crate::PgQuery) -> $crate::PgQuery { q.bind(&self.$key) }
            fn bind_columns(&self, q: $crate::PgQuery) -> $crate::PgQuery { q $(.bind(&self.$col))* }
            fn bind_key_value(key: &Self::Key, q: $crate::PgQuery) -> $crate::PgQuery { q.bind(key) }
        }
    };
}

/// What a repository write runs on: `&PgPool` (each statement is a transaction of its own)
/// or `&mut PgConnection` (a connection, or `&mut *tx` inside a transaction).
///
/// A write that is rejected needs a second statement on the same connection, to tell stale
/// from not found; and its audit row must outlive the caller's transaction: on a pool that
/// second statement writes it itself, on a connection — which may be inside a transaction
/// that later rolls back — the [`Auditor`]'s own pool writes it. Sealed: implemented for
/// sqlx's pool and connection only.
///
/// A pool is trusted to hand out connections outside any transaction, as sqlx-managed
/// transactions guarantee; a pooled connection left inside a raw `BEGIN` would take the
/// audit row into that dangling transaction.
pub trait WriteExecutor<'c>: sealed::Sealed + Send {
    /// What the write runs on.
    #[doc(hidden)]
    fn into_target(self) -> WriteTarget<'c>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for &sqlx::PgPool {}
    impl Sealed for &mut sqlx::PgConnection {}
}

/// What a [`WriteExecutor`] is.
#[doc(hidden)]
#[derive(Debug)]
pub enum WriteTarget<'c> {
    /// A pool: the write takes one connection for all its statements.
    Pool(&'c PgPool),
    /// The caller's connection, maybe inside its transaction.
    Connection(&'c mut sqlx::PgConnection),
}

impl<'c> WriteExecutor<'c> for &'c PgPool {
    fn into_target(self) -> WriteTarget<'c> {
        WriteTarget::Pool(self)
    }
}

impl<'c> WriteExecutor<'c> for &'c mut sqlx::PgConnection {
    fn into_target(self) -> WriteTarget<'c> {
        WriteTarget::Connection(self)
    }
}

/// The connection a write's statements run on: one checked out of the pool for the whole
/// write, or the caller's.
enum Lent<'c> {
    Pooled(sqlx::pool::PoolConnection<Postgres>),
    Borrowed(&'c mut sqlx::PgConnection),
}

impl<'c> WriteTarget<'c> {
    async fn lend(self) -> sqlx::Result<Lent<'c>> {
        Ok(match self {
            Self::Pool(pool) => Lent::Pooled(pool.acquire().await?),
            Self::Connection(conn) => Lent::Borrowed(conn),
        })
    }
}

impl Lent<'_> {
    fn conn(&mut self) -> &mut sqlx::PgConnection {
        match self {
            Self::Pooled(conn) => conn,
            Self::Borrowed(conn) => conn,
        }
    }

    /// Whether every statement is a transaction of its own: only for a pooled connection
    /// (only the client knows; the server cannot tell autocommit from a transaction block).
    fn own_transaction(&self) -> bool {
        matches!(self, Self::Pooled(_))
    }
}

/// What a write presents: the token, and for the audit trail the resource and holder it came
/// from. Built from a [`FenceToken`] or (with the issuer) from a lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fencing {
    /// The fence token.
    pub token: FenceToken,
    /// The resource the token was issued for, if known (recorded in the audit trail).
    pub resource: Option<Resource>,
    /// Who holds the token (lease owner id, job id...), if known.
    pub holder: Option<String>,
}

impl Fencing {
    /// A bare token with no audit context.
    #[must_use]
    pub fn new(token: FenceToken) -> Self {
        Self {
            token,
            resource: None,
            holder: None,
        }
    }

    /// Adds the resource the token was issued for.
    #[must_use]
    pub fn resource(mut self, resource: Resource) -> Self {
        self.resource = Some(resource);
        self
    }

    /// Adds the holder's identity.
    #[must_use]
    pub fn holder(mut self, holder: impl Into<String>) -> Self {
        self.holder = Some(holder.into());
        self
    }
}

impl Fencing {
    /// Binds the parameters of an explaining statement after the key: the token, the audit
    /// context (resource, holder) and whether the statement is its own transaction.
    fn bind_explain(&self, query: PgQuery, own_transaction: bool) -> PgQuery {
        query
            .bind(self.token.get())
            .bind(self.resource.as_ref().map(|r| r.as_str().to_owned()))
            .bind(self.holder.clone())
            .bind(own_transaction)
    }
}

impl From<FenceToken> for Fencing {
    fn from(token: FenceToken) -> Self {
        Self::new(token)
    }
}

impl From<&Fencing> for Fencing {
    fn from(f: &Fencing) -> Self {
        f.clone()
    }
}

/// What an [`Repository::upsert`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Upserted {
    /// The row did not exist and was inserted.
    Inserted,
    /// The row existed with an older fence and was updated.
    Updated,
}

/// The SQL of one table: each write, and the statement that explains a write that changed
/// nothing.
struct Statements {
    update: SqlStr,
    upsert: SqlStr,
    delete: SqlStr,
    explain_update: SqlStr,
    explain_upsert: SqlStr,
    explain_delete: SqlStr,
}

/// Fenced writes to one table. Cheap to clone; build it once and share it.
///
/// Every method takes the executor to run on — `&PgPool`, or `&mut *tx` to join the caller's
/// transaction — and a token (or a [`Fencing`] with audit context). Rejections are logged and
/// audited through the repository's own pool, outside the caller's transaction.
pub struct Repository<T> {
    table: Arc<TableName>,
    sql: Arc<Statements>,
    auditor: Auditor,
    _row: PhantomData<fn() -> T>,
}

impl<T> Clone for Repository<T> {
    fn clone(&self) -> Self {
        Self {
            table: self.table.clone(),
            sql: self.sql.clone(),
            auditor: self.auditor.clone(),
            _row: PhantomData,
        }
    }
}

impl<T: FencedTable> Repository<T> {
    /// Validates `T`'s declaration and prepares its SQL. `pool` is used for audit records.
    ///
    /// # Errors
    /// [`Error::InvalidIdentifier`] / [`Error::InvalidTable`] for a bad declaration.
    pub fn new(pool: PgPool) -> Result<Self> {
        Self::with_auditor(Auditor::new(pool))
    }

    /// Like [`Repository::new`], but for `table` instead of `T::SCHEMA.T::TABLE`: one row
    /// type for several tables of the same shape (per-tenant schemas, names chosen at run
    /// time).
    ///
    /// # Errors
    /// As [`Repository::new`].
    pub fn for_table(pool: PgPool, table: TableName) -> Result<Self> {
        Self::build(Auditor::new(pool), table)
    }

    pub(crate) fn with_auditor(auditor: Auditor) -> Result<Self> {
        Self::build(auditor, TableName::new(T::SCHEMA, T::TABLE)?)
    }

    fn build(auditor: Auditor, table: TableName) -> Result<Self> {
        let keys = idents(T::KEY_COLUMNS)?;
        let cols = idents(T::COLUMNS)?;
        let invalid = |reason: &str| Error::InvalidTable {
            table: table.quoted(),
            reason: reason.to_owned(),
        };
        if keys.is_empty() {
            return Err(invalid("no key columns"));
        }
        let mut all: Vec<&str> = keys.iter().chain(&cols).map(Ident::as_str).collect();
        if all.contains(&"fence") {
            return Err(invalid(
                "`fence` is managed by pgfence and cannot be a declared column",
            ));
        }
        all.sort_unstable();
        if all.windows(2).any(|w| w[0] == w[1]) {
            return Err(invalid("a column is declared twice"));
        }
        let sql = Statements::build(&table, &keys, &cols, auditor.in_statement_timeout_ms());
        Ok(Self {
            table: Arc::new(table),
            sql: Arc::new(sql),
            auditor,
            _row: PhantomData,
        })
    }

    /// The table this repository writes.
    #[must_use]
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// Updates the existing row `row` (matched by its key) if its fence is older than the
    /// token, setting the declared columns and `fence = token`.
    ///
    /// # Errors
    /// [`Error::StaleToken`] when the row's fence is `>=` the token (audited and logged);
    /// [`Error::NotFound`] when there is no such row; [`Error::Database`] otherwise.
    ///
    /// # Example
    /// ```no_run
    /// # #[derive(Clone)] struct Snapshot { sku: String, payload: String }
    /// # pgfence::fenced_table!(Snapshot { table: "inventory_snapshot", key: sku: String, columns: [payload] });
    /// # async fn f(pool: sqlx::PgPool, token: pgfence::FenceToken) -> pgfence::Result<()> {
    /// let repo = pgfence::Repository::<Snapshot>::new(pool.clone())?;
    /// let mut tx = pool.begin().await?;
    /// repo.update(&mut *tx, token, &Snapshot { sku: "A-1".into(), payload: "{}".into() }).await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn update<'c, E: WriteExecutor<'c>>(
        &self,
        exec: E,
        fencing: impl Into<Fencing>,
        row: &T,
    ) -> Result<()> {
        let fencing = fencing.into();
        let mut lent = exec.into_target().lend().await?;
        let write = row.bind_columns(row.bind_key(sqlx::query(self.sql.update.clone())));
        let done = write.bind(fencing.token.get()).execute(lent.conn()).await?;
        if done.rows_affected() > 0 {
            return Ok(());
        }
        let explain = || row.bind_key(sqlx::query(self.sql.explain_update.clone()));
        let out = explain_row(explain, &fencing, &mut lent).await?;
        self.rejected(&out, &fencing, "update").await
    }

    /// Inserts `row`, or updates it if it exists with an older fence. A row that a newer token
    /// deleted through [`Repository::delete`] is not brought back.
    ///
    /// # Errors
    /// [`Error::StaleToken`] when the existing row's fence (or the tombstone of a row a newer
    /// token deleted) is `>=` the token; [`Error::Database`] otherwise.
    pub async fn upsert<'c, E: WriteExecutor<'c>>(
        &self,
        exec: E,
        fencing: impl Into<Fencing>,
        row: &T,
    ) -> Result<Upserted> {
        let fencing = fencing.into();
        let mut lent = exec.into_target().lend().await?;
        let write = row.bind_columns(row.bind_key(sqlx::query(self.sql.upsert.clone())));
        let done = write
            .bind(fencing.token.get())
            .fetch_optional(lent.conn())
            .await?;
        if let Some(done) = done {
            return Ok(if done.try_get::<bool, _>(0)? {
                Upserted::Inserted
            } else {
                Upserted::Updated
            });
        }
        let explain = || row.bind_key(sqlx::query(self.sql.explain_upsert.clone()));
        let out = explain_row(explain, &fencing, &mut lent).await?;
        // No row but a tombstone: a newer token deleted it.
        if out.row.try_get::<Option<i64>, _>("current")?.is_none()
            && let Some(tomb) = out.row.try_get::<Option<i64>, _>("tombstone")?
        {
            return self.stale(&out, &fencing, tomb, "upsert").await;
        }
        self.rejected(&out, &fencing, "upsert").await
    }

    /// Deletes the row with `key` if its fence is older than the token, and records a
    /// tombstone so that an older token's `upsert` cannot recreate it.
    ///
    /// # Errors
    /// [`Error::StaleToken`] when the row's fence is `>=` the token; [`Error::NotFound`] when
    /// there is no such row; [`Error::Database`] otherwise.
    pub async fn delete<'c, E: WriteExecutor<'c>>(
        &self,
        exec: E,
        fencing: impl Into<Fencing>,
        key: &T::Key,
    ) -> Result<()> {
        let fencing = fencing.into();
        let mut lent = exec.into_target().lend().await?;
        let write = T::bind_key_value(key, sqlx::query(self.sql.delete.clone()));
        let deleted: bool = write
            .bind(fencing.token.get())
            .fetch_one(lent.conn())
            .await?
            .try_get(0)?;
        if deleted {
            return Ok(());
        }
        let explain = || T::bind_key_value(key, sqlx::query(self.sql.explain_delete.clone()));
        let out = explain_row(explain, &fencing, &mut lent).await?;
        self.rejected(&out, &fencing, "delete").await
    }

    /// Classifies a write that changed nothing from its explaining row: the row's fence
    /// (`current`, NULL when there is no row) against the token.
    async fn rejected<R>(
        &self,
        out: &Explained,
        fencing: &Fencing,
        operation: &'static str,
    ) -> Result<R> {
        match out.row.try_get::<Option<i64>, _>("current")? {
            None => Err(Error::NotFound {
                table: self.table.quoted(),
                key: key_text(&out.row),
            }),
            Some(current) if current >= fencing.token.get() => {
                self.stale(out, fencing, current, operation).await
            }
            // The row now has an older fence, yet the write did not apply: it was replaced
            // (deleted and inserted again) while the write ran.
            Some(_) => Err(Error::Contended {
                table: self.table.quoted(),
                operation,
            }),
        }
    }

    async fn stale<R>(
        &self,
        out: &Explained,
        fencing: &Fencing,
        current: i64,
        operation: &'static str,
    ) -> Result<R> {
        let key = key_text(&out.row);
        let rejection = Rejection {
            resource: fencing.resource.as_ref().map(|r| r.as_str().to_owned()),
            table: Some(self.table.quoted()),
            key: Some(key.clone()),
            presented: fencing.token.get(),
            current: Some(current),
            holder: fencing.holder.clone(),
            operation,
        };
        self.auditor.record(&rejection, out.audit_row()?).await;
        Err(Error::stale(
            format!("{} {key}", self.table),
            fencing.token,
            current,
        ))
    }
}

/// The catalog's operators, spelled so that `search_path` cannot substitute others.
const EQ: &str = "OPERATOR(pg_catalog.=)";
const LT: &str = "OPERATOR(pg_catalog.<)";

/// The `audit` column of every explaining statement. For a stale outcome (`current >= token`)
/// of a statement that is its own transaction, it calls `pgfence.record_rejection`, which
/// writes the audit row in that same statement and returns `''` (if it cannot, the statement
/// fails and is explained again without it); NULL otherwise, and then [`Auditor`] writes the
/// row through its own pool. The parameters
/// after the token: resource, holder, and whether the statement is its own transaction
/// (only the client knows: see [`WriteExecutor`]).
fn audit_column(
    table_literal: &str,
    token_param: usize,
    current: &str,
    operation: &str,
    lock_timeout_ms: Option<i32>,
) -> String {
    let Some(ms) = lock_timeout_ms else {
        return "NULL::pg_catalog.text".to_owned();
    };
    let token = format!("${token_param}");
    let (resource, holder) = (
        format!("${}", token_param + 1),
        format!("${}", token_param + 2),
    );
    let own_transaction = format!("${}", token_param + 3);
    format!(
        "CASE WHEN {own_transaction}::pg_catalog.bool \
         AND {current} OPERATOR(pg_catalog.>=) {token} \
         THEN pgfence.record_rejection({resource}::pg_catalog.text, {table_literal}, c.row_key, \
         {token}, {current}, {holder}::pg_catalog.text, '{operation}', {ms}) END"
    )
}

/// An explaining statement's row, and the error of its own audit insert if that failed.
struct Explained {
    row: PgRow,
    audit_error: Option<String>,
}

impl Explained {
    /// Where the rejection's audit row stands after this statement.
    fn audit_row(&self) -> Result<AuditRow> {
        Ok(match &self.audit_error {
            Some(e) => AuditRow::Failed(e.clone()),
            // `pgfence.record_rejection` ran (and wrote the row) or the column is NULL.
            None if self.row.try_get::<Option<String>, _>("audit")?.is_some() => AuditRow::Written,
            None => AuditRow::Pending,
        })
    }
}

/// Runs an explaining statement on the write's connection; `explain` makes the statement with
/// the key bound. When the statement fails in its audit insert (`pgfence.record_rejection`
/// in the error's context), runs it again without the insert and keeps the error, so an
/// audit failure never replaces the rejection.
async fn explain_row(
    explain: impl Fn() -> PgQuery,
    fencing: &Fencing,
    lent: &mut Lent<'_>,
) -> Result<Explained> {
    let own = lent.own_transaction();
    let first = fencing
        .bind_explain(explain(), own)
        .fetch_one(lent.conn())
        .await;
    match first {
        Ok(row) => Ok(Explained {
            row,
            audit_error: None,
        }),
        Err(e) => match audit_failure(&e) {
            Some(audit_error) => {
                let row = fencing
                    .bind_explain(explain(), false)
                    .fetch_one(lent.conn())
                    .await?;
                Ok(Explained {
                    row,
                    audit_error: Some(audit_error),
                })
            }
            None => Err(e.into()),
        },
    }
}

/// The message of an error raised inside `pgfence.record_rejection`.
fn audit_failure(e: &sqlx::Error) -> Option<String> {
    let sqlx::Error::Database(db) = e else {
        return None;
    };
    let pg = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()?;
    pg.r#where()
        .filter(|w| w.contains("pgfence.record_rejection"))
        .map(|_| pg.message().to_owned())
}

fn key_text(out: &PgRow) -> String {
    out.try_get::<Option<String>, _>("row_key")
        .ok()
        .flatten()
        .unwrap_or_default()
}

fn idents(names: &[&str]) -> Result<Vec<Ident>> {
    names.iter().map(|n| Ident::new(*n)).collect()
}

impl Statements {
    /// Builds the statements. Identifiers arrive validated and are quoted by
    /// [`Ident::quoted`]; values are always bind parameters. Every operator, function and
    /// type is schema-qualified (`OPERATOR(pg_catalog.=)`, `pg_catalog.jsonb_build_array`),
    /// so objects on the caller's `search_path` can never stand in for the catalog's.
    ///
    /// Writes: key columns `$1..$k`, then (update/upsert) data columns, then the token. Each is
    /// the bare fenced statement, so an applied write costs one plain statement.
    ///
    /// Explaining statements, sent only after a write changed nothing: key columns `$1..$k`,
    /// the token, the audit context (resource, holder; text, may be NULL) and whether the
    /// statement is its own transaction (bool). They return `current` (the row's fence, NULL
    /// when there is no row), `row_key` (the key as JSON text), for upsert `tombstone` (the
    /// fence of a fenced delete of that key), and `audit` (see [`audit_column`]). They run
    /// on the write's own executor, so inside a transaction they see what it sees; under READ
    /// COMMITTED their snapshot is newer than the write's, which had waited for any
    /// concurrent writer of the row to commit, so they report the fence the write lost to.
    fn build(
        table: &TableName,
        keys: &[Ident],
        cols: &[Ident],
        audit_lock_timeout_ms: Option<i32>,
    ) -> Self {
        let t = table.quoted();
        let k = keys.len();
        let token = format!("${}", k + cols.len() + 1);
        let key_params: Vec<String> = (1..=k).map(|i| format!("${i}")).collect();
        let key_match = keys
            .iter()
            .zip(&key_params)
            .map(|(c, p)| format!("{} {EQ} {p}", c.quoted()))
            .collect::<Vec<_>>()
            .join(" AND ");
        let key_json = format!(
            "pg_catalog.jsonb_build_array({})::pg_catalog.text",
            key_params.join(", ")
        );
        let rel = format!(
            "{}::pg_catalog.regclass::pg_catalog.oid",
            crate::ident::quote_literal(&t).unwrap_or_default()
        );
        let tomb_fence = format!(
            "(SELECT tb.fence FROM pgfence.tombstone tb WHERE tb.rel {EQ} {rel} \
             AND tb.row_key {EQ} {key_json})"
        );

        let set_cols: String = cols
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{} = ${}, ", c.quoted(), k + i + 1))
            .collect();
        let update = format!(
            "UPDATE {t} SET {set_cols}\"fence\" = {token} \
             WHERE {key_match} AND \"fence\" {LT} {token}"
        );

        let all_cols: Vec<String> = keys.iter().chain(cols).map(Ident::quoted).collect();
        let all_params: Vec<String> = (1..=k + cols.len()).map(|i| format!("${i}")).collect();
        let conflict_set: String = cols
            .iter()
            .map(|c| format!("{0} = EXCLUDED.{0}, ", c.quoted()))
            .collect();
        let key_cols: Vec<String> = keys.iter().map(Ident::quoted).collect();
        let upsert = format!(
            "INSERT INTO {t} AS cur ({cols}, \"fence\") \
             SELECT {params}, {token} \
             WHERE coalesce({tomb} {LT} {token}, true) OR EXISTS (SELECT 1 FROM {t} WHERE {key_match}) \
             ON CONFLICT ({keys}) DO UPDATE SET {conflict_set}\"fence\" = EXCLUDED.\"fence\" \
             WHERE cur.\"fence\" {LT} EXCLUDED.\"fence\" \
             RETURNING (xmax {EQ} 0) AS inserted",
            tomb = tomb_fence,
            cols = all_cols.join(", "),
            params = all_params.join(", "),
            keys = key_cols.join(", "),
        );

        let del_token = format!("${}", k + 1);
        let delete = format!(
            "WITH w AS (DELETE FROM {t} WHERE {key_match} AND \"fence\" {LT} {del_token} RETURNING 1), \
             tomb AS (INSERT INTO pgfence.tombstone AS tb (rel, row_key, fence) \
             SELECT {rel}, {key_json}, {del_token} FROM w \
             ON CONFLICT (rel, row_key) DO UPDATE SET fence = greatest(tb.fence, EXCLUDED.fence), deleted_at = pg_catalog.now()) \
             SELECT EXISTS (SELECT 1 FROM w)"
        );

        // Explaining statements: the token is the parameter after the key.
        let table_literal = crate::ident::quote_literal(&t).unwrap_or_default();
        let explain = |operation: &str, with_tombstone: bool| {
            let current = if with_tombstone {
                "coalesce(c.current, c.tombstone)"
            } else {
                "c.current"
            };
            let audit = audit_column(
                &table_literal,
                k + 1,
                current,
                operation,
                audit_lock_timeout_ms,
            );
            let (outer, inner) = if with_tombstone {
                (", c.tombstone", format!(", {tomb_fence} AS tombstone"))
            } else {
                ("", String::new())
            };
            format!(
                "SELECT c.current, c.row_key{outer}, {audit} AS audit FROM (\
                 SELECT (SELECT \"fence\" FROM {t} WHERE {key_match}) AS current, \
                 {key_json} AS row_key{inner} OFFSET 0) c"
            )
        };

        let sql = |s: String| AssertSqlSafe(s).into_sql_str();
        Self {
            update: sql(update),
            upsert: sql(upsert),
            delete: sql(delete),
            explain_update: sql(explain("update", false)),
            explain_upsert: sql(explain("upsert", true)),
            explain_delete: sql(explain("delete", false)),
        }
    }
}

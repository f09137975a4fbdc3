//! Checking a table declaration against the catalog, before the first write.
//!
//! A declaration that does not match its table fails late: a misspelled column at the first
//! write (`42703`), a uuid key declared `String` at the first write too (`42883`, no `uuid =
//! text` operator), an unguarded table never — its writes are fenced by the repository but raw
//! SQL is not. [`Repository::verify`] reads the catalog once (at start-up, or in a test) and
//! reports every mismatch at once, naming the columns.

use crate::error::InvalidInput;
use sqlx::postgres::PgRow;
use sqlx::postgres::types::Oid;
use sqlx::{Column, Executor, Row, Statement, TypeInfo};

use crate::repository::executor::WriteExecutor;
use crate::table::ColumnType;
use crate::{
    Error, FencedTable, Repository, Result,
    table::{Ident, TableName},
};

/// One column of the table, as the catalog has it.
struct CatalogColumn {
    name: String,
    oid: Oid,
    type_name: String,
    not_null: bool,
    generated: bool,
}

impl<T: FencedTable> Repository<T> {
    /// Checks `T`'s declaration against the catalog, without writing anything: the table
    /// exists and is guarded (the `pgfence_guard` trigger, enabled, and a `fence bigint NOT
    /// NULL` column); pgfence is migrated; every declared key and data column exists and can
    /// be written; the key columns are a primary key or unique index (as `upsert` needs); and
    /// the columns' types are compatible with the Rust types that
    /// [`FencedTable::key_types`] / [`FencedTable::column_types`] report (the derive reports
    /// every column; [`fenced_table!`](crate::fenced_table) the key columns only). Call it at
    /// start-up, or in a test, to fail before the first write instead of at it.
    ///
    /// # Errors
    /// [`Error::TableNotFound`] when there is no such table; [`InvalidInput::Table`] listing
    /// every mismatch, each naming its column (`column "stauts" does not exist (did you mean
    /// "status"?)`); [`Error::Backend`] when the catalog cannot be read.
    ///
    /// # Example
    /// ```no_run
    /// #[derive(Clone, sqlx::FromRow, pgfence::FencedTable)]
    /// #[fenced(table = "invoices")]
    /// struct Invoice {
    ///     #[fenced(key)]
    ///     id: i64,
    ///     status: String,
    /// }
    /// # async fn f(pool: sqlx::PgPool) -> pgfence::Result<()> {
    /// let repo = pgfence::Repository::<Invoice>::new(pool.clone())?;
    /// repo.verify(&pool).await?; // at start-up: a typo or a wrong type fails here
    /// # Ok(()) }
    /// ```
    pub async fn verify<'c, E: WriteExecutor<'c>>(&self, exec: E) -> Result<()> {
        let mut lent = exec.into_target().lend().await?;
        let conn = lent.conn();
        let table = self.table();
        let relation = relation(conn, table).await?;
        let columns = catalog_columns(conn, relation.oid).await?;
        let mut problems = relation.problems(table, &columns);
        let typed = declared_columns::<T>(&columns, &mut problems);
        type_problems(conn, table, &typed, &mut problems).await?;
        key_problem::<T>(conn, relation.oid, &columns, &mut problems).await?;
        if problems.is_empty() {
            Ok(())
        } else {
            Err(Error::Invalid(InvalidInput::Table {
                table: table.quoted(),
                reason: problems.join("; "),
            }))
        }
    }
}

/// The table as the catalog has it.
struct Relation {
    oid: Oid,
    /// `relkind`.
    kind: String,
    /// Whether pgfence's schema is installed.
    migrated: bool,
    /// The guard trigger's `tgenabled` (none: no trigger).
    guard: Option<String>,
}

/// Existing declared columns with a Rust type: (what, name, Rust type, catalog type name).
type Typed<'a> = Vec<(&'static str, &'static str, ColumnType, &'a str)>;

/// The table, its kind, its guard trigger, and whether pgfence is migrated.
async fn relation(conn: &mut sqlx::PgConnection, table: &TableName) -> Result<Relation> {
    let found = sqlx::query(
        "SELECT c.oid, c.relkind::pg_catalog.text AS kind, \
         pg_catalog.to_regclass('pgfence.tombstone') IS NOT NULL AS migrated, \
         (SELECT t.tgenabled::pg_catalog.text FROM pg_catalog.pg_trigger t \
           WHERE t.tgrelid OPERATOR(pg_catalog.=) c.oid AND t.tgname OPERATOR(pg_catalog.=) 'pgfence_guard' \
           AND NOT t.tgisinternal) AS guard \
         FROM pg_catalog.pg_class c \
         JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace \
         WHERE n.nspname OPERATOR(pg_catalog.=) $1 AND c.relname OPERATOR(pg_catalog.=) $2",
    )
    .bind(table.schema().as_str())
    .bind(table.name().as_str())
    .fetch_optional(conn)
    .await?;
    let Some(found) = found else {
        return Err(Error::TableNotFound(table.quoted()));
    };
    Ok(Relation {
        oid: found.try_get("oid")?,
        kind: found.try_get("kind")?,
        migrated: found.try_get("migrated")?,
        guard: found.try_get("guard")?,
    })
}

/// The table's columns.
async fn catalog_columns(conn: &mut sqlx::PgConnection, rel: Oid) -> Result<Vec<CatalogColumn>> {
    let columns: Vec<CatalogColumn> = sqlx::query(
        "SELECT a.attname::pg_catalog.text AS name, a.atttypid AS oid, \
         pg_catalog.format_type(a.atttypid, a.atttypmod) AS type_name, \
         a.attnotnull AS not_null, \
         a.attgenerated OPERATOR(pg_catalog.<>) '' AS generated \
         FROM pg_catalog.pg_attribute a \
         WHERE a.attrelid OPERATOR(pg_catalog.=) $1 AND a.attnum OPERATOR(pg_catalog.>) 0 \
         AND NOT a.attisdropped ORDER BY a.attnum",
    )
    .bind(rel)
    .fetch_all(conn)
    .await?
    .iter()
    .map(catalog_column)
    .collect::<Result<_>>()?;

    Ok(columns)
}

impl Relation {
    /// What is wrong with the table itself: its kind, the schema, the guard, the fence column.
    fn problems(&self, table: &TableName, columns: &[CatalogColumn]) -> Vec<String> {
        let kind = &self.kind;
        let mut problems = Vec::new();
        if !matches!(kind.as_str(), "r" | "p") {
            problems.push(format!(
                "{} is not a table (relkind {kind})",
                table.quoted()
            ));
        }
        if !self.migrated {
            problems.push("pgfence is not migrated: run pgfence::admin::migrate".to_owned());
        }
        match self.guard.as_deref() {
            None => problems.push(format!(
                "not guarded: no pgfence_guard trigger (run pgfence::guard::guard or `pgfence guard {}`)",
                table.quoted()
            )),
            Some("D" | "R") => problems.push(
                "the pgfence_guard trigger is disabled (ALTER TABLE ... ENABLE TRIGGER pgfence_guard)"
                    .to_owned(),
            ),
            Some(_) => {}
        }
        match columns.iter().find(|c| c.name == "fence") {
            None => problems
                .push("column \"fence\" does not exist (pgfence::guard::guard adds it)".to_owned()),
            Some(fence) if fence.oid != Oid(20) || !fence.not_null => problems.push(format!(
                "column \"fence\" is {}{}; pgfence needs bigint NOT NULL",
                fence.type_name,
                if fence.not_null { " NOT NULL" } else { "" }
            )),
            Some(_) => {}
        }

        problems
    }
}

/// Every declared key and data column exists and can be written; returns those with a Rust
/// type to compare.
fn declared_columns<'a, T: FencedTable>(
    columns: &'a [CatalogColumn],
    problems: &mut Vec<String>,
) -> Typed<'a> {
    let key_types = T::key_types();
    let column_types = T::column_types();
    let mut typed: Typed<'a> = Vec::new();
    for (declared, types, what) in [
        (T::KEY_COLUMNS, &key_types, "key column"),
        (T::COLUMNS, &column_types, "column"),
    ] {
        if !types.is_empty() && types.len() != declared.len() {
            problems.push(format!(
                "the FencedTable impl reports {} Rust types for {} {what}s",
                types.len(),
                declared.len()
            ));
        }
        let types = (types.len() == declared.len()).then_some(types);
        for (i, name) in declared.iter().enumerate() {
            let Some(col) = columns.iter().find(|c| c.name == *name) else {
                problems.push(format!(
                    "{what} \"{name}\" does not exist{}",
                    did_you_mean(name, columns)
                ));
                continue;
            };
            if col.generated {
                problems.push(format!(
                    "{what} \"{name}\" is a generated column and cannot be written"
                ));
            }
            if let Some(ty) = types.and_then(|t| t.get(i)) {
                typed.push((what, name, ty.clone(), &col.type_name));
            }
        }
    }
    typed
}

/// The declared Rust types against the types as sqlx resolves them.
async fn type_problems(
    conn: &mut sqlx::PgConnection,
    table: &TableName,
    typed: &Typed<'_>,
    problems: &mut Vec<String>,
) -> Result<()> {
    if !typed.is_empty() {
        // The types as sqlx resolves them when it reads these columns (built-in, custom
        // by name, a domain as its base type), from a prepared, never executed SELECT.
        let names: Vec<Ident> = typed
            .iter()
            .map(|(_, name, _, _)| Ident::new(*name))
            .collect::<Result<_>>()?;
        let probe = (&mut *conn)
            .prepare(crate::repository::sql::select_columns(table, &names))
            .await?;
        for ((what, name, ty, db_type), column) in typed.iter().zip(probe.columns()) {
            if !ty.is_compatible(column.type_info()) {
                problems.push(format!(
                    "{what} \"{name}\" is {db_type} in the database but {} in Rust (sqlx binds it as {})",
                    ty.rust_name(),
                    ty.type_info().name().to_lowercase()
                ));
            }
        }
    }

    Ok(())
}

/// The key is a primary key or a unique index.
async fn key_problem<T: FencedTable>(
    conn: &mut sqlx::PgConnection,
    rel: Oid,
    columns: &[CatalogColumn],
    problems: &mut Vec<String>,
) -> Result<()> {
    let unique_keys: Vec<(Vec<String>, i32)> = sqlx::query(
        "SELECT ARRAY(SELECT a.attname::pg_catalog.text \
           FROM pg_catalog.unnest(i.indkey::pg_catalog.int2[]) WITH ORDINALITY AS k(attnum, n) \
           JOIN pg_catalog.pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) i.indrelid \
            AND a.attnum OPERATOR(pg_catalog.=) k.attnum \
           WHERE k.n OPERATOR(pg_catalog.<=) i.indnkeyatts) AS cols, \
         i.indnkeyatts::pg_catalog.int4 AS n \
         FROM pg_catalog.pg_index i \
         WHERE i.indrelid OPERATOR(pg_catalog.=) $1 AND i.indisunique AND i.indisvalid \
         AND i.indpred IS NULL",
    )
    .bind(rel)
    .fetch_all(conn)
    .await?
    .iter()
    .map(|r| Ok((r.try_get("cols")?, r.try_get("n")?)))
    .collect::<Result<_>>()?;

    let mut key: Vec<&str> = T::KEY_COLUMNS.to_vec();
    key.sort_unstable();
    let unique = unique_keys.iter().any(|(cols, n)| {
        let mut cols: Vec<&str> = cols.iter().map(String::as_str).collect();
        cols.sort_unstable();
        usize::try_from(*n).is_ok_and(|n| n == cols.len()) && cols == key
    });
    let key_exists = T::KEY_COLUMNS
        .iter()
        .all(|k| columns.iter().any(|c| c.name == *k));
    if key_exists && !unique {
        problems.push(format!(
            "the key ({}) is not a primary key or unique index: a write could match several \
             rows, and upsert's ON CONFLICT needs one",
            T::KEY_COLUMNS.join(", ")
        ));
    }

    Ok(())
}

fn catalog_column(row: &PgRow) -> Result<CatalogColumn> {
    Ok(CatalogColumn {
        name: row.try_get("name")?,
        oid: row.try_get("oid")?,
        type_name: row.try_get("type_name")?,
        not_null: row.try_get("not_null")?,
        generated: row.try_get("generated")?,
    })
}

/// ` (did you mean "status"?)` when a column is at most two edits from `name`.
fn did_you_mean(name: &str, columns: &[CatalogColumn]) -> String {
    columns
        .iter()
        .filter(|c| c.name != "fence")
        .map(|c| (edit_distance(name, &c.name), &c.name))
        .filter(|(d, _)| *d <= 2)
        .min()
        .map(|(_, c)| format!(" (did you mean \"{c}\"?)"))
        .unwrap_or_default()
}

/// Levenshtein distance, by characters (transposition counts as two).
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut row = Vec::with_capacity(b.len() + 1);
        row.push(i + 1);
        for (j, cb) in b.iter().enumerate() {
            let substitute = prev[j] + usize::from(ca != *cb);
            row.push(substitute.min(prev[j + 1] + 1).min(row[j] + 1));
        }
        prev = row;
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_names_lose_their_paths() {
        assert_eq!(ColumnType::of::<String>().rust_name(), "String");
        assert_eq!(
            ColumnType::of::<Option<Vec<String>>>().rust_name(),
            "Option<Vec<String>>"
        );
        assert_eq!(ColumnType::of::<i64>().rust_name(), "i64");
    }

    #[test]
    fn compatibility_is_sqlx_s() {
        let info = |ty: ColumnType| ty.type_info().clone();
        let text = ColumnType::of::<String>();
        assert!(text.is_compatible(&info(ColumnType::of::<&str>())));
        assert!(!text.is_compatible(&info(ColumnType::of::<i64>())));
        assert!(!ColumnType::of::<i32>().is_compatible(&info(ColumnType::of::<i64>())));
        assert!(ColumnType::of::<Option<i64>>().is_compatible(&info(ColumnType::of::<i64>())));
    }

    #[test]
    fn near_misses() {
        assert_eq!(edit_distance("stauts", "status"), 2);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("amount", "amount"), 0);
    }
}

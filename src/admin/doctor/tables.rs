//! The guarded tables: triggers, fence columns, observe mode, the fences rows carry.

use sqlx::PgConnection;

use sqlx::AssertSqlSafe;

use super::{DoctorOptions, Finding, FindingKind, Severity, may, not_permitted};
use crate::Result;
use crate::table::TableName;
use crate::token::{MAX_TOKEN, StoredFence};

/// One guarded (or formerly guarded) table, from the catalog.
#[derive(sqlx::FromRow)]
struct TableRow {
    schema: String,
    name: String,
    /// `format('%I.%I')`, as the trigger writes it in audit rows.
    audit_name: String,
    has_trigger: bool,
    enabled: Option<String>,
    mode: Option<String>,
    fence_type: Option<String>,
    fence_not_null: Option<bool>,
    /// The connected role may read the table (`USAGE` on its schema and `SELECT`).
    readable: bool,
}

/// Table checks; returns `(table, highest token)` of every scanned table.
pub(super) async fn tables(
    pool: &mut PgConnection,
    options: &DoctorOptions,
    findings: &mut Vec<Finding>,
) -> Result<Vec<(String, i64)>> {
    if !may(pool, "guarded_table", "SELECT").await? {
        findings.push(not_permitted(
            "pgfence.guarded_table",
            "guarded tables (triggers, fence columns, highest tokens) were",
            "SELECT on pgfence.guarded_table",
        ));
        return Ok(Vec::new());
    }
    let audit_readable = may(pool, "audit", "SELECT").await?;
    let rows: Vec<TableRow> = sqlx::query_as(
        "SELECT n.nspname::pg_catalog.text AS schema, c.relname::pg_catalog.text AS name,
                pg_catalog.format('%I.%I', n.nspname, c.relname) AS audit_name,
                t.oid IS NOT NULL AS has_trigger,
                t.tgenabled::pg_catalog.text AS enabled,
                CASE WHEN t.oid IS NOT NULL THEN pgfence.trigger_mode(t.tgnargs, t.tgargs) END AS mode,
                pg_catalog.format_type(a.atttypid, a.atttypmod) AS fence_type,
                a.attnotnull AS fence_not_null,
                pg_catalog.has_schema_privilege(n.oid, 'USAGE')
                    AND pg_catalog.has_table_privilege(c.oid, 'SELECT') AS readable
           FROM pg_catalog.pg_class c
           JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace
           LEFT JOIN pg_catalog.pg_trigger t ON t.tgrelid OPERATOR(pg_catalog.=) c.oid
                AND t.tgname OPERATOR(pg_catalog.=) 'pgfence_guard' AND NOT t.tgisinternal
           LEFT JOIN pgfence.guarded_table g ON g.rel OPERATOR(pg_catalog.=) c.oid
           LEFT JOIN pg_catalog.pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) c.oid
                AND a.attname OPERATOR(pg_catalog.=) 'fence' AND NOT a.attisdropped
          WHERE t.oid IS NOT NULL OR g.rel IS NOT NULL
          ORDER BY 1, 2",
    )
    .fetch_all(&mut *pool)
    .await?;
    let limit = MAX_TOKEN.saturating_sub(options.limit_margin);
    let mut highest = Vec::new();
    for row in rows {
        let table = TableName::new(&row.schema, &row.name)?;
        let object = table.quoted();
        let guard_cmd = format!("`pgfence guard '{object}'`");
        trigger(&row, &object, &guard_cmd, findings);
        if row.mode.as_deref() == Some("observe") {
            observe_mode(pool, &row, &object, audit_readable, findings).await?;
        }
        if !fence_column(&row, &object, &guard_cmd, findings) || !options.scan_tables {
            continue;
        }
        if !row.readable {
            findings.push(not_permitted(
                &object,
                "the table's fences were",
                &format!("SELECT on {object}"),
            ));
            continue;
        }
        if let Some(token) = fences(pool, &object, &guard_cmd, limit, findings).await? {
            highest.push((object, token));
        }
    }
    Ok(highest)
}

/// The guard trigger: there, and enabled.
fn trigger(row: &TableRow, object: &str, guard_cmd: &str, findings: &mut Vec<Finding>) {
    if !row.has_trigger {
        findings.push(
            Finding::new(Severity::Error, FindingKind::TriggerMissing, object)
                .says("the table was guarded but its pgfence_guard trigger is gone: no update is fenced")
                .fix(format!("run {guard_cmd} (or `pgfence unguard` if it should not be guarded)")),
        );
    } else if !matches!(row.enabled.as_deref(), Some("O" | "A")) {
        findings.push(
            Finding::new(Severity::Error, FindingKind::TriggerDisabled, object)
                .says("the pgfence_guard trigger is disabled: no update is fenced")
                .fix(format!(
                    "run {guard_cmd} (re-enables it) or ALTER TABLE {object} ENABLE TRIGGER pgfence_guard"
                )),
        );
    }
}

/// A table in observe mode: how many unfenced updates it recorded.
async fn observe_mode(
    pool: &mut PgConnection,
    row: &TableRow,
    object: &str,
    audit_readable: bool,
    findings: &mut Vec<Finding>,
) -> Result<()> {
    if !audit_readable {
        findings.push(
            Finding::new(Severity::Info, FindingKind::ObserveMode, object)
                .says("guarded in observe mode (its recorded unfenced updates not counted: no SELECT on pgfence.audit)"),
        );
        return Ok(());
    }
    let (count, last): (i64, Option<time::OffsetDateTime>) = sqlx::query_as(
        "SELECT pg_catalog.count(*), pg_catalog.max(at) FROM pgfence.audit
          WHERE operation OPERATOR(pg_catalog.=) 'observe'
            AND table_name OPERATOR(pg_catalog.=) $1",
    )
    .bind(&row.audit_name)
    .fetch_one(&mut *pool)
    .await?;
    let last = last
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .map(|t| format!(", the last at {t}"))
        .unwrap_or_default();
    findings.push(
        Finding::new(Severity::Info, FindingKind::ObserveMode, object)
            .says(format!(
                "guarded in observe mode: {count} unfenced update(s) recorded in pgfence.audit{last}"
            ))
            .fix(format!(
                "once no new `observe` rows appear, run `pgfence guard --enforce '{object}'`"
            )),
    );
    Ok(())
}

/// The fence column: there, `bigint`, `NOT NULL`. `false` when the table's fences cannot be
/// read as fences (no column, or another type).
fn fence_column(
    row: &TableRow,
    object: &str,
    guard_cmd: &str,
    findings: &mut Vec<Finding>,
) -> bool {
    match row.fence_type.as_deref() {
        None => {
            findings.push(
                Finding::new(Severity::Error, FindingKind::FenceColumnMissing, object)
                    .says("the guarded table has no fence column")
                    .fix(format!("run {guard_cmd}")),
            );
            return false;
        }
        Some("bigint") => {}
        Some(other) => {
            findings.push(
                Finding::new(Severity::Error, FindingKind::FenceColumnType, object)
                    .says(format!("the fence column has type {other}, not bigint"))
                    .fix(format!(
                        "ALTER TABLE {object} ALTER COLUMN fence TYPE bigint, then run {guard_cmd}"
                    )),
            );
            return false;
        }
    }
    if row.fence_not_null != Some(true) {
        findings.push(
            Finding::new(Severity::Error, FindingKind::FenceColumnNullable, object)
                .says("the fence column is nullable: an update that sets it to NULL is not fenced")
                .fix(format!(
                    "run {guard_cmd} (fills NULLs with 0 and sets NOT NULL)"
                )),
        );
    }
    true
}

/// The fences the table's rows carry: NULL or negative ones, the highest token, one close to
/// the limit. Returns the highest token (none for an empty table).
async fn fences(
    pool: &mut PgConnection,
    object: &str,
    guard_cmd: &str,
    limit: i64,
    findings: &mut Vec<Finding>,
) -> Result<Option<i64>> {
    // The name comes from the catalog and is quoted by TableName.
    let (max, min, nulls): (Option<i64>, Option<i64>, i64) =
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT pg_catalog.max(fence), pg_catalog.min(fence), \
             pg_catalog.count(*) FILTER (WHERE fence IS NULL) FROM {object}"
        )))
        .fetch_one(&mut *pool)
        .await?;
    if nulls > 0 {
        findings.push(
            Finding::new(Severity::Error, FindingKind::FenceInvalid, object)
                .says(format!("{nulls} row(s) have a NULL fence"))
                .fix(format!("run {guard_cmd} (fills NULLs with 0)")),
        );
    }
    if let Some(min) = min.filter(|m| *m < 0) {
        findings.push(
            Finding::new(Severity::Error, FindingKind::FenceInvalid, object)
                .says(format!(
                    "rows have a negative fence (lowest {min}), which decodes to no valid token"
                ))
                .fix("find them with `SELECT ... WHERE fence < 0`; a fence is written by pgfence.next_fence or the repository only"),
        );
    }
    let Some(max) = max else { return Ok(None) };
    let token = StoredFence::from_raw(max).token();
    findings.push(
        Finding::new(Severity::Info, FindingKind::HighestToken, object)
            .says(format!("highest token {token} (fence {max})")),
    );
    if token > limit {
        findings.push(
            Finding::new(Severity::Error, FindingKind::FenceNearLimit, object)
                .says(format!(
                    "a row carries token {token}, within {} of the largest token ({MAX_TOKEN}): no issuer's counter gets there, so every real lease is locked out of that row (a forged or corrupted fence; a row's first token is not bounded by pgfence.max_token_jump())",
                    MAX_TOKEN - token
                ))
                .fix(format!(
                    "find the writer (pgfence audit, the server log); as the table's owner: BEGIN; ALTER TABLE {object} DISABLE TRIGGER pgfence_guard; UPDATE {object} SET fence = (N::bigint << 24) | 16777215 WHERE fence >> 24 > {limit}; ALTER TABLE {object} ENABLE TRIGGER pgfence_guard; COMMIT; with N the highest token the issuer handed out (docs/operations.md, \"Fence poisoning\")"
                )),
        );
    }
    Ok(Some(token))
}

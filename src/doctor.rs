//! [`doctor`]: checks a database (and optionally the Redis counters) for the ways a pgfence
//! setup goes wrong quietly, and reports each as a typed [`Finding`].
//!
//! What it checks, in order:
//!
//! | kind | severity | when |
//! |---|---|---|
//! | [`SchemaNotMigrated`](FindingKind::SchemaNotMigrated) | error | no `pgfence` schema / history (the other checks are skipped) |
//! | [`SchemaBehind`](FindingKind::SchemaBehind) | error | migrations of this version are not applied (the other checks are skipped) |
//! | [`SchemaAhead`](FindingKind::SchemaAhead) | warning | the database has migrations this version does not know |
//! | [`TriggerMissing`](FindingKind::TriggerMissing) | error | a table `guard` guarded has no `pgfence_guard` trigger any more (and `unguard` was not run) |
//! | [`TriggerDisabled`](FindingKind::TriggerDisabled) | error | `ALTER TABLE ... DISABLE TRIGGER` (or `ENABLE REPLICA TRIGGER`): nothing is enforced |
//! | [`FenceColumnMissing`](FindingKind::FenceColumnMissing), [`FenceColumnType`](FindingKind::FenceColumnType), [`FenceColumnNullable`](FindingKind::FenceColumnNullable) | error | a guarded table's `fence` is gone, not `bigint`, or nullable (a `NULL` fence slips past the trigger) |
//! | [`ObserveMode`](FindingKind::ObserveMode) | info | a table is guarded in observe mode (how many unfenced writes were recorded) |
//! | [`FenceInvalid`](FindingKind::FenceInvalid) | error | rows with a negative fence (no valid token) |
//! | [`FenceNearLimit`](FindingKind::FenceNearLimit) | error (a row or resource mark: no counter gets there, real leases are locked out) / warning (an issuer's counter) | a row, resource mark or counter above [`MAX_TOKEN`] − [`DoctorOptions::limit_margin`] |
//! | [`HighestToken`](FindingKind::HighestToken) | info | the highest token on each guarded table |
//! | [`TokenAboveCounters`](FindingKind::TokenAboveCounters) | warning | a table's highest token is above every Redis counter doctor read |
//! | [`CounterBelowMark`](FindingKind::CounterBelowMark) | error | a Redis counter below Postgres's high-water mark: it went backwards (failover), new leases are rejected |
//! | [`RedisUnavailable`](FindingKind::RedisUnavailable) | error | Redis could not be read |
//! | [`InvalidIssuerUrl`](FindingKind::InvalidIssuerUrl) | error | the issuer URL did not parse (reported by the CLI: nothing was connected to) |
//! | [`CountersNotChecked`](FindingKind::CountersNotChecked) | info | no issuer was given, or a recorded resource name is not a valid [`Resource`] |
//! | [`AuditRetention`](FindingKind::AuditRetention) | warning | audit rows older than [`DoctorOptions::audit_retention`] |
//! | [`TimelineCheckOff`](FindingKind::TimelineCheckOff) | info | the database cannot tell its timeline (no WAL functions: Aurora without logical replication, or revoked): failover fencing by timeline is off; what is not protected, and where that is acceptable |
//! | [`Protections`](FindingKind::Protections) | info | what is in force: the timeline check, the guarded tables by mode, the connected role's standing |
//! | [`NotPermitted`](FindingKind::NotPermitted) | warning | a check doctor could not make: the connected role lacks a privilege it needs (run doctor as the schema's owner for the full report); not a problem ([`Finding::is_problem`]) |
//!
//! Counters: for each resource in `pgfence.resource_fence` (resources that ran
//! `pgfence.check`) and each of [`DoctorOptions::resources`], doctor compares the token of
//! `pgfence.high_water(resource)` with the Redis counter ([`RedisIssuer::status`](crate::RedisIssuer::status)). Rows carry no
//! resource name, so a table's highest token (the token of `max(fence)`) is only compared with the
//! highest counter doctor read: above it means the table was written by a counter doctor was
//! not told about (list its resource in [`DoctorOptions::resources`]), or one that went
//! backwards. Reading `max(fence)` scans each guarded table; turn it off with
//! [`DoctorOptions::scan_tables`] on very large tables.

use std::time::Duration;

use futures_util::StreamExt;
use serde::Serialize;
use sqlx::{Acquire, AssertSqlSafe, PgConnection, Postgres};

use crate::{
    Resource, Result, TokenIssuer,
    table::TableName,
    token::{MAX_TOKEN, StoredFence},
};

/// How close to [`MAX_TOKEN`] a token may come before doctor warns by default (2^20 tokens).
pub const DEFAULT_LIMIT_MARGIN: i64 = 1 << 20;

/// How many counter reads `doctor` keeps in flight: a pipelined round trip's worth, few
/// enough that a pooled issuer (PostgreSQL) only queues for its connections.
const STATUS_READS_IN_FLIGHT: usize = 64;

/// How serious a [`Finding`] is. Only [`Severity::Info`] findings leave a setup "clean".
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// For information (a table in observe mode, the highest token per table).
    Info,
    /// Needs attention soon (old audit rows, tokens near the limit).
    Warning,
    /// Fencing is not (or not fully) in force.
    Error,
}

/// What a [`Finding`] is about. docs/operations.md ("`pgfence doctor`") says when each is reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum FindingKind {
    /// No `pgfence` schema or migration history.
    SchemaNotMigrated,
    /// Migrations of this version are not applied.
    SchemaBehind,
    /// The database has migrations this version does not know.
    SchemaAhead,
    /// A guarded table's trigger was dropped.
    TriggerMissing,
    /// A guarded table's trigger is disabled.
    TriggerDisabled,
    /// A guarded table has no `fence` column.
    FenceColumnMissing,
    /// A guarded table's `fence` column is not `bigint`.
    FenceColumnType,
    /// A guarded table's `fence` column is nullable.
    FenceColumnNullable,
    /// A table is guarded in observe mode.
    ObserveMode,
    /// Rows whose fence decodes to no valid token.
    FenceInvalid,
    /// A token close to [`MAX_TOKEN`].
    FenceNearLimit,
    /// The highest token on a guarded table.
    HighestToken,
    /// A table's highest token is above every counter doctor read.
    TokenAboveCounters,
    /// A Redis counter is below Postgres's high-water mark.
    CounterBelowMark,
    /// Redis could not be read.
    RedisUnavailable,
    /// The issuer URL did not parse: no issuer was connected to.
    InvalidIssuerUrl,
    /// Some counters were not compared.
    CountersNotChecked,
    /// Audit rows older than the retention.
    AuditRetention,
    /// A check was skipped: the connected role lacks a privilege it needs.
    NotPermitted,
    /// The database was promoted to a new timeline (a failover) that nobody acknowledged
    /// yet: leases that wrote before it are fenced out, and with asynchronous replication
    /// the promotion may have lost commits ([`acknowledge_failover`] once checked).
    FailedOver,
    /// The database cannot tell its timeline (its WAL functions are not available: Amazon
    /// Aurora without logical replication, or EXECUTE revoked from PUBLIC), so failover
    /// fencing by timeline is off there (`pgfence.timeline_check`).
    TimelineCheckOff,
    /// Which protections are in force on this database, for the connected role: the timeline
    /// check, the guarded tables by mode, and the role's standing.
    Protections,
}

/// One finding: what, about which object, why, and what to do.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// How serious it is.
    pub severity: Severity,
    /// What kind of problem.
    pub kind: FindingKind,
    /// The object: a quoted table, `resource <name>`, `schema pgfence`, `pgfence.audit`.
    pub object: String,
    /// What doctor found.
    pub message: String,
    /// What to do about it, if anything.
    pub suggestion: Option<String>,
}

impl Finding {
    /// Whether this finding makes the setup unhealthy: anything but [`Severity::Info`], except
    /// [`FindingKind::NotPermitted`] (a check the connected role may not make says nothing
    /// about the setup: the application role's doctor is clean when all it can check is).
    #[must_use]
    pub fn is_problem(&self) -> bool {
        self.severity != Severity::Info && self.kind != FindingKind::NotPermitted
    }

    fn new(severity: Severity, kind: FindingKind, object: impl Into<String>) -> Self {
        Self {
            severity,
            kind,
            object: object.into(),
            message: String::new(),
            suggestion: None,
        }
    }

    fn says(mut self, message: impl Into<String>) -> Self {
        self.message = message.into();
        self
    }

    fn fix(mut self, suggestion: impl Into<String>) -> Self {
        self.suggestion = Some(suggestion.into());
        self
    }
}

/// What [`doctor`] checks beyond the defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DoctorOptions {
    /// Report audit rows older than this ([`FindingKind::AuditRetention`]). Default: not checked.
    pub audit_retention: Option<Duration>,
    /// Read `max(fence)` / `min(fence)` of every guarded table (a scan). Default: `true`.
    pub scan_tables: bool,
    /// Resources whose counters to compare besides those in `pgfence.resource_fence`.
    pub resources: Vec<Resource>,
    /// Warn about tokens above `MAX_TOKEN - limit_margin`. Default: [`DEFAULT_LIMIT_MARGIN`].
    pub limit_margin: i64,
}

impl Default for DoctorOptions {
    fn default() -> Self {
        Self {
            audit_retention: None,
            scan_tables: true,
            resources: Vec::new(),
            limit_margin: DEFAULT_LIMIT_MARGIN,
        }
    }
}

impl DoctorOptions {
    /// Reports audit rows older than `retention`.
    #[must_use]
    pub fn audit_retention(mut self, retention: Duration) -> Self {
        self.audit_retention = Some(retention);
        self
    }

    /// Whether to scan guarded tables for their highest and lowest fence.
    #[must_use]
    pub fn scan_tables(mut self, scan: bool) -> Self {
        self.scan_tables = scan;
        self
    }

    /// Also compares these resources' counters with their high-water marks.
    #[must_use]
    pub fn resources(mut self, resources: impl IntoIterator<Item = Resource>) -> Self {
        self.resources.extend(resources);
        self
    }

    /// Warns about tokens above `MAX_TOKEN - margin`.
    #[must_use]
    pub fn limit_margin(mut self, margin: i64) -> Self {
        self.limit_margin = margin.max(0);
        self
    }
}

/// Checks the database behind `conn` (a pool, a connection or a transaction; and, with
/// `issuer`, its counters) and returns every finding, most serious first. An empty list, or
/// one with no problem ([`Finding::is_problem`]: only [`Severity::Info`] and
/// [`FindingKind::NotPermitted`] findings), means healthy.
///
/// Read-only. docs/operations.md ("`pgfence doctor`") lists the checks. Each check first asks whether
/// the connected role may read what it needs; a check it may not make is reported as
/// [`FindingKind::NotPermitted`] (naming the privilege), never as an error or a failed
/// migration — so doctor as the application role says what it could check and what needs the
/// owner.
///
/// # Errors
/// [`crate::Error::Database`] when PostgreSQL cannot be read. Redis failures are findings
/// ([`FindingKind::RedisUnavailable`]), not errors.
///
/// # Example
/// ```no_run
/// # async fn f(pool: sqlx::PgPool, issuer: pgfence::RedisIssuer) -> pgfence::Result<()> {
/// use std::time::Duration;
/// let options = pgfence::admin::DoctorOptions::default().audit_retention(Duration::from_secs(30 * 86_400));
/// for finding in pgfence::admin::doctor(&pool, Some(&issuer), &options).await? {
///     println!("{:?} {}: {}", finding.severity, finding.object, finding.message);
/// }
/// # Ok(()) }
/// ```
pub async fn doctor<'c, A>(
    conn: A,
    issuer: Option<&dyn TokenIssuer>,
    options: &DoctorOptions,
) -> Result<Vec<Finding>>
where
    A: Acquire<'c, Database = Postgres>,
{
    let mut conn = conn.acquire().await?;
    let pool = &mut *conn;
    let mut findings = Vec::new();
    if schema(pool, &mut findings).await? {
        protections(pool, &mut findings).await?;
        failover(pool, &mut findings).await?;
        let highest = tables(pool, options, &mut findings).await?;
        counters(pool, issuer, options, &highest, &mut findings).await?;
        audit(pool, options, &mut findings).await?;
    }
    findings.sort_by_key(|f| std::cmp::Reverse(f.severity));
    Ok(findings)
}

/// Whether the connected role holds `privilege` on pgfence's `object` (`USAGE` on the schema
/// included); `false` for a missing object. Asked through the catalog by OID, so a role
/// without `USAGE` on the schema gets an answer, not an error.
async fn may(conn: &mut PgConnection, object: &str, privilege: &str) -> Result<bool> {
    let allowed: Option<bool> = sqlx::query_scalar(
        "SELECT CASE WHEN c.oid IS NOT NULL
                     THEN pg_catalog.has_schema_privilege(c.relnamespace, 'USAGE')
                          AND pg_catalog.has_table_privilege(c.oid, $2) END
           FROM (SELECT) AS one
           LEFT JOIN pg_catalog.pg_class c
                  ON c.relname OPERATOR(pg_catalog.=) $1
                 AND c.relnamespace OPERATOR(pg_catalog.=) (SELECT n.oid FROM pg_catalog.pg_namespace n
                                                            WHERE n.nspname OPERATOR(pg_catalog.=) 'pgfence')",
    )
    .bind(object)
    .bind(privilege)
    .fetch_one(&mut *conn)
    .await?;
    Ok(allowed == Some(true))
}

/// A [`FindingKind::NotPermitted`] finding: `what` was not checked without `privilege`.
fn not_permitted(object: impl Into<String>, what: &str, privilege: &str) -> Finding {
    Finding::new(Severity::Warning, FindingKind::NotPermitted, object)
        .says(format!(
            "{what} not checked: the connected role lacks {privilege}"
        ))
        .fix("run `pgfence doctor` as the owner of schema pgfence (or a role that may read it) for the full report")
}

/// The schema check; `true` when the other checks can run.
async fn schema(pool: &mut PgConnection, findings: &mut Vec<Finding>) -> Result<bool> {
    let object = "schema pgfence";
    let (present, usage, versioned): (bool, Option<bool>, Option<bool>) = sqlx::query_as(
        "SELECT n.oid IS NOT NULL AND EXISTS (
                    SELECT FROM pg_catalog.pg_class c
                     WHERE c.relnamespace OPERATOR(pg_catalog.=) n.oid
                       AND c.relname OPERATOR(pg_catalog.=) 'refinery_schema_history'),
                CASE WHEN n.oid IS NOT NULL THEN pg_catalog.has_schema_privilege(n.oid, 'USAGE') END,
                CASE WHEN p.oid IS NOT NULL THEN pg_catalog.has_function_privilege(p.oid, 'EXECUTE') END
           FROM (SELECT) AS one
           LEFT JOIN pg_catalog.pg_namespace n ON n.nspname OPERATOR(pg_catalog.=) 'pgfence'
           LEFT JOIN pg_catalog.pg_proc p ON p.pronamespace OPERATOR(pg_catalog.=) n.oid
                AND p.proname OPERATOR(pg_catalog.=) 'schema_version'",
    )
    .fetch_one(&mut *pool)
    .await?;
    if !present {
        findings.push(
            Finding::new(Severity::Error, FindingKind::SchemaNotMigrated, object)
                .says("pgfence's schema is not migrated in this database (other checks skipped)")
                .fix("run `pgfence migrate` (or pgfence::admin::migrate)"),
        );
        return Ok(false);
    }
    if usage != Some(true) {
        findings.push(not_permitted(
            object,
            "the schema and everything in it were",
            "USAGE on schema pgfence (`pgfence grant ROLE` gives it)",
        ));
        return Ok(false);
    }
    if !may(pool, "refinery_schema_history", "SELECT").await? {
        // The application role: the version is readable, the history is not.
        if versioned != Some(true) {
            findings.push(not_permitted(
                object,
                "which migrations are applied was",
                "SELECT on pgfence.refinery_schema_history (and the schema has no pgfence.schema_version(), added by V7: it is behind this version)",
            ));
            return Ok(false);
        }
        let (version, applied): (i32, i32) =
            sqlx::query_as("SELECT version, applied FROM pgfence.schema_version()")
                .fetch_one(&mut *pool)
                .await?;
        let latest = crate::migrate::latest_version();
        if version > latest {
            findings.push(
                Finding::new(Severity::Warning, FindingKind::SchemaAhead, object)
                    .says(format!(
                        "the database has pgfence migration V{version}, newer than this version knows (V{latest})"
                    ))
                    .fix("upgrade this pgfence (library or CLI) to the version that migrated the database"),
            );
        } else if version < latest || i64::from(applied) < i64::from(latest) {
            findings.push(
                Finding::new(Severity::Error, FindingKind::SchemaBehind, object)
                    .says(format!(
                        "pgfence's schema is behind: V{version} applied, this version ships V{latest} (other checks skipped)"
                    ))
                    .fix("run `pgfence migrate` as the schema's owner"),
            );
            return Ok(false);
        }
        return Ok(true);
    }
    let status = match crate::admin::migration_status(&mut *pool).await {
        Err(e @ crate::Error::UnreleasedMigrations { .. }) => {
            findings.push(
                Finding::new(Severity::Error, FindingKind::SchemaBehind, object)
                    .says(format!("{e} (other checks skipped)"))
                    .fix("delete the unreleased build's history rows (V7 to V13) as the schema's owner, then run `pgfence migrate`"),
            );
            return Ok(false);
        }
        status => status?,
    };
    let pending: Vec<String> = status
        .iter()
        .filter(|m| m.applied_on.is_none())
        .map(|m| format!("V{}__{}", m.version, m.name))
        .collect();
    let known = status.iter().map(|m| m.version).max().unwrap_or(0);
    let applied: Option<i32> =
        sqlx::query_scalar("SELECT pg_catalog.max(version) FROM pgfence.refinery_schema_history")
            .fetch_one(&mut *pool)
            .await?;
    if let Some(applied) = applied.filter(|v| *v > known) {
        findings.push(
            Finding::new(Severity::Warning, FindingKind::SchemaAhead, object)
                .says(format!(
                    "the database has pgfence migration V{applied}, newer than this version knows (V{known})"
                ))
                .fix("upgrade this pgfence (library or CLI) to the version that migrated the database"),
        );
    }
    if pending.is_empty() {
        return Ok(true);
    }
    findings.push(
        Finding::new(Severity::Error, FindingKind::SchemaBehind, object)
            .says(format!(
                "pgfence's schema is behind: {} not applied (other checks skipped)",
                pending.join(", ")
            ))
            .fix("run `pgfence migrate` (or pgfence::admin::migrate)"),
    );
    Ok(false)
}

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
async fn tables(
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
        if !row.has_trigger {
            findings.push(
                Finding::new(Severity::Error, FindingKind::TriggerMissing, &object)
                    .says("the table was guarded but its pgfence_guard trigger is gone: no update is fenced")
                    .fix(format!("run {guard_cmd} (or `pgfence unguard` if it should not be guarded)")),
            );
        } else if !matches!(row.enabled.as_deref(), Some("O" | "A")) {
            findings.push(
                Finding::new(Severity::Error, FindingKind::TriggerDisabled, &object)
                    .says("the pgfence_guard trigger is disabled: no update is fenced")
                    .fix(format!(
                        "run {guard_cmd} (re-enables it) or ALTER TABLE {object} ENABLE TRIGGER pgfence_guard"
                    )),
            );
        }
        if row.mode.as_deref() == Some("observe") && !audit_readable {
            findings.push(
                Finding::new(Severity::Info, FindingKind::ObserveMode, &object)
                    .says("guarded in observe mode (its recorded unfenced updates not counted: no SELECT on pgfence.audit)"),
            );
        } else if row.mode.as_deref() == Some("observe") {
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
                Finding::new(Severity::Info, FindingKind::ObserveMode, &object)
                    .says(format!(
                        "guarded in observe mode: {count} unfenced update(s) recorded in pgfence.audit{last}"
                    ))
                    .fix(format!(
                        "once no new `observe` rows appear, run `pgfence guard --enforce '{object}'`"
                    )),
            );
        }
        match row.fence_type.as_deref() {
            None => {
                findings.push(
                    Finding::new(Severity::Error, FindingKind::FenceColumnMissing, &object)
                        .says("the guarded table has no fence column")
                        .fix(format!("run {guard_cmd}")),
                );
                continue;
            }
            Some("bigint") => {}
            Some(other) => {
                findings.push(
                    Finding::new(Severity::Error, FindingKind::FenceColumnType, &object)
                        .says(format!("the fence column has type {other}, not bigint"))
                        .fix(format!(
                            "ALTER TABLE {object} ALTER COLUMN fence TYPE bigint, then run {guard_cmd}"
                        )),
                );
                continue;
            }
        }
        if row.fence_not_null != Some(true) {
            findings.push(
                Finding::new(Severity::Error, FindingKind::FenceColumnNullable, &object)
                    .says("the fence column is nullable: an update that sets it to NULL is not fenced")
                    .fix(format!("run {guard_cmd} (fills NULLs with 0 and sets NOT NULL)")),
            );
        }
        if !options.scan_tables {
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
                Finding::new(Severity::Error, FindingKind::FenceInvalid, &object)
                    .says(format!("{nulls} row(s) have a NULL fence"))
                    .fix(format!("run {guard_cmd} (fills NULLs with 0)")),
            );
        }
        if let Some(min) = min.filter(|m| *m < 0) {
            findings.push(
                Finding::new(Severity::Error, FindingKind::FenceInvalid, &object)
                    .says(format!(
                        "rows have a negative fence (lowest {min}), which decodes to no valid token"
                    ))
                    .fix("find them with `SELECT ... WHERE fence < 0`; a fence is written by pgfence.next_fence or the repository only"),
            );
        }
        let Some(max) = max else { continue };
        let token = StoredFence::from_raw(max).token();
        highest.push((object.clone(), token));
        findings.push(
            Finding::new(Severity::Info, FindingKind::HighestToken, &object)
                .says(format!("highest token {token} (fence {max})")),
        );
        if token > limit {
            findings.push(
                Finding::new(Severity::Error, FindingKind::FenceNearLimit, &object)
                    .says(format!(
                        "a row carries token {token}, within {} of the largest token ({MAX_TOKEN}): no issuer's counter gets there, so every real lease is locked out of that row (a forged or corrupted fence; a row's first token is not bounded by pgfence.max_token_jump())",
                        MAX_TOKEN - token
                    ))
                    .fix(format!(
                        "find the writer (pgfence audit, the server log); as the table's owner: BEGIN; ALTER TABLE {object} DISABLE TRIGGER pgfence_guard; UPDATE {object} SET fence = (N::bigint << 24) | 16777215 WHERE fence >> 24 > {limit}; ALTER TABLE {object} ENABLE TRIGGER pgfence_guard; COMMIT; with N the highest token the issuer handed out (docs/operations.md, \"Fence poisoning\")"
                    )),
            );
        }
    }
    Ok(highest)
}

/// Counter checks.
async fn counters(
    pool: &mut PgConnection,
    issuer: Option<&dyn TokenIssuer>,
    options: &DoctorOptions,
    highest: &[(String, i64)],
    findings: &mut Vec<Finding>,
) -> Result<()> {
    let limit = MAX_TOKEN.saturating_sub(options.limit_margin);
    let marks: Vec<(String, i64)> = if may(pool, "resource_fence", "SELECT").await? {
        sqlx::query_as::<_, (String, i64)>(
            "SELECT resource, fence FROM pgfence.resource_fence ORDER BY 1",
        )
        .fetch_all(&mut *pool)
        .await?
        .into_iter()
        .map(|(resource, fence)| (resource, StoredFence::from_raw(fence).token()))
        .collect()
    } else {
        findings.push(not_permitted(
            "pgfence.resource_fence",
            "the recorded resources' marks and counters were",
            "SELECT on pgfence.resource_fence (the resources given with --resource are still checked)",
        ));
        Vec::new()
    };
    for (resource, mark) in &marks {
        if *mark > limit {
            findings.push(
                Finding::new(
                    Severity::Error,
                    FindingKind::FenceNearLimit,
                    format!("resource {resource}"),
                )
                .says(format!(
                    "its high-water mark is token {mark}, within {} of the largest token: no issuer's counter gets there, so every real lease of it is refused (a forged or corrupted check; a resource's first token is not bounded by pgfence.max_token_jump())",
                    MAX_TOKEN - mark
                ))
                .fix(format!(
                    "as the schema's owner: SELECT pgfence.unpoison_resource('{}', N); with N the highest token the issuer handed out",
                    resource.replace('\'', "''")
                )),
            );
        }
    }
    let mut checks: Vec<(Resource, i64)> = Vec::new();
    let mut invalid = Vec::new();
    // Marks are recorded under their key prefix's name (`Resource::in_key_prefix`; the
    // default prefix's are plain resource names).
    for (name, mark) in marks {
        match Resource::parse_fenced(&name) {
            Ok(r) => checks.push((r, mark)),
            Err(_) => invalid.push(name),
        }
    }
    for resource in &options.resources {
        let named = match issuer {
            Some(issuer) => issuer.fencing_resource(resource)?,
            None => resource.clone(),
        };
        if !checks.iter().any(|(r, _)| *r == named) {
            let mark = crate::admin::high_water(&mut *pool, &named).await?;
            checks.push((named, mark));
        }
    }
    let own_prefix = issuer.map_or(crate::issuer::DEFAULT_KEY_PREFIX, |i| i.key_prefix());
    other_prefix_marks(own_prefix, &options.resources, &checks, findings);
    if !invalid.is_empty() {
        findings.push(
            Finding::new(Severity::Info, FindingKind::CountersNotChecked, "pgfence.resource_fence")
                .says(format!(
                    "{} recorded resource name(s) are not valid resource names; their counters were not checked",
                    invalid.len()
                )),
        );
    }
    let Some(issuer) = issuer else {
        if !checks.is_empty() {
            findings.push(
                Finding::new(Severity::Info, FindingKind::CountersNotChecked, "redis")
                    .says(format!(
                        "{} resource counter(s) not compared: no Redis given",
                        checks.len()
                    ))
                    .fix("pass a Redis URL (--redis-url / REDIS_URL)"),
            );
        }
        return Ok(());
    };
    let mut top_counter: Option<i64> = None;
    let mut other_prefixes = std::collections::BTreeMap::<&str, usize>::new();
    let mut compared: Vec<(&Resource, Resource, i64)> = Vec::with_capacity(checks.len());
    for (named, mark) in &checks {
        // Only this issuer's key prefix's marks are compared with its counters.
        let prefix = named
            .key_prefix()
            .unwrap_or(crate::issuer::DEFAULT_KEY_PREFIX);
        if prefix == issuer.key_prefix() {
            compared.push((named, named.without_key_prefix(), *mark));
        } else {
            *other_prefixes.entry(prefix).or_default() += 1;
        }
    }
    // Counters are read STATUS_READS_IN_FLIGHT at a time, in order: one request after
    // another cost a round trip per resource (153 s for a million resources on loopback
    // Redis, BENCHMARKS.md 12h); each read keeps its own call bound.
    let mut statuses = futures_util::stream::iter(compared.iter())
        .map(|(_, resource, _)| issuer.status(resource))
        .buffered(STATUS_READS_IN_FLIGHT);
    let mut compared = compared.iter();
    while let Some(status) = statuses.next().await {
        let Some((named, resource, mark)) = compared.next() else {
            break;
        };
        let status = match status {
            Ok(s) => s,
            Err(e) => {
                findings.push(
                    Finding::new(Severity::Error, FindingKind::RedisUnavailable, "redis")
                        .says(format!("cannot read the counters: {e}"))
                        .fix("check the Redis URL and that Redis is up; then run doctor again"),
                );
                return Ok(());
            }
        };
        let counter = status.counter;
        top_counter = Some(top_counter.map_or(counter, |t| t.max(counter)));
        let object = match named.key_prefix() {
            Some(prefix) => format!("resource {resource} (key prefix {prefix})"),
            None => format!("resource {resource}"),
        };
        if counter < *mark {
            findings.push(
                Finding::new(Severity::Error, FindingKind::CounterBelowMark, &object)
                    .says(format!(
                        "the Redis counter ({counter}) is below Postgres's high-water mark ({mark}): it went backwards (failover or restart), and new leases get tokens Postgres rejects"
                    ))
                    .fix(format!("run `pgfence reseed '{resource}'`")),
            );
        }
        if counter > limit {
            findings.push(
                Finding::new(Severity::Warning, FindingKind::FenceNearLimit, &object)
                    .says(format!(
                        "the Redis counter ({counter}) is within {} of the largest token ({MAX_TOKEN})",
                        MAX_TOKEN - counter
                    )),
            );
        }
    }
    if !other_prefixes.is_empty() {
        let counts: Vec<String> = other_prefixes
            .iter()
            .map(|(prefix, n)| format!("{n} under key prefix {prefix}"))
            .collect();
        let runs: Vec<String> = other_prefixes
            .keys()
            .map(|prefix| format!("`pgfence doctor --key-prefix {prefix}`"))
            .collect();
        findings.push(
            Finding::new(Severity::Info, FindingKind::CountersNotChecked, "pgfence.resource_fence")
                .says(format!(
                    "resource marks of other key prefixes than the issuer's ({}) were not compared with counters: {}",
                    issuer.key_prefix(),
                    counts.join(", ")
                ))
                .fix(format!("run {} (or set PGFENCE_KEY_PREFIX)", runs.join(", "))),
        );
    }
    if let Some(top) = top_counter {
        for (table, token) in highest {
            if *token > top {
                findings.push(
                    Finding::new(Severity::Warning, FindingKind::TokenAboveCounters, table)
                        .says(format!(
                            "its highest token ({token}) is above every counter doctor read (highest {top}): a counter went backwards, or the table is written by a resource doctor was not told about"
                        ))
                        .fix(format!(
                            "name the table's resources with --resource; if a counter went backwards, `pgfence reseed RESOURCE --floor {token}`"
                        )),
                );
            }
        }
    }
    Ok(())
}

/// Resources given to doctor that have no mark under the key prefix in use (`prefix`) but do
/// under another: the service's leases likely use that prefix; say which to pass.
fn other_prefix_marks(
    prefix: &str,
    asked: &[Resource],
    checks: &[(Resource, i64)],
    findings: &mut Vec<Finding>,
) {
    let prefix_of = |r: &Resource| {
        r.key_prefix()
            .unwrap_or(crate::issuer::DEFAULT_KEY_PREFIX)
            .to_owned()
    };
    for resource in asked {
        let plain = resource.without_key_prefix();
        let own = checks.iter().any(|(r, mark)| {
            *mark > 0 && prefix_of(r) == prefix && r.without_key_prefix() == plain
        });
        if own {
            continue;
        }
        let others: Vec<String> = checks
            .iter()
            .filter(|(r, mark)| {
                *mark > 0 && prefix_of(r) != prefix && r.without_key_prefix() == plain
            })
            .map(|(r, mark)| format!("key prefix {} (token {mark})", prefix_of(r)))
            .collect();
        if others.is_empty() {
            continue;
        }
        let first = checks
            .iter()
            .find(|(r, mark)| {
                *mark > 0 && prefix_of(r) != prefix && r.without_key_prefix() == plain
            })
            .map(|(r, _)| prefix_of(r))
            .unwrap_or_default();
        findings.push(
            Finding::new(
                Severity::Info,
                FindingKind::CountersNotChecked,
                format!("resource {plain}"),
            )
            .says(format!(
                "no high-water mark under key prefix {prefix}, but one under {}: the service's leases use that key prefix",
                others.join(", ")
            ))
            .fix(format!(
                "run `pgfence doctor --key-prefix {first} --resource '{plain}'` (or set PGFENCE_KEY_PREFIX={first})"
            )),
        );
    }
}

/// Failover check: records the database's timeline (so a promotion shows even before any
/// lease wrote through it) and reports every timeline nobody acknowledged.
/// What is in force on this database: the timeline check (off, and why, where the WAL
/// functions are not available), the guarded tables by mode, and the connected role.
async fn protections(pool: &mut PgConnection, findings: &mut Vec<Finding>) -> Result<()> {
    let object = "database";
    let (readable, role, superuser, owner): (bool, String, bool, bool) = sqlx::query_as(
        "SELECT pg_catalog.has_function_privilege('pgfence.timeline()', 'EXECUTE')
                AND pg_catalog.has_schema_privilege('pgfence', 'USAGE'),
                CURRENT_USER::pg_catalog.text, r.rolsuper,
                pg_catalog.pg_has_role(n.nspowner, 'USAGE')
           FROM pg_catalog.pg_roles r, pg_catalog.pg_namespace n
          WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER
            AND n.nspname OPERATOR(pg_catalog.=) 'pgfence'",
    )
    .fetch_one(&mut *pool)
    .await?;
    if !readable {
        findings.push(not_permitted(
            object,
            "the protections in force were",
            "EXECUTE on pgfence.timeline() (`pgfence grant ROLE` gives it)",
        ));
        return Ok(());
    }
    let timeline: i64 = sqlx::query_scalar("SELECT pgfence.timeline()")
        .fetch_one(&mut *pool)
        .await?;
    let timeline_check = if timeline == 0 {
        let reason: Option<String> = if may(pool, "timeline_check", "SELECT").await? {
            sqlx::query_scalar("SELECT reason FROM pgfence.timeline_check")
                .fetch_optional(&mut *pool)
                .await?
                .flatten()
        } else {
            None
        };
        findings.push(
            Finding::new(Severity::Info, FindingKind::TimelineCheckOff, object)
                .says(format!(
                    "failover fencing by timeline is off for this database: {}. Not protected: a promotion of a standby that loses acknowledged commits (asynchronous replication) can put a fenced-out lease's fence back on a row, and that lease's next write is then admitted. Acceptable where a failover loses no acknowledged commit (Amazon Aurora's shared storage, synchronous replication with no async promotion); not for a self-managed primary with an asynchronous standby. Every other protection is in force",
                    reason.as_deref().unwrap_or("its WAL functions are not available (run doctor as the schema's owner for the reason)")
                ))
                .fix("where the WAL functions can be made available (Aurora: enable logical replication; elsewhere: GRANT EXECUTE ON FUNCTION pg_catalog.pg_current_wal_lsn(), pg_catalog.pg_walfile_name(pg_lsn) TO PUBLIC), then run SELECT pgfence.configure_timeline() as the schema's owner (docs/failover.md)"),
        );
        "off".to_owned()
    } else {
        format!("on (timeline {timeline})")
    };
    // Asked first: a refused read would abort the transaction doctor may run in.
    let listed = if may(pool, "guarded_tables", "SELECT").await? {
        crate::guard::guarded_tables_with_modes(&mut *pool)
            .await
            .ok()
    } else {
        None
    };
    let tables = match listed {
        Some(tables) => {
            let count = |f: &dyn Fn(&crate::guard::GuardedTable) -> bool| {
                tables.iter().filter(|t| f(t)).count()
            };
            format!(
                "{} guarded table(s): {} enforcing, {} observing, {} with the trigger disabled",
                tables.len(),
                count(&|t| t.enabled && t.mode == crate::guard::GuardMode::Enforce),
                count(&|t| t.enabled && t.mode == crate::guard::GuardMode::Observe),
                count(&|t| !t.enabled),
            )
        }
        None => "guarded tables not readable by this role".to_owned(),
    };
    let standing = if superuser {
        "a superuser"
    } else if owner {
        "the owner of schema pgfence (deploy time)"
    } else {
        "an application role (run time)"
    };
    findings.push(
        Finding::new(Severity::Info, FindingKind::Protections, object).says(format!(
            "timeline check {timeline_check}; {tables}; connected as {role}, {standing}"
        )),
    );
    Ok(())
}

async fn failover(pool: &mut PgConnection, findings: &mut Vec<Finding>) -> Result<()> {
    let object = "database timeline";
    let may_note: bool = sqlx::query_scalar(
        "SELECT pg_catalog.has_function_privilege('pgfence.note_timeline()', 'EXECUTE')",
    )
    .fetch_one(&mut *pool)
    .await?;
    if !may_note {
        findings.push(not_permitted(
            object,
            "a failover of the database was",
            "EXECUTE on pgfence.note_timeline() (`pgfence grant ROLE` gives it)",
        ));
        return Ok(());
    }
    let (now, previous, unacknowledged): (i64, Option<i64>, bool) = sqlx::query_as(
        "SELECT current_timeline, previous_timeline, unacknowledged FROM pgfence.note_timeline()",
    )
    .fetch_one(&mut *pool)
    .await?;
    if !unacknowledged {
        return Ok(());
    }
    let fix = "leases that wrote before the promotion are fenced out (FencedByFailover) and new \
               leases write as usual; with asynchronous replication check what the promotion \
               lost (commits the old primary acknowledged after the standby's last replay: the \
               old primary's WAL, the jobs that ran then), then run `pgfence doctor --ack-failover`";
    if !may(pool, "timeline_history", "SELECT").await? {
        findings.push(
            Finding::new(Severity::Error, FindingKind::FailedOver, format!("{object} {now}"))
                .says(format!(
                    "the database failed over: it is on timeline {now}{}, and the promotion was not acknowledged",
                    previous.map(|p| format!(" (pgfence saw timeline {p} before)")).unwrap_or_default()
                ))
                .fix(fix),
        );
        return Ok(());
    }
    let rows: Vec<(i64, time::OffsetDateTime, Option<i64>)> = sqlx::query_as(
        "SELECT h.timeline, h.first_seen,
                (SELECT pg_catalog.max(o.timeline) FROM pgfence.timeline_history o
                  WHERE o.timeline OPERATOR(pg_catalog.<) h.timeline)
           FROM pgfence.timeline_history h
          WHERE h.acknowledged_at IS NULL ORDER BY h.timeline",
    )
    .fetch_all(&mut *pool)
    .await?;
    for (timeline, first_seen, before) in rows {
        let seen = first_seen
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default();
        findings.push(
            Finding::new(
                Severity::Error,
                FindingKind::FailedOver,
                format!("{object} {timeline}"),
            )
            .says(format!(
                "the database failed over to timeline {timeline}{} (first seen by pgfence at {seen}), and nobody acknowledged it",
                before
                    .map(|b| format!(" from timeline {b}"))
                    .unwrap_or_default()
            ))
            .fix(fix),
        );
    }
    Ok(())
}

/// Acknowledges every failover `doctor` reports ([`FindingKind::FailedOver`]): marks the
/// database's timelines as checked by `by`. Returns how many were acknowledged. Run it as the
/// owner of schema pgfence, once what the promotion lost has been looked at. Fencing does not
/// depend on it: leases bound to an older timeline stay fenced out.
///
/// # Errors
/// [`Error::Database`](crate::Error::Database) (a role other than the owner is refused).
pub async fn acknowledge_failover<'c, A>(conn: A, by: &str) -> Result<i32>
where
    A: Acquire<'c, Database = Postgres>,
{
    let mut conn = conn.acquire().await?;
    let n: i32 = sqlx::query_scalar("SELECT pgfence.acknowledge_failover($1)")
        .bind(by)
        .fetch_one(&mut *conn)
        .await
        .map_err(crate::error::deploy_time(
            "pgfence doctor --ack-failover",
            crate::error::SCHEMA_OWNER,
        ))?;
    Ok(n)
}

/// Audit retention check.
async fn audit(
    pool: &mut PgConnection,
    options: &DoctorOptions,
    findings: &mut Vec<Finding>,
) -> Result<()> {
    let Some(retention) = options.audit_retention else {
        return Ok(());
    };
    if !may(pool, "audit", "SELECT").await? {
        findings.push(not_permitted(
            "pgfence.audit",
            "audit retention was",
            "SELECT on pgfence.audit",
        ));
        return Ok(());
    }
    let (count, oldest): (i64, Option<time::OffsetDateTime>) = sqlx::query_as(
        "SELECT pg_catalog.count(*), pg_catalog.min(at) FROM pgfence.audit
          WHERE at OPERATOR(pg_catalog.<) (pg_catalog.now()
                OPERATOR(pg_catalog.-) pg_catalog.make_interval(secs => $1))",
    )
    .bind(retention.as_secs_f64())
    .fetch_one(&mut *pool)
    .await?;
    if count > 0 {
        let age = fmt_retention(retention);
        let oldest = oldest
            .and_then(|t| {
                t.format(&time::format_description::well_known::Rfc3339)
                    .ok()
            })
            .map(|t| format!(" (oldest {t})"))
            .unwrap_or_default();
        findings.push(
            Finding::new(
                Severity::Warning,
                FindingKind::AuditRetention,
                "pgfence.audit",
            )
            .says(format!("{count} audit row(s) are older than {age}{oldest}"))
            .fix(format!("run `pgfence audit prune --older-than {age}`")),
        );
    }
    Ok(())
}

/// `30d`, `12h`, `5m`, `90s`: the largest whole unit.
fn fmt_retention(d: Duration) -> String {
    let s = d.as_secs().max(1);
    for (unit, secs) in [("d", 86_400), ("h", 3_600), ("m", 60)] {
        if s.is_multiple_of(secs) {
            return format!("{}{unit}", s / secs);
        }
    }
    format!("{s}s")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retention_is_printed_in_its_largest_unit() {
        assert_eq!(fmt_retention(Duration::from_secs(30 * 86_400)), "30d");
        assert_eq!(fmt_retention(Duration::from_secs(7_200)), "2h");
        assert_eq!(fmt_retention(Duration::from_secs(90)), "90s");
        assert_eq!(fmt_retention(Duration::from_millis(10)), "1s");
    }
}

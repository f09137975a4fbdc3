//! [`doctor`]: checks a database (and optionally an issuer's counters) for the ways a pgfence
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
//! | [`FenceNearLimit`](FindingKind::FenceNearLimit) | error (a row or resource mark: no counter gets there, real leases are locked out) / warning (an issuer's counter) | a row, resource mark or counter above [`MAX_TOKEN`](crate::token::MAX_TOKEN) − [`DoctorOptions::limit_margin`] |
//! | [`HighestToken`](FindingKind::HighestToken) | info | the highest token on each guarded table |
//! | [`TokenAboveCounters`](FindingKind::TokenAboveCounters) | warning | a table's highest token is above every issuer counter doctor read |
//! | [`CounterBelowMark`](FindingKind::CounterBelowMark) | error | an issuer's counter (Redis, etcd, ZooKeeper, the PostgreSQL issuer) below Postgres's high-water mark: it went backwards (failover), new leases are rejected |
//! | [`RedisUnavailable`](FindingKind::RedisUnavailable) | error | the issuer's counters could not be read (the name stays for compatibility: any issuer) |
//! | [`InvalidIssuerUrl`](FindingKind::InvalidIssuerUrl) | error | the issuer URL did not parse (reported by the CLI: nothing was connected to) |
//! | [`CountersNotChecked`](FindingKind::CountersNotChecked) | info | no issuer was given, or a recorded resource name is not a valid [`Resource`] |
//! | [`CounterExpired`](FindingKind::CounterExpired) | info | a resource with a mark has no counter, and the issuer's idle expiry is on: it expired idle, and the next lease is re-created above the mark (instead of [`CounterBelowMark`](FindingKind::CounterBelowMark)) |
//! | [`IssuerState`](FindingKind::IssuerState) | info | what the issuer keeps per resource, counted on its server ([`TokenIssuer::state`](crate::TokenIssuer::state)): counters, how many are idle and expiring, locks, floors; the idle expiry |
//! | [`AuditRetention`](FindingKind::AuditRetention) | warning | audit rows older than [`DoctorOptions::audit_retention`] |
//! | [`TimelineCheckOff`](FindingKind::TimelineCheckOff) | info | the database cannot tell its timeline (no WAL functions: Aurora without logical replication, or revoked): failover fencing by timeline is off; what is not protected, and where that is acceptable |
//! | [`Protections`](FindingKind::Protections) | info | what is in force: the timeline check, the guarded tables by mode, the connected role's standing |
//! | [`NotGranted`](FindingKind::NotGranted) | error | the connected role lacks `USAGE` on schema `pgfence` (it was never granted, `pgfence grant ROLE`): its fenced writes and checks fail (the other checks are skipped) |
//! | [`NotPermitted`](FindingKind::NotPermitted) | warning | a check doctor could not make: the connected role lacks a privilege it needs (run doctor as the schema's owner for the full report); not a problem ([`Finding::is_problem`]) |
//!
//! Counters: for each resource in `pgfence.resource_fence` (resources that ran
//! `pgfence.check`) and each of [`DoctorOptions::resources`], doctor compares the token of
//! `pgfence.high_water(resource)` with the issuer's counter ([`TokenIssuer::status`](crate::TokenIssuer::status)). Rows carry no
//! resource name, so a table's highest token (the token of `max(fence)`) is only compared with the
//! highest counter doctor read: above it means the table was written by a counter doctor was
//! not told about (list its resource in [`DoctorOptions::resources`]), or one that went
//! backwards. Reading `max(fence)` scans each guarded table; turn it off with
//! [`DoctorOptions::scan_tables`] on very large tables.

mod audit;
mod counters;
mod failover;
mod protections;
mod schema;
mod tables;

use std::time::Duration;

use serde::Serialize;
use sqlx::{Acquire, PgConnection, Postgres};

use crate::{Resource, Result, TokenIssuer};

use audit::audit;
use counters::counters;
pub use failover::acknowledge_failover;
use failover::failover;
use protections::protections;
use schema::schema;
use tables::tables;

/// How close to [`MAX_TOKEN`](crate::token::MAX_TOKEN) a token may come before doctor warns by default (2^20 tokens).
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
    /// A token close to [`MAX_TOKEN`](crate::token::MAX_TOKEN).
    FenceNearLimit,
    /// The highest token on a guarded table.
    HighestToken,
    /// A table's highest token is above every counter doctor read.
    TokenAboveCounters,
    /// An issuer's counter is below Postgres's high-water mark.
    CounterBelowMark,
    /// The issuer's counters could not be read (any issuer; the name is 0.2's).
    RedisUnavailable,
    /// The issuer URL did not parse: no issuer was connected to.
    InvalidIssuerUrl,
    /// Some counters were not compared.
    CountersNotChecked,
    /// A resource's counter is gone because it expired idle (the issuer's idle expiry is on),
    /// below a mark: the next lease's token is re-created above the mark.
    CounterExpired,
    /// What the issuer keeps per resource: counters, locks, how many are idle.
    IssuerState,
    /// Audit rows older than the retention.
    AuditRetention,
    /// A check was skipped: the connected role lacks a privilege it needs.
    NotPermitted,
    /// The connected role was never given pgfence's grants (no `USAGE` on schema `pgfence`):
    /// its fenced writes and checks fail ([`Error::NotGranted`](crate::Error::NotGranted));
    /// `pgfence grant ROLE` gives them.
    NotGranted,
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
/// [`Error::Backend`](crate::Error::Backend) when PostgreSQL cannot be read. Redis failures are findings
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
pub(super) async fn may(conn: &mut PgConnection, object: &str, privilege: &str) -> Result<bool> {
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
pub(super) fn not_permitted(object: impl Into<String>, what: &str, privilege: &str) -> Finding {
    Finding::new(Severity::Warning, FindingKind::NotPermitted, object)
        .says(format!(
            "{what} not checked: the connected role lacks {privilege}"
        ))
        .fix("run `pgfence doctor` as the owner of schema pgfence (or a role that may read it) for the full report")
}

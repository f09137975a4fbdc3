//! The audit trail of rejected writes: one structured `tracing` event per rejection, and one
//! row in `pgfence.audit`, written outside the caller's transaction.
//!
//! Where the row is written from: a repository write sent straight to a pool (so it is a
//! transaction of its own) writes the row in the very statement that rejected it, so a
//! rejection costs one round trip like any write and the row commits with it. A write on a
//! connection — possibly inside a caller's transaction that may roll back — leaves the row to
//! the [`Auditor`]'s own pool, in a transaction of its own. `Fence::check` rejections always
//! take that path. See [`crate::WriteExecutor`].

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use sqlx::{PgExecutor, PgPool};
use time::OffsetDateTime;

use crate::Result;
use crate::repository::executor::Lent;

/// `tracing` target of the rejection events (WARN) and of audit-write failures (ERROR).
///
/// Fields of a rejection event: `resource`, `table`, `key`, `presented`, `current`, `holder`,
/// `operation`. String fields are recorded as strings, so subscribers print them quoted and
/// escaped: a hostile key cannot forge a log line.
pub const LOG_TARGET: &str = "pgfence::audit";

/// How long a rejection may wait for its audit row by default.
pub const DEFAULT_AUDIT_TIMEOUT: Duration = Duration::from_secs(2);

/// The `reason` (or its suffix) of an audit row written again after the `COMMIT` of the
/// write's own transaction, which held the first, got no answer: if that transaction did
/// commit, the audit table holds this rejection twice.
pub const REWRITTEN_IN_DOUBT: &str =
    "written again: the first row's transaction may not have committed (this row may repeat it)";

/// A rejected write, as logged, audited and handed to an [`AuditSink`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Rejection {
    /// The resource the presented token was issued for, if known.
    pub resource: Option<String>,
    /// The (quoted) table of a row write; `None` for a resource check.
    pub table: Option<String>,
    /// The row's key as a JSON array; `None` for a resource check.
    pub key: Option<String>,
    /// The token the write carried.
    pub presented: i64,
    /// The token that had already written (or claimed) the row or resource.
    pub current: Option<i64>,
    /// Who presented the token (lease owner id, job id...), if known.
    pub holder: Option<String>,
    /// `update`, `upsert`, `delete`, `claim` or `check`.
    pub operation: &'static str,
    /// `current` came from another token counter (another resource or fencing domain).
    pub other_counter: bool,
    /// Why, when it is not the tokens alone: a failover refusal says `failover: lease
    /// timeline N, database timeline M` ([`Error::FencedByFailover`](crate::Error::FencedByFailover));
    /// a duplicate token, a sealed row and a token jump say so too
    /// ([`RejectionKind::reason`]). `NULL` in the audit table for a plain stale rejection.
    pub reason: Option<String>,
    /// What kind of rejection it is: the log event's `kind` field and message, and the
    /// audit row's `reason`, say it.
    pub kind: RejectionKind,
}

/// What kind of rejection a [`Rejection`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RejectionKind {
    /// A newer lease wrote or checked ([`Error::StaleToken`](crate::Error::StaleToken)).
    Stale,
    /// Another lease presented the same token ([`Error::DuplicateToken`](crate::Error::DuplicateToken)).
    Duplicate,
    /// The row changed outside the protocol after this lease wrote it
    /// ([`Error::RowSealed`](crate::Error::RowSealed)).
    Sealed,
    /// The token is implausibly far ahead ([`Error::TokenJump`](crate::Error::TokenJump)).
    TokenJump,
    /// The lease wrote before a failover of the database
    /// ([`Error::FencedByFailover`](crate::Error::FencedByFailover)).
    Failover,
}

impl RejectionKind {
    /// The log event's `kind` field: `stale`, `duplicate`, `sealed`, `token_jump`,
    /// `failover`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stale => "stale",
            Self::Duplicate => "duplicate",
            Self::Sealed => "sealed",
            Self::TokenJump => "token_jump",
            Self::Failover => "failover",
        }
    }

    /// The log event's message.
    #[must_use]
    pub fn message(self) -> &'static str {
        match self {
            Self::Stale => "stale write rejected",
            Self::Duplicate => "write rejected: duplicate fence token",
            Self::Sealed => "write rejected: row sealed",
            Self::TokenJump => "write rejected: token too far ahead",
            Self::Failover => "write rejected: fenced by a database failover",
        }
    }

    /// The audit row's `reason` for this kind (a failover's names its timelines and is built
    /// where it is refused; a stale rejection has none).
    #[must_use]
    pub fn reason(self) -> Option<String> {
        match self {
            Self::Stale | Self::Failover => None,
            Self::Duplicate => Some(DUPLICATE_REASON.to_owned()),
            Self::Sealed => Some(SEALED_REASON.to_owned()),
            Self::TokenJump => Some(
                "token jump: more than pgfence.max_token_jump() above the current token (forged or corrupted?)"
                    .to_owned(),
            ),
        }
    }

    /// The kind of a fenced-out error, `None` for any other error.
    #[must_use]
    pub fn of(err: &crate::Error) -> Option<Self> {
        Some(match err {
            crate::Error::StaleToken { .. } => Self::Stale,
            crate::Error::DuplicateToken { .. } => Self::Duplicate,
            crate::Error::RowSealed { .. } => Self::Sealed,
            crate::Error::TokenJump { .. } => Self::TokenJump,
            crate::Error::FencedByFailover { .. } => Self::Failover,
            _ => return None,
        })
    }
}

/// The audit `reason` of a duplicate-token rejection (also written by the rejecting
/// statement itself: `sql.rs`).
pub(crate) const DUPLICATE_REASON: &str = "duplicate token: another lease presented the same token (the counter went backwards; reseed it)";
/// The audit `reason` of a sealed-row rejection (also written by the rejecting statement).
pub(crate) const SEALED_REASON: &str =
    "sealed: the row changed outside the fencing protocol after this lease wrote it";

/// What the audit path reports to an [`AuditSink`]: every rejection, and every rejection
/// whose audit row could not be written.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub enum AuditEvent<'a> {
    /// A stale write was rejected (also logged at WARN on [`LOG_TARGET`]).
    Rejected(&'a Rejection),
    /// The rejection's audit row could not be written (also logged at ERROR). The rejection
    /// itself was still returned to the caller and reported as [`AuditEvent::Rejected`].
    AuditFailed {
        /// The rejection whose row is missing.
        rejection: &'a Rejection,
        /// Why the row could not be written.
        error: &'a str,
    },
}

/// A hook for audit events that belong to no caller (like bb8's `ErrorSink`): rejections and
/// failed audit rows, typed. `tracing` stays the default reporter; a sink is called in
/// addition, synchronously, on the task that saw the event, so keep it cheap (count, send
/// on a channel).
pub trait AuditSink: Send + Sync + std::fmt::Debug + 'static {
    /// Called once per event.
    fn event(&self, event: AuditEvent<'_>);
}

/// Where a rejection's audit row stands when the library records the rejection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum AuditRow {
    /// Not written yet: the [`Auditor`]'s pool writes it.
    Pending,
    /// Written by the statement that rejected the write.
    Written,
    /// The rejecting statement could not write it (the error's text).
    Failed(String),
}

/// Writes audit rows through its own pool, so they survive the caller's rollback (see the
/// [`WriteExecutor`](crate::WriteExecutor) for rows written by the rejecting statement itself).
#[derive(Clone, Debug)]
pub struct Auditor {
    pool: PgPool,
    timeout: Duration,
    in_statement: bool,
    sink: Option<Arc<dyn AuditSink>>,
}

impl Auditor {
    /// Audits through `pool` with [`DEFAULT_AUDIT_TIMEOUT`].
    #[must_use]
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            timeout: DEFAULT_AUDIT_TIMEOUT,
            in_statement: true,
            sink: None,
        }
    }

    /// Also reports every rejection and every audit failure to `sink` (see [`AuditSink`]).
    #[must_use]
    pub fn sink(mut self, sink: Arc<dyn AuditSink>) -> Self {
        self.sink = Some(sink);
        self
    }

    /// Bounds how long a rejection waits for its audit row (pool wait included; for a row
    /// written by the rejecting statement, the wait for the audit table's lock). When it runs
    /// out, the rejection is still returned to the caller and logged, and an ERROR event says
    /// the audit row is missing.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Whether repository writes outside a caller transaction write their audit row in the
    /// rejecting statement (the default). Turn it off when audit rows must go to another
    /// database than the one written to (`Auditor::new` with a pool on that database): every
    /// row then goes through this auditor's pool.
    #[must_use]
    pub fn in_statement(mut self, enabled: bool) -> Self {
        self.in_statement = enabled;
        self
    }

    /// The lock timeout (ms, at least 1) a statement-written audit row gets, or `None` when
    /// rows are not written by the statement.
    pub(crate) fn in_statement_timeout_ms(&self) -> Option<i32> {
        self.in_statement.then(|| {
            i32::try_from(self.timeout.as_millis())
                .unwrap_or(i32::MAX)
                .max(1)
        })
    }

    /// The pool audit rows are written through.
    #[must_use]
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Logs `r` and makes sure it has its audit row: writes it through the pool when it is
    /// [`AuditRow::Pending`]. Never fails: an audit failure is reported as an ERROR event and
    /// must not hide the rejection itself.
    pub(crate) async fn record(&self, r: &Rejection, row: AuditRow) {
        let resource = r.resource.as_deref().unwrap_or("");
        let table = r.table.as_deref().unwrap_or("");
        let key = r.key.as_deref().unwrap_or("");
        let holder = r.holder.as_deref().unwrap_or("");
        tracing::warn!(
            target: LOG_TARGET,
            resource,
            table,
            key,
            presented = r.presented,
            current = r.current,
            holder,
            operation = r.operation,
            other_counter = r.other_counter,
            reason = r.reason.as_deref(),
            kind = r.kind.as_str(),
            "{}",
            r.kind.message()
        );
        crate::metrics::rejection(r);
        if let Some(sink) = &self.sink {
            sink.event(AuditEvent::Rejected(r));
        }
        let failure = match row {
            AuditRow::Written => return,
            AuditRow::Failed(error) => error,
            AuditRow::Pending => match self.write_row(r).await {
                Ok(()) => return,
                Err(error) => error,
            },
        };
        self.report_missing(r, &failure);
    }

    /// Reports that `r`'s audit row could not be written (`failure`: why): an ERROR event,
    /// the failure metric and the sink's [`AuditEvent::AuditFailed`].
    pub(crate) fn report_missing(&self, r: &Rejection, failure: &str) {
        tracing::error!(
            target: LOG_TARGET,
            resource = r.resource.as_deref().unwrap_or(""),
            table = r.table.as_deref().unwrap_or(""),
            key = r.key.as_deref().unwrap_or(""),
            presented = r.presented,
            current = r.current,
            holder = r.holder.as_deref().unwrap_or(""),
            operation = r.operation,
            error = failure,
            "could not write the audit row for a rejected write"
        );
        crate::metrics::audit_failure(r.operation);
        if let Some(sink) = &self.sink {
            sink.event(AuditEvent::AuditFailed {
                rejection: r,
                error: failure,
            });
        }
    }

    /// Writes `r`'s audit row again through the pool: the row written in the write's own
    /// transaction is gone or may be (`loss`). A row that may repeat one that did commit says
    /// so in its `reason` ([`REWRITTEN_IN_DOUBT`]). Logged at WARN; a failure is reported like
    /// any missing row ([`AuditEvent::AuditFailed`]).
    pub(crate) async fn rewrite(
        &self,
        r: &Rejection,
        loss: &crate::repository::executor::AuditLoss,
    ) {
        use crate::repository::executor::AuditLoss;
        let mut again = r.clone();
        if let AuditLoss::InDoubt(_) = loss {
            again.reason = Some(match &r.reason {
                Some(reason) => format!("{reason}; {REWRITTEN_IN_DOUBT}"),
                None => REWRITTEN_IN_DOUBT.to_owned(),
            });
        }
        match self.write_row(&again).await {
            Ok(()) => tracing::warn!(
                target: LOG_TARGET,
                resource = r.resource.as_deref().unwrap_or(""),
                table = r.table.as_deref().unwrap_or(""),
                key = r.key.as_deref().unwrap_or(""),
                presented = r.presented,
                operation = r.operation,
                "wrote the audit row of a rejected write again: {loss}"
            ),
            Err(error) => self.report_missing(r, &format!("{loss}; writing it again: {error}")),
        }
    }

    /// Logs `r` and writes its audit row beside the rejected statement: on `lent`'s own
    /// connection when every statement there is a transaction of its own (a connection the
    /// write checked out of the pool: the row commits at once, and it may be the pool's last
    /// free connection), otherwise through the pool, outside the caller's transaction.
    pub(crate) async fn record_beside(&self, r: &Rejection, lent: &mut Lent<'_>) {
        let row = match self.in_statement_timeout_ms() {
            Some(ms) if lent.own_transaction() => {
                let insert = append_audit(
                    "SELECT pg_catalog.set_config('lock_timeout', $10, true), \
                     pgfence.append_audit($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                    r,
                )
                .bind(ms.to_string())
                .execute(lent.conn())
                .await;
                match insert {
                    Ok(_) => {
                        lent.hold_audit(self, r);
                        AuditRow::Written
                    }
                    Err(e) => AuditRow::Failed(e.to_string()),
                }
            }
            _ => AuditRow::Pending,
        };
        self.record(r, row).await;
    }

    /// Inserts `r` through the pool, within the timeout; the error text otherwise.
    async fn write_row(&self, r: &Rejection) -> std::result::Result<(), String> {
        if r.reason.is_some() {
            // Through the owner's function: an application role may insert every column of
            // the audit table but `reason` (migration V7).
            let insert = append_audit(
                "SELECT pgfence.append_audit($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                r,
            )
            .execute(&self.pool);
            return match tokio::time::timeout(self.timeout, insert).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("timed out after {:?}", self.timeout)),
            };
        }
        let insert = sqlx::query!(
            "INSERT INTO pgfence.audit (resource, table_name, row_key, presented, current, holder, operation, other_counter) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            r.resource,
            r.table,
            r.key,
            r.presented,
            r.current,
            r.holder,
            r.operation,
            r.other_counter,
        )
        .execute(&self.pool);
        match tokio::time::timeout(self.timeout, insert).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("timed out after {:?}", self.timeout)),
        }
    }
}

/// `sql` (which calls `pgfence.append_audit` with `$1..$9`) with `r`'s columns bound, in the
/// function's order.
fn append_audit<'q>(
    sql: &'static str,
    r: &'q Rejection,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(sql)
        .bind(&r.resource)
        .bind(&r.table)
        .bind(&r.key)
        .bind(r.presented)
        .bind(r.current)
        .bind(&r.holder)
        .bind(r.operation)
        .bind(r.other_counter)
        .bind(&r.reason)
}

/// One row of the audit trail.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AuditEntry {
    /// Row id (increasing).
    pub id: i64,
    /// When the rejection was recorded.
    #[serde(with = "time::serde::rfc3339")]
    pub at: OffsetDateTime,
    /// The resource the token was issued for, when the writer said.
    pub resource: Option<String>,
    /// The table (quoted, schema-qualified) for row writes.
    pub table: Option<String>,
    /// The row key as a JSON array, for row writes.
    pub key: Option<String>,
    /// The token the rejected write carried.
    pub presented: i64,
    /// The fence it met.
    pub current: Option<i64>,
    /// Who held the token, when the writer said.
    pub holder: Option<String>,
    /// `update`, `upsert`, `delete`, `claim` or `check`.
    pub operation: String,
    /// `current` came from another token counter (another resource or fencing domain).
    pub other_counter: bool,
    /// The writer's `application_name` (observe-mode and bypass rows, and every row written
    /// since V6), when recorded.
    pub application_name: Option<String>,
    /// Why a write was let through (bypass reason, or why an observed bypass was refused).
    pub reason: Option<String>,
    /// The login role that wrote the audit row (since V5).
    pub db_user: Option<String>,
}

/// Filters for [`list`]. The default lists the 100 newest rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditFilter {
    /// Only rows recorded at or after this time.
    pub since: Option<OffsetDateTime>,
    /// Only rows for this resource; a trailing `*` matches every resource with that prefix
    /// (`billing:*`, `{billing}*` for a fencing domain). The rows of leases of an issuer with
    /// a key prefix other than the default carry that prefix's name
    /// ([`Lease::fencing_resource`](crate::Lease::fencing_resource)): see
    /// [`AuditFilter::in_key_prefix`].
    pub resource: Option<String>,
    /// At most this many rows (newest first).
    pub limit: i64,
    /// Only rows with an id above this one, and then **oldest first** (to follow the trail:
    /// pass the last id seen).
    pub after_id: Option<i64>,
}

impl AuditFilter {
    /// The same filter for the leases of issuers with key prefix `prefix`: the
    /// [`AuditFilter::resource`] name or pattern becomes that prefix's PostgreSQL name
    /// ([`Resource::in_key_prefix`](crate::Resource::in_key_prefix): `billing:*` becomes
    /// `P{billing:*`, `{billing}*` becomes `{P{billing}*`), so rows of another prefix's
    /// leases on the same resource name are not listed. Unchanged for the default prefix, for
    /// no resource filter, and for a name that already is a prefix's (one with a `{` past its
    /// first character).
    ///
    /// ```
    /// let f = pgfence::audit::AuditFilter { resource: Some("billing:*".into()), ..Default::default() };
    /// let f = f.in_key_prefix("app_a").unwrap();
    /// assert_eq!(f.resource.as_deref(), Some("app_a{billing:*"));
    /// ```
    ///
    /// # Errors
    /// [`InvalidInput::KeyPrefix`](crate::error::InvalidInput::KeyPrefix) for an invalid prefix.
    pub fn in_key_prefix(mut self, prefix: &str) -> Result<Self> {
        let prefix = crate::issuer::limits::check_key_prefix(prefix)?;
        if prefix == crate::issuer::DEFAULT_KEY_PREFIX {
            return Ok(self);
        }
        self.resource = self.resource.map(|pattern| {
            let named = pattern.char_indices().any(|(i, c)| i > 0 && c == '{');
            match pattern.strip_prefix('{') {
                _ if named => pattern,
                Some(rest) => format!("{{{prefix}{{{rest}"),
                None => format!("{prefix}{{{pattern}"),
            }
        });
        Ok(self)
    }
}

impl Default for AuditFilter {
    fn default() -> Self {
        Self {
            since: None,
            resource: None,
            limit: 100,
            after_id: None,
        }
    }
}

/// Lists audit rows, newest first (oldest first with [`AuditFilter::after_id`]).
///
/// # Errors
/// [`Error::Backend`](crate::Error::Backend).
pub async fn list<'c, E: PgExecutor<'c>>(exec: E, filter: &AuditFilter) -> Result<Vec<AuditEntry>> {
    let rows = sqlx::query_as!(
        AuditEntry,
        r#"SELECT id AS "id!", at AS "at!", resource, table_name AS "table", row_key AS "key",
                  presented AS "presented!", current, holder, operation AS "operation!",
                  other_counter AS "other_counter!", application_name, reason, db_user
             FROM pgfence.audit
            WHERE ($1::pg_catalog.timestamptz IS NULL OR at OPERATOR(pg_catalog.>=) $1)
              AND ($2::pg_catalog.text IS NULL OR resource OPERATOR(pg_catalog.=) $2
                   OR (pg_catalog.right($2, 1) OPERATOR(pg_catalog.=) '*'
                       AND pg_catalog.starts_with(resource, pg_catalog.left($2, -1))))
              AND ($4::pg_catalog.int8 IS NULL OR id OPERATOR(pg_catalog.>) $4)
            ORDER BY CASE WHEN $4::pg_catalog.int8 IS NULL THEN id END DESC, id ASC
            LIMIT $3"#,
        filter.since,
        filter.resource,
        filter.limit.max(0),
        filter.after_id,
    )
    .fetch_all(exec)
    .await?;
    Ok(rows)
}

/// Deletes audit rows older than `older_than` and returns how many were deleted.
///
/// # Errors
/// [`Error::Backend`](crate::Error::Backend).
pub async fn prune<'c, E: PgExecutor<'c>>(exec: E, older_than: OffsetDateTime) -> Result<u64> {
    let done = sqlx::query!(
        "DELETE FROM pgfence.audit WHERE at OPERATOR(pg_catalog.<) $1",
        older_than
    )
    .execute(exec)
    .await
    .map_err(crate::error::deploy_time(
        "pgfence audit prune",
        crate::error::SCHEMA_OWNER,
    ))?;
    Ok(done.rows_affected())
}

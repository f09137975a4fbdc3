//! The library's error type: every rejection, however it was detected, is [`Error::StaleToken`].

use crate::FenceToken;

/// SQLSTATE raised by pgfence's SQL (the guard trigger and `pgfence.check`) when a fence token
/// is not newer than the one already recorded. Custom class `PF` ("pgfence").
pub const SQLSTATE_STALE: &str = "PF001";
/// SQLSTATE raised by `pgfence.guard` when the table has a `fence` column that is not `bigint`.
pub const SQLSTATE_FENCE_TYPE: &str = "PF002";

/// SQLSTATE raised by `pgfence.guard` for tables in the `pgfence` schema or a system schema.
pub const SQLSTATE_PROTECTED: &str = "PF003";

/// `Result` with pgfence's [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in pgfence.
///
/// Match on the variants you act on; use [`Error::is_stale`] and [`Error::is_retryable`]
/// rather than inspecting messages.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The presented token is not newer than the fence already recorded: a newer holder
    /// wrote (`current > presented`) or this token already wrote (`current == presented`).
    /// The write was not applied. Do not retry with the same token.
    #[error("stale fence token on {target}: presented {presented}, current {current}")]
    StaleToken {
        /// What the write targeted: `table key` for row writes, the resource for checks.
        target: String,
        /// The token the write carried.
        presented: i64,
        /// The fence the write met (`>= presented`).
        current: i64,
    },

    /// The row the fenced write addressed does not exist (never reported for a stale write).
    #[error("no row in {table} with key {key}")]
    NotFound {
        /// The (quoted) table name.
        table: String,
        /// The key, as a JSON array.
        key: String,
    },

    /// A fence token must be in `1..=i64::MAX`.
    #[error("invalid fence token {0}: tokens are positive 64-bit integers")]
    InvalidToken(i128),

    /// A resource name was rejected (see [`crate::Resource`]).
    #[error("invalid resource name: {0}")]
    InvalidResource(String),

    /// An SQL identifier (schema, table or column name) was rejected.
    #[error("invalid identifier {name:?}: {reason}")]
    InvalidIdentifier {
        /// The offending name (possibly truncated for display).
        name: String,
        /// Why it was rejected.
        reason: &'static str,
    },

    /// A table definition given to the repository is inconsistent (no key, duplicate column...).
    #[error("invalid table definition for {table}: {reason}")]
    InvalidTable {
        /// The table.
        table: String,
        /// What is wrong.
        reason: String,
    },

    /// The table to guard does not exist.
    #[error("table {0} does not exist")]
    TableNotFound(String),

    /// The table already has a `fence` column of a type other than `bigint`.
    #[error("{table}.fence has type {found}; pgfence needs bigint (rename or convert the column)")]
    FenceColumnType {
        /// The table.
        table: String,
        /// The type found.
        found: String,
    },

    /// A lock TTL or other duration was out of range.
    #[error("invalid duration: {0}")]
    InvalidDuration(String),

    /// Concurrent activity on the row changed it while the write was being classified
    /// (for example it was deleted mid-statement). Nothing was applied; retry is safe.
    #[error("row in {table} changed concurrently during {operation}; retry")]
    Contended {
        /// The table.
        table: String,
        /// The fenced operation.
        operation: &'static str,
    },

    /// A migration failed.
    #[error("migration failed: {0}")]
    Migration(#[source] Box<refinery_core::Error>),

    /// Any other database error.
    #[error("database error: {0}")]
    Database(#[source] sqlx::Error),

    /// A Redis error.
    #[error("redis error: {0}")]
    Redis(#[source] redis::RedisError),
}

impl Error {
    /// True when a write was rejected because its token was not newer than the fence.
    #[must_use]
    pub fn is_stale(&self) -> bool {
        matches!(self, Error::StaleToken { .. })
    }

    /// True when the error is transient and the same operation may be retried as is
    /// (connection loss, serialization failure, deadlock, concurrent change). A stale token is
    /// never retryable: take a new lease instead.
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Contended { .. } => true,
            Error::Database(e) => is_transient_sqlx(e),
            Error::Redis(e) => {
                e.is_io_error()
                    || e.is_connection_dropped()
                    || e.is_timeout()
                    || e.is_connection_refusal()
            }
            _ => false,
        }
    }
}

fn is_transient_sqlx(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => true,
        sqlx::Error::Database(db) => matches!(
            db.code().as_deref(),
            // serialization_failure, deadlock_detected, admin/crash shutdown, cannot_connect_now
            Some("40001" | "40P01" | "57P01" | "57P02" | "57P03")
        ),
        _ => false,
    }
}

impl From<sqlx::Error> for Error {
    /// Maps pgfence's SQLSTATEs to typed errors, so a stale write detected by the guard
    /// trigger or by `pgfence.check` is the same [`Error::StaleToken`] as one detected by the
    /// repository.
    fn from(e: sqlx::Error) -> Self {
        if let sqlx::Error::Database(db) = &e
            && let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
        {
            match pg.code() {
                SQLSTATE_STALE => {
                    if let Some(stale) = parse_stale_detail(pg.detail().unwrap_or("")) {
                        return stale;
                    }
                }
                SQLSTATE_FENCE_TYPE => {
                    return Error::FenceColumnType {
                        table: pg.table().unwrap_or("?").to_owned(),
                        found: pg.detail().unwrap_or("?").to_owned(),
                    };
                }
                SQLSTATE_PROTECTED => {
                    return Error::InvalidTable {
                        table: pg.table().unwrap_or("?").to_owned(),
                        reason: "pgfence and system tables cannot be guarded".to_owned(),
                    };
                }
                "42P01" => return Error::TableNotFound(missing_relation(pg)),
                _ => {}
            }
        }
        Error::Database(e)
    }
}

impl From<redis::RedisError> for Error {
    fn from(e: redis::RedisError) -> Self {
        Error::Redis(e)
    }
}

/// The relation a 42P01 error names: the TABLE field (pgfence's own errors set it), else the
/// name in the server's `relation "..." does not exist`.
fn missing_relation(pg: &sqlx::postgres::PgDatabaseError) -> String {
    if let Some(table) = pg.table() {
        return table.to_owned();
    }
    let msg = pg.message();
    msg.strip_prefix("relation \"")
        .and_then(|m| m.strip_suffix("\" does not exist"))
        .unwrap_or(msg)
        .to_owned()
}

/// Parses the `DETAIL` of a `PF001` error: `presented=<n> current=<n> target=<text>`.
fn parse_stale_detail(detail: &str) -> Option<Error> {
    let rest = detail.strip_prefix("presented=")?;
    let (presented, rest) = rest.split_once(" current=")?;
    let (current, target) = rest.split_once(" target=")?;
    Some(Error::StaleToken {
        target: target.to_owned(),
        presented: presented.parse().ok()?,
        current: current.parse().ok()?,
    })
}

impl Error {
    pub(crate) fn stale(target: impl Into<String>, presented: FenceToken, current: i64) -> Self {
        Error::StaleToken {
            target: target.into(),
            presented: presented.get(),
            current,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_trigger_detail() {
        let e = parse_stale_detail("presented=1 current=2 target=\"public\".\"t\"").unwrap();
        assert!(
            matches!(e, Error::StaleToken { presented: 1, current: 2, ref target } if target == "\"public\".\"t\"")
        );
        assert!(parse_stale_detail("garbage").is_none());
    }
}

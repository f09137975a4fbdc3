//! [`BackendError`]: a failure of PostgreSQL, a migration or a lock service that pgfence does
//! not map to a typed outcome, kept opaque so its shape does not change with cargo features.

use std::fmt;

/// Which system a [`BackendError`] came from. Every kind exists whatever features are built
/// (an issuer that is not built never produces its kind).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BackendKind {
    /// PostgreSQL (the repository, the guard, `Fence::check`, the PostgreSQL issuer, admin calls).
    Database,
    /// A migration ([`admin::migrate`](crate::admin::migrate)).
    Migration,
    /// Redis or a Redis Sentinel (the Redis issuer).
    Redis,
    /// etcd (the etcd issuer, feature `etcd`).
    Etcd,
    /// ZooKeeper (the ZooKeeper issuer, feature `zk`).
    ZooKeeper,
}

/// A failure of PostgreSQL, a migration or a lock service that is not one of pgfence's typed
/// outcomes ([`Error::Backend`](crate::Error::Backend)): a lost connection, a timeout, a
/// server error pgfence does not map. Ask it what it is ([`kind`](Self::kind)), whether the
/// same operation may be retried ([`is_retryable`](Self::is_retryable)) and, for PostgreSQL,
/// its SQLSTATE ([`sqlstate`](Self::sqlstate)); the client library's own error is
/// [`as_sqlx`](Self::as_sqlx) / [`as_redis`](Self::as_redis) (and in the `Debug` output).
///
/// It has no [`source`](std::error::Error::source): its message already says all the client
/// library's error says (for PostgreSQL: the message, SQLSTATE, detail and hint, without
/// sqlx's `at line N`, a line of PostgreSQL's C source), so a printed cause chain
/// (`{:#}` of an `anyhow::Error`) says it once.
///
/// ```
/// use pgfence::{Error, error::BackendKind};
///
/// fn unique_violation(e: &Error) -> bool {
///     matches!(e, Error::Backend(b) if b.kind() == BackendKind::Database && b.sqlstate() == Some("23505"))
/// }
/// # let _ = unique_violation;
/// ```
pub struct BackendError(Box<Source>);

pub(crate) enum Source {
    Database(sqlx::Error),
    Migration(refinery_core::Error),
    Redis(redis::RedisError),
    #[cfg(feature = "etcd")]
    Etcd(etcd_client::Error),
    #[cfg(feature = "zk")]
    ZooKeeper(zookeeper_client::Error),
}

impl BackendError {
    pub(crate) fn new(source: Source) -> Self {
        Self(Box::new(source))
    }

    /// Which system failed.
    #[must_use]
    pub fn kind(&self) -> BackendKind {
        match &*self.0 {
            Source::Database(_) => BackendKind::Database,
            Source::Migration(_) => BackendKind::Migration,
            Source::Redis(_) => BackendKind::Redis,
            #[cfg(feature = "etcd")]
            Source::Etcd(_) => BackendKind::Etcd,
            #[cfg(feature = "zk")]
            Source::ZooKeeper(_) => BackendKind::ZooKeeper,
        }
    }

    /// True when the failure is transient and the same operation may be retried as is: a
    /// lost or refused connection, a timeout, a pool with no free connection, a serialization
    /// failure or deadlock (retry the whole transaction), a server shutting down or failing
    /// over, a lock service without a leader. False for a TLS handshake the server refused
    /// and for anything else.
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        match &*self.0 {
            Source::Database(e) => is_transient_sqlx(e),
            Source::Migration(_) => false,
            Source::Redis(e) if crate::tls::is_tls_rejection(e) => false,
            Source::Redis(e) => {
                e.is_io_error()
                    || e.is_connection_dropped()
                    || e.is_timeout()
                    || e.is_connection_refusal()
                    // A node that is failing over, demoted or still loading.
                    || matches!(
                        e.code(),
                        Some("READONLY" | "MASTERDOWN" | "LOADING" | "TRYAGAIN")
                    )
            }
            #[cfg(feature = "etcd")]
            Source::Etcd(e) => crate::issuer::etcd_is_transient(e),
            #[cfg(feature = "zk")]
            Source::ZooKeeper(e) => crate::issuer::zk_is_transient(e),
        }
    }

    /// The SQLSTATE of an error PostgreSQL reported (`None` for a connection failure or
    /// another system).
    #[must_use]
    pub fn sqlstate(&self) -> Option<&str> {
        match &*self.0 {
            Source::Database(sqlx::Error::Database(db)) => db
                .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                .map(sqlx::postgres::PgDatabaseError::code),
            _ => None,
        }
    }

    /// The sqlx error, when PostgreSQL failed ([`BackendKind::Database`]).
    #[must_use]
    pub fn as_sqlx(&self) -> Option<&sqlx::Error> {
        match &*self.0 {
            Source::Database(e) => Some(e),
            _ => None,
        }
    }

    /// The redis-rs error, when Redis failed ([`BackendKind::Redis`]).
    #[must_use]
    pub fn as_redis(&self) -> Option<&redis::RedisError> {
        match &*self.0 {
            Source::Redis(e) => Some(e),
            _ => None,
        }
    }

    /// The ZooKeeper client's error (crate-internal: its type depends on the `zk` feature).
    #[cfg(feature = "zk")]
    pub(crate) fn as_zk(&self) -> Option<&zookeeper_client::Error> {
        match &*self.0 {
            Source::ZooKeeper(e) => Some(e),
            _ => None,
        }
    }
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &*self.0 {
            Source::Database(e) => write!(f, "database error: {}", describe_sqlx(e)),
            Source::Migration(e) => write!(
                f,
                "migration failed: {}",
                without_source_lines(&with_causes(e))
            ),
            Source::Redis(e) => write!(f, "redis error: {}", with_causes(e)),
            #[cfg(feature = "etcd")]
            Source::Etcd(e) => write!(f, "etcd error: {}", with_causes(e)),
            #[cfg(feature = "zk")]
            Source::ZooKeeper(e) => write!(f, "zookeeper error: {}", with_causes(e)),
        }
    }
}

impl fmt::Debug for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (kind, source): (_, &dyn fmt::Debug) = match &*self.0 {
            Source::Database(e) => ("Database", e),
            Source::Migration(e) => ("Migration", e),
            Source::Redis(e) => ("Redis", e),
            #[cfg(feature = "etcd")]
            Source::Etcd(e) => ("Etcd", e),
            #[cfg(feature = "zk")]
            Source::ZooKeeper(e) => ("ZooKeeper", e),
        };
        f.debug_tuple("BackendError")
            .field(&format_args!("{kind}"))
            .field(source)
            .finish()
    }
}

/// No `source`: the message carries the client library's text already (see the type's docs).
impl std::error::Error for BackendError {}

/// A sqlx error as a user reads it: a database error's message with its SQLSTATE, detail
/// and hint — not sqlx's `at line NNNN`, which is a line of PostgreSQL's C source, not of the
/// caller's SQL.
pub(crate) fn describe_sqlx(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::Database(db) => {
            let mut text = db.message().to_owned();
            if let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
                text.push_str(&format!(" (SQLSTATE {})", pg.code()));
                if let Some(detail) = pg.detail() {
                    text.push_str(&format!("; {detail}"));
                }
                if let Some(hint) = pg.hint() {
                    text.push_str(&format!("; hint: {hint}"));
                }
                if pg.code() == "08P01"
                    && let Some(param) = pg.r#where().and_then(|w| w.strip_prefix("unnamed portal "))
                {
                    // A binary value of another width than the statement's parameter type.
                    text.push_str(&format!(
                        ": the Rust type bound as {param} does not match its column's SQL type \
                         (declare the table's key and columns with matching types, e.g. i64 for bigint)"
                    ));
                }
            }
            text
        }
        sqlx::Error::PoolTimedOut => {
            "no connection within the pool's acquire timeout (the server did not answer, or every connection was busy)".to_owned()
        }
        other => without_source_lines(&with_causes(other)),
    }
}

/// `e`'s message, then each of its causes' that the text so far does not contain already
/// (redis-rs, for one, displays an I/O error and returns it as its source too): the whole
/// chain, each text once, for a [`BackendError`], which has no source of its own.
fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        let more = cause.to_string();
        if !more.is_empty() && !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        next = cause.source();
    }
    text
}

/// Drops sqlx's ` at line NNNN` (PostgreSQL's C source line) from a message that embeds a
/// database error's text (refinery's, for one).
fn without_source_lines(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(" at line ") {
        let digits = rest[at + 9..]
            .bytes()
            .take_while(u8::is_ascii_digit)
            .count();
        if digits == 0 {
            out.push_str(&rest[..at + 9]);
            rest = &rest[at + 9..];
            continue;
        }
        out.push_str(&rest[..at]);
        rest = &rest[at + 9 + digits..];
    }
    out.push_str(rest);
    out
}

/// What sqlx reports when the connection closes before the server answered its SSLRequest.
const SSL_REQUEST_EOF: &str = "unexpected response from SSLRequest: 0x00";

fn is_transient_sqlx(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => true,
        // The connection closed before the server's one-byte answer to the TLS request: sqlx
        // reads nothing into a zeroed byte and reports it as this protocol error (a reset
        // while a new connection is set up). Any other byte is the server's own answer.
        sqlx::Error::Protocol(message) => message.starts_with(SSL_REQUEST_EOF),
        sqlx::Error::Database(db) => matches!(
            db.code().as_deref(),
            // serialization_failure, deadlock_detected, admin/crash shutdown, cannot_connect_now
            Some("40001" | "40P01" | "57P01" | "57P02" | "57P03")
        ),
        _ => false,
    }
}

//! [`InvalidInput`]: what input was refused, and why, before anything was sent
//! ([`Error::Invalid`](crate::Error::Invalid)).

/// An input pgfence refused before it sent anything: nothing changed. Match on it to tell
/// the inputs apart; its `Display` is the message a user reads.
///
/// ```
/// use pgfence::{Error, error::InvalidInput};
///
/// match pgfence::Resource::new("") {
///     Err(Error::Invalid(InvalidInput::Resource(why))) => assert!(!why.is_empty()),
///     other => panic!("{other:?}"),
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidInput {
    /// A fence token must be an integer in `1..=`[`MAX_TOKEN`](crate::token::MAX_TOKEN).
    #[error("invalid fence token {0}: tokens are integers from 1 to {max}", max = crate::token::MAX_TOKEN)]
    Token(String),

    /// A resource name was rejected (see [`crate::Resource`]).
    #[error("invalid resource name: {0}")]
    Resource(String),

    /// A lease owner id was rejected (empty, or containing `:`).
    #[error("invalid owner id: {0}")]
    Owner(String),

    /// An SQL identifier (schema, table or column name) was rejected.
    #[error("invalid identifier {name:?}: {reason}")]
    Identifier {
        /// The offending name (possibly truncated for display).
        name: String,
        /// Why it was rejected.
        reason: &'static str,
    },

    /// A table definition given to the repository is inconsistent (no key, duplicate column...).
    #[error("invalid table definition for {table}: {reason}")]
    Table {
        /// The table.
        table: String,
        /// What is wrong.
        reason: String,
    },

    /// A batch write was refused before anything was sent: too many rows, the same key twice,
    /// or a table type whose [`FencedTable`](crate::FencedTable) impl does not bind arrays.
    #[error("invalid batch for {table}: {reason}")]
    Batch {
        /// The (quoted) table.
        table: String,
        /// What is wrong (for duplicate keys, the keys as JSON arrays).
        reason: String,
    },

    /// A lock TTL or other duration was out of range.
    #[error("invalid duration: {0}")]
    Duration(String),

    /// An effect ([`Effects::begin`](crate::Effects::begin)) was refused before anything was
    /// sent: an empty or too long work key or step, or no resource to record it under.
    #[error("invalid effect: {0}")]
    Effect(String),

    /// A Redis key prefix ([`RedisIssuer::with_key_prefix`](crate::RedisIssuer::with_key_prefix)) was
    /// empty, too long, or contained braces, whitespace or control characters.
    #[error("invalid key prefix: {0}")]
    KeyPrefix(String),

    /// An issuer URL ([`connect_issuer`](crate::connect_issuer)) had a scheme no issuer
    /// handles, or was malformed.
    #[error("invalid issuer URL: {0}")]
    IssuerUrl(String),

    /// The TLS settings of an issuer URL were rejected before anything was sent: `cacert`,
    /// `cert` or `key` on a URL that is not TLS, `cert` without `key` (or the reverse), a
    /// parameter given twice.
    #[error("invalid TLS settings: {0}")]
    Tls(String),

    /// A file named by a TLS parameter of an issuer URL (`cacert`, `cert`, `key`) could not be
    /// read, or does not hold what it should (PEM certificates, a PEM private key).
    #[error("TLS `{param}` file {}: {reason}", path.display())]
    TlsFile {
        /// The URL parameter that named the file.
        param: &'static str,
        /// The file.
        path: std::path::PathBuf,
        /// Why it cannot be used.
        reason: String,
    },
}

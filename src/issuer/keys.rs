//! Key prefixes, which separate applications sharing an issuer (and a database), and the
//! name PostgreSQL fences a lease under for a prefix.

#[cfg(doc)]
use crate::RedisIssuer;
use crate::error::InvalidInput;
use crate::{Error, Resource, Result};

/// The default key prefix: keys are `pgfence:{R}:lock` and `pgfence:{R}:fence`.
pub const DEFAULT_KEY_PREFIX: &str = "pgfence";

/// The longest key prefix accepted ([`RedisIssuer::with_key_prefix`]).
pub const MAX_KEY_PREFIX_LEN: usize = 64;

/// Checks a key prefix: non-empty, at most [`MAX_KEY_PREFIX_LEN`] bytes, and free of braces
/// (which would move the Redis Cluster hash tag), whitespace and control characters.
///
/// # Errors
/// [`InvalidInput::KeyPrefix`](crate::error::InvalidInput::KeyPrefix) saying what is wrong.
pub fn check_key_prefix(prefix: &str) -> Result<&str> {
    let why = if prefix.is_empty() {
        Some("it is empty".to_owned())
    } else if prefix.len() > MAX_KEY_PREFIX_LEN {
        Some(format!(
            "it is {} bytes long, at most {MAX_KEY_PREFIX_LEN} are allowed",
            prefix.len()
        ))
    } else if prefix.contains(['{', '}']) {
        Some("it contains a brace ('{' or '}'), which would change the key's hash slot".into())
    } else if prefix.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Some("it contains whitespace or a control character".into())
    } else {
        None
    };
    match why {
        Some(why) => Err(Error::Invalid(InvalidInput::KeyPrefix(format!(
            "{:?}: {why}",
            prefix.escape_debug().to_string()
        )))),
        None => Ok(prefix),
    }
}

/// The name PostgreSQL fences `resource` under for leases of key prefix `prefix`
/// ([`Resource::in_key_prefix`]), checked before an acquire sends anything: a lock is taken on
/// a resource name, never on a prefix's PostgreSQL name.
pub(crate) fn fencing_name(prefix: &str, resource: &Resource) -> Result<Resource> {
    if let Some(other) = resource.key_prefix() {
        return Err(Error::Invalid(InvalidInput::Resource(format!(
            "{resource} is the PostgreSQL name of {} under key prefix {other}: lock {} itself (with that key prefix)",
            resource.without_key_prefix(),
            resource.without_key_prefix()
        ))));
    }
    resource.in_key_prefix(prefix)
}

//! The bounds an issuer checks before it sends anything: the TTL of a lease
//! ([`MIN_TTL`]`..=`[`MAX_TTL`], [`check_ttl`]) and the key prefix ([`check_key_prefix`]), for
//! code that validates configuration up front (a CLI flag, a service's settings).

pub use super::keys::{MAX_KEY_PREFIX_LEN, check_key_prefix};
pub use super::lease::{MAX_TTL, MIN_TTL, check_ttl};

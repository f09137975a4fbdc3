//! Idle expiry: how long a resource's issuer state (its token counter, and whatever else the
//! issuer keeps per resource) outlives the resource's last lease, and what an issuer holds
//! ([`IssuerState`], for `pgfence doctor` and `pgfence lock status`).
//!
//! A counter that expired restarts low. Tokens still never go back where pgfence can know
//! the floor: the Redis issuer re-issues a fresh counter's token above PostgreSQL's
//! high-water mark when it has a floor source ([`RedisIssuer::with_floor_source`]); the
//! PostgreSQL issuer folds an expired counter into a fixed table of floors
//! (`pgfence.issuer_floor`, 4,096 rows per key prefix at most) that a re-created counter
//! starts above. Where the floor cannot be known (rows of guarded tables that no mark maps to
//! the resource, a Redis issuer without a floor source), the first write is refused as stale
//! and [`TokenIssuer::recover_from`](crate::TokenIssuer::recover_from) heals it; PostgreSQL
//! never accepts a token older than a row's or a mark's. See `docs/issuers.md`, "Idle expiry".

use std::time::Duration;

use serde::Serialize;

#[cfg(doc)]
use crate::RedisIssuer;
use crate::error::InvalidInput;
use crate::{Error, Result};

/// The shortest idle expiry accepted: 1 s.
pub const MIN_IDLE_EXPIRY: Duration = Duration::from_secs(1);

/// The longest idle expiry accepted: 3,650 days (longer is "never": leave it off).
pub const MAX_IDLE_EXPIRY: Duration = Duration::from_secs(3650 * 24 * 60 * 60);

/// Checks an idle expiry: [`MIN_IDLE_EXPIRY`]`..=`[`MAX_IDLE_EXPIRY`].
///
/// # Errors
/// [`InvalidInput::Duration`](crate::error::InvalidInput::Duration) outside those bounds.
pub fn check_idle_expiry(idle: Duration) -> Result<Duration> {
    if (MIN_IDLE_EXPIRY..=MAX_IDLE_EXPIRY).contains(&idle) {
        Ok(idle)
    } else {
        Err(Error::Invalid(InvalidInput::Duration(format!(
            "idle expiry {idle:?}: it must be between {MIN_IDLE_EXPIRY:?} and {MAX_IDLE_EXPIRY:?} (leave it unset to keep counters for ever)"
        ))))
    }
}

/// The idle expiry in whole milliseconds, as the servers take it.
pub(crate) fn idle_millis(idle: Option<Duration>) -> u64 {
    idle.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// What an issuer keeps per resource, counted on its server ([`TokenIssuer::state`](crate::TokenIssuer::state)).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct IssuerState {
    /// Token counters the issuer holds (one per resource, or per fencing domain).
    pub counters: u64,
    /// Of them, counters that will expire (an idle expiry is set on them); `None` where the
    /// issuer cannot tell.
    pub expiring: Option<u64>,
    /// Lock records (held or lapsed but not yet removed).
    pub locks: u64,
    /// Counters of resources no lease holds now: state kept only for the next lease's token.
    pub idle: u64,
    /// Other per-resource records (Redis attempt keys, ZooKeeper lock directories).
    pub other: u64,
    /// Fixed-size records that stand in for expired counters (the PostgreSQL issuer's floors).
    pub floors: u64,
    /// The idle expiry this issuer is configured with (`None`: counters are kept for ever).
    pub idle_expiry: Option<Duration>,
}

/// What one [`PgIssuer::expire_idle`](crate::issuer::PgIssuer::expire_idle) deleted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ExpiredState {
    /// Counters deleted (each folded into its floor).
    pub counters: u64,
    /// Lapsed lock rows deleted.
    pub locks: u64,
}

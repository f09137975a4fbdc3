//! Token issuers: leases and strictly increasing fence tokens from a lock service.
//!
//! What most code needs is here: the four issuers ([`RedisIssuer`], [`PgIssuer`],
//! `EtcdIssuer` with feature `etcd`, `ZkIssuer` with feature `zk`), which share their lease
//! methods (`acquire`, `acquire_as`, `acquire_wait`, `release`, `extend`, `extend_until`,
//! `status`, `keep_alive`); the [`TokenIssuer`] trait over all of them, with
//! [`connect_issuer`] / [`connect_issuer_with`] ([`IssuerOptions`]) to pick one by URL and
//! [`IssuerKind`] to tell them apart ([`IssuerKind::of_url`]: which issuer a URL names);
//! what a lease is and what its calls report ([`Lease`], [`LeaseState`], [`ReleaseOutcome`],
//! [`LockStatus`]); background renewal ([`KeepAlive`], [`LeaseLost`]); and the defaults
//! ([`DEFAULT_CALL_TIMEOUT`], [`DEFAULT_KEY_PREFIX`]).
//!
//! What belongs to one store is in its module: [`redis`] (connections, Sentinel, key names,
//! the ACL a Redis user needs, the floor source that recovers a lost counter), `etcd` and
//! `zk` (URL schemes, key names). [`limits`] has the TTL and key-prefix checks every acquire
//! makes, for validating configuration up front.
//!
//! Inside, one policy (`policy`) writes once what every issuer does the same way (validation,
//! re-sending a call lost in transit, waiting for a lock, the retry windows of release,
//! extend and status, and the [`TokenIssuer`] surface), and `methods` generates the issuers'
//! shared methods over it; each backend answers one attempt at a time:
//!
//! * `redis`: the default issuer, standalone, Cluster or through Sentinel (one Lua script
//!   per acquire), whose counter a failover can send backwards ([`redis::FloorSource`],
//!   reseeding);
//! * `etcd` (feature `etcd`): tokens are cluster revisions;
//! * `zk` (feature `zk`): tokens are the zxids that created the lock nodes;
//! * `pg`: a lease table in PostgreSQL itself.

mod connect;
#[cfg(feature = "etcd")]
pub mod etcd;
mod idle;
mod keepalive;
mod keys;
mod lease;
pub mod limits;
mod methods;
mod pg;
mod policy;
pub mod redis;
mod token_issuer;
mod url;
#[cfg(feature = "zk")]
pub mod zk;

pub use connect::{IssuerOptions, connect_issuer, connect_issuer_with};
#[cfg(feature = "etcd")]
pub use etcd::EtcdIssuer;
#[cfg(feature = "etcd")]
pub(crate) use etcd::is_transient as etcd_is_transient;
pub(crate) use idle::idle_millis;
pub use idle::{ExpiredState, IssuerState, MAX_IDLE_EXPIRY, MIN_IDLE_EXPIRY, check_idle_expiry};
pub use keepalive::{KeepAlive, LeaseLost};
pub use keys::DEFAULT_KEY_PREFIX;
pub(crate) use keys::fencing_name;
pub use lease::{Lease, LeaseState, LockStatus, ReleaseOutcome};
pub use pg::{EXPIRE_BATCH, PgIssuer};
pub use policy::DEFAULT_CALL_TIMEOUT;
pub use redis::RedisIssuer;
pub use token_issuer::{BoxFuture, IssuerKind, TokenIssuer};
pub(crate) use url::{invalid_redis_url, shown_url, unanswered};
#[cfg(feature = "zk")]
pub use zk::ZkIssuer;
#[cfg(feature = "zk")]
pub(crate) use zk::is_transient as zk_is_transient;

/// The Redis issuer's name before 0.3: [`RedisIssuer`], named like [`PgIssuer`] and the
/// others.
#[deprecated(
    since = "0.3.0",
    note = "renamed `RedisIssuer` (`pgfence::issuer::RedisIssuer`)"
)]
pub type Issuer<C = redis::RedisConnections> = RedisIssuer<C>;

#[cfg(test)]
mod tests {
    /// Code written against 0.2's name still compiles (with a deprecation warning).
    #[test]
    #[allow(deprecated)]
    fn the_old_redis_issuer_name_still_compiles() {
        let connect = crate::Issuer::connect("redis://127.0.0.1:1");
        drop(connect);
        let typed: Option<super::Issuer> = None;
        let _: Option<super::RedisIssuer> = typed;
    }
}

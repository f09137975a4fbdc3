//! Token issuers: leases and strictly increasing fence tokens from a lock service.
//!
//! One policy over small backends. `policy` writes once what every issuer does the same way
//! (validation, re-sending a call lost in transit, waiting for a lock, the retry windows of
//! release, extend and status, and the [`TokenIssuer`] surface); each backend answers one
//! attempt at a time:
//!
//! * `redis`: the default issuer, standalone, Cluster or through Sentinel (one Lua script
//!   per acquire), whose counter a failover can send backwards ([`FloorSource`], reseeding);
//! * `etcd` (feature `etcd`): tokens are cluster revisions;
//! * `zk` (feature `zk`): tokens are the zxids that created the lock nodes;
//! * `pg`: a lease table in PostgreSQL itself.
//!
//! Shared by all: `lease` (what a granted lock is and what its calls report), `keys` (key
//! prefixes), `url` (URL parsing), `token_issuer` (the trait and [`IssuerKind`]),
//! `connect` (an issuer picked by URL) and `keepalive` (background renewal).

mod connect;
#[cfg(feature = "etcd")]
pub mod etcd;
mod keepalive;
mod keys;
mod lease;
pub mod limits;
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
pub use keepalive::{KeepAlive, LeaseLost};
pub use keys::DEFAULT_KEY_PREFIX;
pub(crate) use keys::fencing_name;
pub use lease::{Lease, LeaseState, LockStatus, ReleaseOutcome};
pub use pg::PgIssuer;
pub use policy::DEFAULT_CALL_TIMEOUT;
pub use redis::RedisIssuer;
pub use token_issuer::{BoxFuture, IssuerKind, TokenIssuer};
pub(crate) use url::{invalid_redis_url, unanswered, url_host};
#[cfg(feature = "zk")]
pub use zk::ZkIssuer;
#[cfg(feature = "zk")]
pub(crate) use zk::is_transient as zk_is_transient;

/// The Redis issuer's name before 0.3: [`RedisIssuer`], named like [`PgIssuer`] and the
/// others.
#[deprecated(since = "0.3.0", note = "renamed `RedisIssuer` (`pgfence::issuer::RedisIssuer`)")]
pub type Issuer<C = redis::RedisConnections> = RedisIssuer<C>;

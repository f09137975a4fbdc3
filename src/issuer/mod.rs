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
mod etcd;
mod keepalive;
mod keys;
mod lease;
mod pg;
mod policy;
mod redis;
mod token_issuer;
mod url;
#[cfg(feature = "zk")]
mod zk;

pub use connect::{IssuerOptions, connect_issuer, connect_issuer_with};
#[cfg(feature = "etcd")]
pub(crate) use etcd::is_transient as etcd_is_transient;
#[cfg(feature = "etcd")]
pub use etcd::{ETCD_SCHEME, ETCD_TLS_SCHEME, EtcdIssuer, etcd_lock_key, is_etcd_url};
pub use keepalive::{KeepAlive, LeaseLost};
pub(crate) use keys::fencing_name;
pub use keys::{DEFAULT_KEY_PREFIX, MAX_KEY_PREFIX_LEN, check_key_prefix};
pub use lease::{
    Lease, LeaseState, LockStatus, MAX_TTL, MIN_TTL, ReleaseOutcome, check_ttl, new_owner_id,
};
pub use pg::{POSTGRES_SCHEMES, PgIssuer, is_postgres_url};
pub use policy::DEFAULT_CALL_TIMEOUT;
pub use redis::{
    DEFAULT_FAILOVER_WAIT, DEFAULT_SENTINEL_PORT, FloorSource, Issuer, REDIS_ACL_COMMANDS,
    REDIS_SENTINEL_ACL_RULE, RedisConnections, SENTINEL_SCHEME, SENTINEL_TLS_SCHEME,
    SentinelConnections, SentinelUrl, counter_key, default_connections, is_sentinel_url, lock_key,
    redis_acl_key_pattern, redis_acl_rule,
};
pub use token_issuer::{BoxFuture, IssuerKind, TokenIssuer};
pub(crate) use url::{invalid_redis_url, unanswered, url_host};
#[cfg(feature = "zk")]
pub(crate) use zk::is_transient as zk_is_transient;
#[cfg(feature = "zk")]
pub use zk::{ZK_SCHEME, ZkIssuer, is_zk_url, zk_lock_dir};

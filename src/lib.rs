#![doc = include_str!("doc_links.md")]
#![doc = include_str!("../README.md")]

/// The reference, one page per topic: the files in the repository's `docs/` folder, rendered
/// here so that their examples are compiled and their links checked. The crate-level page
/// (the README) is the overview.
pub mod guide {
    #[doc = include_str!("doc_links.md")]
    #[doc = include_str!("../docs/design.md")]
    pub mod design {}
    #[doc = include_str!("doc_links.md")]
    #[doc = include_str!("../docs/library.md")]
    pub mod library {}
    #[doc = include_str!("doc_links.md")]
    #[doc = include_str!("../docs/issuers.md")]
    pub mod issuers {}
    #[doc = include_str!("doc_links.md")]
    #[doc = include_str!("../docs/sql.md")]
    pub mod sql {}
    #[doc = include_str!("doc_links.md")]
    #[doc = include_str!("../docs/operations.md")]
    pub mod operations {}
    #[doc = include_str!("doc_links.md")]
    #[doc = include_str!("../docs/cli.md")]
    pub mod cli {}
    #[doc = include_str!("doc_links.md")]
    #[doc = include_str!("../docs/proof.md")]
    pub mod proof {}
    #[doc = include_str!("doc_links.md")]
    #[doc = include_str!("../docs/failover.md")]
    pub mod failover {}
}

mod audit;
mod batch;
mod doctor;
mod effect;
mod error;
mod fence;
mod grant;
mod guard;
mod ident;
mod issuer;
mod layout;
mod metrics;
mod migrate;
mod recovery;
mod rejection;
mod repository;
mod resource;
mod sql;
mod timeline;
mod tls;
mod token;
mod verify;

pub use audit::{
    AuditEntry, AuditEvent, AuditFilter, AuditSink, Auditor, DEFAULT_AUDIT_TIMEOUT, LOG_TARGET,
    Rejection, list as list_audit, prune as prune_audit,
};
pub use batch::{BatchOutcome, BatchSummary, Claimed, MAX_BATCH_ROWS, RowOutcome};
pub use doctor::{
    DEFAULT_LIMIT_MARGIN, DoctorOptions, Finding, FindingKind, Severity, acknowledge_failover,
    doctor,
};
pub use effect::{
    EFFECT_TABLE, Effect, EffectOutcome, EffectRecord, Effects, MAX_STEP_LEN, MAX_WORK_KEY_LEN,
};
pub use error::{
    Error, Result, SQLSTATE_BYPASS_REFUSED, SQLSTATE_DUPLICATE, SQLSTATE_FAILED_OVER,
    SQLSTATE_FENCE_TYPE, SQLSTATE_LEASELESS, SQLSTATE_PROTECTED, SQLSTATE_SEALED, SQLSTATE_STALE,
    SQLSTATE_TOKEN_JUMP, StaleTarget,
};
pub use fence::{Fence, counter_floor, high_water};
pub use grant::{grant, grant_sql};
pub use guard::{
    GuardMode, GuardedTable, allow_bypass, bypass, disallow_bypass, guard, guard_migration_sql,
    guard_migration_sql_with, guard_mode, guard_with, guarded_tables, guarded_tables_with_modes,
    unguard,
};
pub use ident::{Ident, TableName};
#[cfg(feature = "etcd")]
pub use issuer::ETCD_TLS_SCHEME;
pub use issuer::{
    BoxFuture, DEFAULT_KEY_PREFIX, FloorSource, Issuer, IssuerKind, IssuerOptions, KeepAlive,
    Lease, LeaseLost, LeaseState, LockStatus, MAX_KEY_PREFIX_LEN, MAX_TTL, MIN_TTL,
    POSTGRES_SCHEMES, PgIssuer, RedisConnections, ReleaseOutcome, TokenIssuer, check_key_prefix,
    check_ttl, connect_issuer, connect_issuer_with, counter_key, default_connections,
    is_postgres_url, lock_key, new_owner_id,
};
pub use issuer::{
    DEFAULT_FAILOVER_WAIT, DEFAULT_SENTINEL_PORT, SENTINEL_SCHEME, SentinelConnections,
    SentinelUrl, is_sentinel_url,
};
#[cfg(feature = "etcd")]
pub use issuer::{ETCD_SCHEME, EtcdIssuer, etcd_lock_key, is_etcd_url};
pub use issuer::{
    REDIS_ACL_COMMANDS, REDIS_SENTINEL_ACL_RULE, SENTINEL_TLS_SCHEME, redis_acl_key_pattern,
    redis_acl_rule,
};
#[cfg(feature = "zk")]
pub use issuer::{ZK_SCHEME, ZkIssuer, is_zk_url, zk_lock_dir};
pub use layout::StoredFence;
pub use migrate::{MigrationInfo, migrate, status as migration_status};
pub use repository::{FencedTable, KeyArrays, PgQuery, Repository, Upserted, WriteExecutor};
pub use resource::{MAX_RESOURCE_LEN, Resource};
pub use token::{FenceToken, Fencing, MAX_TOKEN, Relation, SEALED_SEQUENCE, next_sequence};
pub use verify::ColumnType;

/// `#[derive(FencedTable)]`: implements [`FencedTable`](trait@FencedTable) from a struct's
/// fields and `#[fenced(...)]` / `#[sqlx(...)]` attributes, so the struct that reads rows
/// (`#[derive(sqlx::FromRow)]`) also declares the table. Its attributes follow.
#[cfg(feature = "derive")]
pub use pgfence_derive::FencedTable;

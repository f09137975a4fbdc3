#![doc = include_str!("../README.md")]

mod audit;
mod batch;
mod error;
mod fence;
mod guard;
mod ident;
mod issuer;
mod migrate;
mod recovery;
mod repository;
mod resource;
mod sql;
mod token;

pub use audit::{
    AuditEntry, AuditEvent, AuditFilter, AuditSink, Auditor, DEFAULT_AUDIT_TIMEOUT, LOG_TARGET,
    Rejection, list as list_audit, prune as prune_audit,
};
pub use batch::{BatchOutcome, BatchSummary, Claimed, MAX_BATCH_ROWS, RowOutcome};
pub use error::{
    Error, Result, SQLSTATE_DUPLICATE, SQLSTATE_EXHAUSTED, SQLSTATE_FENCE_TYPE, SQLSTATE_PROTECTED,
    SQLSTATE_STALE, StaleTarget,
};
pub use fence::{Fence, counter_floor, high_water};
pub use guard::{guard, guard_migration_sql, guarded_tables, unguard};
pub use ident::{Ident, TableName};
pub use issuer::{
    FloorSource, Issuer, KeepAlive, Lease, LeaseLost, LeaseState, LockStatus, MAX_TTL, MIN_TTL,
    RedisConnections, check_ttl, counter_key, default_connections, lock_key, new_owner_id,
};
pub use migrate::{MigrationInfo, migrate, status as migration_status};
pub use repository::{FencedTable, KeyArrays, PgQuery, Repository, Upserted, WriteExecutor};
pub use resource::{MAX_RESOURCE_LEN, Resource};
pub use token::{FenceToken, Fencing, MAX_TOKEN, MAX_WRITES_PER_ROW, Relation};

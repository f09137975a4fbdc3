#![doc = include_str!("../README.md")]

pub mod audit;
pub mod chaos;
pub mod check;
pub mod ephemeral;
pub mod error;
pub mod guard;
pub mod ident;
pub mod issuer;
pub mod keepalive;
pub mod migrate;
pub mod repository;
pub mod resource;
pub mod token;

pub use audit::{AuditEntry, AuditFilter, Auditor};
pub use check::{Fence, high_water};
pub use error::{Error, Result, SQLSTATE_FENCE_TYPE, SQLSTATE_PROTECTED, SQLSTATE_STALE};
pub use guard::{guard, guarded_tables, unguard};
pub use ident::{Ident, TableName};
pub use issuer::{Issuer, Lease, LeaseState, LockStatus, RedisConnections};
pub use keepalive::{KeepAlive, LeaseLost};
pub use migrate::{MigrationInfo, migrate};
pub use repository::{
    FencedTable, Fencing, PgQuery, Repository, Upserted, WriteExecutor, WriteTarget,
};
pub use resource::Resource;
pub use token::FenceToken;

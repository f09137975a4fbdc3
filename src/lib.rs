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

pub mod audit;
mod batch;
mod doctor;
pub mod effect;
pub mod error;
mod executor;
mod fence;
mod grant;
pub mod guard;
mod ident;
pub mod issuer;
mod layout;
mod metrics;
mod migrate;
mod outcome;
mod recovery;
mod rejection;
pub mod repository;
pub mod resource;
mod sql;
pub mod table;
mod timeline;
mod tls;
pub mod token;
mod verify;

pub mod admin {
    //! Deploy-time and operator calls: the schema ([`migrate`], [`migration_status`]), a
    //! role's least privileges ([`grant`]), the health check ([`doctor`],
    //! [`acknowledge_failover`]) and the numbers a lock service's counter must stay above
    //! ([`high_water`], [`counter_floor`]). Guarding tables is [`guard`](crate::guard);
    //! reading the audit trail is [`audit`](crate::audit).

    pub use crate::doctor::{
        DEFAULT_LIMIT_MARGIN, DoctorOptions, Finding, FindingKind, Severity, acknowledge_failover,
        doctor,
    };
    pub use crate::fence::{counter_floor, high_water};
    pub use crate::grant::{grant, grant_sql};
    pub use crate::migrate::{MigrationInfo, migrate, migration_status};
}

// The names a job author uses; everything else lives in its module.
pub use effect::Effects;
pub use error::{Error, Result};
#[allow(deprecated)]
pub use issuer::Issuer;
pub use issuer::{Lease, RedisIssuer, TokenIssuer, connect_issuer};
pub use repository::{Repository, WriteExecutor};
pub use resource::{Fence, Resource};
pub use table::FencedTable;
pub use token::{FenceToken, Fencing};

/// `#[derive(FencedTable)]`: implements [`FencedTable`](trait@FencedTable) from a struct's
/// fields and `#[fenced(...)]` / `#[sqlx(...)]` attributes, so the struct that reads rows
/// (`#[derive(sqlx::FromRow)]`) also declares the table. Its attributes follow.
#[cfg(feature = "derive")]
pub use pgfence_derive::FencedTable;

#[cfg(test)]
mod doc_refs;

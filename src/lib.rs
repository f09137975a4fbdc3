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
pub mod effect;
pub mod error;
mod fence;
pub mod guard;
mod ident;
pub mod issuer;
mod metrics;
mod recovery;
pub mod repository;
pub mod resource;
pub mod table;
mod timeline;
mod tls;
pub mod token;

pub mod admin;

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
mod arch_rules;
#[cfg(test)]
mod doc_refs;

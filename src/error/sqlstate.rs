//! The SQLSTATEs pgfence's SQL raises: custom class `PF` ("pgfence"). docs/sql.md,
//! "SQLSTATEs", says what each means and what its `DETAIL` carries.

/// SQLSTATE raised by pgfence's SQL (the guard trigger and `pgfence.check`) when a fence token
/// is not newer than the one already recorded. Custom class `PF` ("pgfence").
pub const STALE: &str = "PF001";
/// SQLSTATE raised by `pgfence.guard` when the table has a `fence` column that is not `bigint`.
pub const FENCE_TYPE: &str = "PF002";

/// SQLSTATE raised by `pgfence.guard` for tables in the `pgfence` schema or a system schema.
pub const PROTECTED: &str = "PF003";
/// SQLSTATE raised by `pgfence.check` / `pgfence.next_fence` when another lease already
/// presented the same token (the token counter went backwards).
pub const DUPLICATE: &str = "PF004";
/// SQLSTATE raised by `pgfence.next_fence` when the row was sealed (changed outside the
/// fencing protocol) after this lease wrote it.
pub const SEALED: &str = "PF005";
/// SQLSTATE raised by the guard trigger for a bypass it refuses: set with a plain `SET` (not
/// `pgfence.bypass()` in the writing transaction), or by a role that may not bypass.
pub const BYPASS_REFUSED: &str = "PF006";
/// SQLSTATE raised by the guard trigger for a lease-less UPDATE that changed the fence in a
/// way no lease's write does (`fence = fence + 1`).
pub const LEASELESS: &str = "PF007";
/// SQLSTATE raised when a token is more than the poisoning bound (`pgfence.max_token_jump()`,
/// 2^36 by default) above a resource mark's or row's current token.
pub const TOKEN_JUMP: &str = "PF008";
/// SQLSTATE raised when a lease that first wrote or checked on an earlier PostgreSQL timeline
/// presents itself after the database was promoted to a new one (a failover that may have lost
/// commits): the lease is fenced out.
pub const FAILED_OVER: &str = "PF009";

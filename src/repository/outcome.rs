//! What fenced writes report: [`Upserted`] for a single upsert, and for batches one
//! [`RowOutcome`] per row ([`BatchOutcome`], [`BatchSummary`], [`Claimed`]). Public as
//! `pgfence::repository::*`; defined apart so that the rejection path, which produces them,
//! does not import the repository.

/// What an [`Repository::upsert`](crate::Repository::upsert) did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Upserted {
    /// The row did not exist and was inserted.
    Inserted,
    /// The row existed with an older fence and was updated.
    Updated,
}

/// The most rows one batch call takes.
pub const MAX_BATCH_ROWS: usize = 10_000;

/// What happened to one row of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RowOutcome {
    /// Written (update, delete, claim).
    Applied,
    /// Upsert: the row did not exist and was inserted.
    Inserted,
    /// Upsert: the row existed and was updated.
    Updated,
    /// A newer lease had written or claimed the row (or, for upsert, deleted it). Audited.
    Stale {
        /// The token of that lease.
        current: i64,
        /// That token came from another counter (another resource or fencing domain).
        other_counter: bool,
    },
    /// Another lease presented the same token at this row (the counter went backwards).
    /// Audited.
    DuplicateToken,
    /// No such row.
    NotFound,
    /// The row was sealed (changed outside the fencing protocol) after this lease wrote it;
    /// nothing was written to it (audited). Take a new lease and re-read it.
    Sealed,
    /// The row was replaced while the batch ran; nothing was written to it. Retryable.
    Contended,
}

impl RowOutcome {
    /// Whether the row was written.
    #[must_use]
    pub fn is_applied(self) -> bool {
        matches!(self, Self::Applied | Self::Inserted | Self::Updated)
    }
}

/// Counts of a batch's outcomes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchSummary {
    /// Rows written (inserted and updated included).
    pub applied: usize,
    /// Upsert: rows inserted.
    pub inserted: usize,
    /// Upsert: rows updated.
    pub updated: usize,
    /// Rows a newer lease had written.
    pub stale: usize,
    /// Rows where another lease had presented the same token.
    pub duplicate_token: usize,
    /// Rows that did not exist.
    pub not_found: usize,
    /// Rows sealed since this lease wrote them.
    pub sealed: usize,
    /// Rows replaced while the batch ran.
    pub contended: usize,
}

/// One outcome per input row, in input order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchOutcome {
    /// The outcomes, `rows[i]` for input row `i`.
    pub rows: Vec<RowOutcome>,
}

impl BatchOutcome {
    /// Counts by outcome.
    #[must_use]
    pub fn summary(&self) -> BatchSummary {
        let mut s = BatchSummary::default();
        for row in &self.rows {
            match row {
                RowOutcome::Applied => s.applied += 1,
                RowOutcome::Inserted => {
                    s.applied += 1;
                    s.inserted += 1;
                }
                RowOutcome::Updated => {
                    s.applied += 1;
                    s.updated += 1;
                }
                RowOutcome::Stale { .. } => s.stale += 1,
                RowOutcome::DuplicateToken => s.duplicate_token += 1,
                RowOutcome::NotFound => s.not_found += 1,
                RowOutcome::Sealed => s.sealed += 1,
                RowOutcome::Contended => s.contended += 1,
            }
        }
        s
    }

    /// Whether every row was written.
    #[must_use]
    pub fn all_applied(&self) -> bool {
        self.rows.iter().all(|r| r.is_applied())
    }
}

/// What [`Repository::claim_many`](crate::Repository::claim_many) returns: the claimed rows and every row's outcome.
#[derive(Clone, Debug)]
pub struct Claimed<R> {
    /// `rows[i]` is input key `i`'s row when it was claimed, `None` otherwise.
    pub rows: Vec<Option<R>>,
    /// One outcome per input key.
    pub outcome: BatchOutcome,
}

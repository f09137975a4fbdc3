//! What a run produced: the [`Report`] with its [`Summary`], and how the summary prints.

use std::fmt;

use serde::Serialize;

use crate::{
    Attempt, FaultMark, LeaseRecord, LeaselessAttempt, LibraryCall, Mode, NemesisEvent,
    NemesisFigures,
};

/// How the run recovered from one fault. Only leases granted after the fault count (for an
/// issuer failover: leases asked for after it, which the old leader cannot have issued).
#[derive(Clone, Debug, Serialize)]
pub struct FaultRecovery {
    /// The fault.
    pub name: String,
    /// When it happened (ms since the run started).
    pub at_ms: u64,
    /// Rows that accepted a write again (from a lease granted after the fault).
    pub rows_recovered: usize,
    /// Rows in the run.
    pub rows: usize,
    /// Leases granted after the fault, summed over rows, up to and including each row's first
    /// accepted write.
    pub leases_to_recover: u64,
    /// The most leases any single row needed.
    pub max_leases_one_row: u64,
    /// Stale rejections among those leases (the price of the lost counter).
    pub rejections_before_recovery: u64,
    /// Failed attempts (connection errors...) started after the fault and before the last row
    /// recovered.
    pub errors_before_recovery: u64,
    /// Failed acquisitions after the fault and before the last row recovered.
    pub acquire_errors_before_recovery: u64,
    /// From the fault to the first accepted write on any row.
    pub first_write_ms: Option<u64>,
    /// From the fault until every row had accepted a write again.
    pub recovery_ms: Option<u64>,
}

/// An issuer failover (the fault named `failover`): who died, who took over, and the tokens
/// and writes on either side of it.
///
/// The failover's mark is taken once the old leader's process is gone (`SIGKILL` delivered,
/// its port closed). "Before" is the leases granted until then; "after" is the leases whose
/// acquisition *started* after it, so none of them can have been issued by the old leader,
/// and for Redis also those granted after it (only the promoted replica can have issued them). etcd revisions and ZooKeeper zxids never go backwards, so there
/// `min_token_after > max_token_before` and `resources_backwards` is 0. A Redis replica
/// promoted with a counter that is behind re-issues tokens Postgres has already seen: those
/// writes must be rejected (stale, or a duplicate token), never accepted.
#[derive(Clone, Debug, Serialize)]
pub struct FailoverFigures {
    /// The issuer.
    pub issuer: String,
    /// When the old leader was gone (ms since the run started): the fault's mark.
    pub at_ms: u64,
    /// Units started by then.
    pub at_unit: u64,
    /// The leader (or Redis master) killed.
    pub old_leader: String,
    /// The one that took over.
    pub new_leader: Option<String>,
    /// From the `SIGKILL` until the survivors named the new leader (or promoted the replica).
    pub new_leader_after_ms: Option<u64>,
    /// Redis: the unit at which the replica was paused and cut off.
    pub replica_paused_at_unit: Option<u64>,
    /// Leases granted before the failover.
    pub leases_before: u64,
    /// The highest token of a committed write by a lease granted before the failover.
    pub max_token_before: Option<i64>,
    /// Leases asked for after the failover (Redis: or granted after it).
    pub leases_after: u64,
    /// The lowest token issued to those leases.
    pub min_token_after: Option<i64>,
    /// Whether `min_token_after > max_token_before` (`None` without leases on both sides).
    pub tokens_increased: Option<bool>,
    /// Resources (rows; groups in batch mode) whose lowest token issued after the failover was
    /// at most their highest token accepted before it: the counter went backwards there.
    pub resources_backwards: u64,
    /// Statements committed by the leases after the failover.
    pub accepted_after: u64,
    /// Those leases with at least one committed statement.
    pub units_accepted_after: u64,
    /// Rejections those leases met (rows in batch mode), duplicate tokens included.
    pub rejected_after: u64,
    /// ... of which duplicate tokens.
    pub duplicates_after: u64,
    /// Rows that accepted a write again after the failover (as in [`FaultRecovery`]).
    pub rows_recovered: usize,
    /// Rows in the run.
    pub rows: usize,
    /// From the mark to the first accepted write on any row.
    pub first_write_ms: Option<u64>,
    /// From the mark until every row had accepted a write again.
    pub recovery_ms: Option<u64>,
}

/// A failover of the harness's own PostgreSQL (primary `SIGKILL`ed, asynchronous standby
/// promoted behind the same address after it had been cut off for a while): what the database
/// itself lost, kept apart from what fencing let through or refused.
///
/// The history rows commit with the writes, so the new primary's history is exactly the
/// writes it kept: the summary's token order, lost updates and stale reads are checked on
/// those. A transaction acknowledged to a worker that the new primary does not have is a
/// write **the database lost** (`acknowledged_lost`, not an acknowledgement mismatch) when its
/// try started before the promotion; the same after the promotion is still a mismatch. A
/// statement committed after the promotion (its try started once the old primary was gone) by
/// a lease that had a statement acknowledged before that is a **zombie write** (`zombie_writes`, counted
/// in the violations): pgfence must refuse such a lease
/// ([`FencedByFailover`](pgfence::Error::FencedByFailover), counted in `rejected`).
#[derive(Clone, Debug, Serialize)]
pub struct PgFailoverFigures {
    /// When the standby was cut off (ms since the run started).
    pub cut_off_at_ms: u64,
    /// Units started by then.
    pub cut_off_at_unit: u64,
    /// When the primary was killed.
    pub kill_at_ms: u64,
    /// When the promoted standby was behind the stable address (the `pg_failover` mark).
    pub promoted_at_ms: u64,
    /// From the kill to the promoted standby behind the stable address, ms.
    pub failover_ms: u64,
    /// The old primary's timeline.
    pub old_timeline: i64,
    /// The new primary's.
    pub new_timeline: i64,
    /// Transactions acknowledged to a worker (before the promotion) that the new primary does
    /// not have: writes the database lost.
    pub acknowledged_lost: u64,
    /// Units (leases) with such a lost transaction.
    pub units_lost: u64,
    /// Tries refused with [`FencedByFailover`](pgfence::Error::FencedByFailover).
    pub fenced_by_failover: u64,
    /// Leases (units) with such a refusal: fenced out by the promotion.
    pub leases_fenced: u64,
    /// Of those, leases without a statement acknowledged before the old primary was gone:
    /// typically their first statement was sent as the primary died and its answer was lost
    /// (it may have run on the old timeline, so pgfence cannot let the lease go on). Safe, at
    /// the cost of a new lease.
    pub leases_fenced_unbound: u64,
    /// Detection: from the promotion to the first `FencedByFailover` refusal a worker got, ms.
    pub first_refusal_ms: Option<u64>,
    /// When the old primary's processes were gone (ms since the run started).
    pub dead_at_ms: u64,
    /// Leases with a statement acknowledged before the old primary was gone that tried again
    /// after it.
    pub leases_across: u64,
    /// Statements committed after the promotion by those leases: zombies back in (violations).
    pub zombie_writes: u64,
    /// Rejections seen in tries that started before the promotion (their audit rows may have
    /// been lost with it).
    pub rejected_before: u64,
    /// Rejections in tries that started after it (each must have its audit row).
    pub rejected_after: u64,
    /// Rejections without an audit row on the new primary, and without an audit-failure
    /// event: their rows were lost by the promotion (at most `rejected_before`).
    pub audit_rows_lost: u64,
    /// The PostgreSQL issuer's counters live in the same database: the promotion rolled them
    /// back too (tokens issued before it may be issued again).
    pub issuer_rolled_back: bool,
    /// Rows that accepted a write again after the promotion.
    pub rows_recovered: usize,
    /// Rows in the run.
    pub rows: usize,
    /// From the promotion to the first accepted write on any row.
    pub first_write_ms: Option<u64>,
    /// From the promotion until every row had accepted a write again.
    pub recovery_ms: Option<u64>,
}

impl PgFailoverFigures {
    /// Whether every rejection is reported as far as the database can say after losing
    /// commits: every rejection after the promotion has its audit row (or an audit-failure
    /// event), and rows are missing only for rejections before it.
    #[must_use]
    pub fn rejections_reported(&self) -> bool {
        self.audit_rows_lost <= self.rejected_before
    }
}

/// Batch mode: the rows of the batches, as the workers saw them (one outcome per row) and as
/// Postgres committed them.
#[derive(Clone, Debug, Default, Serialize)]
pub struct BatchFigures {
    /// Fewest rows a unit wrote.
    pub min_rows: u64,
    /// Most rows a unit wrote.
    pub max_rows: u64,
    /// Rows sent in `claim_many` statements that returned (all tries).
    pub rows_claimed_sent: u64,
    /// ... claimed.
    pub rows_claimed: u64,
    /// ... rejected (stale or duplicate token).
    pub rows_rejected_at_claim: u64,
    /// Rows sent in `update_many` statements that returned.
    pub rows_written_sent: u64,
    /// ... applied (the statement's transaction may still have failed to commit).
    pub rows_applied: u64,
    /// ... rejected (stale or duplicate token): the rows a newer lease took over between this
    /// lease's claim and its update.
    pub rows_rejected_at_write: u64,
    /// Rejected rows that were duplicate tokens (counted in the two above too).
    pub rows_duplicate: u64,
    /// Rows reported contended or not found (not written, not audited).
    pub rows_other: u64,
    /// `claim_many` statements with both claimed and rejected rows.
    pub mixed_claims: u64,
    /// `update_many` statements with both applied and rejected rows.
    pub mixed_writes: u64,
    /// Tries that stopped because a statement had no row left (every row rejected).
    pub tries_fully_rejected: u64,
    /// Row writes committed (history rows of `update_many`: increments and rewrites).
    pub row_writes_committed: u64,
    /// Row claims committed (history rows of `claim_many`).
    pub row_claims_committed: u64,
}

/// Effects modes: the job's side effect — the invoices' charges — as the workers saw their
/// calls, as the effect ledger recorded them and as the payment provider counted them.
///
/// Each counter row has a sequence of invoices (its value is how many are paid), and a unit's
/// work item is the row's next invoice, so every holder of the row meets the same item until
/// one marks it paid. The figure that matters is `duplicate_effects`, counted at the provider:
/// 0 with the ledger's keys ([`Mode::Effects`]), above 0 for the control that sends a key
/// per lease ([`Mode::EffectsUnkeyed`]).
#[derive(Clone, Debug, Default, Serialize)]
pub struct EffectFigures {
    /// Where the call's idempotency key came from: `ledger` (the effect's, the same for every
    /// holder) or `per-lease` (`<item>-<token>`, the control).
    pub keys: String,
    /// How long the provider took to answer a charge, in ms.
    pub provider_latency_ms: u64,
    /// Work items (invoices) recorded in the ledger.
    pub items: u64,
    /// ... recorded by more than one lease: taken over by a newer holder.
    pub items_taken_over: u64,
    /// Takeovers: leases that recorded an item another lease had recorded before (the
    /// ledger's holders beyond the first, summed).
    pub takeovers: u64,
    /// Items whose outcome the ledger has as succeeded.
    pub items_succeeded: u64,
    /// Invoices marked paid in the database (the rows' values, summed).
    pub invoices_paid: u64,
    /// Stalls placed between the ledger's begin and the call (the dangerous spot).
    pub stalls_before_call: u64,
    /// Provider calls the workers made.
    pub calls: u64,
    /// ... answered `200` with a new charge.
    pub calls_charged: u64,
    /// ... answered `200` replaying an earlier charge's answer (no charge).
    pub calls_replayed: u64,
    /// ... answered `409`: the same key was in flight (no charge; the try failed, retryable).
    pub calls_conflict: u64,
    /// ... without an answer, or with another status.
    pub calls_failed: u64,
    /// Late calls: made by a lease after a newer lease had recorded the same item in the
    /// ledger (the zombie's call, after the takeover).
    pub late_calls: u64,
    /// ... deduplicated by the provider: replayed or refused as in flight.
    pub late_calls_deduplicated: u64,
    /// ... that charged: with the ledger's key, only when it reached the provider before the
    /// newer holder's own call (which then got the replay); with a key per lease, a duplicate.
    pub late_calls_charged: u64,
    /// Begins that found the charge recorded as done by a previous holder (call skipped).
    pub done_skips: u64,
    /// Requests the provider received.
    pub provider_requests: u64,
    /// Charges it made.
    pub provider_charges: u64,
    /// Answers it replayed for a known key.
    pub provider_replays: u64,
    /// Requests it refused because the same key was in flight.
    pub provider_conflicts: u64,
    /// **Duplicate provider effects**: items the provider charged more than once.
    pub duplicate_effects: u64,
    /// Charges beyond each item's first.
    pub extra_charges: u64,
    /// Invoices marked paid in the database that the provider never charged (must be 0).
    pub paid_uncharged: u64,
    /// Items charged whose payment no holder recorded before the run ended (its next holder
    /// would get the replay): at most one per row.
    pub charged_unpaid: u64,
    /// Items recorded in the ledger that the provider never charged (every holder was fenced
    /// out, or refused as in flight, before its call got through): at most one per row.
    pub begun_uncharged: u64,
    /// Charges for items the ledger does not have (must be 0).
    pub stray_charges: u64,
    /// Up to 10 items charged more than once, with their charge counts.
    pub duplicate_items: Vec<(String, u64)>,
}

impl EffectFigures {
    /// True when no item was charged twice, every paid invoice was charged, and nothing was
    /// charged that the ledger does not know: exactly once at the provider.
    #[must_use]
    pub fn exactly_once(&self) -> bool {
        self.duplicate_effects == 0 && self.paid_uncharged == 0 && self.stray_charges == 0
    }
}

/// Leaseless mode: the lease-less writes next to the leases, as their writers saw them and
/// as Postgres committed them, and what they did to the leases.
///
/// A `fence = fence + 1` must be refused every time (`PF007`): one that went through
/// (`fence_plus_one_accepted`) is a violation. A bypass goes through, audited, and seals the
/// row, so the lease that wrote the row before it is rejected (`RowSealed`, `leases_sealed`)
/// instead of writing back a value it read before the bypass: `lost_bypass_increments` must be
/// 0, and so must `sealed_writes`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct LeaselessFigures {
    /// Lease-less writers.
    pub writers: usize,
    /// `fence = fence + 1` updates sent.
    pub fence_plus_one_sent: u64,
    /// ... refused by the guard.
    pub fence_plus_one_refused: u64,
    /// ... of which with `PF007` ([`pgfence::Error::LeaselessWrite`]).
    pub fence_plus_one_refused_pf007: u64,
    /// ... that went through (acknowledged, or in the history): **violations**.
    pub fence_plus_one_accepted: u64,
    /// ... with their history row committed (a subset of the accepted).
    pub fence_plus_one_committed: u64,
    /// ... that failed otherwise (killed backends...).
    pub fence_plus_one_failed: u64,
    /// Bypasses sent.
    pub bypass_sent: u64,
    /// ... acknowledged.
    pub bypass_applied: u64,
    /// ... with their history row committed (the acknowledged ones, and any whose `COMMIT`
    /// lost its acknowledgement): what the rows' values hold besides the leases' increments.
    pub bypass_committed: u64,
    /// ... refused by the guard (the role not allowed: must be 0).
    pub bypass_refused: u64,
    /// ... that failed otherwise.
    pub bypass_failed: u64,
    /// `pgfence.audit` rows of operation `bypass` on the run's rows (one per committed bypass).
    pub bypass_audit_rows: u64,
    /// Lease tries rejected with [`pgfence::Error::RowSealed`]: the lease had claimed the row,
    /// a bypass changed it, and the lease's next write was refused.
    pub leases_sealed: u64,
    /// Lost updates (see [`Summary::lost_updates`]) that were the leases' increments.
    pub lost_lease_increments: u64,
    /// Lost updates that were bypass increments: committed, then overwritten by a lease that
    /// had read the row before it.
    pub lost_bypass_increments: u64,
    /// Lease writes right after a bypass by the lease that wrote the row before it (the seal
    /// must stop them): **violations**.
    pub sealed_writes: u64,
    /// Lease-less writes acknowledged but not in the history, or refused / failed before
    /// `COMMIT` but in it (counted in [`Summary::ack_mismatches`]).
    pub ack_mismatches: u64,
}

/// Errors the workers saw, by kind.
#[derive(Clone, Debug, Serialize)]
pub struct ErrorKind {
    /// Short classification (`database sqlstate 57P01`, `database io`, `redis io`...).
    pub kind: String,
    /// What [`pgfence::Error::is_retryable`] said.
    pub retryable: bool,
    /// How many.
    pub count: u64,
}

/// The run's figures; [`Summary::json`] is the one-line form.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// Run id (resources are `chaos:<run>:<row>`).
    pub run: String,
    /// Protection used.
    pub mode: Mode,
    /// The token issuer (`redis`, `etcd`, `zk`, `postgres`).
    pub issuer: String,
    /// Workers.
    pub workers: usize,
    /// Rows.
    pub rows: usize,
    /// Work units started (leases that went on to write).
    pub units: u64,
    /// Tries (attempted writes in the single-transaction modes), retries included.
    pub attempts: u64,
    /// Statements Postgres committed (from the history written in the same transactions): one
    /// write per unit in the single-transaction modes; claims, increments and rewrites in the
    /// multi-statement modes (in batch mode, per row: row claims and row writes).
    pub accepted: u64,
    /// Committed increments (value-changing writes); the rows' values must add up to this.
    pub increments: u64,
    /// Units with a committed increment.
    pub units_incremented: u64,
    /// Committed increments beyond a unit's first (in `fenced-multi`, beyond the first of each
    /// of its transactions): retries after a lost commit acknowledgement (always 0 in
    /// `row-claim`, whose claim reads back whether the increment landed).
    pub repeated_increments: u64,
    /// Tries that ended accepted: every transaction's commit acknowledged.
    pub acknowledged: u64,
    /// Writes rejected as stale (or as a duplicate token). In batch mode: rows rejected, by the
    /// claims and the updates (each rejected row is audited and logged on its own).
    pub rejected: u64,
    /// Writes that failed with other errors.
    pub errors: u64,
    /// ... of which [`pgfence::Error::is_retryable`] said retryable.
    pub retryable_errors: u64,
    /// Retries made.
    pub retries: u64,
    /// All safety violations: token order + acknowledgement mismatches + torn writes (in
    /// leaseless mode also accepted `fence + 1` updates and writes by sealed leases).
    pub violations: u64,
    /// Accepted writes whose token was older than the previous accepted write's on the row, or
    /// the same token from another lease.
    pub token_order_violations: u64,
    /// Writes reported accepted but not committed, or reported rejected/failed before commit
    /// but committed.
    pub ack_mismatches: u64,
    /// Row updates and history rows that did not commit together (version gaps).
    pub torn_writes: u64,
    /// Sum over rows of committed increments minus the final value. In leaseless mode the
    /// increments are the leases' and the bypasses' ([`LeaselessFigures`] splits the lost ones
    /// by kind).
    pub lost_updates: u64,
    /// Committed statements that read a value other than the previous one left (or changed it
    /// by other than their kind says).
    pub stale_reads: u64,
    /// `pgfence.audit` rows for the run's resources, one per rejection: a row written again
    /// after its first one's `COMMIT` got no answer ([`pgfence::audit::REWRITTEN_IN_DOUBT`])
    /// is not counted when the first one is there too.
    pub audit_rows: u64,
    /// Audit rows the library wrote again through its pool because the transaction that held
    /// the first did not commit, or may not have (counted in `audit_rows` unless they repeat
    /// a row that did commit).
    pub audit_rows_rewritten: u64,
    /// Rejections pgfence reported for the run's resources (counted by the harness's
    /// [`AuditCounter`](crate::AuditCounter); each is also one `pgfence::audit` WARN event).
    pub log_events: u64,
    /// Rejections whose audit row could not be written (each is also one `pgfence::audit`
    /// ERROR event).
    pub audit_failures: u64,
    /// Automatic reseeds from the floor source (`null` without a
    /// [`ReseedCounter`](crate::ReseedCounter), which only Redis runs take).
    pub reseed_events: Option<u64>,
    /// Counter raises by [`pgfence::TokenIssuer::recover_from`] (Redis only: a no-op
    /// elsewhere).
    pub counter_raises: u64,
    /// Injected stalls.
    pub pauses: u64,
    /// Backends terminated (the workers' and, with the PostgreSQL issuer, the issuer's).
    pub backend_kills: u64,
    /// ... of which the PostgreSQL issuer's (0 with the other issuers).
    pub issuer_backend_kills: u64,
    /// ... of which were running the issuer's statement (an acquire or release whose reply
    /// was lost, which the issuer re-sent with the same owner id); the others were idle in
    /// its pool.
    pub issuer_kills_mid_statement: u64,
    /// Acquisitions that failed (issuer errors).
    pub acquire_errors: u64,
    /// Acquisitions that gave up waiting for the lock.
    pub acquire_timeouts: u64,
    /// Releases that found the lease expired.
    pub released_expired: u64,
    /// Releases that found another holder.
    pub released_taken: u64,
    /// Wall-clock duration of the run.
    pub duration_ms: u64,
    /// True when `max_duration` stopped the run early.
    pub timed_out: bool,
    /// Recovery figures, one per fault.
    pub faults: Vec<FaultRecovery>,
    /// Errors by kind.
    pub error_kinds: Vec<ErrorKind>,
    /// Batch mode: the rows' figures; `None` in the other modes.
    pub batch: Option<BatchFigures>,
    /// Effects modes: the charges' figures; `None` in the other modes.
    pub effects: Option<EffectFigures>,
    /// Leaseless mode: the lease-less writes' figures; `None` in the other modes.
    pub leaseless: Option<LeaselessFigures>,
    /// The issuer failover, if the run had one.
    pub failover: Option<FailoverFigures>,
    /// The failover of the harness's own PostgreSQL, if the run had one.
    pub pg_failover: Option<PgFailoverFigures>,
    /// What the nemeses did (partitions, clock steps), if the run had any.
    pub nemesis: Option<NemesisFigures>,
    /// With [`Config::coalesce`](crate::Config::coalesce): what the run's coalescers did.
    pub coalescer: Option<CoalescerFigures>,
}

/// What the run's [`pgfence::repository::Coalescer`]s did (summed over pools), from their
/// [`CoalescerStats`](pgfence::repository::CoalescerStats).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CoalescerFigures {
    /// Updates sent alone at once (nothing was queued).
    pub alone: u64,
    /// Coalesced statements.
    pub statements: u64,
    /// Updates they carried.
    pub carried: u64,
    /// Of those, the ones they applied.
    pub applied: u64,
    /// Updates a coalesced statement did not apply (stale, sealed, the same row twice...),
    /// sent again alone by their callers.
    pub resent: u64,
    /// Statements whose `BEGIN` went with the previous one's `COMMIT`.
    pub chained: u64,
}

impl From<pgfence::repository::CoalescerStats> for CoalescerFigures {
    fn from(s: pgfence::repository::CoalescerStats) -> Self {
        Self {
            alone: s.alone,
            statements: s.statements,
            carried: s.carried,
            applied: s.applied,
            resent: s.resent,
            chained: s.chained,
        }
    }
}

impl Summary {
    /// The summary as one JSON line.
    #[must_use]
    pub fn json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// True when the run showed no violation and no lost update.
    #[must_use]
    pub fn is_safe(&self) -> bool {
        self.violations == 0 && self.lost_updates == 0 && self.stale_reads == 0
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let opt = |v: Option<u64>| v.map_or_else(|| "n/a".to_owned(), |v| v.to_string());
        writeln!(
            f,
            "run {} ({} mode, {} issuer): {} workers on {} rows, {} units in {} ms{}",
            self.run,
            self.mode,
            self.issuer,
            self.workers,
            self.rows,
            self.units,
            self.duration_ms,
            if self.timed_out {
                " (time limit hit)"
            } else {
                ""
            }
        )?;
        writeln!(
            f,
            "  writes:     {} tries ({} acknowledged), {} statements accepted, {} rejected as stale, {} failed ({} retryable), {} retries",
            self.attempts,
            self.acknowledged,
            self.accepted,
            self.rejected,
            self.errors,
            self.retryable_errors,
            self.retries
        )?;
        writeln!(
            f,
            "  increments: {} committed by {} units ({} repeated by retries)",
            self.increments, self.units_incremented, self.repeated_increments
        )?;
        writeln!(
            f,
            "  safety:     {} violations ({} token order, {} ack mismatches, {} torn), {} lost updates, {} stale reads => {}",
            self.violations,
            self.token_order_violations,
            self.ack_mismatches,
            self.torn_writes,
            self.lost_updates,
            self.stale_reads,
            if self.is_safe() { "SAFE" } else { "UNSAFE" }
        )?;
        writeln!(
            f,
            "  reporting:  {} rejections, {} audit rows ({} written again), {} log events, {} audit failures",
            self.rejected,
            self.audit_rows,
            self.audit_rows_rewritten,
            self.log_events,
            self.audit_failures
        )?;
        let issuer_kills = if self.issuer_backend_kills > 0 || self.issuer == "postgres" {
            format!(
                " ({} of them the issuer's, {} mid-statement)",
                self.issuer_backend_kills, self.issuer_kills_mid_statement
            )
        } else {
            String::new()
        };
        writeln!(
            f,
            "  faults:     {} stalls, {} backends killed{}, {} acquire errors, {} acquire timeouts, {} counter raises, {} auto-reseeds",
            self.pauses,
            self.backend_kills,
            issuer_kills,
            self.acquire_errors,
            self.acquire_timeouts,
            self.counter_raises,
            opt(self.reseed_events)
        )?;
        if let Some(b) = &self.batch {
            writeln!(
                f,
                "  batches:    {}–{} rows a unit; claims: {} rows sent, {} claimed, {} rejected; updates: {} rows sent, {} applied, {} rejected; {} duplicate-token rows, {} other",
                b.min_rows,
                b.max_rows,
                b.rows_claimed_sent,
                b.rows_claimed,
                b.rows_rejected_at_claim,
                b.rows_written_sent,
                b.rows_applied,
                b.rows_rejected_at_write,
                b.rows_duplicate,
                b.rows_other
            )?;
            writeln!(
                f,
                "  mixed:      {} claims and {} updates with applied and rejected rows; {} tries fully rejected; committed: {} row writes, {} row claims",
                b.mixed_claims,
                b.mixed_writes,
                b.tries_fully_rejected,
                b.row_writes_committed,
                b.row_claims_committed
            )?;
        }
        if let Some(e) = &self.effects {
            fmt_effects(f, e)?;
        }
        if let Some(l) = &self.leaseless {
            fmt_leaseless(f, l)?;
        }
        for r in &self.faults {
            writeln!(
                f,
                "  recovery:   {} at {} ms: {}/{} rows writing again after {} (first write after {}), {} leases ({} max on one row), {} rejections, {} errors, {} acquire errors",
                r.name,
                r.at_ms,
                r.rows_recovered,
                r.rows,
                r.recovery_ms
                    .map_or_else(|| "never".to_owned(), |v| format!("{v} ms")),
                r.first_write_ms
                    .map_or_else(|| "never".to_owned(), |v| format!("{v} ms")),
                r.leases_to_recover,
                r.max_leases_one_row,
                r.rejections_before_recovery,
                r.errors_before_recovery,
                r.acquire_errors_before_recovery
            )?;
        }
        if let Some(fo) = &self.failover {
            fmt_failover(f, fo)?;
        }
        if let Some(p) = &self.pg_failover {
            fmt_pg_failover(f, p)?;
        }
        if let Some(c) = &self.coalescer {
            writeln!(
                f,
                "  coalescer:  {} alone; {} statements carried {} updates ({} applied, {} sent again alone), {} chained",
                c.alone, c.statements, c.carried, c.applied, c.resent, c.chained
            )?;
        }
        if let Some(n) = &self.nemesis {
            writeln!(
                f,
                "  nemesis:    {} groups; {} black-holes ({} one-way, {} ms in all), {} resets; {} clock steps (offset {} ms)",
                n.groups,
                n.black_holes,
                n.one_way,
                n.black_hole_ms,
                n.resets,
                n.clock_steps,
                n.clock_offset_ms
            )?;
        }
        for k in &self.error_kinds {
            writeln!(
                f,
                "  error:      {} x {} ({})",
                k.count,
                k.kind,
                if k.retryable {
                    "retryable"
                } else {
                    "not retryable"
                }
            )?;
        }
        Ok(())
    }
}

/// The PostgreSQL failover lines of the summary.
fn fmt_pg_failover(f: &mut fmt::Formatter<'_>, p: &PgFailoverFigures) -> fmt::Result {
    let ms = |v: Option<u64>| v.map_or_else(|| "never".to_owned(), |v| format!("{v} ms"));
    writeln!(
        f,
        "  pg failover: standby cut off at {} ms (unit {}), primary killed at {} ms, standby promoted after {} ms (timeline {} -> {})",
        p.cut_off_at_ms,
        p.cut_off_at_unit,
        p.kill_at_ms,
        p.failover_ms,
        p.old_timeline,
        p.new_timeline
    )?;
    writeln!(
        f,
        "  db lost:    {} acknowledged transactions ({} units) the new primary does not have; {} audit rows lost with them",
        p.acknowledged_lost, p.units_lost, p.audit_rows_lost
    )?;
    writeln!(
        f,
        "  fenced:     {} tries refused FencedByFailover ({} leases, {} of them without a statement before the kill; first {} after the promotion); {} leases from before the kill tried again after it, {} zombie writes got in; rejections {} before / {} after the promotion",
        p.fenced_by_failover,
        p.leases_fenced,
        p.leases_fenced_unbound,
        ms(p.first_refusal_ms),
        p.leases_across,
        p.zombie_writes,
        p.rejected_before,
        p.rejected_after
    )?;
    writeln!(
        f,
        "  pg recovery: {}/{} rows writing again after {} (first write after {}){}",
        p.rows_recovered,
        p.rows,
        ms(p.recovery_ms),
        ms(p.first_write_ms),
        if p.issuer_rolled_back {
            "; the postgres issuer's counters rolled back with the database"
        } else {
            ""
        }
    )
}

/// The effects lines of the summary.
fn fmt_effects(f: &mut fmt::Formatter<'_>, e: &EffectFigures) -> fmt::Result {
    writeln!(
        f,
        "  effects:    {} items in the ledger ({} taken over, {} takeovers), {} succeeded, {} invoices paid; keys: {}",
        e.items, e.items_taken_over, e.takeovers, e.items_succeeded, e.invoices_paid, e.keys
    )?;
    writeln!(
        f,
        "  calls:      {} ({} charged, {} replayed, {} conflict, {} failed), {} late calls after a takeover ({} deduplicated, {} charged), {} stalls before a call, {} skipped as done",
        e.calls,
        e.calls_charged,
        e.calls_replayed,
        e.calls_conflict,
        e.calls_failed,
        e.late_calls,
        e.late_calls_deduplicated,
        e.late_calls_charged,
        e.stalls_before_call,
        e.done_skips
    )?;
    writeln!(
        f,
        "  provider:   {} requests, {} charges, {} replays, {} conflicts ({} ms latency)",
        e.provider_requests,
        e.provider_charges,
        e.provider_replays,
        e.provider_conflicts,
        e.provider_latency_ms
    )?;
    let dups = if e.duplicate_items.is_empty() {
        String::new()
    } else {
        let list: Vec<String> = e
            .duplicate_items
            .iter()
            .map(|(item, n)| format!("{item} x{n}"))
            .collect();
        format!(" (e.g. {})", list.join(", "))
    };
    writeln!(
        f,
        "  charges:    {} duplicate provider effects ({} extra charges){}, {} paid but never charged, {} charged but not recorded paid, {} begun but never charged, {} stray => {}",
        e.duplicate_effects,
        e.extra_charges,
        dups,
        e.paid_uncharged,
        e.charged_unpaid,
        e.begun_uncharged,
        e.stray_charges,
        if e.exactly_once() {
            "EXACTLY ONCE"
        } else if e.duplicate_effects > 0 {
            "CHARGED TWICE"
        } else {
            "INCONSISTENT"
        }
    )
}

/// The leaseless lines of the summary.
fn fmt_leaseless(f: &mut fmt::Formatter<'_>, l: &LeaselessFigures) -> fmt::Result {
    writeln!(
        f,
        "  lease-less: {} writers; fence + 1: {} sent, {} refused ({} PF007), {} accepted, {} failed; bypass: {} sent, {} applied ({} committed, {} audit rows), {} refused, {} failed",
        l.writers,
        l.fence_plus_one_sent,
        l.fence_plus_one_refused,
        l.fence_plus_one_refused_pf007,
        l.fence_plus_one_accepted,
        l.fence_plus_one_failed,
        l.bypass_sent,
        l.bypass_applied,
        l.bypass_committed,
        l.bypass_audit_rows,
        l.bypass_refused,
        l.bypass_failed
    )?;
    writeln!(
        f,
        "  sealed:     {} lease tries rejected as sealed (RowSealed); lost: {} lease increments, {} bypass increments; {} writes by sealed leases",
        l.leases_sealed, l.lost_lease_increments, l.lost_bypass_increments, l.sealed_writes
    )
}

/// The failover lines of the summary.
fn fmt_failover(f: &mut fmt::Formatter<'_>, fo: &FailoverFigures) -> fmt::Result {
    let opt = |v: Option<i64>| v.map_or_else(|| "n/a".to_owned(), |v| v.to_string());
    let ms = |v: Option<u64>| v.map_or_else(|| "never".to_owned(), |v| format!("{v} ms"));
    let paused = fo
        .replica_paused_at_unit
        .map_or_else(String::new, |u| format!(" (replica paused at unit {u})"));
    writeln!(
        f,
        "  failover:   {} leader {} killed at unit {} ({} ms){}; {} took over after {}",
        fo.issuer,
        fo.old_leader,
        fo.at_unit,
        fo.at_ms,
        paused,
        fo.new_leader.as_deref().unwrap_or("nobody"),
        ms(fo.new_leader_after_ms),
    )?;
    writeln!(
        f,
        "  tokens:     max accepted before {} ({} leases), min issued after {} ({} leases): {}; {} resources went backwards",
        opt(fo.max_token_before),
        fo.leases_before,
        opt(fo.min_token_after),
        fo.leases_after,
        match fo.tokens_increased {
            Some(true) => "increased",
            Some(false) => "WENT BACKWARDS",
            None => "n/a",
        },
        fo.resources_backwards,
    )?;
    writeln!(
        f,
        "  after it:   {} statements accepted by {} units, {} rejected ({} duplicate tokens); {}/{} rows writing again after {} (first write after {})",
        fo.accepted_after,
        fo.units_accepted_after,
        fo.rejected_after,
        fo.duplicates_after,
        fo.rows_recovered,
        fo.rows,
        ms(fo.recovery_ms),
        ms(fo.first_write_ms),
    )
}

/// Everything a run produced: the summary and the full client-side history.
#[derive(Clone, Debug)]
pub struct Report {
    /// Figures and verdicts.
    pub summary: Summary,
    /// Every attempted write, in no particular order.
    pub attempts: Vec<Attempt>,
    /// Every granted lease that went on to write.
    pub leases: Vec<LeaseRecord>,
    /// Leaseless mode: every lease-less write, in no particular order.
    pub leaseless: Vec<LeaselessAttempt>,
    /// Faults, in order.
    pub faults: Vec<FaultMark>,
    /// Nemesis actions (partitions, clock steps), in order.
    pub nemesis: Vec<NemesisEvent>,
    /// Each counter row's final value as PostgreSQL committed it, `(row, value)` by row.
    pub final_values: Vec<(i32, i64)>,
    /// The library calls the workers made (issuer acquire and release, repository update),
    /// timed, with their bounds; in no particular order.
    pub calls: Vec<LibraryCall>,
}

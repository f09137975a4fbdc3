//! Race harness: proof under faults.
//!
//! N workers repeatedly take the lock of one of K counter rows through a token issuer — Redis,
//! etcd, ZooKeeper or PostgreSQL itself, as a [`pgfence::TokenIssuer`] picked by the URL's
//! scheme (see [Issuers](#issuers)) — read the row's value, sometimes pause past the lease's TTL (an
//! injected stall, like a GC pause or a frozen VM), then write `value + 1` with their fence
//! token (in the multi-statement modes: several transactions and writes per lease, see
//! below). Every try is recorded (row, token, value read, value written, outcome,
//! timestamps), and after the run the history is checked against what Postgres actually
//! committed:
//!
//! * **token order** — on each row, accepted writes (and claims) in commit order carry
//!   non-decreasing tokens, and an equal token only from the same lease (pgfence lets one
//!   lease write a row more than once, and a retry after a lost commit acknowledgement does);
//! * **no lost updates** — each row's final value equals its number of committed increments,
//!   and every committed statement read the value the previous one left;
//! * **every rejection is reported** — one `pgfence.audit` row and one audit event (which
//!   pgfence also logs at WARN) per rejection a worker saw
//!   ([`Error::StaleToken`](pgfence::Error::StaleToken), or
//!   [`Error::DuplicateToken`](pgfence::Error::DuplicateToken) after the counter went
//!   backwards);
//! * **all or nothing** — a write's row update and its history row commit together.
//!
//! Faults can be injected while it runs: Redis counter loss (built in: `DEL` of every counter
//! at chosen points), killed Postgres backends (built in: `pg_terminate_backend` of a busy
//! worker connection at random intervals, and with the PostgreSQL issuer of one of the
//! issuer's connections too), a real issuer failover
//! ([`Deployment::failover_at`]), and anything else the caller does between
//! [`Control::wait_for_units`] and [`Control::mark_fault`] (restarting Redis or Postgres). For
//! each fault the report measures recovery: how many leases, rejections and errors it took, and
//! how long, until every row accepted writes again.
//!
//! # Issuers
//!
//! [`Target::issuer_url`] picks the issuer ([`pgfence::issuer::connect_issuer_with`]): `redis://`,
//! `redis+sentinel://host:port,.../master`, `etcd://host:port,...`, `zk://host:port,...` or
//! `postgres://`. The workers only see the [`pgfence::TokenIssuer`] trait; [`Deployment`]
//! starts throwaway servers for the first three, a single server or a replicated deployment
//! to fail over.
//!
//! * **Redis** counts tokens per resource, and its counter can go backwards (counter loss, a
//!   restart that comes back empty, a replica promoted before it had every `INCR`). Those are
//!   Redis's faults here: counter resets ([`Config::reset_counters_at`]), restarts, and the
//!   sentinel failover. The issuer gets a floor source (reseeds a missing counter from
//!   Postgres's high-water mark: [`ReseedCounter`] counts those) and the workers call
//!   `recover_from` after a rejection ([`Recovery`]).
//! * **etcd** and **ZooKeeper** tokens are cluster-wide revisions / zxids, which never go
//!   backwards, not even across a leader failover: reseeding and `recover_from` are no-ops, and
//!   the Redis-only settings are refused ([`ChaosError::Config`]) rather than ignored. etcd
//!   leases count whole seconds, so its runs use a 1 s TTL and longer stalls
//!   ([`Config::for_issuer`]); the ZooKeeper issuer ends a lock when its TTL runs out, to the
//!   millisecond, like Redis.
//! * **PostgreSQL** ([`pgfence::issuer::PgIssuer`]) runs on the harness's own database
//!   ([`Target::postgres`]): locks and counters are rows there, expiring by the database's
//!   clock, and the counter commits in the same WAL as the fences, so it never goes backwards
//!   on one server (the Redis-only settings are refused, and it has no leader of its own to
//!   fail over). Its faults are the database's: a restart takes the issuer down with the
//!   workers, killed backends include the issuer's (an acquire or release that loses its reply
//!   is re-sent with the same owner id; [`Summary::issuer_backend_kills`]), and a database
//!   failover ([`pg_failover_at`]) rolls its counters back with the fences
//!   ([`PgFailoverFigures::issuer_rolled_back`]).
//!
//! A failover's figures ([`FailoverFigures`], in [`Summary::failover`]) compare the tokens on
//! either side of it — the highest token accepted from a lease granted before the kill, the
//! lowest issued to a lease asked for after: for etcd and ZooKeeper the latter is higher; for
//! Redis it may be lower (that is the point: Postgres must reject those writes, stale or
//! [`DuplicateToken`](pgfence::Error::DuplicateToken), and never accept them) — and count the
//! rejections after it and the time until every row wrote again.
//!
//! # A failover of the protected database
//!
//! [`pg_failover_at`] fails the harness's own PostgreSQL over for real: a primary and an
//! asynchronous standby ([`pgfence_testkit::PgReplicaSet`]) behind a stable address, the
//! standby cut off while the workers write on, then the primary killed and the standby
//! promoted (a new timeline). The promotion loses acknowledged commits — rows and high-water
//! marks go back — so a lease that a newer lease had fenced out may find its own fence again.
//! The workers' units caught by the outage retry with their leases ([`Config::outage_retry`]).
//! [`PgFailoverFigures`] (in [`Summary::pg_failover`]) count the writes **the database lost**
//! (acknowledged, absent from the new primary: not acknowledgement mismatches) apart from
//! anything fencing let through: the checks above run on what the new primary kept, and a
//! statement committed after the promotion by a lease with a statement acknowledged before it
//! is a *zombie write*, a violation. pgfence refuses those leases with
//! [`FencedByFailover`](pgfence::Error::FencedByFailover), counted as rejections (audited; the
//! audit rows of rejections before the promotion may be lost with it).
//!
//! # What guarantees what
//!
//! Six [`Mode`]s run a read-modify-write under one lease with different protection. Three do
//! it in one statement's or one transaction's worth of work per lease; two treat the lease as
//! a session of work, as pgfence does (one lease writes a row many times and checks a resource
//! in many transactions); one writes many rows per statement. Two more
//! ([`Mode::Effects`], [`Mode::EffectsUnkeyed`], [below](#side-effects-outside-postgresql))
//! add a side effect outside PostgreSQL: an HTTP call to a payment provider. One more
//! ([`Mode::LeaselessMix`], [below](#lease-less-writers)) adds writers without a lease.
//!
//! * [`Mode::Unfenced`] — what an application without pgfence does: read the value, then
//!   `UPDATE ... SET value = $1` without a token, on a table that is not guarded. A worker
//!   whose lease expired during a pause overwrites newer work. The harness must report
//!   violations here, which proves that it can detect them.
//!
//! * [`Mode::RowFence`] — read the value, then a fenced
//!   [`Repository::update`](pgfence::Repository::update) (`... WHERE fence < $token`). This
//!   guarantees **token order per row**: no accepted write carries a token lower than or equal
//!   to an earlier accepted write on the row (also for raw SQL, through the guard trigger). It
//!   does **not** make read-modify-write atomic. Take holder A with token 1 that pauses past
//!   its TTL *before writing*, and holder B that then gets token 2 and reads value `v`. If A
//!   wakes up and writes `v + 1` before B writes, A's write is accepted (the row's fence is
//!   still below 1) — and so is B's `v + 1` afterwards (2 is newer than 1). Tokens are in
//!   order, yet A's increment is lost: the fence compares tokens at write time, but B's *read*
//!   was never ordered against A's write.
//!
//! * [`Mode::Fenced`] (the default) — one transaction per write:
//!   [`Fence::check`](pgfence::Fence::check) on the row's resource first, then the read, then
//!   the fenced update, committed together. The check raises the resource's high-water mark and
//!   holds that row lock until commit, so holders of one resource are serialised in token
//!   order: an older holder that has not checked yet fails its check later (the mark is already
//!   newer); an older holder that checked earlier makes this check wait until it commits or
//!   rolls back, and then this transaction's read — a later statement under READ COMMITTED —
//!   sees its committed write; a newer holder waits for this transaction. So no write can land
//!   between a holder's read and its write, which is exactly what rules out lost updates. The
//!   row fence stays as defence in depth (and is what stops raw SQL). A pause *inside* the
//!   transaction only delays the next holder; it cannot make an older write land after a newer
//!   one. (Under REPEATABLE READ or SERIALIZABLE the snapshot is taken by the check itself,
//!   before any wait, so a conflicting holder gets a serialization failure — still safe, and
//!   retryable.)
//!
//! * [`Mode::FencedMulti`] — the same lease runs 2–3 transactions, each `Fence::check`, read,
//!   fenced increment, commit. The check accepts the lease that already holds the mark, so
//!   the lease's later transactions pass; once a newer lease has checked, the older lease's
//!   next check fails (and its row writes would too). Every transaction is ordered by its own
//!   check exactly as in `fenced`, so each of them increments: the unit adds 2–3. A stall may
//!   fall before any statement — between two transactions (the lease expires and a newer one
//!   gets in: the next check is rejected) or inside one (it holds the mark's lock and only
//!   delays the next holder). A retry resumes at the transaction that failed.
//!
//! * [`Mode::RowClaim`] — no resource check at all. The lease claims its row with
//!   [`Repository::claim`](pgfence::Repository::claim) (`UPDATE ... SET fence = <next>
//!   WHERE <key> AND <fence admits the lease> RETURNING *`): the read and the fencing are one
//!   statement, so nothing an older lease does can land after the read, and anything a newer
//!   lease does (claim or write) fences this one out. Then 2–4 fenced updates of the row: the
//!   first writes `value + 1` and `last_unit = <unit>`, the others rewrite the value with
//!   `step = n`. The claim and the writes are spread over 1–3 transactions (cut at random;
//!   the claim may share the first write's transaction or commit on its own), and a stall may
//!   fall before any statement. A retry after a failed try claims again from the start; the
//!   claim reads `last_unit` back, so a retry whose earlier try's increment committed (its
//!   acknowledgement lost with a killed backend) does not increment again.
//!
//! * [`Mode::Batch`] — many rows per lease, one statement per step. The rows are split into
//!   [`Config::batch_groups`] groups of contiguous rows, one resource (lock and token counter)
//!   each; a unit leases a group and draws 10–100 distinct rows of it
//!   ([`Config::batch_min_rows`], [`Config::batch_max_rows`]; at most the group), so the units
//!   of a group contend for the same rows. It claims them with
//!   [`Repository::claim_many`](pgfence::Repository::claim_many) (fences and reads each row;
//!   one outcome per row), then writes `value + 1` and `last_unit` to every claimed row with
//!   one [`Repository::update_many`](pgfence::Repository::update_many), and records the
//!   history rows of each statement in one `INSERT` in its transaction. The claim and the
//!   update share a transaction or commit separately (half the units each); a stall may fall
//!   before the claim (a zombie whose claim meets rows newer leases already took: a mixed
//!   claim) or before the update (with its own transaction, a zombie whose update meets rows
//!   newer leases claimed meanwhile: a mixed update). Rows rejected by the claim are not
//!   written; a statement with no row left ends the try as rejected. Each row is checked as in
//!   `row-claim` — per row, tokens in commit order, no lost update, each unit's increment at
//!   most once (a retry's claim reads `last_unit` back and rewrites instead) — and each
//!   rejected row must have its own audit row and audit event, so in this mode the summary's
//!   `rejected` counts rows ([`Attempt::batch`] has each row's outcomes, [`Summary::batch`]
//!   the totals and how many batches came out mixed). Rows are sent in ascending order.
//!
//! ## Side effects outside PostgreSQL
//!
//! Fencing protects what PostgreSQL stores; a payment provider cannot check a token. The
//! effects modes run the job of [`pgfence::Effects`] against a real HTTP provider on loopback
//! (`pgfence_testkit::Provider`, one per run, answering after [`Config::provider_latency`]),
//! which honours `Idempotency-Key` as payment APIs do: the same key again replays the first
//! answer, the same key while the first request is in flight gets `409`, and each request
//! without a known key charges. Each counter row has a sequence of invoices — its value is
//! how many are paid — so a unit's work item is its row's next invoice (`row<r>-inv<n>`), and
//! every holder of the row meets the same item until one marks it paid.
//!
//! * [`Mode::Effects`] — claim the row ([`Repository::claim`](pgfence::Repository::claim),
//!   committed with its history row: the value read names the invoice); record the charge
//!   with [`Effects::begin`](pgfence::Effects::begin) on the pool (committed before the call,
//!   so a holder that takes over sees the key; refused with `StaleToken` once a newer lease
//!   recorded it); unless a holder recorded it done, call the provider with
//!   [`Effect::idempotency_key`](pgfence::effect::Effect::idempotency_key); then in one transaction
//!   [`Effects::finish`](pgfence::Effects::finish) with the answer, the fenced increment
//!   (invoice paid, `last_unit` set) and its history row. Stalls fall mostly between the begin
//!   and the call (the dangerous spot: the zombie calls late, after a newer holder took the
//!   item over and called with the same key: replayed, or `409` if in flight), else before
//!   the claim, before the begin or before the finish. A `409` or a call without answer fails
//!   the try, retryable: a retry, or a later holder, calls again with the same key and gets
//!   the replay. A retry whose claim reads back its own `last_unit` stops there (its
//!   payment committed; the acknowledgement was lost).
//! * [`Mode::EffectsUnkeyed`] — the same job, but the call's key is `<item>-<token>` (the
//!   classic mistake: a key per lease). The database side is fenced the same way and stays
//!   safe; at the provider, the zombie's late call and the new holder's call carry different
//!   keys, and the invoice is charged twice. The control: it must show duplicates.
//!
//! The database side is checked as in `row-claim`. At the provider
//! ([`Summary::effects`], [`EffectFigures`]): charges per item as the provider counted them —
//! an item charged more than once is a **duplicate provider effect** — against the invoices
//! the rows say are paid (each must have been charged) and the items the ledger has; the
//! workers' calls by answer, and the *late calls* (made after a newer lease's begin of the same
//! item had returned) with how many the provider deduplicated; the ledger's takeovers (items
//! recorded by more than one lease).
//!
//! ## Lease-less writers
//!
//! People and scripts write guarded tables without a lease too. [`Mode::LeaselessMix`]
//! (`leaseless`) runs [`Mode::RowClaim`]'s leases with [`Config::leaseless_writers`]
//! lease-less writers on the same rows (a write every 0–2 × [`Config::leaseless_every`], on a
//! random row), of two kinds ([`LeaselessKind`]; [`Config::bypass_share`] of them bypasses):
//!
//! * `UPDATE ... SET value = value + 1, fence = fence + 1` — the hand-written "bump the fence"
//!   that 0.2 let through, where the next write of the row's lease (whose fence it looked
//!   like) overwrote it. The guard must refuse it every time
//!   ([`pgfence::Error::LeaselessWrite`], `PF007`); one that goes through is a violation.
//! * `BEGIN; SET LOCAL ROLE pgfence_chaos_bypass; SELECT pgfence.bypass(reason); UPDATE ...
//!   SET value = value + 1; <history row>; COMMIT` — an audited bypass by a role allowed with
//!   [`pgfence::guard::allow_bypass`] (created `NOLOGIN` at setup; superusers are not exempt from the
//!   guard). It goes through, writes an audit row (operation `bypass`) and seals the row: the
//!   lease that claimed it before gets [`RowSealed`](pgfence::Error::RowSealed) on its next
//!   write, which the worker treats like a stale rejection (nothing written, the try recorded
//!   as [`Outcome::Rejected`] with `sealed`), so the lease cannot write back its picture of
//!   the row from before the bypass; a newer lease claims the sealed row as usual.
//!
//! A lease-less write that goes through commits its history row with it (kind `bypass` or
//! `fence_plus_one`), so it has its place in the row's commit order: each adds one to the
//! value, has no token to order (token order is checked between the leases' statements, and a
//! lease statement right after a bypass by the lease that wrote the row before it is a
//! violation, `sealed_writes`), and the row's final value must equal the leases' committed
//! increments plus the committed bypasses. [`LeaselessFigures`] splits the lost updates by
//! kind: a committed bypass increment that the final value does not hold (the row's states
//! are chained back from its last statement, each statement building on the latest state
//! whose value it read) is a lost bypass increment. The seal protects what a lease *claimed*
//! (its claim wrote the row's fence before reading it); a lease that only read the row (as
//! `fenced` does, behind its resource check) has not written it, so a bypass between its read
//! and its write would not seal it out — which is why this mode runs row-claim's leases.
//!
//! ## Coalesced writes
//!
//! With [`Config::coalesce`] (`--coalesce`), [`Mode::RowClaim`] and [`Mode::LeaselessMix`]
//! send each update that is alone in its transaction of the unit through one shared
//! [`pgfence::repository::Coalescer`] per pool, and half their units commit the claim on its
//! own and give every update a transaction of its own, so that many units' updates queue up and
//! travel as one statement. Such a write cannot insert its history row in a transaction of the
//! unit (the coalescer's statement is shared), so it carries the row in the counter table's
//! `w_*` columns and a trigger inserts it (flagged `coalesced`) in the same statement: it
//! commits if and only if the write does, with the version the write gave the row, and every
//! check below applies to it unchanged. A coalesced write that fails other than by a rejection
//! is recorded as failed at [`Stage::Commit`]: it was its own commit, so the history says
//! whether it landed. [`Summary::coalescer`] has what the coalescers did. The fenced modes
//! refuse it: their write must share the transaction of the `Fence::check` that orders it (the
//! check's lock is what keeps a newer lease from reading first; a write queued outside could
//! land after that transaction ended and be overwritten).
//!
//! ## What counts as an applied increment
//!
//! A unit's increment counts when, and only when, the statement that wrote it committed —
//! whatever happened to the unit's other statements. A `row-claim` unit that claimed, stalled
//! past its TTL and was fenced out before its first update added nothing (its committed claim
//! changed only the fence); one fenced out after its increment committed, at a later rewrite,
//! added exactly one. Ground truth is the history (next section), where every committed
//! statement is a row with its kind: `claim` (value unchanged), `increment` (value read + 1)
//! or `rewrite` (value unchanged). Per row, in commit order, each statement must have read the
//! value the previous one left and changed it by what its kind says (else it is a *stale
//! read*), and the row's final value must equal its committed increments (the shortfall is
//! *lost updates*). So for `row-claim` the final values add up to the units whose increment
//! committed (each at most once: `repeated_increments` is 0); for `fenced-multi`, to the
//! committed transactions; for the single-write modes, to the committed writes (a retry after
//! a lost acknowledgement may write twice, and both count, since both committed).
//!
//! Token order applies to every recorded statement, claims included: per row, in commit
//! order, tokens never decrease, and an equal token must come from the same unit (lease).
//! A try that reports its transactions acknowledged must find them all in the history, and
//! the transaction it failed in only if it failed in `COMMIT` (*ack mismatches*).
//!
//! # How commit order is observed
//!
//! Ordering accepted writes by client-side timestamps would be wrong: the commit a client
//! sees is not the order Postgres applied. Instead each counter row has a `version` column that
//! a trigger bumps on every update (claims included), and each write or claim inserts its
//! history row **in the same transaction**, copying that version (multi-statement units run
//! every statement inside an explicit transaction for this reason). Updates of one row are serialised by its row lock, so
//! versions `1, 2, 3, ...` are the commit order of the row's writes; the history row exists if
//! and only if the write committed, which also settles commits whose acknowledgement was lost
//! (a connection killed during `COMMIT`).
//!
//! # Counting rejections
//!
//! pgfence reports every rejection, and every rejection whose audit row could not be written,
//! to the [`AuditSink`](pgfence::audit::AuditSink) registered on its [`Auditor`](pgfence::audit::Auditor)
//! (in addition to its `tracing` events at WARN and ERROR). [`Harness::new`] registers an
//! [`AuditCounter`] on the auditor its fence and repository share; it counts the typed
//! events per resource, and the summary reports those of the run's resources (their names
//! start with [`Harness::resource_prefix`]) as `log_events` and `audit_failures`.
//!
//! Automatic reseeds after counter loss (Redis) are reported by the issuer only as a `tracing`
//! event. To count them, install a [`ReseedCounter`] layer ([`ReseedCounter::install_global`],
//! or [`ReseedCounter::layer`] in your own subscriber) and pass it to
//! [`Harness::with_reseed_counter`]; without it `reseed_events` is reported as `null`.
//!
//! # Modules
//!
//! [`Config`] and [`Target`] say what runs where; [`Deployment`] starts the issuer's throwaway
//! servers and fails them over; [`Harness`] sets the run up and runs the workers, whose write
//! pipeline (one plan of steps per [`Mode`]) lives in `worker`; the fault injectors in
//! `faults`; the checks in `verify`; the [`Report`] and its printing in `report`. The nemeses
//! ([`Partitions`] between groups of workers and PostgreSQL, lock-server clock steps with
//! [`clock_steps`]) are in `nemesis`; [`Report::write_history`] writes the history as JSON
//! lines for a checker outside the project (format: `docs/proof.md`, "History format").

mod config;
mod deploy;
mod error;
mod faults;
mod harness;
mod history;
mod history_file;
mod leaseless;
mod nemesis;
mod pg_failover;
mod report;
mod reseed;
mod schema;
mod sink;
mod util;
mod verify;
mod worker;

pub use config::{Config, Mode, Recovery, Target};
pub use deploy::{Deployment, issuer_of_url, parse_issuer};
pub use error::ChaosError;
pub use harness::{Control, FaultHold, Harness};
pub use history::{
    Attempt, BatchRows, FailoverEvent, FaultMark, LeaseRecord, LeaselessAttempt, LeaselessKind,
    LeaselessOutcome, LibraryCall, Outcome, PgFailoverEvent, RowResult, Stage,
};
pub use history_file::HISTORY_FORMAT_VERSION;
pub use nemesis::{NemesisEvent, NemesisFigures, Partitions, SteppableClock, clock_steps};
pub use pg_failover::pg_failover_at;
pub use report::{
    BatchFigures, CoalescerFigures, EffectFigures, ErrorKind, FailoverFigures, FaultRecovery,
    LeaselessFigures, PgFailoverFigures, Report, Summary,
};
pub use reseed::{ReseedCounter, ReseedLayer};
pub use schema::SCHEMA;
pub use sink::{AuditCounter, AuditTally};

//! [`Coalescer`]: concurrent single-row updates of one table sent as one statement when they
//! queue up (group commit), each caller getting its own outcome.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use sqlx::PgPool;
use tokio::sync::oneshot;
use tokio::time::{Instant, timeout_at};

use crate::error::TimedOut;
use crate::repository::Repository;
use crate::repository::executor::{commit_rolled_back, commit_then_gate_sql, gate_sql};
use crate::table::FencedTable;
use crate::{Error, Fencing, Result};

/// How many statements of one coalescer may be in flight at once by default: one, which
/// measured best at 16 and 64 tasks (larger groups; `BENCHMARKS.md`, "Coalesced updates").
pub const DEFAULT_LANES: usize = 1;
/// A queued update with less than this left of its bound is not sent (it is answered
/// `TimedOut`, nothing applied).
const MIN_STATEMENT: std::time::Duration = std::time::Duration::from_millis(10);

/// How many queued updates one coalesced statement carries at most by default.
pub const DEFAULT_MAX_GROUP: usize = 64;

/// Single-row [`update`](Repository::update)s of one table through a pool, coalesced when
/// they queue up: while `lanes` statements of this coalescer are in flight, further calls
/// wait, and the next free lane sends every waiting update (up to `max_group`) as one
/// statement. A call that finds a lane free is sent at once, alone, through
/// [`Repository::update`]: no added latency when nothing is queued.
///
/// Each caller gets the outcome `Repository::update` would have given it, with the same
/// audit row and WARN event for a rejection: the coalesced statement applies exactly the
/// updates its lease would have applied alone (the same fence rule, the same timeline
/// binding, per row); an update it did not apply (stale, not found, sealed, another
/// timeline, or a second update of the same key in the group) is sent again alone by its
/// caller, which explains and audits it as today. If the coalesced statement fails as a whole,
/// every caller in it sends its update alone; if it times out, every caller gets that
/// [`Error::TimedOut`].
///
/// Opt-in (`Repository::coalesced`): rows are cloned into the queue (`T: Clone + Send +
/// Sync + 'static`), writes go through a pool (not a caller's transaction), and a table type
/// whose [`FencedTable`] impl does not bind arrays is always sent alone. `BENCHMARKS.md`,
/// "Coalesced updates", has what it gains and costs.
///
/// ```no_run
/// # #[derive(Clone)] struct Invoice { id: i64, status: String }
/// # pgfence::fenced_table!(Invoice { table: "invoices", key: id: i64, columns: [status] });
/// # async fn f(pool: sqlx::PgPool, lease: pgfence::Lease) -> pgfence::Result<()> {
/// let writer = pgfence::Repository::<Invoice>::new(pool.clone())?.coalesced(pool);
/// // Many tasks, each with its own lease, call it concurrently:
/// writer.update(&lease, &Invoice { id: 7, status: "paid".into() }).await?;
/// # Ok(()) }
/// ```
pub struct Coalescer<T> {
    inner: Arc<Inner<T>>,
}

impl<T> Clone for Coalescer<T> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<T> std::fmt::Debug for Coalescer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coalescer")
            .field("table", &self.inner.repo.table.quoted())
            .field("lanes", &self.inner.lanes)
            .field("max_group", &self.inner.max_group)
            .finish_non_exhaustive()
    }
}

/// What a [`Coalescer`] has done so far ([`Coalescer::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CoalescerStats {
    /// Updates sent alone at once (a lane was free).
    pub alone: u64,
    /// Coalesced statements sent.
    pub statements: u64,
    /// Updates those statements carried.
    pub carried: u64,
    /// Of those, the updates they applied.
    pub applied: u64,
    /// Updates a coalesced statement did not apply, sent again alone by their callers (the
    /// rejections among them are explained and audited there).
    pub resent: u64,
    /// Coalesced statements whose transaction began in the same round trip as the previous
    /// statement's `COMMIT` (updates were waiting then, or that statement's callers came
    /// back).
    pub chained: u64,
}

#[derive(Default)]
struct Counters {
    alone: AtomicU64,
    statements: AtomicU64,
    carried: AtomicU64,
    applied: AtomicU64,
    resent: AtomicU64,
    chained: AtomicU64,
}

struct Inner<T> {
    counters: Counters,
    repo: Repository<T>,
    pool: PgPool,
    lanes: usize,
    max_group: usize,
    /// Cleared when `T`'s impl turns out not to bind arrays: every update is sent alone.
    arrays: AtomicBool,
    state: Mutex<State<T>>,
}

struct State<T> {
    queue: VecDeque<Waiting<T>>,
    in_flight: usize,
    next_id: u64,
}

/// A queued update and where its answer goes.
struct Waiting<T> {
    id: u64,
    /// When the caller's bound ends: the statement that carries it ends by then too.
    deadline: tokio::time::Instant,
    row: T,
    fencing: Fencing,
    answer: oneshot::Sender<Answer>,
}

/// What a coalesced statement did for one queued update.
enum Answer {
    /// Applied.
    Applied,
    /// Not applied (or the statement failed): the caller sends its update alone.
    Alone,
    /// The statement timed out: this error for every caller in it.
    Failed(Error),
}

impl<T: FencedTable + Clone + Send + Sync + 'static> Repository<T> {
    /// This repository's single-row updates through `pool`, coalesced when they queue up
    /// ([`Coalescer`]), with [`DEFAULT_LANES`] statements in flight at most.
    #[must_use]
    pub fn coalesced(self, pool: PgPool) -> Coalescer<T> {
        Coalescer::build(self, pool, DEFAULT_LANES, DEFAULT_MAX_GROUP)
    }
}

impl<T: FencedTable + Clone + Send + Sync + 'static> Coalescer<T> {
    /// The same coalescer with at most `lanes` statements in flight (at least 1) and at most
    /// `max_group` updates per statement (1 to [`MAX_BATCH_ROWS`](crate::repository::MAX_BATCH_ROWS)):
    /// a new coalescer over the same repository and pool, with its own queue and stats.
    #[must_use]
    pub fn with_lanes(self, lanes: usize, max_group: usize) -> Self {
        let (repo, pool) = (self.inner.repo.clone(), self.inner.pool.clone());
        Self::build(repo, pool, lanes, max_group)
    }

    /// A coalescer with an empty queue and no statement in flight.
    fn build(repo: Repository<T>, pool: PgPool, lanes: usize, max_group: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                repo,
                pool,
                lanes: lanes.max(1),
                max_group: max_group.clamp(1, crate::repository::MAX_BATCH_ROWS),
                arrays: AtomicBool::new(true),
                counters: Counters::default(),
                state: Mutex::new(State {
                    queue: VecDeque::new(),
                    in_flight: 0,
                    next_id: 0,
                }),
            }),
        }
    }

    /// What this coalescer has done so far.
    #[must_use]
    pub fn stats(&self) -> CoalescerStats {
        let c = &self.inner.counters;
        CoalescerStats {
            alone: c.alone.load(Ordering::Relaxed),
            statements: c.statements.load(Ordering::Relaxed),
            carried: c.carried.load(Ordering::Relaxed),
            applied: c.applied.load(Ordering::Relaxed),
            resent: c.resent.load(Ordering::Relaxed),
            chained: c.chained.load(Ordering::Relaxed),
        }
    }

    /// The repository the updates go through.
    #[must_use]
    pub fn repository(&self) -> &Repository<T> {
        &self.inner.repo
    }

    /// Updates the existing row `row` under `fencing`: [`Repository::update`] through the
    /// coalescer's pool, with the same outcome, errors, audit rows and bound.
    ///
    /// # Errors
    /// As [`Repository::update`].
    pub async fn update(&self, fencing: impl Into<Fencing>, row: &T) -> Result<()> {
        let fencing = fencing.into();
        let inner = &self.inner;
        if !inner.arrays.load(Ordering::Relaxed) {
            return inner.repo.update(&inner.pool, fencing, row).await;
        }
        let waiting = {
            let mut state = inner.lock();
            if state.in_flight < inner.lanes && state.queue.is_empty() {
                state.in_flight += 1;
                None
            } else {
                let (answer, wait) = oneshot::channel();
                let id = state.next_id;
                state.next_id += 1;
                let deadline = tokio::time::Instant::now() + inner.repo.call_timeout();
                state.queue.push_back(Waiting {
                    id,
                    deadline,
                    row: row.clone(),
                    fencing: fencing.clone(),
                    answer,
                });
                if state.in_flight < inner.lanes {
                    state.in_flight += 1;
                    drop(state);
                    spawn_drain(inner.clone());
                }
                Some((id, deadline, wait))
            }
        };
        let Some((id, deadline, mut wait)) = waiting else {
            // A free lane: sent at once, alone; the lane then serves whoever queued meanwhile
            // (given back even if this future is dropped).
            let _lane = Lane(inner.clone());
            inner.counters.alone.fetch_add(1, Ordering::Relaxed);
            return inner.repo.update(&inner.pool, fencing, row).await;
        };
        let answer = match tokio::time::timeout_at(deadline, &mut wait).await {
            Ok(answer) => answer,
            // Still queued after the call's bound: withdrawn, nothing was sent for it.
            Err(_) if inner.withdraw(id) => return Err(inner.timed_out(TimedOut::NotApplied)),
            // In a statement now, which has a bound of its own and answers.
            Err(_) => wait.await,
        };
        match answer {
            Ok(Answer::Applied) => Ok(()),
            Ok(Answer::Failed(e)) => Err(e),
            Ok(Answer::Alone) | Err(_) => {
                inner.counters.resent.fetch_add(1, Ordering::Relaxed);
                // Sent alone within what is left of this call's bound.
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                if left < MIN_STATEMENT {
                    return Err(inner.timed_out(TimedOut::NotApplied));
                }
                let repo = inner.repo.clone().with_call_timeout(left)?;
                repo.update(&inner.pool, fencing, row).await
            }
        }
    }
}

impl<T: FencedTable + Clone + Send + Sync + 'static> Inner<T> {
    fn lock(&self) -> std::sync::MutexGuard<'_, State<T>> {
        // A panic cannot happen while the lock is held (no user code runs under it).
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Gives a lane back, or hands it to a drain when updates are waiting.
    fn release_lane(self: &Arc<Self>) {
        let mut state = self.lock();
        if state.queue.is_empty() {
            state.in_flight -= 1;
        } else {
            drop(state);
            spawn_drain(self.clone());
        }
    }

    /// Takes update `id` out of the queue; false when a lane has taken it already.
    fn withdraw(&self, id: u64) -> bool {
        let mut state = self.lock();
        let before = state.queue.len();
        state.queue.retain(|w| w.id != id);
        state.queue.len() < before
    }

    /// Up to `max_group` waiting updates, oldest first.
    fn take_group(&self) -> Vec<Waiting<T>> {
        let mut state = self.lock();
        let n = state.queue.len().min(self.max_group);
        state.queue.drain(..n).collect()
    }

    /// The time left to the group's earliest deadline: the statement's bound, so that every
    /// caller in it is answered within its own bound. Callers with less than
    /// [`MIN_STATEMENT`] left are answered `TimedOut` (nothing sent) and left out.
    fn bound(&self, group: &mut Vec<Waiting<T>>) -> std::time::Duration {
        let now = tokio::time::Instant::now();
        let (late, on_time): (Vec<_>, Vec<_>) = std::mem::take(group)
            .into_iter()
            .partition(|w| w.deadline.saturating_duration_since(now) < MIN_STATEMENT);
        for waiting in late {
            let _ = waiting
                .answer
                .send(Answer::Failed(self.timed_out(TimedOut::NotApplied)));
        }
        *group = on_time;
        group
            .iter()
            .map(|w| w.deadline.saturating_duration_since(now))
            .min()
            .unwrap_or(MIN_STATEMENT)
    }

    fn timed_out(&self, outcome: TimedOut) -> Error {
        Error::TimedOut {
            operation: "update",
            target: self.repo.table.quoted(),
            after: self.repo.call_timeout(),
            outcome,
        }
    }

    /// Sends one group as one statement in the lane's gate — `gate`, begun in the same round
    /// trip as the previous group's `COMMIT` ([`Inner::chain`]), else a gate of its own — and
    /// answers every caller whose row it did not apply. The callers whose rows it applied are
    /// answered when their `COMMIT` returns: the open group this returns ([`Inner::commit`],
    /// or [`Inner::chain`]). An unused `gate` is dropped (its `ROLLBACK` goes with the
    /// connection back to the pool).
    async fn send(&self, mut group: Vec<Waiting<T>>, gate: Option<Gate>) -> Option<Open<T>> {
        let bound = self.bound(&mut group);
        if group.is_empty() {
            return None;
        }
        let deadline = Instant::now() + bound;
        let mut tx = match gate {
            Some(tx) => {
                self.counters.chained.fetch_add(1, Ordering::Relaxed);
                tx
            }
            None => match timeout_at(deadline, self.pool.begin_with(gate_sql(bound))).await {
                Ok(Ok(tx)) => tx,
                // Each caller sends its update alone and reports what its own call meets.
                Ok(Err(_)) => return self.answer_all(group, || Answer::Alone),
                Err(_) => return self.answer_all(group, || self.failed(TimedOut::NotApplied)),
            },
        };
        let rows: Vec<&T> = group.iter().map(|w| &w.row).collect();
        let fencings: Vec<&Fencing> = group.iter().map(|w| &w.fencing).collect();
        let statement = self.repo.coalesced_update(&mut tx, &rows, &fencings);
        let applied = match timeout_at(deadline, statement).await {
            Ok(Ok(None)) => {
                self.arrays.store(false, Ordering::Relaxed);
                return self.answer_all(group, || Answer::Alone);
            }
            Ok(Ok(Some(applied))) => applied,
            // The gate is dropped: its ROLLBACK is queued, nothing of the statement is kept.
            Ok(Err(_)) => {
                self.count_statement(group.len(), 0);
                return self.answer_all(group, || Answer::Alone);
            }
            Err(_) => {
                self.count_statement(group.len(), 0);
                return self.answer_all(group, || self.failed(TimedOut::NotApplied));
            }
        };
        let n = applied.iter().filter(|a| **a).count();
        self.count_statement(group.len(), n);
        let mut done = Vec::with_capacity(n);
        for (waiting, applied) in group.into_iter().zip(applied) {
            if applied {
                done.push(waiting);
            } else {
                // Not written by this statement: the caller's own update explains it.
                let _ = waiting.answer.send(Answer::Alone);
            }
        }
        Some(Open {
            tx,
            applied: done,
            deadline,
        })
    }

    /// Commits `open` and begins the next group's gate in one simple query, answering
    /// `open`'s callers; the gate, or `None` when that query failed or ran past `open`'s bound
    /// (the next group then begins a gate of its own). The gate's server-side timeouts are
    /// the time left to the earliest waiting caller's bound, or a whole call's bound when
    /// nobody waits yet (the group it will carry is taken after this returns). The statements'
    /// answers are read one by one, so a failure after `COMMIT`'s own answer (the server
    /// ending the connection between the statements) still counts the group as committed.
    async fn chain(&self, open: Open<T>) -> Option<Gate> {
        use futures_util::StreamExt;
        let bound = self.next_bound();
        let Open {
            mut tx,
            applied,
            deadline,
        } = open;
        let sql = commit_then_gate_sql(bound);
        let run = async {
            let mut answers = sqlx::raw_sql(sql).fetch_many(&mut *tx);
            let mut done = 0usize;
            while let Some(answer) = answers.next().await {
                match answer {
                    Ok(sqlx::Either::Left(_)) => done += 1,
                    Ok(sqlx::Either::Right(_)) => {}
                    Err(e) => return (done, Some(e)),
                }
            }
            (done, None)
        };
        let (committed, chained) = match timeout_at(deadline, run).await {
            Ok((_, None)) => (Committed::Yes, true),
            Ok((done, Some(_))) if done > 0 => (Committed::Yes, false),
            Ok((_, Some(e))) => (Committed::of(&e), false),
            Err(_) => (Committed::TimedOut, false),
        };
        self.answer_committed(applied, &committed);
        chained.then_some(tx)
    }

    /// The time left to the bound of the earliest update waiting (the queue's front: every
    /// queued update got the same bound when it was queued); the repository's call bound
    /// when none waits.
    fn next_bound(&self) -> std::time::Duration {
        let now = tokio::time::Instant::now();
        self.lock()
            .queue
            .front()
            .map_or(self.repo.call_timeout(), |w| {
                w.deadline.saturating_duration_since(now)
            })
    }

    /// Whether an update waits.
    fn queued(&self) -> bool {
        !self.lock().queue.is_empty()
    }

    /// Commits `open` (nothing queued behind it) and answers its callers.
    async fn commit(&self, open: Open<T>) {
        let committed = match timeout_at(open.deadline, open.tx.commit()).await {
            Ok(Ok(())) => Committed::Yes,
            Ok(Err(e)) => Committed::of(&e),
            Err(_) => Committed::TimedOut,
        };
        self.answer_committed(open.applied, &committed);
    }

    /// Answers the callers of a committed group: applied; or, when the server answered the
    /// `COMMIT` with an error (it rolled back), sent alone; or, when no answer came — the
    /// connection failed, or the bound ran out — the error that says the update applied or
    /// not (never sent again: a second send could be told "stale" for a write that landed).
    fn answer_committed(&self, applied: Vec<Waiting<T>>, committed: &Committed) {
        for waiting in applied {
            let answer = match committed {
                Committed::Yes => Answer::Applied,
                Committed::RolledBack => Answer::Alone,
                Committed::Unknown(why) => {
                    Answer::Failed(Error::from(sqlx::Error::Io(std::io::Error::new(
                        std::io::ErrorKind::ConnectionAborted,
                        format!(
                            "the connection failed before the coalesced update's COMMIT was \
                             answered, so it applied or not; retry with the same lease: {why}"
                        ),
                    ))))
                }
                Committed::TimedOut => self.failed(TimedOut::InDoubt),
            };
            // A caller that went away (its future dropped) needs no answer.
            let _ = waiting.answer.send(answer);
        }
    }

    fn answer_all(&self, group: Vec<Waiting<T>>, answer: impl Fn() -> Answer) -> Option<Open<T>> {
        for waiting in group {
            let _ = waiting.answer.send(answer());
        }
        None
    }

    fn failed(&self, outcome: TimedOut) -> Answer {
        Answer::Failed(self.timed_out(outcome))
    }

    fn count_statement(&self, carried: usize, applied: usize) {
        let c = &self.counters;
        c.statements.fetch_add(1, Ordering::Relaxed);
        c.carried.fetch_add(carried as u64, Ordering::Relaxed);
        c.applied.fetch_add(applied as u64, Ordering::Relaxed);
    }
}

/// How a group's `COMMIT` ended.
enum Committed {
    Yes,
    /// The server answered it with an error: the transaction rolled back.
    RolledBack,
    /// No answer: the connection failed or the server ended it (what happened, for the
    /// callers' error).
    Unknown(String),
    /// No answer within the group's bound.
    TimedOut,
}

impl Committed {
    /// What a failed `COMMIT` says ([`commit_rolled_back`]).
    fn of(e: &sqlx::Error) -> Self {
        if commit_rolled_back(e) {
            Committed::RolledBack
        } else {
            Committed::Unknown(e.to_string())
        }
    }
}

/// A lane's gate: the transaction its statements run in.
type Gate = sqlx::Transaction<'static, sqlx::Postgres>;

/// A group whose statement ran in the lane's gate and whose `COMMIT` is not sent yet: the
/// callers whose rows it applied, and when the earliest of the group's bounds ends.
struct Open<T> {
    tx: Gate,
    applied: Vec<Waiting<T>>,
    deadline: Instant,
}

/// Starts a drain on the lane the caller holds; without a runtime (a caller dropped outside
/// one) the lane is given back and the waiting updates are served by the next call.
fn spawn_drain<T: FencedTable + Clone + Send + Sync + 'static>(inner: Arc<Inner<T>>) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(drain(inner));
        }
        Err(_) => inner.lock().in_flight -= 1,
    }
}

/// Serves the queue on one lane until it is empty, then gives the lane back. A group whose
/// statement ran is committed in the same round trip as the next group's `BEGIN` while
/// updates wait or when it carried more than one (its callers, answered by that `COMMIT`,
/// tend to come back at once: closed-loop workers); the next group is taken only once they
/// had a turn to queue again (a yield to the runtime, no timer), so one group carries the
/// callers of the last and whoever came meanwhile: two round trips a group, and a caller
/// waits for no group but its own. With nothing waiting and a lone update, the group is
/// committed at once.
async fn drain<T: FencedTable + Clone + Send + Sync + 'static>(inner: Arc<Inner<T>>) {
    let mut open: Option<Open<T>> = None;
    let mut gate = None;
    loop {
        if let Some(group) = open.take() {
            if group.applied.len() > 1 || inner.queued() {
                gate = inner.chain(group).await;
                tokio::task::yield_now().await;
            } else {
                inner.commit(group).await;
            }
            continue;
        }
        let group = inner.take_group();
        if !group.is_empty() {
            open = inner.send(group, gate.take()).await;
            continue;
        }
        // Begun for callers that did not come back: its ROLLBACK goes with the connection.
        drop(gate.take());
        let mut state = inner.lock();
        if state.queue.is_empty() {
            state.in_flight -= 1;
            return;
        }
    }
}

/// A lane held by a call sending its update alone: given back (or handed to a drain) when
/// the call ends, however it ends.
struct Lane<T: FencedTable + Clone + Send + Sync + 'static>(Arc<Inner<T>>);

impl<T: FencedTable + Clone + Send + Sync + 'static> Drop for Lane<T> {
    fn drop(&mut self) {
        self.0.release_lane();
    }
}

impl<T: FencedTable> Repository<T> {
    /// One coalesced statement for `rows`, each under its own lease, on `conn` (the lane's
    /// gate): which rows it applied, by input position; `None` when `T`'s impl does not bind
    /// arrays (nothing was sent).
    async fn coalesced_update(
        &self,
        conn: &mut sqlx::PgConnection,
        rows: &[&T],
        fencings: &[&Fencing],
    ) -> Result<Option<Vec<bool>>> {
        let mut timelines = Vec::with_capacity(fencings.len());
        for fencing in fencings {
            timelines.push(self.seen.bind(&fencing.timeline, conn).await?);
        }
        let fences = fencings.iter().map(|f| f.lease_fence()).collect();
        let statement = &self.sql.batch.coalesced_update;
        let Some(query) = statement.bind_coalesced(rows, fences, timelines) else {
            return Ok(None);
        };
        let done = match query.fetch_all(conn).await {
            Ok(done) => done,
            Err(e) => {
                let e = Error::from(e);
                self.seen.forget_on(&e);
                return Err(e);
            }
        };
        let mut applied = vec![false; rows.len()];
        for row in done {
            let ord: i64 = sqlx::Row::try_get(&row, 0).map_err(Error::from)?;
            if let Some(slot) = usize::try_from(ord - 1)
                .ok()
                .and_then(|i| applied.get_mut(i))
            {
                *slot = true;
            }
        }
        Ok(Some(applied))
    }
}

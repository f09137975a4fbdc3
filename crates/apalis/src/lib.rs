//! Fenced [apalis] tasks: a tower layer that runs each task under a pgfence lease, so that a
//! worker paused past its heartbeats (GC, VM stall, `SIGSTOP`) — whose task apalis re-enqueued
//! and another worker ran — can no longer write your tables or pay twice when it wakes up.
//!
//! [`FenceLayer`] gives every task a [`Lease`] on a resource derived from the task (its id by
//! default; [`FenceLayer::resource`] for "one lease per account"), keeps it alive while the
//! handler runs, hands the handler a [`TaskLease`] (an extractor, like apalis's `Data`), and
//! releases it afterwards. In the handler, [`Repository`](pgfence::Repository) writes,
//! [`Fence::check`] and the effect ledger take `&lease`; the effect ledger's work item is the
//! task id, so every run of one task uses the same idempotency key.
//!
//! ```no_run
//! use std::sync::Arc;
//! use apalis_core::{error::BoxDynError, worker::builder::WorkerBuilder};
//! use apalis_postgres::PostgresStorage;
//! use pgfence::issuer::PgIssuer;
//! use pgfence_apalis::{FenceLayer, TaskLease};
//!
//! #[derive(Debug, serde::Serialize, serde::Deserialize)]
//! struct Charge { invoice: i64 }
//!
//! async fn charge(job: Charge, lease: TaskLease) -> Result<(), BoxDynError> {
//!     let pool = lease.pool();
//!     let effect = lease.begin_effect("charge").await?; // one key for every run of this task
//!     // provider.charge(job.invoice, effect.idempotency_key()).await?;
//!     let mut tx = pool.begin().await?;
//!     lease.check(&mut *tx).await?; // StaleToken once a newer run of the task has started
//!     sqlx::query("UPDATE invoices SET status = 'paid' WHERE id = $1")
//!         .bind(job.invoice)
//!         .execute(&mut *tx)
//!         .await?;
//!     tx.commit().await?;
//!     Ok(())
//! }
//!
//! # async fn run(pool: sqlx::PgPool) -> Result<(), BoxDynError> {
//! let worker = WorkerBuilder::new("billing-1")
//!     .backend(PostgresStorage::new(&pool))
//!     .layer(FenceLayer::new(Arc::new(PgIssuer::new(pool.clone())), pool.clone()))
//!     .build(charge);
//! worker.run().await?;
//! # Ok(()) }
//! ```
//!
//! # What a run's outcome is when its lease was lost
//!
//! After the handler returns, the layer checks the task's resource once more
//! ([`Fence::check`], one statement). Every run checks it first thing, so this check fails
//! exactly when a newer run of the task (or of its resource) has started since: this run is a
//! zombie. Its outcome is then a [`FenceError::LeaseLost`] and apalis status **`Failed`**,
//! whatever the handler returned — never `Done` (a zombie must not report a result it could
//! not write) and never `Killed` (the live run may still complete the task). With
//! apalis-postgres the zombie's report is normally dropped anyway: its acknowledgement only
//! updates the task while the task is locked to the zombie's worker (`lock_by`), which the
//! re-enqueue cleared and the new worker took over. Where it does land, `Failed` lets the
//! backend run the task again under a newer lease, and that run finds the effects the live
//! run recorded. Details: [`FenceService`].
//!
//! [apalis]: https://docs.rs/apalis

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use apalis_core::error::BoxDynError;
use apalis_core::layers::{Layer, Service};
use apalis_core::task::Task;
use apalis_core::task::from_request::FromRequest;
use apalis_core::task::status::Status;
use pgfence::effect::{Effect, EffectOutcome};
use pgfence::error::ErrorKind;
use pgfence::issuer::KeepAlive;
use pgfence::{Effects, Fence, FenceToken, Fencing, Lease, Resource, TokenIssuer, WriteExecutor};
use sqlx::PgPool;

/// The lease TTL [`FenceLayer::new`] starts with: apalis-postgres's default heartbeat interval.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);

/// How a task is mapped to the [`Resource`] its lease locks. [`ByTaskId`] is the default; any
/// `Fn(&Task<Args>) -> pgfence::Result<Resource>` is one too.
pub trait TaskResource<Args>: Send + Sync + 'static {
    /// The resource `task`'s lease locks and fences.
    ///
    /// # Errors
    /// [`pgfence::Error::Invalid`] for a name [`Resource::new`] refuses; the task
    /// then fails without running.
    fn resource(&self, task: &Task<Args>) -> pgfence::Result<Resource>;
}

/// The default [`TaskResource`]: `apalis:task:<task id>`, one lock per task.
#[derive(Clone, Copy, Debug, Default)]
pub struct ByTaskId;

impl<Args> TaskResource<Args> for ByTaskId {
    fn resource(&self, task: &Task<Args>) -> pgfence::Result<Resource> {
        match task.task_id() {
            Some(id) => Resource::new(format!("apalis:task:{id}")),
            None => Err(pgfence::Error::Invalid(
                pgfence::error::InvalidInput::Resource(
                    "the task has no id (apalis backends assign one when a task is stored)".into(),
                ),
            )),
        }
    }
}

impl<Args, F> TaskResource<Args> for F
where
    F: Fn(&Task<Args>) -> pgfence::Result<Resource> + Send + Sync + 'static,
{
    fn resource(&self, task: &Task<Args>) -> pgfence::Result<Resource> {
        self(task)
    }
}

/// A tower [`Layer`] for apalis workers that runs every task under a pgfence lease. Add it
/// with `WorkerBuilder::layer`; the handler takes a [`TaskLease`].
///
/// For each task the service it builds ([`FenceService`]):
///
/// 1. derives the task's resource ([`TaskResource`]; `apalis:task:<id>` by default);
/// 2. acquires a lease on it, waiting up to [`FenceLayer::wait`] for a previous run's lease to
///    be released or to expire (a re-enqueued task usually meets its zombie's lease);
/// 3. checks the resource ([`Fence::check`]): from then on every older run's
///    [`TaskLease::check`], effect and final check is refused;
/// 4. renews the lease in the background ([`KeepAlive`], every TTL/3) and runs the handler
///    with a [`TaskLease`] in the task's data;
/// 5. checks the resource again — the verdict on whether this run was superseded, which sets
///    the run's outcome (see [`FenceService`]) — and releases the lease.
///
/// It does not cancel the handler when a renewal fails: renewal is an efficiency aid, and
/// fencing, not the clock, is what refuses a zombie's writes.
pub struct FenceLayer<R = ByTaskId> {
    issuer: Arc<dyn TokenIssuer>,
    pool: PgPool,
    fence: Fence,
    effects: Effects,
    ttl: Duration,
    wait: Option<Duration>,
    resource: Arc<R>,
}

impl<R> Clone for FenceLayer<R> {
    fn clone(&self) -> Self {
        Self {
            issuer: self.issuer.clone(),
            pool: self.pool.clone(),
            fence: self.fence.clone(),
            effects: self.effects.clone(),
            ttl: self.ttl,
            wait: self.wait,
            resource: self.resource.clone(),
        }
    }
}

impl<R> fmt::Debug for FenceLayer<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FenceLayer")
            .field("issuer", &self.issuer)
            .field("ttl", &self.ttl)
            .field("wait", &self.wait_for())
            .field("resource", &std::any::type_name::<R>())
            .finish_non_exhaustive()
    }
}

impl FenceLayer<ByTaskId> {
    /// A layer whose leases come from `issuer` — any [`TokenIssuer`]; the PostgreSQL issuer
    /// [`PgIssuer`](pgfence::issuer::PgIssuer) needs no other server — and whose checks,
    /// effects and audit rows go through `pool`, a database with pgfence's schema
    /// ([`pgfence::admin::migrate`]). One lease per task (`apalis:task:<id>`), TTL
    /// [`DEFAULT_TTL`].
    #[must_use]
    pub fn new(issuer: Arc<dyn TokenIssuer>, pool: PgPool) -> Self {
        Self {
            issuer,
            fence: Fence::new(pool.clone()),
            effects: Effects::new(pool.clone()),
            pool,
            ttl: DEFAULT_TTL,
            wait: None,
            resource: Arc::new(ByTaskId),
        }
    }
}

impl<R> FenceLayer<R> {
    /// Sets the lease TTL. The lease is renewed every TTL/3 while the handler runs; a paused
    /// worker stops renewing, and its lease expires at most one TTL later. Keep it below the
    /// backend's orphan timeout (apalis-postgres: `heartbeat_interval * missed_heartbeats`),
    /// so that the worker that picks up a re-enqueued task does not wait long for the zombie's
    /// lease.
    ///
    /// # Panics
    /// Outside pgfence's TTL range ([`pgfence::issuer::limits::MIN_TTL`] to
    /// [`pgfence::issuer::limits::MAX_TTL`]): a configuration error.
    #[must_use]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        if let Err(e) = pgfence::issuer::limits::check_ttl(ttl) {
            panic!("FenceLayer::ttl: {e}");
        }
        self.ttl = ttl;
        self
    }

    /// Sets how long a run waits for the lock before giving up with [`FenceError::Busy`]
    /// (status `Failed`: the backend retries the task later). Default: the TTL plus one
    /// second, long enough for a stopped worker's lease to expire.
    #[must_use]
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// Derives each task's resource with `resource` instead of the task id — for example one
    /// lease per account, so that two tasks for one account never run at once and each one's
    /// runs fence the other's late writes:
    ///
    /// ```
    /// # use apalis_core::task::Task;
    /// # use pgfence::Resource;
    /// # struct Charge { account: i64 }
    /// # fn f(layer: pgfence_apalis::FenceLayer) {
    /// let layer = layer.resource(|task: &Task<Charge>| {
    ///     Resource::new(format!("billing:account:{}", task.args.account))
    /// });
    /// # }
    /// ```
    ///
    /// The effect ledger's work item stays the task id ([`TaskLease::work_key`]).
    #[must_use]
    pub fn resource<R2>(self, resource: R2) -> FenceLayer<R2> {
        FenceLayer {
            issuer: self.issuer,
            pool: self.pool,
            fence: self.fence,
            effects: self.effects,
            ttl: self.ttl,
            wait: self.wait,
            resource: Arc::new(resource),
        }
    }

    /// The lease TTL.
    #[must_use]
    pub fn lease_ttl(&self) -> Duration {
        self.ttl
    }

    /// How long a run waits for the lock.
    #[must_use]
    pub fn wait_for(&self) -> Duration {
        self.wait.unwrap_or(self.ttl + Duration::from_secs(1))
    }
}

impl<S, R> Layer<S> for FenceLayer<R> {
    type Service = FenceService<S, R>;

    fn layer(&self, inner: S) -> Self::Service {
        FenceService {
            inner,
            layer: Arc::new(self.clone()),
        }
    }
}

/// The service [`FenceLayer`] wraps a worker's service in: one lease per task run.
///
/// # Outcomes, in apalis's terms
///
/// | what happened | the run's result | apalis status |
/// |---|---|---|
/// | the final check passed | the handler's result, unchanged | as the handler's result says (`Done` for `Ok`) |
/// | the final check was refused: a newer run started (the lease was lost) | [`FenceError::LeaseLost`], whatever the handler returned | `Failed` |
/// | the final check could not run (database unreachable) and the handler returned `Ok` | [`FenceError::Unverified`] | `Failed` |
/// | no lock within [`FenceLayer::wait`] | [`FenceError::Busy`], the handler does not run | `Failed` |
/// | the issuer or the first check failed | [`FenceError::Fencing`], the handler does not run | `Failed` |
///
/// `Failed`, not `Killed`, because a lost lease says nothing against the task: the live run
/// may still complete it, or fail and leave it to a retry. And not `Done`, because the
/// zombie's writes were refused: with apalis-postgres a zombie's acknowledgement is only
/// applied while the task is still locked to its worker (`lock_by`), which the re-enqueue
/// cleared; when it does land (its worker fetched the task again, or re-locked it before the
/// new worker did), `Failed` has the backend run the task once more under a newer lease, and
/// that run reuses the task's idempotency keys and sees the effects already recorded. A
/// zombie's `Done` would instead overwrite the live run's result with one the zombie never
/// wrote.
///
/// Retry layers: add apalis's retry layer *inside* this one (after it in the builder) to retry
/// under the same lease, or skip lost leases in its policy with [`is_lease_lost`]: retrying a
/// zombie outside the layer would take a new lease and run the task a second time.
pub struct FenceService<S, R = ByTaskId> {
    inner: S,
    layer: Arc<FenceLayer<R>>,
}

impl<S: Clone, R> Clone for FenceService<S, R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<S: fmt::Debug, R> fmt::Debug for FenceService<S, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FenceService")
            .field("inner", &self.inner)
            .field("layer", &self.layer)
            .finish()
    }
}

impl<S, R, Args> Service<Task<Args>> for FenceService<S, R>
where
    S: Service<Task<Args>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxDynError>,
    S::Response: Send + 'static,
    Args: Send + 'static,
    R: TaskResource<Args>,
{
    type Response = S::Response;
    type Error = BoxDynError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxDynError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxDynError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, task: Task<Args>) -> Self::Future {
        // The service that was polled ready runs this task; a clone takes its place.
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        let resource = self.layer.resource.resource(&task);
        Box::pin(fenced_run(self.layer.clone(), inner, task, resource))
    }
}

/// One run of a task under a lease (see [`FenceLayer`] and [`FenceService`]).
async fn fenced_run<S, R, Args>(
    layer: Arc<FenceLayer<R>>,
    mut inner: S,
    mut task: Task<Args>,
    resource: pgfence::Result<Resource>,
) -> Result<S::Response, BoxDynError>
where
    S: Service<Task<Args>>,
    S::Error: Into<BoxDynError>,
{
    // The status apalis reports for this run, shared with the backend's own layer: the
    // handler's result sets it (apalis's lifecycle layer runs inside this one); a run that
    // ends here sets `Failed` over it.
    let status = task.raw_status().clone();
    let fail = |e: FenceError| -> BoxDynError {
        status.store(Status::Failed);
        Box::new(e)
    };
    let Some(task_id) = task.task_id().map(ToString::to_string) else {
        return Err(fail(FenceError::Fencing {
            task_id: String::new(),
            source: pgfence::Error::Invalid(pgfence::error::InvalidInput::Resource(
                "the task has no id".into(),
            )),
        }));
    };
    let fencing_error = |source: pgfence::Error| FenceError::Fencing {
        task_id: task_id.clone(),
        source,
    };
    let resource = resource.map_err(|e| fail(fencing_error(e)))?;
    let wait = layer.wait_for();
    let lease = match layer.issuer.acquire_wait(&resource, layer.ttl, wait).await {
        Ok(Some(lease)) => lease,
        Ok(None) => {
            return Err(fail(FenceError::Busy {
                task_id,
                resource: resource.as_str().to_owned(),
                waited: wait,
            }));
        }
        Err(e) => return Err(fail(fencing_error(e))),
    };
    // Mark the run: from here on, every older run of this resource is refused at its checks
    // and effects (and its final check tells it so).
    if let Err(e) = layer.fence.check(&layer.pool, &resource, &lease).await {
        if e.kind() == ErrorKind::Fenced {
            // The counter went backwards (a Redis failover): raise it, so a retry gets a
            // token above the mark. A no-op for issuers whose tokens cannot go backwards.
            let _ = layer.issuer.recover_from(&e).await;
        }
        let _ = layer.issuer.release(&lease).await;
        return Err(fail(fencing_error(e)));
    }
    tracing::debug!(
        target: "pgfence_apalis",
        task_id = task_id.as_str(),
        resource = resource.as_str(),
        token = lease.token().get(),
        "task run under lease"
    );
    let keep = KeepAlive::spawn(layer.issuer.clone(), lease.clone());
    task.inject_data(TaskLease {
        lease: lease.clone(),
        task_id: Arc::from(task_id.as_str()),
        pool: layer.pool.clone(),
        fence: layer.fence.clone(),
        effects: layer.effects.clone(),
    });
    let outcome = inner.call(task).await.map_err(Into::into);
    let renewed = keep.deadline().is_some();
    keep.stop();
    let verdict = layer.fence.check(&layer.pool, &resource, &lease).await;
    match layer.issuer.release(&lease).await {
        Ok(released) if !released.is_released() => tracing::debug!(
            target: "pgfence_apalis",
            task_id = task_id.as_str(),
            resource = resource.as_str(),
            outcome = %released,
            "lease had already ended"
        ),
        Ok(_) => {}
        Err(e) => tracing::debug!(
            target: "pgfence_apalis",
            task_id = task_id.as_str(),
            error = %e,
            "release failed; the lease expires on its own"
        ),
    }
    match verdict {
        Ok(()) => outcome,
        Err(e) if e.kind() == ErrorKind::Fenced => {
            let current = match &e {
                pgfence::Error::StaleToken { current, .. } => Some(*current),
                _ => None,
            };
            let handler_error = outcome.err().map(|h| h.to_string());
            tracing::warn!(
                target: "pgfence_apalis",
                task_id = task_id.as_str(),
                resource = resource.as_str(),
                token = lease.token().get(),
                current,
                renewed,
                handler_error = handler_error.as_deref(),
                "lease lost: a newer run of this task started; this run reports Failed, not its result"
            );
            Err(fail(FenceError::LeaseLost {
                task_id,
                resource: resource.as_str().to_owned(),
                token: lease.token().get(),
                current,
                handler_error,
                source: e,
            }))
        }
        Err(e) => match outcome {
            Err(handler) => Err(handler),
            Ok(_) => Err(fail(FenceError::Unverified {
                task_id,
                resource: resource.as_str().to_owned(),
                source: e,
            })),
        },
    }
}

/// What a handler receives from [`FenceLayer`]: the run's [`Lease`] and the task id as the
/// effect ledger's work item. Take it as a handler argument (it implements apalis's
/// `FromRequest`, like `Data`).
///
/// `&task_lease` is what fenced writes take: [`Repository`](pgfence::Repository) methods,
/// [`Fence::check`] and [`Effects`] accept it wherever they accept `&lease`
/// (`impl Into<Fencing>`).
#[derive(Clone, Debug)]
pub struct TaskLease {
    lease: Lease,
    task_id: Arc<str>,
    pool: PgPool,
    fence: Fence,
    effects: Effects,
}

impl TaskLease {
    /// The run's lease.
    #[must_use]
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// The lease's fence token.
    #[must_use]
    pub fn token(&self) -> FenceToken {
        self.lease.token()
    }

    /// The resource the lease locks (see [`TaskResource`]).
    #[must_use]
    pub fn resource(&self) -> &Resource {
        self.lease.resource()
    }

    /// The task id: the effect ledger's work item in [`TaskLease::begin_effect`], so every run
    /// of this task gets the same idempotency key for a step.
    #[must_use]
    pub fn work_key(&self) -> &str {
        &self.task_id
    }

    /// The pool the layer fences through (the one given to [`FenceLayer::new`]).
    #[must_use]
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The layer's [`Fence`] handle.
    #[must_use]
    pub fn fence(&self) -> &Fence {
        &self.fence
    }

    /// The layer's effect ledger handle.
    #[must_use]
    pub fn effects(&self) -> &Effects {
        &self.effects
    }

    /// Checks the task's resource for this lease inside `exec`'s transaction
    /// ([`Fence::check`]): call it first in each transaction that writes the task's results.
    ///
    /// # Errors
    /// [`pgfence::Error::StaleToken`] (logged and audited) once a newer run has started: stop,
    /// roll back; the rest as [`Fence::check`].
    pub async fn check<'c, E: WriteExecutor<'c>>(&self, exec: E) -> pgfence::Result<()> {
        self.fence
            .check(exec, self.lease.resource(), &self.lease)
            .await
    }

    /// Records effect `step` of this task under the lease before its call
    /// ([`Effects::begin`], on the pool, so it is committed before the call) and returns its
    /// idempotency key — the same for every run of the task — and what an earlier run
    /// recorded ([`Effect::is_done`]: do not call again).
    ///
    /// # Errors
    /// [`pgfence::Error::StaleToken`] (logged and audited) once a newer run has started: do
    /// not make the call; the rest as [`Effects::begin`].
    pub async fn begin_effect(&self, step: &str) -> pgfence::Result<Effect> {
        self.effects
            .begin(&self.pool, &self.lease, &self.task_id, step)
            .await
    }

    /// Records `effect`'s outcome under the lease after its call ([`Effects::finish`]); put it
    /// in the transaction that records the task's result.
    ///
    /// # Errors
    /// As [`Effects::finish`].
    pub async fn finish_effect<'c, E: WriteExecutor<'c>>(
        &self,
        exec: E,
        effect: &Effect,
        outcome: EffectOutcome,
    ) -> pgfence::Result<()> {
        self.effects
            .finish(exec, &self.lease, effect, outcome)
            .await
    }
}

impl From<&TaskLease> for Fencing {
    fn from(task: &TaskLease) -> Self {
        Fencing::from(&task.lease)
    }
}

impl AsRef<Lease> for TaskLease {
    fn as_ref(&self) -> &Lease {
        &self.lease
    }
}

impl<Args: Sync> FromRequest<Task<Args>> for TaskLease {
    type Error = MissingLease;

    async fn from_request(task: &Task<Args>) -> Result<Self, MissingLease> {
        task.data().get::<TaskLease>().cloned().ok_or(MissingLease)
    }
}

/// A handler asked for a [`TaskLease`] but the worker has no [`FenceLayer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "no TaskLease for this task: add pgfence_apalis::FenceLayer to the worker (WorkerBuilder::layer)"
)]
pub struct MissingLease;

/// Why [`FenceService`] did not report the handler's result.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FenceError {
    /// A newer run of the task (or of its resource) started while this one ran: this run is
    /// a zombie, its fenced writes and effects were refused, and it reports `Failed` whatever
    /// its handler returned.
    #[error(
        "task {task_id}: lease lost on {resource}: a newer run started (token {token}{}); this run's outcome is discarded{}",
        current.map(|c| format!(" < {c}")).unwrap_or_default(),
        handler_error.as_ref().map(|h| format!(" (its handler failed: {h})")).unwrap_or_default()
    )]
    LeaseLost {
        /// The task.
        task_id: String,
        /// The resource the lease locked.
        resource: String,
        /// This run's token.
        token: i64,
        /// The newer run's token, when the refusal says it.
        current: Option<i64>,
        /// The handler's error, if it returned one (typically its own refused write).
        handler_error: Option<String>,
        /// The refused final check.
        source: pgfence::Error,
    },
    /// Another run held the task's resource for all of [`FenceLayer::wait`]; the handler did
    /// not run.
    #[error("task {task_id}: {resource} stayed locked by another run for {waited:?}; not run")]
    Busy {
        /// The task.
        task_id: String,
        /// The resource.
        resource: String,
        /// How long this run waited.
        waited: Duration,
    },
    /// The handler returned `Ok`, but whether a newer run had started could not be checked
    /// (the database did not answer): reported as `Failed` rather than risk a zombie's `Done`.
    #[error("task {task_id}: could not check {resource} after the run: {source}")]
    Unverified {
        /// The task.
        task_id: String,
        /// The resource.
        resource: String,
        /// Why the check failed.
        source: pgfence::Error,
    },
    /// Taking the lease or the run's first check failed (issuer unreachable, invalid
    /// resource, a token counter that went backwards); the handler did not run.
    #[error("task {task_id}: could not take its lease: {source}")]
    Fencing {
        /// The task.
        task_id: String,
        /// What failed.
        source: pgfence::Error,
    },
}

impl FenceError {
    /// Whether this is [`FenceError::LeaseLost`].
    #[must_use]
    pub fn is_lease_lost(&self) -> bool {
        matches!(self, FenceError::LeaseLost { .. })
    }
}

/// Whether `err` (or an error in its source chain) is a [`FenceError::LeaseLost`]: for retry
/// policies that must not retry a zombie, e.g. apalis's
/// `RetryPolicy::retries(3).retry_if(|e: &BoxDynError| !pgfence_apalis::is_lease_lost(&**e))`.
#[must_use]
pub fn is_lease_lost(err: &(dyn StdError + 'static)) -> bool {
    let mut next = Some(err);
    while let Some(e) = next {
        if e.downcast_ref::<FenceError>()
            .is_some_and(FenceError::is_lease_lost)
        {
            return true;
        }
        next = e.source();
    }
    false
}

/// The README's examples, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

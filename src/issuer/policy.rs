//! The issuer policy, written once over small backends: validation, the re-sends of an acquire
//! lost in transit, waiting for a lock, the retry windows of release, extend and status, and
//! the [`TokenIssuer`] surface.
//!
//! A backend (Redis, etcd, ZooKeeper, PostgreSQL) answers one attempt at a time, as a bb8
//! `ManageConnection` connects or checks one connection: [`Backend::try_acquire`],
//! [`Backend::release_once`], [`Backend::extend_once`], [`Backend::status_once`], and, where
//! its counter can go backwards, [`Backend::raise_floor_once`] and the recovery calls. Every
//! one of them is owner-safe (it compares owner and token, or re-sends the same owner id), so
//! sending it twice is harmless; this module decides when it is sent again and for how long.

use crate::error::InvalidInput;
use std::future::Future;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::PgPool;
use tokio::time::Instant;

use super::idle::IssuerState;
use super::keys::fencing_name;
use super::lease::{check_owner, check_ttl, new_owner_id};
use super::token_issuer::{BoxFuture, IssuerKind, TokenIssuer};
use super::{Lease, LeaseState, LockStatus, ReleaseOutcome};
use crate::{Error, FenceToken, Resource, Result};

/// The least time [`TokenIssuer::state`] is given (it counts every key or row of a prefix).
const STATE_BOUND: Duration = Duration::from_secs(60);

/// How many times an acquire is sent, with the same owner id, when it fails in transit.
const ACQUIRE_ATTEMPTS: u32 = 3;

/// The time bound of an issuer call unless the issuer is configured otherwise (each issuer's
/// `with_call_timeout`, or [`IssuerOptions::call_timeout`](crate::issuer::IssuerOptions::call_timeout)):
/// an acquire, release, extend, status read or floor raise returns within it, its re-sends
/// included. See `docs/issuers.md`, "Time bounds".
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// How a backend's owner-safe calls are re-sent after a failure in transit.
pub struct Resend {
    /// Pause before the first re-send; later pauses double from `start` up to `max`.
    pub first: Duration,
    /// Pause the doubling starts from (after a zero `first`).
    pub start: Duration,
    /// Longest pause.
    pub max: Duration,
    /// Most attempts of a release, a status read or a floor raise (extend re-sends until its
    /// deadline whatever the count).
    pub max_attempts: u32,
    /// Cuts each attempt off after this long (so that a re-send, on another connection, gets
    /// a chance within the call's bound), for a backend whose client does not reconnect a
    /// stalled connection by itself; `None`: an attempt may take all the time the call has
    /// left. Either way an attempt is cut off at the call's deadline (but the first one gets
    /// at least [`FIRST_ATTEMPT_MIN`]), and reported with [`Backend::no_reply`].
    pub attempt_timeout: Option<Duration>,
}

/// The shortest time the first attempt of a call is given, even when the caller's time is up.
const FIRST_ATTEMPT_MIN: Duration = Duration::from_millis(100);

/// The re-sends of the consensus stores and PostgreSQL: 25 ms doubling to 400 ms, as many as
/// fit the call's bound; an attempt may take what is left of it.
pub const PATIENT: Resend = Resend {
    first: Duration::from_millis(25),
    start: Duration::from_millis(25),
    max: Duration::from_millis(400),
    max_attempts: u32::MAX,
    attempt_timeout: None,
};

/// One acquire as the policy hands it to a backend: validated, with the owner id, the name
/// PostgreSQL fences the lease under, and the call's id (all its attempts share it).
pub struct Ask<'a> {
    pub resource: &'a Resource,
    pub fencing: &'a Resource,
    pub owner: &'a str,
    pub ttl: Duration,
    /// This acquire call's id ([`next_call_id`]): increasing within the process.
    pub call: u64,
    /// The owner id is this call's own ([`acquire`] made it up and tells it to nobody unless
    /// the call succeeds): no other call can ever present it, so a backend need not record
    /// which call of the owner took the lock.
    pub own_owner: bool,
}

/// A new acquire call's id: increasing within the process, starting from the wall clock (in
/// microseconds) at the first call, so that a later process's ids are most likely higher too.
pub fn next_call_id() -> u64 {
    static NEXT: LazyLock<AtomicU64> = LazyLock::new(|| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(0));
        AtomicU64::new(now)
    });
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Ask<'_> {
    /// The lease this acquire got, with `token`, from the request sent at `sent_at`.
    pub fn lease(&self, token: FenceToken, sent_at: Instant) -> Lease {
        Lease::granted(
            self.resource,
            self.fencing,
            self.owner,
            token,
            self.ttl,
            sent_at,
        )
    }
}

/// What one acquire attempt found.
pub enum Attempt {
    /// The lock is the asker's (newly, or again for the same owner: the same token).
    Granted(Lease),
    /// Another owner holds it; retry in about this long (zero: unknown).
    Busy(Duration),
    /// The lock changed hands between two of the backend's requests: look again.
    Again,
    /// Granted on a counter that did not exist before (Redis lost it, or the resource is
    /// new): [`Backend::settle_fresh`] settles the token before the lease is handed out.
    FreshCounter(Lease),
}

/// What one extend attempt found.
pub enum Renewal {
    /// The lease still holds the lock, now until this local deadline.
    Held(Instant),
    /// The lock had expired.
    Expired,
    /// Another lease holds the lock.
    Taken,
}

impl Renewal {
    /// A backend's answer `state`, with the local deadline `deadline` should it be held.
    pub fn of(state: LeaseState, deadline: Instant) -> Self {
        match state {
            LeaseState::Held => Renewal::Held(deadline),
            LeaseState::Expired => Renewal::Expired,
            LeaseState::Taken => Renewal::Taken,
        }
    }
}

/// What an issuer backend does, one attempt at a time. Private to the crate (its module is):
/// every backend gets [`TokenIssuer`] from it, and its public methods from the free functions
/// below.
pub trait Backend: Send + Sync + std::fmt::Debug + 'static {
    /// Which issuer this is.
    const KIND: IssuerKind;
    /// How its calls are re-sent after a failure in transit.
    const RESEND: Resend;

    /// The key prefix.
    fn key_prefix(&self) -> &str;

    /// The idle expiry ([`TokenIssuer::idle_expiry`]); `None` by default.
    fn idle_expiry(&self) -> Option<Duration> {
        None
    }

    /// What the issuer keeps per resource, counted on its server ([`TokenIssuer::state`]);
    /// `None` where it is not counted. Bounded by the call bound, at least 60 s.
    fn state_once(&self) -> impl Future<Output = Result<Option<IssuerState>>> + Send {
        async { Ok(None) }
    }

    /// The bound of each call (acquire, release, extend, status, floor raise), re-sends
    /// included.
    fn call_timeout(&self) -> Duration {
        DEFAULT_CALL_TIMEOUT
    }

    /// The error of an attempt cut off after `after` without a reply: one
    /// [`Backend::resendable`] accepts, since the call's outcome is unknown.
    fn no_reply(after: Duration) -> Error;

    /// Whether `e` left the call's outcome unknown (the request or its reply was lost), so that
    /// sending it again may succeed.
    fn resendable(e: &Error) -> bool {
        e.is_retryable()
    }

    /// Takes the lock for `ask.owner` if it is free or already theirs (then the same token,
    /// renewed for `ask.ttl`).
    fn try_acquire(&self, ask: &Ask<'_>) -> impl Future<Output = Result<Attempt>> + Send;

    /// Settles a lease granted on a fresh counter ([`Attempt::FreshCounter`]); sent once, not
    /// re-sent with the acquire.
    fn settle_fresh(&self, lease: Lease) -> impl Future<Output = Result<Lease>> + Send {
        async { Ok(lease) }
    }

    /// An acquire or a release of `owner`'s lock on `resource` failed in transit for good: it
    /// may have left something behind (ZooKeeper removes it in the background).
    fn abandoned(&self, resource: &Resource, owner: &str) -> impl Future<Output = ()> + Send {
        let _ = (resource, owner);
        async {}
    }

    /// The acquire call `ask` returned no lease after an attempt of it whose outcome is
    /// unknown (cut off by its bound, or lost in transit): that attempt may still take the
    /// lock, for an owner that was told it failed. Never called when the call returned a
    /// lease. By default [`Backend::abandoned`]; Redis removes such a lock in the background.
    fn acquire_abandoned(&self, ask: &Ask<'_>) -> impl Future<Output = ()> + Send {
        self.abandoned(ask.resource, ask.owner)
    }

    /// Releases the lock if `lease` (owner and token) holds it.
    fn release_once(&self, lease: &Lease) -> impl Future<Output = Result<ReleaseOutcome>> + Send;

    /// Extends the lock to `ttl` from now if `lease` holds it.
    fn extend_once(
        &self,
        lease: &Lease,
        ttl: Duration,
    ) -> impl Future<Output = Result<Renewal>> + Send;

    /// Reads `resource`'s lock and counter.
    fn status_once(&self, resource: &Resource) -> impl Future<Output = Result<LockStatus>> + Send;

    /// Raises `resource`'s counter to at least `floor` (never below 0); the counter afterwards.
    /// A counter that never goes backwards has nothing to raise: the default reads it.
    fn raise_floor_once(
        &self,
        resource: &Resource,
        floor: i64,
    ) -> impl Future<Output = Result<i64>> + Send {
        let _ = floor;
        async move { Ok(self.status_once(resource).await?.counter) }
    }

    /// Recovery from a rejected write ([`TokenIssuer::recover_from`]): nothing to recover
    /// where the counter never goes backwards.
    fn recover_from(&self, err: &Error) -> impl Future<Output = Result<bool>> + Send {
        let _ = err;
        async { Ok(false) }
    }

    /// [`TokenIssuer::reseed`]: where the counter never goes backwards, the counter as it is,
    /// without reading Postgres.
    fn reseed(
        &self,
        pool: &PgPool,
        resource: &Resource,
    ) -> impl Future<Output = Result<i64>> + Send {
        let _ = pool;
        raise_floor(self, resource, 0)
    }
}

/// Tries once (re-sending what was lost in transit) to take `resource`'s lock for `ttl`.
pub async fn acquire<B: Backend>(
    backend: &B,
    resource: &Resource,
    ttl: Duration,
) -> Result<Option<Lease>> {
    Ok(acquire_by(backend, resource, &new_owner_id(), true, ttl)
        .await?
        .ok())
}

/// [`acquire`] with a caller-chosen owner id; `Err(retry_in)` when another owner holds the
/// lock. Nothing is sent for a bad TTL, owner or name. An attempt lost in transit is sent
/// again, with the same owner id (which makes it return the token already issued), up to
/// [`ACQUIRE_ATTEMPTS`] times.
pub async fn acquire_as<B: Backend>(
    backend: &B,
    resource: &Resource,
    owner: &str,
    ttl: Duration,
) -> Result<std::result::Result<Lease, Duration>> {
    acquire_by(backend, resource, owner, false, ttl).await
}

/// [`acquire_as`]; `own_owner` when the owner id is this call's alone ([`Ask::own_owner`]).
async fn acquire_by<B: Backend>(
    backend: &B,
    resource: &Resource,
    owner: &str,
    own_owner: bool,
    ttl: Duration,
) -> Result<std::result::Result<Lease, Duration>> {
    check_ttl(ttl)?;
    check_owner(owner)?;
    let fencing = fencing_name(backend.key_prefix(), resource)?;
    let ask = Ask {
        resource,
        fencing: &fencing,
        owner,
        ttl,
        call: next_call_id(),
        own_owner,
    };
    let _timer = crate::metrics::Timer::acquire();
    let mut unknown = false;
    let result = acquire_attempts(backend, &ask, &mut unknown).await;
    // An attempt whose outcome is unknown may still take the lock; no lease was handed out.
    if unknown && !matches!(result, Ok(Ok(_))) {
        backend.acquire_abandoned(&ask).await;
    }
    crate::metrics::acquisition(match &result {
        Ok(Ok(_)) => "acquired",
        Ok(Err(_)) => "busy",
        Err(_) => "error",
    });
    result
}

/// The attempts of one acquire call; `unknown` is set when one of them failed with its outcome
/// unknown ([`Backend::resendable`]: cut off, or lost in transit).
async fn acquire_attempts<B: Backend>(
    backend: &B,
    ask: &Ask<'_>,
    unknown: &mut bool,
) -> Result<std::result::Result<Lease, Duration>> {
    let until = Instant::now() + backend.call_timeout();
    let (mut failed, mut looked) = (0, 0);
    let mut pause = B::RESEND.first;
    loop {
        let first = failed == 0 && looked == 0;
        let outcome = bounded::<B, _>(until, first, backend.try_acquire(ask)).await;
        if outcome.as_ref().is_err_and(B::resendable) {
            *unknown = true;
        }
        match outcome {
            Ok(Attempt::Granted(lease)) => return Ok(Ok(lease)),
            Ok(Attempt::FreshCounter(lease)) => return backend.settle_fresh(lease).await.map(Ok),
            Ok(Attempt::Busy(retry_in)) => return Ok(Err(retry_in)),
            // Only a lock that keeps vanishing between a read and a write looks this often.
            Ok(Attempt::Again) if looked + 1 >= ACQUIRE_ATTEMPTS * 2 || Instant::now() >= until => {
                return Ok(Err(Duration::ZERO));
            }
            Ok(Attempt::Again) => looked += 1,
            Err(e)
                if failed + 1 < ACQUIRE_ATTEMPTS
                    && B::resendable(&e)
                    && Instant::now() + pause < until =>
            {
                tracing::debug!(target: "pgfence::issuer", error = %e, attempt = failed + 1, "acquire failed in transit; re-sending");
                failed += 1;
                if !pause.is_zero() {
                    tokio::time::sleep(pause).await;
                }
                pause = next_pause(pause, &B::RESEND);
            }
            Err(e) => return Err(e),
        }
    }
}

/// One attempt, cut off at the call's deadline `until` (the first attempt of a call gets at
/// least [`FIRST_ATTEMPT_MIN`]) and after [`Resend::attempt_timeout`]; a cut-off attempt is
/// [`Backend::no_reply`]. Dropping the attempt is how it is cut off: a backend whose
/// statement could still apply later makes sure, when dropped, that it cannot (PostgreSQL).
async fn bounded<B, T>(
    until: Instant,
    first: bool,
    attempt: impl Future<Output = Result<T>>,
) -> Result<T>
where
    B: Backend + ?Sized,
{
    let mut budget = until.saturating_duration_since(Instant::now());
    if first {
        budget = budget.max(FIRST_ATTEMPT_MIN);
    }
    if let Some(after) = B::RESEND.attempt_timeout {
        budget = budget.min(after);
    }
    tokio::time::timeout(budget, attempt)
        .await
        .unwrap_or_else(|_| Err(B::no_reply(budget)))
}

/// Waits up to `wait` for the lock: tries with one owner id until it gets the lock or `wait`
/// runs out (`Ok(None)`), sleeping [`wait_nap`] between tries and waiting through retryable
/// errors (a failover while waiting) up to the deadline.
pub async fn acquire_wait<B: Backend>(
    backend: &B,
    resource: &Resource,
    ttl: Duration,
    wait: Duration,
) -> Result<Option<Lease>> {
    check_ttl(ttl)?;
    let give_up = Instant::now() + wait;
    let owner = new_owner_id();
    let mut backoff = Duration::from_millis(10);
    loop {
        let retry_in = match acquire_as(backend, resource, &owner, ttl).await {
            Ok(Ok(lease)) => return Ok(Some(lease)),
            Ok(Err(retry_in)) => retry_in,
            // The same owner id makes a retried acquire idempotent.
            Err(e) if e.is_retryable() && Instant::now() < give_up => Duration::ZERO,
            Err(e) => return Err(e),
        };
        let now = Instant::now();
        if now >= give_up {
            return Ok(None);
        }
        tokio::time::sleep(wait_nap(&mut backoff, retry_in, give_up - now)).await;
    }
}

/// How long a waiting acquire sleeps before its next try: jittered exponential backoff (10 ms
/// doubling to 500 ms, advanced here), never past the holder's reported remaining time — a
/// lock that reports none (no expiry, or under a second on etcd) gets the plain backoff
/// instead of a busy poll — nor past `left`, the caller's remaining wait.
fn wait_nap(backoff: &mut Duration, retry_in: Duration, left: Duration) -> Duration {
    let jittered = backoff.mul_f64(0.5 + rand::random::<f64>() / 2.0);
    *backoff = (*backoff * 2).min(Duration::from_millis(500));
    let nap = if retry_in.is_zero() {
        jittered
    } else {
        jittered.min(retry_in)
    };
    nap.min(left)
}

/// Releases the lock if `lease` still holds it, re-sending a release lost in transit within
/// the call bound. A re-sent release that finds the lock gone before the lease's local deadline
/// reports [`ReleaseOutcome::Released`]: an earlier attempt released it.
pub async fn release<B: Backend>(backend: &B, lease: &Lease) -> Result<ReleaseOutcome> {
    let until = Instant::now() + backend.call_timeout();
    let (outcome, retried) = resend::<B, _, _, _>(until, B::RESEND.max_attempts, || {
        backend.release_once(lease)
    })
    .await;
    match outcome {
        Ok(outcome) => Ok(outcome.after_resend(retried, lease)),
        Err(e) => {
            if B::resendable(&e) {
                backend.abandoned(&lease.resource, &lease.owner).await;
            }
            Err(e)
        }
    }
}

/// Extends the lock to `ttl` from now if `lease` still holds it, re-sending within the call
/// bound.
pub async fn extend<B: Backend>(
    backend: &B,
    lease: &mut Lease,
    ttl: Duration,
) -> Result<LeaseState> {
    let until = Instant::now() + backend.call_timeout();
    extend_until(backend, lease, ttl, until).await
}

/// [`extend`], re-sending after failures in transit until `until`, its bound (what
/// [`KeepAlive`](crate::issuer::KeepAlive) uses: the lease's local deadline). On
/// [`LeaseState::Held`] the lease's TTL and local deadline move; the deadline comes from the
/// attempt that succeeded (an earlier one that arrives later only moves the server's expiry
/// further out).
pub async fn extend_until<B: Backend>(
    backend: &B,
    lease: &mut Lease,
    ttl: Duration,
    until: Instant,
) -> Result<LeaseState> {
    check_ttl(ttl)?;
    let held: &Lease = lease;
    let (renewal, _) =
        resend::<B, _, _, _>(until, u32::MAX, || backend.extend_once(held, ttl)).await;
    Ok(match renewal? {
        Renewal::Held(deadline) => {
            lease.ttl = ttl;
            lease.deadline = deadline;
            LeaseState::Held
        }
        Renewal::Expired => LeaseState::Expired,
        Renewal::Taken => LeaseState::Taken,
    })
}

/// Reads `resource`'s lock and counter, re-sent after failures in transit within the call
/// bound.
pub async fn status<B: Backend>(backend: &B, resource: &Resource) -> Result<LockStatus> {
    let until = Instant::now() + backend.call_timeout();
    resend::<B, _, _, _>(until, B::RESEND.max_attempts, || {
        backend.status_once(resource)
    })
    .await
    .0
}

/// Raises `resource`'s counter to at least `floor` (only ever raising, so a re-send is
/// harmless) and returns it afterwards; refuses a negative floor whatever the backend.
pub async fn raise_floor<B: Backend + ?Sized>(
    backend: &B,
    resource: &Resource,
    floor: i64,
) -> Result<i64> {
    if floor < 0 {
        return Err(Error::Invalid(InvalidInput::Token(floor.to_string())));
    }
    let until = Instant::now() + backend.call_timeout();
    resend::<B, _, _, _>(until, B::RESEND.max_attempts, || {
        backend.raise_floor_once(resource, floor)
    })
    .await
    .0
}

/// Runs an owner-safe `attempt` until it succeeds, fails for a reason that is not
/// [`Backend::resendable`], `max_attempts` were made, or `until` passes (an attempt still out
/// then is cut off), with [`Backend::RESEND`]'s pauses and attempt timeout. Also says whether it was re-sent.
pub async fn resend<B, T, F, Fut>(
    until: Instant,
    max_attempts: u32,
    mut attempt: F,
) -> (Result<T>, bool)
where
    B: Backend + ?Sized,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let policy = &B::RESEND;
    let mut pause = policy.first;
    let mut made = 0;
    loop {
        let first = made == 0;
        made += 1;
        let result = bounded::<B, _>(until, first, attempt()).await;
        match result {
            Err(e)
                if B::resendable(&e) && made < max_attempts && Instant::now() + pause < until =>
            {
                tracing::debug!(target: "pgfence::issuer", error = %e, attempt = made, "issuer call failed in transit; retrying");
                if !pause.is_zero() {
                    tokio::time::sleep(pause).await;
                }
                pause = next_pause(pause, policy);
            }
            result => return (result, made > 1),
        }
    }
}

fn next_pause(pause: Duration, policy: &Resend) -> Duration {
    (pause * 2).clamp(policy.start, policy.max)
}

/// The refusal of an acquire whose token would pass [`MAX_TOKEN`](crate::token::MAX_TOKEN): the lock stays free and the
/// next acquire is refused the same way until the counter is repaired. Every issuer refuses
/// before it writes (the counter as it was); `undone` says it wrote and undid it instead (a
/// race with the limit on etcd and ZooKeeper, whose counters cannot be read before a write
/// they did not see, or a lost Redis counter whose floor is at the limit). `counter` names
/// what reached the limit (with its value), `fix` what to do about it.
/// [`InvalidInput::Token`](crate::error::InvalidInput::Token), the error a token past the limit has always been.
pub fn limit_refused(resource: &Resource, counter: &str, fix: &str, undone: bool) -> Error {
    let outcome = if undone {
        "left nothing behind (what it had written was removed again)"
    } else {
        "changed nothing (no lock taken, the counter as it was)"
    };
    Error::Invalid(InvalidInput::Token(format!(
        "for resource {resource}: {counter} reached the token limit, so the acquire was refused and {outcome}; {fix}; `pgfence doctor --resource '{resource}'` reports the counters and marks near the limit"
    )))
}

// The `TokenIssuer` surface of every backend, written once.
impl<B: Backend> TokenIssuer for B {
    fn kind(&self) -> IssuerKind {
        B::KIND
    }

    fn key_prefix(&self) -> &str {
        Backend::key_prefix(self)
    }

    fn idle_expiry(&self) -> Option<Duration> {
        Backend::idle_expiry(self)
    }

    fn state(&self) -> BoxFuture<'_, Result<Option<IssuerState>>> {
        Box::pin(async move {
            // A scan of every key or row: longer than one call, still bounded.
            let bound = self.call_timeout().max(STATE_BOUND);
            tokio::time::timeout(bound, self.state_once())
                .await
                .map_err(|_| B::no_reply(bound))?
        })
    }

    fn acquire<'a>(
        &'a self,
        resource: &'a Resource,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<Lease>>> {
        Box::pin(acquire(self, resource, ttl))
    }

    fn acquire_as<'a>(
        &'a self,
        resource: &'a Resource,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<std::result::Result<Lease, Duration>>> {
        Box::pin(acquire_as(self, resource, owner, ttl))
    }

    fn acquire_wait<'a>(
        &'a self,
        resource: &'a Resource,
        ttl: Duration,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Option<Lease>>> {
        Box::pin(acquire_wait(self, resource, ttl, wait))
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<ReleaseOutcome>> {
        Box::pin(release(self, lease))
    }

    fn extend<'a>(
        &'a self,
        lease: &'a mut Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<LeaseState>> {
        Box::pin(extend(self, lease, ttl))
    }

    fn extend_until<'a>(
        &'a self,
        lease: &'a mut Lease,
        ttl: Duration,
        until: Instant,
    ) -> BoxFuture<'a, Result<LeaseState>> {
        Box::pin(extend_until(self, lease, ttl, until))
    }

    fn status<'a>(&'a self, resource: &'a Resource) -> BoxFuture<'a, Result<LockStatus>> {
        Box::pin(status(self, resource))
    }

    fn raise_floor<'a>(&'a self, resource: &'a Resource, floor: i64) -> BoxFuture<'a, Result<i64>> {
        Box::pin(raise_floor(self, resource, floor))
    }

    fn recover_from<'a>(&'a self, err: &'a Error) -> BoxFuture<'a, Result<bool>> {
        Box::pin(Backend::recover_from(self, err))
    }

    fn reseed<'a>(
        &'a self,
        pool: &'a PgPool,
        resource: &'a Resource,
    ) -> BoxFuture<'a, Result<i64>> {
        Box::pin(Backend::reseed(self, pool, resource))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn naps_back_off_and_respect_the_holder_and_the_wait() {
        let mut backoff = Duration::from_millis(10);
        let nap = wait_nap(&mut backoff, Duration::ZERO, Duration::from_secs(9));
        assert!(nap >= Duration::from_millis(5) && nap <= Duration::from_millis(10));
        assert_eq!(backoff, Duration::from_millis(20));
        let nap = wait_nap(
            &mut backoff,
            Duration::from_millis(1),
            Duration::from_secs(9),
        );
        assert_eq!(nap, Duration::from_millis(1), "never past the holder's TTL");
        let nap = wait_nap(&mut backoff, Duration::ZERO, Duration::from_millis(2));
        assert!(
            nap <= Duration::from_millis(2),
            "never past the caller's wait"
        );
        for _ in 0..10 {
            wait_nap(&mut backoff, Duration::ZERO, Duration::from_secs(9));
        }
        assert_eq!(backoff, Duration::from_millis(500));
    }

    #[test]
    fn resend_pauses_double_within_bounds() {
        let mut pause = PATIENT.first;
        let mut seen = Vec::new();
        for _ in 0..6 {
            seen.push(pause.as_millis());
            pause = next_pause(pause, &PATIENT);
        }
        assert_eq!(seen, [25, 50, 100, 200, 400, 400]);
    }
}

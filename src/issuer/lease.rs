//! What a granted lock is (a [`Lease`]) and what release, extend and status report about
//! it, shared by every issuer, with the checks every acquire makes before sending anything.

use crate::error::InvalidInput;
use std::time::Duration;

use tokio::time::Instant;

use super::keys::fencing_name;
use crate::{Error, FenceToken, Fencing, Resource, Result};
#[cfg(doc)]
use crate::{RedisIssuer, TokenIssuer};

/// Shortest lease accepted.
pub const MIN_TTL: Duration = Duration::from_millis(10);
/// Longest lease accepted: a lease is a lease, not a reservation.
pub const MAX_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// Validates a lease TTL.
///
/// # Errors
/// [`InvalidInput::Duration`](crate::error::InvalidInput::Duration) outside [`MIN_TTL`]`..=`[`MAX_TTL`].
pub fn check_ttl(ttl: Duration) -> Result<Duration> {
    if (MIN_TTL..=MAX_TTL).contains(&ttl) {
        Ok(ttl)
    } else {
        Err(Error::Invalid(InvalidInput::Duration(format!(
            "lease TTL {ttl:?}: a lease TTL must be between {MIN_TTL:?} and {MAX_TTL:?}"
        ))))
    }
}

pub(super) fn ttl_millis(ttl: Duration) -> Result<u64> {
    u64::try_from(check_ttl(ttl)?.as_millis())
        .map_err(|_| Error::Invalid(InvalidInput::Duration(format!("{ttl:?}"))))
}

/// A new unguessable owner id ([`Lease::new_owner_id`]).
pub(super) fn new_owner_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Validates a lock owner id (stored as `owner:token`, so it cannot contain `:`).
pub(super) fn check_owner(owner: &str) -> Result<()> {
    if owner.is_empty() || owner.contains(':') {
        return Err(Error::Invalid(InvalidInput::Owner(
            "owner ids are non-empty and contain no ':'".into(),
        )));
    }
    Ok(())
}

/// A granted lock: who holds what, with which token, until when.
#[derive(Clone, Debug)]
pub struct Lease {
    pub(super) resource: Resource,
    pub(super) fencing: Resource,
    pub(super) owner: String,
    pub(super) token: FenceToken,
    pub(super) ttl: Duration,
    pub(super) deadline: Instant,
    /// The PostgreSQL timeline the lease's first fenced statement ran on; shared by clones
    /// and by every [`Fencing`] made from the lease ([`Lease::timeline`]).
    pub(crate) timeline: crate::timeline::Binding,
    /// The fence the lease last saw on each row it wrote; shared like `timeline`.
    pub(crate) rows: crate::token::order::RowLog,
}

impl PartialEq for Lease {
    fn eq(&self, other: &Self) -> bool {
        self.resource == other.resource
            && self.fencing == other.fencing
            && self.owner == other.owner
            && self.token == other.token
            && self.ttl == other.ttl
            && self.deadline == other.deadline
            && self.timeline.get() == other.timeline.get()
    }
}

impl Eq for Lease {}

impl Lease {
    /// A new unguessable owner id, for [`TokenIssuer::acquire_as`] (an acquire that can be
    /// re-sent after a lost reply with the same id): 128 random bits from the OS-seeded CSPRNG,
    /// as 32 hex digits.
    #[must_use]
    pub fn new_owner_id() -> String {
        new_owner_id()
    }

    /// The locked resource.
    #[must_use]
    pub fn resource(&self) -> &Resource {
        &self.resource
    }

    /// The name PostgreSQL fences this lease's resource under: [`Lease::resource`] itself for
    /// an issuer with the default key prefix, its key prefix's name otherwise
    /// ([`Resource::in_key_prefix`]: `P{R`, `{P{D}NAME`), so that prefixes sharing a database
    /// share no mark. [`Fencing`] (`&lease`) carries it: checks, audit rows, effects and the
    /// token tag use it. SQL callers pass it to `pgfence.check` (`pgfence run` exports it as
    /// `PGFENCE_RESOURCE`); [`high_water`](crate::admin::high_water) and
    /// [`counter_floor`](crate::admin::counter_floor) read its marks.
    #[must_use]
    pub fn fencing_resource(&self) -> &Resource {
        &self.fencing
    }

    /// The owner id (unguessable; only its holder can release or extend the lock).
    #[must_use]
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The fence token to present with every write made under this lease.
    #[must_use]
    pub fn token(&self) -> FenceToken {
        self.token
    }

    /// The fence value for hand-written SQL in the write-up's form, `SET fence = $f ... WHERE
    /// ... AND fence < $f`: [`Fencing::fence`] of this lease (`pgfence run` exports it as
    /// `PGFENCE_FENCE`). Not [`Lease::token`]: a token compared with a stored fence updates 0
    /// rows for a newer, legitimate lease.
    #[must_use]
    pub fn fence(&self) -> i64 {
        Fencing::from(self).fence()
    }

    /// The TTL the lease was granted (or last extended) with.
    #[must_use]
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Local deadline: measured from before the request was sent, on the client's monotonic
    /// clock, so it is early relative to the server's expiry while the two clocks run at the
    /// same rate. A forward step of the lock server's wall clock (Redis expires keys by it;
    /// the PostgreSQL issuer compares the database's `clock_timestamp()`) expires the lock
    /// early by the size of the step, and the deadline is then late by up to that much: a
    /// hint, not a guarantee — fencing refuses the old lease's writes either way
    /// (docs/design.md, "Known limits").
    #[must_use]
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Time left before [`Lease::deadline`] (zero once passed). An efficiency hint only: a
    /// pause can still land between this check and a write, which is why writes are fenced.
    #[must_use]
    pub fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// The PostgreSQL timeline this lease is bound to: the one its first fenced statement ran
    /// on, `None` before that. After a failover of the database (a promotion, which starts a
    /// new timeline and may have lost commits) the lease's fenced statements are refused
    /// with [`Error::FencedByFailover`]: take a new lease. See [`Fencing::timeline`].
    #[must_use]
    pub fn timeline(&self) -> Option<i64> {
        self.timeline.get()
    }

    /// Binds the lease to `timeline` unless it is bound already (a lease continued in another
    /// process: `pgfence run` exports `PGFENCE_TIMELINE`).
    #[must_use]
    pub fn on_timeline(self, timeline: i64) -> Self {
        self.timeline.pin(timeline);
        self
    }

    /// Rebuilds a lease handle from what another process printed (`pgfence lock acquire`),
    /// to release or extend that lock from here. The local deadline is unknown, so it is set
    /// to now: [`Lease::remaining`] is zero until a successful [`RedisIssuer::extend`].
    ///
    /// The lease is fenced as one of the default key prefix; [`Lease::with_key_prefix`] puts
    /// it under another.
    #[must_use]
    pub fn resume(resource: Resource, owner: impl Into<String>, token: FenceToken) -> Self {
        Self {
            fencing: resource.clone(),
            resource,
            owner: owner.into(),
            token,
            ttl: MIN_TTL,
            deadline: Instant::now(),
            timeline: crate::timeline::Binding::default(),
            rows: crate::token::order::RowLog::default(),
        }
    }

    /// The same lease as one of an issuer with key prefix `prefix`: its
    /// [`Lease::fencing_resource`] becomes that prefix's name (a resumed lease of a prefixed
    /// issuer, for its fenced writes).
    ///
    /// # Errors
    /// [`InvalidInput::KeyPrefix`](crate::error::InvalidInput::KeyPrefix); [`InvalidInput::Resource`](crate::error::InvalidInput::Resource) when the name would be too long
    /// (see [`Resource::in_key_prefix`]).
    pub fn with_key_prefix(mut self, prefix: &str) -> Result<Self> {
        self.fencing = fencing_name(prefix, &self.resource)?;
        Ok(self)
    }

    /// A lease just granted: `deadline` is measured from `sent_at`, when the request that
    /// took the lock was sent, so it can only be early.
    pub(super) fn granted(
        resource: &Resource,
        fencing: &Resource,
        owner: &str,
        token: FenceToken,
        ttl: Duration,
        sent_at: Instant,
    ) -> Self {
        Self {
            resource: resource.clone(),
            fencing: fencing.clone(),
            owner: owner.to_owned(),
            token,
            ttl,
            deadline: sent_at + ttl,
            timeline: crate::timeline::Binding::default(),
            rows: crate::token::order::RowLog::default(),
        }
    }

    /// `owner:token`, what the Redis lock key holds.
    pub(super) fn value(&self) -> String {
        format!("{}:{}", self.owner, self.token)
    }
}

impl From<&Lease> for Fencing {
    fn from(lease: &Lease) -> Self {
        let mut fencing = Fencing::new(lease.token)
            .resource(lease.fencing.clone())
            .holder(lease.owner.clone());
        fencing.timeline = lease.timeline.clone();
        fencing.rows = lease.rows.clone();
        fencing
    }
}

impl From<Lease> for Fencing {
    fn from(lease: Lease) -> Self {
        Fencing::from(&lease)
    }
}

/// What [`RedisIssuer::extend`] (and [`TokenIssuer::extend`]) found: whether the lease still
/// holds the lock after the call.
///
/// `Held` means what it says here: the lease still holds the lock, now extended. Releasing
/// has its own answer, [`ReleaseOutcome`], because after a release nothing is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseState {
    /// The lease still holds the lock, and it was extended.
    Held,
    /// The lock had expired; nobody holds it.
    Expired,
    /// Another lease holds the lock now.
    Taken,
}

/// What [`RedisIssuer::release`] (and [`TokenIssuer::release`]) did.
///
/// Only [`ReleaseOutcome::Released`] means this call (or an earlier attempt of it lost in
/// transit) freed the lock. The other two are not errors: the lease had already ended, and
/// the lock was left as it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReleaseOutcome {
    /// The lease held the lock and released it: the lock is free.
    Released,
    /// The lock had already expired (nobody held it); nothing was changed.
    AlreadyExpired,
    /// Another lease holds the lock now; it was left alone.
    TakenByOther,
}

impl ReleaseOutcome {
    /// Whether this release freed the lock.
    #[must_use]
    pub fn is_released(self) -> bool {
        self == ReleaseOutcome::Released
    }

    /// A short lower-case word for output: `released`, `expired` or `taken`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseOutcome::Released => "released",
            ReleaseOutcome::AlreadyExpired => "expired",
            ReleaseOutcome::TakenByOther => "taken",
        }
    }

    /// What a release reports when it was re-sent after a transport failure: a lock found gone
    /// before the lease's local deadline cannot have expired, so an earlier attempt released
    /// it. Every issuer's release goes through here.
    pub(super) fn after_resend(self, retried: bool, lease: &Lease) -> Self {
        if self == ReleaseOutcome::AlreadyExpired && retried && Instant::now() < lease.deadline {
            ReleaseOutcome::Released
        } else {
            self
        }
    }

    pub(super) fn from_reply(code: i64) -> Self {
        match code {
            1 => ReleaseOutcome::Released,
            0 => ReleaseOutcome::AlreadyExpired,
            _ => ReleaseOutcome::TakenByOther,
        }
    }
}

impl std::fmt::Display for ReleaseOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl LeaseState {
    pub(super) fn from_reply(code: i64) -> Self {
        match code {
            1 => LeaseState::Held,
            0 => LeaseState::Expired,
            _ => LeaseState::Taken,
        }
    }
}

/// The state of a resource's lock and counter, for status displays.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LockStatus {
    /// The resource.
    pub resource: String,
    /// Owner id of the current holder, if the lock is held.
    pub owner: Option<String>,
    /// Token of the current holder, if the lock is held.
    pub token: Option<i64>,
    /// Milliseconds until the lock expires, if held.
    pub ttl_ms: Option<i64>,
    /// The counter: the last token issued (0 if none).
    pub counter: i64,
}

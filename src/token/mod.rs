//! Fence tokens and what a write presents: a token is a lease's number; a lease's writes
//! store it, with the holder's tag and a per-row sequence, in the `fence` column.
//!
//! # What a token means
//!
//! A lease is a session of work: its holder may write the same row and check the same
//! resource many times, in many transactions, while every older lease stays fenced out. The
//! issuer hands out one [`FenceToken`] per acquisition; a fence stored in Postgres packs three
//! numbers into one `BIGINT`:
//!
//! ```text
//!  63            24 23     20 19      12 11          0
//! +----------------+---------+----------+-------------+
//! |     token      | counter |  holder  |  sequence   |
//! +----------------+---------+----------+-------------+
//!                  \------ tag -------/
//! ```
//!
//! * **token** (39 bits, `1..=`[`MAX_TOKEN`]): the lease's number. A fence written by a newer
//!   lease is numerically greater than any fence an older lease can write, so
//!   `fence < $mine` keeps the design card's meaning: an older lease's write is rejected.
//! * **counter** (4 bits): a hash of the counter the token came from — the resource's fencing
//!   domain, or the resource itself ([`Resource::counter_id`]). A rejection whose current
//!   fence came from another counter says so: resources that write the same rows must draw
//!   tokens from one counter ([`Resource::in_domain`]).
//! * **holder** (8 bits): a hash of the holder id ([`Fencing::holder`]). Two leases that got
//!   the same token from the same counter — a Redis failover that lost `INCR`s — almost
//!   always differ here, and a write that meets the same token with another holder fails
//!   with [`Error::DuplicateToken`] instead of letting both
//!   progress.
//! * **sequence** (12 bits): a lease's first write to a row stores sequence 0
//!   ([`Fencing::lease_fence`]); each later write by the same lease steps it through a fixed
//!   cycle of the values `0..=4094`: `next = (sequence + 2731) mod 4095` ([`StoredFence::next_sequence`]).
//!   Every applied write changes the fence in a way only a lease's write does, so the guard
//!   trigger can refuse raw SQL that leaves the fence alone *or* bumps it (`fence = fence +
//!   1` is not a step of the cycle), and the cycle never ends: one lease writes one row any
//!   number of times. Sequence [`StoredFence::SEALED_SEQUENCE`] (4095) seals the row: it was changed
//!   outside the protocol (an audited bypass, a write let through in observe mode) after the
//!   lease that wrote it, whose next write is then rejected
//!   ([`Error::RowSealed`]).
//!
//! Resource checks store the lease fence itself and accept the same lease again without a
//! sequence.
//!
//! The layout's numbers are defined once, as the constants of
//! [`StoredFence`], which also reads a stored value's parts; everything
//! here, the repository's SQL and the SQL helpers of migration V7 are built on it.

pub(crate) mod layout;
pub(crate) mod order;

use crate::error::InvalidInput;
use std::fmt;

use crate::timeline::Binding;
pub use crate::token::layout::StoredFence;
use crate::{Error, Resource, Result};

/// The largest token: 39 bits, so that token, tag and sequence fit a positive `BIGINT`.
pub const MAX_TOKEN: i64 = StoredFence::MAX_TOKEN;

/// A fence token: an integer in `1..=`[`MAX_TOKEN`], issued once per lock acquisition and
/// strictly increasing per resource (or fencing domain). `0` and negative numbers are never
/// tokens, so a value of this type is proof that the number is usable in a fenced write.
///
/// ```
/// use pgfence::FenceToken;
/// assert_eq!(FenceToken::new(42).unwrap().get(), 42);
/// assert!(FenceToken::new(0).is_err());
/// assert!(FenceToken::new(-1).is_err());
/// assert!(FenceToken::new(pgfence::token::MAX_TOKEN + 1).is_err());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FenceToken(i64);

impl FenceToken {
    /// Validates `value` as a token.
    ///
    /// # Errors
    /// [`InvalidInput::Token`] when `value` is outside `1..=`[`MAX_TOKEN`].
    pub fn new(value: i64) -> Result<Self> {
        if (1..=MAX_TOKEN).contains(&value) {
            Ok(Self(value))
        } else {
            Err(Error::Invalid(InvalidInput::Token(value.to_string())))
        }
    }

    /// Validates a token that arrives as an unsigned number (for example from Redis or a CLI
    /// argument), refusing values that do not fit instead of wrapping them.
    ///
    /// # Errors
    /// [`InvalidInput::Token`] when `value` is `0` or larger than [`MAX_TOKEN`].
    pub fn from_u64(value: u64) -> Result<Self> {
        i64::try_from(value)
            .map_err(|_| Error::Invalid(InvalidInput::Token(value.to_string())))
            .and_then(Self::new)
    }

    /// The token as a number.
    #[must_use]
    pub fn get(self) -> i64 {
        self.0
    }

    /// The token a stored fence was written with (`0` for a fence no lease wrote, and for
    /// fences written before tokens carried a tag and sequence).
    #[must_use]
    pub fn of_fence(fence: i64) -> i64 {
        StoredFence::from_raw(fence).token()
    }
}

impl fmt::Display for FenceToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::str::FromStr for FenceToken {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let text = s.trim();
        let v: i64 = text
            .parse()
            .map_err(|_| Error::Invalid(InvalidInput::Token(format!("{text:?}"))))?;
        Self::new(v)
    }
}

impl TryFrom<i64> for FenceToken {
    type Error = Error;
    fn try_from(value: i64) -> Result<Self> {
        Self::new(value)
    }
}

impl From<FenceToken> for i64 {
    fn from(t: FenceToken) -> i64 {
        t.0
    }
}

/// What a write presents: the lease's token, and for the audit trail and duplicate detection
/// the resource and holder it came from. Built from a [`FenceToken`] or from a
/// [`Lease`](crate::Lease) (`&lease` converts, with its owner id as holder).
///
/// Pass the same `Fencing` (or the same lease) to every write of one job: they are one
/// session of work, and each is applied while no newer lease has written or checked.
#[derive(Clone, Debug)]
pub struct Fencing {
    /// The fence token.
    pub token: FenceToken,
    /// The resource the token was issued for, if known (recorded in the audit trail).
    pub resource: Option<Resource>,
    /// Who holds the token (lease owner id, job id...), if known. Its hash tells two leases
    /// with the same token apart.
    pub holder: Option<String>,
    /// The PostgreSQL timeline the lease is bound to (see [`Fencing::timeline`]); shared with
    /// the [`Lease`](crate::Lease) it came from and with every clone.
    pub(crate) timeline: Binding,
    /// The fence this lease last saw on each row it wrote; shared like `timeline`.
    pub(crate) rows: order::RowLog,
    /// How long a caller's transaction that carries this lease's check may sit idle
    /// ([`Fencing::idle_bound`]).
    pub(crate) idle_bound: Option<std::time::Duration>,
}

impl PartialEq for Fencing {
    fn eq(&self, other: &Self) -> bool {
        self.token == other.token
            && self.resource == other.resource
            && self.holder == other.holder
            && self.timeline.get() == other.timeline.get()
    }
}

impl Eq for Fencing {}

impl Fencing {
    /// A bare token with no audit context (tag 0).
    #[must_use]
    pub fn new(token: FenceToken) -> Self {
        Self {
            token,
            resource: None,
            holder: None,
            timeline: Binding::default(),
            rows: order::RowLog::default(),
            idle_bound: None,
        }
    }

    /// The PostgreSQL timeline this lease is bound to: the one its first fenced statement ran
    /// on (`None` before that). After a promotion of the database (a failover, which starts a
    /// new timeline and may have lost commits), every fenced statement of a lease bound to
    /// an older timeline is refused with
    /// [`Error::FencedByFailover`]. Keep one `Fencing` (or the
    /// [`Lease`](crate::Lease)) for the lease's whole job: clones share the binding, a
    /// `Fencing` built again from the bare token does not.
    #[must_use]
    pub fn timeline(&self) -> Option<i64> {
        self.timeline.get()
    }

    /// Binds the lease to `timeline` unless it is bound already: for a job that continues a
    /// lease in another process (`pgfence run` exports `PGFENCE_TIMELINE`), so its writes are
    /// fenced across a failover from the first one.
    #[must_use]
    pub fn on_timeline(self, timeline: i64) -> Self {
        self.timeline.pin(timeline);
        self
    }

    /// How long a caller's transaction that carries this lease's
    /// [`Fence::check`](crate::Fence::check) may then sit idle before PostgreSQL ends it
    /// (`idle_in_transaction_session_timeout`, set for that transaction by the check's own
    /// statement): a process paused inside its transaction (SIGSTOP, a GC pause, a stalled VM)
    /// releases its locks at most this long after its last statement, instead of stalling
    /// every newer holder until it wakes. The woken process's next statement or `COMMIT` then
    /// fails and nothing of the transaction is applied.
    ///
    /// Off unless set: bound a lease's transactions by its TTL with
    /// `Fencing::from(&lease).with_idle_bound(Some(lease.ttl()))` (a TTL, not the time left:
    /// a lease renewed by [`KeepAlive`](crate::issuer::KeepAlive) keeps its old deadline in the
    /// caller's handle), or give the role a default (`pgfence grant ROLE
    /// --idle-in-transaction-timeout`). Not on by default: the chaos suite, whose workers stall
    /// inside transactions past their TTL, failed with it on (its verifier reported a
    /// violation in a PostgreSQL-issuer failover run that is not analysed yet), and a job that
    /// holds a transaction open longer than its TTL while it computes would be ended. `None`
    /// turns the bound off. A check on `&pool`, or outside a
    /// transaction with its call bound instead. See docs/operations.md, "A paused lease's
    /// transaction".
    ///
    /// ```
    /// use std::time::Duration;
    /// use pgfence::{FenceToken, Fencing};
    /// let f = Fencing::new(FenceToken::new(5).unwrap());
    /// assert_eq!(f.idle_bound(), None);
    /// let f = f.with_idle_bound(Some(Duration::from_secs(10)));
    /// assert_eq!(f.idle_bound(), Some(Duration::from_secs(10)));
    /// ```
    #[must_use]
    pub fn idle_bound(&self) -> Option<std::time::Duration> {
        self.idle_bound
    }

    /// The same lease with its idle bound set to `bound` ([`Fencing::idle_bound`]; whole
    /// milliseconds, at least 1 ms).
    #[must_use]
    pub fn with_idle_bound(mut self, bound: Option<std::time::Duration>) -> Self {
        self.idle_bound = bound;
        self
    }

    /// Adds the resource the token was issued for.
    #[must_use]
    pub fn resource(mut self, resource: Resource) -> Self {
        self.resource = Some(resource);
        self
    }

    /// Adds the holder's identity.
    #[must_use]
    pub fn holder(mut self, holder: impl Into<String>) -> Self {
        self.holder = Some(holder.into());
        self
    }

    /// The lease's 12-bit tag, `counter << 8 | holder`: a 4-bit hash of the counter the
    /// token came from ([`Resource::counter_id`]; 0 without a resource) and an 8-bit hash of
    /// the holder (0 without one). `pgfence run` exports it as `PGFENCE_TAG` for SQL callers.
    #[must_use]
    pub fn tag(&self) -> u16 {
        let counter = self.resource.as_ref().map_or(0, |r| {
            fold(fnv1a(r.counter_id()), StoredFence::COUNTER_BITS)
        });
        let holder = self
            .holder
            .as_deref()
            .map_or(0, |h| fold(fnv1a(h), StoredFence::HOLDER_BITS));
        (counter << StoredFence::HOLDER_BITS) | holder
    }

    /// The value hand-written SQL compares and sets, in the write-up's statement:
    ///
    /// ```sql
    /// UPDATE inventory_snapshot SET payload = $1, fence = $2 WHERE sku = $3 AND fence < $2
    /// ```
    ///
    /// with `$2` = `fence()`. It lies above every fence this lease stores and below every
    /// newer lease's, so the statement updates the row for this lease's every write (the
    /// guard stores the lease's next fence in its place) and 0 rows for an older lease. It
    /// is not a [`FenceToken`]: `fence < $token` compares a token with a stored fence
    /// (`token << 24 | ...`) and updates 0 rows for a newer, legitimate lease. `pgfence run`
    /// exports it as `PGFENCE_FENCE`; [`Lease::fence`](crate::Lease::fence) is the same
    /// value. See docs/sql.md, "Porting hand-written fenced SQL".
    ///
    /// ```
    /// use pgfence::{FenceToken, Fencing};
    /// let older = Fencing::new(FenceToken::new(4).unwrap());
    /// let lease = Fencing::new(FenceToken::new(5).unwrap());
    /// assert!(older.fence() < lease.fence());
    /// // Every fence the lease stores on a row is below its `fence()`.
    /// assert!(pgfence::token::StoredFence::lease(lease.token, lease.tag()).get() < lease.fence());
    /// ```
    #[must_use]
    pub fn fence(&self) -> i64 {
        self.stored().sealed().get()
    }

    /// The fence this lease's first write to a row stores: token and tag, sequence 0. This is
    /// the one value the repository's statements bind for the lease (not a value for
    /// hand-written SQL: that is [`Fencing::fence`]).
    #[must_use]
    pub fn lease_fence(&self) -> i64 {
        self.stored().get()
    }

    /// [`Fencing::lease_fence`] as a [`StoredFence`].
    pub(crate) fn stored(&self) -> StoredFence {
        StoredFence::lease(self.token, self.tag())
    }

    /// How a stored `fence` relates to this lease.
    #[must_use]
    pub fn classify(&self, fence: i64) -> Relation {
        StoredFence::from_raw(fence).relation_to(self.stored())
    }
}

fn fnv1a(text: &str) -> u32 {
    text.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// Folds a 32-bit hash to its low `bits` bits by xor-ing all its `bits`-wide slices.
fn fold(mut h: u32, bits: u32) -> u16 {
    let mask = (1_u32 << bits) - 1;
    let mut out = 0;
    while h != 0 {
        out ^= h & mask;
        h >>= bits;
    }
    u16::try_from(out).unwrap_or(0)
}

/// How a stored fence relates to a [`Fencing`] ([`Fencing::classify`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Relation {
    /// Written by an older lease (or never by a lease): this lease's write is admitted.
    Older,
    /// Written by this lease (it may write again).
    Own,
    /// Written by this lease, then sealed: changed outside the fencing protocol (an audited
    /// bypass, observe mode). This lease is rejected; a newer one writes as usual.
    Sealed,
    /// Written by another lease that presented the same token from the same counter (the
    /// counter went backwards).
    Duplicate,
    /// Written by a newer lease: this lease is stale. `other_counter` when that lease's token
    /// came from another counter (another resource or fencing domain).
    Newer {
        /// The fence's token came from another counter.
        other_counter: bool,
    },
}

impl From<FenceToken> for Fencing {
    fn from(token: FenceToken) -> Self {
        Self::new(token)
    }
}

impl From<&Fencing> for Fencing {
    fn from(f: &Fencing) -> Self {
        f.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds() {
        assert!(FenceToken::new(MAX_TOKEN).is_ok());
        assert!(FenceToken::new(MAX_TOKEN + 1).is_err());
        assert!(FenceToken::new(i64::MIN).is_err());
        assert!(FenceToken::from_u64(u64::MAX).is_err());
        assert!(FenceToken::from_u64(0).is_err());
        assert!("9223372036854775808".parse::<FenceToken>().is_err());
        assert_eq!("7".parse::<FenceToken>().unwrap().get(), 7);
    }

    #[test]
    fn a_bad_token_text_is_reported_as_given() {
        let err = "abc".parse::<FenceToken>().unwrap_err();
        assert!(err.to_string().contains("\"abc\""), "{err}");
        assert!(!err.to_string().contains(" 0"), "{err}");
    }

    #[test]
    fn lease_fences_order_by_token_and_fit_a_bigint() {
        let top = Fencing::new(FenceToken::new(MAX_TOKEN).unwrap()).holder("x");
        assert!(
            top.lease_fence()
                .checked_add(StoredFence::SEALED_SEQUENCE)
                .is_some()
        );
        let older = Fencing::new(FenceToken::new(7).unwrap()).holder("zzz");
        let newer = Fencing::new(FenceToken::new(8).unwrap());
        assert!(older.lease_fence() + StoredFence::SEALED_SEQUENCE < newer.lease_fence());
        assert_eq!(FenceToken::of_fence(newer.lease_fence()), 8);
    }

    #[test]
    fn the_sequence_cycle_visits_every_unsealed_value_and_never_adds_a_small_number() {
        let mut seen = vec![false; 4095];
        let mut s = 0;
        for _ in 0..4095 {
            assert!(!seen[usize::try_from(s).unwrap()], "{s} twice");
            seen[usize::try_from(s).unwrap()] = true;
            let n = StoredFence::next_sequence(s);
            assert_ne!(n, StoredFence::SEALED_SEQUENCE);
            // `fence = fence + d` for a hand-written d is never a lease's step.
            for d in [1, 2, 3, 5, 10, 100, 1000] {
                assert_ne!(n, s + d, "sequence {s} + {d}");
            }
            s = n;
        }
        assert_eq!(s, 0, "the cycle closes after 4095 steps");
        assert!(seen.iter().all(|v| *v));
    }

    #[test]
    fn classification() {
        let me = Fencing::new(FenceToken::new(5).unwrap()).holder("a");
        let twin = Fencing::new(FenceToken::new(5).unwrap()).holder("b");
        assert_ne!(me.tag(), twin.tag());
        let f = me.lease_fence();
        assert_eq!(me.classify(0), Relation::Older);
        assert_eq!(me.classify(42), Relation::Older);
        assert_eq!(me.classify(f), Relation::Own);
        assert_eq!(me.classify(f + 3), Relation::Own);
        assert_eq!(me.classify(f + 4094), Relation::Own);
        assert_eq!(
            me.classify(f + StoredFence::SEALED_SEQUENCE),
            Relation::Sealed
        );
        assert_eq!(me.classify(twin.lease_fence()), Relation::Duplicate);
        let next = Fencing::new(FenceToken::new(6).unwrap());
        assert_eq!(
            me.classify(next.lease_fence()),
            Relation::Newer {
                other_counter: false
            }
        );
        // Tokens of two counters: "billing" and "reports" hash apart.
        let billing = Fencing::new(FenceToken::new(11).unwrap())
            .resource(Resource::in_domain("billing", "account:2").unwrap());
        let report = Fencing::new(FenceToken::new(1).unwrap())
            .resource(Resource::new("reports:daily").unwrap());
        assert_eq!(
            report.classify(billing.lease_fence()),
            Relation::Newer {
                other_counter: true
            }
        );
        let same_domain = Fencing::new(FenceToken::new(12).unwrap())
            .resource(Resource::in_domain("billing", "account:3").unwrap());
        assert_eq!(same_domain.classify(billing.lease_fence()), Relation::Older);
    }
}

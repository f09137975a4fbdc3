//! The stored fence's layout, defined once: [`StoredFence`] and its constants.
//!
//! Everything else reads the layout from here: [`Fencing`](crate::Fencing) and
//! [`FenceToken`](crate::FenceToken), the repository's generated SQL (`sql.rs` formats these
//! constants into its statements), `doctor`, and the SQL helpers of migration V7
//! (`pgfence.fence_token`, `pgfence.sealed_sequence`...), which tests compare with this type
//! value by value. The layout itself is explained in the token module's docs ("What a token
//! means").

use crate::token::Relation;

/// A value of a `fence BIGINT` column (or a resource's high-water mark) read as its parts:
/// `token << 24 | counter << 20 | holder << 12 | sequence`.
///
/// Any `i64` is a stored fence (`0` is a row no lease wrote; fences written before tokens
/// carried a tag are plain small numbers and decode to token 0); a lease's own fence is built
/// with [`StoredFence::lease`].
///
/// ```
/// use pgfence::{FenceToken, token::StoredFence};
/// let lease = StoredFence::lease(FenceToken::new(5).unwrap(), 0x3_07);
/// assert_eq!(lease.token(), 5);
/// assert_eq!((lease.counter(), lease.holder(), lease.sequence()), (3, 7, 0));
/// let next = lease.next().unwrap();
/// assert_eq!(next.sequence(), StoredFence::SEQUENCE_STEP);
/// assert!(lease.sealed().is_sealed());
/// assert_eq!(lease.sealed().next(), None);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StoredFence(i64);

impl StoredFence {
    /// Bits of the per-row sequence (the lowest bits).
    pub const SEQUENCE_BITS: u32 = 12;
    /// Bits of the holder hash, above the sequence.
    pub const HOLDER_BITS: u32 = 8;
    /// Bits of the counter hash, above the holder hash.
    pub const COUNTER_BITS: u32 = 4;
    /// Bits of the tag (counter and holder hashes together).
    pub const TAG_BITS: u32 = Self::COUNTER_BITS + Self::HOLDER_BITS;
    /// Where the tag starts (`tag << 12`).
    pub const TAG_SHIFT: u32 = Self::SEQUENCE_BITS;
    /// Where the counter hash starts (`counter << 20`).
    pub const COUNTER_SHIFT: u32 = Self::SEQUENCE_BITS + Self::HOLDER_BITS;
    /// Where the token starts (`token << 24`).
    pub const TOKEN_SHIFT: u32 = Self::SEQUENCE_BITS + Self::TAG_BITS;
    /// Bits of the token: what is left of a positive `BIGINT`.
    pub const TOKEN_BITS: u32 = 63 - Self::TOKEN_SHIFT;
    /// The largest token, exported as [`MAX_TOKEN`](crate::token::MAX_TOKEN).
    pub(crate) const MAX_TOKEN: i64 = (1 << Self::TOKEN_BITS) - 1;
    /// The sequence of a sealed fence (all sequence bits set), and the modulus of the
    /// sequence cycle ([`SEALED_SEQUENCE`](Self::SEALED_SEQUENCE)).
    pub const SEALED_SEQUENCE: i64 = (1 << Self::SEQUENCE_BITS) - 1;
    /// The step of a lease's sequence on a row it writes again: coprime with 4095, so the
    /// cycle visits every value of `0..=4094`, and far from the small numbers a hand-written
    /// `fence + n` adds.
    pub const SEQUENCE_STEP: i64 = 2731;
    /// Tag and sequence bits, all set (`0xFF_FFFF`): below the first fence of token 1.
    pub const LOW_MASK: i64 = (1 << Self::TOKEN_SHIFT) - 1;
    /// Clears tag and sequence (`!0xFF_FFFF`): the token's part of a fence.
    pub const TOKEN_MASK: i64 = !Self::LOW_MASK;
    /// The counter hash's bits in place (`0xF0_0000`).
    pub const COUNTER_MASK: i64 = ((1 << Self::COUNTER_BITS) - 1) << Self::COUNTER_SHIFT;

    /// The sequence a lease's next write to a row stores after `sequence` (`0..=4094`): the
    /// cycle the repository's statements, `pgfence.next_fence` and the guard trigger agree on
    /// ([`StoredFence::next`] on a whole fence).
    #[must_use]
    pub const fn next_sequence(sequence: i64) -> i64 {
        (sequence + Self::SEQUENCE_STEP) % Self::SEALED_SEQUENCE
    }

    /// A stored value, as read from a `fence` column.
    #[must_use]
    pub const fn from_raw(fence: i64) -> Self {
        Self(fence)
    }

    /// The value to store.
    #[must_use]
    pub const fn get(self) -> i64 {
        self.0
    }

    /// The fence a lease's first write stores: `token` and `tag` (its low 12 bits), sequence
    /// 0 ([`Fencing::lease_fence`](crate::Fencing::lease_fence)).
    #[must_use]
    pub fn lease(token: crate::FenceToken, tag: u16) -> Self {
        let tag = i64::from(tag) & ((1 << Self::TAG_BITS) - 1);
        Self((token.get() << Self::TOKEN_SHIFT) | (tag << Self::TAG_SHIFT))
    }

    /// The lowest fence a lease with token `token` can store (tag and sequence 0): every
    /// fence below it was written by an older lease.
    #[must_use]
    pub const fn first_of_token(token: i64) -> Self {
        Self(token << Self::TOKEN_SHIFT)
    }

    /// The token it was written with (`0` for a fence no lease wrote, and for fences written
    /// before tokens carried a tag and sequence).
    #[must_use]
    pub const fn token(self) -> i64 {
        self.0 >> Self::TOKEN_SHIFT
    }

    /// The 12-bit tag, `counter << 8 | holder` ([`Fencing::tag`](crate::Fencing::tag)).
    #[must_use]
    pub fn tag(self) -> u16 {
        bits(self.0, Self::TAG_SHIFT, Self::TAG_BITS)
    }

    /// The 4-bit hash of the counter the token came from.
    #[must_use]
    pub fn counter(self) -> u16 {
        bits(self.0, Self::COUNTER_SHIFT, Self::COUNTER_BITS)
    }

    /// The 8-bit hash of the holder.
    #[must_use]
    pub fn holder(self) -> u16 {
        bits(self.0, Self::TAG_SHIFT, Self::HOLDER_BITS)
    }

    /// The per-row sequence: `0..=4094` on a lease's cycle, [`Self::SEALED_SEQUENCE`] sealed.
    #[must_use]
    pub const fn sequence(self) -> i64 {
        self.0 & Self::SEALED_SEQUENCE
    }

    /// Whether the row was sealed: changed outside the fencing protocol after the lease whose
    /// token and tag it carries wrote it.
    #[must_use]
    pub const fn is_sealed(self) -> bool {
        self.sequence() == Self::SEALED_SEQUENCE
    }

    /// The lease fence this fence belongs to: the same token and tag, sequence 0.
    #[must_use]
    pub const fn lease_fence(self) -> Self {
        Self(self.0 & !Self::SEALED_SEQUENCE)
    }

    /// The same fence sealed (sequence [`Self::SEALED_SEQUENCE`]).
    #[must_use]
    pub const fn sealed(self) -> Self {
        Self(self.0 | Self::SEALED_SEQUENCE)
    }

    /// What the same lease's next write stores over this fence: the next step of its
    /// sequence cycle ([`next_sequence`](Self::next_sequence)); `None` when sealed.
    #[must_use]
    pub const fn next(self) -> Option<Self> {
        if self.is_sealed() {
            None
        } else {
            Some(Self(
                self.lease_fence().0 + Self::next_sequence(self.sequence()),
            ))
        }
    }

    /// Whether its counter hash differs from `other`'s, for a fence a lease wrote (token
    /// above 0): tokens of two counters do not compare.
    #[must_use]
    pub fn other_counter(self, other: Self) -> bool {
        self.token() > 0 && self.counter() != other.counter()
    }

    /// How this fence, met by a write, relates to the lease whose lease fence is `lease`.
    #[must_use]
    pub fn relation_to(self, lease: Self) -> Relation {
        let other_counter = self.other_counter(lease);
        match self.token().cmp(&lease.token()) {
            std::cmp::Ordering::Less => Relation::Older,
            std::cmp::Ordering::Greater => Relation::Newer { other_counter },
            std::cmp::Ordering::Equal if other_counter => Relation::Newer { other_counter },
            std::cmp::Ordering::Equal if self.lease_fence() != lease.lease_fence() => {
                Relation::Duplicate
            }
            std::cmp::Ordering::Equal if self.is_sealed() => Relation::Sealed,
            std::cmp::Ordering::Equal => Relation::Own,
        }
    }
}

/// `count` bits of `value` from bit `shift` (at most 16).
fn bits(value: i64, shift: u32, count: u32) -> u16 {
    u16::try_from((value >> shift) & ((1 << count) - 1)).unwrap_or(0)
}

/// The layout as SQL text, for the statements `sql.rs` and `doctor.rs` build: each constant
/// of [`StoredFence`] formatted as a typed literal, never typed by hand.
pub(crate) mod sql {
    use super::StoredFence;

    /// `value` as a `pg_catalog.int8` literal (negative numbers in parentheses).
    pub(crate) fn int8(value: i64) -> String {
        if value < 0 {
            format!("({value})::pg_catalog.int8")
        } else {
            format!("{value}::pg_catalog.int8")
        }
    }

    /// Clears tag and sequence from a fence.
    pub(crate) fn token_mask() -> String {
        int8(StoredFence::TOKEN_MASK)
    }

    /// The sealed sequence, also the sequence cycle's modulus.
    pub(crate) fn sealed_sequence() -> String {
        int8(StoredFence::SEALED_SEQUENCE)
    }

    /// The step of the sequence cycle.
    pub(crate) fn sequence_step() -> String {
        int8(StoredFence::SEQUENCE_STEP)
    }

    /// The counter hash's bits in place.
    pub(crate) fn counter_mask() -> String {
        int8(StoredFence::COUNTER_MASK)
    }

    /// `fence`'s token: `(fence >> 24)`.
    pub(crate) fn token_of(fence: &str) -> String {
        format!(
            "({fence} OPERATOR(pg_catalog.>>) {})",
            StoredFence::TOKEN_SHIFT
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FenceToken;

    #[test]
    fn the_constants_are_the_documented_layout() {
        assert_eq!(StoredFence::TOKEN_SHIFT, 24);
        assert_eq!(StoredFence::COUNTER_SHIFT, 20);
        assert_eq!(StoredFence::TAG_SHIFT, 12);
        assert_eq!(StoredFence::MAX_TOKEN, 549_755_813_887);
        assert_eq!(StoredFence::SEALED_SEQUENCE, 4095);
        assert_eq!(StoredFence::LOW_MASK, 0xFF_FFFF);
        assert_eq!(StoredFence::TOKEN_MASK, -16_777_216);
        assert_eq!(StoredFence::COUNTER_MASK, 15_728_640);
        // The step is coprime with the cycle's modulus (4095 = 3^2 * 5 * 7 * 13).
        assert!(
            [3, 5, 7, 13]
                .iter()
                .all(|p| StoredFence::SEQUENCE_STEP % p != 0)
        );
        // The top lease's sealed fence still fits a positive BIGINT.
        let top = StoredFence::lease(FenceToken::new(StoredFence::MAX_TOKEN).unwrap(), 0xFFF);
        assert_eq!(top.sealed().get(), i64::MAX);
    }

    #[test]
    fn parts_round_trip_at_the_extremes() {
        for token in [1, 2, 4096, StoredFence::MAX_TOKEN] {
            for tag in [0_u16, 1, 0xFF, 0x100, 0xF00, 0xFFF] {
                let lease = StoredFence::lease(FenceToken::new(token).unwrap(), tag);
                assert_eq!(lease.token(), token);
                assert_eq!(lease.tag(), tag);
                assert_eq!(lease.counter(), tag >> 8);
                assert_eq!(lease.holder(), tag & 0xFF);
                assert_eq!(lease.sequence(), 0);
                assert!(!lease.is_sealed());
                assert_eq!(lease.sealed().lease_fence(), lease);
                assert_eq!(lease.sealed().token(), token);
                let mut f = lease;
                for _ in 0..4095 {
                    f = f.next().unwrap();
                    assert_eq!(f.lease_fence(), lease);
                    assert!(!f.is_sealed());
                }
                assert_eq!(f, lease, "the cycle closes after 4095 steps");
            }
        }
        assert_eq!(StoredFence::from_raw(0).token(), 0);
        assert_eq!(StoredFence::from_raw(42).token(), 0);
        assert_eq!(StoredFence::from_raw(-1).token(), -1);
        assert_eq!(StoredFence::first_of_token(3).get(), 3 << 24);
    }

    #[test]
    fn sql_literals_are_the_constants() {
        assert_eq!(sql::token_mask(), "(-16777216)::pg_catalog.int8");
        assert_eq!(sql::sealed_sequence(), "4095::pg_catalog.int8");
        assert_eq!(sql::sequence_step(), "2731::pg_catalog.int8");
        assert_eq!(sql::counter_mask(), "15728640::pg_catalog.int8");
        assert_eq!(sql::token_of("f"), "(f OPERATOR(pg_catalog.>>) 24)");
    }
}

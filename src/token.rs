//! Fence tokens: positive, strictly increasing numbers handed out with each lock acquisition.

use std::fmt;

use crate::{Error, Result};

/// A fence token: an integer in `1..=i64::MAX`, issued once per lock acquisition and strictly
/// increasing per resource. `0` and negative numbers are never tokens, so a value of this type
/// is proof that the number is usable in a fenced write.
///
/// ```
/// use pgfence::FenceToken;
/// assert_eq!(FenceToken::new(42).unwrap().get(), 42);
/// assert!(FenceToken::new(0).is_err());
/// assert!(FenceToken::new(-1).is_err());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FenceToken(i64);

impl FenceToken {
    /// Validates `value` as a token.
    ///
    /// # Errors
    /// [`Error::InvalidToken`] when `value <= 0`.
    pub fn new(value: i64) -> Result<Self> {
        if value > 0 {
            Ok(Self(value))
        } else {
            Err(Error::InvalidToken(i128::from(value)))
        }
    }

    /// Validates a token that arrives as an unsigned number (for example from Redis or a CLI
    /// argument), refusing values that do not fit an `i64` instead of wrapping them.
    ///
    /// # Errors
    /// [`Error::InvalidToken`] when `value` is `0` or larger than `i64::MAX`.
    pub fn from_u64(value: u64) -> Result<Self> {
        i64::try_from(value)
            .map_err(|_| Error::InvalidToken(i128::from(value)))
            .and_then(Self::new)
    }

    /// The token as the `BIGINT` Postgres stores.
    #[must_use]
    pub fn get(self) -> i64 {
        self.0
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
        let v: i128 = s.trim().parse().map_err(|_| Error::InvalidToken(0))?;
        i64::try_from(v)
            .map_err(|_| Error::InvalidToken(v))
            .and_then(Self::new)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds() {
        assert!(FenceToken::new(i64::MAX).is_ok());
        assert!(FenceToken::new(i64::MIN).is_err());
        assert!(FenceToken::from_u64(u64::MAX).is_err());
        assert!(FenceToken::from_u64(0).is_err());
        assert!("9223372036854775808".parse::<FenceToken>().is_err());
        assert!("abc".parse::<FenceToken>().is_err());
        assert_eq!("7".parse::<FenceToken>().unwrap().get(), 7);
    }
}

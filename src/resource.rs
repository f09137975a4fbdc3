//! Resource names: what a lock protects, e.g. `payments:batch:42`.

use std::fmt;

use crate::{Error, Result};

/// The longest resource name accepted, in bytes.
pub const MAX_RESOURCE_LEN: usize = 200;

/// A validated resource name. One resource = one lock = one token counter = one high-water
/// mark in Postgres.
///
/// Accepted: 1 to [`MAX_RESOURCE_LEN`] bytes of printable, non-whitespace characters other
/// than `{` and `}` (those would break the Redis Cluster hash tag the issuer wraps the name
/// in).
///
/// ```
/// use pgfence::Resource;
/// assert!(Resource::new("payments:batch:42").is_ok());
/// assert!(Resource::new("").is_err());
/// assert!(Resource::new("a{b}").is_err());
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Resource(String);

impl Resource {
    /// Validates `name`.
    ///
    /// # Errors
    /// [`Error::InvalidResource`] saying what is wrong.
    pub fn new(name: impl Into<String>) -> Result<Self> {
        let name = name.into();
        if name.is_empty() {
            return Err(Error::InvalidResource("empty".into()));
        }
        if name.len() > MAX_RESOURCE_LEN {
            return Err(Error::InvalidResource(format!(
                "{} bytes long, at most {MAX_RESOURCE_LEN} allowed",
                name.len()
            )));
        }
        if let Some(c) = name
            .chars()
            .find(|c| c.is_control() || c.is_whitespace() || matches!(c, '{' | '}'))
        {
            return Err(Error::InvalidResource(format!(
                "character {c:?} not allowed (no whitespace, control characters, '{{' or '}}')"
            )));
        }
        Ok(Self(name))
    }

    /// The name.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for Resource {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::new(s)
    }
}

impl AsRef<str> for Resource {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_names() {
        for bad in ["", "a b", "a\nb", "a\0b", "{x}", "x}", &"x".repeat(201)] {
            assert!(Resource::new(bad).is_err(), "{bad:?} accepted");
        }
        assert!(Resource::new("x".repeat(200)).is_ok());
        assert!(Resource::new("paiements:lot:é").is_ok());
    }
}

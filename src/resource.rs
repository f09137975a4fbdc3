//! Resource names: what a lock protects, e.g. `payments:batch:42`.

use std::fmt;

use crate::{Error, Result};

/// The longest resource name accepted, in bytes.
pub const MAX_RESOURCE_LEN: usize = 200;

/// A validated resource name. One resource = one lock = one high-water mark in Postgres; its
/// tokens come from its own counter, or from its **fencing domain**'s counter.
///
/// Accepted: 1 to [`MAX_RESOURCE_LEN`] bytes of printable, non-whitespace characters other
/// than `{` and `}` (those would break the Redis Cluster hash tag the issuer wraps the name
/// in), optionally prefixed by a domain in braces: `{billing}account:2`.
///
/// Tokens are per counter and fences are per row. Resources whose jobs write the same rows
/// (a per-account lock and a nightly report over all accounts) must draw tokens from one
/// counter, or a lease of one can never write a row the other wrote with a higher number:
/// put them in one domain ([`Resource::in_domain`]). Each keeps its own lock; the domain
/// shares the counter (and the Redis Cluster slot).
///
/// ```
/// use pgfence::Resource;
/// assert!(Resource::new("payments:batch:42").is_ok());
/// assert!(Resource::new("").is_err());
/// assert!(Resource::new("a{b}").is_err());
/// let r = Resource::in_domain("billing", "account:2").unwrap();
/// assert_eq!(r.as_str(), "{billing}account:2");
/// assert_eq!(r.domain(), Some("billing"));
/// assert_eq!(Resource::new("{billing}account:2").unwrap(), r);
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Resource(String);

impl Resource {
    /// A resource in fencing domain `domain`: its own lock, the domain's token counter.
    ///
    /// # Errors
    /// [`Error::InvalidResource`] when either part is empty or invalid, or the whole is too
    /// long.
    pub fn in_domain(domain: &str, name: &str) -> Result<Self> {
        Self::new(format!("{{{domain}}}{name}"))
    }

    /// Validates `name` (`{domain}rest` for a resource in a fencing domain).
    ///
    /// # Errors
    /// [`Error::InvalidResource`] saying what is wrong.
    pub fn new(name: impl Into<String>) -> Result<Self> {
        let name = name.into();
        if name.is_empty() {
            return Err(Error::InvalidResource("empty".into()));
        }
        let plain = match name.strip_prefix('{').map(|rest| rest.split_once('}')) {
            None => name.as_str(),
            Some(Some((domain, rest))) if !domain.is_empty() && !rest.is_empty() => {
                check_chars(domain)?;
                rest
            }
            Some(_) => {
                return Err(Error::InvalidResource(
                    "a domain is written {domain}name, both non-empty".into(),
                ));
            }
        };
        if name.len() > MAX_RESOURCE_LEN {
            return Err(Error::InvalidResource(format!(
                "{} bytes long, at most {MAX_RESOURCE_LEN} allowed",
                name.len()
            )));
        }
        check_chars(plain)?;
        Ok(Self(name))
    }

    /// The name (with its `{domain}` prefix, if any).
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The fencing domain, if the resource is in one.
    #[must_use]
    pub fn domain(&self) -> Option<&str> {
        self.0
            .strip_prefix('{')
            .and_then(|rest| rest.split_once('}'))
            .map(|(domain, _)| domain)
    }

    /// What names the resource's token counter: its domain, or the resource itself.
    #[must_use]
    pub fn counter_id(&self) -> &str {
        self.domain().unwrap_or(&self.0)
    }
}

fn check_chars(part: &str) -> Result<()> {
    match part
        .chars()
        .find(|c| c.is_control() || c.is_whitespace() || matches!(c, '{' | '}'))
    {
        Some(c) => Err(Error::InvalidResource(format!(
            "character {c:?} not allowed (no whitespace, control characters, or '{{' '}}' outside a leading {{domain}})"
        ))),
        None => Ok(()),
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
        for bad in [
            "",
            "a b",
            "a\nb",
            "a\0b",
            "{x}",
            "x}",
            "{}x",
            "{a b}x",
            "{x}y{z}",
            &"x".repeat(201),
        ] {
            assert!(Resource::new(bad).is_err(), "{bad:?} accepted");
        }
        assert!(Resource::new("x".repeat(200)).is_ok());
        assert!(Resource::new("paiements:lot:é").is_ok());
    }
}

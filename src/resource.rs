//! Resources: what a lock protects, e.g. `payments:batch:42` ([`Resource`], with its fencing
//! domain), and [`Fence`], the check that fences work on a resource rather than on one row:
//! the first statement of each transaction records the lease's token as the resource's
//! high-water mark, and an older lease's check fails.

pub use crate::fence::Fence;

use crate::error::InvalidInput;
use std::fmt;

use crate::{Error, Result, issuer::DEFAULT_KEY_PREFIX};

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
    /// [`InvalidInput::Resource`] when either part is empty or invalid, or the whole is too
    /// long.
    pub fn in_domain(domain: &str, name: &str) -> Result<Self> {
        Self::new(format!("{{{domain}}}{name}"))
    }

    /// Validates `name` (`{domain}rest` for a resource in a fencing domain).
    ///
    /// # Errors
    /// [`InvalidInput::Resource`] saying what is wrong.
    pub fn new(name: impl Into<String>) -> Result<Self> {
        let name = name.into();
        if name.is_empty() {
            return Err(Error::Invalid(InvalidInput::Resource("empty".into())));
        }
        let plain = match name.strip_prefix('{').map(|rest| rest.split_once('}')) {
            None => name.as_str(),
            Some(Some((domain, rest))) if !domain.is_empty() && !rest.is_empty() => {
                check_chars(domain)?;
                rest
            }
            Some(_) => {
                return Err(Error::Invalid(InvalidInput::Resource(
                    "a domain is written {domain}name, both non-empty".into(),
                )));
            }
        };
        if name.len() > MAX_RESOURCE_LEN {
            return Err(Error::Invalid(InvalidInput::Resource(format!(
                "{} bytes long, at most {MAX_RESOURCE_LEN} allowed",
                name.len()
            ))));
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

    /// The name PostgreSQL fences this resource under for the leases of issuers with key
    /// prefix `prefix` (what [`Lease::fencing_resource`](crate::Lease::fencing_resource) is):
    /// the resource itself for the default prefix [`DEFAULT_KEY_PREFIX`], so existing marks
    /// and audit rows keep their names; for another prefix `P`, `P{R` for a resource `R`, and
    /// `{P{D}NAME` for resource `NAME` in fencing domain `D` (whose domain, as PostgreSQL's
    /// `pgfence.domain_high_water` and the token tag see it, is then `P{D`).
    ///
    /// A resource name has no `{` past its first character, and a key prefix none at all, so
    /// the names of two prefixes never meet, nor meet a resource name of the default prefix:
    /// prefixes that share a database share no mark, no check and no audit filter. The
    /// result is that prefix's name again when `self` already is one.
    ///
    /// ```
    /// use pgfence::Resource;
    /// let r = Resource::new("payments:batch:42").unwrap();
    /// assert_eq!(r.in_key_prefix("pgfence").unwrap(), r);
    /// assert_eq!(r.in_key_prefix("app_a").unwrap().as_str(), "app_a{payments:batch:42");
    /// let d = Resource::in_domain("billing", "account:2").unwrap();
    /// let named = d.in_key_prefix("app_a").unwrap();
    /// assert_eq!(named.as_str(), "{app_a{billing}account:2");
    /// assert_eq!(named.domain(), Some("app_a{billing"));
    /// assert_eq!(named.key_prefix(), Some("app_a"));
    /// assert_eq!(named.without_key_prefix(), d);
    /// ```
    ///
    /// # Errors
    /// [`InvalidInput::KeyPrefix`] for an invalid prefix; [`InvalidInput::Resource`] when the
    /// name would be longer than [`MAX_RESOURCE_LEN`], or `self` is another prefix's name.
    pub fn in_key_prefix(&self, prefix: &str) -> Result<Self> {
        let prefix = crate::issuer::limits::check_key_prefix(prefix)?;
        if let Some(own) = self.key_prefix() {
            if own == prefix {
                return Ok(self.clone());
            }
            return Err(Error::Invalid(InvalidInput::Resource(format!(
                "{} is already the PostgreSQL name of {} under key prefix {own}, not {prefix}",
                self.0,
                self.without_key_prefix()
            ))));
        }
        if prefix == DEFAULT_KEY_PREFIX {
            return Ok(self.clone());
        }
        let name = match self.0.strip_prefix('{') {
            Some(rest) => format!("{{{prefix}{{{rest}"),
            None => format!("{prefix}{{{}", self.0),
        };
        if name.len() > MAX_RESOURCE_LEN {
            return Err(Error::Invalid(InvalidInput::Resource(format!(
                "{} under key prefix {prefix} is fenced in PostgreSQL as {name}, {} bytes long: at most {MAX_RESOURCE_LEN} allowed (shorten the name or the prefix)",
                self.0,
                name.len()
            ))));
        }
        Ok(Self(name))
    }

    /// Validates a name as PostgreSQL's `pgfence` schema stores it: a resource name
    /// ([`Resource::new`]), or one of a key prefix other than the default
    /// ([`Resource::in_key_prefix`]: `P{R`, `{P{D}NAME`), such as `pgfence run` exports as
    /// `PGFENCE_RESOURCE`.
    ///
    /// ```
    /// use pgfence::Resource;
    /// let named = Resource::parse_fenced("app_a{payments:batch:42").unwrap();
    /// assert_eq!(named.key_prefix(), Some("app_a"));
    /// assert_eq!(named.without_key_prefix().as_str(), "payments:batch:42");
    /// assert_eq!(Resource::parse_fenced("x").unwrap(), Resource::new("x").unwrap());
    /// assert!(Resource::parse_fenced("pgfence{x").is_err()); // the default prefix: just "x"
    /// ```
    ///
    /// # Errors
    /// [`InvalidInput::Resource`] for anything else.
    pub fn parse_fenced(name: &str) -> Result<Self> {
        let plain_err = match Self::new(name) {
            Ok(r) => return Ok(r),
            Err(e) => e,
        };
        let split = match name.strip_prefix('{') {
            Some(rest) => rest
                .split_once('{')
                .map(|(prefix, tail)| (prefix, format!("{{{tail}"))),
            None => name
                .split_once('{')
                .map(|(prefix, tail)| (prefix, tail.to_owned())),
        };
        let parsed = split.and_then(|(prefix, tail)| {
            let inner = Self::new(tail).ok()?;
            (prefix != DEFAULT_KEY_PREFIX).then_some(())?;
            let named = inner.in_key_prefix(prefix).ok()?;
            (named.0 == name).then_some(named)
        });
        parsed.ok_or(plain_err)
    }

    /// The key prefix whose name this is ([`Resource::in_key_prefix`]); `None` for a
    /// resource name, which is also the default prefix's name for it.
    #[must_use]
    pub fn key_prefix(&self) -> Option<&str> {
        match self.0.strip_prefix('{') {
            Some(rest) => {
                let domain = rest.split_once('}').map_or(rest, |(d, _)| d);
                domain.split_once('{').map(|(prefix, _)| prefix)
            }
            None => self.0.split_once('{').map(|(prefix, _)| prefix),
        }
    }

    /// The resource this is the name of ([`Resource::in_key_prefix`] undone); `self` for a
    /// resource name.
    #[must_use]
    pub fn without_key_prefix(&self) -> Self {
        let Some(prefix) = self.key_prefix() else {
            return self.clone();
        };
        Self(match self.0.strip_prefix('{') {
            Some(rest) => format!("{{{}", &rest[prefix.len() + 1..]),
            None => self.0[prefix.len() + 1..].to_owned(),
        })
    }
}

fn check_chars(part: &str) -> Result<()> {
    match part
        .chars()
        .find(|c| c.is_control() || c.is_whitespace() || matches!(c, '{' | '}'))
    {
        Some(c) => Err(Error::Invalid(InvalidInput::Resource(format!(
            "character {c:?} not allowed (no whitespace, control characters, or '{{' '}}' outside a leading {{domain}})"
        )))),
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

    /// Names of valid resources under several prefixes: every (prefix, resource) pair gets
    /// its own name, no prefixed name is a resource name, and each parses back.
    #[test]
    fn key_prefix_names_are_injective() {
        let resources: Vec<Resource> = [
            "r",
            "a{b",
            "a/r",
            "app_a/r",
            "app_a:r",
            "{d}x",
            "{app_a/d}x",
            "{d}app_a{x",
            "payments:batch:42",
            "{billing}account:2",
            "{b}{",
        ]
        .iter()
        .filter_map(|n| Resource::new(*n).ok())
        .collect();
        let prefixes = ["pgfence", "app_a", "app_b", "app", "a", "app_a:x", "a/b"];
        let mut seen = std::collections::HashMap::new();
        for prefix in prefixes {
            for r in &resources {
                let named = r.in_key_prefix(prefix).unwrap();
                if prefix == DEFAULT_KEY_PREFIX {
                    assert_eq!(&named, r, "the default prefix keeps the name");
                    assert_eq!(named.key_prefix(), None);
                } else {
                    assert!(
                        Resource::new(named.as_str()).is_err(),
                        "{named} is a resource name"
                    );
                    assert_eq!(named.key_prefix(), Some(prefix));
                    assert_eq!(r.domain().is_some(), named.domain().is_some());
                    if let Some(d) = r.domain() {
                        assert_eq!(named.domain(), Some(format!("{prefix}{{{d}").as_str()));
                    }
                }
                assert_eq!(&named.without_key_prefix(), r);
                assert_eq!(Resource::parse_fenced(named.as_str()).unwrap(), named);
                assert_eq!(named.in_key_prefix(prefix).unwrap(), named);
                if let Some(before) = seen.insert(named.as_str().to_owned(), (prefix, r.clone())) {
                    panic!("{named} is the name of {before:?} and of {:?}", (prefix, r));
                }
            }
        }
        // Another prefix's name is not namespaced again.
        let named = resources[0].in_key_prefix("app_a").unwrap();
        assert!(named.in_key_prefix("app_b").is_err());
        assert!(named.in_key_prefix(DEFAULT_KEY_PREFIX).is_err());
        // Too long once prefixed.
        let long = Resource::new("x".repeat(MAX_RESOURCE_LEN - 5)).unwrap();
        assert!(long.in_key_prefix("abcd").is_ok());
        assert!(matches!(
            long.in_key_prefix("abcde"),
            Err(Error::Invalid(InvalidInput::Resource(_)))
        ));
        // What is no prefix's name.
        for bad in [
            "pgfence{r",
            "{pgfence{d}x",
            "a b{r",
            "{a{b",
            "a{{d}x",
            "{a{d}x{",
            "a{b{c",
            "{a{b{c}x",
            "",
        ] {
            assert!(Resource::parse_fenced(bad).is_err(), "{bad:?} parsed");
        }
    }
}

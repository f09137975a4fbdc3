//! Parsing shared by the issuers' URLs: the scheme that picks an issuer, and the host lists of
//! the consensus stores.

use crate::error::InvalidInput;

/// The issuer URL schemes, for error messages.
pub(super) const EXPECTED_SCHEMES: &str = "redis://, rediss://, redis+sentinel://, rediss+sentinel://, etcd://, etcd+https://, zk://, postgres:// or postgresql://";

/// The scheme of `url`, lower-cased, with its `://` (`None` without one).
pub(super) fn scheme(url: &str) -> Option<String> {
    url.find("://")
        .map(|i| url[..i + 3].to_ascii_lowercase())
        .filter(|s| {
            s[..s.len() - 3]
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
        })
}

/// Where `url` points, for messages: its scheme and host, with the port when it is a number
/// (`redis://cache.internal:6380`). Never its user, password, path or query, which may hold
/// secrets: the userinfo ends at the last `@` (a password may hold `/`, `?` or `#`).
pub(crate) fn url_host(url: &str) -> String {
    let Some(sep) = url.find("://") else {
        return "a URL without a scheme".to_owned();
    };
    let scheme = scheme(url).unwrap_or_else(|| "?://".to_owned());
    let rest = &url[sep + 3..];
    let rest = rest.rfind('@').map_or(rest, |at| &rest[at + 1..]);
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let (host, port) = split_port(authority);
    match port {
        Some(port) if port.parse::<u16>().is_ok() => format!("{scheme}{host}:{port}"),
        _ => format!("{scheme}{host}"),
    }
}

/// `host:port` → (`host`, `Some("port")`); `[v6]:port` keeps the brackets; no port → `None`.
fn split_port(authority: &str) -> (&str, Option<&str>) {
    if authority.starts_with('[') {
        return match authority.find(']') {
            Some(end) => (&authority[..=end], authority[end + 1..].strip_prefix(':')),
            None => (authority, None),
        };
    }
    match authority.rsplit_once(':') {
        Some((host, port)) => (host, Some(port)),
        None => (authority, None),
    }
}

/// A Redis URL redis-rs refused to parse, as the one invalid-URL error every issuer reports:
/// the host it names (never the password) and what is wrong, in words (redis-rs says only
/// "Redis URL did not parse - InvalidClientConfig"). `url` is `None` when only a parsed
/// address was at hand.
pub(crate) fn invalid_redis_url(url: Option<&str>, e: &redis::RedisError) -> crate::Error {
    let why = url.and_then(redis_url_problem).unwrap_or_else(|| {
        // redis-rs's own words, without its error kind's name.
        e.to_string()
            .replace(" - InvalidClientConfig", "")
            .replace("Redis URL did not parse", "not a valid URL")
    });
    let which = url.map_or_else(String::new, |u| format!(" {}", url_host(u)));
    crate::Error::Invalid(InvalidInput::IssuerUrl(format!(
        "the Redis URL{which} did not parse: {why} (expected redis://host:port/db, rediss:// for TLS)"
    )))
}

/// What is wrong with a `redis://` / `rediss://` URL, when it is one of the usual mistakes.
fn redis_url_problem(url: &str) -> Option<String> {
    let rest = &url[url.find("://")? + 3..];
    let rest = rest.rfind('@').map_or(rest, |at| &rest[at + 1..]);
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(end);
    if authority.starts_with('[') && !authority.contains(']') {
        return Some("an IPv6 host opens '[' but does not close it".to_owned());
    }
    let (host, port) = split_port(authority);
    if host.is_empty() || host == "[]" {
        return Some("it names no host".to_owned());
    }
    if let Some(port) = port {
        // The port is not echoed: in `redis://:secret` (no `@`), it is a password.
        if port.is_empty() {
            return Some("the port after ':' is empty".to_owned());
        }
        if !port.bytes().all(|b| b.is_ascii_digit()) {
            return Some("the port is not a number".to_owned());
        }
        if port.parse::<u16>().is_err() {
            return Some("the port is out of range (1 to 65535)".to_owned());
        }
    }
    let db = path
        .split(['?', '#'])
        .next()
        .unwrap_or("")
        .trim_matches('/');
    if !db.is_empty() && db.parse::<i64>().is_err() {
        return Some("the database (after '/') is not a number".to_owned());
    }
    None
}

/// The error of a server that did not answer: `STORE at HOST:PORT did not answer within
/// BOUND: CAUSE`, keeping the cause's kind (so a refusal or a timeout is still retryable and
/// still reads as one).
pub(crate) fn unanswered(
    store: &str,
    addr: &str,
    bound: std::time::Duration,
    cause: Option<&std::io::Error>,
) -> std::io::Error {
    let kind = cause.map_or(std::io::ErrorKind::TimedOut, std::io::Error::kind);
    let cause = cause.map_or_else(|| "no reply".to_owned(), ToString::to_string);
    std::io::Error::new(
        kind,
        format!(
            "{store} at {addr} did not answer within {}s: {cause}",
            bound.as_secs_f64()
        ),
    )
}

/// Splits `host[:port][,host[:port]...]` into `host:port` entries (`default_port` where a
/// host names none; `[v6]` hosts keep their brackets). The reason when malformed.
#[cfg(any(feature = "etcd", feature = "zk"))]
pub(crate) fn host_list(
    hosts: &str,
    default_port: u16,
) -> std::result::Result<Vec<String>, &'static str> {
    let mut out = Vec::new();
    for host in hosts.split(',') {
        let host = host.trim();
        if host.is_empty() || host.contains(['/', '?', '@']) {
            return Err("empty or malformed host");
        }
        let has_port = match host.rsplit_once(':') {
            // `[::1]:2379` or `h:2379` have a port; a bare `[::1]` does not.
            Some((h, port)) if !h.is_empty() && !port.contains(']') => {
                port.parse::<u16>().map_err(|_| "bad port")?;
                true
            }
            Some(_) | None => false,
        };
        out.push(if has_port {
            host.to_owned()
        } else {
            format!("{host}:{default_port}")
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_without_secrets() {
        for (url, host) in [
            ("redis://:hunter2@cache:6380/0", "redis://cache:6380"),
            ("redis://u:a/b?c@h:1/0", "redis://h:1"),
            ("redis://h:notaport", "redis://h"),
            ("REDIS://[::1]:7", "redis://[::1]:7"),
            (
                "postgres://u:hunter2@db.internal/app?password=x",
                "postgres://db.internal",
            ),
            ("no scheme", "a URL without a scheme"),
        ] {
            assert_eq!(url_host(url), host, "{url}");
        }
    }

    #[test]
    fn redis_url_problems_in_words() {
        for (url, why) in [
            ("redis://h:notaport", "the port is not a number"),
            ("redis://:hunter2", "no host"),
            ("redis://h:99999", "out of range"),
            ("redis://h:", "empty"),
            ("redis://[::1", "does not close"),
            ("redis://:pw@/0", "no host"),
            ("redis://h:1/x", "database"),
        ] {
            let err = invalid_redis_url(
                Some(url),
                &redis::RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "Redis URL did not parse",
                )),
            )
            .to_string();
            assert!(err.contains(why), "{url}: {err}");
            assert!(err.contains("did not parse"), "{url}: {err}");
            assert!(
                !err.contains("hunter2") && !err.contains("InvalidClientConfig"),
                "{err}"
            );
        }
    }

    #[test]
    fn schemes() {
        assert_eq!(scheme("REDIS://h:1").as_deref(), Some("redis://"));
        assert_eq!(
            scheme("redis+sentinel://h").as_deref(),
            Some("redis+sentinel://")
        );
        assert_eq!(scheme("etcd://a,b").as_deref(), Some("etcd://"));
        assert_eq!(scheme("zk://a,b").as_deref(), Some("zk://"));
        assert_eq!(
            scheme("Rediss+Sentinel://h").as_deref(),
            Some("rediss+sentinel://")
        );
        assert_eq!(scheme("etcd+https://a").as_deref(), Some("etcd+https://"));
        assert_eq!(scheme("not a url"), None);
        assert_eq!(scheme("a b://x"), None);
    }
}

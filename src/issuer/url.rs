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
/// the URL quoted with its password hidden ([`shown_url`]) and what is wrong with it, naming
/// the part (redis-rs says only "Redis URL did not parse - InvalidClientConfig"). `url` is
/// `None` when only a parsed address was at hand.
pub(crate) fn invalid_redis_url(url: Option<&str>, e: &redis::RedisError) -> crate::Error {
    let why = url.and_then(redis_url_problem).unwrap_or_else(|| {
        // redis-rs's own words, without its error kind's name.
        e.to_string()
            .replace(" - InvalidClientConfig", "")
            .replace("Redis URL did not parse", "not a valid URL")
    });
    let which = url.map_or_else(String::new, |u| format!(" {:?}", shown_url(u)));
    crate::Error::Invalid(InvalidInput::IssuerUrl(format!(
        "the Redis URL{which} did not parse: {why} (expected redis://host:port/db, rediss:// for TLS)"
    )))
}

/// `url` as an error may quote it: the password of its userinfo and the values of its
/// credential-like query parameters (`password`, `token`, `secret`, `auth`...) replaced by
/// `***`, and at most 200 characters. Without an `@`, what follows a `:` where no host
/// precedes it (`redis://:secret`) is taken for a password too.
pub(crate) fn shown_url(url: &str) -> String {
    let start = url.find("://").map_or(0, |i| i + 3);
    let (head, rest) = url.split_at(start);
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let mut out = head.to_owned();
    // The userinfo ends at the last '@' (a password may hold '/', '?' or '#').
    let after_userinfo = match rest[..authority_end].rfind('@').or_else(|| rest.rfind('@')) {
        Some(at) => {
            let user = rest[..at]
                .split_once(':')
                .map_or(&rest[..at], |(user, _)| user);
            out.push_str(user);
            if rest[..at].contains(':') {
                out.push_str(":***");
            }
            out.push('@');
            &rest[at + 1..]
        }
        None if rest.starts_with(':') => {
            out.push_str(":***");
            &rest[authority_end..]
        }
        None => rest,
    };
    match after_userinfo.split_once('?') {
        None => out.push_str(after_userinfo),
        Some((path, query)) => {
            out.push_str(path);
            out.push('?');
            let (query, fragment) = query
                .split_once('#')
                .map_or((query, None), |(q, f)| (q, Some(f)));
            let pairs: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((name, _)) if is_credential(name) => format!("{name}=***"),
                    _ => pair.to_owned(),
                })
                .collect();
            out.push_str(&pairs.join("&"));
            if let Some(fragment) = fragment {
                out.push('#');
                out.push_str(fragment);
            }
        }
    }
    if out.chars().count() > 200 {
        out = out.chars().take(200).collect::<String>() + "…";
    }
    out
}

/// Whether a URL query parameter named `name` carries a credential.
fn is_credential(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    ["pass", "pwd", "secret", "token", "auth", "credential"]
        .iter()
        .any(|w| name.contains(w))
}

/// What is wrong with a `redis://` / `rediss://` URL, when it is one of the usual mistakes.
fn redis_url_problem(url: &str) -> Option<String> {
    let Some(sep) = url.find("://") else {
        return Some("it has no scheme (write redis://host:port, or rediss:// for TLS)".to_owned());
    };
    let rest = &url[sep + 3..];
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
        // With a host before it, what follows ':' is a port ([`shown_url`] quotes it); a
        // password is never here (it is in the userinfo, before an '@').
        if port.is_empty() {
            return Some(format!("the port after {host}: is empty"));
        }
        if !port.bytes().all(|b| b.is_ascii_digit()) {
            return Some(format!("the port {port:?} is not a number"));
        }
        if port.parse::<u16>().is_err() {
            return Some(format!("the port {port} is out of range (1 to 65535)"));
        }
    }
    let db = path
        .split(['?', '#'])
        .next()
        .unwrap_or("")
        .trim_matches('/');
    if !db.is_empty() && db.parse::<i64>().is_err() {
        return Some(format!("the database {db:?} (after '/') is not a number"));
    }
    None
}

/// The error of a server that did not answer, as it failed: `STORE at HOST:PORT refused the
/// connection` (nothing listens there: said at once, not as a time-out), `... did not answer
/// within BOUND` (no reply, or the connection timed out), `... could not be reached: CAUSE`
/// (unreachable, reset, a name that does not resolve). The cause's kind is kept, so the error
/// is still retryable and still reads as what it is.
pub(crate) fn unanswered(
    store: &str,
    addr: &str,
    bound: std::time::Duration,
    cause: Option<&std::io::Error>,
) -> std::io::Error {
    let kind = cause.map_or(std::io::ErrorKind::TimedOut, std::io::Error::kind);
    let text = match (kind, cause) {
        (std::io::ErrorKind::ConnectionRefused, _) => format!(
            "{store} at {addr} refused the connection (nothing listens there: is the server running, on this port?)"
        ),
        (std::io::ErrorKind::TimedOut, _) | (_, None) => format!(
            "{store} at {addr} did not answer within {}s",
            bound.as_secs_f64()
        ),
        (_, Some(cause)) => format!("{store} at {addr} could not be reached: {cause}"),
    };
    std::io::Error::new(kind, text)
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
    fn urls_shown_without_secrets() {
        for (url, shown) in [
            ("redis://:hunter2@cache:6380/0", "redis://:***@cache:6380/0"),
            ("redis://u:a/b?c@h:1/0", "redis://u:***@h:1/0"),
            ("redis://h:notaport", "redis://h:notaport"),
            ("redis://:hunter2", "redis://:***"),
            ("redis://:hunter2/0", "redis://:***/0"),
            ("redis://app@h:1", "redis://app@h:1"),
            (
                "postgres://u:hunter2@db.internal/app?password=x&sslmode=require&api_Token=y#f",
                "postgres://u:***@db.internal/app?password=***&sslmode=require&api_Token=***#f",
            ),
            ("no scheme", "no scheme"),
        ] {
            assert_eq!(shown_url(url), shown, "{url}");
        }
        assert_eq!(shown_url(&"x".repeat(300)).chars().count(), 201);
    }

    #[test]
    fn redis_url_problems_in_words() {
        for (url, why) in [
            (
                "redis://h:notaport",
                "the Redis URL \"redis://h:notaport\" did not parse: the port \"notaport\" is not a number",
            ),
            (
                "redis://:hunter2@cache.internal:notaport",
                "\"redis://:***@cache.internal:notaport\" did not parse: the port \"notaport\"",
            ),
            (
                "redis://:hunter2",
                "\"redis://:***\" did not parse: it names no host",
            ),
            ("redis://h:99999", "the port 99999 is out of range"),
            ("redis://h:", "the port after h: is empty"),
            ("redis://[::1", "does not close"),
            ("redis://:pw@/0", "no host"),
            ("redis://h:1/x", "the database \"x\""),
            (
                "localhost:6379",
                "the Redis URL \"localhost:6379\" did not parse: it has no scheme",
            ),
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

//! Parsing shared by the issuers' URLs: the scheme that picks an issuer, and the host lists of
//! the consensus stores.

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

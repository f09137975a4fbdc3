//! `zk://` URLs: the ensemble's hosts and the session timeout, and the refusal of TLS.

use crate::error::InvalidInput;
use std::time::Duration;

use crate::issuer::url::host_list;
use crate::tls::zk_tls_unsupported as tls_unsupported;
use crate::{Error, Result};

/// The URL scheme that selects the ZooKeeper issuer: `zk://host:2181[,host2:2181...]`.
pub const SCHEME: &str = "zk://";

/// The port used when a `zk://` URL names a host without one.
const DEFAULT_PORT: u16 = 2181;

/// The session timeout asked of the servers unless the URL sets `session_timeout_ms`.
const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether `url` selects the ZooKeeper issuer (`zk://...`).
#[must_use]
pub(super) fn is_zk_url(url: &str) -> bool {
    url.get(..SCHEME.len())
        .is_some_and(|s| s.eq_ignore_ascii_case(SCHEME))
}

/// Query parameters that ask for TLS, which this issuer does not speak (see [`ZkIssuer`]).
const TLS_PARAMS: [&str; 6] = ["tls", "ssl", "secure", "cacert", "cert", "key"];

/// `zk://host[:port][,host[:port]...][/][?session_timeout_ms=N]` → the client's host list and
/// the session timeout.
pub(super) fn parse_url(url: &str) -> Result<(String, Duration)> {
    let invalid = |why: &str| {
        Error::Invalid(InvalidInput::IssuerUrl(format!(
            "{why} (expected zk://host:port[,host:port...][?session_timeout_ms=N])"
        )))
    };
    if crate::tls::is_zk_tls_url(url) {
        return Err(tls_unsupported());
    }
    if !is_zk_url(url) {
        return Err(invalid("not a zk:// URL"));
    }
    let rest = &url[SCHEME.len()..];
    let (hosts, query) = rest.split_once('?').unwrap_or((rest, ""));
    let hosts = hosts.strip_suffix('/').unwrap_or(hosts);
    let mut session_timeout = DEFAULT_SESSION_TIMEOUT;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("session_timeout_ms", ms)) => {
                let ms: u64 = ms
                    .parse()
                    .ok()
                    .filter(|ms| *ms > 0)
                    .ok_or_else(|| invalid("session_timeout_ms is a positive number"))?;
                session_timeout = Duration::from_millis(ms);
            }
            Some((name, _)) if TLS_PARAMS.contains(&name) => return Err(tls_unsupported()),
            None if TLS_PARAMS.contains(&pair) => return Err(tls_unsupported()),
            _ => return Err(invalid("unknown parameter")),
        }
    }
    let hosts = host_list(hosts, DEFAULT_PORT).map_err(invalid)?;
    Ok((hosts.join(","), session_timeout))
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_zk_urls() {
        let (hosts, timeout) = parse_url("zk://127.0.0.1:2181,10.0.0.2,[::1]:3000/").unwrap();
        assert_eq!(hosts, "127.0.0.1:2181,10.0.0.2:2181,[::1]:3000");
        assert_eq!(timeout, DEFAULT_SESSION_TIMEOUT);
        let (hosts, timeout) = parse_url("ZK://h1:1,h2:2?session_timeout_ms=4000").unwrap();
        assert_eq!(hosts, "h1:1,h2:2");
        assert_eq!(timeout, Duration::from_millis(4000));
        for bad in [
            "redis://h",
            "zk://",
            "zk://h:x",
            "zk://a,,b",
            "zk://h/chroot",
            "zk://h?session_timeout_ms=0",
            "zk://h?foo=1",
            "zk://u:p@h",
        ] {
            let err = parse_url(bad).unwrap_err();
            assert!(
                matches!(err, Error::Invalid(InvalidInput::IssuerUrl(_))),
                "{bad}: {err}"
            );
        }
        for tls in [
            "zks://h:2281",
            "ZK+TLS://h",
            "zk://h?tls",
            "zk://h?secure=true",
            "zk://h?session_timeout_ms=4000&cacert=/ca.pem",
        ] {
            let err = parse_url(tls).unwrap_err();
            assert!(matches!(err, Error::TlsUnsupported { .. }), "{tls}: {err}");
            assert!(err.to_string().contains("TLS tunnel"), "{tls}: {err}");
        }
        assert!(is_zk_url("zk://h") && !is_zk_url("etcd://h") && !is_zk_url("z"));
    }
}

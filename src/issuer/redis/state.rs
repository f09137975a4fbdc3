//! What the Redis issuer keeps per resource, counted with `SCAN` on a standalone or Sentinel
//! master ([`TokenIssuer::state`](crate::TokenIssuer::state)).

use std::collections::HashSet;
use std::time::Duration;

use redis::aio::ConnectionLike;

use crate::issuer::IssuerState;

/// Keys asked for per `SCAN` step.
const SCAN_COUNT: usize = 1000;

/// What a key of the prefix is, and the hash tag (resource or domain) it belongs to.
enum Key<'a> {
    Counter(&'a str),
    Lock(&'a str),
    Other,
}

/// Classifies `key` (`PREFIX:{TAG}:fence`, `PREFIX:{TAG}:lock[:NAME]`, anything else of the
/// prefix). `None` for a key outside the layout.
fn classify<'a>(prefix: &str, key: &'a str) -> Option<Key<'a>> {
    let rest = key.strip_prefix(prefix)?.strip_prefix(":{")?;
    let (tag, tail) = rest.split_once("}:")?;
    Some(if tail == "fence" {
        Key::Counter(tag)
    } else if tail == "lock" || tail.starts_with("lock:") {
        Key::Lock(tag)
    } else {
        Key::Other
    })
}

/// Scans every key of `prefix` (`PREFIX:{*`): counters (and how many have an expiry), locks,
/// other keys, and the counters no lock of their tag holds (idle).
pub(super) async fn count<C: ConnectionLike + Send>(
    mut conn: C,
    prefix: &str,
    idle_expiry: Option<Duration>,
) -> redis::RedisResult<IssuerState> {
    let pattern = format!("{prefix}:{{*");
    let mut cursor: u64 = 0;
    let mut counters: Vec<String> = Vec::new();
    let mut expiring = 0u64;
    let mut locked: HashSet<String> = HashSet::new();
    let (mut locks, mut other) = (0u64, 0u64);
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(SCAN_COUNT)
            .query_async(&mut conn)
            .await?;
        let mut step: Vec<String> = Vec::new();
        for key in &keys {
            match classify(prefix, key) {
                Some(Key::Counter(tag)) => {
                    counters.push(tag.to_owned());
                    step.push(key.clone());
                }
                Some(Key::Lock(tag)) => {
                    locks += 1;
                    locked.insert(tag.to_owned());
                }
                Some(Key::Other) => other += 1,
                None => {}
            }
        }
        if !step.is_empty() {
            let mut pipe = redis::pipe();
            for key in &step {
                pipe.pttl(key);
            }
            let ttls: Vec<i64> = pipe.query_async(&mut conn).await?;
            expiring += ttls.iter().filter(|t| **t >= 0).count() as u64;
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
    let idle = counters.iter().filter(|tag| !locked.contains(*tag)).count() as u64;
    Ok(IssuerState {
        counters: counters.len() as u64,
        expiring: Some(expiring),
        locks,
        idle,
        other,
        floors: 0,
        idle_expiry,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_told_apart_by_their_layout() {
        assert!(matches!(
            classify("pgfence", "pgfence:{a:b}:fence"),
            Some(Key::Counter("a:b"))
        ));
        assert!(matches!(
            classify("pgfence", "pgfence:{a}:lock"),
            Some(Key::Lock("a"))
        ));
        assert!(matches!(
            classify("pgfence", "pgfence:{d}:lock:x"),
            Some(Key::Lock("d"))
        ));
        assert!(matches!(
            classify("pgfence", "pgfence:{a}:attempt"),
            Some(Key::Other)
        ));
        assert!(classify("pgfence", "other:{a}:fence").is_none());
        assert!(classify("pgfence", "pgfencex:{a}:fence").is_none());
    }
}

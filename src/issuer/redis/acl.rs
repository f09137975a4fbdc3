//! The Redis ACL the issuer needs, as one text for the README, the tests and the error a
//! refused command gets.

use redis::{ErrorKind, RedisError, ServerErrorKind};

use super::DEFAULT_KEY_PREFIX;
use crate::Error;

/// The commands the Redis issuer sends (ACL command rules, after `-@all`):
///
/// | rule | sent by |
/// |---|---|
/// | `+evalsha`, `+script\|load` | every lease call: the issuer's Lua scripts run by SHA; a server that does not have a script yet (new, restarted, failed over) gets it loaded once |
/// | `+get +set +pexpire +pttl +incr +del` | inside the scripts (acquire, extend, release, raise the floor, reissue after a lost counter) — Redis checks a script's commands against the ACL too — and `status` (`GET`, `PTTL`) |
/// | `+ping` | the connections' probe after a dropped connection; Redis Cluster's connection check |
/// | `+role` | through Sentinel: is the node the sentinels name really the master? |
/// | `+select` | connecting to a database other than 0 (`redis://host/3`) |
/// | `+cluster\|slots`, `+asking` | Redis Cluster: the slot map, and redirections while slots move |
///
/// `AUTH` and `HELLO` need no rule. On Redis 7.2 and later redis-rs also sends `CLIENT SETINFO`
/// (the library's name and version, for `CLIENT LIST`) and ignores a refusal, which `ACL LOG`
/// records; add `+client|setinfo` there to keep the log clean (Redis 7.0 rejects that rule:
/// it has no such command).
pub const ACL_COMMANDS: &str = "-@all +evalsha +script|load +get +set +pexpire +pttl +incr +del +ping +role +select +cluster|slots +asking";

/// The ACL rules a sentinel's user needs for the issuer's `rediss+sentinel://` /
/// `redis+sentinel://` connections (the user of `sentinel_username` / `sentinel_password`):
/// the issuer asks the sentinels only `SENTINEL get-master-addr-by-name`.
pub const SENTINEL_ACL_RULE: &str = "-@all +sentinel|get-master-addr-by-name";

/// The Redis ACL key pattern of an issuer with key prefix `prefix`: `~PREFIX:*` (`~pgfence:*`
/// by default), with the glob characters of the prefix escaped. Every lock and counter key of
/// the issuer matches it ([`lock_key`](crate::issuer::redis::lock_key), [`counter_key`](crate::issuer::redis::counter_key)).
#[must_use]
pub fn acl_key_pattern(prefix: &str) -> String {
    let mut pattern = String::with_capacity(prefix.len() + 3);
    pattern.push('~');
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            pattern.push('\\');
        }
        pattern.push(c);
    }
    pattern.push_str(":*");
    pattern
}

/// The minimal Redis ACL for the issuer's user with key prefix `prefix`
/// ([`DEFAULT_KEY_PREFIX`](crate::issuer::DEFAULT_KEY_PREFIX) unless
/// [`RedisIssuer::with_key_prefix`](crate::RedisIssuer::with_key_prefix) sets another): its keys
/// ([`acl_key_pattern`]), no Pub/Sub channel, and [`ACL_COMMANDS`]. The rules go
/// after the user's name and password:
///
/// ```text
/// ACL SETUSER pgfence-app on >PASSWORD resetkeys ~pgfence:* resetchannels -@all +evalsha +script|load +get +set +pexpire +pttl +incr +del +ping +role +select +cluster|slots +asking
/// ```
///
/// (in `users.acl` or `redis.conf`: `user pgfence-app on >PASSWORD resetkeys ...`). Through
/// Sentinel, the sentinels' user needs [`SENTINEL_ACL_RULE`]. A command Redis refuses
/// for lack of one of these permissions fails with [`Error::RedisPermission`], which quotes
/// this rule.
///
/// ```
/// assert_eq!(
///     pgfence::issuer::redis::acl_rule("billing"),
///     "resetkeys ~billing:* resetchannels -@all +evalsha +script|load +get +set +pexpire +pttl +incr +del +ping +role +select +cluster|slots +asking"
/// );
/// ```
#[must_use]
pub fn acl_rule(prefix: &str) -> String {
    format!(
        "resetkeys {} resetchannels {ACL_COMMANDS}",
        acl_key_pattern(prefix)
    )
}

/// What a sentinel's refusal says, so that the error quotes the sentinels' rule.
pub(super) const SENTINEL_REFUSED: &str = "the sentinel's ACL user may not ask for the master";

/// Whether Redis refused the command for lack of an ACL permission: `NOPERM` for a command
/// or its keys, or a script's `redis.call` refused (`The user executing the script can't ...`).
pub(super) fn is_acl_denial(e: &RedisError) -> bool {
    if e.kind() == ErrorKind::Server(ServerErrorKind::NoPerm) || e.code() == Some("NOPERM") {
        return true;
    }
    let text = e.to_string();
    text.contains("NOPERM")
        || text.contains("no permissions to")
        || text.contains("The user executing the script can't")
        || text.contains(SENTINEL_REFUSED)
}

/// `e` as pgfence's error: an ACL refusal becomes [`Error::RedisPermission`] naming the rule
/// the user needs (the issuer's, for `prefix`, or the sentinels').
pub(super) fn redis_error(e: RedisError, prefix: &str) -> Error {
    if !is_acl_denial(&e) {
        return Error::redis(e);
    }
    if e.to_string().contains(SENTINEL_REFUSED) {
        Error::RedisPermission {
            what: "the sentinels' user",
            rule: SENTINEL_ACL_RULE.to_owned(),
            source: e,
        }
    } else {
        Error::RedisPermission {
            what: "the issuer's user",
            rule: acl_rule(prefix),
            source: e,
        }
    }
}

/// [`redis_error`] for an error met while connecting, before the issuer's key prefix is set:
/// the rule named is the default prefix's.
pub(super) fn connect_error(e: RedisError) -> Error {
    match redis_error(e, DEFAULT_KEY_PREFIX) {
        Error::RedisPermission {
            what: "the issuer's user",
            rule,
            source,
        } => Error::RedisPermission {
            what: "the issuer's user (with the default key prefix; another prefix needs its own key pattern)",
            rule,
            source,
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_patterns_escape_globs() {
        assert_eq!(acl_key_pattern("pgfence"), "~pgfence:*");
        assert_eq!(acl_key_pattern("a*b?[c]\\"), r"~a\*b\?\[c\]\\:*");
    }

    #[test]
    fn refusals_name_the_rule() {
        let noperm = RedisError::from((
            ErrorKind::Server(ServerErrorKind::NoPerm),
            "NOPERM",
            "this user has no permissions to access one of the keys used as arguments".into(),
        ));
        let err = redis_error(noperm, "billing");
        assert!(
            matches!(&err, Error::RedisPermission { rule, .. } if rule.contains("~billing:*")),
            "{err}"
        );
        assert!(err.to_string().contains("+evalsha +script|load"), "{err}");
        assert!(!err.is_retryable());

        let script = RedisError::from((
            ErrorKind::Server(ServerErrorKind::ResponseError),
            "ERR",
            "The user executing the script can't run this command or subcommand script: ab".into(),
        ));
        assert!(matches!(
            redis_error(script, "pgfence"),
            Error::RedisPermission { .. }
        ));

        let sentinel = RedisError::from((
            ErrorKind::Server(ServerErrorKind::NoPerm),
            SENTINEL_REFUSED,
            "NOPERM ...".into(),
        ));
        let err = redis_error(sentinel, "pgfence");
        assert!(
            matches!(&err, Error::RedisPermission { rule, .. } if rule == SENTINEL_ACL_RULE),
            "{err}"
        );

        let other = RedisError::from((ErrorKind::Io, "connection refused"));
        assert!(
            matches!(redis_error(other, "pgfence"), Error::Backend(b) if b.as_redis().is_some())
        );
    }
}

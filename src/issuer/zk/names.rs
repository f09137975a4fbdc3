//! Where a resource's lock nodes live, and what their names say: the owner id, then
//! ZooKeeper's sequence (the lowest holds the lock).

use crate::Resource;

use super::DEFAULT_KEY_PREFIX;

/// The name every lock node starts with; then the owner id and `-`, then ZooKeeper's sequence.
pub(super) const NODE_PREFIX: &str = "lock-";

/// The znode under which `resource`'s lock nodes are created, with the default key prefix:
/// `/pgfence/lock/<resource>`, the resource name with `%`, `/` and characters ZooKeeper does
/// not allow in a node name written as `%XX` (so `a/b` is `/pgfence/lock/a%2Fb`).
#[must_use]
pub fn lock_dir(resource: &Resource) -> String {
    prefixed_lock_dir(DEFAULT_KEY_PREFIX, resource)
}

pub(super) fn prefixed_lock_dir(prefix: &str, resource: &Resource) -> String {
    format!(
        "/{}/lock/{}",
        node_name(prefix),
        node_name(resource.as_str())
    )
}

/// `s` as one znode name: ASCII letters, digits and `-_.:{}@+=,!~*()'` as they are, every
/// other byte as `%XX`; a name of dots only (`.`, `..`) has its dots encoded. Injective, since
/// `%` itself is encoded.
pub(super) fn node_name(s: &str) -> String {
    use std::fmt::Write as _;
    let all_dots = s.bytes().all(|b| b == b'.');
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        let plain = b.is_ascii_alphanumeric()
            || (b"-_:{}@+=,!~*()'".contains(&b))
            || (b == b'.' && !all_dots);
        if plain {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// The sequence number at the end of a lock node's name (`None` for a foreign node).
pub(super) fn sequence_of(name: &str) -> Option<i64> {
    let (_, digits) = name.rsplit_once('-')?;
    if !name.starts_with(NODE_PREFIX) || digits.is_empty() {
        return None;
    }
    digits.parse().ok()
}

/// The lock nodes of a directory listing, lowest sequence (the holder) first.
pub(super) fn queue(mut names: Vec<String>) -> Vec<(i64, String)> {
    let mut nodes: Vec<(i64, String)> = names
        .drain(..)
        .filter_map(|n| sequence_of(&n).map(|s| (s, n)))
        .collect();
    nodes.sort_unstable();
    nodes
}

/// The name `owner`'s lock node starts with (ZooKeeper appends the sequence).
pub(super) fn owner_stem(owner: &str) -> String {
    format!("{NODE_PREFIX}{}-", node_name(owner))
}

/// Whether lock node `name` was created for `owner`.
pub(super) fn is_owners(name: &str, stem: &str) -> bool {
    name.strip_prefix(stem)
        .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()))
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_are_safe_and_injective() {
        let r = Resource::in_domain("billing", "account:2").unwrap();
        assert_eq!(lock_dir(&r), "/pgfence/lock/{billing}account:2");
        let r = Resource::new("a/b%c..d").unwrap();
        assert_eq!(lock_dir(&r), "/pgfence/lock/a%2Fb%25c..d");
        assert_eq!(node_name(".."), "%2E%2E");
        assert_eq!(node_name("."), "%2E");
        assert_eq!(node_name("é"), "%C3%A9");
        assert_ne!(node_name("a/b"), node_name("a%2Fb"));
        assert_eq!(
            prefixed_lock_dir("app/x", &Resource::new("r").unwrap()),
            "/app%2Fx/lock/r"
        );
    }

    #[test]
    fn lock_nodes_sort_by_sequence_and_belong_to_their_owner() {
        let names = vec![
            "lock-b-0000000010".to_owned(),
            "lock-a-b-0000000002".to_owned(),
            "stray".to_owned(),
            "lock-a-0000000003".to_owned(),
        ];
        let q = queue(names);
        assert_eq!(q.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [2, 3, 10]);
        let stem = owner_stem("a");
        assert!(is_owners("lock-a-0000000003", &stem));
        assert!(!is_owners("lock-a-b-0000000002", &stem));
        assert!(is_owners("lock-a-b-0000000002", &owner_stem("a-b")));
        assert!(!is_owners("lock-a-", &stem));
    }
}

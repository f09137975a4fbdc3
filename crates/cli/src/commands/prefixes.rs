//! Finding a resource under key prefixes other than the one a command uses, so that a command
//! that finds nothing can say which `--key-prefix` would (a service with key prefix `nu4`
//! records `recon:batch:14` as `nu4{recon:batch:14`, and keeps its counter at
//! `nu4:{recon:batch:14}:fence`).

use std::collections::BTreeMap;
use std::time::Duration;

use pgfence::Resource;
use pgfence::issuer::{DEFAULT_KEY_PREFIX, IssuerKind};

use crate::util::cell;

/// The key prefix a stored (PostgreSQL) resource name belongs to, and the resource as its
/// service wrote it: `nu4{recon:batch:14` → (`nu4`, `recon:batch:14`). `None` for a name that
/// is not a resource's (rows written by hand).
pub fn split_stored(name: &str) -> Option<(String, String)> {
    let named = Resource::parse_fenced(name).ok()?;
    Some((
        named.key_prefix().unwrap_or(DEFAULT_KEY_PREFIX).to_owned(),
        named.without_key_prefix().as_str().to_owned(),
    ))
}

/// Whether `resource` (as written, without a key prefix) matches an audit filter `pattern`:
/// the name, or a prefix of names with a trailing `*`.
fn matches(pattern: &str, resource: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(stem) => resource.starts_with(stem),
        None => resource == pattern,
    }
}

/// How to select a key prefix: `--key-prefix nu4 (or PGFENCE_KEY_PREFIX=nu4)`, or for the
/// default prefix, no flag.
pub fn how_to_select(prefix: &str) -> String {
    if prefix == DEFAULT_KEY_PREFIX {
        "leave out --key-prefix and PGFENCE_KEY_PREFIX (the default prefix, pgfence)".to_owned()
    } else {
        format!(
            "pass --key-prefix {p} (or set PGFENCE_KEY_PREFIX={p})",
            p = cell(prefix)
        )
    }
}

/// How many audit rows match `pattern` (a resource or `stem*`, as the user wrote it) under
/// each key prefix other than `own`, read in one statement on `conn` (rows recorded at or
/// after `since`).
pub async fn audit_rows_elsewhere(
    conn: &mut sqlx::PgConnection,
    pattern: &str,
    since: Option<time::OffsetDateTime>,
    own: &str,
) -> anyhow::Result<BTreeMap<String, i64>> {
    // Every stored form of a match contains the pattern's stem (`P{stem...`, `{P{D}...`).
    let stem = pattern.strip_suffix('*').unwrap_or(pattern);
    let stem = stem.strip_prefix('{').unwrap_or(stem);
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT resource, pg_catalog.count(*) FROM pgfence.audit
          WHERE resource IS NOT NULL
            AND pg_catalog.strpos(resource, $1) OPERATOR(pg_catalog.>) 0
            AND ($2::pg_catalog.timestamptz IS NULL OR at OPERATOR(pg_catalog.>=) $2)
          GROUP BY resource LIMIT 10000",
    )
    .bind(stem)
    .bind(since)
    .fetch_all(&mut *conn)
    .await?;
    let mut found = BTreeMap::new();
    for (name, count) in rows {
        if let Some((prefix, resource)) = split_stored(&name)
            && prefix != own
            && matches(pattern, &resource)
        {
            *found.entry(prefix).or_default() += count;
        }
    }
    Ok(found)
}

/// The key prefixes other than `own` under which the issuer at `url` has a counter for
/// `resource`, with the counter's value: for a standalone Redis, a bounded `SCAN` for
/// `*:{COUNTER}:fence`; for the PostgreSQL issuer, `pgfence.issuer_counter` (readable by its
/// owner only). Nothing for other issuers, or when the look fails (it is only a hint: the
/// `--verbose` log says why).
pub async fn counters_elsewhere(url: &str, resource: &Resource, own: &str) -> Vec<(String, i64)> {
    let look = async {
        match crate::connect::issuer_kind(url)? {
            IssuerKind::Redis if crate::connect::is_plain_redis(url) => {
                redis_counters(url, resource, own).await
            }
            IssuerKind::Postgres => pg_counters(url, resource, own).await,
            _ => Ok(Vec::new()),
        }
    };
    match tokio::time::timeout(Duration::from_secs(3), look).await {
        Ok(Ok(found)) => found,
        Ok(Err(e)) => {
            tracing::info!(target: "pgfence::cli", "other key prefixes not looked at: {e:#}");
            Vec::new()
        }
        Err(_) => {
            tracing::info!(target: "pgfence::cli", "other key prefixes not looked at: timed out");
            Vec::new()
        }
    }
}

/// Redis: the keys `PREFIX:{COUNTER}:fence` for any prefix but `own` (at most 100,000 keys
/// scanned).
async fn redis_counters(
    url: &str,
    resource: &Resource,
    own: &str,
) -> anyhow::Result<Vec<(String, i64)>> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    // The key's form, from the library: `PREFIX:{COUNTER}:fence`.
    let key = pgfence::issuer::redis::counter_key(resource);
    let suffix = &key[DEFAULT_KEY_PREFIX.len()..];
    let mut pattern = String::from("*");
    for c in suffix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            pattern.push('\\');
        }
        pattern.push(c);
    }
    let mut keys = Vec::new();
    let mut cursor: u64 = 0;
    for _ in 0..100 {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await?;
        keys.extend(batch);
        cursor = next;
        if cursor == 0 {
            break;
        }
    }
    let mut found = Vec::new();
    for key in keys {
        let Some(prefix) = key.strip_suffix(suffix) else {
            continue;
        };
        if prefix == own || pgfence::issuer::limits::check_key_prefix(prefix).is_err() {
            continue;
        }
        let value: Option<i64> = redis::cmd("GET").arg(&key).query_async(&mut conn).await?;
        found.push((prefix.to_owned(), value.unwrap_or(0)));
    }
    found.sort();
    Ok(found)
}

/// The PostgreSQL issuer: its counter rows of other prefixes.
async fn pg_counters(
    url: &str,
    resource: &Resource,
    own: &str,
) -> anyhow::Result<Vec<(String, i64)>> {
    let pool = crate::connect::connect_pg_with(url, 1).await?;
    let mut session = crate::connect::Session::begin(&pool).await?;
    let found: Vec<(String, i64)> = sqlx::query_as(
        "SELECT prefix, value FROM pgfence.issuer_counter
          WHERE counter OPERATOR(pg_catalog.=) $1 AND prefix OPERATOR(pg_catalog.<>) $2
          ORDER BY 1",
    )
    .bind(resource.counter_id())
    .bind(own)
    .fetch_all(session.conn())
    .await?;
    session.commit().await?;
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_names_split_into_prefix_and_resource() {
        assert_eq!(
            split_stored("nu4{recon:batch:14"),
            Some(("nu4".into(), "recon:batch:14".into()))
        );
        assert_eq!(
            split_stored("{nu4{billing}account:7"),
            Some(("nu4".into(), "{billing}account:7".into()))
        );
        assert_eq!(
            split_stored("recon:batch:14"),
            Some(("pgfence".into(), "recon:batch:14".into()))
        );
        assert!(matches("recon:batch:*", "recon:batch:14"));
        assert!(!matches("recon:batch:1", "recon:batch:14"));
    }
}

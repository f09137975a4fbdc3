//! The issuer's counters against PostgreSQL's high-water marks.

use sqlx::PgConnection;

use futures_util::StreamExt;

use super::{
    DoctorOptions, Finding, FindingKind, STATUS_READS_IN_FLIGHT, Severity, may, not_permitted,
};
use crate::issuer::IssuerKind;
use crate::token::{MAX_TOKEN, StoredFence};
use crate::{Resource, Result, TokenIssuer};

/// Counter checks.
pub(super) async fn counters(
    pool: &mut PgConnection,
    issuer: Option<&dyn TokenIssuer>,
    options: &DoctorOptions,
    highest: &[(String, i64)],
    findings: &mut Vec<Finding>,
) -> Result<()> {
    let limit = MAX_TOKEN.saturating_sub(options.limit_margin);
    let marks = marks(pool, limit, findings).await?;
    let checks = checks(pool, issuer, options, marks, findings).await?;
    let Some(issuer) = issuer else {
        if !checks.is_empty() {
            findings.push(
                Finding::new(Severity::Info, FindingKind::CountersNotChecked, "redis")
                    .says(format!(
                        "{} resource counter(s) not compared: no Redis given",
                        checks.len()
                    ))
                    .fix("pass a Redis URL (--redis-url / REDIS_URL)"),
            );
        }
        return Ok(());
    };
    if let Some(top) = compare(issuer, &checks, limit, findings).await {
        above_counters(top, highest, findings);
    }
    state(issuer, findings).await;
    Ok(())
}

/// What the issuer keeps per resource ([`TokenIssuer::state`]), as an info finding.
async fn state(issuer: &dyn TokenIssuer, findings: &mut Vec<Finding>) {
    let kind = issuer.kind();
    let object = format!(
        "{} issuer (key prefix {})",
        kind.name(),
        issuer.key_prefix()
    );
    let expiry = match issuer.idle_expiry() {
        Some(idle) => format!("idle expiry {idle:?}"),
        None => "idle expiry off: counters are kept for ever".to_owned(),
    };
    let finding = match issuer.state().await {
        Ok(Some(s)) => {
            let expiring = s
                .expiring
                .map_or_else(String::new, |n| format!(", {n} of them expiring"));
            let floors = if s.floors > 0 {
                format!(", {} floor(s) of expired counters", s.floors)
            } else {
                String::new()
            };
            let other = if s.other > 0 {
                format!(", {} other key(s)", s.other)
            } else {
                String::new()
            };
            Finding::new(Severity::Info, FindingKind::IssuerState, &object).says(format!(
                "{} counter(s), {} of them idle (no lease holds their resource){expiring}; {} lock record(s){other}{floors}; {expiry}",
                s.counters, s.idle, s.locks
            ))
        }
        Ok(None) => {
            let why = match kind {
                IssuerKind::Redis => {
                    "a Redis Cluster is not scanned (one connection reaches one node's keys)"
                }
                _ => "this issuer does not count its state",
            };
            Finding::new(Severity::Info, FindingKind::IssuerState, &object)
                .says(format!("not counted: {why}; {expiry}"))
        }
        Err(e) => Finding::new(Severity::Info, FindingKind::IssuerState, &object)
            .says(format!("could not count the issuer's state: {e}")),
    };
    findings.push(finding);
}

/// The resources' high-water marks (token), each checked against the limit.
async fn marks(
    pool: &mut PgConnection,
    limit: i64,
    findings: &mut Vec<Finding>,
) -> Result<Vec<(String, i64)>> {
    let marks: Vec<(String, i64)> = if may(pool, "resource_fence", "SELECT").await? {
        sqlx::query_as::<_, (String, i64)>(
            "SELECT resource, fence FROM pgfence.resource_fence ORDER BY 1",
        )
        .fetch_all(&mut *pool)
        .await?
        .into_iter()
        .map(|(resource, fence)| (resource, StoredFence::from_raw(fence).token()))
        .collect()
    } else {
        findings.push(not_permitted(
            "pgfence.resource_fence",
            "the recorded resources' marks and counters were",
            "SELECT on pgfence.resource_fence (the resources given with --resource are still checked)",
        ));
        Vec::new()
    };
    for (resource, mark) in &marks {
        if *mark > limit {
            findings.push(
                Finding::new(
                    Severity::Error,
                    FindingKind::FenceNearLimit,
                    format!("resource {resource}"),
                )
                .says(format!(
                    "its high-water mark is token {mark}, within {} of the largest token: no issuer's counter gets there, so every real lease of it is refused (a forged or corrupted check; a resource's first token is not bounded by pgfence.max_token_jump())",
                    MAX_TOKEN - mark
                ))
                .fix(format!(
                    "as the schema's owner: SELECT pgfence.unpoison_resource('{}', N); with N the highest token the issuer handed out",
                    resource.replace('\'', "''")
                )),
            );
        }
    }
    Ok(marks)
}

/// The resources whose counters are compared: every recorded mark that names a valid resource,
/// and the resources given to doctor (their mark read under the issuer's key prefix).
async fn checks(
    pool: &mut PgConnection,
    issuer: Option<&dyn TokenIssuer>,
    options: &DoctorOptions,
    marks: Vec<(String, i64)>,
    findings: &mut Vec<Finding>,
) -> Result<Vec<(Resource, i64)>> {
    let mut checks: Vec<(Resource, i64)> = Vec::new();
    let mut invalid = Vec::new();
    // Marks are recorded under their key prefix's name (`Resource::in_key_prefix`; the
    // default prefix's are plain resource names).
    for (name, mark) in marks {
        match Resource::parse_fenced(&name) {
            Ok(r) => checks.push((r, mark)),
            Err(_) => invalid.push(name),
        }
    }
    for resource in &options.resources {
        let named = match issuer {
            Some(issuer) => issuer.fencing_resource(resource)?,
            None => resource.clone(),
        };
        if !checks.iter().any(|(r, _)| *r == named) {
            let mark = crate::admin::high_water(&mut *pool, &named).await?;
            checks.push((named, mark));
        }
    }
    let own_prefix = issuer.map_or(crate::issuer::DEFAULT_KEY_PREFIX, |i| i.key_prefix());
    other_prefix_marks(own_prefix, &options.resources, &checks, findings);
    if !invalid.is_empty() {
        findings.push(
            Finding::new(Severity::Info, FindingKind::CountersNotChecked, "pgfence.resource_fence")
                .says(format!(
                    "{} recorded resource name(s) are not valid resource names; their counters were not checked",
                    invalid.len()
                )),
        );
    }
    Ok(checks)
}

/// Reads the issuer's counter of every resource of its key prefix and compares it with the
/// mark; returns the highest counter read (none when nothing was read).
async fn compare(
    issuer: &dyn TokenIssuer,
    checks: &[(Resource, i64)],
    limit: i64,
    findings: &mut Vec<Finding>,
) -> Option<i64> {
    let mut top_counter: Option<i64> = None;
    let mut other_prefixes = std::collections::BTreeMap::<&str, usize>::new();
    let mut compared: Vec<(&Resource, Resource, i64)> = Vec::with_capacity(checks.len());
    for (named, mark) in checks {
        // Only this issuer's key prefix's marks are compared with its counters.
        let prefix = named
            .key_prefix()
            .unwrap_or(crate::issuer::DEFAULT_KEY_PREFIX);
        if prefix == issuer.key_prefix() {
            compared.push((named, named.without_key_prefix(), *mark));
        } else {
            *other_prefixes.entry(prefix).or_default() += 1;
        }
    }
    // Counters are read STATUS_READS_IN_FLIGHT at a time, in order: one request after
    // another cost a round trip per resource (153 s for a million resources on loopback
    // Redis, BENCHMARKS.md 12h); each read keeps its own call bound.
    let kind = issuer.kind();
    let mut statuses = futures_util::stream::iter(compared.iter())
        .map(|(_, resource, _)| issuer.status(resource))
        .buffered(STATUS_READS_IN_FLIGHT);
    let mut compared = compared.iter();
    while let Some(status) = statuses.next().await {
        let Some((named, resource, mark)) = compared.next() else {
            break;
        };
        let status = match status {
            Ok(s) => s,
            Err(e) => {
                findings.push(
                    Finding::new(Severity::Error, FindingKind::RedisUnavailable, kind.name())
                        .says(format!("cannot read the {kind} issuer's counters: {e}"))
                        .fix(format!(
                            "check the issuer URL and that {} is up; then run doctor again",
                            store(kind)
                        )),
                );
                return None;
            }
        };
        let counter = status.counter;
        top_counter = Some(top_counter.map_or(counter, |t| t.max(counter)));
        let object = match named.key_prefix() {
            Some(prefix) => format!("resource {resource} (key prefix {prefix})"),
            None => format!("resource {resource}"),
        };
        if counter == 0 && *mark > 0 && issuer.idle_expiry().is_some() {
            findings.push(
                Finding::new(Severity::Info, FindingKind::CounterExpired, &object)
                    .says(format!(
                        "no {} counter (Postgres's high-water mark is {mark}): it expired idle, and the next lease's token is created above the mark (the PostgreSQL issuer, or Redis with a floor source; without one the first check is refused and `recover_from` heals it)",
                        store(kind)
                    )),
            );
        } else if counter < *mark {
            findings.push(
                Finding::new(Severity::Error, FindingKind::CounterBelowMark, &object)
                    .says(format!(
                        "the {} counter ({counter}) is below Postgres's high-water mark ({mark}): it went backwards (failover or restart), and new leases get tokens Postgres rejects",
                        store(kind)
                    ))
                    .fix(format!("run `pgfence reseed '{resource}'`")),
            );
        }
        if counter > limit {
            findings.push(
                Finding::new(Severity::Warning, FindingKind::FenceNearLimit, &object)
                    .says(format!(
                        "the {} counter ({counter}) is within {} of the largest token ({MAX_TOKEN})",
                        store(kind),
                        MAX_TOKEN - counter
                    )),
            );
        }
    }
    if !other_prefixes.is_empty() {
        let counts: Vec<String> = other_prefixes
            .iter()
            .map(|(prefix, n)| format!("{n} under key prefix {prefix}"))
            .collect();
        let runs: Vec<String> = other_prefixes
            .keys()
            .map(|prefix| format!("`pgfence doctor --key-prefix {prefix}`"))
            .collect();
        findings.push(
            Finding::new(Severity::Info, FindingKind::CountersNotChecked, "pgfence.resource_fence")
                .says(format!(
                    "resource marks of other key prefixes than the issuer's ({}) were not compared with counters: {}",
                    issuer.key_prefix(),
                    counts.join(", ")
                ))
                .fix(format!("run {} (or set PGFENCE_KEY_PREFIX)", runs.join(", "))),
        );
    }
    top_counter
}

/// Tables whose highest token is above every counter read.
fn above_counters(top: i64, highest: &[(String, i64)], findings: &mut Vec<Finding>) {
    for (table, token) in highest {
        if *token > top {
            findings.push(
                Finding::new(Severity::Warning, FindingKind::TokenAboveCounters, table)
                    .says(format!(
                        "its highest token ({token}) is above every counter doctor read (highest {top}): a counter went backwards, or the table is written by a resource doctor was not told about"
                    ))
                    .fix(format!(
                        "name the table's resources with --resource; if a counter went backwards, `pgfence reseed RESOURCE --floor {token}`"
                    )),
            );
        }
    }
}

/// Resources given to doctor that have no mark under the key prefix in use (`prefix`) but do
/// under another: the service's leases likely use that prefix; say which to pass.
pub(super) fn other_prefix_marks(
    prefix: &str,
    asked: &[Resource],
    checks: &[(Resource, i64)],
    findings: &mut Vec<Finding>,
) {
    let prefix_of = |r: &Resource| {
        r.key_prefix()
            .unwrap_or(crate::issuer::DEFAULT_KEY_PREFIX)
            .to_owned()
    };
    for resource in asked {
        let plain = resource.without_key_prefix();
        let own = checks.iter().any(|(r, mark)| {
            *mark > 0 && prefix_of(r) == prefix && r.without_key_prefix() == plain
        });
        if own {
            continue;
        }
        let others: Vec<String> = checks
            .iter()
            .filter(|(r, mark)| {
                *mark > 0 && prefix_of(r) != prefix && r.without_key_prefix() == plain
            })
            .map(|(r, mark)| format!("key prefix {} (token {mark})", prefix_of(r)))
            .collect();
        if others.is_empty() {
            continue;
        }
        let first = checks
            .iter()
            .find(|(r, mark)| {
                *mark > 0 && prefix_of(r) != prefix && r.without_key_prefix() == plain
            })
            .map(|(r, _)| prefix_of(r))
            .unwrap_or_default();
        findings.push(
            Finding::new(
                Severity::Info,
                FindingKind::CountersNotChecked,
                format!("resource {plain}"),
            )
            .says(format!(
                "no high-water mark under key prefix {prefix}, but one under {}: the service's leases use that key prefix",
                others.join(", ")
            ))
            .fix(format!(
                "run `pgfence doctor --key-prefix {first} --resource '{plain}'` (or set PGFENCE_KEY_PREFIX={first})"
            )),
        );
    }
}

/// Where an issuer keeps its counter, as a finding names it.
fn store(kind: IssuerKind) -> &'static str {
    match kind {
        IssuerKind::Redis => "Redis",
        IssuerKind::Etcd => "etcd",
        IssuerKind::ZooKeeper => "ZooKeeper",
        IssuerKind::Postgres => "PostgreSQL issuer's",
    }
}

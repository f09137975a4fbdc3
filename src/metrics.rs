//! Metrics through the [`metrics`](https://docs.rs/metrics) facade, behind the `metrics`
//! cargo feature: without it every function here is empty and nothing is linked. pgfence
//! records; the application installs a recorder (for example the Prometheus exporter).
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `pgfence_rejections_total` | counter | `operation`, `table`, `kind`, `domain` | rejected writes and checks ([`rejection_kind`], [`domain_label`]) |
//! | `pgfence_audit_failures_total` | counter | `operation` | rejections whose audit row could not be written |
//! | `pgfence_acquisitions_total` | counter | `result` (`acquired`, `busy`, `error`) | lock acquisition attempts |
//! | `pgfence_lease_lost_total` | counter | | leases a keep-alive reported lost |
//! | `pgfence_counter_reseeds_total` | counter | | Redis counters found missing (expired idle, or lost) and re-created above PostgreSQL's high-water mark (the floor source) |
//! | `pgfence_idle_state_expired_total` | counter | `state` (`counter`, `lock`) | PostgreSQL issuer rows `PgIssuer::expire_idle` deleted |
//! | `pgfence_write_seconds` | histogram | `operation` | fenced write latency (`update`, `upsert`, `delete`, `claim`, `*_many`) |
//! | `pgfence_acquire_seconds` | histogram | | acquisition latency (one attempt) |
//!
//! Every label is bounded: operations, tables and kinds are fixed sets, and a resource is
//! counted under its domain only, never its name (names carry ids: one series per batch or
//! account would grow without end). The exact resource of a rejection is in the audit trail
//! and the WARN event.

#[cfg(feature = "metrics")]
use std::time::Instant;

use crate::audit::Rejection;

/// A rejected write or check: `pgfence_rejections_total{operation, table, kind, domain}`.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn rejection(r: &Rejection) {
    #[cfg(feature = "metrics")]
    ::metrics::counter!(
        "pgfence_rejections_total",
        "operation" => r.operation,
        "table" => r.table.clone().unwrap_or_default(),
        "kind" => rejection_kind(r),
        "domain" => domain_label(r.resource.as_deref()),
    )
    .increment(1);
}

/// The `kind` label of a rejection: its [`RejectionKind`](crate::audit::RejectionKind)
/// (`stale`, `duplicate`, `sealed`, `token_jump`, `failover`), with a stale rejection by a
/// newer token from another counter (another resource or fencing domain) as `other_counter`:
/// resources writing the same rows belong in one domain.
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub(crate) fn rejection_kind(r: &Rejection) -> &'static str {
    match r.kind {
        crate::audit::RejectionKind::Stale if r.other_counter => "other_counter",
        kind => kind.as_str(),
    }
}

/// The `domain` label of a resource: its fencing domain (`{billing}account:7` → `billing`),
/// else the part of its name before the first `:` (`payments:batch:42` → `payments`), else
/// empty (a name without `:` may be an id). A key prefix's name counts as its resource's
/// (`nu4{recon:batch:14` → `recon`). At most 64 bytes.
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub(crate) fn domain_label(resource: Option<&str>) -> String {
    let Some(name) = resource else {
        return String::new();
    };
    let named = crate::Resource::parse_fenced(name).map(|r| r.without_key_prefix());
    let domain = match &named {
        Ok(r) => match r.domain() {
            Some(domain) => domain,
            None => r.as_str().split_once(':').map_or("", |(d, _)| d),
        },
        Err(_) => "",
    };
    let mut end = domain.len().min(64);
    while !domain.is_char_boundary(end) {
        end -= 1;
    }
    domain[..end].to_owned()
}

/// A rejection whose audit row is missing.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn audit_failure(operation: &'static str) {
    #[cfg(feature = "metrics")]
    ::metrics::counter!("pgfence_audit_failures_total", "operation" => operation).increment(1);
}

/// One acquisition attempt's result: `acquired`, `busy` or `error`.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn acquisition(result: &'static str) {
    #[cfg(feature = "metrics")]
    ::metrics::counter!("pgfence_acquisitions_total", "result" => result).increment(1);
}

/// A lease a keep-alive reported lost.
pub(crate) fn lease_lost() {
    #[cfg(feature = "metrics")]
    ::metrics::counter!("pgfence_lease_lost_total").increment(1);
}

/// A Redis counter re-created above the floor source's mark.
pub(crate) fn counter_reseeded() {
    #[cfg(feature = "metrics")]
    ::metrics::counter!("pgfence_counter_reseeds_total").increment(1);
}

/// Idle PostgreSQL issuer state deleted: `counters` counter rows, `locks` lock rows.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn idle_state_expired(counters: u64, locks: u64) {
    #[cfg(feature = "metrics")]
    {
        ::metrics::counter!("pgfence_idle_state_expired_total", "state" => "counter")
            .increment(counters);
        ::metrics::counter!("pgfence_idle_state_expired_total", "state" => "lock").increment(locks);
    }
}

/// Times an operation; records its latency when dropped.
pub(crate) struct Timer {
    #[cfg(feature = "metrics")]
    start: Instant,
    #[cfg(feature = "metrics")]
    name: &'static str,
    #[cfg(feature = "metrics")]
    operation: Option<&'static str>,
}

impl Timer {
    /// Times a fenced write (`pgfence_write_seconds{operation}`).
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn write(operation: &'static str) -> Self {
        Self {
            #[cfg(feature = "metrics")]
            start: Instant::now(),
            #[cfg(feature = "metrics")]
            name: "pgfence_write_seconds",
            #[cfg(feature = "metrics")]
            operation: Some(operation),
        }
    }

    /// Times an acquisition attempt (`pgfence_acquire_seconds`).
    pub(crate) fn acquire() -> Self {
        Self {
            #[cfg(feature = "metrics")]
            start: Instant::now(),
            #[cfg(feature = "metrics")]
            name: "pgfence_acquire_seconds",
            #[cfg(feature = "metrics")]
            operation: None,
        }
    }
}

#[cfg(feature = "metrics")]
impl Drop for Timer {
    fn drop(&mut self) {
        let seconds = self.start.elapsed().as_secs_f64();
        match self.operation {
            Some(op) => ::metrics::histogram!(self.name, "operation" => op).record(seconds),
            None => ::metrics::histogram!(self.name).record(seconds),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn domains_are_bounded() {
        for (name, domain) in [
            (Some("payments:batch:42"), "payments"),
            (Some("{billing}account:7"), "billing"),
            (Some("nu4{recon:batch:14"), "recon"),
            (Some("{nu4{billing}account:7"), "billing"),
            (Some("job-7d1c"), ""),
            (None, ""),
        ] {
            assert_eq!(domain_label(name), domain, "{name:?}");
        }
    }
}

//! Metrics through the [`metrics`](https://docs.rs/metrics) facade, behind the `metrics`
//! cargo feature: without it every function here is empty and nothing is linked. pgfence
//! records; the application installs a recorder (for example the Prometheus exporter).
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `pgfence_rejections_total` | counter | `table`, `resource`, `operation` | rejected writes and checks (stale or duplicate token) |
//! | `pgfence_audit_failures_total` | counter | `operation` | rejections whose audit row could not be written |
//! | `pgfence_acquisitions_total` | counter | `result` (`acquired`, `busy`, `error`) | lock acquisition attempts |
//! | `pgfence_lease_lost_total` | counter | | leases a keep-alive reported lost |
//! | `pgfence_write_seconds` | histogram | `operation` | fenced write latency (`update`, `upsert`, `delete`, `claim`, `*_many`) |
//! | `pgfence_acquire_seconds` | histogram | | acquisition latency (one attempt) |

#[cfg(feature = "metrics")]
use std::time::Instant;

/// A rejected write or check.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn rejection(table: Option<&str>, resource: Option<&str>, operation: &'static str) {
    #[cfg(feature = "metrics")]
    ::metrics::counter!(
        "pgfence_rejections_total",
        "table" => table.unwrap_or("").to_owned(),
        "resource" => resource.unwrap_or("").to_owned(),
        "operation" => operation,
    )
    .increment(1);
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

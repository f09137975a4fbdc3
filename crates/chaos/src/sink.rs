//! Counting what pgfence reports about rejections, through its typed audit hook.

use std::collections::HashMap;
use std::sync::Mutex;

use pgfence::audit::{AuditEvent, AuditSink};
use serde::Serialize;

use crate::util::lock;

/// Audit events for one run (or any resource prefix), as counted by an [`AuditCounter`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct AuditTally {
    /// Rejections reported (one per stale write or check; each is also a `pgfence::audit`
    /// WARN log event).
    pub rejections: u64,
    /// Rejections whose audit row could not be written (each is also a `pgfence::audit`
    /// ERROR log event).
    pub audit_failures: u64,
}

/// An [`AuditSink`] that counts rejections and audit failures per resource.
///
/// The [`Harness`](crate::Harness) registers one on the auditor its fence and repository
/// share, so every rejection of the run is counted; read it with [`AuditCounter::tally`] and
/// the run's [`resource_prefix`](crate::Harness::resource_prefix). Rejections that name no
/// resource are counted under the empty name.
#[derive(Debug, Default)]
pub struct AuditCounter(Mutex<HashMap<String, AuditTally>>);

impl AuditCounter {
    /// A counter with nothing counted.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Events so far for resources whose name starts with `resource_prefix`.
    #[must_use]
    pub fn tally(&self, resource_prefix: &str) -> AuditTally {
        lock(&self.0)
            .iter()
            .filter(|(resource, _)| resource.starts_with(resource_prefix))
            .fold(AuditTally::default(), |total, (_, t)| AuditTally {
                rejections: total.rejections + t.rejections,
                audit_failures: total.audit_failures + t.audit_failures,
            })
    }

    fn bump(&self, resource: Option<&str>, bump: impl FnOnce(&mut AuditTally)) {
        let mut map = lock(&self.0);
        let resource = resource.unwrap_or_default();
        match map.get_mut(resource) {
            Some(tally) => bump(tally),
            None => bump(map.entry(resource.to_owned()).or_default()),
        }
    }
}

impl AuditSink for AuditCounter {
    fn event(&self, event: AuditEvent<'_>) {
        match event {
            AuditEvent::Rejected(rejection) => {
                self.bump(rejection.resource.as_deref(), |t| t.rejections += 1);
            }
            AuditEvent::AuditFailed { rejection, .. } => {
                self.bump(rejection.resource.as_deref(), |t| t.audit_failures += 1);
            }
            _ => {}
        }
    }
}

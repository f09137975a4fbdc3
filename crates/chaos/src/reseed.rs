//! Counting the issuer's automatic reseeds (counter loss repaired from the floor source).
//!
//! pgfence reports a reseed only as a `tracing` INFO event (fields `resource`, `lost_token`,
//! `high_water`, `token`); it has no typed hook for it as it has for rejections
//! ([`pgfence::audit::AuditSink`]). So this one figure still needs a `tracing` layer, which the
//! caller installs (the harness installs no subscriber of its own): without one, a run
//! reports `reseed_events` as `null`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt as _};

use crate::ChaosError;
use crate::util::lock;

/// The field that tells the issuer's reseed event from its other events.
const RESEED_FIELD: &str = "lost_token";

/// Counts the issuer's reseed events per resource. Feed it with [`ReseedCounter::layer`] (or
/// [`ReseedCounter::install_global`]) and pass it to
/// [`Harness::with_reseed_counter`](crate::Harness::with_reseed_counter).
#[derive(Debug, Default)]
pub struct ReseedCounter(Mutex<HashMap<String, u64>>);

impl ReseedCounter {
    /// Reseeds so far of resources whose name starts with `resource_prefix`.
    #[must_use]
    pub fn count(&self, resource_prefix: &str) -> u64 {
        lock(&self.0)
            .iter()
            .filter(|(resource, _)| resource.starts_with(resource_prefix))
            .map(|(_, n)| n)
            .sum()
    }

    /// A `tracing_subscriber` layer that feeds this counter.
    #[must_use]
    pub fn layer(self: &Arc<Self>) -> ReseedLayer {
        ReseedLayer(self.clone())
    }

    /// Installs a global subscriber made of this counter's layer alone, once per process, and
    /// returns the counter (the same one on every call).
    ///
    /// # Errors
    /// [`ChaosError::Subscriber`] when another global subscriber was installed first (then add
    /// [`ReseedCounter::layer`] to that one instead).
    pub fn install_global() -> Result<Arc<Self>, ChaosError> {
        static GLOBAL: OnceLock<Result<Arc<ReseedCounter>, String>> = OnceLock::new();
        GLOBAL
            .get_or_init(|| {
                let counter = Arc::new(ReseedCounter::default());
                let subscriber = tracing_subscriber::registry().with(counter.layer());
                tracing::subscriber::set_global_default(subscriber)
                    .map(|()| counter)
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(ChaosError::Subscriber)
    }
}

/// The layer half of a [`ReseedCounter`].
#[derive(Debug)]
pub struct ReseedLayer(Arc<ReseedCounter>);

fn is_reseed(meta: &Metadata<'_>) -> bool {
    meta.is_event()
        && *meta.level() == Level::INFO
        && meta.target().starts_with("pgfence")
        && meta.fields().field(RESEED_FIELD).is_some()
}

/// Picks the `resource` field out of an event.
#[derive(Default)]
struct ResourceField(Option<String>);

impl tracing::field::Visit for ResourceField {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "resource" {
            self.0 = Some(value.to_owned());
        }
    }
    fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
}

impl<S: Subscriber> Layer<S> for ReseedLayer {
    fn register_callsite(&self, meta: &'static Metadata<'static>) -> Interest {
        if is_reseed(meta) {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, meta: &Metadata<'_>, _: Context<'_, S>) -> bool {
        is_reseed(meta)
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        if !is_reseed(event.metadata()) {
            return;
        }
        let mut field = ResourceField::default();
        event.record(&mut field);
        *lock(&(self.0).0)
            .entry(field.0.unwrap_or_default())
            .or_default() += 1;
    }
}

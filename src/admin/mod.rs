//! Deploy-time and operator calls: the schema ([`migrate`], [`migration_status`]), a
//! role's least privileges ([`grant`]), the health check ([`doctor`],
//! [`acknowledge_failover`]) and the numbers a lock service's counter must stay above
//! ([`high_water`], [`counter_floor`]). Guarding tables is [`guard`](crate::guard);
//! reading the audit trail is [`audit`](crate::audit).

pub(crate) mod doctor;
pub(crate) mod grant;
pub(crate) mod marks;
pub(crate) mod migrate;

pub use doctor::{
    DEFAULT_LIMIT_MARGIN, DoctorOptions, Finding, FindingKind, Severity, acknowledge_failover,
    doctor,
};
pub use grant::{bound_idle_transactions, grant, grant_sql};
pub use marks::{counter_floor, high_water};
pub use migrate::{MigrationInfo, migrate, migration_status};

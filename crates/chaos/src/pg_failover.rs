//! A failover of the harness's own PostgreSQL ([`pg_failover_at`]): the database runs as a
//! primary and an asynchronous standby behind a stable address
//! ([`PgReplicaSet`](pgfence_testkit::PgReplicaSet)); the standby is cut off, the workers go on
//! writing (acknowledged commits the standby never gets), then the primary is killed and the
//! standby promoted behind the same address. The workers reconnect through it; the units the
//! outage caught retry with their leases from before it ([`Config::outage_retry`]).
//!
//! [`Config::outage_retry`]: crate::Config::outage_retry

use std::time::Duration;

use pgfence_testkit::{PgReplicaSet, Replication};

use crate::verify::PG_FAILOVER;
use crate::{ChaosError, Control, PgFailoverEvent};

/// Fails the harness's database over once `at_unit` units have started:
///
/// 1. cuts the standby off ([`PgReplicaSet::cut_off_standby`]);
/// 2. lets the workers write for `write_for` (every commit acknowledged from here on is lost
///    by the promotion);
/// 3. kills the primary (`SIGKILL` of its processes) and promotes the standby behind the
///    stable address ([`PgReplicaSet::fail_over`]), then marks the fault `pg_failover` (recovery
///    is measured from the promotion) and records a [`PgFailoverEvent`].
///
/// The run's verification waits until this is done ([`Control::hold`]). Returns `None` when
/// the run ended before `at_unit`, or before the kill (the standby then stays cut off, nothing
/// is recorded).
///
/// # Errors
/// [`ChaosError::Config`] when `set` is not an asynchronous replica set that can still fail
/// over (a synchronous standby cut off would stall every commit: nothing would be lost);
/// [`ChaosError::Server`] when cutting off, killing or promoting fails.
pub async fn pg_failover_at(
    set: &mut PgReplicaSet,
    ctl: &Control,
    at_unit: u64,
    write_for: Duration,
) -> Result<Option<PgFailoverEvent>, ChaosError> {
    if set.replication() != Replication::Async || set.standby_port().is_none() {
        return Err(ChaosError::Config(
            "a database failover needs a replica set with an asynchronous standby that has not \
             been promoted yet"
                .into(),
        ));
    }
    if !ctl.wait_for_units(at_unit).await {
        return Ok(None);
    }
    let _hold = ctl.hold();
    let cut_off_at_unit = ctl.units_started();
    set.cut_off_standby().await?;
    let cut_off_at_ms = ctl.now_ms();
    tokio::time::sleep(write_for).await;
    if ctl.is_done() {
        return Ok(None);
    }
    let kill_at_ms = ctl.now_ms();
    let failover = set.fail_over().await?;
    ctl.mark_fault(PG_FAILOVER);
    let event = PgFailoverEvent {
        cut_off_at_ms,
        cut_off_at_unit,
        kill_at_ms,
        dead_at_ms: kill_at_ms + crate::util::millis(failover.kill),
        promoted_at_ms: ctl.now_ms(),
        failover_ms: crate::util::millis(failover.took),
        old_timeline: failover.old_timeline,
        new_timeline: failover.new_timeline,
    };
    ctl.record_pg_failover(event.clone());
    Ok(Some(event))
}

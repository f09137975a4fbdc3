//! The faults the harness injects by itself: counter loss and killed backends. (Stalls are
//! injected by the workers; server restarts and issuer failovers by the caller, through a
//! [`Control`](crate::Control).)

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::PgPool;

use crate::FaultMark;
use crate::harness::{Ctx, Shared};
use crate::util::{lock, millis};

/// Deletes every row's counter (a failover that lost them). Lock keys are left alone: holders
/// keep their leases, only the numbering restarts. The fault is recorded if the `DEL` went
/// through. Redis only: without the connection (which [`Harness::new`](crate::Harness::new)
/// opens only for a Redis run that resets), nothing happens.
pub(crate) async fn reset_counters(ctx: &Ctx) {
    let Some(conn) = &ctx.redis else {
        return;
    };
    let keys: Vec<String> = ctx.resources.iter().map(pgfence::counter_key).collect();
    let mut conn = conn.clone();
    let mark = FaultMark {
        name: "counter_reset".into(),
        at_ms: ctx.shared.now_ms(),
        at_unit: ctx.shared.units.load(Ordering::SeqCst),
    };
    let deleted: redis::RedisResult<i64> =
        redis::cmd("DEL").arg(&keys).query_async(&mut conn).await;
    if deleted.is_ok() {
        lock(&ctx.shared.faults).push(mark);
    }
}

/// Terminates one busy worker backend (application name `app`) about every `every` until the
/// run ends. Returns how many were terminated.
pub(crate) async fn kill_backends(
    admin: PgPool,
    app: String,
    shared: Arc<Shared>,
    every: Duration,
    seed: u64,
) -> u64 {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6b69_6c6c);
    let mut kills = 0u64;
    let base = millis(every).max(1);
    while !shared.done.load(Ordering::SeqCst) {
        let nap = rng.random_range(base / 2..=base + base / 2);
        tokio::time::sleep(Duration::from_millis(nap.max(1))).await;
        if shared.done.load(Ordering::SeqCst) {
            break;
        }
        let killed: Result<i64, sqlx::Error> = sqlx::query_scalar(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) AS gone \
               FROM pg_stat_activity \
              WHERE application_name = $1 AND pid <> pg_backend_pid() \
                AND state IN ('active', 'idle in transaction') \
              ORDER BY random() LIMIT 1) k WHERE gone",
        )
        .bind(&app)
        .fetch_one(&admin)
        .await;
        if let Ok(n) = killed {
            kills += u64::try_from(n).unwrap_or(0);
        }
    }
    kills
}

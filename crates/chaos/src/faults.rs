//! The faults the harness injects by itself: counter loss and killed backends (the workers',
//! and with the PostgreSQL issuer the issuer's). (Stalls are injected by the workers; server
//! restarts and issuer failovers by the caller, through a [`Control`](crate::Control).)

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
    let keys: Vec<String> = ctx
        .resources
        .iter()
        .map(pgfence::issuer::redis::counter_key)
        .collect();
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

/// Backends [`kill_backends`] terminated.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Kills {
    /// Worker backends (busy: running a statement or inside a transaction).
    pub(crate) workers: u64,
    /// The PostgreSQL issuer's backends.
    pub(crate) issuer: u64,
    /// ... of which were running a statement (an acquire or release, which lost its reply).
    pub(crate) issuer_mid_statement: u64,
}

/// One busy worker backend (application name `$1`), at random.
const KILL_WORKER_SQL: &str = "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) AS gone \
       FROM pg_stat_activity \
      WHERE application_name = $1 AND pid <> pg_backend_pid() \
        AND state IN ('active', 'idle in transaction') \
      ORDER BY random() LIMIT 1) k WHERE gone";

/// One backend of the PostgreSQL issuer's pool (application name `$1`): one running a
/// statement if there is one (an acquire or release then loses its reply and is re-sent with
/// the same owner id), else an idle one (the pool finds it dead and reconnects).
/// Returns how many were terminated, and how many of those were running a statement.
const KILL_ISSUER_SQL: &str = "SELECT count(*) FILTER (WHERE gone), \
            count(*) FILTER (WHERE gone AND active) \
       FROM (SELECT pg_terminate_backend(pid) AS gone, state = 'active' AS active \
               FROM pg_stat_activity \
              WHERE application_name = $1 AND pid <> pg_backend_pid() \
              ORDER BY state = 'active' DESC, random() LIMIT 1) k";

/// Terminates one busy worker backend (application name `app`) about every `every` until the
/// run ends, and with `issuer_app` (the PostgreSQL issuer's application name) one of the
/// issuer's backends each time too. Returns how many of each were terminated.
pub(crate) async fn kill_backends(
    admin: PgPool,
    app: String,
    issuer_app: Option<String>,
    shared: Arc<Shared>,
    every: Duration,
    seed: u64,
) -> Kills {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6b69_6c6c);
    let mut kills = Kills::default();
    let base = millis(every).max(1);
    while !shared.done.load(Ordering::SeqCst) {
        let nap = rng.random_range(base / 2..=base + base / 2);
        tokio::time::sleep(Duration::from_millis(nap.max(1))).await;
        if shared.done.load(Ordering::SeqCst) {
            break;
        }
        let killed: Result<i64, sqlx::Error> = sqlx::query_scalar(KILL_WORKER_SQL)
            .bind(&app)
            .fetch_one(&admin)
            .await;
        kills.workers += killed.map_or(0, count);
        if let Some(issuer_app) = &issuer_app {
            let killed: Result<(i64, i64), sqlx::Error> = sqlx::query_as(KILL_ISSUER_SQL)
                .bind(issuer_app)
                .fetch_one(&admin)
                .await;
            if let Ok((gone, mid_statement)) = killed {
                kills.issuer += count(gone);
                kills.issuer_mid_statement += count(mid_statement);
            }
        }
    }
    kills
}

/// A `count(*)` as `u64` (a failed kill statement, e.g. while the server restarts, counts
/// nothing).
fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

//! `pgfence simulate --pg-failover`: the race across a failover of the protected database.
//!
//! A throwaway primary and an asynchronous standby run behind one address (a proxy, like a
//! virtual IP). Lease A checks the batch's resource and writes the row (one transaction). The
//! standby is cut off. A stalls past its TTL; lease B takes the lock (a newer token) and writes
//! — acknowledged, but only the primary has it — and A, waking up, is rejected as stale. Then
//! the primary dies and the standby is promoted (a new timeline): B's write and A's audit row
//! are gone, the row and the resource's mark look like A's again. Zombie A writes once more:
//! pgfence refuses it ([`Error::FencedByFailover`]), since A is bound to the old timeline.
//! The control: the same zombie's check sent as 0.2 sent it (the three-argument
//! `pgfence.check`, which carries no timeline) is accepted. A new lease C writes and is
//! applied. The audit trail and the final row are shown.
//!
//! The demo always runs on its own throwaway pair: a failover needs a primary to kill and a
//! standby to promote, which `DATABASE_URL` cannot give (a configured one is left alone).
//! Leases come from Redis (`REDIS_URL`, else a throwaway server) or, with `--issuer postgres`,
//! from the PostgreSQL issuer on the pair itself, whose counter rolls back with the database.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use pgfence::{
    Error, Fence, FenceToken, Fencing, Lease, Repository, Resource, TokenIssuer,
    audit::AuditFilter, issuer::PgIssuer, table::TableName,
};
use pgfence_testkit::{Kind, PgReplicaSet, Replication, url_or_start};
use sqlx::{AssertSqlSafe, PgPool};

use super::race::DemoRow;
use super::render::Narrator;
use crate::cli::{Conn, SimulateArgs, SimulateIssuer};
use crate::connect::{connect_pg, connect_redis, is_plain_redis};
use crate::util::{self, fmt_duration};

/// The demo row's key.
const BATCH: &str = "batch-42";

/// How often a statement is tried again while the database fails over (100 ms apart).
const RECONNECT_TRIES: u32 = 100;

/// What a write by a lease came to.
enum Written {
    Applied,
    Stale { presented: i64, current: i64 },
    Failover { lease_timeline: i64, timeline: i64 },
}

impl Written {
    fn describe(&self) -> String {
        match self {
            Written::Applied => "applied".to_owned(),
            Written::Stale { presented, current } => {
                format!("REJECTED: stale token (presented {presented}, current {current})")
            }
            Written::Failover {
                lease_timeline,
                timeline,
            } => format!(
                "REFUSED: FencedByFailover (lease bound to timeline {lease_timeline}, database on timeline {timeline})"
            ),
        }
    }
}

/// The demo's database handles.
struct Demo {
    pool: PgPool,
    fence: Fence,
    repo: Repository<DemoRow>,
    resource: Resource,
    table: TableName,
}

/// Runs the failover demo; succeeds when the outcome is the one pgfence promises: zombie A
/// refused after the promotion, the 0.2-style control let through, lease C applied.
pub async fn simulate_failover(conn: &Conn, args: &SimulateArgs) -> Result<ExitCode> {
    if args.no_fence {
        bail!(
            "--pg-failover shows what fencing does across a database failover; its unfenced \
             control is built in (the zombie's check as 0.2 sent it): drop --no-fence"
        );
    }
    if args.mermaid {
        bail!("--pg-failover prints a narrated timeline only: drop --mermaid");
    }
    let pg_issuer = args.issuer == SimulateIssuer::Postgres;
    let issuer_url = conn.issuer_url.as_deref().filter(|u| !u.is_empty());
    if let Some(url) = issuer_url
        && (pg_issuer || !is_plain_redis(url))
    {
        bail!(
            "--pg-failover runs with Redis (REDIS_URL, a redis:// --issuer-url, or a throwaway \
             server) or --issuer postgres on the demo's own primary; drop --issuer-url / \
             PGFENCE_ISSUER_URL"
        );
    }
    if args.ttl > Duration::from_secs(10) {
        bail!("--ttl is capped at 10s with --pg-failover");
    }
    let say = Narrator { mermaid: false };
    say.line(format!(
        "pgfence simulate --pg-failover: the lock-expiry race across a PostgreSQL failover \
         (async standby), lock TTL {}",
        fmt_duration(args.ttl)
    ));
    if conn.database_url.as_deref().is_some_and(|u| !u.is_empty()) {
        say.line(
            "  note:     DATABASE_URL / --database-url is left alone: a failover needs a primary \
             to kill and a standby to promote, so the demo starts its own pair"
                .to_owned(),
        );
    }
    let mut pair = PgReplicaSet::start(Replication::Async)
        .await
        .context("cannot start the throwaway PostgreSQL primary and standby")?;
    say.line(format!(
        "  {:<10}throwaway primary on 127.0.0.1:{}, async standby on 127.0.0.1:{}, clients use \
         127.0.0.1:{} (a proxy in front of the primary, like a virtual IP)",
        "postgres:",
        pair.primary_port(),
        pair.standby_port().unwrap_or_default(),
        pair.proxy().port()
    ));
    let pool = connect_pg(&pair.url()).await?;
    let (issuer, _redis): (Arc<dyn TokenIssuer>, _) = if pg_issuer {
        say.line(format!(
            "  {:<10}the PostgreSQL issuer, on the same primary (its counter fails over with it)",
            "issuer:"
        ));
        (Arc::new(PgIssuer::new(pool.clone())), None)
    } else {
        let configured = issuer_url.or(conn.redis_url.as_deref());
        let (url, server) = url_or_start(Kind::Redis, configured).await.context(
            "cannot start a throwaway redis server (or set REDIS_URL, or use --issuer postgres)",
        )?;
        say.line(match &server {
            Some(s) => format!(
                "  {:<10}throwaway server on 127.0.0.1:{}",
                "redis:",
                s.port()
            ),
            None => format!("  {:<10}{}", "redis:", util::redact(&url)),
        });
        (Arc::new(connect_redis(&url).await?), server)
    };
    let demo = setup(pool).await?;
    pair.wait_replayed().await?;
    let timeline = pair.timeline().await?;
    say.line(format!(
        "  setup:    pgfence schema migrated; demo table {} created and guarded; the standby has \
         replayed it all (timeline {timeline})",
        demo.table.name().as_str()
    ));
    say.line(String::new());

    let ttl = args.ttl;
    // 1. Lease A writes the row; the standby gets it.
    let a = acquire(&*issuer, &demo.resource, ttl, "A").await?;
    let a_token = a.token().get();
    say.line(format!(
        "A  takes the lock: token {a_token} (TTL {})",
        fmt_duration(ttl)
    ));
    let written = write(&demo, &a, "written by A").await?;
    say.line(format!(
        "A  checks {} and writes the row with token {a_token}: {}",
        demo.resource,
        written.describe()
    ));
    let a_first = matches!(written, Written::Applied);
    pair.wait_replayed().await?;
    say.line("   the standby has replayed A's write".to_owned());

    // 2. The standby is cut off; A stalls; B writes (acknowledged); zombie A is rejected.
    pair.cut_off_standby().await?;
    say.line(
        "-- the standby is cut off: it receives no more WAL (the primary goes on acknowledging)"
            .to_owned(),
    );
    let stall = ttl + Duration::from_millis(100);
    say.line(format!(
        "A  pauses {} (GC, VM stall...): its lease expires",
        fmt_duration(stall)
    ));
    tokio::time::sleep(stall).await;
    let b = acquire(
        &*issuer,
        &demo.resource,
        ttl.max(Duration::from_secs(5)),
        "B",
    )
    .await?;
    let b_token = b.token().get();
    say.line(format!("B  takes the lock: token {b_token}"));
    let b_written = write(&demo, &b, "written by B").await?;
    say.line(format!(
        "B  writes the row with token {b_token}: {} (acknowledged by the primary only)",
        b_written.describe()
    ));
    let zombie_before = write(&demo, &a, "written by zombie A").await?;
    say.line(format!(
        "A  wakes and writes with token {a_token}: {}",
        zombie_before.describe()
    ));
    let _ = issuer.release(&b).await;
    say.line("B  releases the lock".to_owned());

    // 3. The primary dies; the standby is promoted.
    let failover = pair.fail_over().await?;
    say.line(format!(
        "-- the primary is killed (SIGKILL); the standby is promoted after {} (timeline {} -> \
         {}); the proxy now points at it",
        fmt_duration(failover.took),
        failover.old_timeline,
        failover.new_timeline
    ));
    let (status, fence) = retrying(|| read_row(&demo)).await?;
    let row_token = FenceToken::of_fence(fence);
    say.line(format!(
        "   the new primary's row: status = {status:?}, fence token {row_token}: B's write is gone{}",
        if row_token == a_token {
            ", the row looks like A's again"
        } else {
            ""
        }
    ));

    // 4. Zombie A writes again; the control; a new lease C.
    let zombie_after =
        retrying(|| write(&demo, &a, "written by zombie A after the failover")).await?;
    say.line(format!(
        "A  (zombie) writes again with token {a_token}: {}",
        zombie_after.describe()
    ));
    let control = control_check(&demo, &a).await;
    say.line(format!(
        "   control, as pgfence 0.2 sent it: SELECT pgfence.check('{}', {a_token}, {}) — no \
         timeline: {}",
        demo.resource,
        Fencing::from(&a).tag(),
        match &control {
            Ok(()) => "ACCEPTED (0.2 let the zombie back in)".to_owned(),
            Err(e) => format!("refused ({e})"),
        }
    ));
    let (c, c_written) = new_lease_writes(&demo, &*issuer, ttl, &say).await?;
    let c_token = c.token().get();
    let _ = issuer.release(&c).await;
    say.line("C  releases the lock".to_owned());
    if pg_issuer && c_token <= b_token {
        say.line(format!(
            "   (the PostgreSQL issuer's counter failed over with the database: B's token \
             {b_token} was lost with it, and C got {c_token})"
        ));
    }

    // 5. The audit trail and the final row.
    say.line(String::new());
    let audit = retrying(|| async {
        pgfence::audit::list(
            &demo.pool,
            &AuditFilter {
                resource: Some(demo.resource.to_string()),
                ..Default::default()
            },
        )
        .await
        .map_err(anyhow::Error::from)
    })
    .await?;
    say.line(format!(
        "pgfence.audit for {} ({} rows; A's stale rejection before the failover was lost with it):",
        demo.resource,
        audit.len()
    ));
    for e in &audit {
        say.line(format!(
            "  #{} {} presented {} current {} {}{}",
            e.id,
            e.operation,
            e.presented,
            e.current.map_or_else(|| "-".to_owned(), |c| c.to_string()),
            e.table.as_deref().unwrap_or("(resource check)"),
            e.reason
                .as_deref()
                .map_or_else(String::new, |r| format!(" — {r}"))
        ));
    }
    let (status, fence) = retrying(|| read_row(&demo)).await?;
    let final_token = FenceToken::of_fence(fence);
    say.line(format!(
        "final row: status = {status:?}, fence token {final_token}"
    ));
    say.line(String::new());

    let refused = matches!(zombie_after, Written::Failover { .. });
    let ok = a_first
        && matches!(b_written, Written::Applied)
        && matches!(zombie_before, Written::Stale { .. })
        && row_token == a_token
        && refused
        && control.is_ok()
        && matches!(c_written, Written::Applied)
        && status == "written by C"
        && final_token == c_token;
    if ok {
        say.line(
            "verdict: the promotion lost B's acknowledged write, and zombie A, whose fence the \
             row showed again, was refused (FencedByFailover); the new lease C wrote. Safe."
                .to_owned(),
        );
    } else if matches!(zombie_after, Written::Applied) {
        say.line(
            "verdict: UNSAFE — after the promotion zombie A's write was APPLIED: the fence \
             alone cannot tell a lost newer write from none"
                .to_owned(),
        );
    } else {
        say.line(
            "verdict: the run did not go as the demo expects (see the steps above)".to_owned(),
        );
    }
    pair.stop();
    say.line("stopped the throwaway primary, standby and proxy, removed their directories".into());
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Migrates, creates the demo table (guarded) with its row, and picks a fresh resource.
async fn setup(pool: PgPool) -> Result<Demo> {
    let suffix = format!("{:08x}", rand::random::<u32>());
    let table = TableName::new("public", &format!("pgfence_demo_{suffix}"))?;
    let resource = Resource::new(format!("demo:payments:batch-42:{suffix}"))?;
    pgfence::admin::migrate(&pool).await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {t} (batch text PRIMARY KEY, status text NOT NULL, paid_by text NOT NULL);
         INSERT INTO {t} VALUES ('{BATCH}', 'pending', 'nobody');",
        t = table.quoted()
    )))
    .execute(&pool)
    .await?;
    pgfence::guard::guard(&pool, &table).await?;
    Ok(Demo {
        fence: Fence::new(pool.clone()),
        repo: Repository::for_table(pool.clone(), table.clone())?,
        pool,
        resource,
        table,
    })
}

async fn acquire(
    issuer: &dyn TokenIssuer,
    resource: &Resource,
    ttl: Duration,
    who: &str,
) -> Result<Lease> {
    retrying(|| async {
        issuer
            .acquire_wait(resource, ttl, Duration::from_secs(10))
            .await
            .map_err(anyhow::Error::from)?
            .with_context(|| format!("worker {who} never got the lock"))
    })
    .await
}

/// One write of the job under `lease`: check the batch's resource, then the fenced row
/// update, in one transaction.
async fn write(demo: &Demo, lease: &Lease, status: &str) -> Result<Written> {
    let row = DemoRow::new(BATCH, status, "nobody");
    let mut tx = demo.pool.begin().await?;
    let result = match demo.fence.check(&mut *tx, &demo.resource, lease).await {
        Ok(()) => demo.repo.update(&mut *tx, lease, &row).await,
        Err(e) => Err(e),
    };
    match result {
        Ok(()) => {
            tx.commit().await?;
            Ok(Written::Applied)
        }
        Err(Error::StaleToken {
            presented, current, ..
        }) => Ok(Written::Stale { presented, current }),
        Err(Error::FencedByFailover {
            lease_timeline,
            timeline,
            ..
        }) => Ok(Written::Failover {
            lease_timeline,
            timeline,
        }),
        Err(e) => Err(e.into()),
    }
}

/// A new lease C writes; a lease whose first statement met the handle's first sight of the
/// new timeline may be refused once (safe): then it takes another lease.
async fn new_lease_writes(
    demo: &Demo,
    issuer: &dyn TokenIssuer,
    ttl: Duration,
    say: &Narrator,
) -> Result<(Lease, Written)> {
    for _ in 0..2 {
        let c = acquire(issuer, &demo.resource, ttl.max(Duration::from_secs(5)), "C").await?;
        let c_token = c.token().get();
        say.line(format!("C  takes the lock: token {c_token}"));
        let written = retrying(|| write(demo, &c, "written by C")).await?;
        say.line(format!(
            "C  writes the row with token {c_token}: {}",
            written.describe()
        ));
        if matches!(written, Written::Failover { .. }) {
            let _ = issuer.release(&c).await;
            say.line("   (refused once while pgfence learnt the new timeline: a new lease)".into());
            continue;
        }
        return Ok((c, written));
    }
    bail!("lease C was refused twice after the failover")
}

/// The zombie's check as pgfence 0.2 sent it: `pgfence.check(resource, token, tag)`, without a
/// timeline, in its own transaction (rolled back: it is shown, not kept).
async fn control_check(demo: &Demo, lease: &Lease) -> Result<()> {
    let fencing = Fencing::from(lease);
    retrying(|| async {
        let mut tx = demo.pool.begin().await?;
        sqlx::query("SELECT pgfence.check($1, $2, $3)")
            .bind(demo.resource.as_str())
            .bind(fencing.token.get())
            .bind(i32::from(fencing.tag()))
            .execute(&mut *tx)
            .await?;
        tx.rollback().await?;
        Ok(())
    })
    .await
}

/// The demo row's status and stored fence.
async fn read_row(demo: &Demo) -> Result<(String, i64)> {
    Ok(sqlx::query_as(AssertSqlSafe(format!(
        "SELECT status, fence FROM {} WHERE batch = $1",
        demo.table.quoted()
    )))
    .bind(BATCH)
    .fetch_one(&demo.pool)
    .await?)
}

/// Runs `op` until it succeeds or fails with something other than a lost connection (the
/// pool reconnects through the proxy to the promoted standby), at most [`RECONNECT_TRIES`]
/// times, 100 ms apart.
async fn retrying<T, F, Fut>(mut op: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let mut tries = 0;
    loop {
        match op().await {
            Ok(v) => return Ok(v),
            Err(e) if tries < RECONNECT_TRIES && transient(&e) => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Whether `e` is a connection lost or refused while the database fails over.
fn transient(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<Error>()
            .is_some_and(Error::is_retryable)
            || cause.downcast_ref::<sqlx::Error>().is_some_and(|s| {
                matches!(
                    s,
                    sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed
                )
            })
    })
}

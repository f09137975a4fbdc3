//! `pgfence simulate`: the lock-expiry race, replayed with real servers and real timing.
//!
//! Worker A takes the lock, reads, and pauses past the TTL (a stand-in for a GC pause or VM
//! stall). The lock expires; worker B takes it with a newer token and writes. A wakes, still
//! believing it holds the lock, and writes too. With fencing, Postgres rejects A's write;
//! with `--no-fence`, A's stale write silently overwrites B's.

use std::fmt::Write as _;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use pgfence::ephemeral::{Kind, Server, url_or_start};
use pgfence::{Error, Issuer, Lease, Repository, TableName};
use sqlx::{AssertSqlSafe, PgPool};
use tokio::time::Instant;

use crate::util::{self, fmt_duration};
use crate::{Conn, SimulateArgs};

#[derive(Clone, Debug)]
struct Payment {
    batch: String,
    paid_by: String,
    amount: i64,
}

/// A row of the demo table, whose name is chosen at run time.
struct DemoRow(Payment);

#[derive(Clone, Debug)]
enum What {
    Acquired {
        token: i64,
        ttl: Duration,
    },
    Read {
        paid_by: String,
    },
    Pause(Duration),
    Expired,
    Wake,
    Write {
        token: Option<i64>,
        applied: bool,
        detail: String,
    },
    Released(&'static str),
}

#[derive(Clone, Debug)]
struct Event {
    at: Duration,
    actor: char,
    what: What,
}

#[derive(Clone)]
struct Recorder {
    t0: Instant,
    events: Arc<Mutex<Vec<Event>>>,
}

impl Recorder {
    fn record(&self, actor: char, what: What) {
        let at = self.t0.elapsed();
        self.events
            .lock()
            .expect("recorder lock")
            .push(Event { at, actor, what });
    }

    fn record_at(&self, at: Duration, actor: char, what: What) {
        self.events
            .lock()
            .expect("recorder lock")
            .push(Event { at, actor, what });
    }

    fn sorted(&self) -> Vec<Event> {
        let mut events = self.events.lock().expect("recorder lock").clone();
        events.sort_by_key(|e| e.at);
        events
    }
}

/// Everything the two workers share.
struct Stage {
    pool: PgPool,
    issuer: Issuer,
    redis_url: String,
    resource: pgfence::Resource,
    table: TableName,
    fenced: bool,
    repo: Option<Repository<DemoRow>>,
    rec: Recorder,
}

pub async fn simulate(conn: &Conn, args: &SimulateArgs) -> Result<ExitCode> {
    pgfence::issuer::check_ttl(args.ttl)?;
    if args.pause <= args.ttl {
        bail!(
            "--pause ({}) must be longer than --ttl ({}) for the lease to expire",
            fmt_duration(args.pause),
            fmt_duration(args.ttl)
        );
    }
    if args.pause > Duration::from_secs(60) {
        bail!("--pause is capped at 60s");
    }
    // Narration goes to stdout, except in --mermaid mode where stdout is the diagram.
    let say = |line: String| {
        if args.mermaid {
            eprintln!("{line}")
        } else {
            println!("{line}")
        }
    };

    say(format!(
        "pgfence simulate: the lock-expiry race ({}), lock TTL {}, worker A pauses {}",
        if args.no_fence {
            "UNFENCED writes"
        } else {
            "fenced writes"
        },
        fmt_duration(args.ttl),
        fmt_duration(args.pause)
    ));

    // Servers: the given URLs, or throwaway ones that live as long as this function.
    let mut throwaway: Vec<Server> = Vec::new();
    let mut urls = Vec::new();
    for (kind, configured, label, var) in [
        (
            Kind::Postgres,
            conn.database_url.as_deref(),
            "postgres",
            "DATABASE_URL",
        ),
        (Kind::Redis, conn.redis_url.as_deref(), "redis", "REDIS_URL"),
    ] {
        let (url, server) = url_or_start(kind, configured)
            .await
            .with_context(|| format!("cannot start a throwaway {label} server (or set {var})"))?;
        match server {
            Some(server) => {
                say(format!(
                    "  {:<10}throwaway server on 127.0.0.1:{} in {}",
                    format!("{label}:"),
                    server.port(),
                    server.dir().display()
                ));
                throwaway.push(server);
            }
            None => say(format!(
                "  {:<10}{} ({var})",
                format!("{label}:"),
                util::redact(&url)
            )),
        }
        urls.push(url);
    }
    let (pg_url, redis_url) = (urls[0].clone(), urls[1].clone());

    let pool = util::connect_pg(&pg_url).await?;
    let issuer = util::connect_redis(&redis_url).await?;
    let applied = pgfence::migrate(&pool).await?;
    let suffix = format!("{:08x}", rand::random::<u32>());
    let table = TableName::new("public", &format!("pgfence_demo_{suffix}"))?;
    let resource = pgfence::Resource::new(format!("demo:payments:batch-42:{suffix}"))?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {t} (batch text PRIMARY KEY, paid_by text NOT NULL, amount bigint NOT NULL);
         INSERT INTO {t} VALUES ('batch-42', 'nobody', 0);",
        t = table.quoted()
    )))
    .execute(&pool)
    .await?;
    let fenced = !args.no_fence;
    if fenced {
        pgfence::guard(&pool, &table).await?;
    }
    say(format!(
        "  setup:    pgfence schema {}; demo table {} created{}",
        if applied.is_empty() {
            "already current"
        } else {
            "migrated"
        },
        table.name().as_str(),
        if fenced {
            " and guarded"
        } else {
            " (NOT guarded)"
        }
    ));
    say(String::new());

    let stage = Arc::new(Stage {
        repo: fenced
            .then(|| Repository::for_table(pool.clone(), table.clone()))
            .transpose()?,
        pool: pool.clone(),
        issuer,
        redis_url: redis_url.clone(),
        resource: resource.clone(),
        table: table.clone(),
        fenced,
        rec: Recorder {
            t0: Instant::now(),
            events: Arc::new(Mutex::new(Vec::new())),
        },
    });

    let outcome = race(stage.clone(), args.ttl, args.pause).await;
    let final_row: Result<(String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT paid_by, {} FROM {} WHERE batch = 'batch-42'",
        if fenced { "fence" } else { "0::bigint" },
        table.quoted()
    )))
    .fetch_one(&pool)
    .await
    .map_err(Into::into);
    let audit = pgfence::audit::list(
        &pool,
        &pgfence::AuditFilter {
            resource: Some(resource.to_string()),
            ..Default::default()
        },
    )
    .await;

    // Leave nothing behind on the user's servers; throwaway ones simply go away.
    if throwaway.len() < 2 {
        cleanup(&stage).await;
    }
    let (a_token, b_token) = outcome?;
    let (paid_by, fence) = final_row?;
    let audit = audit?;
    let events = stage.rec.sorted();

    if args.mermaid {
        print!("{}", mermaid(&events, fenced));
    } else {
        for line in timeline(&events) {
            println!("{line}");
        }
        println!();
    }

    let a_rejected = events
        .iter()
        .any(|e| e.actor == 'A' && matches!(e.what, What::Write { applied: false, .. }));
    let ok = if fenced {
        say(format!(
            "result: the row holds B's write (paid_by = {paid_by}, fence = {fence})"
        ));
        say(format!(
            "audit:  {} rejected write(s) recorded in pgfence.audit{}",
            audit.len(),
            audit
                .first()
                .map(|a| format!(
                    ": {} by {} with token {} (row fence {})",
                    a.operation,
                    short(a.holder.as_deref()),
                    a.presented,
                    a.current.unwrap_or(0)
                ))
                .unwrap_or_default()
        ));
        let ok = a_rejected && paid_by == "B" && audit.len() == 1;
        if ok {
            say(format!(
                "A's stale write (token {a_token}) was REJECTED because B's token {b_token} had already written: fencing works."
            ));
        } else {
            say("unexpected outcome: A's stale write was not rejected as expected".into());
        }
        ok
    } else {
        say(format!("result: the row says paid_by = {paid_by}"));
        let damaged = paid_by == "A";
        if damaged {
            say(format!(
                "DAMAGE: A's stale write (token {a_token}, unfenced) overwrote B's newer write (token {b_token}). \
                 Both workers believed they held the lock. Run without --no-fence to see fencing stop it."
            ));
        } else {
            say("the race did not reproduce this time (try a longer --pause)".into());
        }
        damaged
    };

    for server in throwaway {
        let dir = server.dir().display().to_string();
        server.stop();
        say(format!("stopped throwaway server, removed {dir}"));
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Runs both workers; returns (A's token, B's token).
async fn race(stage: Arc<Stage>, ttl: Duration, pause: Duration) -> Result<(i64, i64)> {
    let a = {
        let stage = stage.clone();
        tokio::spawn(async move { worker_a(&stage, ttl, pause).await })
    };
    let b = {
        let stage = stage.clone();
        tokio::spawn(async move { worker_b(&stage, ttl, pause).await })
    };
    let a_token = a.await.context("worker A panicked")??;
    let b_token = b.await.context("worker B panicked")??;
    Ok((a_token, b_token))
}

async fn worker_a(stage: &Stage, ttl: Duration, pause: Duration) -> Result<i64> {
    let rec = &stage.rec;
    let acquired_at = rec.t0.elapsed();
    let lease = stage
        .issuer
        .acquire(&stage.resource, ttl)
        .await?
        .context("worker A could not take the lock")?;
    rec.record(
        'A',
        What::Acquired {
            token: lease.token().get(),
            ttl,
        },
    );
    rec.record_at(acquired_at + ttl, '-', What::Expired);
    let paid_by = read(stage).await?;
    rec.record('A', What::Read { paid_by });
    rec.record('A', What::Pause(pause));
    tokio::time::sleep(pause).await;
    rec.record('A', What::Wake);
    write(stage, 'A', &lease).await?;
    let state = stage.issuer.release(&lease).await?;
    rec.record('A', What::Released(release_word(state)));
    Ok(lease.token().get())
}

async fn worker_b(stage: &Stage, ttl: Duration, pause: Duration) -> Result<i64> {
    let rec = &stage.rec;
    // Let A go first; then queue for the lock like a second job instance would.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let lease = stage
        .issuer
        .acquire_wait(&stage.resource, ttl.max(pause), pause * 2)
        .await?
        .context("worker B never got the lock")?;
    rec.record(
        'B',
        What::Acquired {
            token: lease.token().get(),
            ttl: ttl.max(pause),
        },
    );
    let paid_by = read(stage).await?;
    rec.record('B', What::Read { paid_by });
    write(stage, 'B', &lease).await?;
    let state = stage.issuer.release(&lease).await?;
    rec.record('B', What::Released(release_word(state)));
    Ok(lease.token().get())
}

fn release_word(state: pgfence::LeaseState) -> &'static str {
    match state {
        pgfence::LeaseState::Held => "released the lock",
        pgfence::LeaseState::Expired => "release: the lock had expired",
        pgfence::LeaseState::Taken => "release refused: another holder has the lock",
    }
}

async fn read(stage: &Stage) -> Result<String> {
    let sql = format!(
        "SELECT paid_by FROM {} WHERE batch = 'batch-42'",
        stage.table.quoted()
    );
    Ok(sqlx::query_scalar(AssertSqlSafe(sql))
        .fetch_one(&stage.pool)
        .await?)
}

async fn write(stage: &Stage, actor: char, lease: &Lease) -> Result<()> {
    let row = DemoRow(Payment {
        batch: "batch-42".into(),
        paid_by: actor.to_string(),
        amount: 100,
    });
    let rec = &stage.rec;
    if let (true, Some(repo)) = (stage.fenced, &stage.repo) {
        match repo.update(&stage.pool, lease, &row).await {
            Ok(()) => rec.record(
                actor,
                What::Write {
                    token: Some(lease.token().get()),
                    applied: true,
                    detail: "applied".into(),
                },
            ),
            Err(Error::StaleToken {
                presented, current, ..
            }) => rec.record(
                actor,
                What::Write {
                    token: Some(presented),
                    applied: false,
                    detail: format!(
                        "REJECTED: stale token (presented {presented}, current {current})"
                    ),
                },
            ),
            Err(e) => return Err(e.into()),
        }
    } else {
        let sql = format!(
            "UPDATE {} SET paid_by = $1, amount = $2 WHERE batch = 'batch-42'",
            stage.table.quoted()
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(&row.0.paid_by)
            .bind(row.0.amount)
            .execute(&stage.pool)
            .await?;
        rec.record(
            actor,
            What::Write {
                token: None,
                applied: true,
                detail: "applied (no fence to check)".into(),
            },
        );
    }
    Ok(())
}

async fn cleanup(stage: &Stage) {
    let drop = format!("DROP TABLE IF EXISTS {}", stage.table.quoted());
    if let Err(e) = sqlx::raw_sql(AssertSqlSafe(drop))
        .execute(&stage.pool)
        .await
    {
        eprintln!("pgfence: could not drop demo table: {e}");
    }
    let _ = sqlx::query("DELETE FROM pgfence.audit WHERE resource = $1")
        .bind(stage.resource.as_str())
        .execute(&stage.pool)
        .await;
    // The demo's own resource only: production counters are never deleted.
    let keys = [
        pgfence::issuer::lock_key(&stage.resource),
        pgfence::issuer::counter_key(&stage.resource),
    ];
    if let Ok(client) = redis::Client::open(stage.redis_url.as_str())
        && let Ok(mut conn) = client.get_multiplexed_async_connection().await
    {
        let _: redis::RedisResult<i64> = redis::cmd("DEL").arg(&keys).query_async(&mut conn).await;
    }
}

fn short(holder: Option<&str>) -> String {
    holder
        .map(|h| h.chars().take(8).collect::<String>() + "…")
        .unwrap_or_else(|| "-".into())
}

fn describe(e: &Event) -> String {
    match &e.what {
        What::Acquired { token, ttl } => format!(
            "acquires the lock (TTL {}) -> fence token {token}",
            fmt_duration(*ttl)
        ),
        What::Read { paid_by } => format!("reads batch-42: paid_by = {paid_by}"),
        What::Pause(d) => format!(
            "pauses for {} (GC pause, VM stall, swap...)",
            fmt_duration(*d)
        ),
        What::Expired => {
            "lock expires: A's lease has run out, but A is still paused and does not know".into()
        }
        What::Wake => "wakes up, still believing it holds the lock".into(),
        What::Write {
            token: Some(t),
            detail,
            ..
        } => format!("writes paid_by = {} with token {t}: {detail}", e.actor),
        What::Write {
            token: None,
            detail,
            ..
        } => format!("writes paid_by = {}: {detail}", e.actor),
        What::Released(word) => (*word).to_owned(),
    }
}

fn timeline(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .map(|e| {
            let who = match e.actor {
                '-' => "redis".to_owned(),
                a => format!("{a}    "),
            };
            format!(
                "{:>8}  {who}  {}",
                format!("+{}ms", e.at.as_millis()),
                describe(e)
            )
        })
        .collect()
}

fn mermaid(events: &[Event], fenced: bool) -> String {
    let mut out = String::from("sequenceDiagram\n");
    out.push_str("    participant A as Worker A\n    participant R as Redis\n    participant P as Postgres\n    participant B as Worker B\n");
    for e in events {
        let who = e.actor;
        let at = e.at.as_millis();
        let line = match &e.what {
            What::Acquired { token, ttl } => format!(
                "    {who}->>R: +{at}ms acquire lock (TTL {})\n    R-->>{who}: token {token}\n",
                fmt_duration(*ttl)
            ),
            What::Read { paid_by } => format!(
                "    {who}->>P: +{at}ms read batch-42\n    P-->>{who}: paid_by = {paid_by}\n"
            ),
            What::Pause(d) => format!(
                "    Note over A: +{at}ms paused {} (GC)\n",
                fmt_duration(*d)
            ),
            What::Expired => format!("    Note over R: +{at}ms lock expires\n"),
            What::Wake => {
                format!("    Note over A: +{at}ms wakes, still believes it holds the lock\n")
            }
            What::Write {
                token,
                applied,
                detail,
            } => {
                let with = token.map(|t| format!(" fence={t}")).unwrap_or_default();
                let reply = if *applied {
                    format!("P-->>{who}: {detail}")
                } else {
                    format!("P--x{who}: {detail}")
                };
                format!("    {who}->>P: +{at}ms UPDATE paid_by={who}{with}\n    {reply}\n")
            }
            What::Released(word) => {
                format!("    {who}->>R: +{at}ms release\n    R-->>{who}: {word}\n")
            }
        };
        out.push_str(&line.replace(['(', ')'], ""));
    }
    let _ = writeln!(
        out,
        "    Note over P: {}",
        if fenced {
            "fenced: stale write rejected"
        } else {
            "unfenced: stale write overwrote B"
        }
    );
    out
}

impl pgfence::FencedTable for DemoRow {
    type Key = String;
    // The demo's table name is random; `Repository::for_table` supplies it.
    const TABLE: &'static str = "pgfence_demo";
    const KEY_COLUMNS: &'static [&'static str] = &["batch"];
    const COLUMNS: &'static [&'static str] = &["paid_by", "amount"];
    fn bind_key(&self, q: pgfence::PgQuery) -> pgfence::PgQuery {
        q.bind(self.0.batch.clone())
    }
    fn bind_columns(&self, q: pgfence::PgQuery) -> pgfence::PgQuery {
        q.bind(self.0.paid_by.clone()).bind(self.0.amount)
    }
    fn bind_key_value(key: &String, q: pgfence::PgQuery) -> pgfence::PgQuery {
        q.bind(key.clone())
    }
}

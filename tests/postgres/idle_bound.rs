//! A paused lease cannot hold rows past its lease for long: `Fence::check` in the caller's
//! transaction bounds how long that transaction may sit idle (`Fencing::idle_bound`, the
//! lease's TTL), so PostgreSQL ends the transaction of a process paused inside it (SIGSTOP)
//! and the next holder's write goes through, instead of waiting until the paused process
//! wakes. The woken process's `COMMIT` fails, and nothing of its transaction is applied.
//!
//! The paused holder is a real separate process: this test binary run again as the worker
//! (`paused_worker`, ignored unless the parent sets its environment), stopped by its PID.

use crate::support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use pgfence::{Fence, Fencing, Repository, Resource, issuer::PgIssuer, table::TableName};
use support::TestDb;

#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
struct Doc {
    id: i64,
    body: String,
}

pgfence::fenced_table!(Doc { table: "docs", key: id: i64, columns: [body] });

/// The worker's database URL; the worker runs only when it is set.
const WORKER_URL: &str = "PGFENCE_TEST_IDLE_WORKER_URL";
/// `off`: the worker's lease carries no idle bound (the behaviour before it existed).
const WORKER_BOUND: &str = "PGFENCE_TEST_IDLE_WORKER_BOUND";
const TTL: Duration = Duration::from_secs(3);

fn resource() -> Resource {
    Resource::new("docs:1").unwrap()
}

/// The paused holder: takes a lease, checks the resource and writes the row in its own
/// transaction, says READY, and waits for a line on stdin (it is stopped meanwhile) before it
/// commits; prints what the COMMIT got.
#[tokio::test]
#[ignore = "the worker of a_paused_holders_transaction_ends_at_its_lease_ttl, run by it"]
#[allow(clippy::print_stdout)] // Its stdout is how the parent follows it.
async fn paused_worker() {
    let Ok(url) = std::env::var(WORKER_URL) else {
        return;
    };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .unwrap();
    let issuer = PgIssuer::new(pool.clone());
    let lease = issuer.acquire(&resource(), TTL).await.unwrap().unwrap();
    assert_eq!(
        Fencing::from(&lease).idle_bound(),
        None,
        "the bound is the caller's choice"
    );
    let mut fencing = Fencing::from(&lease).with_idle_bound(Some(lease.ttl()));
    if std::env::var(WORKER_BOUND).as_deref() == Ok("off") {
        fencing = fencing.with_idle_bound(None);
    }
    let repo = Repository::<Doc>::new(pool.clone()).unwrap();
    let mut tx = pool.begin().await.unwrap();
    Fence::new(pool.clone())
        .check(&mut *tx, &resource(), &fencing)
        .await
        .unwrap();
    let doc = Doc {
        id: 1,
        body: "zombie".into(),
    };
    repo.update(&mut *tx, &fencing, &doc).await.unwrap();
    println!("READY");
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let committed = tx.commit().await;
    println!("COMMIT {:?}", committed.map_err(|e| e.to_string()));
    std::io::stdout().flush().unwrap();
}

/// The worker process; stopped processes are continued and killed when dropped (by PID).
struct Worker {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Worker {
    fn start(db: &TestDb, bounded: bool) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "idle_bound::paused_worker",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(WORKER_URL, db.url())
            .env(WORKER_BOUND, if bounded { "on" } else { "off" })
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Self {
            child,
            stdin,
            lines,
        }
    }

    /// The worker's first line with `prefix` (libtest may print the test's name before it on
    /// that line), from `prefix` on.
    fn line(&self, prefix: &str, within: Duration) -> String {
        let until = Instant::now() + within;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(prefix) => {
                    return line[line.find(prefix).unwrap_or(0)..].to_owned();
                }
                Ok(_) => {}
                Err(e) => panic!("no {prefix} line from the worker within {within:?}: {e}"),
            }
        }
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill {signal}");
    }

    /// Continues the worker and lets it commit.
    fn wake(&mut self) {
        self.signal("-CONT");
        let mut stdin = self.stdin.take().unwrap();
        writeln!(stdin).unwrap();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What one run measured.
#[derive(Debug)]
struct Figures {
    /// From the worker's SIGSTOP until the next holder had the lease.
    acquired: Duration,
    /// From the SIGSTOP until the next holder's write returned.
    written: Duration,
    /// The next holder's write.
    write: pgfence::Result<()>,
    /// What the woken worker's COMMIT got.
    commit: String,
    /// The row afterwards.
    body: String,
}

/// The worker writes the row in a transaction and is stopped inside it; the next holder
/// takes the lease when the worker's expires and writes the row (its call bound `write_bound`);
/// the worker is woken `pause` after its stop (or once the write returned, if later) and
/// commits.
async fn paused_holder(bounded: bool, pause: Duration, write_bound: Duration) -> Figures {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE docs (id bigint PRIMARY KEY, body text NOT NULL); INSERT INTO docs VALUES (1, 'initial');")
        .await;
    pgfence::guard::guard(&db.pool, &TableName::parse("docs").unwrap())
        .await
        .unwrap();
    let mut worker = Worker::start(&db, bounded);
    worker.line("READY", Duration::from_secs(120));
    worker.signal("-STOP");
    let stopped = Instant::now();

    let issuer = PgIssuer::new(db.pool.clone());
    let lease = issuer
        .acquire_wait(
            &resource(),
            Duration::from_secs(60),
            Duration::from_secs(30),
        )
        .await
        .unwrap()
        .expect("the paused worker's lease expires");
    let acquired = stopped.elapsed();
    let repo = Repository::<Doc>::new(db.pool.clone())
        .unwrap()
        .with_call_timeout(write_bound)
        .unwrap();
    let write = repo
        .update(
            &db.pool,
            &lease,
            &Doc {
                id: 1,
                body: "next holder".into(),
            },
        )
        .await;
    let written = stopped.elapsed();
    tokio::time::sleep(pause.saturating_sub(stopped.elapsed())).await;
    worker.wake();
    let commit = worker.line("COMMIT", Duration::from_secs(60));
    let body: String = sqlx::query_scalar("SELECT body FROM docs WHERE id = 1")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let figures = Figures {
        acquired,
        written,
        write,
        commit,
        body,
    };
    eprintln!("paused holder (idle bound {bounded}): {figures:?}");
    figures
}

/// With the bound, the server ends the paused worker's transaction at its TTL: the next
/// holder's write goes through within a second or two of taking the lease, the woken worker's
/// COMMIT fails, and the row holds the next holder's write. Without the bound, the same write
/// waits on the worker's row lock until its call bound (`unbounded_holder_stalls_the_next`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holders_transaction_ends_at_its_lease_ttl() {
    let f = paused_holder(true, Duration::ZERO, Duration::from_secs(20)).await;
    assert!(f.write.is_ok(), "{f:?}");
    assert!(
        f.written < TTL + Duration::from_secs(8),
        "the next holder waited {:?} after the stop (TTL {TTL:?}): {f:?}",
        f.written
    );
    assert!(
        f.written.saturating_sub(f.acquired) < Duration::from_secs(5),
        "the write after taking the lease waited {:?}: {f:?}",
        f.written.saturating_sub(f.acquired)
    );
    assert!(f.commit.starts_with("COMMIT Err("), "{f:?}");
    assert!(
        f.commit.contains("idle-in-transaction"),
        "the COMMIT's error says why: {f:?}"
    );
    assert_eq!(
        f.body, "next holder",
        "nothing of the paused transaction applied"
    );
}

/// The figure before the bound (a lease made `with_idle_bound(None)`): the next holder's
/// write waits on the paused worker's row lock for its whole call bound (10 s) and times out;
/// the worker, woken 15 s after its stop, commits its write (legal: no newer write reached the
/// row). Ignored: it takes 15 s; run it to measure (docs/operations.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: 15 s"]
async fn unbounded_holder_stalls_the_next() {
    let f = paused_holder(false, Duration::from_secs(15), Duration::from_secs(10)).await;
    assert!(
        matches!(f.write, Err(pgfence::Error::TimedOut { .. })),
        "{f:?}"
    );
    assert!(f.commit.starts_with("COMMIT Ok"), "{f:?}");
    assert_eq!(f.body, "zombie");
}

/// The per-role default (`admin::bound_idle_transactions`, `pgfence grant
/// --idle-in-transaction-timeout`) bounds a transaction of repository writes alone (no
/// `Fence::check`): its holder sits idle (as a paused process does, for the server) and the
/// server ends it after the bound; the next holder's write waits no longer; `None` removes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_default_bounds_the_roles_idle_transactions() {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE docs (id bigint PRIMARY KEY, body text NOT NULL); INSERT INTO docs VALUES (1, 'initial');")
        .await;
    pgfence::guard::guard(&db.pool, &TableName::parse("docs").unwrap())
        .await
        .unwrap();
    let app = support::Role::create(&db, "idle_app", "NOSUPERUSER").await;
    db.exec(&format!(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON docs TO {}",
        app.quoted()
    ))
    .await;
    pgfence::admin::grant(&db.pool, &app.ident()).await.unwrap();
    let bound = Duration::from_millis(1500);
    assert!(matches!(
        pgfence::admin::bound_idle_transactions(&db.pool, &app.ident(), Some(Duration::ZERO)).await,
        Err(pgfence::Error::Invalid(
            pgfence::error::InvalidInput::Duration(_)
        ))
    ));
    pgfence::admin::bound_idle_transactions(&db.pool, &app.ident(), Some(bound))
        .await
        .unwrap();

    let pool = app.pool(&db).await;
    let shown: String = sqlx::query_scalar("SHOW idle_in_transaction_session_timeout")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(shown, "1500ms");
    let repo = Repository::<Doc>::new(pool.clone()).unwrap();
    let old = support::token(1);
    let mut tx = pool.begin().await.unwrap();
    let zombie = Doc {
        id: 1,
        body: "zombie".into(),
    };
    repo.update(&mut *tx, old, &zombie).await.unwrap();
    let idle_since = Instant::now();
    // The holder sits idle in its transaction; the next lease writes the row meanwhile.
    let next = Doc {
        id: 1,
        body: "next holder".into(),
    };
    repo.with_call_timeout(Duration::from_secs(20))
        .unwrap()
        .update(&pool, support::token(2), &next)
        .await
        .unwrap();
    let waited = idle_since.elapsed();
    assert!(
        waited < bound + Duration::from_secs(5),
        "the next holder waited {waited:?} (bound {bound:?})"
    );
    eprintln!(
        "role default {bound:?}: the next holder's write returned {waited:?} after the holder went idle"
    );
    let err = tx.commit().await.unwrap_err();
    assert!(err.to_string().contains("idle-in-transaction"), "{err}");
    let body: String = sqlx::query_scalar("SELECT body FROM docs WHERE id = 1")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(body, "next holder");

    pgfence::admin::bound_idle_transactions(&db.pool, &app.ident(), None)
        .await
        .unwrap();
    let fresh = app.pool(&db).await;
    let shown: String = sqlx::query_scalar("SHOW idle_in_transaction_session_timeout")
        .fetch_one(&fresh)
        .await
        .unwrap();
    assert_eq!(shown, "0", "RESET: the server's default again");
}

//! A lease's late statement cannot undo its newer write (issues 31, 43): a statement held up in
//! the network while the caller gave up, and the same lease's next write applied, is released
//! and reaches the server — and changes nothing. A single-row write of the library expects the
//! fence its lease last saw on the row and applies over exactly that one (or an older
//! lease's): the lease's next write moved the fence, so the late statement matches no row.
//! Batches and checks still run in a transaction of their own (the gate) whose `COMMIT` is sent
//! only after the answer came in time; on the shell path, a `psql --single-transaction` whose
//! client gave up is the same gate. Each test has its control: the same held statement sent
//! without the expected fence, or without a gate, lands late and undoes the newer write.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support;

use pgfence::error::TimedOut;
use pgfence::{Error, Fencing, Repository, Resource, table::TableName};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use support::{TestDb, token};

#[derive(Debug, Clone, sqlx::FromRow)]
struct Acct {
    id: i64,
    balance: i64,
}
pgfence::fenced_table!(Acct { table: "acct", key: id: i64, columns: [balance] });

async fn setup() -> TestDb {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE acct (id bigint PRIMARY KEY, balance bigint NOT NULL); INSERT INTO acct VALUES (1, 0);")
        .await;
    pgfence::guard::guard(&db.pool, &TableName::parse("acct").unwrap())
        .await
        .unwrap();
    db
}

fn lease() -> Fencing {
    Fencing::new(token(7))
        .resource(Resource::new("acct:1").unwrap())
        .holder("w1")
}

async fn balance(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT balance FROM acct WHERE id = 1")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// What the proxy holds.
#[derive(Clone, Copy)]
enum Hold {
    /// The first bytes containing this text (a simple-protocol statement, as psql sends).
    Text(&'static [u8]),
    /// Once [`HoldProxy::arm`]ed, the next Bind message (`B`): the execution of a statement
    /// the connection has prepared before (as sqlx sends a cached statement).
    NextBind,
}

/// A loopback proxy that forwards both ways until a client sends what [`Hold`] says; from
/// there on, that connection's bytes towards the server are held (read and kept, EOF
/// included) until [`HoldProxy::release`], which delivers them in order — as a network path
/// that black-holes one statement and later heals.
struct HoldProxy {
    port: u16,
    armed: Arc<AtomicBool>,
    released: Arc<AtomicBool>,
    holding: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl HoldProxy {
    fn start(target: u16, hold: Hold) -> Self {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        listener.set_nonblocking(true).unwrap();
        let armed = Arc::new(AtomicBool::new(matches!(hold, Hold::Text(_))));
        let released = Arc::new(AtomicBool::new(false));
        let holding = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (a, r, h, st) = (
            armed.clone(),
            released.clone(),
            holding.clone(),
            stop.clone(),
        );
        std::thread::spawn(move || {
            while !st.load(Ordering::SeqCst) {
                let Ok((client, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                client.set_nonblocking(false).unwrap();
                let upstream = TcpStream::connect((Ipv4Addr::LOCALHOST, target)).unwrap();
                let (c2, u2) = (client.try_clone().unwrap(), upstream.try_clone().unwrap());
                let (a, r, h) = (a.clone(), r.clone(), h.clone());
                std::thread::spawn(move || towards_server(client, upstream, hold, [&a, &r, &h]));
                std::thread::spawn(move || copy(u2, c2));
            }
        });
        Self {
            port,
            armed,
            released,
            holding,
            stop,
        }
    }

    /// Holds the next Bind ([`Hold::NextBind`]).
    fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Whether a statement is held now.
    fn holding(&self) -> bool {
        self.holding.load(Ordering::SeqCst)
    }

    /// Delivers what was held, and forwards everything from now on.
    fn release(&self) {
        self.released.store(true, Ordering::SeqCst);
    }
}

impl Drop for HoldProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.release();
    }
}

fn towards_server(
    mut client: TcpStream,
    mut upstream: TcpStream,
    hold: Hold,
    [armed, released, holding]: [&AtomicBool; 3],
) {
    let held = Arc::new(Mutex::new(Vec::<u8>::new()));
    let mut holding_this = false;
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = client.read(&mut buf).unwrap_or(0);
        let chunk = &buf[..n];
        let matches = match hold {
            Hold::Text(pattern) => chunk.windows(pattern.len()).any(|w| w == pattern),
            Hold::NextBind => chunk.first() == Some(&b'B'),
        };
        if !holding_this
            && armed.load(Ordering::SeqCst)
            && !released.load(Ordering::SeqCst)
            && matches
        {
            holding_this = true;
            holding.store(true, Ordering::SeqCst);
        }
        if holding_this {
            held.lock().unwrap().extend_from_slice(chunk);
            if n == 0 || !released.load(Ordering::SeqCst) {
                // Wait for the release before delivering anything of this connection.
                while !released.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            let bytes = std::mem::take(&mut *held.lock().unwrap());
            if upstream.write_all(&bytes).is_err() {
                return;
            }
            holding_this = n != 0 && !released.load(Ordering::SeqCst);
        } else if n > 0 && upstream.write_all(chunk).is_err() {
            return;
        }
        if n == 0 {
            let _ = upstream.shutdown(Shutdown::Write);
            return;
        }
    }
}

fn copy(mut from: TcpStream, mut to: TcpStream) {
    let _ = std::io::copy(&mut from, &mut to);
    let _ = to.shutdown(Shutdown::Write);
}

/// The server's port and a pool of one connection through `proxy`.
async fn pool_through(db: &TestDb, proxy: &HoldProxy) -> sqlx::PgPool {
    let options: PgConnectOptions = db.url().parse().unwrap();
    PgPoolOptions::new()
        .max_connections(1)
        // In the clear, so the proxy can see the statement.
        .connect_with(
            options
                .host("127.0.0.1")
                .port(proxy.port)
                .ssl_mode(PgSslMode::Disable),
        )
        .await
        .unwrap()
}

fn server_port(db: &TestDb) -> u16 {
    let options: PgConnectOptions = db.url().parse().unwrap();
    options.get_port()
}

/// Waits until the held statement has reached the server and ended there (applied, or rolled
/// back with its transaction).
async fn settle(db: &TestDb) {
    for _ in 0..100 {
        let busy: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid() \
             AND query LIKE 'UPDATE%' AND state <> 'idle'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if busy == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
}

/// The history: w1's write of 39 is held in the network and the call gives up; the
/// same lease writes 40; the held write is delivered — and 40 stays. The caller was told the
/// write is in doubt; the lease's next write ordered after it.
#[tokio::test]
async fn a_held_write_released_after_the_leases_next_write_changes_nothing() {
    let db = setup().await;
    let lease = lease();
    let repo = Repository::<Acct>::new(db.pool.clone()).unwrap();
    repo.update(&db.pool, &lease, &Acct { id: 1, balance: 38 })
        .await
        .unwrap();

    let proxy = HoldProxy::start(server_port(&db), Hold::NextBind);
    let held_pool = pool_through(&db, &proxy).await;
    let held_repo = Repository::<Acct>::new(db.pool.clone())
        .unwrap()
        .with_call_timeout(Duration::from_millis(600))
        .unwrap();
    // The connection has run the statement before: the held one is its execution only.
    held_repo
        .update(&held_pool, &lease, &Acct { id: 1, balance: 38 })
        .await
        .unwrap();
    proxy.arm();
    let err = held_repo
        .update(&held_pool, &lease, &Acct { id: 1, balance: 39 })
        .await
        .unwrap_err();
    assert!(proxy.holding(), "the proxy held the write");
    assert!(
        matches!(
            err,
            Error::TimedOut {
                operation: "update",
                outcome: TimedOut::InDoubt,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.is_retryable());

    // The lease's next write, on another connection.
    repo.update(&db.pool, &lease, &Acct { id: 1, balance: 40 })
        .await
        .unwrap();
    proxy.release();
    settle(&db).await;
    assert_eq!(
        balance(&db).await,
        40,
        "the late statement undid the newer write"
    );
    drop(held_pool);
}

/// The control: the write-up's statement, sent through the same proxy without a transaction
/// of its own and given up by the caller in the same way, lands late and undoes the lease's
/// newer write — the loss the gate prevents.
#[tokio::test]
async fn control_an_ungated_held_write_lands_late_and_undoes_the_newer_one() {
    let db = setup().await;
    let lease = lease();
    let repo = Repository::<Acct>::new(db.pool.clone()).unwrap();
    repo.update(&db.pool, &lease, &Acct { id: 1, balance: 38 })
        .await
        .unwrap();

    let proxy = HoldProxy::start(server_port(&db), Hold::NextBind);
    let held_pool = pool_through(&db, &proxy).await;
    let write_up = |balance: i64| {
        sqlx::query("UPDATE acct SET balance = $1, fence = $2 WHERE id = 1 AND fence < $2")
            .bind(balance)
            .bind(lease.fence())
            .execute(&held_pool)
    };
    write_up(38).await.unwrap();
    proxy.arm();
    let write_up = write_up(39);
    let cut = tokio::time::timeout(Duration::from_millis(600), write_up).await;
    assert!(cut.is_err(), "the held write was not cut off: {cut:?}");
    assert!(proxy.holding());

    repo.update(&db.pool, &lease, &Acct { id: 1, balance: 40 })
        .await
        .unwrap();
    proxy.release();
    settle(&db).await;
    assert_eq!(
        balance(&db).await,
        39,
        "the control should lose the newer write (the held statement lands late)"
    );
    drop(held_pool);
}

/// The held write inside the caller's own transaction: the call says so, and once the caller
/// drops its transaction the late statement changes nothing.
#[tokio::test]
async fn a_held_write_in_the_callers_transaction_says_roll_back() {
    let db = setup().await;
    let lease = lease();
    let repo = Repository::<Acct>::new(db.pool.clone()).unwrap();
    repo.update(&db.pool, &lease, &Acct { id: 1, balance: 38 })
        .await
        .unwrap();
    let proxy = HoldProxy::start(server_port(&db), Hold::NextBind);
    let held_pool = pool_through(&db, &proxy).await;
    let held_repo = repo
        .clone()
        .with_call_timeout(Duration::from_millis(600))
        .unwrap();
    held_repo
        .update(&held_pool, &lease, &Acct { id: 1, balance: 38 })
        .await
        .unwrap();
    proxy.arm();
    let mut tx = held_pool.begin().await.unwrap();
    let err = held_repo
        .update(&mut *tx, &lease, &Acct { id: 1, balance: 39 })
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::TimedOut {
                outcome: TimedOut::CallerTransaction,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        !err.is_retryable(),
        "the transaction must be rolled back first"
    );
    drop(tx);
    repo.update(&db.pool, &lease, &Acct { id: 1, balance: 40 })
        .await
        .unwrap();
    proxy.release();
    settle(&db).await;
    assert_eq!(balance(&db).await, 40);
    drop(held_pool);
}

/// The shell path: `psql --single-transaction` is the gate. Its client is cut off while the
/// proxy holds the statement (`timeout` in a script, or the job runner killing it); the lease
/// writes again; the held statement reaches the server and is rolled back with its session.
/// Without `--single-transaction` (the control) the same statement lands late.
#[tokio::test]
async fn on_the_shell_path_psql_single_transaction_is_the_gate() {
    let Some(psql) = psql() else {
        eprintln!("skipped: psql not installed");
        return;
    };
    for gated in [true, false] {
        let db = setup().await;
        let lease = lease();
        let repo = Repository::<Acct>::new(db.pool.clone()).unwrap();
        repo.update(&db.pool, &lease, &Acct { id: 1, balance: 38 })
            .await
            .unwrap();
        let proxy = HoldProxy::start(server_port(&db), Hold::Text(b"UPDATE"));
        let mut url = db.url();
        url = url.replacen(
            &format!(":{}/", server_port(&db)),
            &format!(":{}/", proxy.port),
            1,
        );
        url.push_str("?sslmode=disable");
        let fence = lease.fence();
        let sql = format!(
            "UPDATE acct SET balance = 39, fence = {fence} WHERE id = 1 AND fence < {fence}"
        );
        let mut cmd = std::process::Command::new(&psql);
        cmd.arg(&url).args(["-X", "-q", "-v", "ON_ERROR_STOP=1"]);
        if gated {
            cmd.arg("--single-transaction");
        }
        let mut child = cmd
            .args(["-c", &sql])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(
            child.try_wait().unwrap().is_none(),
            "psql was not held: it has exited"
        );
        assert!(proxy.holding());
        // The client gives up (a script's `timeout`, a killed job).
        child.kill().unwrap();
        child.wait().unwrap();
        repo.update(&db.pool, &lease, &Acct { id: 1, balance: 40 })
            .await
            .unwrap();
        proxy.release();
        settle(&db).await;
        let expected = if gated { 40 } else { 39 };
        assert_eq!(
            balance(&db).await,
            expected,
            "psql {} --single-transaction",
            if gated { "with" } else { "without" }
        );
    }
}

fn psql() -> Option<std::path::PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("psql"))
            .find(|p| p.is_file())
    })
}

/// Statements of this database still running or waiting (not the caller's own, not idle).
async fn running(db: &TestDb) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND pid <> pg_backend_pid() AND state = 'active'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// Every fenced call returns within its bound, and its statement does not outlive it on the
/// server: writes, claims, batches, `Fence::check` and the effect ledger, each blocked behind
/// a lock another transaction holds.
#[tokio::test]
async fn every_call_returns_within_its_bound_and_stops_on_the_server_too() {
    let db = setup().await;
    let lease = lease();
    let bound = Duration::from_millis(400);
    let repo = Repository::<Acct>::new(db.pool.clone())
        .unwrap()
        .with_call_timeout(bound)
        .unwrap();
    let fence = pgfence::Fence::new(db.pool.clone())
        .with_call_timeout(bound)
        .unwrap();
    let effects = pgfence::Effects::new(db.pool.clone())
        .with_call_timeout(bound)
        .unwrap();
    let resource = Resource::new("acct:1").unwrap();
    // Marks and effect rows exist before the locks are taken.
    repo.update(&db.pool, &lease, &Acct { id: 1, balance: 1 })
        .await
        .unwrap();
    fence.check(&db.pool, &resource, &lease).await.unwrap();
    effects
        .begin(&db.pool, &lease, "inv-1", "charge")
        .await
        .unwrap();

    // Another transaction holds every row these calls need.
    let mut blocker = db.pool.begin().await.unwrap();
    sqlx::raw_sql(
        "SELECT * FROM acct FOR UPDATE; \
         SELECT * FROM pgfence.resource_fence FOR UPDATE; \
         SELECT * FROM pgfence.effect FOR UPDATE",
    )
    .execute(&mut *blocker)
    .await
    .unwrap();

    let timed_out = |what: &str, r: Result<(), Error>, started: std::time::Instant| {
        let elapsed = started.elapsed();
        match r {
            Err(Error::TimedOut {
                outcome: TimedOut::NotApplied | TimedOut::InDoubt,
                after,
                ..
            }) => assert_eq!(after, bound, "{what}"),
            other => panic!("{what}: expected TimedOut, got {other:?}"),
        }
        assert!(
            elapsed < bound + Duration::from_millis(300),
            "{what} returned after {elapsed:?}, bound {bound:?}"
        );
    };
    let t = std::time::Instant::now();
    let r = repo
        .update(&db.pool, &lease, &Acct { id: 1, balance: 2 })
        .await;
    timed_out("update", r, t);
    let t = std::time::Instant::now();
    let r = repo.claim::<_, Acct>(&db.pool, &lease, &1).await.map(drop);
    timed_out("claim", r, t);
    let t = std::time::Instant::now();
    let r = repo
        .update_many(&db.pool, &lease, &[Acct { id: 1, balance: 3 }])
        .await
        .map(drop);
    timed_out("update_many", r, t);
    let t = std::time::Instant::now();
    let r = fence.check(&db.pool, &resource, &lease).await;
    timed_out("check", r, t);
    let t = std::time::Instant::now();
    let r = effects
        .begin(&db.pool, &lease, "inv-1", "charge")
        .await
        .map(drop);
    timed_out("effect", r, t);

    // The server ended them too, before the lock is gone: the gated ones at their
    // `statement_timeout`, the ordered ones once their closed connection was noticed
    // (`client_connection_check_interval`, 1 s, set by the migration).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(running(&db).await, 0, "a statement outlived its call");
    blocker.rollback().await.unwrap();
    assert_eq!(balance(&db).await, 1, "nothing of the cut calls applied");
}

/// The control for the row's ordering: the repository's statement with the ordering check
/// switched off — admitting any fence of its own lease, as 0.3 did before writes carried the
/// fence they expect — held and released the same way, lands late and undoes the newer write.
#[tokio::test]
async fn control_without_the_expected_fence_a_held_write_undoes_the_newer_one() {
    let db = setup().await;
    let lease = lease();
    let repo = Repository::<Acct>::new(db.pool.clone()).unwrap();
    repo.update(&db.pool, &lease, &Acct { id: 1, balance: 38 })
        .await
        .unwrap();

    let proxy = HoldProxy::start(server_port(&db), Hold::NextBind);
    let held_pool = pool_through(&db, &proxy).await;
    // Any fence of the lease admits the write (the cycle's next step is stored).
    let unordered = |balance: i64| {
        sqlx::query(
            "UPDATE acct SET balance = $1, \
             fence = CASE WHEN fence < $2 THEN $2 ELSE $2 + ((fence - $2 + 2731) % 4095) END \
             WHERE id = 1 AND (fence < ($2 & ~16777215::bigint) \
             OR (fence >= $2 AND fence < $2 + 4095))",
        )
        .bind(balance)
        .bind(lease.lease_fence())
        .execute(&held_pool)
    };
    unordered(38).await.unwrap();
    proxy.arm();
    let cut = tokio::time::timeout(Duration::from_millis(600), unordered(39)).await;
    assert!(cut.is_err(), "the held write was not cut off: {cut:?}");
    assert!(proxy.holding());

    repo.update(&db.pool, &lease, &Acct { id: 1, balance: 40 })
        .await
        .unwrap();
    proxy.release();
    settle(&db).await;
    assert_eq!(
        balance(&db).await,
        39,
        "without the expected fence the held statement should land late and undo 40"
    );
    drop(held_pool);
}

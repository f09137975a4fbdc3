//! A real Redis Sentinel failover that loses `INCR`s: a master, one replica and three
//! sentinels (throwaway processes on 127.0.0.1). The replica is paused (`SIGSTOP`) while the
//! master hands out tokens, the master is killed (`SIGKILL`), the replica resumes and is
//! promoted with a counter that is behind. New leases then get tokens Postgres has already
//! seen: every such write is rejected (stale, or `DuplicateToken` when the very same token
//! wrote the row under another holder), no row ever goes back to an older token, nothing is
//! lost, and liveness comes back by itself (`with_floor_source`, for `Fence::check` users) or
//! through `recover_from` (row-only users). Prints the figures.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroUsize;
use std::time::Duration;

use pgfence::{
    Error, Fence, Lease, RedisIssuer, Repository, Resource,
    issuer::{LeaseState, redis::SentinelConnections},
    table::TableName,
};
use pgfence_testkit::optional::Sentinel;
use pgfence_testkit::{Installed, SentinelConfig, SentinelSet, needs};
use tokio::time::Instant;

use support::{TestDb, audit_count, unique_resource};

#[derive(Debug, Clone, sqlx::FromRow)]
struct Account {
    id: i64,
    balance: i64,
    last_holder: String,
}

pgfence::fenced_table!(Account { table: "accounts", key: id: i64, columns: [balance, last_holder] });

/// Rows the row-only jobs write in turn, and the row the first lease the replica missed wrote.
const ROWS: [i64; 4] = [0, 1, 2, 3];
const DUP_ROW: i64 = 100;
const TTL: Duration = Duration::from_secs(10);

/// Tallies of one phase.
#[derive(Debug, Default)]
struct Tally {
    applied: BTreeMap<i64, i64>,
    checks_applied: i64,
    stale: i64,
    duplicate: i64,
    tokens: Vec<i64>,
}

impl Tally {
    fn rejected(&self) -> i64 {
        self.stale + self.duplicate
    }

    fn count(&mut self, rejection: &Error) {
        match rejection {
            Error::StaleToken { .. } => self.stale += 1,
            Error::DuplicateToken { .. } => self.duplicate += 1,
            other => panic!("not a rejection: {other}"),
        }
    }
}

fn rejection(e: Error) -> Result<Option<Error>, Error> {
    match e {
        Error::StaleToken { .. } | Error::DuplicateToken { .. } => Ok(Some(e)),
        e => Err(e),
    }
}

/// A row-only job: claim the row, add 1 to its balance, write it back, under one lease.
async fn row_job(
    repo: &Repository<Account>,
    pool: &sqlx::PgPool,
    lease: &Lease,
    id: i64,
) -> Result<Option<Error>, Error> {
    let step = async {
        let mut account: Account = repo.claim(pool, lease, &id).await?;
        account.balance += 1;
        account.last_holder = lease.owner().to_owned();
        repo.update(pool, lease, &account).await
    };
    match step.await {
        Ok(_) => Ok(None),
        Err(e) => rejection(e),
    }
}

/// A `Fence::check` job: check the resource, insert a ledger row, in one transaction.
async fn check_job(
    fence: &Fence,
    pool: &sqlx::PgPool,
    lease: &Lease,
) -> Result<Option<Error>, Error> {
    let mut tx = pool.begin().await?;
    if let Err(e) = fence.check(&mut *tx, lease.resource(), lease).await {
        return rejection(e);
    }
    sqlx::query("INSERT INTO ledger (resource, token, holder) VALUES ($1, $2, $3)")
        .bind(lease.resource().as_str())
        .bind(lease.token().get())
        .bind(lease.owner())
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(None)
}

async fn acquire(issuer: &RedisIssuer<SentinelConnections>, resource: &Resource) -> Lease {
    issuer
        .acquire(resource, TTL)
        .await
        .expect("acquire")
        .expect("nobody else holds the lock")
}

/// The token part of every row's fence.
async fn row_tokens(pool: &sqlx::PgPool) -> BTreeMap<i64, i64> {
    sqlx::query_as::<_, (i64, i64)>("SELECT id, fence >> 24 FROM accounts ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

async fn setup_db() -> TestDb {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE accounts (id bigint PRIMARY KEY, balance bigint NOT NULL, last_holder text NOT NULL);
         INSERT INTO accounts SELECT i, 0, '' FROM unnest(ARRAY[0, 1, 2, 3, 100]) AS i;
         CREATE TABLE ledger (seq bigserial PRIMARY KEY, resource text NOT NULL, token bigint NOT NULL, holder text NOT NULL);
         -- Every applied row update, in commit order, to check that no fence ever went back.
         CREATE TABLE history (seq bigserial PRIMARY KEY, id bigint, old_fence bigint, new_fence bigint);
         CREATE FUNCTION record_history() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN INSERT INTO history (id, old_fence, new_fence) VALUES (OLD.id, OLD.fence, NEW.fence); RETURN NEW; END $$;",
    )
    .await;
    pgfence::guard::guard(&db.pool, &TableName::parse("accounts").unwrap())
        .await
        .unwrap();
    db.exec(
        "CREATE TRIGGER record_history AFTER UPDATE ON accounts FOR EACH ROW EXECUTE FUNCTION record_history()",
    )
    .await;
    db
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_that_loses_incrs_is_fenced_and_recovers() {
    let Some(sentinel) =
        needs::<Sentinel>("a_sentinel_failover_that_loses_incrs_is_fenced_and_recovers")
    else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(150), failover(sentinel))
        .await
        .expect("the failover test is bounded to 150 s");
}

#[allow(clippy::too_many_lines)]
async fn failover(sentinel: Installed<Sentinel>) {
    let db = setup_db().await;
    let repo = Repository::<Account>::new(db.pool.clone()).unwrap();
    let fence = Fence::new(db.pool.clone());
    let config = SentinelConfig {
        replicas: 1,
        sentinels: 3,
        quorum: 2,
        down_after: Duration::from_millis(1000),
        failover_timeout: Duration::from_secs(3),
    };
    let mut set = SentinelSet::start(sentinel, "pgfence-failover", config)
        .await
        .expect("start master, replica and sentinels");
    let url = set.url();
    let old_master = set.master().port();
    eprintln!(
        "deployment: master 127.0.0.1:{old_master} (pid {:?}), replica 127.0.0.1:{} (pid {:?}), {} sentinels quorum {}, down-after {:?}; {url}",
        set.master().pid(),
        set.replicas()[0].port(),
        set.replicas()[0].pid(),
        config.sentinels,
        config.quorum,
        config.down_after,
    );

    let conns = SentinelConnections::open_with(
        &url,
        NonZeroUsize::new(2).unwrap(),
        Duration::from_secs(10),
    )
    .await
    .expect("connect through the sentinels");
    assert_eq!(
        conns.master_addr().as_deref(),
        Some(format!("127.0.0.1:{old_master}").as_str())
    );
    let issuer = RedisIssuer::new(conns.clone()).with_floor_source(db.pool.clone());
    // A second issuer that waits only 250 ms for a master: it shows what a caller sees while
    // no master is reachable.
    let impatient = RedisIssuer::connect_sentinel_with(
        &url,
        NonZeroUsize::new(1).unwrap(),
        Duration::from_millis(250),
    )
    .await
    .unwrap();

    let rows = unique_resource("failover:rows");
    let checked = unique_resource("failover:check");
    let behind = unique_resource("failover:check-behind");
    let kept = unique_resource("failover:kept");
    let probe = unique_resource("failover:probe");
    let mut before = Tally::default();

    // Phase A: 3 leases the replica receives (tokens 1..=3 of the row resource).
    for (i, &id) in ROWS.iter().take(3).enumerate() {
        let lease = acquire(&issuer, &rows).await;
        assert_eq!(lease.token().get(), i64::try_from(i).unwrap() + 1);
        assert!(
            row_job(&repo, &db.pool, &lease, id)
                .await
                .unwrap()
                .is_none()
        );
        *before.applied.entry(id).or_default() += 1;
        before.tokens.push(lease.token().get());
        issuer.release(&lease).await.unwrap();
        // A Fence::check user whose counter the replica has too (tokens 1..=3).
        let lease = acquire(&issuer, &behind).await;
        assert!(check_job(&fence, &db.pool, &lease).await.unwrap().is_none());
        before.checks_applied += 1;
        issuer.release(&lease).await.unwrap();
    }
    let mut master_conn = redis::Client::open(set.master().url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let acked: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(2000)
        .query_async(&mut master_conn)
        .await
        .unwrap();
    assert_eq!(acked, 1, "the replica has the first three tokens");
    let mut replica_conn = redis::Client::open(set.replicas()[0].url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let replica_counter: i64 = redis::cmd("GET")
        .arg(issuer.counter_key(&rows))
        .query_async(&mut replica_conn)
        .await
        .unwrap();
    assert_eq!(replica_counter, 3, "the replica has the first three tokens");
    drop(replica_conn);

    // Phase B: the replica stops; 20 row leases and 20 check leases on the master only. A
    // stopped process still receives into its socket buffer, so the master also drops its
    // replication link (as a partition would): the replica cannot get those INCRs later.
    set.replicas()[0].pause().unwrap();
    let cut: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .query_async(&mut master_conn)
        .await
        .unwrap();
    assert_eq!(cut, 1, "one replication link cut");
    for j in 0..20 {
        let lease = acquire(&issuer, &rows).await;
        // The first lease the replica misses writes its own row; the others take turns.
        let id = if j == 0 {
            DUP_ROW
        } else {
            ROWS[usize::try_from(lease.token().get()).unwrap() % ROWS.len()]
        };
        assert!(
            row_job(&repo, &db.pool, &lease, id)
                .await
                .unwrap()
                .is_none()
        );
        *before.applied.entry(id).or_default() += 1;
        before.tokens.push(lease.token().get());
        issuer.release(&lease).await.unwrap();

        let lease = acquire(&issuer, &checked).await;
        assert!(check_job(&fence, &db.pool, &lease).await.unwrap().is_none());
        before.checks_applied += 1;
        issuer.release(&lease).await.unwrap();

        let lease = acquire(&issuer, &behind).await;
        assert!(check_job(&fence, &db.pool, &lease).await.unwrap().is_none());
        before.checks_applied += 1;
        issuer.release(&lease).await.unwrap();
    }
    let rows_counter_before = issuer.status(&rows).await.unwrap().counter;
    let check_counter_before = issuer.status(&checked).await.unwrap().counter;
    let high_water_before = pgfence::admin::high_water(&db.pool, &checked)
        .await
        .unwrap();
    let fences_before = row_tokens(&db.pool).await;
    let behind_counter_before = issuer.status(&behind).await.unwrap().counter;
    assert_eq!(
        (
            rows_counter_before,
            check_counter_before,
            behind_counter_before
        ),
        (23, 20, 23)
    );
    // A lease held across the failover (the promoted replica never saw it).
    let mut kept_lease = issuer
        .acquire(&kept, Duration::from_secs(60))
        .await
        .unwrap()
        .unwrap();

    // Phase C: the master dies, the replica comes back and is promoted. One sentinel hangs
    // too (the first one the issuer asks): the others fail over, and the issuer asks them.
    set.sentinels()[0].pause().unwrap();
    let killed_at = Instant::now();
    set.master_mut().kill().unwrap();
    set.replicas()[0].resume().unwrap();

    // While no master is reachable: an impatient caller gets retryable errors only; the
    // issuer's own retries carry an extend across the failover.
    let probing = {
        let impatient = impatient.clone();
        let probe = probe.clone();
        tokio::spawn(async move {
            let (mut retryable, mut other) = (0_u32, Vec::new());
            loop {
                match impatient.acquire(&probe, TTL).await {
                    Ok(Some(lease)) => {
                        impatient.release(&lease).await.unwrap();
                        return (retryable, other, killed_at.elapsed());
                    }
                    Ok(None) => panic!("nobody holds the probe lock"),
                    Err(e) if e.is_retryable() => retryable += 1,
                    Err(e) => other.push(e.to_string()),
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let extending = {
        let issuer = issuer.clone();
        tokio::spawn(async move {
            let state = issuer
                .extend(&mut kept_lease, Duration::from_secs(60))
                .await;
            (state.map_err(|e| e.to_string()), killed_at.elapsed())
        })
    };
    let new_master = set
        .wait_for_new_master(old_master, Duration::from_secs(60))
        .await
        .expect("the sentinels promote the replica");
    let promoted_after = killed_at.elapsed();
    assert_eq!(new_master, set.replicas()[0].port());

    // Phase D: row-only users. The first new lease gets a token Postgres has already seen.
    let mut after = Tally::default();
    let first = acquire(&issuer, &rows).await;
    let first_token_after = first.token().get();
    assert_eq!(
        conns.master_addr().as_deref(),
        Some(format!("127.0.0.1:{new_master}").as_str()),
        "the issuer follows the master"
    );
    assert_eq!(
        first_token_after,
        replica_counter + 1,
        "the promoted replica missed the INCRs"
    );
    assert!(first_token_after <= rows_counter_before);
    // It is the token of the first lease the replica missed, which wrote DUP_ROW under
    // another holder: DuplicateToken, not a write.
    let dup = async {
        let mut account: Account = repo.claim(&db.pool, &first, &DUP_ROW).await?;
        account.balance += 1;
        repo.update(&db.pool, &first, &account).await
    }
    .await
    .unwrap_err();
    assert!(
        matches!(&dup, Error::DuplicateToken { token, target }
            if *token == first_token_after && target.resource() == Some(rows.as_str())),
        "{dup:?}"
    );
    eprintln!("duplicate token detected: {dup}");
    after.count(&dup);
    after.tokens.push(first_token_after);
    // The counter is at this very token already: the next lease is newer than the row.
    issuer.recover_from(&dup).await.unwrap();
    issuer.release(&first).await.unwrap();

    // Row-only workers: write the rows in turn, recovering on each rejection, until every
    // row has accepted a write again.
    let targets: Vec<i64> = ROWS.iter().copied().chain([DUP_ROW]).collect();
    let mut written_again = BTreeSet::new();
    let mut first_row_ok = None;
    let mut turn = 0;
    while written_again.len() < targets.len() {
        assert!(turn < 200, "row writers did not recover");
        let id = targets[turn % targets.len()];
        let lease = acquire(&issuer, &rows).await;
        after.tokens.push(lease.token().get());
        match row_job(&repo, &db.pool, &lease, id).await {
            Ok(None) => {
                *after.applied.entry(id).or_default() += 1;
                first_row_ok.get_or_insert(killed_at.elapsed());
                written_again.insert(id);
                turn += 1;
            }
            // Rejected: raise the counter past what the write met, take a new lease.
            Ok(Some(rejected)) => {
                after.count(&rejected);
                issuer.recover_from(&rejected).await.unwrap();
            }
            Err(e) => panic!("row job failed: {e}"),
        }
        issuer.release(&lease).await.unwrap();
    }
    let rows_recovered_after = killed_at.elapsed();

    // Fence::check users: the promoted replica never had this counter, so the issuer reseeds
    // it from Postgres's high-water mark before handing out the lease.
    let lease = acquire(&issuer, &checked).await;
    assert!(
        lease.token().get() > high_water_before,
        "re-issued above the high-water mark"
    );
    let check_token_after = lease.token().get();
    assert!(check_job(&fence, &db.pool, &lease).await.unwrap().is_none());
    after.checks_applied += 1;
    let check_ok_after = killed_at.elapsed();
    issuer.release(&lease).await.unwrap();
    for _ in 0..5 {
        let lease = acquire(&issuer, &checked).await;
        assert!(check_job(&fence, &db.pool, &lease).await.unwrap().is_none());
        after.checks_applied += 1;
        issuer.release(&lease).await.unwrap();
    }

    // A Fence::check user whose counter the promoted replica has, but behind: the counter is
    // not missing, so nothing reseeds it on acquire; the first check is rejected as stale and
    // recover_from raises the counter past the mark it met.
    let lease = acquire(&issuer, &behind).await;
    let behind_first_token = lease.token().get();
    assert_eq!(behind_first_token, 4, "the replica had tokens 1..=3");
    let stale = check_job(&fence, &db.pool, &lease)
        .await
        .unwrap()
        .expect("a token Postgres has seen is rejected");
    assert!(
        matches!(
            stale,
            Error::StaleToken {
                presented: 4,
                current: 23,
                ..
            }
        ),
        "{stale:?}"
    );
    after.count(&stale);
    issuer.release(&lease).await.unwrap();
    assert!(issuer.recover_from(&stale).await.unwrap());
    let lease = acquire(&issuer, &behind).await;
    let behind_token_after = lease.token().get();
    assert!(check_job(&fence, &db.pool, &lease).await.unwrap().is_none());
    after.checks_applied += 1;
    let behind_ok_after = killed_at.elapsed();
    issuer.release(&lease).await.unwrap();

    let (retryable, other, probe_ok_after) = probing.await.unwrap();
    let (extended, extend_done_after) = extending.await.unwrap();

    // Nothing went back, nothing was lost.
    let went_back: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM history WHERE new_fence <= old_fence OR new_fence >> 24 < old_fence >> 24",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let fences_after = row_tokens(&db.pool).await;
    for (id, token) in &fences_before {
        assert!(
            fences_after[id] >= *token,
            "row {id} went back to an older token"
        );
    }
    let balances: BTreeMap<i64, i64> =
        sqlx::query_as::<_, (i64, i64)>("SELECT id, balance FROM accounts ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    for (id, balance) in &balances {
        let accepted = before.applied.get(id).unwrap_or(&0) + after.applied.get(id).unwrap_or(&0);
        assert_eq!(
            *balance, accepted,
            "row {id}: every accepted write, and only those"
        );
    }
    let ledger: Vec<(String, i64)> =
        sqlx::query_as("SELECT resource, token FROM ledger ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        i64::try_from(ledger.len()).unwrap(),
        before.checks_applied + after.checks_applied
    );
    for resource in [&checked, &behind] {
        let tokens: Vec<i64> = ledger
            .iter()
            .filter(|(r, _)| r == resource.as_str())
            .map(|(_, t)| *t)
            .collect();
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "checked work on {resource} is in token order: {tokens:?}"
        );
    }
    let audited = audit_count(&db.pool).await;

    eprintln!("--- Redis Sentinel failover figures ---");
    eprintln!(
        "row resource: tokens 1..={rows_counter_before} issued before the failover (replica had {replica_counter}); first token after: {first_token_after} (already seen by Postgres)"
    );
    eprintln!(
        "check resource: tokens 1..={check_counter_before} before (replica had none); first lease after: token {check_token_after} (reseeded from high-water {}), 0 rejected",
        high_water_before
    );
    eprintln!(
        "check resource with a counter behind: tokens 1..={behind_counter_before} before (replica had 3); first lease after: token {behind_first_token} rejected as stale, recover_from, then token {behind_token_after} accepted after {behind_ok_after:?}"
    );
    eprintln!(
        "writes accepted before the failover: {} row jobs, {} check jobs",
        before.applied.values().sum::<i64>(),
        before.checks_applied
    );
    eprintln!(
        "after: {} row jobs accepted, {} writes/checks rejected ({} stale, {} duplicate token), {} check jobs accepted; tokens presented by row jobs: {:?}",
        after.applied.values().sum::<i64>(),
        after.rejected(),
        after.stale,
        after.duplicate,
        after.checks_applied,
        after.tokens
    );
    eprintln!(
        "violations: {went_back} (history rows whose fence did not advance); audit rows: {audited}; balances {balances:?}"
    );
    eprintln!(
        "timeline from SIGKILL of the master: promoted after {promoted_after:?}; impatient caller: {retryable} retryable errors, {} other, lock after {probe_ok_after:?}; extend across the failover: {extended:?} after {extend_done_after:?}; first accepted row write {:?}; every row written again {rows_recovered_after:?}; first accepted check {check_ok_after:?}",
        other.len(),
        first_row_ok
    );
    eprintln!(
        "master resolutions by the issuer: {} (sentinel 127.0.0.1:{} hung throughout)",
        conns.resolutions(),
        set.sentinels()[0].port()
    );

    assert_eq!(went_back, 0, "no row ever holds an older token than before");
    assert!(
        other.is_empty(),
        "non-retryable errors during the failover: {other:?}"
    );
    assert_eq!(
        extended,
        Ok(LeaseState::Expired),
        "the extend reached the new master, which never had the lock"
    );
    assert!(after.rejected() >= 1);
    assert_eq!(audited, after.rejected(), "every rejection is audited");
    assert!(conns.resolutions() >= 2);
    assert!(
        rows_recovered_after < Duration::from_secs(30)
            && check_ok_after < Duration::from_secs(30)
            && behind_ok_after < Duration::from_secs(30),
        "liveness came back within 30 s of the master's death"
    );
}

/// A graceful failover (`SENTINEL FAILOVER`): the old master stays up and is demoted to a
/// replica, so the issuer's open connections now reach a replica. Its next write is refused
/// (`READONLY`), which sends the issuer back to the sentinels: the caller sees no error, and
/// the new master (which had every INCR) hands out the next token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_master_sends_the_issuer_back_to_the_sentinels() {
    let Some(sentinel) =
        needs::<Sentinel>("a_demoted_master_sends_the_issuer_back_to_the_sentinels")
    else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(120), demoted_master(sentinel))
        .await
        .expect("the switch-over test is bounded to 120 s");
}

async fn demoted_master(sentinel: Installed<Sentinel>) {
    let set = SentinelSet::start(sentinel, "pgfence-switchover", SentinelConfig::default())
        .await
        .expect("start master, replica and sentinel");
    let old_master = set.master().port();
    let conns = SentinelConnections::open_with(
        &set.url(),
        NonZeroUsize::new(2).unwrap(),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    let issuer = RedisIssuer::new(conns.clone());
    let resource = unique_resource("switchover");
    for expected in 1..=5 {
        let lease = acquire(&issuer, &resource).await;
        assert_eq!(lease.token().get(), expected);
        issuer.release(&lease).await.unwrap();
    }
    let mut master_conn = redis::Client::open(set.master().url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let acked: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(2000)
        .query_async(&mut master_conn)
        .await
        .unwrap();
    assert_eq!(acked, 1);
    let mut replica_conn = redis::Client::open(set.replicas()[0].url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    // WAIT says the replica acknowledged the stream; give it a moment to be readable there
    // (a loaded machine can lag between the acknowledgement and the read).
    let until = Instant::now() + Duration::from_secs(10);
    let on_replica = loop {
        let seen: Option<i64> = redis::cmd("GET")
            .arg(issuer.counter_key(&resource))
            .query_async(&mut replica_conn)
            .await
            .unwrap();
        if seen == Some(5) || Instant::now() > until {
            break seen;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(on_replica, Some(5), "the replica has every INCR");

    let started = Instant::now();
    let reply = set.sentinels()[0]
        .command(&format!("SENTINEL FAILOVER {}", set.name()))
        .unwrap_or_default();
    assert!(reply.starts_with("+OK"), "{reply}");
    let new_master = set
        .wait_for_new_master(old_master, Duration::from_secs(30))
        .await
        .unwrap();
    // Wait until the old master has been turned into a replica (it stays up).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let port = old_master;
        let role = tokio::task::spawn_blocking(move || {
            std::net::TcpStream::connect(("127.0.0.1", port))
                .ok()
                .and_then(|mut s| {
                    use std::io::{Read, Write};
                    s.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
                    s.write_all(b"ROLE\r\n").ok()?;
                    let mut buf = [0u8; 256];
                    let n = s.read(&mut buf).ok()?;
                    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
                })
        })
        .await
        .unwrap()
        .unwrap_or_default();
        if role.contains("$5\r\nslave") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the old master was not demoted: {role}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let demoted_after = started.elapsed();
    assert_eq!(
        conns.master_addr().as_deref(),
        Some(format!("127.0.0.1:{old_master}").as_str()),
        "the issuer has not noticed yet: its connections reach the demoted node"
    );

    // The next acquire meets READONLY on the demoted node, asks the sentinels, and is re-sent
    // (same owner) to the new master.
    let lease = acquire(&issuer, &resource).await;
    assert_eq!(lease.token().get(), 6, "a graceful failover loses no INCR");
    assert_eq!(
        conns.master_addr().as_deref(),
        Some(format!("127.0.0.1:{new_master}").as_str())
    );
    assert_eq!(conns.resolutions(), 2);
    issuer.release(&lease).await.unwrap();
    eprintln!(
        "switch-over: master 127.0.0.1:{old_master} demoted {demoted_after:?} after SENTINEL FAILOVER; the issuer followed to 127.0.0.1:{new_master} on its next acquire (token {}), no error surfaced",
        lease.token().get()
    );
}

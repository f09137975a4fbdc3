//! One lease, many writes: a lease is a session of work. Its holder writes the same row and
//! checks the same resource many times, in many transactions; every older lease stays
//! fenced out; a row claimed before a read cannot be overwritten by a zombie; two leases with
//! the same token are told apart.

use crate::support;

use pgfence::{
    Error, Fence, Fencing, Repository, Resource, repository::Upserted, table::TableName,
};
use support::{TestDb, assert_stale, audit_count, token};

#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
struct Invoice {
    id: i64,
    status: String,
    amount: i64,
}

pgfence::fenced_table!(Invoice { table: "invoices", key: id: i64, columns: [status, amount] });

fn invoice(id: i64, status: &str, amount: i64) -> Invoice {
    Invoice {
        id,
        status: status.into(),
        amount,
    }
}

async fn setup() -> (TestDb, Repository<Invoice>) {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE invoices (id bigint PRIMARY KEY, status text NOT NULL, amount bigint NOT NULL);
         INSERT INTO invoices VALUES (1, 'open', 100), (2, 'open', 200);",
    )
    .await;
    pgfence::guard::guard(&db.pool, &TableName::parse("invoices").unwrap())
        .await
        .unwrap();
    let repo = Repository::new(db.pool.clone()).unwrap();
    (db, repo)
}

fn lease(n: i64, holder: &str) -> Fencing {
    Fencing::new(token(n))
        .holder(holder)
        .resource(Resource::new("billing:run").unwrap())
}

async fn status(db: &TestDb, id: i64) -> Option<String> {
    sqlx::query_scalar("SELECT status FROM invoices WHERE id = $1")
        .bind(id)
        .fetch_optional(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn one_lease_writes_the_same_row_many_times_in_many_transactions() {
    let (db, repo) = setup().await;
    let job = lease(5, "billing-run-1");
    for step in 0..20 {
        let mut tx = db.pool.begin().await.unwrap();
        repo.update(&mut *tx, &job, &invoice(1, &format!("step {step}"), 100))
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    assert_eq!(status(&db, 1).await.as_deref(), Some("step 19"));
    // Every write after the first stepped the lease's sequence once.
    let fence: i64 = sqlx::query_scalar("SELECT fence FROM invoices WHERE id = 1")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let seq = (0..19).fold(0, |s, _| pgfence::token::StoredFence::next_sequence(s));
    assert_eq!(
        fence,
        pgfence::token::StoredFence::lease(job.token, job.tag()).get() + seq
    );
    assert_eq!(audit_count(&db.pool).await, 0);
}

#[tokio::test]
async fn the_old_strict_predicate_rejects_a_lease_s_second_write() {
    // The control: `fence < $token` with the token itself as the fence (the design before
    // leases were sessions) rejects the holder's own second write — what this feature fixes.
    let (db, _) = setup().await;
    // On an unguarded copy: the guard trigger refuses plain tokens as fences.
    db.exec(
        "CREATE TABLE invoices_plain (LIKE invoices INCLUDING ALL);
         INSERT INTO invoices_plain SELECT * FROM invoices;",
    )
    .await;
    let strict = "UPDATE invoices_plain SET status = $1, fence = $2 WHERE id = 1 AND fence < $2";
    let first = sqlx::query(strict)
        .bind("processing")
        .bind(5_i64)
        .execute(&db.pool)
        .await
        .unwrap();
    let second = sqlx::query(strict)
        .bind("paid")
        .bind(5_i64)
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!((first.rows_affected(), second.rows_affected()), (1, 0));
    let status: String = sqlx::query_scalar("SELECT status FROM invoices_plain WHERE id = 1")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(status, "processing");
}

#[tokio::test]
async fn upsert_then_update_then_delete_under_one_lease() {
    let (db, repo) = setup().await;
    let job = lease(3, "job");
    assert_eq!(
        repo.upsert(&db.pool, &job, &invoice(7, "new", 70))
            .await
            .unwrap(),
        Upserted::Inserted
    );
    assert_eq!(
        repo.upsert(&db.pool, &job, &invoice(7, "again", 70))
            .await
            .unwrap(),
        Upserted::Updated
    );
    repo.update(&db.pool, &job, &invoice(7, "paid", 70))
        .await
        .unwrap();
    repo.delete(&db.pool, &job, &7).await.unwrap();
    assert_eq!(status(&db, 7).await, None);
    // An older lease cannot bring it back; the deleting lease can.
    let err = repo
        .upsert(&db.pool, &lease(2, "zombie"), &invoice(7, "zombie", 1))
        .await
        .unwrap_err();
    assert_stale(&err, 2, 3);
    assert_eq!(
        repo.upsert(&db.pool, &job, &invoice(7, "restored", 70))
            .await
            .unwrap(),
        Upserted::Inserted
    );
}

#[tokio::test]
async fn after_a_newer_claim_every_older_write_claim_and_delete_is_rejected() {
    let (db, repo) = setup().await;
    let old = lease(4, "old-holder");
    let new = lease(5, "new-holder");
    // The old lease wrote first, several times.
    repo.update(&db.pool, &old, &invoice(1, "processing", 100))
        .await
        .unwrap();
    repo.update(&db.pool, &old, &invoice(1, "processing 2", 100))
        .await
        .unwrap();
    // The new lease claims the row (and reads it back as the struct).
    let seen: Invoice = repo.claim(&db.pool, &new, &1).await.unwrap();
    assert_eq!(seen, invoice(1, "processing 2", 100));

    let err = repo
        .update(&db.pool, &old, &invoice(1, "zombie", 0))
        .await
        .unwrap_err();
    assert_stale(&err, 4, 5);
    let err = repo
        .claim::<_, Invoice>(&db.pool, &old, &1)
        .await
        .unwrap_err();
    assert_stale(&err, 4, 5);
    let err = repo.delete(&db.pool, &old, &1).await.unwrap_err();
    assert_stale(&err, 4, 5);
    assert_eq!(audit_count(&db.pool).await, 3);
    // The new lease goes on writing.
    repo.update(&db.pool, &new, &invoice(1, "paid", 100))
        .await
        .unwrap();
    repo.update(&db.pool, &new, &invoice(1, "paid twice", 100))
        .await
        .unwrap();
    assert_eq!(status(&db, 1).await.as_deref(), Some("paid twice"));
}

#[tokio::test]
async fn claim_before_read_loses_no_update_to_a_zombie() {
    let (db, repo) = setup().await;
    let zombie = lease(1, "zombie");
    let holder = lease(2, "holder");
    // The zombie read the row long ago; the new holder claims and reads it now...
    let _zombie_read = status(&db, 2).await;
    let mut row: Invoice = repo.claim(&db.pool, &holder, &2).await.unwrap();
    // ...the zombie wakes up and writes between the holder's read and its write...
    let err = repo
        .update(&db.pool, &zombie, &invoice(2, "zombie", 999))
        .await
        .unwrap_err();
    assert!(err.is_stale());
    // ...and the holder's read-modify-write lands on what it read.
    row.amount += 50;
    repo.update(&db.pool, &holder, &row).await.unwrap();
    let amount: i64 = sqlx::query_scalar("SELECT amount FROM invoices WHERE id = 2")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(amount, 250);
}

#[tokio::test]
async fn claim_tells_not_found_from_stale() {
    let (db, repo) = setup().await;
    let err = repo
        .claim::<_, Invoice>(&db.pool, &lease(9, "x"), &404)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err:?}");
    assert_eq!(audit_count(&db.pool).await, 0);
}

#[tokio::test]
async fn a_second_lease_with_the_same_token_is_detected_not_let_through() {
    let (db, repo) = setup().await;
    // Counter loss: two leases were both handed token 6.
    let first = lease(6, "owner-a");
    let twin = lease(6, "owner-b");
    repo.update(&db.pool, &first, &invoice(1, "first", 1))
        .await
        .unwrap();
    let err = repo
        .update(&db.pool, &twin, &invoice(1, "twin", 2))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::DuplicateToken { token: 6, target } if target.resource() == Some("billing:run")),
        "{err:?}"
    );
    assert_eq!(status(&db, 1).await.as_deref(), Some("first"));
    let (presented, current): (i64, Option<i64>) =
        sqlx::query_as("SELECT presented, current FROM pgfence.audit")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((presented, current), (6, Some(6)));
}

#[tokio::test]
async fn a_row_sealed_after_a_lease_wrote_it_rejects_that_lease_and_admits_a_newer_one() {
    let (db, repo) = setup().await;
    let job = lease(8, "job");
    repo.update(&db.pool, &job, &invoice(1, "a", 1))
        .await
        .unwrap();
    // What a bypass or observe mode leaves: the lease's fence, sealed (the owner may write the
    // fence by hand with the trigger disabled; here, the superuser through a disabled trigger).
    db.exec("ALTER TABLE invoices DISABLE TRIGGER pgfence_guard")
        .await;
    sqlx::query("UPDATE invoices SET fence = $1 WHERE id = 1")
        .bind(job.fence()) // the lease's fence, sealed
        .execute(&db.pool)
        .await
        .unwrap();
    db.exec("ALTER TABLE invoices ENABLE TRIGGER pgfence_guard")
        .await;
    let before = audit_count(&db.pool).await;
    let err = repo
        .update(&db.pool, &job, &invoice(1, "b", 1))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::RowSealed { token: 8, .. }), "{err:?}");
    assert_eq!(
        audit_count(&db.pool).await,
        before + 1,
        "audited like any stale write"
    );
    assert_eq!(status(&db, 1).await.as_deref(), Some("a"));
    repo.update(&db.pool, &lease(9, "next"), &invoice(1, "c", 1))
        .await
        .unwrap();
    assert_eq!(status(&db, 1).await.as_deref(), Some("c"));
}

#[tokio::test]
async fn resource_checks_and_row_writes_share_the_lease_across_transactions() {
    // The multi-step job: check the batch resource in each transaction, write rows.
    let (db, repo) = setup().await;
    let fence = Fence::new(db.pool.clone());
    let batch = Resource::new("billing:run").unwrap();
    let job = lease(11, "run-11");
    for id in [1, 2] {
        let mut tx = db.pool.begin().await.unwrap();
        fence.check(&mut *tx, &batch, &job).await.unwrap();
        let mut row: Invoice = repo.claim(&mut *tx, &job, &id).await.unwrap();
        row.status = "paid".into();
        repo.update(&mut *tx, &job, &row).await.unwrap();
        tx.commit().await.unwrap();
    }
    // A zombie with an older lease fails at the check, in any transaction.
    let mut tx = db.pool.begin().await.unwrap();
    let err = fence
        .check(&mut *tx, &batch, &lease(10, "zombie"))
        .await
        .unwrap_err();
    assert_stale(&err, 10, 11);
}

/// Rows written under more than one resource: without a shared counter the tokens do not
/// compare, and the rejection says so; in one fencing domain they do.
#[tokio::test]
async fn resources_that_write_the_same_rows_share_a_fencing_domain() {
    let (db, repo) = setup().await;
    let issuer = support::issuer().await;
    let ttl = std::time::Duration::from_secs(5);
    // Fixed names (their 4-bit counter hashes differ, which the flag relies on), fresh keys.
    let name = |s: &str| format!("lease-session-test:{s}");
    let account = Resource::new(name("billing:account:2")).unwrap();
    let report = Resource::new(name("reports:daily")).unwrap();
    let domain = name("billing");
    let in_domain = |n: &str| Resource::in_domain(&domain, n).unwrap();
    let client = redis::Client::open(support::redis_url().await).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    for r in [
        &account,
        &report,
        &in_domain("account:2"),
        &in_domain("reports:daily"),
    ] {
        let _: () = redis::cmd("DEL")
            .arg(pgfence::issuer::redis::lock_key(r))
            .arg(pgfence::issuer::redis::counter_key(r))
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let tag = |r: &Resource| Fencing::new(token(1)).resource(r.clone()).tag() >> 8;
    assert_ne!(
        tag(&account),
        tag(&report),
        "precondition: counter hashes differ"
    );

    // Two counters: the account lock has issued 11 tokens, the report lock 1.
    issuer.raise_floor(&account, 10).await.unwrap();
    let a = issuer.acquire(&account, ttl).await.unwrap().unwrap();
    let r = issuer.acquire(&report, ttl).await.unwrap().unwrap();
    assert_eq!((a.token().get(), r.token().get()), (11, 1));
    repo.update(&db.pool, &a, &invoice(1, "account job", 1))
        .await
        .unwrap();
    let err = repo
        .update(&db.pool, &r, &invoice(1, "report job", 1))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::StaleToken {
                presented: 1,
                current: 11,
                other_counter: true,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("fencing domain"), "{err}");
    let flagged: bool = sqlx::query_scalar("SELECT other_counter FROM pgfence.audit")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(
        flagged,
        "the audit row says the current token came from another counter"
    );
    issuer.release(&a).await.unwrap();
    issuer.release(&r).await.unwrap();

    // One domain: separate locks, one counter, so tokens compare across the two jobs.
    let account = in_domain("account:2");
    let report = in_domain("reports:daily");
    let a = issuer.acquire(&account, ttl).await.unwrap().unwrap();
    let r = issuer.acquire(&report, ttl).await.unwrap().unwrap();
    assert_eq!(r.token().get(), a.token().get() + 1, "one counter");
    assert_ne!(
        pgfence::issuer::redis::lock_key(&account),
        pgfence::issuer::redis::lock_key(&report)
    );
    assert_eq!(
        pgfence::issuer::redis::counter_key(&account),
        pgfence::issuer::redis::counter_key(&report)
    );
    repo.update(&db.pool, &a, &invoice(2, "account job", 1))
        .await
        .unwrap();
    repo.update(&db.pool, &r, &invoice(2, "report job", 1))
        .await
        .unwrap();
    // And the older of the two is now fenced out, as within one resource.
    assert!(
        repo.update(&db.pool, &a, &invoice(2, "late account job", 1))
            .await
            .unwrap_err()
            .is_stale()
    );
    issuer.release(&a).await.unwrap();
    issuer.release(&r).await.unwrap();
}
